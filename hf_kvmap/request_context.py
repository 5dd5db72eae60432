"""`RequestContext`: one request as it goes through the pipeline, the one object every stage and every scorer reads.

The caller's part (the models, the mapper, the prompt, a given source cache) is what `handoff` checks; each stage adds
its part (the positions, the target-side cache, the held-back tokens' logits, the drafts decoded so far, a repair's
candidates), and the probes and the repair strategies read the same object (`hf_kvmap.scoring`). It replaces three
classes that carried the same fields: `hf_kvmap.serving.pipeline.Request`, `hf_kvmap.serving.probes.ProbeContext`
and `hf_kvmap.repair.RepairContext`, whose names resolve to [`legacy_context`] subclasses until 0.2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from .drafting import Draft


@dataclass(kw_only=True)
class RequestContext:
    r"""
    One batch of requests and what the pipeline knows of it so far. Every field is a keyword.

    Args:
        source, target (`PreTrainedModel`, *optional*): the model the cache is mapped from and the one that reads it.
        mapper ([`MapperModel`], *optional*): fitted for them.
        input_ids (`torch.Tensor`): `(batch, T)` prompt (left padding allowed).
        attention_mask (`torch.Tensor`, *optional*): `(batch, T)`, ones where there is a token (a stage fills it).
        position_ids (`torch.Tensor`, *optional*): `(batch, T)` positions the target reads the prompt at, derived
            from the mask as `generate` does.
        cache (`Cache`, *optional*): the target-side cache: the first `T - 1` tokens for a probe (the mapped
            `T - hold_back`, then the `hold_back - 1` the target ran itself), the first `cached_length` for a repair.
        source_cache (`Cache`, *optional*): the source's cache of all `T` prompt tokens.
        source_position_ids (`torch.Tensor`, *optional*): `(batch, T)` positions `source_cache` was built at (a plain
            forward's `0 .. T-1` differ from `position_ids` in left-padded rows).
        hold_back (`int`, *optional*, defaults to 1): final prompt tokens held back from the mapping.
        tail_logits (`torch.Tensor`, *optional*): `(batch, hold_back - 1, vocab)` target logits on the held-back tokens
            it ran (they predict the tokens at columns `T - hold_back + 1 .. T - 1`); `None` for `hold_back=1`.
        drafts (`dict[str, Draft]`, *optional*): the greedy drafts decoded for this request so far, by role (`draft`).
        span_start (`int`, *optional*): a session's switch (`hf_kvmap.serving.spans`): the first mapped position of
            its one row, the positions before it being the target's own.
        candidates (`torch.Tensor`, *optional*): `(batch, cached_length)` bool, the cached positions a repair
            strategy may choose (the real tokens, from the repair's `start` on).
        tokenizer (*optional*): checked against the mapper's fingerprint by the gate.
        target_first_layer (`bool`, *optional*, defaults to `False`): the target computes its first layer.
        same_weights (`bool`, *optional*, defaults to `False`): the gate does not compare model ids.
    """

    source: Any = None
    target: Any = None
    mapper: Any = None
    input_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    cache: Cache | None = None
    source_cache: Any = None
    source_position_ids: torch.Tensor | None = None
    hold_back: int = 1
    tail_logits: torch.Tensor | None = None
    drafts: dict[str, Draft] = field(default_factory=dict)
    span_start: int | None = None
    candidates: torch.Tensor | None = None
    tokenizer: Any = None
    target_first_layer: bool = False
    same_weights: bool = False

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt_length(self) -> int:
        """`T`, the prompt's tokens."""
        return self.input_ids.shape[1]

    @property
    def cached_length(self) -> int:
        """The cached positions a repair strategy scores (the candidates' width)."""
        return self.candidates.shape[1]

    @property
    def length(self) -> int:
        """What a scorer's scores are about: the cached positions (`cached_length`) where the context has a repair's
        candidates, else the prompt (`prompt_length`), as the strategies and the probes have always read it."""
        return self.cached_length if self.candidates is not None else self.prompt_length

    @property
    def source_draft(self) -> Draft | None:
        """The source's greedy draft after the prompt, as far as the request decoded it (a probe's): a strategy that
        drafts continues it."""
        return self.drafts.get("source")

    def draft(self, role: str) -> Draft:
        """The greedy draft of the `"source"` (on `source_cache`) or of the `"target"` (on the mapped `cache`) after
        the prompt ([`~hf_kvmap.drafting.Draft`]), decoded once per request as far as its readers ask: the probes, and
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


def legacy_context(name: str, order: tuple[str, ...]) -> type[RequestContext]:
    """A [`RequestContext`] subclass named `name` that also takes its old positional arguments (`order`) and an old
    `source_draft=` (kept in `drafts`): what the names of the three classes it replaces resolve to until 0.2."""

    def __init__(self, *args, **kwargs):
        if len(args) > len(order):
            raise TypeError(f"{name}() takes {len(order)} positional arguments but {len(args)} were given")
        for key, value in zip(order, args):
            if key in kwargs:
                raise TypeError(f"{name}() got multiple values for argument {key!r}")
            kwargs[key] = value
        source_draft = kwargs.pop("source_draft", None)
        if source_draft is not None:
            kwargs["drafts"] = {**kwargs.get("drafts", {}), "source": source_draft}
        RequestContext.__init__(self, **kwargs)

    doc = f"Deprecated (goes in 0.2): a [`RequestContext`], which `{name}`'s positional order builds too."
    return type(name, (RequestContext,), {"__init__": __init__, "__doc__": doc, "__module__": __name__})


__all__ = ["RequestContext", "legacy_context"]
