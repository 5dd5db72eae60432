"""A ladder's sparse rung on a one-row request: the target prefills the positions the ladder's strategy selects,
alone and at their original positions (`hf_kvmap.repair.sparse_prefill`), in place of the mapped cache."""

from __future__ import annotations

from typing import Any

import torch

from ..repair import RepairConfig, SparseCache, select_repair, sparse_prefill
from .forwards import run_tokens
from .probes import RequestContext


def can_serve_sparse(context: RequestContext) -> bool:
    """A sparse prefill serves one row without padding (rows select different positions; the layout has no slot for
    the ones a row skips), and not a session's switch (its positions before the span are the target's own)."""
    one_row = context.input_ids.shape[0] == 1 and context.span_start is None
    return one_row and bool(context.attention_mask.bool().all())


@torch.no_grad()
def serve_sparse(context: RequestContext, fraction: float, strategy: dict[str, Any] | str) -> tuple[SparseCache, int]:
    """The sparse rung of `context`'s one row: `(cache of its first T - 1 tokens, positions prefilled)`; the
    held-back tokens the probe ran are run again on it, as on a repaired cache."""
    ids, length = context.input_ids, context.input_ids.shape[1]
    mapped = length - context.hold_back
    draft = context.drafts.get("source")
    positions, valid = select_repair(
        context.target,
        ids,
        RepairConfig(strategy, fraction=fraction),
        length=mapped,
        cache=context.cache,
        attention_mask=context.attention_mask,
        position_ids=context.position_ids,
        source=context.source,
        source_cache=context.source_cache,
        source_position_ids=context.source_position_ids,
        source_draft=draft,
    )
    chosen = positions[0][valid[0]]
    if chosen.numel() == 0:  # a budget that rounds to nothing: the first position keeps the cache defined
        chosen = torch.zeros(1, dtype=torch.long, device=ids.device)
    cache = sparse_prefill(context.target, ids, chosen, length=mapped)
    if mapped < length - 1:
        run_tokens(context.target, cache, ids, mapped, length - 1, context.attention_mask, context.position_ids)
    return cache, int(chosen.numel())


__all__ = ["can_serve_sparse", "serve_sparse"]
