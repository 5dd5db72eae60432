"""What every repair strategy shares: the [`RequestContext`] it reads, the [`Strategy`] base class, the one registry
(`STRATEGIES`) and the budget and top-k that turn a strategy's scores into the positions the target recomputes.

A new strategy is one file with one class and one decorator line:

```python
>>> import torch
>>> from hf_kvmap.repair import Strategy, register_strategy
>>> @register_strategy
... class Head(Strategy):
...     name = "head"
...
...     def score(self, context):
...         return -torch.arange(context.length, dtype=torch.float32).expand(context.batch, -1)
```
"""

from __future__ import annotations

import json
import math
from typing import Any, ClassVar

import torch

from ..deprecation import deprecated_names
from ..registry import registrar
from ..request_context import RequestContext, legacy_context
from ..scoring import Scorer, from_settings

#: name -> strategy class; filled by `register_strategy`.
STRATEGIES: dict[str, type[Strategy]] = {}


#: Class decorator adding a [`Strategy`] subclass to `STRATEGIES` under its `name`.
register_strategy = registrar(STRATEGIES, "a repair strategy")


class Strategy(Scorer):
    r"""
    Base class of the repair strategies, on the one scoring contract ([`~hf_kvmap.scoring.Scorer`]). Subclasses set
    `name` (the registry key), take their options as keyword arguments and implement `score`: one float per cached
    position, higher meaning "recompute first" (its importance). The base turns the scores into positions (`select`),
    so a strategy never handles budgets, padding or ties.
    """

    kind: ClassVar[str] = "repair strategy"

    def score(self, context: RequestContext) -> torch.Tensor:
        """`(batch, context.length)` float scores; only the candidates' are read."""
        raise NotImplementedError

    def select(self, context: RequestContext, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The `counts[row]` best-scored candidates of every row (`select_positions` of `score`)."""
        if not any(counts):
            return select_positions(None, context.candidates, counts, context.attention_mask[:, : context.length])
        scores = self.checked_scores(context, (context.batch, context.length), "(batch, cached positions)")
        return select_positions(scores, context.candidates, counts, context.attention_mask[:, : context.length])

    def __eq__(self, other: object) -> bool:
        """Two strategies are equal when their settings are (what `strategy_from_dict` rebuilds one from)."""
        return isinstance(other, Strategy) and self.settings() == other.settings()

    def __hash__(self) -> int:
        return hash(json.dumps(self.settings(), sort_keys=True, default=str))


def strategy_from_text(text: str) -> dict[str, Any]:
    """A strategy's settings from its text, `name[:option=value,...]` (each value read as JSON where it is one, else
    kept as text): `query_overlap:fill=draft_branches,after=24` -> `{"name": "query_overlap", "fill":
    "draft_branches", "after": 24}`. The one syntax the command line, the rungs and the benchmarks write."""
    name, _, options = text.strip().partition(":")
    settings: dict[str, Any] = {"name": name}
    for option in filter(None, (part.strip() for part in options.split(","))):
        key, equals, raw = option.partition("=")
        if not equals or not key:
            raise ValueError(f"Repair strategy {text!r}: option {option!r} is not key=value.")
        try:
            settings[key] = json.loads(raw)
        except json.JSONDecodeError:
            settings[key] = raw
    return settings


def strategy_from_dict(settings: Strategy | dict[str, Any] | str) -> Strategy:
    """A registered strategy from `{"name": ..., **options}`, its name, or its text (`name:option=value,...`,
    `strategy_from_text`); a `Strategy` is returned as is."""
    if isinstance(settings, Strategy):
        return settings
    if isinstance(settings, str):
        settings = strategy_from_text(settings)
    return from_settings(STRATEGIES, settings, Strategy, "strategies")


def budget_counts(candidates: torch.Tensor, fraction: float | None = None, tokens: int | None = None) -> list[int]:
    """Positions to recompute per row: `floor(fraction * candidates)` (never more than the fraction asked for) or
    `min(tokens, candidates)`."""
    available = candidates.sum(-1).tolist()
    if fraction is not None:
        return [min(n, math.floor(fraction * n + 1e-9)) for n in available]
    return [min(tokens, n) for n in available]


def select_positions(
    scores: torch.Tensor | None, candidates: torch.Tensor, counts: list[int], token_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""
    The `counts[row]` highest-scored candidates of each row, as one `(batch, n)` index tensor for a batched recompute.

    Rows that recompute fewer than `n = max(counts)` positions are filled with left-padding slots (`token_mask == 0`),
    whose contents no query reads; `valid` marks the real selections. Ties go to the earlier position.

    Args:
        scores (`torch.Tensor` or `None`): `(batch, length)` floats (`None` only when every count is 0).
        candidates (`torch.Tensor`): `(batch, length)` bool.
        counts (`list[int]`): positions per row, each at most the row's candidates.
        token_mask (`torch.Tensor`): `(batch, length)` 1 on tokens, 0 on left padding.

    Returns:
        `(positions, valid)`: `(batch, n)` long (each row's selections ascending, then its filler slots) and bool.
    """
    batch, length = candidates.shape
    width = max(counts) if counts else 0
    device = candidates.device
    positions = torch.zeros(batch, width, dtype=torch.long, device=device)
    valid = torch.zeros(batch, width, dtype=torch.bool, device=device)
    if scores is not None and not bool(torch.isfinite(scores[candidates]).all()):
        raise ValueError("A repair strategy returned NaN or infinite scores on candidate positions.")
    for row, count in enumerate(counts):
        if count == 0 and width == 0:
            continue
        pool = candidates[row].nonzero().squeeze(-1)
        if count > pool.numel():
            raise ValueError(f"Row {row} has {pool.numel()} candidate positions; {count} were asked for.")
        if count:
            order = torch.sort(scores[row, pool].float(), descending=True, stable=True).indices
            chosen = pool[order[:count]].sort().values
        else:
            chosen = pool[:0]
        filler = (token_mask[row] == 0).nonzero().squeeze(-1)[: width - count]
        if filler.numel() < width - count:
            raise ValueError(
                f"Row {row} recomputes {count} positions and has {filler.numel()} padding slots to fill the batch's "
                f"{width}; repair such rows one at a time."
            )
        positions[row] = torch.cat([chosen, filler.to(device)])
        valid[row, :count] = True
    return positions, valid


