"""The `lookahead_margin` probe: the target's top-1 margin over its first answer tokens."""

from __future__ import annotations

import torch

from .base import Probe, RequestContext, register_probe


@register_probe
class LookaheadMarginProbe(Probe):
    """The target decodes its first `tokens` answer tokens greedily on the mapped cache. Risk: one minus the smallest
    top-1 minus top-2 probability margin among those steps (a retrieval that went wrong is rarely confident).

    Cost: `tokens` target decoding steps (they are the first tokens the user would receive).
    """

    name = "lookahead_margin"

    @torch.no_grad()
    def score(self, context: RequestContext) -> torch.Tensor:
        top = context.draft("target").top2(self.tokens)
        return 1.0 - (top[..., 0] - top[..., 1]).amin(-1)


__all__ = ["LookaheadMarginProbe"]
