"""`draft_coverage`: the positions any token of a long source draft reads most. As `draft_attention`, the source
greedily drafts the answer on its own cache and its draft's queries meet the source cache's keys; but a position
scores the *most* attention one drafted token pays it (summed over heads and layers), not the sum over the draft.

Why: an answer that runs long (a function body, a paragraph) reads a different span at each step. Summed over a long
draft, the mass goes to what every step reads (attention sinks, the prompt's last lines, the draft's own
neighbourhood) and a span read by one step only is outranked; the largest single read keeps every step's strongest
positions in the ranking. For a one-span answer the two agree on the span.

Cost: as `draft_attention` with the same `draft_tokens` (64 by default: at most 64 greedy steps of the source, fewer
once every row has ended its draft), plus keeping `draft_tokens x T` floats; nothing of the target.
"""

from __future__ import annotations

import torch

from .base import register_strategy
from .draft_attention import DraftAttentionStrategy


@register_strategy
class DraftCoverageStrategy(DraftAttentionStrategy):
    """Scores each cached position by the largest attention mass one of the source's `draft_tokens` drafted tokens
    (or of the prompt's last `last_tokens`) pays it, summed over heads and layers.

    Args:
        draft_tokens (`int`, *optional*, defaults to 64): answer tokens the source drafts (at least 1).
        last_tokens (`int`, *optional*, defaults to 0): final prompt tokens whose queries are read too.
        stop_at_eos (`bool`, *optional*, defaults to `True`): read no draft token after the source's first
            end-of-sequence token.
    """

    name = "draft_coverage"
    per_query = True

    def __init__(self, draft_tokens: int = 64, last_tokens: int = 0, stop_at_eos: bool = True):
        super().__init__(draft_tokens=draft_tokens, last_tokens=last_tokens, stop_at_eos=stop_at_eos)

    def reduce(self, mass: torch.Tensor) -> torch.Tensor:
        return mass.amax(dim=1)


__all__ = ["DraftCoverageStrategy"]
