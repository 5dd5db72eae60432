"""The target's per-head key normalisation (Qwen3's `self_attn.k_norm`, an RMSNorm), as a mapper applies it to the
keys it predicts (`MapperConfig.key_norm`): `k = g * n(k_hat / g)`, `n(u) = u / sqrt(mean(u^2) + eps)`.

Every key such a target caches lies on that surface; a regression predicts a conditional mean, which shrinks towards
the origin where it is unsure, and flattens the attention logits of a sharp layer. Normalising restores the scale.
"""

from __future__ import annotations

from typing import Any

import torch


def normalize_keys(keys: torch.Tensor, weight: torch.Tensor, head_dim: int, eps: float) -> torch.Tensor:
    """`(..., n_heads * head_dim)` predicted content-space keys -> the same on the key norm's surface (per head)."""
    weight = weight.to(keys.dtype)
    heads = keys.unflatten(-1, (-1, head_dim)) / weight
    scale = torch.rsqrt(heads.float().square().mean(-1, keepdim=True) + eps)
    return (heads * scale.to(keys.dtype) * weight).flatten(-2)


def target_key_norm(target_model) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The key normalisation of every target layer: its weights, and the `MapperConfig` field of its epsilon. Raises
    `ValueError` for a target without one (or none given)."""
    if target_model is None:
        raise ValueError("key_norm=True copies the target's key norm: pass the target model.")
    layers = getattr(target_model.get_decoder(), "layers", None) or []
    norms = [getattr(getattr(layer, "self_attn", None), "k_norm", None) for layer in layers]
    if not norms or any(norm is None or getattr(norm, "weight", None) is None for norm in norms):
        raise ValueError(
            f"key_norm=True needs a target whose attention normalises each key head (`self_attn.k_norm`, as in "
            f"Qwen3); {type(target_model).__name__} has none. Fit without key_norm."
        )
    eps = getattr(norms[0], "variance_epsilon", getattr(norms[0], "eps", 1e-6))
    weights = [norm.weight.detach().to("cpu", torch.float32).clone() for norm in norms]
    return weights, {"key_norm_eps": float(eps)}
