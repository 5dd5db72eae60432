"""The guard ladder of a sealed protocol, calibrated on items measured apart and replayed on its report items.

    python -m benchmarks.sealed.ladder --protocol benchmarks/protocols/whole-context-conv4k.json \
        --calibration benchmarks/results/sealed/whole-context/ladder-calibration-4096.jsonl \
        --records benchmarks/results/sealed/whole-context/4096/ridge-k8-conv4k.jsonl \
        --out benchmarks/results/sealed/whole-context-conv4k-ladder.json

No item is measured again: every arm of a `benchmarks.switch.long_switch` record keeps each answer token's margin
(top-1 minus top-2 probability), so one record holds what a ladder of the protocol's rungs would have read and served
(`ladder_record`): the probe `lookahead_margin:1` is one minus the mapped arm's first margin, each rung's first margin
is what a check after it reads, each arm's seconds are its stage's cost over the item's own re-prefill. A path is
costed as `hf_kvmap.serving` serves it, to its first token: the mapping and the probe's step on the mapped cache on
every path, a rung's whole preparation (its selection and the repair, and its own mapping again: a repair maps with the
target's own first layer, so the replay pays a second mapping, a few hundredths of a 4K re-prefill here), the check's forward
where the ladder checks, and the served cache's first token; the fallback pays the re-prefill to its first token on
top of what came before it (a rung the check refused included). The ladder is
chosen as `hf-kvmap calibrate-ladder` chooses one (`hf_kvmap.calibration.ladder_records.ladder_from_records`: the
cheapest candidate, with and without a check, whose changed answers served stay within the budget on every task of
the calibration items, its costs read on the calibration items timed at the protocol's load), then served once on the
report items: per task, the rungs it gave, the changed answers it served with their one-sided upper bound, the right
answers it kept, and its mean cost (on the items timed at the protocol's load) with a bootstrap interval, beside what a
perfect probe would cost with the same rungs. Its verdicts:
mean cost at most `max_cost` (read on the interval's upper end) and changed answers at most `max_changed` (read on
their upper bound).
"""

from __future__ import annotations

import argparse
import random
import sys
from statistics import mean
from typing import Any

from hf_kvmap.calibration.ladder import changed_upper_bound
from hf_kvmap.calibration.ladder_records import (
    ladder_from_records,
    perfect_probe_outcome,
    probe_key,
    replay_ladder,
    strategy_key,
)
from hf_kvmap.repair import strategy_from_dict
from hf_kvmap.reporting import write_json
from hf_kvmap.serving.ladder import GuardLadder

from ..switch.long_switch_args import parse_rung
from ..switch.long_switch_report import load
from .protocol import SPARSE, Protocol, existing_files, protocol_from_flag
from .report import answer_changed, percentile_bounds, read_records, timed

#: the probe a long_switch record gives: the target's first answer margin on the mapped cache (its mapped arm)
PROBE = "lookahead_margin:1"


def _first_s(record: dict) -> float:
    """An arm's seconds from its prepared cache to its first token."""
    return record["ttft_s"] - record["prepare_s"]


