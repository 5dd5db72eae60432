"""The records of measured ladder items, and the ladder chosen and replayed from them: how a record names a probe and
a repair strategy (`probe_key`, `strategy_key`), what each rung costs and keeps there (`record_costs`,
`record_margins`), the cheapest ladder of the candidates (`ladder_from_records`), what a ladder serves on records
measured elsewhere (`replay_ladder`, `with_min_tokens`) and what a perfect probe would (`perfect_probe_outcome`).

```python
ladder = ladder_from_records(records, max_changed=0.05)      # the cheapest (probe, strategy) ladder
checked = ladder_from_records(records, max_changed=0.05, check=True)  # ... with a check after the rung, if cheaper
print(replay_ladder(ladder, other_records))                  # what it serves on items measured elsewhere
```

The records are measured by `hf_kvmap.calibration.ladder_items.measure_ladder_items` through the code the handoff
serves with, so a replay gives what `handoff(..., ladder=)` serves on those prompts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..repair import strategy_from_dict
from ..serving.ladder import FALLBACK, GuardLadder
from ..serving.probes import Probe, probe_from_dict
from .ladder import calibrate_ladder, ladder_outcome, refused_by_check, sparse_key


def probe_key(probe: Probe | dict | str) -> str:
    """`"name:tokens"` of a probe (how records name its risk)."""
    probe = probe if isinstance(probe, Probe) else probe_from_dict(probe)
    return f"{probe.name}:{probe.tokens}"


def option_text(value: Any) -> str:
    """A strategy option as its record key writes it: a number or text as it is, anything else as sorted JSON."""
    return str(value) if isinstance(value, (int, float, str)) else json.dumps(value, sort_keys=True)


def strategy_key(strategy: dict | str) -> str:
    """How records name a repair strategy: its name, then its options as `:key=value` (JSON for nested ones)."""
    settings = strategy_from_dict(strategy).settings()
    options = {k: v for k, v in sorted(settings.items()) if k != "name"}
    parts = [f"{k}={option_text(v)}" for k, v in options.items()]
    return ":".join([settings["name"], *parts])


def parse_probe(text: str) -> Probe:
    """A probe from `"name"` or `"name:tokens"`."""
    name, _, tokens = text.partition(":")
    return probe_from_dict({"name": name, **({"tokens": int(tokens)} if tokens else {})})


#: the answer margins a ladder's check after the rung is calibrated over (`ladder_from_records(check=True)`)
CHECK_MARGINS = tuple(round(0.05 * i, 2) for i in range(1, 20))


#: the numbers of answer tokens a check is calibrated over where the records hold every answer token's margin
CHECK_TOKENS = (1, 2, 4, 8)


def has_margins(record: dict, tokens: int = 1) -> bool:
    """Whether a record holds the answer margin of every rung it measured (what a check after the rung reads): of the
    first answer token, or with `tokens` > 1 of every answer token (`margins`) and each check step's seconds."""
    key = "margin" if tokens == 1 else "margins"
    held = all(key in outcome for rungs in record["answers"].values() for outcome in rungs.values())
    return held and (tokens == 1 or "check_steps" in record["seconds"])


def _need_margins(records: Sequence[dict], tokens: int = 1) -> None:
    if not all(has_margins(record, tokens) for record in records):
        what = "answer margins" if tokens == 1 else "margins of every answer token"
        raise ValueError(
            f"A ladder that checks {tokens} answer token(s) after each rung needs the {what} in every record; these "
            "records were measured before they were recorded: measure them with the repository lab's `lab.ladder_migration.measure_margins` "
            f"(`python -m benchmarks.ladder.guard_ladder ... {'--margins' if tokens == 1 else '--token-margins'}`)."
        )


def record_margin(outcome: dict, tokens: int = 1) -> float:
    """The margin a check of `tokens` answer tokens reads in one rung's outcome: its smallest over them (an answer
    that ended sooner, over all of it)."""
    return float(outcome["margin"]) if tokens == 1 else min(float(m) for m in outcome["margins"][:tokens])


