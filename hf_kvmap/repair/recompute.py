"""The recompute: selected cached positions run through every target layer in one forward of the target's own modules
and attention implementation, each attending to the cache of the positions before it, and their keys/values replace
the cached ones.

The forward reads the cache through [`RecomputeLayer`]s: when a layer's attention computes the new keys/values of the
selected positions, the layer writes them into those positions' slots (out of place) and hands the whole layer to
attention. So a selected position reads the cache of the unselected positions before it and the recomputed keys/values
of the selected ones before it (and its own), and the attention mask is the plain causal-and-padding mask of the cache
restricted to the selected query rows: `(batch, 1, n, length)`, boolean for `sdpa`, additive for `eager`. Recomputing
every position is the target's own prefill; recomputing a suffix is a crop and a re-prefill of that suffix.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .._compat import attention_implementation, cache_kwargs
from ..packed_attention import PACKED_SDPA

#: attention implementations that take a custom 4-D mask, and the mask each takes
MASK_KINDS = {"sdpa": "bool", "eager": "additive", PACKED_SDPA: "bool"}


class RecomputeLayer(DynamicLayer):
    """A cache layer for one recompute forward: `update` writes the states the model computes for `index` (`(batch,
    n)` positions) into those slots of the stored keys/values and returns the whole layer. It follows the dtype and
    device of the states it is given (as `MappedLayer` does)."""

    @classmethod
    def wrap(cls, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor) -> RecomputeLayer:
        layer = cls()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values, layer.index = keys, values, index
        return layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        device, dtype = key_states.device, key_states.dtype
        keys, values = self.keys.to(device, dtype), self.values.to(device, value_states.dtype)
        index = self.index.to(device)[:, None, :, None]
        self.keys = keys.scatter(2, index.expand(-1, key_states.shape[1], -1, key_states.shape[3]), key_states)
        self.values = values.scatter(
            2, index.expand(-1, value_states.shape[1], -1, value_states.shape[3]), value_states
        )
        self.device = device
        return self.keys, self.values


def query_mask(positions: torch.Tensor, valid: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    r"""
    `(batch, 1, n, length)` bool: what the query of each selected position may read.

    A selected position `p` reads every token slot `j <= p` (`token_mask == 1`); a filler slot (`valid == False`, a
    padding slot that only fills the batch) reads only itself, so its softmax is defined and nothing reads it.
    """
    slots = torch.arange(token_mask.shape[1], device=positions.device)
    causal = (slots[None, None, :] <= positions[:, :, None]) & token_mask.bool()[:, None, :]
    itself = slots[None, None, :] == positions[:, :, None]
    return torch.where(valid[:, :, None], causal, itself).unsqueeze(1)


def _mask_for(model, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    implementation = attention_implementation(model)
    kind = MASK_KINDS.get(implementation)
    if kind is None:
        raise ValueError(
            f"Repair runs the target with a custom 4-D attention mask, which attn_implementation={implementation!r} "
            f"does not take. Load the target with attn_implementation='sdpa' (or one of {sorted(MASK_KINDS)})."
        )
    if kind == "bool":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


@torch.no_grad()
def recompute_positions(
    target,
    cache: Cache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    *,
    token_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> Cache:
    r"""
    Recompute the keys/values of `positions` of `cache` through every layer of `target`, in place of the cached ones.

    Args:
        target (`PreTrainedModel`): the causal LM the cache belongs to (`eager` or `sdpa` attention).
        cache (`Cache`): its cache of the first `length` prompt tokens; its layers' tensors are replaced.
        input_ids (`torch.Tensor`): `(batch, T)` prompt ids, `T >= length`.
        positions (`torch.Tensor`): `(batch, n)` cached slots to recompute (distinct per row; see `select_positions`).
        valid (`torch.Tensor`): `(batch, n)` bool, `False` on filler slots (left padding that fills the batch).
        token_mask (`torch.Tensor`): `(batch, length)` 1 on tokens, 0 on left padding.
        position_ids (`torch.Tensor`): `(batch, length)` positions the target reads the cache at.

    Returns:
        `cache`, with the recomputed slots.
    """
    if positions.shape[1] == 0:
        return cache
    embed = target.get_input_embeddings().weight
    device = embed.device
    positions, valid = positions.to(device), valid.to(device)
    ids = input_ids.to(device).gather(1, positions)
    pos = position_ids.to(device).gather(1, positions)
    allowed = query_mask(positions, valid, token_mask.to(device))
    dtype = next(p for p in target.parameters() if p.is_floating_point()).dtype
    mask = _mask_for(target, allowed, dtype)
    layers = [RecomputeLayer.wrap(layer.keys, layer.values, positions) for layer in cache.layers]
    work = Cache(layers=layers)
    target.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **cache_kwargs(work))
    for layer, done in zip(cache.layers, layers):
        layer.keys, layer.values = done.keys, done.values
        layer.device = done.keys.device
        if hasattr(layer, "dtype"):
            layer.dtype = done.keys.dtype
    return cache


__all__ = ["MASK_KINDS", "RecomputeLayer", "query_mask", "recompute_positions"]
