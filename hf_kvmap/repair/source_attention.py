"""`source_attention`: the positions the source model's last prompt tokens attend to most, summed over heads and
layers (the question at the end of a prompt reads the facts it needs).

The source reruns its last `last_tokens` prompt tokens over its own cache of the tokens before them (a forward of
that many tokens, about `last_tokens / T` of its prefill); the queries of that rerun meet the source cache's keys
(`hf_kvmap.repair.attention`). Needs the source model and its cache of the prompt.
"""

from __future__ import annotations

import torch

from ..rope import positions_from_attention_mask
from ..validation import check_int
from .attention import last_tokens_attention
from .base import RequestContext, Strategy, register_strategy


@register_strategy
class SourceAttentionStrategy(Strategy):
    """Scores each cached position by the attention the source's last `last_tokens` prompt tokens pay it.

    Args:
        last_tokens (`int`, *optional*, defaults to 16): how many final prompt tokens' queries to read.
    """

    name = "source_attention"
    needs_source = True

    def __init__(self, last_tokens: int = 16):
        check_int("last_tokens", last_tokens, 1)
        self.last_tokens = last_tokens

    def settings(self) -> dict:
        return {"name": self.name, "last_tokens": self.last_tokens}

    def score(self, context: RequestContext) -> torch.Tensor:
        positions = context.source_position_ids
        if positions is None:  # a plain forward: every row at 0 .. T-1
            positions = positions_from_attention_mask(None, *context.input_ids.shape, context.input_ids.device)
        mass = last_tokens_attention(
            context.source,
            context.source_cache,
            context.input_ids,
            context.attention_mask,
            positions,
            self.last_tokens,
        )
        return mass[:, : context.length]
