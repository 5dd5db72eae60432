"""`tail`: the last positions of the prompt. Recomputing them is exactly a crop of the cache and a re-prefill of the
suffix by the target (the suffix attends to the cache of everything before it); it costs nothing to select and is
the baseline every other strategy has to beat."""

from __future__ import annotations

import torch

from .base import RequestContext, Strategy, register_strategy


@register_strategy
class TailStrategy(Strategy):
    """Scores each cached position by its index: the latest positions are recomputed first."""

    name = "tail"

    def score(self, context: RequestContext) -> torch.Tensor:
        return torch.arange(context.length, dtype=torch.float32).expand(context.batch, -1)
