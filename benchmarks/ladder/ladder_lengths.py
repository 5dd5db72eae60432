"""The guard ladder at several prompt lengths, for docs/switch.md: one `benchmarks.ladder.guard_ladder` run calibrated at one
length (`--tokens`) and replayed on a report set at each of `--report-tokens`; what each calibration serves per length,
and the length from which the ladder costs less than the target's prefill.

`python -m benchmarks.ladder.ladder_lengths RESULT.json --plot PATH.png` draws it: per direction, each way's mean cost and
worst task's changed answers against the prompt length.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_kvmap.calibration.ladder_items import replay_ladder, with_min_tokens

from ..formatting import break_even_text, number_text, pct, rung_label, rung_order
from ..switch.long_switch_report import break_even_length

#: the ways held to the bound, and the name of each served with `min_tokens` at its calibration set's shortest prompt
GATED = {"ladder_confident": "ladder_confident_gated", "ladder_checked_confident": "ladder_checked_confident_gated"}

#: the calibrated ways a run compares, as the tables and the plot name them
WAYS = (
    ("ladder_confident", "ladder, bound"),
    ("ladder_confident_gated", "ladder, bound, maps from its calibration length"),
    ("binary_guard_confident", "binary guard, bound"),
    ("ladder", "ladder"),
    ("binary_guard", "binary guard"),
    ("ladder_lost", "ladder, budget on lost answers"),
    ("ladder_checked_confident", "ladder + check, bound"),
    ("ladder_checked_confident_gated", "ladder + check, bound, maps from its calibration length"),
    ("ladder_checked", "ladder + check"),
)


def gated_way(ladder, selection: list[dict], report: list[dict]) -> dict:
    """`ladder` (calibrated on `selection`) with `min_tokens` at the selection set's shortest prompt, a rule fixed
    before any report set is read (it maps only the lengths it was calibrated at and longer; a shorter prompt gets
    the target's prefill unmapped), replayed on `report`."""
    gated = with_min_tokens(ladder, min(r["tokens"] for r in selection), selection)
    return {
        "ladder": gated.to_dict(),
        "selection": gated.calibration["outcome"],
        "report": replay_ladder(gated, report),
    }


def markdown(result: dict) -> str:
    """Of a `benchmarks.ladder.guard_ladder` run with report sets at several lengths (`--report-tokens`): per direction and
    length, what each calibration serves on the report set (the ladder and the binary guard, with the budget held on
    the selection items and, where measured, as an upper confidence bound; the ladder with its budget on lost answers):
    worst task's changed answers (and lost ones, where that was the budget), mean cost and net saving, beside the
    target's prefill seconds."""
    lines = [
        "| direction | report prompts (tokens) | items per task | target's prefill (s) | calibration | rungs | worst-task "
        "changed served | worst-task lost served | mean cost | net saving |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, data in result["directions"].items():
        direction = key.split(" at ")[0]
        items = data.get("report_items_per_task", result["run"]["report"]["items_per_task"])
        for name, label in WAYS:
            if name not in data:
                continue
            if name == "ladder_lost" and data[name]["ladder"]["calibration"].get("confidence") is not None:
                label = "ladder, bound, budget on lost answers"
            report = data[name]["report"]
            worst = _worst_served(changed_outcome(data[name]))
            lost = pct(_worst_served(report), 1) if "report_changed" in data[name] else "-"
            rungs = ", ".join(
                f"{rung_label(rung)} {pct(share)}"
                for rung, share in sorted(report["rungs"].items(), key=lambda item: rung_order(item[0]))
                if share
            )
            if "checked_fallback" in report:
                rungs += f"; the check sent back {pct(report['checked_fallback'])}"
            lines.append(
                f"| {direction} | {data['tokens']:,.0f} | {items} | {data['prefill_seconds']:.1f} | {label} | {rungs} | "
                f"{pct(worst, 1)} | {lost} | {number_text(report['mean_cost'])} | {pct(report['net_saving'])} |"
            )
    lines += ["", *break_even_lines(result)]
    return "\n".join(lines)


def changed_outcome(way: dict) -> dict:
    """What a calibrated way serves on the report set counted as changed answers, whatever its budget: a ladder with
    its budget on lost answers counts those in `report` and the changed ones in `report_changed`."""
    return way.get("report_changed", way["report"])


def _worst_served(outcome: dict) -> float:
    """The worst task's share of counted answers served (changed, or lost where that was the budget)."""
    return max(group["changed_served"] for group in outcome["per_group"].values())


def break_even_lines(result: dict) -> list[str]:
    """Per direction of a run with report sets at several lengths: the prompt length from which the ladder held to the
    bound (else the plain ladder) costs less than the target's prefill, interpolated between the lengths measured
    (`long_switch_report.break_even_length` over 1 / mean cost), and the lengths where it serves more changed answers
    than its budget (`run.max_changed`): there its cost is no saving it vouches for."""
    lines = []
    per_direction: dict[str, list[tuple[float, float]]] = {}
    over: dict[str, list[tuple[float, float]]] = {}  # (tokens, worst task's changed share) where over the budget
    budget = result.get("run", {}).get("max_changed")
    name = "ladder_confident" if all("ladder_confident" in d for d in result["directions"].values()) else "ladder"
    for key, data in result["directions"].items():
        direction = key.split(" at ")[0]
        report = data[name]["report"]
        cost = report["mean_cost"]
        per_direction.setdefault(direction, []).append((data["tokens"], 1.0 / cost if cost else float("inf")))
        worst = _worst_served(report)
        if budget is not None and worst > budget:
            over.setdefault(direction, []).append((data["tokens"], worst))
    label = "the ladder held to the bound" if name == "ladder_confident" else "the ladder"
    for direction, points in per_direction.items():
        found = break_even_length(points)
        measured = ", ".join(f"{tokens:,.0f}: {1 / speed:.2f}" for tokens, speed in found["points"])
        line = (
            f"**{direction}**: break-even length of {label}: {break_even_text(found)}; mean cost per length (1 = the "
            f"prefill): {measured}."
        )
        if direction in over:
            line += (
                f" It serves more changed answers than its {pct(budget)} budget (worst task) at "
                f"{', '.join(f'{tokens:,.0f} tokens ({pct(worst, 1)})' for tokens, worst in sorted(over[direction]))}: "
                "no saving is vouched for there."
            )
        lines.append(line)
    gated = _gated_lines(result)
    return [*lines, "", *gated] if gated else lines


def _gated_lines(result: dict) -> list[str]:
    """Per direction: what the ladder held to the bound serves per length when it maps no prompt shorter than its
    calibration set's shortest (`gated_way`)."""
    lines, found = [], {}
    for key, data in result["directions"].items():
        if "ladder_confident_gated" in data:
            way = data["ladder_confident_gated"]
            found.setdefault(key.split(" at ")[0], []).append((data["tokens"], way))
    for direction, points in found.items():
        shortest = points[0][1]["ladder"]["min_tokens"]
        measured = ", ".join(
            f"{tokens:,.0f}: cost {way['report']['mean_cost']:.2f}, worst task {pct(_worst_served(way['report']), 1)} "
            "changed"
            for tokens, way in sorted(points, key=lambda point: point[0])
        )
        lines.append(
            f"**{direction}**, the same ladder mapping no prompt shorter than its calibration set's shortest "
            f"({shortest:,} tokens; a shorter one gets the target's prefill at cost 1): {measured}."
        )
    return lines


def per_length(result: dict) -> dict[str, dict[str, list[tuple[float, float, float]]]]:
    """Per direction and way: `(report tokens, mean cost, worst task's changed answers served)` sorted by length."""
    out: dict[str, dict[str, list]] = {}
    for key, data in result["directions"].items():
        ways = out.setdefault(key.split(" at ")[0], {})
        for name, _ in WAYS:
            if name in data:
                ways.setdefault(name, []).append(
                    (data["tokens"], data[name]["report"]["mean_cost"], _worst_served(changed_outcome(data[name])))
                )
    return {d: {n: sorted(points) for n, points in ways.items()} for d, ways in out.items()}


def plot(result: dict, path: str) -> None:
    """Per direction: each way's mean cost (1 = the target's prefill) and worst task's changed answers against the
    report set's prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = per_length(result)
    labels = dict(WAYS)
    fig, axes = plt.subplots(len(found), 2, figsize=(10, 3.6 * len(found)), squeeze=False)
    for row, (direction, ways) in zip(axes, found.items()):
        for name, points in ways.items():
            tokens = [p[0] for p in points]
            row[0].plot(tokens, [p[1] for p in points], marker="o", label=labels[name])
            row[1].plot(tokens, [p[2] for p in points], marker="o", label=labels[name])
        row[0].axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        row[1].axhline(result["run"]["max_changed"], color="grey", linewidth=0.8, linestyle=":")
        row[0].set_ylabel("mean cost (1 = the target's prefill)")
        row[1].set_ylabel("changed answers served (worst task)")
        lengths = sorted({p[0] for points in ways.values() for p in points})
        for axis in row:
            axis.set_xscale("log", base=2)
            axis.set_xticks(lengths, [f"{t:,.0f}" for t in lengths])
            axis.minorticks_off()
            axis.set_xlabel("prompt length (tokens)")
            axis.set_title(f"{direction} (report sets; calibrated at {result['run']['tokens']:,} tokens)", fontsize=9)
            axis.set_ylim(bottom=0)
    axes[0][1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path, help="a `benchmarks.ladder.guard_ladder` JSON with `--report-tokens`")
    parser.add_argument("--plot", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    if not args.result.exists():
        raise SystemExit(
            f"{args.result} does not exist: give the JSON that `benchmarks.ladder.guard_ladder --out` wrote."
        )
    result = json.loads(args.result.read_text())
    if not all("tokens" in data for data in result["directions"].values()):
        raise SystemExit(f"{args.result} has no prompt lengths: it is not a run of the long tasks (--report-tokens).")
    plot(result, args.plot)
    print(f"wrote {args.plot}")


__all__ = ["GATED", "WAYS", "break_even_lines", "changed_outcome", "gated_way", "markdown", "per_length", "plot"]


if __name__ == "__main__":
    main()