def has_sparse(records: Sequence[dict], strategy: str) -> bool:
    """Whether every record holds the sparse rung of `strategy` at each repairing fraction it measured
    (`measure_ladder_items(..., sparse=True)`): the target's prefill of that repair's selection alone, its answer and
    seconds. Records measured before sparse rungs were (or without them) do not."""
    if not records:
        return False
    for record in records:
        fractions = {f for f in record["answers"].get(strategy, {}) if float(f) > 0}
        held = record.get("sparse", {}).get(strategy, {})
        timed = record["seconds"].get("sparse", {}).get(strategy, {})
        if not fractions or not fractions <= set(held) or not fractions <= set(timed):
            return False
    return True


def _need_sparse(records: Sequence[dict], strategy: str) -> None:
    if not has_sparse(records, strategy):
        raise ValueError(
            f"Sparse rungs of {strategy} need its sparse outcome at every repairing fraction in every record; these "
            "records lack them (measured before sparse rungs were, or without): measure them with "
            "`measure_ladder_items(..., sparse=True)` (`hf-kvmap calibrate-ladder --sparse`) into a new records file."
        )


def _rung_seconds(seconds: dict, table: str, strategy: str, f: str, shared: int, check: bool, tokens: int) -> float:
    """The seconds of one rung beyond the mapping and the probe: its repair (`table` "repair") or its sparse prefill
    ("sparse"), less the draft steps the probe decoded for it, plus the check after it."""
    prefix = "repair" if table == "repair" else table
    steps = seconds.get(f"{prefix}_draft_steps", {}).get(strategy, {}).get(f, [])
    spent = seconds[table][strategy][f] - sum(steps[:shared])
    if check and table == "repair" and tokens == 1:
        spent += seconds["verify"][strategy][f]
    elif check:
        spent += sum(seconds["check_steps" if table == "repair" else f"{table}_check_steps"][strategy][f][:tokens])
    return spent


def record_costs(
    records: Sequence[dict],
    key: str,
    strategy: str,
    check: bool = False,
    check_tokens: int = 1,
    sparse: bool = False,
) -> dict[float | str, float]:
    """Mean cost of every rung relative to each record's own prefill, with the mapping (and the held-back tokens) and
    probe `key` counted in every rung, strategy `strategy`'s repair in the repairing ones, and the prefill in the
    fallback. A repair that continues the probe's source draft does not pay again for the steps the probe decoded:
    the seconds the repair's own first steps took are taken off (records that timed them; older ones pay in full).
    With `check`, every rung but the fallback also pays the check after it (the answer margin's token, or the steps
    of a check of `check_tokens` tokens). With `sparse`, the sparse rung of each repairing fraction too, keyed by
    `sparse_key(f)` and costed the same way (the mapping and the probe are paid before the rung is chosen; its
    selection and prefill in place of the repair)."""
    fractions = sorted(float(f) for f in records[0]["answers"][strategy])
    if check:
        _need_margins(records, check_tokens)
    if sparse:
        _need_sparse(records, strategy)
    rungs: list[tuple[float | str, str, float]] = [(f, "repair", f) for f in fractions]
    rungs += [(sparse_key(f), "sparse", f) for f in fractions if f > 0 and sparse]
    sums: dict[float | str, float] = dict.fromkeys([*(rung for rung, _, _ in rungs), FALLBACK], 0.0)
    for record in records:
        seconds = record["seconds"]
        base = (seconds["map"] + seconds["probe"][key]) / seconds["prefill"]
        shared = seconds.get("probe_source_steps", {}).get(key, 0)
        for rung, table, f in rungs:
            spent = _rung_seconds(seconds, table, strategy, f"{f:g}", shared, check, check_tokens)
            sums[rung] += base + spent / seconds["prefill"]
        sums[FALLBACK] += base + 1.0
    return {k: v / len(records) for k, v in sums.items()}


