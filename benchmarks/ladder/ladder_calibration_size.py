"""How many calibration items does the guard ladder need? Calibrate it on subsets of one measured selection set, `n`
items per task, many times over, and replay every calibrated ladder on held-out report records: how often the changed
answers it serves exceed the budget on the worst task, and what it costs, with the budget held on the items alone and
held as a one-sided upper confidence bound (`calibrate_ladder(confidence=)`).

Nothing is measured here: the records are the JSONL files `benchmarks.ladder.guard_ladder` keeps under its `--work` folder
(one line per item), read as they are.

    python -m benchmarks.ladder.ladder_calibration_size --selection $WORK/ladder/0.5b-to-1.5b.selection.jsonl \
        --report $WORK/ladder/0.5b-to-1.5b.report.jsonl --report $WORK/ladder_2024/0.5b-to-1.5b.report.jsonl \
        --out benchmarks/results/ladder_calibration_size.json --plot benchmarks/results/ladder_calibration_size.png

Subsets of a finite selection set are not independent draws (at `n` near its size they mostly share items), so the
spread of the larger sizes is understated; the report records are pooled across the files given and must not share a
prompt with the selection set.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import random
import statistics
import sys
from pathlib import Path

from hf_kvmap.calibration.ladder import changed_budget
from hf_kvmap.reporting import environment_info, write_json
from lab.ladder_migration import with_side_measurements

from .guard_ladder import calibrated_replay, mapped_only

#: the calibrations compared: (name, view of the records, whether the budget is held as a confidence bound)
WAYS = (
    ("ladder", list, False),
    ("binary_guard", mapped_only, False),
    ("ladder_bound", list, True),
    ("binary_guard_bound", mapped_only, True),
)


def read_records(paths: list[str]) -> list[dict]:
    """The records of every JSONL file of `paths`, with what was measured after them kept beside each (the answer
    margins and the source's own answers: `guard_ladder --margins --source-answers`)."""
    records = []
    for path in paths:
        loaded = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        records += with_side_measurements(Path(path), None, [], loaded)
    if not records:
        raise SystemExit(f"no records in {paths}")
    return records


def by_task(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for record in records:
        out.setdefault(record["task"], []).append(record)
    return out


def one_calibration(selection: list[dict], report: list[dict], max_changed: float, confidence: float) -> dict:
    """Every way of `WAYS` calibrated on `selection` and replayed on `report`: worst task's changed answers served,
    mean cost and the rungs' shares."""
    out = {}
    for name, view, bound in WAYS:
        replayed = calibrated_replay(view(selection), view(report), max_changed, confidence if bound else None)
        out[name] = {**replayed, "fallback": replayed["rungs"].get("fallback", 0.0)}
    return out


def study(
    selection: list[dict],
    report: list[dict],
    sizes: list[int],
    resamples: int,
    max_changed: float,
    confidence: float,
    seed: int = 0,
) -> dict:
    """Per size `n` (items per task): `resamples` calibrations on `n` items of each task drawn without replacement
    (one where `n` is every item), each replayed on all of `report`."""
    tasks = by_task(selection)
    largest = min(len(items) for items in tasks.values())
    rng = random.Random(seed)
    rows = []
    for n in sizes:
        if n > largest:
            raise SystemExit(f"--sizes {n}: the selection set holds only {largest} items of one task")
        draws = 1 if n == largest else resamples
        runs = []
        for _ in range(draws):
            subset = [record for items in tasks.values() for record in rng.sample(items, n)]
            runs.append(one_calibration(subset, report, max_changed, confidence))
        row = {
            "items_per_task": n,
            "calibrations": draws,
            "budget_per_task": changed_budget(n, max_changed),
            "budget_per_task_bound": changed_budget(n, max_changed, confidence),
        }
        for name, *_ in WAYS:
            worst = [run[name]["worst_changed"] for run in runs]
            costs = [run[name]["mean_cost"] for run in runs]
            row[name] = {
                "worst_changed_mean": statistics.fmean(worst),
                "over_budget": sum(w > max_changed + 1e-9 for w in worst) / draws,
                "mean_cost": statistics.fmean(costs),
                "mean_cost_spread": [min(costs), max(costs)],
                "fallback_mean": statistics.fmean(run[name]["fallback"] for run in runs),
            }
        rows.append(row)
        print(
            f"n={n:>3}: "
            + "; ".join(
                f"{name} over {row[name]['over_budget']:.2f} cost {row[name]['mean_cost']:.3f}" for name, *_ in WAYS
            ),
            flush=True,
        )
    return {"sizes": rows}


def markdown(result: dict, source: str = "benchmarks/results/ladder_calibration_size.json") -> str:
    """The docs table: per calibration size, each way's share of calibrations over the budget on the report set's
    worst task, and its mean cost."""
    run = result["run"]
    names = [name for name, *_ in WAYS]
    headers = [name.replace("_bound", ", bound").replace("_", " ") for name in names]
    lines = [
        f"Generated from `{source}` (`{run['command']}`). Selection records: "
        + ", ".join(f"{n} {task}" for task, n in run["selection_items"].items())
        + f"; report records (held out, pooled): {run['report_items']} ("
        + ", ".join(f"{n} {task}" for task, n in run["report_items_per_task"].items())
        + f"). Each size draws that many items of every task {run['resamples']} times (once at the full set) and "
        f"calibrates at most {run['max_changed']:.0%} changed answers per task, on the items alone or (*bound*) as a "
        f"one-sided Clopper-Pearson upper bound at {run['confidence']:g}; each calibration is replayed on every report "
        "record. Cells: share of calibrations whose worst task is served more than the budget · mean cost (1 = the "
        "target's prefill; the probe and the mapping are paid on every rung).",
        "",
        "| items per task | changed answers allowed (alone / bound) | " + " | ".join(headers) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for row in result["sizes"]:
        allowed = f"{row['budget_per_task']} / {'none served' if row['budget_per_task_bound'] < 0 else row['budget_per_task_bound']}"
        cells = [f"{row[name]['over_budget']:.2f} · {row[name]['mean_cost']:.3f}" for name in names]
        lines.append(f"| {row['items_per_task']} ({row['calibrations']}x) | {allowed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["sizes"]
    sizes = [row["items_per_task"] for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, *_ in WAYS:
        style = "--" if name.endswith("_bound") else "-"
        label = name.replace("_bound", " (upper bound)").replace("_", " ")
        left.plot(sizes, [row[name]["over_budget"] for row in rows], style, marker="o", label=label)
        right.plot(sizes, [row[name]["mean_cost"] for row in rows], style, marker="o", label=label)
    run = result["run"]
    left.set_ylabel(f"share of calibrations serving > {run['max_changed']:.0%}\nchanged answers (report, worst task)")
    right.set_ylabel("mean cost per request (1 = the target's prefill)")
    right.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    for axis in (left, right):
        axis.set_xlabel("calibration items per task")
        axis.set_ylim(bottom=0)
    right.legend(fontsize=7)
    fig.suptitle(
        f"guard ladder vs calibration size ({run['resamples']} draws a size; report: {run['report_items']} items)",
        fontsize=9,
        y=1.02,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--selection", required=True, help="records JSONL of the selection set")
    parser.add_argument("--report", action="append", required=True, help="records JSONL of a report set (repeatable)")
    parser.add_argument("--sizes", default="12,24,48,72,100", help="calibration items per task")
    parser.add_argument("--resamples", type=int, default=50, help="calibrations a size (one at the full set)")
    parser.add_argument("--max-changed", type=float, default=0.05)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plot", default=None)
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    selection, report = read_records([args.selection]), read_records(args.report)
    shared = {r["prompt_sha256"] for r in selection} & {r["prompt_sha256"] for r in report}
    if shared:
        raise SystemExit(f"{len(shared)} report prompts are also in the selection set: report on held-out items only")
    sizes = [int(n) for n in args.sizes.split(",")]
    result = {
        "run": {
            "what": "the guard ladder calibrated on subsets of one selection set, replayed on held-out report records",
            "selection": args.selection,
            "selection_items": {task: len(items) for task, items in sorted(by_task(selection).items())},
            "report": args.report,
            "report_items": len(report),
            "report_items_per_task": {task: len(items) for task, items in sorted(by_task(report).items())},
            "max_changed": args.max_changed,
            "confidence": args.confidence,
            "resamples": args.resamples,
            "seed": args.seed,
            "command": "python -m benchmarks.ladder.ladder_calibration_size "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "date": _dt.date.today().isoformat(),
        },
        "environment": environment_info(),
        **study(selection, report, sizes, args.resamples, args.max_changed, args.confidence, args.seed),
    }
    write_json(args.out, result)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
