"""How `MapperModel.forward` computes one target layer: source content once per source layer, the layer's inputs,
its key and value maps, and the target's rope, written into contiguous cache tensors.

Two ways to the same numbers: the general one lays the selected source layers out as one feature tensor
(`layout.mapper_inputs`, the layout fitting uses) and calls the layer's maps; the direct one, for an affine map of
plain per-position inputs (the paper's ridge) outside autograd, skips the feature tensor and accumulates one matrix
product per selected source layer, reading each source layer's token-major content in place (on CPUs the gather is
a quarter of the mapping's time).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .configuration_mapper import MapperConfig
from .key_norm import normalize_keys
from .layout import mapper_inputs
from .rope import RotaryTable


def source_content(
    source_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    source_layer: int,
    source_rope: RotaryTable,
    length: int,
    work_dtype: torch.dtype,
    work_device: torch.device,
    content: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(keys, values)` of `source_layer`, `(batch, length, n_kv_src * head_dim_src)`, keys RoPE-stripped, both
    token-major and contiguous; computed once per `(source_layer, work_device)` and kept in `content`."""
    found = content.get((source_layer, work_device))
    if found is None:
        keys, values = (t[:, :, :length].to(work_device, non_blocking=True) for t in source_kv[source_layer])
        batch = keys.shape[0]
        found = tuple(
            t.transpose(1, 2).to(work_dtype).reshape(batch, length, -1) for t in (source_rope.strip(keys), values)
        )
        content[(source_layer, work_device)] = found
    return found


def direct_affine(config: MapperConfig, layer_idx: int, mapper_layer: nn.Module) -> bool:
    """Whether target layer `layer_idx` can take the direct way: affine maps (`nn.Linear`) of each part's own
    per-position content, no context window, no autograd."""
    plain = all(config.part_inputs(layer_idx, part) == (0, "same") for part in ("key", "value"))
    maps = (mapper_layer.key_proj, mapper_layer.value_proj)
    return plain and all(type(m) is nn.Linear for m in maps) and not torch.is_grad_enabled()


def _accumulate(proj: nn.Linear, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """`proj(cat(parts, -1))` without the concatenation: the bias, plus one `addmm_` per part with its columns of
    the weight (each part `(batch, length, width)`, token-major)."""
    batch, length = parts[0].shape[:2]
    out = proj.bias.expand(batch * length, -1).clone() if proj.bias is not None else None
    start = 0
    for part in parts:
        width = part.shape[-1]
        weight = proj.weight[:, start : start + width].t()
        rows = part.reshape(batch * length, width)
        out = rows @ weight if out is None else out.addmm_(rows, weight)
        start += width
    return out.view(batch, length, -1)


def map_target_layer(
    config: MapperConfig,
    layer_idx: int,
    mapper_layer: nn.Module,
    source_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    source_rope: RotaryTable,
    target_rope: RotaryTable,
    length: int,
    dtype: torch.dtype,
    work_device: torch.device,
    content: dict,
    position_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target layer `layer_idx` (`(batch, n_kv_tgt, length, head_dim_tgt)` keys and values in `dtype`) from the
    first `length` source tokens, computed on `work_device` by `mapper_layer` (a `MapperLayer`).

    `content` (shared by the layers of one mapping, see [`source_content`]) keeps each source layer's RoPE-stripped
    keys and values, so that a source layer selected by several target layers is prepared once.
    """
    work_dtype = next(mapper_layer.parameters()).dtype
    selected = config.source_layers[layer_idx]
    tgt = config.target_geometry
    pairs = [source_content(source_kv, s, source_rope, length, work_dtype, work_device, content) for s in selected]
    batch = pairs[0][0].shape[0]
    if direct_affine(config, layer_idx, mapper_layer):
        keys = _accumulate(mapper_layer.key_proj, [k for k, _ in pairs])
        values = _accumulate(mapper_layer.value_proj, [v for _, v in pairs])
        if mapper_layer.key_norm_weight is not None:
            keys = normalize_keys(keys, mapper_layer.key_norm_weight, tgt.head_dim, mapper_layer.key_norm_eps)
    else:
        key_features = torch.cat([k for k, _ in pairs], dim=-1)
        value_features = torch.cat([v for _, v in pairs], dim=-1)
        key_features, value_features = mapper_inputs(config, key_features, value_features, position_ids, layer_idx)
        keys, values = mapper_layer(key_features, value_features)
        del key_features, value_features
    shape = (batch, tgt.num_kv_heads, length, tgt.head_dim)
    keys = keys.view(batch, length, tgt.num_kv_heads, tgt.head_dim).transpose(1, 2)
    values = values.view(batch, length, tgt.num_kv_heads, tgt.head_dim).transpose(1, 2)
    if keys.requires_grad or values.requires_grad:  # training through the mapping: no in-place writes
        return target_rope.apply(keys.float()).to(dtype), values.to(dtype).contiguous()
    mapped_keys = torch.empty(shape, dtype=dtype, device=keys.device)
    mapped_values = torch.empty(shape, dtype=dtype, device=values.device)
    if dtype == torch.float32:  # rotate straight into the contiguous cache tensor
        target_rope.apply(keys.float(), out=mapped_keys)
    else:  # rotate in float32, round once
        mapped_keys.copy_(target_rope.apply(keys.float()))
    mapped_values.copy_(values)
    return mapped_keys, mapped_values