def _outcomes(record: dict, strategy: str, sparse: bool) -> dict[float | str, dict]:
    """One record's outcome of every rung of `strategy`: by fraction, and with `sparse` by `sparse_key(f)`."""
    out: dict[float | str, dict] = {float(f): o for f, o in record["answers"][strategy].items()}
    if sparse:
        out.update({sparse_key(float(f)): o for f, o in record["sparse"][strategy].items()})
    return out


def record_margins(
    records: Sequence[dict], strategy: str, tokens: int = 1, sparse: bool = False
) -> dict[float | str, list[float]]:
    """Per measured fraction of `strategy` (and with `sparse` per sparse rung, `sparse_key(f)`), every record's answer
    margin on its served cache ([`record_margin`] over `tokens` answer tokens)."""
    _need_margins(records, tokens)
    if sparse:
        _need_sparse(records, strategy)
    keys = _outcomes(records[0], strategy, sparse)
    return {k: [record_margin(_outcomes(r, strategy, sparse)[k], tokens) for r in records] for k in keys}


def _changed(records: Sequence[dict], strategy: str, sparse: bool = False) -> dict[float | str, list[bool]]:
    if sparse:
        _need_sparse(records, strategy)
    keys = _outcomes(records[0], strategy, sparse)
    return {k: [bool(_outcomes(r, strategy, sparse)[k]["changed"]) for r in records] for k in keys}


def held_strategies(records: Sequence[dict]) -> list[str]:
    """The strategies every record holds answers of (sorted keys): a strategy measured beside records after them is
    a candidate only once every record has it (a side pass stopped part-way leaves it out)."""
    return sorted(set.intersection(*(set(r["answers"]) for r in records))) if records else []


def _pick(keys: Sequence[str] | None, held: Sequence[str], what: str) -> list[str]:
    keys = list(held) if keys is None else list(keys)
    missing = [k for k in keys if k not in held]
    if missing:
        raise ValueError(f"The records hold no {what} {missing}; they have {sorted(held)}.")
    return keys


