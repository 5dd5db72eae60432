"""The guard ladder: per request (per row of a batch), serve the mapped cache, repair it with the fraction the probe's
risk calls for, or fall back to the target's full prefill.

```python
ladder = GuardLadder(
    probe={"name": "draft_agreement", "tokens": 2},
    strategy={"name": "source_attention", "last_tokens": 16},
    rungs=[LadderRung(max_risk=0.0, fraction=0.0), LadderRung(max_risk=0.5, fraction=0.3)],
)
cache, report = handoff(source, target, mapper, input_ids, ladder=ladder)   # or stored: mapper.config.handoff_ladder
```

A row whose risk is at most the first rung's `max_risk` gets that rung's repair fraction (0: the mapped cache as it
is), and so on up the rungs; a risk above the last rung's `max_risk` falls back. [`calibrate_ladder`] chooses the rungs
on measured items (`hf-kvmap calibrate-ladder` measures them, `hf_kvmap.ladder_items`): the cheapest ladder whose
changed answers stay within a budget on every task.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from ._compat import cache_kwargs, output_cache
from .probes import ProbeContext, probe_from_dict
from .repair import RepairConfig, repair_cache, selector_from_dict
from .repair.attention import as_layer

#: the rung name of a row that falls back to the target's own prefill
FALLBACK = "fallback"


@dataclass
class LadderRung:
    r"""
    One rung of a [`GuardLadder`].

    Args:
        max_risk (`float`): the highest probe risk this rung takes (rows above it go up the ladder).
        fraction (`float`): share of the row's mapped tokens the target recomputes, in `[0, 1)` (0: serve the mapped
            cache as it is).
    """

    max_risk: float
    fraction: float

    def __post_init__(self):
        for name in ("max_risk", "fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"LadderRung {name}={value!r} must be a finite number.")
        if not 0.0 <= self.fraction < 1.0:
            raise ValueError(
                f"LadderRung fraction={self.fraction!r} must be in [0, 1): 0 serves the mapped cache, and a row that "
                "needs everything recomputed is the fallback above the last rung."
            )
        self.max_risk, self.fraction = float(self.max_risk), float(self.fraction)


@dataclass
class GuardLadder:
    r"""
    The rungs between the mapped cache and the target's full prefill, chosen per row by one probe's risk.

    Args:
        probe (`dict`): the probe's settings (`{"name": ..., "tokens": ...}`, `hf_kvmap.probes.PROBES`).
        strategy (`dict` or `str`): the repair strategy of the repairing rungs (`hf_kvmap.repair.SELECTORS`).
        rungs (`list[LadderRung]`): by increasing `max_risk` and increasing `fraction`; may be empty (every row falls
            back).
        calibration (`dict`, *optional*): what [`calibrate_ladder`] measured (items, costs, changed answers per task).

    Example:

    ```python
    >>> from hf_kvmap.ladder import GuardLadder, LadderRung
    >>> ladder = GuardLadder({"name": "tail_nll", "tokens": 8}, "tail", [LadderRung(0.5, 0.0), LadderRung(2.0, 0.2)])
    >>> [ladder.fraction_for(risk) for risk in (0.1, 1.0, 3.0)]
    [0.0, 0.2, None]
    ```
    """

    probe: dict[str, Any]
    strategy: dict[str, Any] | str
    rungs: list[LadderRung] = field(default_factory=list)
    calibration: dict[str, Any] | None = None

    def __post_init__(self):
        self.probe = probe_from_dict(self.probe).settings()  # unknown probes and options raise here
        self.strategy = selector_from_dict(self.strategy).settings()
        self.rungs = [rung if isinstance(rung, LadderRung) else LadderRung(**rung) for rung in self.rungs]
        for low, high in zip(self.rungs, self.rungs[1:]):
            if not (high.max_risk > low.max_risk and high.fraction > low.fraction):
                raise ValueError(
                    f"Ladder rungs must rise in both max_risk and fraction; got {low} then {high}. Drop the rung "
                    "that does not."
                )

    def fraction_for(self, risk: float) -> float | None:
        """The repair fraction of a row with this risk, or `None` for the fallback (a NaN risk falls back)."""
        for rung in self.rungs:
            if risk <= rung.max_risk:
                return rung.fraction
        return None

    def plan(self, risks: Sequence[float] | torch.Tensor) -> list[float | None]:
        """`fraction_for` of every row."""
        return [self.fraction_for(float(risk)) for risk in risks]

    def to_dict(self) -> dict[str, Any]:
        return {
            "probe": dict(self.probe),
            "strategy": dict(self.strategy),
            "rungs": [{"max_risk": rung.max_risk, "fraction": rung.fraction} for rung in self.rungs],
            "calibration": self.calibration,
        }

    @classmethod
    def from_dict(cls, settings: GuardLadder | dict[str, Any]) -> GuardLadder:
        """A ladder from `to_dict()`'s output (a `GuardLadder` is returned as is)."""
        if isinstance(settings, GuardLadder):
            return settings
        if not isinstance(settings, dict):
            raise TypeError(f"A ladder is a GuardLadder or a dict of its fields; got {type(settings).__name__}.")
        unknown = set(settings) - {"probe", "strategy", "rungs", "calibration"}
        if unknown:
            raise ValueError(f"Unknown ladder settings {sorted(unknown)}; a ladder has probe, strategy, rungs.")
        missing = {"probe", "strategy", "rungs"} - set(settings)
        if missing:
            raise ValueError(f"The ladder settings lack {sorted(missing)}.")
        return cls(**settings)


