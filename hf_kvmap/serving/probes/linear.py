"""The `linear` probe: a weighted sum of other probes' risks, and its logistic fit (`fit_linear_probe`)."""

from __future__ import annotations

from typing import Any

import torch

from .base import Probe, RequestContext, probe_from_dict, register_probe


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

    def score(self, context: RequestContext) -> torch.Tensor:
        risk = torch.full((context.batch,), self.bias)
        for weight, component in zip(self.weights, self.components):
            risk = risk + weight * component.risks(context).cpu()
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


__all__ = ["LinearProbe", "fit_linear_probe"]