def ladder_from_records(
    records: Sequence[dict],
    *,
    strategy: dict | str | None = None,
    probe: str | None = None,
    max_changed: float = 0.05,
    confidence: float | None = None,
    provenance: dict[str, Any] | None = None,
    check: bool | Sequence[float] = False,
    check_tokens: Sequence[int] | None = None,
    sparse: bool | None = None,
    cost_records: Sequence[dict] | None = None,
) -> GuardLadder:
    """The calibrated ladder of `records` ([`calibrate_ladder`], budget per task): of `probe` (a key of the records'
    risks) and `strategy`, or else of the candidate probe and strategy whose ladder costs least there; `max_changed`
    and `confidence` as in [`calibrate_ladder`]. Each rung's cost is its mean over `cost_records` (default: `records`;
    e.g. the records measured on a quiet machine, while the changed answers are read on all of them). With `check` (`True`: the margins of `CHECK_MARGINS`, or a sequence
    of them), the ladder may also check each rung's answer margin: every candidate is calibrated without a check and
    with each `min_margin`, and the cheapest kept (the records need margins), over checks of each number of answer
    tokens of `check_tokens` (default: `CHECK_TOKENS` where every record holds every answer token's margin, else the
    first token alone). With `sparse` (default: wherever every record holds a strategy's sparse rungs,
    [`has_sparse`]; `False`: never; `True`: required of every candidate strategy), a strategy's ladder may also place
    the sparse rung of a fraction (the target's prefill of that repair's selection alone) where it costs less than the
    repair of that fraction, within the same changed-answer budget. The costs, changed answers and ladders of every
    candidate are kept in `calibration["candidates"]`."""
    if not records:
        raise ValueError("No records: measure items first (measure_ladder_items).")
    priced = records if cost_records is None else cost_records
    if not priced:
        raise ValueError("No cost_records: a ladder's costs need at least one timed record.")
    probes = _pick([probe] if probe else None, sorted(records[0]["risks"]), "risk of the probes")
    strategies = _pick(
        [strategy_key(strategy)] if strategy is not None else None, held_strategies(records), "strategies"
    )
    margins_checked = [] if check is False else list(CHECK_MARGINS if check is True else check)
    if check_tokens is None:
        check_tokens = CHECK_TOKENS if margins_checked and all(has_margins(r, 2) for r in records) else (1,)
    if not margins_checked:
        check_tokens = ()
    best, candidates = None, {}
    groups = [r["task"] for r in records]
    for key in probes:
        risks = [r["risks"][key] for r in records]
        for name in strategies:
            spared = has_sparse(records, name) if sparse is None else bool(sparse)  # `True` refuses records without
            changed = _changed(records, name, spared)
            costs, margins = {None: record_costs(priced, key, name, sparse=spared)}, {}
            for tokens in check_tokens:  # the same for every margin tried
                costs[tokens] = record_costs(priced, key, name, check=True, check_tokens=tokens, sparse=spared)
                margins[tokens] = record_margins(records, name, tokens, spared)
            tries = [(None, None)] + [(m, k) for k in check_tokens for m in margins_checked]
            for min_margin, tokens in tries:
                ladder = calibrate_ladder(
                    risks,
                    changed,
                    costs[tokens],
                    probe=parse_probe(key).settings(),
                    strategy=records[0]["strategies"][name],
                    groups=groups,
                    max_changed=max_changed,
                    confidence=confidence,
                    provenance=provenance,
                    margins=margins.get(tokens),
                    min_margin=min_margin,
                    check_tokens=tokens or 1,
                )
                outcome = ladder.calibration["outcome"]
                label = f"{key} {name}"
                if min_margin is not None:
                    label += f" check>={min_margin:g}" + (f" over {tokens} tokens" if tokens > 1 else "")
                candidates[label] = {
                    "mean_cost": outcome["mean_cost"],
                    "changed_served": outcome["changed_served"],
                    "rungs": ladder.to_dict()["rungs"],
                    **({"min_margin": min_margin} if min_margin is not None else {}),
                    **({"check_tokens": tokens} if tokens and tokens > 1 else {}),
                }
                if best is None or outcome["mean_cost"] < best.calibration["outcome"]["mean_cost"]:
                    best = ladder
    best.calibration["candidates"] = candidates
    return best


def replay_ladder(ladder: GuardLadder | dict, records: Sequence[dict]) -> dict[str, Any]:
    """`ladder_outcome` of serving `records` with `ladder` (calibrated elsewhere): its probe, its strategy and every
    rung it uses must have been measured there (a sparse rung: records measured with `sparse=True`). With the ladder's
    `min_tokens`, a record of fewer prompt tokens is served the target's prefill unmapped (rung `"short"`)."""
    ladder = GuardLadder.from_dict(ladder)
    key, name = probe_key(ladder.probe), strategy_key(ladder.strategy)
    if key not in records[0]["risks"]:
        raise ValueError(f"The records hold no risk of the ladder's probe {key}.")
    if name not in held_strategies(records):
        raise ValueError(
            f"The records hold no answers of the ladder's strategy {name} on every record; every record holds "
            f"{held_strategies(records)}."
        )
    measured = {float(f) for f in records[0]["answers"][name]}
    unmeasured = [rung.fraction for rung in ladder.rungs if rung.fraction not in measured]
    if unmeasured:
        raise ValueError(
            f"The records do not measure the ladder's fractions {unmeasured}; they hold {sorted(measured)}."
        )
    risks = [r["risks"][key] for r in records]
    spared = any(rung.sparse for rung in ladder.rungs)  # its sparse rungs are served as measured, one row a request
    plan = [f if not s else sparse_key(f) for f, s in zip(ladder.plan(risks), ladder.sparse_plan(risks))]
    checked, tokens = ladder.min_margin is not None, ladder.check_tokens
    return ladder_outcome(
        plan,
        _changed(records, name, spared),
        record_costs(records, key, name, check=checked, check_tokens=tokens, sparse=spared),
        [r["task"] for r in records],
        refused_by_check(record_margins(records, name, tokens, spared), ladder.min_margin) if checked else None,
        [ladder.too_short(r["tokens"]) for r in records] if ladder.min_tokens is not None else None,
    )