def rung_name(fraction: float | None) -> str:
    """`"mapped"`, `"repair:<fraction>"` or `"fallback"`."""
    if fraction is None:
        return FALLBACK
    return "mapped" if fraction == 0.0 else f"repair:{fraction:g}"


# ------------------------------------------------------------------------------------------------ serving


def _row_cache(cache: Cache, rows: torch.Tensor) -> Cache:
    return Cache(layers=[as_layer(layer.keys[rows], layer.values[rows]) for layer in cache.layers])


def _write_rows(cache: Cache, rows: torch.Tensor, part: Cache) -> None:
    for layer, new in zip(cache.layers, part.layers):
        index = rows.to(layer.keys.device)
        layer.keys[index] = new.keys.to(layer.keys.device, layer.keys.dtype)
        layer.values[index] = new.values.to(layer.values.device, layer.values.dtype)


@torch.no_grad()
def serve_rows(
    context: ProbeContext,
    fractions: Sequence[float | None],
    strategy: dict[str, Any] | str,
    *,
    source_position_ids: torch.Tensor | None = None,
) -> list[dict[str, Any]]:
    r"""
    Give every row of `context.cache` its rung, in place: rows with fraction 0 keep the mapped cache, rows with a
    fraction have the target recompute that share of their mapped tokens ([`~hf_kvmap.repair.repair_cache`], rows of
    one fraction in one batch), and `None` rows get the target's own prefill. Then, when the probe held back more than
    the last token, the target re-runs the held-back tokens on the result, so they attend to what is served.

    Args:
        context ([`~hf_kvmap.probes.ProbeContext`]): what the handoff built (its `cache` covers `T - 1` tokens).
        fractions (sequence of `float` or `None`): one per row.
        strategy (`dict` or `str`): the repair strategy.
        source_position_ids (`torch.Tensor`, *optional*): positions the source cache was built at; defaults to the
            context's (`ProbeContext.source_position_ids`).

    Returns:
        One dict per row: `rung` (`"mapped"`, `"repair:<f>"`, `"fallback"`), `fraction`, and `recomputed` tokens.
    """
    ids, mask, positions, cache = context.input_ids, context.attention_mask, context.position_ids, context.cache
    if source_position_ids is None:
        source_position_ids = context.source_position_ids
    batch, length = ids.shape
    if len(fractions) != batch:
        raise ValueError(f"{len(fractions)} rung fractions for a batch of {batch} rows.")
    mapped = length - context.hold_back
    rows = [{"rung": rung_name(f), "fraction": f, "recomputed": 0} for f in fractions]
    if all(f == 0.0 for f in fractions):
        return rows
    tail = cache.get_seq_length() - mapped
    if tail:
        cache.crop(-tail)
    selector = selector_from_dict(strategy)
    for fraction in sorted({f for f in fractions if f not in (None, 0.0)}):
        index = torch.tensor([i for i, f in enumerate(fractions) if f == fraction], device=ids.device)
        part = _row_cache(cache, index)
        source_part = source_draft = None
        if selector.needs_source:
            source_part = _row_cache(context.source_cache, index)
            if "source" in context.drafts:  # the probe's draft: a strategy that drafts continues it
                source_draft = context.drafts["source"].rows(index)
        repair_cache(
            context.target,
            part,
            ids[index],
            RepairConfig(selector, fraction=fraction),
            attention_mask=mask[index],
            position_ids=positions[index],
            source=context.source,
            source_cache=source_part,
            source_position_ids=None if source_position_ids is None else source_position_ids[index],
            source_draft=source_draft,
        )
        _write_rows(cache, index, part)
        real = mask[index, :mapped].sum(-1).tolist()
        for i, n in zip(index.tolist(), real):
            rows[i]["recomputed"] = min(n, math.floor(fraction * n + 1e-9))
    fallback = [i for i, f in enumerate(fractions) if f is None]
    if fallback:
        index = torch.tensor(fallback, device=ids.device)
        own = output_cache(
            context.target(
                input_ids=ids[index, :mapped],
                attention_mask=mask[index, :mapped],
                position_ids=positions[index, :mapped],
                use_cache=True,
            )
        )
        _write_rows(cache, index, own)
        for i, n in zip(fallback, mask[index, :mapped].sum(-1).tolist()):
            rows[i]["recomputed"] = n
    if tail:
        context.target(
            input_ids=ids[:, mapped : length - 1],
            attention_mask=mask[:, : length - 1],
            position_ids=positions[:, mapped : length - 1],
            use_cache=True,
            **cache_kwargs(cache),
        )
    info = getattr(cache, "mapping_info", None)
    if isinstance(info, dict):
        info["ladder"] = {"rows": rows, "strategy": selector.settings()}
    return rows


