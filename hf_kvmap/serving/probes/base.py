"""Probes: cheap checks, run on a mapped cache before it is served, that predict whether the handoff will change the
target's answer.

A probe reads a [`RequestContext`] (the models, the prompt, the target-side cache of every prompt token but the last)
and returns one *risk* per row: higher means the answer generated on the mapped cache is more likely to differ from
the one the target would give after its own prefill. [`handoff`](hf_kvmap.serving.handoff.handoff) compares the risk with a
threshold calibrated for the mapper (stored in `MapperConfig.handoff_probe`). A probe leaves both caches as it found
them (same length, same contents).

A new probe is one class and one line:

```python
>>> from hf_kvmap.serving.probes import Probe, register_probe
>>> @register_probe
... class Zero(Probe):
...     name = "zero"
...
...     def score(self, context):
...         return context.input_ids.new_zeros(context.input_ids.shape[0], dtype=torch.float32)
```
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..._compat import cache_kwargs
from ...deprecation import deprecated_names
from ...registry import registrar
from ...request_context import RequestContext, legacy_context
from ...scoring import Scorer, from_settings
from ...validation import check_int

#: name -> probe class; filled by `register_probe`.
PROBES: dict[str, type[Probe]] = {}


#: Class decorator adding a [`Probe`] subclass to `PROBES` under its `name`.
register_probe = registrar(PROBES, "a probe")


#: the old probe context, `(source, target, input_ids, attention_mask, position_ids, cache, source_cache, ...)`
_ProbeContext = legacy_context(
    "ProbeContext",
    ("source", "target", "input_ids", "attention_mask", "position_ids", "cache", "source_cache", "hold_back")
    + ("tail_logits", "drafts", "source_position_ids", "span_start"),
)


class Probe(Scorer):
    r"""
    Base class of the probes, on the one scoring contract ([`~hf_kvmap.scoring.Scorer`]). Subclasses set `name` (the
    registry key) and implement `score`: one float per row, higher meaning the mapped cache is more likely to change
    the answer (its risk). The base checks them ([`risks`]); the serving pipeline decides from them.

    Args:
        tokens (`int`, *optional*, defaults to the class's `default_tokens`): the probe's size (what it counts depends
            on the probe; `target_tokens` turns it into the number of tokens the target runs).
    """

    kind: ClassVar[str] = "probe"
    #: tokens a probe reads by default
    default_tokens: ClassVar[int] = 4
    #: whether an exact mapping (the target's own cache, source = target) scores 0 by construction
    exact_scores_zero: ClassVar[bool] = False

    def __init__(self, tokens: int | None = None):
        tokens = self.default_tokens if tokens is None else tokens
        check_int(f"{type(self).__name__}: tokens", tokens, 1)
        self.tokens = tokens

    @property
    def hold_back(self) -> int:
        """Final prompt tokens the mapping must leave to the target (1: only the last one, as `from_source`)."""
        return 1

    def settings(self) -> dict[str, Any]:
        """What `probe_from_dict` needs to rebuild this probe."""
        return {"name": self.name, "tokens": self.tokens}

    def risks(self, context: RequestContext) -> torch.Tensor:
        """`score(context)` checked, one float32 risk per row, `(batch,)`: what the pipeline decides from."""
        return self.checked_scores(context, (context.batch,), "(batch,)").float()

    def target_tokens(self, length: int) -> int:
        """Tokens the target processes for this probe beyond what serving needs anyway, at prompt length `length`."""
        return self.tokens

    def score(self, context: RequestContext) -> torch.Tensor:
        """`(batch,)` float risks; higher means the handoff is more likely to change the answer."""
        raise NotImplementedError


def probe_from_dict(settings: Probe | dict[str, Any] | str) -> Probe:
    """Build a registered probe from `{"name": ..., "tokens": ...}` (or just its name); a `Probe` is returned as is."""
    if isinstance(settings, Probe):
        return settings
    if isinstance(settings, str):
        settings = {"name": settings}
    return from_settings(PROBES, settings, Probe, "probes")


def extend_mask(mask: torch.Tensor, extra: int) -> torch.Tensor:
    """`mask` `(batch, T)` with `extra` columns of ones appended (tokens a probe runs after the prompt)."""
    return torch.cat([mask, mask.new_ones(mask.shape[0], extra)], dim=1)


@torch.no_grad()
def run_appended(model, ids, cache, mask, positions) -> torch.Tensor:
    """Logits of `ids` `(batch, n)` appended to `cache`; `mask` covers cache + ids; `positions` `(batch, n)`."""
    return model(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache_kwargs(cache)
    ).logits.float()


__all__ = ["PROBES", "Probe", "RequestContext", "extend_mask", "probe_from_dict", "register_probe", "run_appended"]

#: the probe context before one context served every scorer (deprecated, goes in 0.2)
__getattr__ = deprecated_names(
    __name__, globals(), {"ProbeContext": ("hf_kvmap.request_context.RequestContext", _ProbeContext)}
)
