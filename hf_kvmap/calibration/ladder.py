"""Calibrating the guard ladder on measured items: what a ladder serves there (`ladder_outcome`), the one-sided
Clopper-Pearson bound on its share of changed answers (`changed_upper_bound`, `changed_budget`, `items_to_vouch`), and
the cheapest ladder within a budget per task (`calibrate_ladder`, exact dynamic programming over the rungs measured).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..serving.ladder import FALLBACK, GuardLadder, LadderRung, below_margin, rung_name

#: the rung name, in a ladder outcome, of an item below the ladder's `min_tokens` (the target prefills it unmapped)
SHORT = "short"


def sparse_key(fraction: float) -> str:
    """How a sparse rung of `fraction` is keyed among the measured rungs (`changed`, `costs`, `margins` of
    [`calibrate_ladder`], a plan of [`ladder_outcome`]): `"sparse:<fraction>"`, its rung name in a handoff report. A
    repairing rung (or the mapped cache, 0) is keyed by its fraction.

    >>> sparse_key(0.1)
    'sparse:0.1'
    """
    return rung_name(float(fraction), True)


def rung_of(key: float | str) -> tuple[float, bool]:
    """`(fraction, sparse)` of a measured rung's key: a fraction, or [`sparse_key`]'s `"sparse:<fraction>"`."""
    if isinstance(key, str):
        kind, _, fraction = key.partition(":")
        try:
            value = float(fraction)
        except ValueError:
            value = None
        if kind != "sparse" or value is None or not 0.0 < value < 1.0:
            raise ValueError(
                f"Unknown measured rung {key!r}: a rung is keyed by its fraction (a float in [0, 1)), or a sparse one "
                "by `sparse_key(fraction)` ('sparse:0.1')."
            )
        return value, True
    return float(key), False


def _rung_label(key: float | str | None) -> str:
    return key if isinstance(key, str) else rung_name(key)


def refused_by_check(
    margins: dict[float, Sequence[float]], min_margin: float | None
) -> dict[float, list[bool]] | None:
    """Per fraction, whether the check after the rung (`GuardLadder.min_margin`) sends each item to the fallback: its
    answer margin there is below `min_margin` (a NaN margin too). `None` without a check."""
    if min_margin is None:
        return None
    return {f: [below_margin(m, min_margin) for m in values] for f, values in margins.items()}


def ladder_outcome(
    fractions: Sequence[float | None],
    changed: dict[float, Sequence[bool]],
    costs: dict[float | str, float],
    groups: Sequence[str] | None = None,
    refused: dict[float, Sequence[bool]] | None = None,
    short: Sequence[bool] | None = None,
) -> dict[str, Any]:
    """What serving `fractions` (one per item, `None` = fallback) gives on measured items: the share of changed answers
    served, the mean cost (relative to a prefill) and the net saving, overall and per group (task), and the share of
    items on each rung. `changed[f][i]`: item `i`'s answer differs from the target's own at fraction `f`; the fallback
    never changes an answer. `costs[f]` and `costs["fallback"]`: mean cost of each rung, every stage counted. A sparse
    rung is keyed by [`sparse_key`] (`"sparse:0.1"`) in the plan and in every dict.

    With a check after the rung, `refused[f][i]` says that item `i`, served fraction `f`, falls back after it
    ([`refused_by_check`]): it serves the target's own answer and pays its rung and a prefill on top; `rungs` counts it
    on the rung it was given and `checked_fallback` is the share of items the check sent back.

    `short[i]` says that item `i` is below the ladder's `min_tokens`: the target prefills it unmapped (rung `"short"`,
    cost 1: no mapping, no probe) whatever its fraction."""
    groups = list(groups) if groups is not None else ["all"] * len(fractions)
    short = [False] * len(fractions) if short is None else [bool(s) for s in short]
    if len(short) != len(fractions):
        raise ValueError(f"{len(short)} short flags for {len(fractions)} items.")
    fractions = [None if below else f for f, below in zip(fractions, short)]

    def sent_back(i: int) -> bool:
        return refused is not None and fractions[i] is not None and bool(refused[fractions[i]][i])

    def name(i: int) -> str:
        return SHORT if short[i] else _rung_label(fractions[i])

    def summary(index: list[int]) -> dict[str, Any]:
        n = max(len(index), 1)
        served_changed = sum(
            bool(changed[fractions[i]][i]) for i in index if fractions[i] is not None and not sent_back(i)
        )
        cost = (
            sum(
                1.0 if short[i] else costs[FALLBACK if fractions[i] is None else fractions[i]] + sent_back(i)
                for i in index
            )
            / n
        )
        rungs: dict[str, float] = {}
        for i in index:
            rungs[name(i)] = rungs.get(name(i), 0) + 1 / n
        out = {
            "items": len(index),
            "changed_served": served_changed / n,
            "mean_cost": cost,
            "net_saving": 1.0 - cost,
            "rungs": {name: round(share, 6) for name, share in sorted(rungs.items())},
        }
        if refused is not None:
            out["checked_fallback"] = round(sum(sent_back(i) for i in index) / n, 6)
        return out

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
    margins: dict[float, Sequence[float]] | None = None,
    min_margin: float | None = None,
    check_tokens: int = 1,
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
            answer differs from the target's own. A sparse rung (the target's prefill of the strategy's selection
            alone, `LadderRung.sparse`) is keyed by [`sparse_key`] (`"sparse:0.1"`); it is a candidate only where it
            costs less than the repair of its fraction, and sits just below that repair in the ladder's order.
        costs (`dict`): the mean cost of each fraction and of `"fallback"`, relative to the target's prefill, with the
            probe and the mapping counted in each.
        probe, strategy: the probe the risks come from and the repair strategy the fractions were measured with.
        groups (sequence of `str`, *optional*): each item's task; the budget holds in each.
        max_changed (`float`, *optional*, defaults to 0.05): the share of changed answers a group may be served.
        confidence (`float`, *optional*): hold `max_changed` as an upper confidence bound at this level (e.g. 0.9)
            instead of on the calibration items alone.
        provenance (`dict`, *optional*): what the items were, recorded in `calibration`.
        margins (`dict[float, sequence of float]`, *optional*): per measured fraction, the target's answer margin on
            each item's served cache (`hf_kvmap.serving.forwards.answer_margin`); needed with `min_margin`.
        min_margin (`float`, *optional*): the ladder checks each served item after its rung, and one whose margin is
            below this falls back ([`refused_by_check`]): it serves no changed answer and costs its rung plus a
            prefill. `costs` should count the check in each rung. The rungs are chosen for this check.
        check_tokens (`int`, *optional*, defaults to 1): the answer tokens the check reads (`GuardLadder.check_tokens`);
            `margins` and `costs` should be those of a check of that many tokens.

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
    measured = sorted(changed, key=lambda key: (rung_of(key)[0], not rung_of(key)[1]))  # sparse f before repair f
    for f in measured:
        if len(changed[f]) != n:
            raise ValueError(f"changed[{f}] has {len(changed[f])} items; risks has {n}.")
        if f not in costs:
            raise ValueError(f"No cost for fraction {f}; pass costs for every measured fraction and 'fallback'.")
    if FALLBACK not in costs:
        raise ValueError("costs needs a 'fallback' entry (the prefill, with the probe and the mapping).")
    groups = list(groups) if groups is not None else ["all"] * n
    if len(groups) != n:
        raise ValueError(f"{len(groups)} groups for {n} items.")
    refused = None
    if min_margin is not None:
        if margins is None or set(margins) != set(measured) or any(len(margins[f]) != n for f in measured):
            raise ValueError(
                "min_margin checks each rung's answer margin: pass margins with one value per item for every measured "
                "fraction (records measured before margins were recorded get them from "
                "the repository lab's `lab.ladder_migration.measure_margins`)."
            )
        refused = refused_by_check(margins, min_margin)
    # the changed answers the budget counts: those served (a check sends some back, which changes none)
    counted = (
        changed if refused is None else {f: [c and not r for c, r in zip(changed[f], refused[f])] for f in measured}
    )
    # a sparse rung is a candidate where it is cheaper than the repair of its fraction (else that repair is kept)
    fractions = [
        key for key in measured if not isinstance(key, str) or costs[key] < costs.get(rung_of(key)[0], math.inf)
    ]
    names = sorted(set(groups))
    if confidence is not None and not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must be in (0, 1), e.g. 0.9; or None for the budget on the items.")
    budget = {g: changed_budget(groups.count(g), max_changed, confidence) for g in names}
    blocked = {i for i, g in enumerate(groups) if budget[g] < 0}  # items of a group that cannot vouch: fallback only
    options: list[float | str | None] = [*fractions, None]
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
        # the block's cost on each option: its rung for every item, and a prefill more for each the check sends back
        block_cost = [
            option_cost[k] * len(block) + (0 if refused is None or f is None else sum(refused[f][i] for i in block))
            for k, f in enumerate(options)
        ]
        for (low, used), (cost, picks) in states.items():
            for k in range(low, len(options)):
                f = options[k]
                add = list(used)
                if f is not None:
                    for i in block:
                        if counted[f][i]:
                            add[names.index(groups[i])] += 1
                if f is not None and any(i in blocked for i in block):
                    continue
                if any(add[j] > max(budget[g], 0) for j, g in enumerate(names)):
                    continue
                key = (k, tuple(add))
                value = (cost + block_cost[k], picks + (k,))
                if key not in nxt or value[0] < nxt[key][0]:
                    nxt[key] = value
        states = nxt
    cost, picks = min(states.values(), key=lambda item: (item[0], item[1]))  # the fallback everywhere always fits
    assigned: list[float | str | None] = [None] * n
    rungs: list[LadderRung] = []
    for block, k in zip(blocks, picks):
        for i in block:
            assigned[i] = options[k]
        if options[k] is not None:
            fraction, sparse = rung_of(options[k])
            rung = LadderRung(max_risk=risks[block[-1]], fraction=fraction, sparse=sparse)
            if rungs and (rungs[-1].fraction, rungs[-1].sparse) == (rung.fraction, rung.sparse):
                rungs[-1] = rung
            else:
                rungs.append(rung)
    calibration = {
        "items": n,
        "max_changed": max_changed,
        "confidence": confidence,
        "budget_per_group": budget,
        "costs": {(k if isinstance(k, str) else f"{k:g}"): v for k, v in costs.items()},
        "outcome": ladder_outcome(assigned, changed, costs, groups, refused),
        **({"min_margin": min_margin} if min_margin is not None else {}),
        **({"check_tokens": check_tokens} if check_tokens != 1 else {}),
        **(provenance or {}),
    }
    return GuardLadder(
        probe=probe,
        strategy=strategy,
        rungs=rungs,
        calibration=calibration,
        min_margin=min_margin,
        check_tokens=check_tokens,
    )


__all__ = [
    "SHORT",
    "calibrate_ladder",
    "changed_budget",
    "changed_upper_bound",
    "items_to_vouch",
    "ladder_outcome",
    "refused_by_check",
    "rung_of",
    "sparse_key",
]
