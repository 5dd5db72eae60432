"""The `draft_agreement` probe: the target verifies the source's greedy draft on the mapped cache."""

from __future__ import annotations

import torch

from ...cache_views import prefix_view
from .base import Probe, RequestContext, extend_mask, register_probe, run_appended


@register_probe
class DraftAgreementProbe(Probe):
    """Speculative verification: the source drafts the first `tokens` answer tokens greedily on its own cache; the
    target scores the draft on the mapped cache in one forward. Risk: the fraction of draft tokens that are not the
    target's argmax.

    Cost: `tokens` target tokens in one forward, plus `tokens` greedy steps of the (smaller) source. When the source
    answers as the target does, disagreement means the mapped cache changed the answer; when the two models disagree
    on their own (a weak source), the probe raises false alarms.
    """

    name = "draft_agreement"
    needs_source = True
    exact_scores_zero = True

    @torch.no_grad()
    def score(self, context: RequestContext) -> torch.Tensor:
        disagree, _ = self.verify(context)
        return disagree.mean(-1)

    @torch.no_grad()
    def verify(self, context: RequestContext) -> tuple[torch.Tensor, torch.Tensor]:
        """`(disagree, confidence)`, each `(batch, tokens)`: whether the target's argmax on the mapped cache differs
        from each draft token, and the source's probability of that draft token."""
        steps = self.tokens
        # the source drafts from the last prompt token, as generation would (shared with a repair that drafts)
        source_draft = context.draft("source")
        draft = source_draft.tokens(steps).to(context.input_ids.device)
        confidence = source_draft.top2(steps)[..., 0].cpu()  # the drafted token is the most probable one
        ids = torch.cat([context.input_ids[:, -1:], draft[:, :-1]], dim=1)
        mask = extend_mask(context.attention_mask, steps - 1)
        positions = context.position_ids[:, -1:] + torch.arange(steps, device=ids.device)
        logits = run_appended(context.target, ids, prefix_view(context.cache, context.length - 1), mask, positions)
        return (logits.argmax(-1).to(draft.device) != draft).float().cpu(), confidence


__all__ = ["DraftAgreementProbe"]
