"""How much could a better probe save? The guard ladder with a perfect probe, one that knows for every request the
cheapest rung that keeps the target's own answer, replayed on the same measured records as the calibrated ladders:
once free, and once at the measured cost of each real probe. Beside it, how well each real probe separates the
requests whose mapped cache changes the answer from the rest (AUROC per task).

Nothing is measured here: the records are the JSONL files `benchmarks.ladder.guard_ladder` keeps under its `--work` folder
(one line per item), read as they are.

    python -m benchmarks.ladder.ladder_headroom --selection $WORK/ladder/0.5b-to-1.5b.selection.jsonl \
        --report seed-1234=$WORK/ladder/0.5b-to-1.5b.report.jsonl \
        --report seed-2024=$WORK/ladder_2024/0.5b-to-1.5b.report.jsonl \
        --out benchmarks/results/ladder_headroom.json --plot benchmarks/results/ladder_headroom.png

The perfect probe's ladder (`hf_kvmap.calibration.ladder_items.perfect_probe_outcome`) is a lower bound on the cost of any ladder
of these rungs, with a probe of that price, that serves no changed answer; a reference, not a serving choice.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from collections.abc import Sequence

from hf_kvmap.calibration.ladder_items import (
    held_strategies,
    ladder_from_records,
    perfect_probe_outcome,
    replay_ladder,
)
from hf_kvmap.reporting import environment_info, write_json

from ..formatting import fraction_text
from .guard_ladder import served_summary
from .ladder_calibration_size import by_task, read_records


def auroc(positives: Sequence[float], negatives: Sequence[float]) -> float | None:
    """The chance that a positive scores above a negative (ties count half); `None` without both kinds."""
    if not positives or not negatives:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


#: the column of the check after the rung in the separation tables: `1 - margin` read as a risk
CHECK = "check: 1 - answer margin"
#: ... and of a check over the whole answer: one minus its smallest token margin
CHECK_ANSWER = "check over the answer: 1 - smallest margin"


def separation(records: Sequence[dict], fraction: str = "0") -> dict[str, dict[str, dict]]:
    """Per task and probe: the AUROC of the probe's risk for "the cache changes the target's answer" (the mapped cache;
    with `fraction`, the first strategy's repair of that share), and how many records of each kind it rests on. Where
    every record holds the answer margin on that cache, `CHECK` too: one minus the margin read as a risk (what the
    check after the rung reads, on the served cache itself rather than before the repair); where it holds every
    answer token's margin, `CHECK_ANSWER` (the check over the whole answer) too."""
    out: dict[str, dict[str, dict]] = {}
    for task in sorted({r["task"] for r in records}):
        mine = [r for r in records if r["task"] == task]
        strategy = sorted(mine[0]["answers"])[0]
        answers = [r["answers"][strategy][fraction] for r in mine]
        flip = [bool(a["changed"]) for a in answers]
        signals = {probe: [r["risks"][probe] for r in mine] for probe in sorted(mine[0]["risks"])}
        if all("margin" in a for a in answers):
            signals[CHECK] = [1.0 - a["margin"] for a in answers]
        if all("margins" in a for a in answers):
            signals[CHECK_ANSWER] = [1.0 - min(a["margins"]) for a in answers]
        out[task] = {
            name: {
                "auroc": auroc([v for v, f in zip(values, flip) if f], [v for v, f in zip(values, flip) if not f]),
                "changed": sum(flip),
                "kept": len(flip) - sum(flip),
            }
            for name, values in signals.items()
        }
    return out


def study(
    selection: list[dict], reports: dict[str, list[dict]], max_changed: float, confidence: float
) -> dict[str, dict]:
    """Per report set: the perfect probe's ladder (free, and at each real probe's cost) per strategy, beside the
    ladders calibrated on `selection` (budget on the items alone, and as an upper bound at `confidence`) replayed
    there; and each probe's separation on the selection set and on every report set."""
    strategies = held_strategies(selection)
    probes = sorted(selection[0]["risks"])
    calibrated = {  # calibrated once, replayed on every report set
        "ladder": ladder_from_records(selection, max_changed=max_changed),
        "ladder_bound": ladder_from_records(selection, max_changed=max_changed, confidence=confidence),
    }
    repairs = sorted((f for f in selection[0]["answers"][strategies[0]] if float(f)), key=float)
    out: dict[str, dict] = {"separation": {"selection": separation(selection)}, "reports": {}}
    if repairs:  # where the mapped cache changes (nearly) every answer, what tells which repairs keep it
        out["repair_separation"] = {f: {"selection": separation(selection, f)} for f in repairs}
    for name, report in reports.items():
        ways: dict[str, dict] = {}
        for strategy in strategies:
            ways[f"perfect {strategy}"] = {
                **served_summary(perfect_probe_outcome(report, strategy)),
                "strategy": strategy,
            }
            for probe in probes:
                ways[f"perfect {strategy} at {probe}"] = {
                    **served_summary(perfect_probe_outcome(report, strategy, probe)),
                    "strategy": strategy,
                    "probe": probe,
                }
        for way, ladder in calibrated.items():
            ways[way] = served_summary(replay_ladder(ladder, report))
        out["reports"][name] = ways
        out["separation"][name] = separation(report)
        for fraction, sets in out.get("repair_separation", {}).items():
            sets[name] = separation(report, fraction)
    return out


def _label(way: str, entry: dict, quote: str = "") -> str:
    """A row's name: a perfect probe's ladder by its strategy and whose cost it pays, or the calibrated ladder."""
    if "strategy" not in entry:
        return {"ladder": "calibrated, budget on the items", "ladder_bound": "calibrated, budget as a bound"}[way]
    cost = f"at the cost of {quote}{entry['probe']}{quote}" if entry.get("probe") else "free"
    return f"perfect probe, {quote}{entry['strategy'].split(':')[0]}{quote} repairs, {cost}"


