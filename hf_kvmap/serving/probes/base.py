"""Probes: cheap checks, run on a mapped cache before it is served, that predict whether the handoff will change the
target's answer.

A probe reads a [`ProbeContext`] (the models, the prompt, the target-side cache of every prompt token but the last)
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

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers.cache_utils import Cache

from ..._compat import cache_kwargs
from ...drafting import Draft
from ...registry import registrar
from ...scoring import Scorer, from_settings
from ...validation import check_int

#: name -> probe class; filled by `register_probe`.
PROBES: dict[str, type[Probe]] = {}


#: Class decorator adding a [`Probe`] subclass to `PROBES` under its `name`.
register_probe = registrar(PROBES, "a probe")


@dataclass
class ProbeContext:
    r"""
    What a probe may read. Built by `handoff` after the mapping and before the decision.

    Args:
        source, target (`PreTrainedModel`): the two causal LMs.
        input_ids (`torch.Tensor`): `(batch, T)` prompt (left padding allowed).
        attention_mask (`torch.Tensor`): `(batch, T)`, ones where there is a token.
        position_ids (`torch.Tensor`): `(batch, T)` positions derived from the mask as `generate` does.
        cache (`Cache`): the target-side cache of the first `T - 1` tokens: the mapped `T - hold_back` tokens, then the
            `hold_back - 1` tokens the target ran itself.
        source_cache (`Cache`): the source's cache of all `T` prompt tokens.
        hold_back (`int`): how many final prompt tokens were held back from the mapping.
        tail_logits (`torch.Tensor`, *optional*): `(batch, hold_back - 1, vocab)` target logits on the held-back
            tokens it ran (they predict the tokens at columns `T - hold_back + 1 .. T - 1`); `None` for `hold_back=1`.
        drafts (`dict[str, Draft]`): the greedy drafts decoded for this request so far, by role (`draft`).
        source_position_ids (`torch.Tensor`, *optional*): `(batch, T)` positions `source_cache` was built at (a
            plain forward's `0 .. T-1` differ from `position_ids` in left-padded rows); defaults to `position_ids`.
        span_start (`int`, *optional*): a session's switch (`hf_kvmap.serving.spans`): the first mapped position of
            its one row, the positions before it being the target's own; `None` for a request whose whole prompt
            but the held-back tokens was mapped.
    """

    source: torch.nn.Module
    target: torch.nn.Module
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    cache: Cache
    source_cache: Cache
    hold_back: int = 1
    tail_logits: torch.Tensor | None = None
    drafts: dict[str, Draft] = field(default_factory=dict)
    source_position_ids: torch.Tensor | None = None
    span_start: int | None = None

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]

    def draft(self, role: str) -> Draft:
        """The greedy draft of the `"source"` (on `source_cache`) or of the `"target"` (on the mapped `cache`) after
        the prompt ([`~hf_kvmap.repair.Draft`]), decoded once per request as far as its readers ask: the probes, and
        then a repair strategy that drafts (`draft_attention` continues the source's)."""
        if role not in ("source", "target"):
            raise ValueError(f"role={role!r}: a draft is the 'source''s or the 'target''s.")
        if role not in self.drafts:
            if role == "source":
                positions = self.position_ids if self.source_position_ids is None else self.source_position_ids
                model, cache = self.source, self.source_cache
            else:
                positions, model, cache = self.position_ids, self.target, self.cache
            self.drafts[role] = Draft(model, cache, self.input_ids, self.attention_mask, positions)
        return self.drafts[role]

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]


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

    def risks(self, context: ProbeContext) -> torch.Tensor:
        """`score(context)` checked, one float32 risk per row, `(batch,)`: what the pipeline decides from."""
        return self.checked_scores(context, (context.batch,), "(batch,)").float()

    def target_tokens(self, length: int) -> int:
        """Tokens the target processes for this probe beyond what serving needs anyway, at prompt length `length`."""
        return self.tokens

    def score(self, context: ProbeContext) -> torch.Tensor:
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


__all__ = ["PROBES", "Probe", "ProbeContext", "extend_mask", "probe_from_dict", "register_probe", "run_appended"]
