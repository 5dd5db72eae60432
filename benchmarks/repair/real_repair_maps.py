"""Does a better map need less repair? Two or more `benchmarks.repair.real_repair` runs of one pair, on the same items, with
different mappers, side by side: the markdown of `docs/repair.md` (`maps_markdown`) and a plot, one panel per task,
of each map's frontier for one strategy (the point at 0 % is the mapped cache alone).

Nothing is measured here; the runs' JSON files are read as they are.

    python -m benchmarks.repair.real_repair_maps benchmarks/results/real_repair.json benchmarks/results/real_repair_kl.json \
        --plot benchmarks/results/real_repair_maps.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..formatting import fraction_text, number_text
from .repair_report import mapper_name, score_text, task_label, task_value


def map_label(run: dict) -> str:
    """How a run's mapper reads in a table: the folder name, its objective and its calibration positions."""
    config = run.get("mapper_config") or {}
    parts = [mapper_name(run["mapper"])]
    details = []
    tuned = config.get("fine_tunes") or [o for o in [config.get("objective")] if o not in (None, "mse", "ridge")]
    if tuned:
        details.append(f"fine-tuned: {', '.join(tuned)}")
    if config.get("calibration_positions"):
        details.append(f"{config['calibration_positions']:,} calibration positions")
    return " ".join(parts + ([f"({', '.join(details)})"] if details else []))


def _short(run: dict) -> str:
    """The mapper's folder name alone, for a column header."""
    return f"`{Path(run['mapper']).name}`"


def _items(run: dict) -> dict:
    """What decides a run's items: the models, the dtype and both item sets (not the fractions reported)."""
    sets = {name: {k: v for k, v in run[name].items() if k != "fractions"} for name in ("selection", "report")}
    return {"direction": run["direction"], "dtype": run["dtype"], **sets}


def _check_same_items(runs: list[dict]) -> None:
    first = runs[0]["run"]
    for other in runs[1:]:
        mine, theirs = _items(first), _items(other["run"])
        differ = [f"{key}: {mine[key]} against {theirs[key]}" for key in mine if mine[key] != theirs[key]]
        if differ:
            raise ValueError(
                f"the runs of {first['mapper']} and {other['run']['mapper']} differ ({'; '.join(differ)}): maps are "
                "compared on the same items only"
            )


def common_strategy(runs: list[dict]) -> str:
    """The strategy every run measured on its selection set (the first in the first run's order)."""
    names = [list(next(iter(r["sets"]["selection"].values()))["repair"]) for r in runs]
    shared = [name for name in names[0] if all(name in other for other in names[1:])]
    if not shared:
        raise ValueError(f"the runs measured no strategy in common ({names}): nothing to compare")
    return "draft_attention" if "draft_attention" in shared else shared[0]