# ------------------------------------------------------------------------------------------------ calibration


def ladder_outcome(
    fractions: Sequence[float | None],
    changed: dict[float, Sequence[bool]],
    costs: dict[float | str, float],
    groups: Sequence[str] | None = None,
) -> dict[str, Any]:
    """What serving `fractions` (one per item, `None` = fallback) gives on measured items: the share of changed answers
    served, the mean cost (relative to a prefill) and the net saving, overall and per group (task), and the share of
    items on each rung. `changed[f][i]`: item `i`'s answer differs from the target's own at fraction `f`; the fallback
    never changes an answer. `costs[f]` and `costs["fallback"]`: mean cost of each rung, every stage counted."""
    groups = list(groups) if groups is not None else ["all"] * len(fractions)

    def summary(index: list[int]) -> dict[str, Any]:
        n = max(len(index), 1)
        served_changed = sum(bool(changed[fractions[i]][i]) for i in index if fractions[i] is not None)
        cost = sum(costs[FALLBACK if fractions[i] is None else fractions[i]] for i in index) / n
        rungs: dict[str, float] = {}
        for i in index:
            rungs[rung_name(fractions[i])] = rungs.get(rung_name(fractions[i]), 0) + 1 / n
        return {
            "items": len(index),
            "changed_served": served_changed / n,
            "mean_cost": cost,
            "net_saving": 1.0 - cost,
            "rungs": {name: round(share, 6) for name, share in sorted(rungs.items())},
        }

    out = summary(list(range(len(fractions))))
    out["per_group"] = {g: summary([i for i, x in enumerate(groups) if x == g]) for g in sorted(set(groups))}
    return out