def ladder_record(row: dict, rungs: list[str]) -> dict[str, Any]:
    """One item of `benchmarks.switch.long_switch` (every arm of `rungs`, their sparse peers, the target and the
    mapped cache, with margins) as a measured ladder item (`hf_kvmap.calibration.ladder_items.measure_item`'s
    fields): the probe [`PROBE`]'s risk, each rung's outcome at its fraction (0: the mapped cache) and its sparse
    peer's, and the seconds of each stage, to the first token (the module's docstring): the re-prefill's time to its
    first token is the item's prefill, a rung's "repair" its whole preparation and its first token, a check its own
    forward (a first-token step, as serving runs it), the mapped rung's repair and check one step each on the mapped
    cache. Rungs of one strategy at two fractions are refused (a record keys each rung by its strategy)."""
    arms = row["arms"]
    strategies_of = [strategy_key(parse_rung(rung)[1]) for rung in rungs]
    if len(set(strategies_of)) < len(rungs):
        raise ValueError(f"Rungs {rungs} repeat a strategy: a ladder replay keys each rung by its strategy alone.")
    needed = ["target", "mapped", *rungs, *(SPARSE + rung for rung in rungs)]
    missing = [arm for arm in needed if arm not in arms or "margins" not in arms[arm]]
    if missing:
        raise ValueError(
            f"{row['key']}: no record (or no margins) of {missing}: measure the item with margins recorded "
            "(benchmarks.switch.long_switch records them since the ladder was sealed)."
        )

    def outcome(arm: str) -> dict[str, Any]:
        margins = arms[arm]["margins"]
        out = {"changed": answer_changed(arms, arm), "correct": arms[arm]["score"] >= 1.0, "margin": margins[0]}
        return {**out, "margins": margins, "arm": arm}

    strategies, answers, sparse = {}, {}, {}
    seconds: dict[str, Any] = {
        "prefill": arms["target"]["ttft_s"],
        "map": arms["mapped"]["prepare_s"],
        "probe": {PROBE: _first_s(arms["mapped"])},  # the first token on the mapped cache: the probe's one step
        "repair": {},
        "verify": {},
        "sparse": {},
        "sparse_check_steps": {},
    }
    for rung in rungs:
        _, settings, fraction, _ = parse_rung(rung)
        key, f = strategy_key(settings), f"{fraction:g}"
        strategies[key] = strategy_from_dict(settings).settings()
        answers[key] = {"0": outcome("mapped"), f: outcome(rung)}
        sparse[key] = {f: {**outcome(SPARSE + rung), "selected": arms[SPARSE + rung].get("selected")}}
        mapped_step, step = _first_s(arms["mapped"]), _first_s(arms[rung])
        seconds["repair"][key] = {"0": mapped_step, f: arms[rung]["prepare_s"] + step}  # to the first token
        seconds["verify"][key] = {"0": mapped_step, f: step}  # the check: one more forward of the held-back token
        sparse_step = _first_s(arms[SPARSE + rung])
        seconds["sparse"][key] = {f: arms[SPARSE + rung]["prepare_s"] + sparse_step}
        seconds["sparse_check_steps"][key] = {f: [sparse_step]}
    return {
        "key": row["key"],
        "task": row["task"],
        "tokens": row["tokens"],
        "mapper": row.get("setup", {}).get("mapper"),
        "reference": arms["target"]["tokens"],
        "correct_target": arms["target"]["score"] >= 1.0,
        "score_target": arms["target"]["score"],
        "risks": {PROBE: 1.0 - arms["mapped"]["margins"][0]},
        "strategies": strategies,
        "answers": answers,
        "sparse": sparse,
        "scores": {arm: arms[arm]["score"] for arm in needed},
        "seconds": seconds,
    }


def read_calibration(protocol: Protocol, paths: list[str]) -> list[dict]:
    """The rows of the ladder's calibration cell (its tasks, length and seed) in `paths`, refusing any other item: the
    calibration must be of items no report reads."""
    cell = protocol.settings["ladder"]["calibration"]
    rows: dict[str, dict] = {}
    for path in paths:
        for key, row in load(path).items():
            _, task, tokens, seed, _ = key.split("/", 4)
            if task not in cell["tasks"] or int(tokens) != cell["tokens"] or int(seed) != cell["seed"]:
                raise SystemExit(
                    f"{path}: {key} is not an item of the ladder's calibration cell ({','.join(cell['tasks'])} at "
                    f"{cell['tokens']} tokens, seed {cell['seed']}): leave the file out."
                )
            setup = row.get("setup", {})
            for name in ("dtype", "direction"):
                if setup.get(name) != protocol.settings[name]:
                    raise SystemExit(
                        f"{path}: {key} was measured with {name} {setup.get(name)!r}, not the protocol's "
                        f"{protocol.settings[name]!r}."
                    )
            if key in rows and rows[key]["setup"].get("mapper") != setup.get("mapper"):
                raise SystemExit(
                    f"{path}: {key} was measured with two fits of the map: an item is served on one; leave one of "
                    "its records out."
                )
            rows.setdefault(key, {**row, "arms": {}})["arms"].update(row["arms"])
    return list(rows.values())


def served_plan(ladder: GuardLadder, record: dict) -> str:
    """The arm the ladder serves one ladder record (`"target"` for the fallback, a check's refusal included)."""
    risk = record["risks"][probe_key(ladder.probe)]
    rung = ladder.rung_for(risk)
    if rung is None:
        return "target"
    key = strategy_key(ladder.strategy)
    table = record["sparse"] if rung.sparse else record["answers"]
    outcome = table[key][f"{rung.fraction:g}"]
    if ladder.min_margin is not None and not outcome["margin"] >= ladder.min_margin:
        return "target"
    return outcome["arm"]


def _score(record: dict, arm: str) -> float:
    return record["scores"][arm] if arm != "target" else record["score_target"]


def _arm_changed(record: dict, arm: str) -> bool:
    """Whether arm `arm` of a ladder record answered otherwise than the target (the target never does)."""
    outcomes = [
        o for table in (record["answers"], record["sparse"]) for rungs in table.values() for o in rungs.values()
    ]
    return arm != "target" and any(o["changed"] for o in outcomes if o["arm"] == arm)