def with_min_tokens(ladder: GuardLadder, min_tokens: int, records: Sequence[dict]) -> GuardLadder:
    """`ladder` (calibrated on `records`) with `min_tokens` set, its calibration outcome replayed on the records with
    the records below it prefilled unmapped ([`replay_ladder`]). Serving fewer items the mapped cache only lowers the
    changed answers served, so a budget the ladder held on the records still holds."""
    gated = GuardLadder.from_dict({**ladder.to_dict(), "min_tokens": min_tokens})
    gated.calibration = {**(ladder.calibration or {}), "outcome": replay_ladder(gated, records)}
    return gated


def cheapest_keeping(
    record: dict, strategy: str, costs: dict[float | str, float], sparse: bool = False
) -> float | str | None:
    """The rung of one record that keeps the target's answer at the least cost: the measured fraction of `strategy`
    (0: the mapped cache), or with `sparse` also a sparse rung (`sparse_key(f)`), whose answer is unchanged and whose
    `costs` entry is least (ties to the rung listed first: the repairs by fraction, then the sparse rungs), or `None`
    (the fallback) where no such rung costs less than `costs["fallback"]`."""
    outcomes = _outcomes(record, strategy, sparse)
    fractions = sorted(rung for rung in outcomes if not isinstance(rung, str))
    order = fractions + [sparse_key(f) for f in fractions if sparse_key(f) in outcomes]
    kept = [rung for rung in order if not outcomes[rung]["changed"] and rung in costs]
    best = min(kept, key=lambda rung: costs[rung], default=None)
    return best if best is not None and costs[best] < costs[FALLBACK] else None


def perfect_probe_outcome(
    records: Sequence[dict], strategy: str, cost_of: str | None = None, sparse: bool = False
) -> dict[str, Any]:
    """What a perfect probe would serve on measured records: every request the cheapest rung that keeps the target's
    answer ([`cheapest_keeping`]; the fallback always does), as [`ladder_outcome`] with the rungs costed as a
    calibrated ladder's ([`record_costs`]); with `sparse` the sparse rungs are among them. The probe costs nothing, or
    what probe `cost_of` (a key of the records' risks) cost on each record. It serves no changed answer and costs no
    more than any ladder of these rungs that serves none; the gap to a calibrated ladder's cost is what a better probe
    could save with these rungs."""
    perfect = "perfect"  # a probe key no record holds
    priced = []
    for record in records:
        seconds = record["seconds"]
        steps = seconds.get("probe_source_steps", {})
        priced.append(
            {
                **record,
                "seconds": {
                    **seconds,
                    "probe": {**seconds["probe"], perfect: 0.0 if cost_of is None else seconds["probe"][cost_of]},
                    "probe_source_steps": {**steps, perfect: 0 if cost_of is None else steps.get(cost_of, 0)},
                },
            }
        )
    costs = record_costs(priced, perfect, strategy, sparse=sparse)
    plan = [cheapest_keeping(record, strategy, costs, sparse) for record in records]
    return ladder_outcome(plan, _changed(records, strategy, sparse), costs, [r["task"] for r in records])


__all__ = [
    "CHECK_MARGINS",
    "CHECK_TOKENS",
    "cheapest_keeping",
    "has_margins",
    "has_sparse",
    "held_strategies",
    "ladder_from_records",
    "option_text",
    "parse_probe",
    "perfect_probe_outcome",
    "probe_key",
    "record_costs",
    "record_margin",
    "record_margins",
    "replay_ladder",
    "strategy_key",
    "with_min_tokens",
]
