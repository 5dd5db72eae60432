"""`early_deviation`: CacheBlend's check (Yao et al., EuroSys 2025). The target computes its exact layers `0 ..
layer` from the token ids (a forward stopped once layer `layer` has its keys/values: about `(layer + 1) / L` of a
prefill, and for `layer=0` no attention at all, as `hf_kvmap.first_layer`), and the positions whose cached
keys/values at `layer` deviate most from the exact ones are recomputed first.

Deviation per position: `|dK| / mean |K| + |dV| / mean |V|` over the heads of that layer (norms over a position's
heads and dims, means over the row's tokens), so keys and values weigh alike whatever their scales. A mapped cache
whose first layer is already the target's (`from_source(..., first_layer="target")`) deviates nowhere at layer 0: check a
later one.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .._compat import cache_kwargs
from ..first_layer import target_first_layer
from ..validation import check_int
from .base import RequestContext, Strategy, register_strategy


class _Stop(Exception):
    """Raised by `_StopLayer` once the layer the check reads has its keys and values."""


class _StopLayer(DynamicLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        self.keys, self.values = key_states, value_states
        raise _Stop


@torch.no_grad()
def exact_layer(target, input_ids, attention_mask, position_ids, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own keys/values of layer `layer` for `input_ids` `(batch, n)`, from a forward that stops there."""
    if layer == 0:
        return target_first_layer(target, input_ids, position_ids)
    stop = _StopLayer()
    layers = [DynamicLayer() for _ in range(layer)] + [stop]
    work = Cache(layers=layers)
    try:
        target.get_decoder()(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **cache_kwargs(work),
        )
    except _Stop:
        return stop.keys, stop.values
    raise RuntimeError(f"The target's forward never reached layer {layer}.")


@register_strategy
class EarlyDeviationStrategy(Strategy):
    """Scores each cached position by how far its cached keys/values at `layer` are from the target's exact ones.

    Args:
        layer (`int`, *optional*, defaults to 1): the target layer compared (0 costs no attention; CacheBlend uses
            an early one).
    """

    name = "early_deviation"

    def __init__(self, layer: int = 1):
        check_int("layer", layer, 0)
        self.layer = layer

    def settings(self) -> dict:
        return {"name": self.name, "layer": self.layer}

    def score(self, context: RequestContext) -> torch.Tensor:
        if self.layer >= len(context.cache.layers):
            raise ValueError(f"layer={self.layer} but the target has {len(context.cache.layers)} layers.")
        length = context.length
        mask = context.attention_mask[:, :length]
        keys, values = exact_layer(
            context.target,
            context.input_ids[:, :length],
            mask,
            context.position_ids[:, :length],
            self.layer,
        )
        cached = context.cache.layers[self.layer]
        tokens = mask.to(keys.device).float()
        score = torch.zeros(context.batch, length, dtype=torch.float32, device=keys.device)
        for exact, mapped in ((keys, cached.keys), (values, cached.values)):
            exact = exact.float()
            error = (mapped.to(exact.device).float() - exact).square().sum((1, 3)).sqrt()
            scale = exact.square().sum((1, 3)).sqrt()
            mean = (scale * tokens).sum(-1, keepdim=True) / tokens.sum(-1, keepdim=True).clamp(min=1)
            score += error / mean.clamp(min=torch.finfo(torch.float32).tiny)
        return (score * tokens).cpu()