def markdown(result: dict, source: str = "benchmarks/results/ladder_headroom.json") -> str:
    """The docs tables: per report set, the perfect probe's ladder beside the calibrated ones (mean cost, worst task's
    changed answers served, share falling back), and the probes' AUROC per task."""
    run = result["run"]
    names = list(result["reports"])
    lines = [
        f"Generated from `{source}` (`{run['command']}`). The perfect probe serves each request the cheapest rung "
        "that keeps the target's own answer (else the fallback); its rungs are costed as a calibrated ladder's (the "
        "mapping and the probe on every rung, the repair on a repairing one, the prefill on the fallback). The "
        f"calibrated ladders: at most {run['max_changed']:.0%} changed answers per task on the selection set "
        f"({', '.join(f'{n} {t}' for t, n in run['selection_items'].items())}), on the items alone or as a "
        f"one-sided upper bound at {run['confidence']:g}. Cells: mean cost (1 = the target's prefill) · worst task's "
        "changed answers served · share falling back.",
        "",
        "| ladder | " + " | ".join(f"report set `{n}`" for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for way, first in result["reports"][names[0]].items():
        label = _label(way, first, "`")
        cells = [
            f"{w['mean_cost']:.3f} · {w['worst_changed']:.1%} · {w['rungs'].get('fallback', 0.0):.0%}"
            for w in (result["reports"][n][way] for n in names)
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", *_separation_lines(result["separation"], "mapped cache")]
    for fraction, sets in result.get("repair_separation", {}).items():
        lines += ["", *_separation_lines(sets, f"repair of {fraction_text(float(fraction))}")]
    return "\n".join(lines)


def _separation_lines(separations: dict[str, dict], what: str) -> list[str]:
    """The AUROC table of `separation` per set (selection first), for the answers `what` changes."""
    sets = list(separations)
    probes = list(next(iter(separations["selection"].values())))  # the probes, then the check where measured
    lines = [
        f"How well each probe separates the requests whose {what} changes the answer (AUROC: 0.5 is chance; "
        "changed / kept requests in brackets)"
        + (
            f"; `{CHECK}` is what the check after the rung reads, on the served cache itself, after the repair:"
            if CHECK in probes
            else ":"
        ),
        "",
        "| task | set | " + " | ".join(f"`{p}`" for p in probes) + " |",
        "|---|---|" + "---|" * len(probes),
    ]
    for task in sorted(separations["selection"]):
        for name in sets:
            row = separations[name].get(task)
            if row is None:
                continue
            first = row[probes[0]]
            cells = ["-" if row.get(p, {}).get("auroc") is None else f"{row[p]['auroc']:.2f}" for p in probes]
            lines.append(f"| {task} | {name} ({first['changed']} / {first['kept']}) | " + " | ".join(cells) + " |")
    return lines


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["reports"])
    ways = list(result["reports"][names[0]])
    fig, axis = plt.subplots(figsize=(8, 0.35 * len(ways) * len(names) + 1.2))
    height = 0.8 / len(names)
    for k, name in enumerate(names):
        costs = [result["reports"][name][w]["mean_cost"] for w in ways]
        axis.barh([i + k * height for i in range(len(ways))], costs, height=height, label=f"report set {name}")
    axis.set_yticks([i + 0.4 - height / 2 for i in range(len(ways))])
    axis.set_yticklabels([_label(w, result["reports"][names[0]][w]) for w in ways], fontsize=7)
    for k, name in enumerate(names):  # what each ladder serves changed, beside its bar
        for i, w in enumerate(ways):
            entry = result["reports"][name][w]
            axis.annotate(
                f"{entry['worst_changed']:.0%} changed",
                (entry["mean_cost"], i + k * height),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=6,
            )
    axis.set_xlim(0, 1.2)
    axis.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
    axis.set_xlabel("mean cost per request (1 = the target's prefill); label: worst task's changed answers served")
    axis.invert_yaxis()
    axis.legend(fontsize=7)
    axis.set_title("guard ladder: a perfect probe against the calibrated ones", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--selection", required=True, help="records JSONL of the selection set")
    parser.add_argument(
        "--report",
        action="append",
        required=True,
        help="records JSONL of a report set, NAME=PATH or PATH (repeatable)",
    )
    parser.add_argument("--max-changed", type=float, default=0.05)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plot", default=None)
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    selection = read_records([args.selection])
    reports = {}
    for number, given in enumerate(args.report, start=1):
        name, _, path = given.rpartition("=") if "=" in given else (str(number), "", given)
        if name in reports:
            raise SystemExit(f"--report {given}: a second report set named {name!r}; give each its own NAME=")
        reports[name] = read_records([path])
    held = {r["prompt_sha256"] for r in selection}
    for name, report in reports.items():
        if held & {r["prompt_sha256"] for r in report}:
            raise SystemExit(f"report set {name!r} shares prompts with the selection set: report on held-out items")
    result = {
        "run": {
            "what": "the guard ladder with a perfect probe against the calibrated ladders, on measured records",
            "selection": args.selection,
            "selection_items": {task: len(items) for task, items in sorted(by_task(selection).items())},
            "report": args.report,
            "max_changed": args.max_changed,
            "confidence": args.confidence,
            "command": "python -m benchmarks.ladder.ladder_headroom "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "date": _dt.date.today().isoformat(),
        },
        "environment": environment_info(),
        **study(selection, reports, args.max_changed, args.confidence),
    }
    write_json(args.out, result)
    print(markdown(result, args.out))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
