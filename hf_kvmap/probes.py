"""Probes: cheap checks, run on a mapped cache before it is served, that predict whether the handoff will change the
target's answer.

A probe reads a [`ProbeContext`] (the models, the prompt, the target-side cache of every prompt token but the last)
and returns one *risk* per row: higher means the answer generated on the mapped cache is more likely to differ from
the one the target would give after its own prefill. [`handoff`](hf_kvmap.handoff.handoff) compares the risk with a
threshold calibrated for the mapper (stored in `MapperConfig.handoff_probe`). A probe leaves both caches as it found
them (same length, same contents).

A new probe is one class and one line:

```python
>>> from hf_kvmap.probes import Probe, register_probe
>>> @register_probe
... class Zero(Probe):
...     name = "zero"
...
...     def score(self, context):
...         return context.input_ids.new_zeros(context.input_ids.shape[0], dtype=torch.float32)
```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers.cache_utils import Cache

from ._compat import cache_kwargs, output_cache
from .repair.attention import prefix_view
from .repair.draft import Draft

#: name -> probe class; filled by `register_probe`.
PROBES: dict[str, type[Probe]] = {}


def register_probe(cls: type[Probe]) -> type[Probe]:
    """Class decorator adding a [`Probe`] subclass to `PROBES` under its `name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty `name` to be registered.")
    if cls.name in PROBES and PROBES[cls.name] is not cls:
        raise ValueError(f"A probe named {cls.name!r} is already registered ({PROBES[cls.name].__name__}).")
    PROBES[cls.name] = cls
    return cls


@dataclass
class ProbeContext:
    r"""
    What a probe may read. Built by `handoff` after the mapping and before the decision.

    Args:
        source, target (`PreTrainedModel`): the two causal LMs.
        input_ids (`torch.Tensor`): `(batch, T)` prompt (left padding allowed).
        attention_mask (`torch.Tensor`): `(batch, T)`, ones where there is a token.
        position_ids (`torch.Tensor`): `(batch, T)` positions derived from the mask as `generate` does.
        cache (`Cache`): the target-side cache of the first `T - 1` tokens: the mapped `T - hold_back` tokens, then the
            `hold_back - 1` tokens the target ran itself.
        source_cache (`Cache`): the source's cache of all `T` prompt tokens.
        hold_back (`int`): how many final prompt tokens were held back from the mapping.
        tail_logits (`torch.Tensor`, *optional*): `(batch, hold_back - 1, vocab)` target logits on the held-back
            tokens it ran (they predict the tokens at columns `T - hold_back + 1 .. T - 1`); `None` for `hold_back=1`.
        drafts (`dict[str, Draft]`): the greedy drafts decoded for this request so far, by role (`draft`).
        source_position_ids (`torch.Tensor`, *optional*): `(batch, T)` positions `source_cache` was built at (a
            plain forward's `0 .. T-1` differ from `position_ids` in left-padded rows); defaults to `position_ids`.
    """

    source: torch.nn.Module
    target: torch.nn.Module
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    cache: Cache
    source_cache: Cache
    hold_back: int = 1
    tail_logits: torch.Tensor | None = None
    drafts: dict[str, Draft] = field(default_factory=dict)
    source_position_ids: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]

    def draft(self, role: str) -> Draft:
        """The greedy draft of the `"source"` (on `source_cache`) or of the `"target"` (on the mapped `cache`) after
        the prompt ([`~hf_kvmap.repair.Draft`]), decoded once per request as far as its readers ask: the probes, and
        then a repair strategy that drafts (`draft_attention` continues the source's)."""
        if role not in ("source", "target"):
            raise ValueError(f"role={role!r}: a draft is the 'source''s or the 'target''s.")
        if role not in self.drafts:
            if role == "source":
                positions = self.position_ids if self.source_position_ids is None else self.source_position_ids
                model, cache = self.source, self.source_cache
            else:
                positions, model, cache = self.position_ids, self.target, self.cache
            self.drafts[role] = Draft(model, cache, self.input_ids, self.attention_mask, positions)
        return self.drafts[role]

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]


class Probe:
    r"""
    Base class of the probes. Subclasses set `name` (the registry key) and implement `score`.

    Args:
        tokens (`int`, *optional*, defaults to the class's `default_tokens`): the probe's size (what it counts depends
            on the probe; `target_tokens` turns it into the number of tokens the target runs).
    """

    name: ClassVar[str] = ""
    #: tokens a probe reads by default
    default_tokens: ClassVar[int] = 4
    #: whether `score` runs the source model (then a cache the caller prefilled must still be at hand)
    needs_source: ClassVar[bool] = False
    #: whether an exact mapping (the target's own cache, source = target) scores 0 by construction
    exact_scores_zero: ClassVar[bool] = False

    def __init__(self, tokens: int | None = None):
        tokens = self.default_tokens if tokens is None else tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"{type(self).__name__}: tokens={tokens!r} must be a positive integer.")
        self.tokens = tokens

    @property
    def hold_back(self) -> int:
        """Final prompt tokens the mapping must leave to the target (1: only the last one, as `from_source`)."""
        return 1

    def settings(self) -> dict[str, Any]:
        """What `probe_from_dict` needs to rebuild this probe."""
        return {"name": self.name, "tokens": self.tokens}

    def target_tokens(self, length: int) -> int:
        """Tokens the target processes for this probe beyond what serving needs anyway, at prompt length `length`."""
        return self.tokens

    def score(self, context: ProbeContext) -> torch.Tensor:
        """`(batch,)` float risks; higher means the handoff is more likely to change the answer."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tokens={self.tokens})"


def probe_from_dict(settings: dict[str, Any] | str) -> Probe:
    """Build a registered probe from `{"name": ..., "tokens": ...}` (or just its name)."""
    if isinstance(settings, str):
        settings = {"name": settings}
    settings = dict(settings)
    name = settings.pop("name", None)
    if name not in PROBES:
        raise ValueError(f"Unknown probe {name!r}; registered probes: {', '.join(sorted(PROBES))}.")
    return PROBES[name](**settings)


# ------------------------------------------------------------------------------------------------ helpers


def _extend_mask(mask: torch.Tensor, extra: int) -> torch.Tensor:
    return torch.cat([mask, mask.new_ones(mask.shape[0], extra)], dim=1)


@torch.no_grad()
def _run(model, ids, cache, mask, positions) -> torch.Tensor:
    """Logits of `ids` `(batch, n)` appended to `cache`; `mask` covers cache + ids; `positions` `(batch, n)`."""
    return model(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache_kwargs(cache)
    ).logits.float()


# ------------------------------------------------------------------------------------------------- probes


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

    def score(self, context: ProbeContext) -> torch.Tensor:
        if context.tail_logits is None or context.tail_logits.shape[1] == 0:
            return torch.zeros(context.batch)
        held = context.tail_logits.shape[1]
        targets = context.input_ids[:, -held:]
        mask = context.attention_mask[:, -held:].float()
        nll = -torch.log_softmax(context.tail_logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return (nll * mask).sum(-1) / mask.sum(-1).clamp_min(1)


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
    def score(self, context: ProbeContext) -> torch.Tensor:
        disagree, _ = self.verify(context)
        return disagree.mean(-1)

    @torch.no_grad()
    def verify(self, context: ProbeContext) -> tuple[torch.Tensor, torch.Tensor]:
        """`(disagree, confidence)`, each `(batch, tokens)`: whether the target's argmax on the mapped cache differs
        from each draft token, and the source's probability of that draft token."""
        steps = self.tokens
        # the source drafts from the last prompt token, as generation would (shared with a repair that drafts)
        source_draft = context.draft("source")
        draft = source_draft.tokens(steps).to(context.input_ids.device)
        confidence = source_draft.top2(steps)[..., 0].cpu()  # the drafted token is the most probable one
        ids = torch.cat([context.input_ids[:, -1:], draft[:, :-1]], dim=1)
        mask = _extend_mask(context.attention_mask, steps - 1)
        positions = context.position_ids[:, -1:] + torch.arange(steps, device=ids.device)
        logits = _run(context.target, ids, prefix_view(context.cache, context.length - 1), mask, positions)
        return (logits.argmax(-1).to(draft.device) != draft).float().cpu(), confidence


@register_probe
class ConfidentDraftProbe(DraftAgreementProbe):
    """Draft verification weighted by the source's confidence: the mean over the `tokens` draft tokens of
    `[target argmax != draft token] * p_source(draft token)`. A disagreement on a token the source itself was unsure of
    (a question neither model can answer) counts little; one on a token the source was sure of counts fully. Same cost
    as `draft_agreement`; an exact mapping scores 0.
    """

    name = "confident_draft"

    @torch.no_grad()
    def score(self, context: ProbeContext) -> torch.Tensor:
        disagree, confidence = self.verify(context)
        return (disagree * confidence).mean(-1)


@register_probe
class LookaheadMarginProbe(Probe):
    """The target decodes its first `tokens` answer tokens greedily on the mapped cache. Risk: one minus the smallest
    top-1 minus top-2 probability margin among those steps (a retrieval that went wrong is rarely confident).

    Cost: `tokens` target decoding steps (they are the first tokens the user would receive).
    """

    name = "lookahead_margin"

    @torch.no_grad()
    def score(self, context: ProbeContext) -> torch.Tensor:
        top = context.draft("target").top2(self.tokens)
        return 1.0 - (top[..., 0] - top[..., 1]).amin(-1)


@register_probe
class PrefixAuditProbe(Probe):
    """The target prefills its first `tokens` prompt tokens itself (a cost of `tokens / T` of its prefill) and compares
    its own keys and values with the mapped ones there. Risk: the largest relative error `|mapped - own| / |own|` over
    layers and K/V, on real (unpadded) tokens. An exact mapping scores 0.
    """

    name = "prefix_audit"
    default_tokens = 32
    exact_scores_zero = True

    def target_tokens(self, length: int) -> int:
        return min(self.tokens, length - 1)

    @torch.no_grad()
    def score(self, context: ProbeContext) -> torch.Tensor:
        mapped_tokens = context.length - context.hold_back
        width = min(self.tokens, mapped_tokens)
        mask = context.attention_mask[:, :width]
        own = output_cache(
            context.target(
                input_ids=context.input_ids[:, :width],
                attention_mask=mask,
                position_ids=context.position_ids[:, :width],
                use_cache=True,
            )
        )
        weight = mask[:, None, :, None].float()
        risk = torch.zeros(context.batch)
        for own_layer, layer in zip(own.layers, context.cache.layers):
            for mine, theirs in ((layer.keys, own_layer.keys), (layer.values, own_layer.values)):
                theirs = theirs.float()
                diff = ((mine[:, :, :width].float().to(theirs.device) - theirs) * weight).pow(2).sum((1, 2, 3))
                norm = (theirs * weight).pow(2).sum((1, 2, 3)).clamp_min(1e-30)
                risk = torch.maximum(risk, (diff / norm).sqrt().cpu())
        return risk


@register_probe
class LinearProbe(Probe):
    """A weighted sum of other probes' risks: `bias + sum_i weights[i] * risk_i` (a logistic model's logit when the
    weights come from `fit_linear_probe`). Its components must all hold back one token (they share one context).

    Args:
        components (`list[dict]`): the settings of the combined probes (`{"name": ..., "tokens": ...}`).
        weights (`list[float]`): one weight per component.
        bias (`float`, *optional*, defaults to 0).
    """

    name = "linear"

    def __init__(self, components: list[dict], weights: list[float], bias: float = 0.0):
        self.components = [probe_from_dict(settings) for settings in components]
        if not self.components or len(weights) != len(self.components):
            raise ValueError(f"LinearProbe needs one weight per component; got {len(weights)} for {len(components)}.")
        if any(component.hold_back != 1 for component in self.components):
            raise ValueError("LinearProbe components must hold back one token (tail probes cannot share the context).")
        self.weights, self.bias = [float(w) for w in weights], float(bias)
        self.tokens = sum(component.tokens for component in self.components)

    def settings(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "components": [component.settings() for component in self.components],
            "weights": self.weights,
            "bias": self.bias,
        }

    def target_tokens(self, length: int) -> int:
        return sum(component.target_tokens(length) for component in self.components)

    def score(self, context: ProbeContext) -> torch.Tensor:
        risk = torch.full((context.batch,), self.bias)
        for weight, component in zip(self.weights, self.components):
            risk = risk + weight * component.score(context).float().cpu()
        return risk

    def __repr__(self) -> str:
        return f"LinearProbe({[repr(c) for c in self.components]}, weights={self.weights}, bias={self.bias})"


def fit_linear_probe(
    components: list[dict], risks: list[list[float]], positives: list[bool], l2: float = 1e-2, steps: int = 50
) -> LinearProbe:
    """Fit a [`LinearProbe`] by L2-regularized logistic regression (Newton steps, float64) of `positives` (the handoff
    changed the answer) on the components' measured risks `risks[item][component]`."""
    x = torch.tensor(risks, dtype=torch.float64)
    y = torch.tensor([float(p) for p in positives], dtype=torch.float64)
    if x.dim() != 2 or x.shape != (len(positives), len(components)):
        raise ValueError(f"risks must be (items, components) = ({len(positives)}, {len(components)}).")
    mean, scale = x.mean(0), x.std(0).clamp_min(1e-12)
    design = torch.cat([torch.ones(len(y), 1, dtype=torch.float64), (x - mean) / scale], dim=1)
    beta = torch.zeros(design.shape[1], dtype=torch.float64)
    penalty = torch.diag(torch.tensor([0.0] + [l2] * len(components), dtype=torch.float64)) * len(y)
    for _ in range(steps):
        p = torch.sigmoid(design @ beta)
        gradient = design.T @ (p - y) + penalty @ beta
        hessian = design.T @ (design * (p * (1 - p)).unsqueeze(1)) + penalty
        step = torch.linalg.solve(hessian + 1e-9 * torch.eye(len(beta), dtype=torch.float64), gradient)
        beta = beta - step
        if step.abs().max() < 1e-10:
            break
    weights = beta[1:] / scale
    bias = beta[0] - (weights * mean).sum()
    return LinearProbe(components, weights.tolist(), float(bias))