def percentile_ranks(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Each candidate's rank among its row's candidates, scaled to `(0, 1]` (1: the highest score); 0 elsewhere."""
    ranks = torch.zeros_like(scores, dtype=torch.float32)
    for row in range(scores.shape[0]):
        pool = candidates[row].nonzero().squeeze(-1)
        if pool.numel():
            order = torch.sort(scores[row, pool].float(), stable=True).indices
            ranks[row, pool[order]] = torch.arange(1, pool.numel() + 1, dtype=torch.float32) / pool.numel()
    return ranks


__all__ = [
    "STRATEGIES",
    "RequestContext",
    "Strategy",
    "budget_counts",
    "percentile_ranks",
    "register_strategy",
    "select_positions",
    "strategy_from_dict",
    "strategy_from_text",
]

#: the old strategy context, `(target, cache, input_ids, attention_mask, position_ids, candidates, ...)` positionally
_RepairContext = legacy_context(
    "RepairContext",
    ("target", "cache", "input_ids", "attention_mask", "position_ids", "candidates", "source", "source_cache")
    + ("source_position_ids", "source_draft"),
)

#: the names before "strategy" was the one word and one context served every scorer (deprecated, go in 0.2)
DEPRECATED_NAMES = {
    "RepairContext": ("hf_kvmap.request_context.RequestContext", _RepairContext),
    "SELECTORS": "STRATEGIES",
    "Selector": "Strategy",
    "register_selector": "register_strategy",
    "selector_from_dict": "strategy_from_dict",
}
__getattr__ = deprecated_names(__name__, globals(), DEPRECATED_NAMES)
