"""The `confident_draft` probe: draft verification weighted by the source's confidence."""

from __future__ import annotations

import torch

from .base import RequestContext, register_probe
from .draft_agreement import DraftAgreementProbe


@register_probe
class ConfidentDraftProbe(DraftAgreementProbe):
    """Draft verification weighted by the source's confidence: the mean over the `tokens` draft tokens of
    `[target argmax != draft token] * p_source(draft token)`. A disagreement on a token the source itself was unsure of
    (a question neither model can answer) counts little; one on a token the source was sure of counts fully. Same cost
    as `draft_agreement`; an exact mapping scores 0.
    """

    name = "confident_draft"

    @torch.no_grad()
    def score(self, context: RequestContext) -> torch.Tensor:
        disagree, confidence = self.verify(context)
        return (disagree * confidence).mean(-1)


__all__ = ["ConfidentDraftProbe"]
