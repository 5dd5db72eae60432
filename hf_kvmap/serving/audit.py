"""The exactness audit: how far a served cache is from the target's own, on the first layer at every position and on
every layer at the first tokens (what `handoff` certifies an exact mapping with)."""

from __future__ import annotations

from transformers.cache_utils import Cache

from ..input_checks import first_layer_error
from ..rope import positions_from_attention_mask
from .probes import RequestContext
from .probes.prefix_audit import PrefixAuditProbe


def first_layer_audit(target, context: RequestContext) -> float:
    """The worst relative error of the cache's first layer against the one `target` computes from the prompt's ids,
    over every cached position (real tokens only)."""
    layer = context.cache.layers[0]
    seq = layer.keys.shape[2]
    ids, positions, mask = context.input_ids[:, :seq], context.position_ids[:, :seq], context.attention_mask[:, :seq]
    return float(first_layer_error(target, ids, positions, mask, layer.keys, layer.values).max())


def exactness_error(target, input_ids, attention_mask, cache: Cache, *, audit_tokens: int = 8) -> float:
    """The audit `handoff` certifies exactness with, for a cache of the first `T - 1` tokens of `input_ids`: every
    layer on the first `audit_tokens` tokens, and the first layer at every position (relative error, worst)."""
    positions = positions_from_attention_mask(attention_mask, *input_ids.shape, input_ids.device)
    context = RequestContext(
        target=target, input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, cache=cache
    )
    return max(PrefixAuditProbe(audit_tokens).score(context).max().item(), first_layer_audit(target, context))


__all__ = ["exactness_error", "first_layer_audit"]
