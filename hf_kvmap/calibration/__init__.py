"""Calibrating the guard on measured items: a probe's threshold (`probe_thresholds`), the guard ladder with its
confidence bound (`ladder`), measuring every rung of the ladder on items through the serving pipeline
(`ladder_items`), choosing and replaying ladders from those records (`ladder_records`), and what is measured for
records after them, kept beside them (`ladder_side`: strategies added later; the migration of records measured before
their answer margins and the source's own answers were, is the repository lab's `lab.ladder_migration`)."""

from .ladder import calibrate_ladder, changed_budget, changed_upper_bound, items_to_vouch, ladder_outcome
from .ladder_items import LadderItem, measure_ladder_items
from .ladder_records import ladder_from_records, replay_ladder
from .probe_thresholds import calibrate_probe

__all__ = [
    "LadderItem",
    "calibrate_ladder",
    "calibrate_probe",
    "changed_budget",
    "changed_upper_bound",
    "items_to_vouch",
    "ladder_from_records",
    "ladder_outcome",
    "measure_ladder_items",
    "replay_ladder",
]
