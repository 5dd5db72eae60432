"""The one place a served cache is repaired: the target recomputes the positions a [`~hf_kvmap.repair.RepairConfig`]
selects ([`~hf_kvmap.repair.repair_cache`]). The request pipeline (`hf_kvmap.serving.pipeline`: a handoff's fixed
repair, a ladder's repairing rungs, a session's switch) and `MappedCache.from_source(..., repair=)` all call
[`apply_repair`]; it sits with the cache and repair layer so that the cache can reach it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..drafting import Draft
from ..repair import RepairConfig, repair_cache
from ..repair.base import budget_counts
from ..repair.repair import candidate_positions


@torch.no_grad()
def apply_repair(
    target,
    cache: Cache,
    input_ids: torch.Tensor,
    repair: RepairConfig,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    source=None,
    source_cache=None,
    source_position_ids: torch.Tensor | None = None,
    source_draft: Draft | None = None,
    start: int = 0,
) -> list[int]:
    r"""
    Have `target` recompute the positions `repair` selects of `cache` (in place), and return how many it recomputed
    per row. The arguments are [`~hf_kvmap.repair.repair_cache`]'s; `repair` is a `RepairConfig` (the callers convert
    a dict once, where it comes in).
    """
    if not isinstance(repair, RepairConfig):
        raise TypeError(f"apply_repair takes a RepairConfig (convert with `RepairConfig.from_dict`); got {repair!r}.")
    repair_cache(
        target,
        cache,
        input_ids,
        repair,
        attention_mask=attention_mask,
        position_ids=position_ids,
        source=source,
        source_cache=source_cache,
        source_position_ids=source_position_ids,
        source_draft=source_draft,
        start=start,
    )
    candidates = candidate_positions(input_ids, attention_mask, cache.get_seq_length(), start)
    return budget_counts(candidates, repair.fraction, repair.tokens)


__all__ = ["apply_repair"]
