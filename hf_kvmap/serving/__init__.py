"""Serving: a request through the one pipeline (`pipeline`: map, repair, held-back tokens, probe, a rung per row, the
report; a session's switch as a span request, `spans`), its front doors (`handoff`, `HandoffSession`), the guard
ladder as data (`ladder`) and the probes (`probes/`, one file each). The repair it serves goes through
`hf_kvmap.repair.apply_repair`, the one door to the recompute."""

from ..deprecation import deprecated_names
from ..request_context import RequestContext
from .handoff import HandoffRefusedError, HandoffReport, handoff
from .ladder import FALLBACK, GuardLadder, LadderRung, rung_name
from .probes import PROBES, Probe, probe_from_dict, register_probe
from .probes.base import _ProbeContext
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
    "RequestContext",
    "SessionTurn",
    "handoff",
    "probe_from_dict",
    "register_probe",
    "rung_name",
]

#: the probe context before one context served every scorer (deprecated, goes in 0.2)
__getattr__ = deprecated_names(
    __name__, globals(), {"ProbeContext": ("hf_kvmap.request_context.RequestContext", _ProbeContext)}
)
