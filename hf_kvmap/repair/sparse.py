"""The sparse prefill: the map-free rung a repair is measured against.

The target prefills only the positions a repair strategy selects, at their original positions, and nothing else: no
mapped cache surrounds them (what SpecPrefill does with a small model's attention). A repair with the same selection
differs from it in one thing only, the mapped keys/values of the positions it does not recompute, so the two served
side by side measure what the map adds.

```python
from hf_kvmap.repair import RepairConfig, select_repair, sparse_prefill

positions, valid = select_repair(target, ids, RepairConfig("draft_branches", fraction=0.1), length=T - 1,
                                 source=source, source_cache=source_cache)
cache = sparse_prefill(target, ids, positions[0], length=T - 1)   # holds the selected positions only
out = target.generate(ids, cache=cache, max_new_tokens=8)          # reads on at position T - 1
```

The cache stores the selected positions and reports the prompt's length (`get_seq_length()`), so a forward or
`generate` places the held-back token at its own position and every later token after it; its layers give attention
masks an offset (`get_mask_sizes`) so new tokens read every stored position. It serves one row: a batch's rows select
different counts, and the stored layout has no slot for the positions one row skips and another keeps.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .._compat import init_cache_with_layers, output_cache


class SparseLayer(DynamicLayer):
    """A `DynamicLayer` that stores the keys/values of a prompt's selected positions only; `skipped` positions of the
    prompt were never computed. Its length is the prompt's (stored + skipped) plus what it grows by, and the mask of a
    forward covers the stored positions and the new ones (offset by `skipped`)."""

    @classmethod
    def from_tensors(cls, keys: torch.Tensor, values: torch.Tensor, skipped: int) -> SparseLayer:
        layer = cls()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values, layer.skipped = keys, values, int(skipped)
        return layer

    def stored(self) -> int:
        """Positions held (the selected ones and what a forward appended since)."""
        return 0 if not self.is_initialized or self.keys.numel() == 0 else self.keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.stored() + getattr(self, "skipped", 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.stored() + query_length, getattr(self, "skipped", 0)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and -tokens_to_remove > self.stored():
            raise ValueError(
                f"A sparse cache stores {self.stored()} positions; cropping {-tokens_to_remove} would reach into the "
                "prompt positions it never computed. Build a new sparse prefill instead."
            )
        super().crop(tokens_to_remove)


class SparseCache(DynamicCache):
    r"""
    The target's cache of a prompt's selected positions only (see the module docstring); approximate, like a mapped
    cache: it is never the model's own prefix cache.

    Args:
        layers (`list[SparseLayer]`): one per target layer.
        sparse_info (`dict`, *optional*): what was prefilled (`length`, `selected`, `positions`).
    """

    #: a sparse prefill is not the target's own cache of the prompt
    approximate = True

    def __init__(self, layers: list[SparseLayer], sparse_info: dict[str, Any] | None = None):
        init_cache_with_layers(self, layers)
        self.sparse_info = dict(sparse_info or {})


def _check_positions(input_ids: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a (1, T) integer tensor of the prompt; got {got}.")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"A sparse prefill serves one row; input_ids has {input_ids.shape[0]}. Rows select different positions: "
            "prefill each row on its own."
        )
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= input_ids.shape[1]:
        raise ValueError(f"length={length!r} must be an int in [1, {input_ids.shape[1]}] (the prompt's cached part).")
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point():
        raise TypeError(f"positions must be an integer tensor of selected positions; got {type(positions).__name__}.")
    positions = positions.reshape(-1).to(torch.long)
    if positions.numel() == 0:
        raise ValueError("A sparse prefill needs at least one selected position (a budget of 0 selects none).")
    if bool((positions[1:] <= positions[:-1]).any()):
        raise ValueError("positions must be distinct and ascending (as `select_repair` returns them).")
    if int(positions[0]) < 0 or int(positions[-1]) >= length:
        raise ValueError(f"positions must lie in [0, {length}); got {int(positions[0])}..{int(positions[-1])}.")
    return positions


@torch.no_grad()
def sparse_prefill(
    target, input_ids: torch.Tensor, positions: torch.Tensor, *, length: int | None = None
) -> SparseCache:
    r"""
    The target's prefill of `positions` of the prompt only, each at its original position, attending to the selected
    positions before it (the sparse rung).

    Args:
        target (`PreTrainedModel`): the causal LM that will read the cache.
        input_ids (`torch.Tensor`): `(1, T)` prompt ids (no padding).
        positions (`torch.Tensor`): `(n,)` or `(1, n)` distinct ascending positions in `[0, length)` to prefill.
        length (`int`, *optional*): the prompt positions the cache stands for (defaults to `T`); the held-back tokens
            `length .. T-1` are then run on it by a forward or `generate`, at their own positions.

    Returns:
        [`SparseCache`]: `get_seq_length() == length`, storing `n` positions.
    """
    length = input_ids.shape[1] if length is None else length
    positions = _check_positions(input_ids, positions, length)
    device = target.get_input_embeddings().weight.device
    ids = input_ids.to(device)[:, positions.to(device)]
    decoder = target.get_decoder()
    cache = output_cache(decoder(input_ids=ids, position_ids=positions.to(device)[None], use_cache=True))
    skipped = length - positions.numel()
    layers = [SparseLayer.from_tensors(layer.keys, layer.values, skipped) for layer in cache.layers]
    info = {
        "length": length,
        "selected": positions.numel(),
        "fraction": positions.numel() / length,
        "positions": positions.tolist(),
    }
    return SparseCache(layers, info)


__all__ = ["SparseCache", "SparseLayer", "sparse_prefill"]
