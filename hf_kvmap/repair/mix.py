"""`mix`: a weighted vote of other strategies. Each component's scores become percentile ranks among the row's
candidates (so scales never matter), and the weighted mean of the ranks orders the positions.

Why: no single cheap signal finds every position that matters. The attention of the prompt's last tokens finds the
facts a question reads but not the recent context every continuation reads; the tail finds the latter; a deviation
check finds where the map is worst whatever is read. A vote keeps each component's strongest positions near the top.
"""

from __future__ import annotations

import torch

from .base import RequestContext, Strategy, percentile_ranks, register_strategy, strategy_from_dict

#: the default vote: the target's own reading of the prompt and the recent context
DEFAULT_COMPONENTS = {"target_attention": 1.0, "tail": 1.0}


@register_strategy
class MixStrategy(Strategy):
    """Scores each cached position by the weighted mean of its percentile ranks under `components`.

    Args:
        components (`dict[str, float]` or `list[dict]`, *optional*, defaults to `DEFAULT_COMPONENTS`): strategy name
            -> weight, or a list of `{"name": ..., "weight": w, **options}` settings (weights default to 1).
    """

    name = "mix"

    def __init__(self, components: dict[str, float] | list[dict] | None = None):
        components = DEFAULT_COMPONENTS if components is None else components
        if isinstance(components, dict):
            components = [{"name": name, "weight": weight} for name, weight in components.items()]
        if not isinstance(components, list) or not components:
            raise ValueError("mix needs at least one component strategy.")
        self.components = []
        for entry in components:
            entry = dict(entry)
            weight = entry.pop("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
                raise ValueError(f"mix weight {weight!r} of {entry.get('name')!r} must be a non-negative number.")
            if entry.get("name") == self.name:
                raise ValueError("mix cannot contain itself.")
            self.components.append((strategy_from_dict(entry), float(weight)))
        self.needs_source = any(strategy.needs_source for strategy, _ in self.components)

    def settings(self) -> dict:
        return {
            "name": self.name,
            "components": [{**strategy.settings(), "weight": weight} for strategy, weight in self.components],
        }

    def score(self, context: RequestContext) -> torch.Tensor:
        total = torch.zeros(context.batch, context.length, dtype=torch.float32)
        for strategy, weight in self.components:
            if weight:
                total += weight * percentile_ranks(strategy.score(context).cpu(), context.candidates.cpu())
        return total
