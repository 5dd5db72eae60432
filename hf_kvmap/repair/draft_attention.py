"""`draft_attention`: the positions the source reads while it drafts the answer. The source greedily decodes its first
`draft_tokens` answer tokens on its own cache, then the queries of those tokens (and of the prompt's last
`last_tokens`, none by default) meet the source cache's keys (`hf_kvmap.repair.attention`); each cached position
scores the attention mass it receives, summed over heads, queries and layers.

Why: the question at the end of a prompt attends to where an answer starts (the first digit of a number, the first
word of a fact), but copying the answer reads the rest of it one token at a time, as each drafted token's queries
find the position after its previous occurrence. Reading the draft's attention finds the whole span the answer is
copied from; reading only the prompt's last tokens (`source_attention`) finds its start, and spends much of the
budget on attention sinks and on those tokens themselves. On the real pair (Qwen2.5-Coder 0.5B -> 1.5B,
docs/repair.md) recomputing the fifth of the positions it selects keeps every retrieval and chat-recall answer of the
report set, where the source's attention keeps no retrieval at that fraction.

Cost: at most `draft_tokens` greedy decoding steps of the source (fewer once every row has ended its answer), plus
one source forward of `last_tokens + draft_tokens` tokens over its cache; nothing of the target. The source cache is
read, never changed. A draft the request already decoded (`RequestContext.source_draft`: the guard's
`draft_agreement` / `confident_draft` probe drafts the same tokens) is continued, not decoded again.
"""

from __future__ import annotations

import torch

from ..drafting import Draft
from ..input_checks import eos_token_ids
from ..rope import positions_from_attention_mask
from ..validation import check_int
from .attention import last_tokens_attention
from .base import RequestContext, Strategy, register_strategy


@register_strategy
class DraftAttentionStrategy(Strategy):
    """Scores each cached position by the attention the source pays it while drafting the answer: the queries of its
    `draft_tokens` greedy answer tokens and of the prompt's last `last_tokens`.

    Args:
        draft_tokens (`int`, *optional*, defaults to 8): answer tokens the source drafts (at least 1).
        last_tokens (`int`, *optional*, defaults to 0): final prompt tokens whose queries are read too (0: only the
            draft's; the prompt's own last tokens spend the budget on themselves and on attention sinks).
        stop_at_eos (`bool`, *optional*, defaults to `True`): read no draft token after the source's first
            end-of-sequence token (`generation_config.eos_token_id`): what follows the answer reads nothing of it.
            The draft stops once every row has drafted one, so a short answer costs fewer steps.
    """

    name = "draft_attention"
    needs_source = True

    def __init__(self, draft_tokens: int = 8, last_tokens: int = 0, stop_at_eos: bool = True):
        for option, value, least in (("draft_tokens", draft_tokens, 1), ("last_tokens", last_tokens, 0)):
            check_int(option, value, least)
        if not isinstance(stop_at_eos, bool):
            raise ValueError(f"stop_at_eos={stop_at_eos!r} must be True or False.")
        self.draft_tokens = draft_tokens
        self.last_tokens = last_tokens
        self.stop_at_eos = stop_at_eos

    def settings(self) -> dict:
        return {
            "name": self.name,
            "draft_tokens": self.draft_tokens,
            "last_tokens": self.last_tokens,
            "stop_at_eos": self.stop_at_eos,
        }

    def score(self, context: RequestContext) -> torch.Tensor:
        ids, mask = context.input_ids, context.attention_mask
        positions = context.source_position_ids
        if positions is None:  # a plain forward: every row at 0 .. T-1
            positions = positions_from_attention_mask(None, *ids.shape, ids.device)
        eos = eos_token_ids(context.source) if self.stop_at_eos else []
        shared = context.source_draft
        if shared is None or not shared.reads(context.source, ids, positions):
            shared = Draft(context.source, context.source_cache, ids, mask, positions)
        draft = shared.tokens(self.draft_tokens, eos)
        steps = draft.shape[1]
        extended = torch.cat([ids, draft.to(ids.device)], dim=1)
        extended_mask = torch.cat([mask, mask.new_ones(mask.shape[0], steps)], dim=1)
        following = positions[:, -1:] + torch.arange(1, steps + 1, device=positions.device)
        extended_positions = torch.cat([positions, following], dim=1)
        counted = None
        if self.stop_at_eos:
            counted = torch.ones_like(extended_mask, dtype=torch.bool)
            counted[:, ids.shape[1] :] = _before_first_eos(draft, eos).to(ids.device)
        mass = last_tokens_attention(
            context.source,
            context.source_cache,
            extended,
            extended_mask,
            extended_positions,
            steps + self.last_tokens,
            query_mask=counted,
            per_query=self.per_query,
        )
        return self.reduce(mass)[:, : context.length]

    #: whether `reduce` reads each query's attention apart (`(batch, queries, T)`) or their sum (`(batch, T)`)
    per_query = False

    def reduce(self, mass: torch.Tensor) -> torch.Tensor:
        """The score of every position from the attention mass the draft's queries pay it (here: their sum)."""
        return mass


def _before_first_eos(draft: torch.Tensor, eos: list[int]) -> torch.Tensor:
    """`(batch, steps)` bool: the drafted tokens up to and including each row's first end-of-sequence token."""
    if not eos:
        return torch.ones_like(draft, dtype=torch.bool)
    ended = torch.isin(draft, torch.tensor(eos, device=draft.device))
    after = ended.long().cumsum(-1) - ended.long()  # end tokens strictly before each step
    return after == 0


__all__ = ["DraftAttentionStrategy"]
