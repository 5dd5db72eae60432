"""`draft_branches`: the positions the source reads while drafting each of its `branches` likeliest answers. The source
ranks its first answer token; each of the top `branches` tokens starts a branch that the source continues greedily
for `draft_tokens - 1` more tokens, and each cached position scores the attention the branches' queries pay it
(as `draft_attention` scores one branch), summed over the branches.

Why: where a prompt holds several similar facts (six registration numbers, several near-identical functions), the
source may pick another fact than the target would; `draft_attention` then repairs the span of the source's fact and
the target, reading the repaired span clearly and the others through the map, answers with the source's fact. The
first token of each candidate answer sends a branch to its own span, so the target reads every candidate the
source weighs, repaired, and chooses among them itself. With `branches=1` it is `draft_attention`.

Cost: `draft_tokens` source decoding steps and one source forward of `last_tokens + draft_tokens` tokens over its
cache, each on a batch of `branches` rows per prompt (the branches draft side by side, over copies of the source's
cache rows); nothing of the target.
"""

from __future__ import annotations

import torch

from .._compat import cache_kwargs
from ..cache_views import prefix_view, row_cache
from ..rope import positions_from_attention_mask
from ..validation import check_int
from .base import RequestContext, register_strategy
from .draft_attention import DraftAttentionStrategy


@register_strategy
class DraftBranchesStrategy(DraftAttentionStrategy):
    """Scores each cached position by the attention the source pays it while drafting its `branches` likeliest answers
    (top first tokens, each continued greedily), summed over the branches.

    Args:
        branches (`int`, *optional*, defaults to 3): first tokens to branch on (at least 1).
        draft_tokens (`int`, *optional*, defaults to 8): tokens per branch, its first token included (at least 2).
        last_tokens (`int`, *optional*, defaults to 0): final prompt tokens whose queries are read too (per branch).
        stop_at_eos (`bool`, *optional*, defaults to `True`): read no token of a branch after its first end token
            (a branch whose first token is an end token still reads its continuation: an empty answer is rare).
    """

    name = "draft_branches"

    def __init__(self, branches: int = 3, draft_tokens: int = 8, last_tokens: int = 0, stop_at_eos: bool = True):
        super().__init__(draft_tokens=draft_tokens, last_tokens=last_tokens, stop_at_eos=stop_at_eos)
        check_int("branches", branches, 1)
        check_int("draft_tokens", draft_tokens, 2)  # the forced first token and at least one after it
        self.branches = branches

    def settings(self) -> dict:
        return {**super().settings(), "branches": self.branches}

    @torch.no_grad()
    def score(self, context: RequestContext) -> torch.Tensor:
        ids, mask = context.input_ids, context.attention_mask
        positions = context.source_position_ids
        if positions is None:
            positions = positions_from_attention_mask(None, *ids.shape, ids.device)
        work = prefix_view(context.source_cache, ids.shape[1] - 1)  # read, never written: appends go to a view
        logits = context.source(
            input_ids=ids[:, -1:],
            attention_mask=mask,
            position_ids=positions[:, -1:],
            use_cache=True,
            **cache_kwargs(work),
        ).logits[:, -1]
        first = logits.float().topk(min(self.branches, logits.shape[-1]), dim=-1).indices  # (batch, branches)
        branch = DraftAttentionStrategy(
            draft_tokens=self.draft_tokens - 1,
            last_tokens=self.last_tokens + 1,  # the forced first token's own query
            stop_at_eos=self.stop_at_eos,
        )
        # every branch of every row drafts as one row of a batch (row r's branches are rows r * k .. r * k + k - 1)
        count = first.shape[1]
        rows = torch.arange(context.batch, device=ids.device).repeat_interleave(count)
        following = context.position_ids[rows, -1:] + 1
        extended = RequestContext(
            target=context.target,
            cache=context.cache,
            input_ids=torch.cat([ids[rows], first.reshape(-1, 1).to(ids.device)], dim=1),
            attention_mask=torch.cat([mask[rows], mask.new_ones(len(rows), 1)], dim=1),
            position_ids=torch.cat([context.position_ids[rows], following], dim=1),
            candidates=context.candidates[rows],
            source=context.source,
            source_cache=row_cache(context.source_cache, rows),
            source_position_ids=torch.cat([positions[rows], positions[rows, -1:] + 1], dim=1),
        )
        mass = branch.score(extended)  # (batch * branches, length)
        return mass.view(context.batch, count, -1).sum(1)


__all__ = ["DraftBranchesStrategy"]
