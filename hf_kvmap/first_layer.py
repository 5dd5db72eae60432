"""The target's first layer from the token ids: its keys and values depend on nothing but each token and its
position (embedding, input norm, key/value projections, the key norm where the architecture has one, RoPE), so a
handoff can have the target compute them exactly instead of mapping them, at the cost of one embedding lookup and two
projections per token (no attention, no MLP).

On the real Qwen2.5-Coder 0.5B -> 1.5B pair, mapping the target's layer 0 alone (every other layer its own) breaks
the retrieval of a planted number, where mapping any other single layer alone does not (`python -m benchmarks.real
scale swap`); with layer 0 exact and every other layer mapped, retrieval still fails there (`scale first-layer`):
an exact first layer is necessary on that pair, not sufficient.
"""

from __future__ import annotations

import torch

from .configuration_mapper import summarize_model_config
from .geometry import check_supported_layout
from .rope import RotaryCodec


@torch.no_grad()
def target_first_layer(
    target_model, input_ids: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""
    The keys (RoPE applied at `position_ids`) and values of the target's first layer for `input_ids`, as the
    target's own forward caches them.

    Args:
        target_model (`PreTrainedModel`): a causal LM of a supported architecture (its decoder's first layer:
            `input_layernorm`, `self_attn.k_proj` / `v_proj` and, where it has one, `self_attn.k_norm`).
        input_ids (`torch.Tensor`): `(batch, seq)` token ids.
        position_ids (`torch.Tensor`): `(batch, seq)` positions the target reads them at.

    Returns:
        `(keys, values)`, each `(batch, n_kv, seq, head_dim)` in the target's dtype, on its first layer's device.
    """
    summary = summarize_model_config(target_model.config)
    check_supported_layout(summary)
    if tuple(position_ids.shape) != tuple(input_ids.shape):
        raise ValueError(f"position_ids have shape {tuple(position_ids.shape)}; input_ids {tuple(input_ids.shape)}.")
    decoder = target_model.get_decoder()
    layer, embed = decoder.layers[0], decoder.get_input_embeddings()
    attention = layer.self_attn
    hidden = layer.input_layernorm(embed(input_ids.to(embed.weight.device)).to(attention.k_proj.weight.device))
    shape = (*input_ids.shape, -1, attention.head_dim)
    keys = attention.k_proj(hidden).view(shape)
    if getattr(attention, "k_norm", None) is not None:
        keys = attention.k_norm(keys)
    values = attention.v_proj(hidden).view(shape).transpose(1, 2)
    table = RotaryCodec(summary).table(position_ids.to(keys.device))
    keys = table.apply(keys.transpose(1, 2).float()).to(values.dtype)
    return keys, values


__all__ = ["target_first_layer"]