def changed_upper_bound(changed: int, items: int, confidence: float) -> float:
    """The one-sided Clopper-Pearson upper bound on the share of changed answers, having seen `changed` of `items`: the
    highest rate under which seeing at most `changed` still has probability at least `1 - confidence`.

    >>> round(changed_upper_bound(0, 59, 0.95), 4)  # none of 59 changed: the rate is below 5 % with 95 % confidence
    0.0495
    """
    if items < 1 or not 0 <= changed <= items:
        raise ValueError(f"changed={changed} of items={items}: need 0 <= changed <= items and items >= 1.")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must be in (0, 1), e.g. 0.9.")
    if changed == items:
        return 1.0

    def tail(p: float) -> float:  # P(X <= changed) for X ~ Binomial(items, p), summed in log space
        terms = [
            math.lgamma(items + 1)
            - math.lgamma(k + 1)
            - math.lgamma(items - k + 1)
            + k * math.log(p)
            + (items - k) * math.log1p(-p)
            for k in range(changed + 1)
        ]
        top = max(terms)
        return math.exp(top) * sum(math.exp(t - top) for t in terms)

    low, high = changed / items, 1.0  # tail() falls as p grows: bisect for tail(p) = 1 - confidence
    for _ in range(100):
        mid = (low + high) / 2
        if mid <= 0.0 or tail(mid) > 1.0 - confidence:
            low = mid
        else:
            high = mid
    return high


def changed_budget(items: int, max_changed: float, confidence: float | None = None) -> int:
    """The changed answers `items` calibration items of one task may show: `floor(max_changed * items)`, or with a
    `confidence`, the most whose [`changed_upper_bound`] stays within `max_changed` (-1 where even none would not:
    too few items to vouch for the budget, so the task's items can only fall back)."""
    if confidence is None:
        return math.floor(max_changed * items + 1e-9)
    budget = -1
    while budget < items and changed_upper_bound(budget + 1, items, confidence) <= max_changed:
        budget += 1
    return budget


def items_to_vouch(max_changed: float, confidence: float) -> int:
    """The fewest items of a task whose upper confidence bound can hold `max_changed` (none of them changed)."""
    if not 0.0 < max_changed < 1.0 or not 0.0 < confidence < 1.0:
        raise ValueError(f"max_changed={max_changed} and confidence={confidence} must both be in (0, 1).")
    n = max(1, math.ceil(math.log1p(-confidence) / math.log1p(-max_changed)))
    while changed_budget(n, max_changed, confidence) < 0:  # the closed form can fall short by a rounding
        n += 1
    return n


