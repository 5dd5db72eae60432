"""Views of a cache's tensors, shared by the repair strategies, the probes and serving: a layer around given tensors,
the first positions of a cache (a forward appends to the view, the cache stays as it is), and some rows of a batch."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


def as_layer(keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    """A `DynamicLayer` holding `keys` and `values` `(batch, heads, seq, head_dim)` as they are (no copy)."""
    layer = DynamicLayer()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    return layer


def prefix_view(cache, length: int) -> Cache:
    """A cache of views of `cache`'s first `length` positions: a forward appends to it, `cache` stays as it is."""
    return Cache(layers=[as_layer(layer.keys[:, :, :length], layer.values[:, :, :length]) for layer in cache.layers])


def row_cache(cache: Cache, rows: torch.Tensor) -> Cache:
    """A cache of rows `rows` of `cache` (copies: writing to it leaves `cache` as it is)."""
    return Cache(layers=[as_layer(layer.keys[rows], layer.values[rows]) for layer in cache.layers])


def write_rows(cache: Cache, rows: torch.Tensor, part: Cache) -> None:
    """Write `part`'s layers into rows `rows` of `cache`, in `cache`'s dtype and on its devices."""
    for layer, new in zip(cache.layers, part.layers):
        index = rows.to(layer.keys.device)
        layer.keys[index] = new.keys.to(layer.keys.device, layer.keys.dtype)
        layer.values[index] = new.values.to(layer.values.device, layer.values.dtype)


__all__ = ["as_layer", "prefix_view", "row_cache", "write_rows"]