def served(protocol: Protocol, ladder: GuardLadder, records: list[dict]) -> dict[str, Any]:
    """What `ladder` serves `records` (one task's, or all): `replay_ladder`'s rungs on every item, the changed answers
    served (count, share, one-sided upper bound at the protocol's level), the mean score served against the target's
    and the target's right answers kept, and its mean cost on the items timed at the protocol's load (a bootstrap
    interval over them) beside a perfect probe's with the same rungs and strategy."""
    interval = protocol.settings["interval"]
    level, n = interval["level"], len(records)
    replayed = replay_ladder(ladder, records)
    plan = [served_plan(ladder, record) for record in records]
    changed = sum(_arm_changed(record, arm) for record, arm in zip(records, plan))
    if abs(changed / n - replayed["changed_served"]) > 1e-9:  # the per-item plan must be the replay's
        raise AssertionError(
            f"the plan serves {changed} changed answers of {n}; the replay {replayed['changed_served']}"
        )
    right = [i for i, record in enumerate(records) if record["correct_target"]]
    out: dict[str, Any] = {
        "items": n,
        "rungs": replayed["rungs"],
        "checked_fallback": replayed.get("checked_fallback"),
        "changed_served": changed,
        "changed_share": changed / n,
        "changed_upper": changed_upper_bound(changed, n, level),
        "score_served": mean(_score(record, arm) for record, arm in zip(records, plan)),
        "score_target": mean(record["score_target"] for record in records),
        "right_kept": [sum(_score(records[i], plan[i]) >= 1.0 for i in right), len(right)],
    }
    clocked = [record for record in records if record["timed"]]
    out["timed_items"] = len(clocked)
    if clocked:
        draw = random.Random(interval["seed"])
        out["mean_cost"] = replay_ladder(ladder, clocked)["mean_cost"]
        costs = [
            replay_ladder(ladder, [clocked[draw.randrange(len(clocked))] for _ in clocked])["mean_cost"]
            for _ in range(interval["resamples"])
        ]
        out["mean_cost_interval"] = percentile_bounds(costs, level)
        strategy = strategy_key(ladder.strategy)
        out["perfect_probe_cost"] = perfect_probe_outcome(clocked, strategy, PROBE, sparse=True)["mean_cost"]
    return out


def verdict(rules: dict, figures: dict) -> dict[str, str]:
    """The ladder's verdicts on one task's (or all tasks') figures: its mean cost read on the interval's upper end,
    its changed answers on their upper bound."""
    high = (figures.get("mean_cost_interval") or [None, None])[1]
    cost = "not timed" if high is None else ("met" if high <= rules["max_cost"] else "missed")
    changed = "met" if figures["changed_upper"] <= rules["max_changed"] else "missed"
    return {"cost": cost, "changed": changed}


def assemble(protocol: Protocol, calibration_paths: list[str], report_paths: list[str]) -> dict[str, Any]:
    """The ladder calibrated on the calibration items and served on the report items of the protocol's ladder cell;
    verdicts only once both are complete."""
    settings = protocol.settings
    if "ladder" not in settings:
        raise SystemExit(f"{protocol.path} seals no ladder: write one into a new protocol before its items are built.")
    rules, cell = settings["ladder"], settings["ladder"]["calibration"]
    max_load = settings["timing"]["max_load"]

    def records_of(rows: list[dict]) -> list[dict]:
        return [{**ladder_record(row, protocol.rungs), "timed": timed(row, max_load)} for row in rows]

    calibration_rows = read_calibration(protocol, calibration_paths)
    calibration = records_of(calibration_rows)
    report_cells = read_records(protocol, report_paths)
    report = records_of(
        [
            row
            for (task, tokens), rows in report_cells.items()
            if tokens == cell["tokens"] and ":" not in task
            for row in rows
        ]
    )
    mappers = {record["mapper"] for record in calibration + report}
    if len(mappers) > 1:
        raise SystemExit(
            f"The calibration and report items were served by {len(mappers)} fits of the map {sorted(map(str, mappers))}: one ladder serves one map."
        )
    planned = {task: protocol.cell(task, cell["tokens"])["items"] for task in cell["tasks"]}
    out: dict[str, Any] = {
        "protocol": {"path": protocol.path, "sha256": protocol.sha256, "name": settings["name"]},
        "tokens": cell["tokens"],
        "calibration": {
            "items": {task: sum(r["task"] == task for r in calibration) for task in cell["tasks"]},
            "planned": cell["items"],
            "seed": cell["seed"],
        },
        "report_items": {task: sum(r["task"] == task for r in report) for task in cell["tasks"]},
        "report_planned": planned,
        "mapper": next(iter(mappers), None),
    }
    if not calibration or not report:
        return out
    checked = rules["check_tokens"] is not None
    quiet = [record for record in calibration if record["timed"]]
    if not quiet:
        raise SystemExit(
            f"No calibration item was measured at a load of at most {max_load}: the ladder's costs have nothing to "
            "be read on; measure calibration items on a quiet machine."
        )
    out["calibration"]["timed_items"] = len(quiet)
    ladder = ladder_from_records(
        calibration,
        cost_records=quiet,
        probe=rules["probe"],
        max_changed=rules["max_changed"],
        confidence=rules["confidence"],
        check=checked,
        check_tokens=(rules["check_tokens"],) if checked else None,
        sparse=True,
        provenance={"items": len(calibration), "seed": cell["seed"], "tokens": cell["tokens"]},
    )
    out["ladder"] = ladder.to_dict()
    complete = all(out["calibration"]["items"][t] >= cell["items"] for t in cell["tasks"]) and all(
        out["report_items"][t] >= planned[t] for t in cell["tasks"]
    )
    out["served"] = {}
    for task in [*cell["tasks"], "all"]:
        rows = [r for r in report if task in ("all", r["task"])]
        if rows:
            figures = served(protocol, ladder, rows)
            figures["verdict"] = (
                verdict(rules["verdicts"], figures)
                if complete
                else {"pending": "calibration or report items still measuring"}
            )
            out["served"][task] = figures
    return out