def maps_markdown(runs: list[dict], sources: list[str]) -> str:
    """The `real-repair-maps` section: per task, each map's mapped cache and its frontier for the common strategy on
    the selection set; each map's chosen point; and each map at its chosen point on the report set."""
    _check_same_items(runs)
    strategy = common_strategy(runs)
    fractions = sorted(
        {row["fraction"] for r in runs for data in r["sets"]["selection"].values() for row in data["repair"][strategy]}
    )
    run = runs[0]["run"]
    lines = [
        f"Generated from {', '.join(f'`{s}`' for s in sources)} (the same pair, Qwen2.5-Coder "
        f"{run['direction'].replace(':', ' -> ').upper()}, the same items: selection seed {run['selection']['seed']}, "
        f"report seed {run['report']['seed']}). Selection set, `{strategy}` (exact match and choice: retention; "
        "perplexity tasks: the perplexity itself, since the maps start from different ones; 'mapped': the mapped "
        "cache alone; '-': not measured):",
        "",
        "| task | map | mapped | " + " | ".join(fraction_text(f) for f in fractions) + " |",
        "|---|---|---|" + "---|" * len(fractions),
    ]
    for task in runs[0]["sets"]["selection"]:
        for i, result in enumerate(runs):
            data = result["sets"]["selection"].get(task)
            if data is None:
                continue
            by_fraction = {row["fraction"]: row for row in data["repair"][strategy]}
            perplexity = data.get("task_type") == "perplexity"
            mapped = score_text(data, data["mapped"]) if perplexity else number_text(data.get("mapped_retention"))
            cells = [
                "-"
                if f not in by_fraction
                else score_text(data, by_fraction[f]["score"])
                if perplexity
                else number_text(task_value(data, by_fraction[f]))
                for f in fractions
            ]
            label = f"{task} (perplexity; the target: {score_text(data, data['target'])})"
            head = "" if i else label if perplexity else task_label(task, data)
            lines.append(f"| {head} | {map_label(result['run'])} | {mapped} | {' | '.join(cells)} |")
    lines += ["", "Chosen on each map's selection set (the rule of the section above):", ""]
    for result in runs:
        chosen = result["chosen_on_selection"]
        reached = "reaches" if chosen["reaches_goal"] else "does not reach"
        lines.append(
            f"- {map_label(result['run'])}: `{chosen['strategy']}` at {fraction_text(chosen['fraction'])}, worst-task "
            f"retention {number_text(chosen['selection_worst_retention'])} ({reached} {result['run']['goal']:g})."
        )
    reported = [r for r in runs if r["sets"].get("report")]
    if reported:
        lines += [
            "",
            "Report set, each map at its chosen point (retention or the gap closed, then the raw score: items right "
            "or the perplexity):",
            "",
            "| task | items | target | "
            + " | ".join(f"{_short(r['run'])} mapped | {_short(r['run'])} repaired" for r in reported)
            + " |",
            "|---|---|---|" + "---|---|" * len(reported),
        ]
        for task, data0 in reported[0]["sets"]["report"].items():
            cells = []
            for result in reported:
                data = result["sets"]["report"].get(task)
                row = (result.get("chosen_reported") or {}).get(task)
                if data is None or row is None:
                    cells += ["-", "-"]
                    continue
                cells.append(score_text(data, data["mapped"]))
                cells.append(
                    f"{number_text(task_value(data, row))} ({score_text(data, row['score'])}) at {fraction_text(row['fraction'])}"
                )
            lines.append(
                f"| {task_label(task, data0)} | {data0['items']} | {score_text(data0, data0['target'])} | "
                f"{' | '.join(cells)} |"
            )
    return "\n".join(lines)


def plot(runs: list[dict], path: str) -> None:
    """One panel per task: each map's selection-set frontier for the common strategy (0 % = the mapped cache) and its
    report-set point (a star); retention against the goal, or the perplexity itself against the target's (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategy = common_strategy(runs)
    tasks = list(runs[0]["sets"]["selection"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.6 * len(tasks), 3.4), squeeze=False)
    for axis, task in zip(axes[0], tasks):
        perplexity = False
        for result in runs:
            data = result["sets"]["selection"].get(task)
            if data is None:
                continue
            perplexity = data.get("task_type") == "perplexity"
            rows = data["repair"][strategy]

            def y(set_data: dict, row: dict | None) -> float | None:
                if set_data.get("task_type") == "perplexity":
                    return set_data["mapped"] if row is None else row["score"]
                return set_data.get("mapped_retention") if row is None else task_value(set_data, row)

            xs = [0.0] + [row["fraction"] for row in rows]
            ys = [y(data, None)] + [y(data, row) for row in rows]
            (line,) = axis.plot(
                xs,
                [float("nan") if v is None else v for v in ys],
                marker="o",
                markersize=3,
                label=Path(result["run"]["mapper"]).name,
            )
            row = (result.get("chosen_reported") or {}).get(task)
            if row is not None and not perplexity:  # a perplexity of other items is on another scale
                report = result["sets"]["report"][task]
                axis.plot([row["fraction"]], [y(report, row)], marker="*", markersize=10, color=line.get_color())
            if perplexity:
                axis.axhline(data["target"], color="grey", linestyle="--", linewidth=1)
        if not perplexity:
            axis.axhline(runs[0]["run"]["goal"], color="grey", linestyle=":", linewidth=1)
        axis.set_title(f"{task} ({'perplexity, target dashed' if perplexity else 'retention'})", fontsize=9)
        axis.set_xlabel(f"fraction recomputed ({strategy})")
    axes[0][0].set_ylabel("selection set (lines), report set (stars)")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(
        f"a better map, less repair? Qwen2.5-Coder {runs[0]['run']['direction'].replace(':', ' -> ')}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="`benchmarks.repair.real_repair` result JSON files, one per map")
    parser.add_argument("--plot", required=True)
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if len(args.runs) < 2:
        raise SystemExit("give at least two runs (one per map) to compare")
    runs = [json.loads(Path(path).read_text()) for path in args.runs]
    _check_same_items(runs)
    plot(runs, args.plot)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
