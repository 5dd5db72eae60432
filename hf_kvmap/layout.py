"""The input layout of a mapper: what each map reads from the content-space features of its selected source layers
(its own part or keys and values both, and the earlier positions of a context window). The one definition, shared by
`MapperModel.forward` (`hf_kvmap.mapping`) and fitting (`hf_kvmap.features.CalibrationFeatures.inputs`). It
depends on torch alone: `MapperConfig` and `FitOptions` read it, the mapper kinds fit on it."""

from __future__ import annotations

from typing import Any

import torch

PARTS = ("key", "value")


# ------------------------------------------------------------------------------------------------ layout
def part_inputs(
    layer_inputs: dict[str, Any], layer: int, part: str, context_window: int, input_kinds: str
) -> tuple[int, str]:
    """`(context_window, input_kinds)` of target `layer`'s `part` map: its `layer_inputs` entry, else the global
    ones."""
    spec = layer_inputs.get(str(layer), {}).get(part, {})
    return spec.get("context_window", context_window), spec.get("input_kinds", input_kinds)


def window_features(
    features: torch.Tensor, context_window: int, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    r"""
    The features of each position followed by those of the `context_window` positions before it.

    Args:
        features (`torch.Tensor`): `(batch, seq, F)`.
        context_window (`int`): `w`, the number of earlier positions appended.
        position_ids (`torch.Tensor`, *optional*): `(batch, seq)` positions of the tokens. A shift `s` at a token
            whose position is below `s` reaches before the sequence's first token (left padding) and is zero.
            Without them the tokens are at `0 .. seq - 1`.

    Returns:
        `(batch, seq, (w + 1) * F)`: `[x_t, x_{t-1}, ..., x_{t-w}]`, zeros where `t - s` is not a token.
    """
    if context_window == 0:
        return features
    batch, length, width = features.shape
    out = features.new_zeros(batch, length, context_window + 1, width)
    out[:, :, 0] = features
    for shift in range(1, min(context_window, length - 1) + 1):
        out[:, shift:, shift] = features[:, :-shift]
    if position_ids is not None:
        shifts = torch.arange(1, context_window + 1, device=features.device)
        reaches_before = position_ids.to(features.device).unsqueeze(-1) < shifts  # (batch, seq, w)
        out[:, :, 1:].masked_fill_(reaches_before.unsqueeze(-1), 0)
    return out.view(batch, length, (context_window + 1) * width)


def mapper_inputs(
    config: Any,
    key_features: torch.Tensor,
    value_features: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    layer: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""
    The inputs of one target layer's key and value maps, from the content-space features of its selected source
    layers. The one definition of the input layout, shared by fitting and by `MapperModel.forward`.

    Args:
        config ([`MapperConfig`]): its `input_kinds` and `context_window` (or the target layer's own, see
            `MapperConfig.part_inputs`) decide the layout.
        key_features, value_features (`torch.Tensor`): `(batch, seq, k * n_kv_src * head_dim_src)` RoPE-stripped
            source keys and source values of the selected layers (layer-major, then head, then dim).
        position_ids (`torch.Tensor`, *optional*): `(batch, seq)` token positions (see [`window_features`]).
        layer (`int`, *optional*): the target layer, whose `layer_inputs` entry applies (default: the global layout).

    Returns:
        `(key_inputs, value_inputs)`, each `(batch, seq, config.input_width(layer, part))`, laid out as
        `[position t, t - 1, ..., t - w]`, each `[keys, values]` with `input_kinds="both"` (else its own part).
    """
    if layer is None:
        layouts = [(config.context_window, config.input_kinds)] * 2
    else:
        layouts = [config.part_inputs(layer, part) for part in PARTS]
    if layouts[0] == layouts[1] and layouts[0][1] == "both":  # one tensor read by both maps
        both = window_features(torch.cat([key_features, value_features], dim=-1), layouts[0][0], position_ids)
        return both, both
    inputs = []
    for (window, input_kinds), own in zip(layouts, (key_features, value_features)):
        if input_kinds == "both":
            own = torch.cat([key_features, value_features], dim=-1)
        inputs.append(window_features(own, window, position_ids))
    return inputs[0], inputs[1]


# ------------------------------------------------------------------------------------------------ extraction


__all__ = ["PARTS", "mapper_inputs", "part_inputs", "window_features"]