def calibrate_ladder(
    risks: Sequence[float],
    changed: dict[float, Sequence[bool]],
    costs: dict[float | str, float],
    *,
    probe: dict[str, Any] | str,
    strategy: dict[str, Any] | str,
    groups: Sequence[str] | None = None,
    max_changed: float = 0.05,
    confidence: float | None = None,
    provenance: dict[str, Any] | None = None,
) -> GuardLadder:
    r"""
    The cheapest ladder on measured items whose served changed answers stay within `max_changed` in every group.

    Items are sorted by risk; a ladder gives each item a rung that never goes down as the risk grows (items of equal
    risk share a rung). Among all such assignments (exact dynamic programming over the rungs measured, with the budget
    `floor(max_changed * items)` per group), the one of least total cost is kept; its rungs become thresholds at the
    highest risk each rung took, and a risk above the last one falls back.

    A budget met on the calibration items is a point estimate: on other items the same thresholds can serve more
    changed answers. With `confidence`, a group's budget is instead the most changed answers whose one-sided
    Clopper-Pearson upper bound on the rate stays within `max_changed` ([`changed_budget`]): at 5 % and 0.95, none of
    59 items, 1 of 93, 2 of 124. A group with too few items to vouch for the budget at all (fewer than 59 there) is
    served only the fallback, and so is every item of another group at or above its lowest risk. The bound is exact
    for thresholds fixed in advance; thresholds (and a probe) chosen on the same items make it somewhat optimistic, so
    replay the ladder on other items (`ladder_items.replay_ladder`) before trusting it.

    Args:
        risks (sequence of `float`): the probe's risk of every calibration item (on the mapped cache).
        changed (`dict[float, sequence of bool]`): per measured fraction (0.0 = the mapped cache), whether each item's
            answer differs from the target's own.
        costs (`dict`): the mean cost of each fraction and of `"fallback"`, relative to the target's prefill, with the
            probe and the mapping counted in each.
        probe, strategy: the probe the risks come from and the repair strategy the fractions were measured with.
        groups (sequence of `str`, *optional*): each item's task; the budget holds in each.
        max_changed (`float`, *optional*, defaults to 0.05): the share of changed answers a group may be served.
        confidence (`float`, *optional*): hold `max_changed` as an upper confidence bound at this level (e.g. 0.9)
            instead of on the calibration items alone.
        provenance (`dict`, *optional*): what the items were, recorded in `calibration`.

    Returns:
        A [`GuardLadder`] whose `calibration` holds the budget, the costs and `ladder_outcome` on these items.
    """
    n = len(risks)
    if n == 0:
        raise ValueError("calibrate_ladder needs at least one measured item.")
    if not 0.0 <= max_changed <= 1.0:
        raise ValueError(f"max_changed={max_changed} must be in [0, 1].")
    risks = [float(r) for r in risks]
    if not all(math.isfinite(r) for r in risks):
        raise ValueError("A calibration risk is NaN or infinite; measure the items again.")
    fractions = sorted(changed)
    for f in fractions:
        if len(changed[f]) != n:
            raise ValueError(f"changed[{f}] has {len(changed[f])} items; risks has {n}.")
        if f not in costs:
            raise ValueError(f"No cost for fraction {f}; pass costs for every measured fraction and 'fallback'.")
    if FALLBACK not in costs:
        raise ValueError("costs needs a 'fallback' entry (the prefill, with the probe and the mapping).")
    groups = list(groups) if groups is not None else ["all"] * n
    if len(groups) != n:
        raise ValueError(f"{len(groups)} groups for {n} items.")
    names = sorted(set(groups))
    if confidence is not None and not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must be in (0, 1), e.g. 0.9; or None for the budget on the items.")
    budget = {g: changed_budget(groups.count(g), max_changed, confidence) for g in names}
    blocked = {i for i, g in enumerate(groups) if budget[g] < 0}  # items of a group that cannot vouch: fallback only
    options: list[float | None] = [*fractions, None]
    option_cost = [costs[f] for f in fractions] + [costs[FALLBACK]]

    order = sorted(range(n), key=lambda i: risks[i])
    blocks: list[list[int]] = []
    for i in order:
        if blocks and risks[blocks[-1][-1]] == risks[i]:
            blocks[-1].append(i)
        else:
            blocks.append([i])
    # state: (rung index, changed answers used per group) -> (cost, assignment of the blocks so far)
    states: dict[tuple[int, tuple[int, ...]], tuple[float, tuple[int, ...]]] = {(0, (0,) * len(names)): (0.0, ())}
    for block in blocks:
        nxt: dict[tuple[int, tuple[int, ...]], tuple[float, tuple[int, ...]]] = {}
        for (low, used), (cost, picks) in states.items():
            for k in range(low, len(options)):
                f = options[k]
                add = list(used)
                if f is not None:
                    for i in block:
                        if changed[f][i]:
                            add[names.index(groups[i])] += 1
                if f is not None and any(i in blocked for i in block):
                    continue
                if any(add[j] > max(budget[g], 0) for j, g in enumerate(names)):
                    continue
                key = (k, tuple(add))
                value = (cost + option_cost[k] * len(block), picks + (k,))
                if key not in nxt or value[0] < nxt[key][0]:
                    nxt[key] = value
        states = nxt
    cost, picks = min(states.values(), key=lambda item: (item[0], item[1]))  # the fallback everywhere always fits
    assigned: list[float | None] = [None] * n
    rungs: list[LadderRung] = []
    for block, k in zip(blocks, picks):
        for i in block:
            assigned[i] = options[k]
        if options[k] is not None:
            rung = LadderRung(max_risk=risks[block[-1]], fraction=options[k])
            if rungs and rungs[-1].fraction == rung.fraction:
                rungs[-1] = rung
            else:
                rungs.append(rung)
    calibration = {
        "items": n,
        "max_changed": max_changed,
        "confidence": confidence,
        "budget_per_group": budget,
        "costs": {("fallback" if k == FALLBACK else f"{k:g}"): v for k, v in costs.items()},
        "outcome": ladder_outcome(assigned, changed, costs, groups),
        **(provenance or {}),
    }
    return GuardLadder(probe=probe, strategy=strategy, rungs=rungs, calibration=calibration)


__all__ = [
    "FALLBACK",
    "GuardLadder",
    "LadderRung",
    "calibrate_ladder",
    "changed_budget",
    "changed_upper_bound",
    "items_to_vouch",
    "ladder_outcome",
    "rung_name",
    "serve_rows",
]
