"""Probes: cheap checks, run on a mapped cache before it is served, that predict whether serving it will change the
target's answer. One file per probe, each one class registered in `PROBES` (`base.register_probe`); the shared
context and base class are in `base`."""

from ...deprecation import deprecated_names
from ...request_context import RequestContext
from .base import PROBES, Probe, _ProbeContext, probe_from_dict, register_probe
from .confident_draft import ConfidentDraftProbe
from .draft_agreement import DraftAgreementProbe
from .linear import LinearProbe, fit_linear_probe
from .lookahead_margin import LookaheadMarginProbe
from .prefix_audit import PrefixAuditProbe
from .tail_nll import TailNLLProbe

__all__ = [
    "PROBES",
    "ConfidentDraftProbe",
    "DraftAgreementProbe",
    "LinearProbe",
    "LookaheadMarginProbe",
    "PrefixAuditProbe",
    "Probe",
    "RequestContext",
    "TailNLLProbe",
    "fit_linear_probe",
    "probe_from_dict",
    "register_probe",
]

#: the probe context before one context served every scorer (deprecated, goes in 0.2)
__getattr__ = deprecated_names(
    __name__, globals(), {"ProbeContext": ("hf_kvmap.request_context.RequestContext", _ProbeContext)}
)