def _rungs_text(ladder: dict) -> str:
    parts, low = [], None
    for rung in ladder["rungs"]:
        name = (
            "mapped"
            if rung["fraction"] == 0
            else f"{'sparse' if rung.get('sparse') else 'repair'} {rung['fraction']:g}"
        )
        parts.append(f"risk <= {rung['max_risk']:.4g}: {name}")
        low = rung["max_risk"]
    parts.append("above: prefill" if low is not None else "every item: prefill")
    return "; ".join(parts)


def markdown(results: dict) -> str:
    """The ladder the calibration items chose, then one row a task of what it served on the report items."""
    calibration, tokens = results["calibration"], results["tokens"]
    counts = ", ".join(f"{task} {n}" for task, n in calibration["items"].items())
    head = (
        f"**The guard ladder at {tokens} tokens** (protocol `{results['protocol']['name']}`; calibration items at seed "
        f"{calibration['seed']}: {counts} of {calibration['planned']} a task; report items: "
        + ", ".join(f"{task} {n} of {results['report_planned'][task]}" for task, n in results["report_items"].items())
        + ")"
    )
    if "ladder" not in results:
        return head + ": nothing to calibrate or serve yet."
    ladder = results["ladder"]
    check = f", check after the rung: first-token margin >= {ladder['min_margin']:g}" if "min_margin" in ladder else ""
    lines = [
        head,
        "",
        f"Calibrated: probe `{ladder['probe']['name']}:{ladder['probe'].get('tokens', 1)}`, strategy "
        f"`{strategy_key(ladder['strategy'])}`; {_rungs_text(ladder)}{check}.",
        "",
        "| task | items | rungs served | changed answers served [upper bound] | score served / target | right answers "
        "kept | mean cost [interval] (timed items) | perfect probe's cost | verdicts |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for task, row in results["served"].items():
        rungs = ", ".join(f"{name} {share:.0%}" for name, share in row["rungs"].items())
        cost = "-"
        if row.get("mean_cost") is not None:
            low, high = row["mean_cost_interval"]
            cost = f"{row['mean_cost']:.2f} [{low:.2f}, {high:.2f}] ({row['timed_items']})"
        perfect = f"{row['perfect_probe_cost']:.2f}" if row.get("perfect_probe_cost") is not None else "-"
        verdicts = (
            row["verdict"].get("pending") or f"cost {row['verdict']['cost']}, changed {row['verdict']['changed']}"
        )
        lines.append(
            f"| {task} | {row['items']} | {rungs} | {row['changed_served']} ({row['changed_share']:.0%}) "
            f"[{row['changed_upper']:.0%}] | {row['score_served']:.2f} / {row['score_target']:.2f} | "
            f"{row['right_kept'][0]} of {row['right_kept'][1]} | {cost} | {perfect} | {verdicts} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", required=True, help="the sealed protocol whose ladder is served")
    parser.add_argument("--calibration", nargs="+", required=True, help="records of the ladder's calibration items")
    parser.add_argument("--records", nargs="+", required=True, help="the report records made under the protocol")
    parser.add_argument("--out", required=True, help="the results JSON to write")
    args = parser.parse_args(argv)
    protocol = protocol_from_flag(args.protocol)
    existing_files([*args.calibration, *args.records])
    results = assemble(protocol, args.calibration, args.records)
    write_json(args.out, results)
    print(markdown(results))


if __name__ == "__main__":
    main(sys.argv[1:])
