"""`"ridge"`: one affine map per target layer and K/V, all target KV heads at once (the paper's mapper).

Its per-position maps are solved from the sufficient statistics (`hf_kvmap.fitting.solve_layer`, no pass over the
data); wider inputs (a context window, keys and values read together) are solved on features kept in memory, one
ridge per set of maps reading the same inputs ([`RidgeKind.fit_on_features`]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from ..layout import PARTS
from ..regression import ridge_solve
from ..validation import check_choice, check_number
from .base import MapperKind, map_inputs, register_mapper_kind

LAMBDA_CONVENTIONS = ("absolute", "per_token")


@dataclass
class RidgeOptions:
    """The settings of the ridge (also the penalty of the MLP's ridge initialization and comparison).

    Args:
        ridge_lambda (`float`, *optional*, defaults to 0.01): the ridge penalty.
        lambda_convention (`str`, *optional*, defaults to `"absolute"`): `"absolute"` adds `lambda I`,
            `"per_token"` adds `N lambda I` with `N` calibration positions.
    """

    ridge_lambda: float = 0.01
    lambda_convention: str = "absolute"

    def __post_init__(self):
        check_number("ridge_lambda", self.ridge_lambda, 0)
        check_choice("lambda_convention", self.lambda_convention, LAMBDA_CONVENTIONS)


def _ridge_map(config, in_features: int) -> nn.Module:
    """`"ridge"`: one affine map, all target KV heads at once."""
    return nn.Linear(in_features, config.target_geometry.layer_width, bias=True)


def _ridge_on_features(features, selection, options, target, progress):
    """Maps that read the same inputs (same selected layers, window and input kinds; with input_kinds="both" keys and
    values alike) share one Gram: solve them together, their targets side by side."""
    penalty = options.ridge_lambda * (features.num_positions if options.lambda_convention == "per_token" else 1.0)
    groups: dict[tuple, list[tuple[int, str]]] = {}
    for layer_idx in range(target.num_layers):
        for part in PARTS:
            window, input_kinds = map_inputs(options, layer_idx, part)
            reads = "both" if input_kinds == "both" else part
            key = (reads, window, input_kinds, tuple(selection.source_layers[layer_idx]))
            groups.setdefault(key, []).append((layer_idx, part))
    maps, width = {}, target.layer_width
    for (_, window, input_kinds, chosen), members in tqdm(
        groups.items(), desc="solving ridge maps", unit="input set", disable=not progress
    ):
        x = features.inputs(members[0][1], list(chosen), None, input_kinds, window)
        y = torch.cat([features.outputs(part, layer_idx) for layer_idx, part in members], dim=1)
        weight, bias = ridge_solve(x, y, penalty)
        for slot, member in enumerate(members):
            columns = slice(slot * width, (slot + 1) * width)
            maps[member] = {"weight": weight[columns].contiguous(), "bias": bias[columns].contiguous()}
    return maps, {"features": features.provenance}


@register_mapper_kind
class RidgeKind(MapperKind):
    """`"ridge"`: see the module docstring."""

    name = "ridge"
    options_class = RidgeOptions
    needs_features = False
    build_map = staticmethod(_ridge_map)
    fit_on_features = staticmethod(_ridge_on_features)


__all__ = ["LAMBDA_CONVENTIONS", "RidgeKind", "RidgeOptions"]
