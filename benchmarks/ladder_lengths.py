"""The guard ladder at several prompt lengths, for docs/switch.md: one `benchmarks.guard_ladder` run calibrated at one
length (`--tokens`) and replayed on a report set at each of `--report-tokens`; what each calibration serves per length,
and the length from which the ladder costs less than the target's prefill.
"""

from __future__ import annotations

from .long_switch_report import break_even_length
from .repair_report import _pct, _rung_label, _rung_order, number_text


def markdown(result: dict) -> str:
    """Of a `benchmarks.guard_ladder` run with report sets at several lengths (`--report-tokens`): per direction and
    length, what each calibration serves on the report set (the ladder and the binary guard, with the budget held on
    the selection items and, where measured, as an upper confidence bound; the ladder with its budget on lost answers):
    worst task's changed answers (and lost ones, where that was the budget), mean cost and net saving, beside the
    target's prefill seconds."""
    names = [
        ("ladder_confident", "ladder, bound"),
        ("binary_guard_confident", "binary guard, bound"),
        ("ladder", "ladder"),
        ("binary_guard", "binary guard"),
        ("ladder_lost", "ladder, budget on lost answers"),
    ]
    lines = [
        "| direction | report prompts (tokens) | items per task | target's prefill (s) | calibration | rungs | worst-task "
        "changed served | worst-task lost served | mean cost | net saving |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, data in result["directions"].items():
        direction = key.split(" at ")[0]
        items = data.get("report_items_per_task", result["run"]["report"]["items_per_task"])
        for name, label in names:
            if name not in data:
                continue
            if name == "ladder_lost" and data[name]["ladder"]["calibration"].get("confidence") is not None:
                label = "ladder, bound, budget on lost answers"
            report = data[name]["report"]
            changed = data[name].get(
                "report_changed"
            )  # set where the budget was on lost answers: `report` counts them
            worst = _worst_served(report if changed is None else changed)
            lost = "-" if changed is None else _pct(_worst_served(report), 1)
            rungs = ", ".join(
                f"{_rung_label(rung)} {_pct(share)}"
                for rung, share in sorted(report["rungs"].items(), key=lambda item: _rung_order(item[0]))
                if share
            )
            lines.append(
                f"| {direction} | {data['tokens']:,.0f} | {items} | {data['prefill_seconds']:.1f} | {label} | {rungs} | "
                f"{_pct(worst, 1)} | {lost} | {number_text(report['mean_cost'])} | {_pct(report['net_saving'])} |"
            )
    lines += ["", *break_even_lines(result)]
    return "\n".join(lines)


def _worst_served(outcome: dict) -> float:
    """The worst task's share of counted answers served (changed, or lost where that was the budget)."""
    return max(group["changed_served"] for group in outcome["per_group"].values())


def break_even_lines(result: dict) -> list[str]:
    """Per direction of a run with report sets at several lengths: the prompt length from which the ladder held to the
    bound (else the plain ladder) costs less than the target's prefill, interpolated between the lengths measured
    (`long_switch_report.break_even_length` over 1 / mean cost)."""
    lines = []
    per_direction: dict[str, list[tuple[float, float]]] = {}
    name = "ladder_confident" if all("ladder_confident" in d for d in result["directions"].values()) else "ladder"
    for key, data in result["directions"].items():
        cost = data[name]["report"]["mean_cost"]
        per_direction.setdefault(key.split(" at ")[0], []).append(
            (data["tokens"], 1.0 / cost if cost else float("inf"))
        )
    label = "the ladder held to the bound" if name == "ladder_confident" else "the ladder"
    for direction, points in per_direction.items():
        found = break_even_length(points)
        measured = ", ".join(f"{tokens:,.0f}: {1 / speed:.2f}" for tokens, speed in found["points"])
        if "tokens" in found:
            verdict = f"pays from about {found['tokens']:,} tokens"
        elif "below" in found:
            verdict = f"pays at every length measured, from {found['below']:,.0f} tokens"
        else:
            verdict = f"pays at no length measured (up to {found['above']:,.0f} tokens)"
        lines.append(f"**{direction}**: {label} {verdict} (mean cost per length, 1 = the prefill: {measured}).")
    return lines


__all__ = ["break_even_lines", "markdown"]
