"""The `prefix_audit` probe: the target's own keys/values of the first prompt tokens against the mapped ones."""

from __future__ import annotations

import torch

from ..._compat import output_cache
from .base import Probe, RequestContext, register_probe


@register_probe
class PrefixAuditProbe(Probe):
    """The target prefills its first `tokens` prompt tokens itself (a cost of `tokens / T` of its prefill) and compares
    its own keys and values with the mapped ones there. Risk: the largest relative error `|mapped - own| / |own|` over
    layers and K/V, on real (unpadded) tokens. An exact mapping scores 0.
    """

    name = "prefix_audit"
    default_tokens = 32
    exact_scores_zero = True

    def target_tokens(self, length: int) -> int:
        return min(self.tokens, length - 1)

    @torch.no_grad()
    def score(self, context: RequestContext) -> torch.Tensor:
        mapped_tokens = context.length - context.hold_back
        width = min(self.tokens, mapped_tokens)
        mask = context.attention_mask[:, :width]
        own = output_cache(
            context.target(
                input_ids=context.input_ids[:, :width],
                attention_mask=mask,
                position_ids=context.position_ids[:, :width],
                use_cache=True,
            )
        )
        weight = mask[:, None, :, None].float()
        risk = torch.zeros(context.batch)
        for own_layer, layer in zip(own.layers, context.cache.layers):
            for mine, theirs in ((layer.keys, own_layer.keys), (layer.values, own_layer.values)):
                theirs = theirs.float()
                diff = ((mine[:, :, :width].float().to(theirs.device) - theirs) * weight).pow(2).sum((1, 2, 3))
                norm = (theirs * weight).pow(2).sum((1, 2, 3)).clamp_min(1e-30)
                risk = torch.maximum(risk, (diff / norm).sqrt().cpu())
        return risk


__all__ = ["PrefixAuditProbe"]
