"""Serving: a request through the one pipeline (`pipeline`: map, repair, held-back tokens, probe, a rung per row, the
report; a session's switch as a span request, `spans`), its front doors (`handoff`, `HandoffSession`), the guard
ladder as data (`ladder`) and the probes (`probes/`, one file each). The repair it serves goes through
`hf_kvmap.repair.apply_repair`, the one door to the recompute."""

from .handoff import HandoffRefusedError, HandoffReport, handoff
from .ladder import FALLBACK, GuardLadder, LadderRung, rung_name
from .probes import PROBES, Probe, ProbeContext, probe_from_dict, register_probe
from .session import HandoffSession, SessionTurn

__all__ = [
    "FALLBACK",
    "PROBES",
    "GuardLadder",
    "HandoffRefusedError",
    "HandoffReport",
    "HandoffSession",
    "LadderRung",
    "Probe",
    "ProbeContext",
    "SessionTurn",
    "handoff",
    "probe_from_dict",
    "register_probe",
    "rung_name",
]
