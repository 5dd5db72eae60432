"""`oracle`: the positions whose cached keys/values are furthest from the target's own, summed over every layer.

It needs the target's own cache of the prompt, i.e. the full prefill that repair exists to avoid, so it is never a
serving choice: it is the reference the cheap strategies are measured against (how much of the gap between the mapped
cache and the target's own a selection of this size can close when the positions are known).
"""

from __future__ import annotations

import torch

from .._compat import output_cache
from .base import RequestContext, Strategy, register_strategy


@register_strategy
class OracleStrategy(Strategy):
    """Scores each cached position by its relative key and value error against the target's own cache, summed over
    layers (`|dK| / mean |K| + |dV| / mean |V|` per layer, as `early_deviation` does for one)."""

    name = "oracle"

    def score(self, context: RequestContext) -> torch.Tensor:
        length = context.length
        mask = context.attention_mask[:, :length]
        own = context.target.get_decoder()(
            input_ids=context.input_ids[:, :length],
            attention_mask=mask,
            position_ids=context.position_ids[:, :length],
            use_cache=True,
        )
        own = output_cache(own)
        tokens = mask.float()
        score = torch.zeros(context.batch, length, dtype=torch.float32)
        for exact_layer, cached in zip(own.layers, context.cache.layers):
            for exact, mapped in ((exact_layer.keys, cached.keys), (exact_layer.values, cached.values)):
                exact = exact.float()
                error = (mapped.to(exact.device).float() - exact).square().sum((1, 3)).sqrt().cpu()
                scale = exact.square().sum((1, 3)).sqrt().cpu()
                mean = (scale * tokens).sum(-1, keepdim=True) / tokens.sum(-1, keepdim=True).clamp(min=1)
                score += error / mean.clamp(min=torch.finfo(torch.float32).tiny)
        return score * tokens
