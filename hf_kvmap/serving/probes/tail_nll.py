"""The `tail_nll` probe: the target's NLL of the held-back prompt tokens on the mapped cache."""

from __future__ import annotations

import torch

from .base import Probe, RequestContext, register_probe


@register_probe
class TailNLLProbe(Probe):
    """The target's mean negative log-likelihood of the final prompt tokens, read on the mapped cache.

    The mapping holds back `tokens` final prompt tokens; the target runs them itself (it would run the last one anyway),
    so the probe costs `tokens - 1` target tokens and nothing else. Risk: mean NLL (nats) of the `tokens - 1` tokens the
    target predicts there.
    """

    name = "tail_nll"
    default_tokens = 16

    @property
    def hold_back(self) -> int:
        return self.tokens

    def target_tokens(self, length: int) -> int:
        return min(self.tokens, length) - 1

    def score(self, context: RequestContext) -> torch.Tensor:
        if context.tail_logits is None or context.tail_logits.shape[1] == 0:
            return torch.zeros(context.batch)
        held = context.tail_logits.shape[1]
        targets = context.input_ids[:, -held:]
        mask = context.attention_mask[:, -held:].float()
        nll = -torch.log_softmax(context.tail_logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return (nll * mask).sum(-1) / mask.sum(-1).clamp_min(1)


__all__ = ["TailNLLProbe"]
