"""`target_attention`: the positions the target's own last prompt tokens attend to most, read over the mapped cache,
summed over heads and layers.

The target runs its last `last_tokens` prompt tokens over the cache being repaired (`hf_kvmap.repair.attention`):
the queries are the target's, so the positions are the ones the model that answers reads, even where the source
reads the prompt differently. The attention is computed on the mapped keys, so a position whose mapped key is badly
off can be missed. Costs a target forward of `last_tokens` tokens; needs no source.
"""

from __future__ import annotations

import torch

from ..validation import check_int
from .attention import last_tokens_attention
from .base import RequestContext, Strategy, register_strategy


@register_strategy
class TargetAttentionStrategy(Strategy):
    """Scores each cached position by the attention the target's last `last_tokens` prompt tokens pay it over the
    cache being repaired.

    Args:
        last_tokens (`int`, *optional*, defaults to 16): how many final prompt tokens' queries to read.
        reduce (`str`, *optional*, defaults to `"sum"`): `"sum"` of their attention, or its `"max"` over the queries.
    """

    name = "target_attention"

    def __init__(self, last_tokens: int = 16, reduce: str = "sum"):
        check_int("last_tokens", last_tokens, 1)
        if reduce not in ("sum", "max"):
            raise ValueError(f"reduce={reduce!r} must be 'sum' or 'max'.")
        self.last_tokens = last_tokens
        self.reduce = reduce

    def settings(self) -> dict:
        settings = {"name": self.name, "last_tokens": self.last_tokens}
        if self.reduce != "sum":  # the default is left out, so settings recorded before the option read the same
            settings["reduce"] = self.reduce
        return settings

    def score(self, context: RequestContext) -> torch.Tensor:
        last = min(self.last_tokens, context.input_ids.shape[1] - 1)
        last = max(last, context.input_ids.shape[1] - context.length)  # the held-back tokens are read anyway
        mass = last_tokens_attention(
            context.target,
            context.cache,
            context.input_ids,
            context.attention_mask,
            context.position_ids,
            last,
            per_query=self.reduce == "max",
        )
        if self.reduce == "max":
            mass = mass.amax(dim=1)
        return mass[:, : context.length]
