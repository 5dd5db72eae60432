"""Retention vs fraction recomputed, for every repair strategy, on the tiny family (or any source/target/mapper).

For each direction and task (exact-match generation tasks of the tiny family: chat recall and recall), on two item
sets of different seeds: the target's accuracy, the mapped handoff's (fraction 0), and the repaired handoff's at every
strategy and fraction. Retention is floor-normalized as the project's evaluation does (`(acc - chance) / (target -
chance)`, chance 0 for these tasks). The strategy and fraction are chosen on the selection set (the cheapest point
with retention >= `--goal`, and the best strategy at each fraction) and reported on the other set.

    python benchmarks/repair/repair_frontier.py                          # tiny-s/m/x -> tiny-l, 64 + 64 items per task
    python benchmarks/repair/repair_frontier.py --items 16 --quick       # a minute
    python benchmarks/repair/repair_frontier.py --directions tiny-m:tiny-l --items 200

Writes `--out` (JSON) and `--plot` (PNG).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import time
from pathlib import Path

import torch

from hf_kvmap import MapperModel
from hf_kvmap.evaluation import HandoffEvaluation, evaluate_items
from hf_kvmap.loading import load_causal_lm, load_tokenizer, resolve_mapper
from hf_kvmap.repair import STRATEGIES, RepairConfig
from hf_kvmap.reporting import environment_info, write_json
from hf_kvmap.zoo import corpus

REPO = Path(__file__).resolve().parents[2]
DIRECTIONS = ("tiny-s:tiny-l", "tiny-m:tiny-l", "tiny-x:tiny-l")
TASKS = {"chat": corpus.END, "recall": "\n"}
FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.3)
#: strategies measured for reference and never chosen
REFERENCE_ONLY = ("oracle",)


def _strategy(name: str) -> dict | str:
    return {"name": name, "last_tokens": 16} if name in ("source_attention", "target_attention") else name


def retention(accuracy: float, target: float, chance: float = 0.0) -> float | None:
    return (accuracy - chance) / (target - chance) if target > chance else None


def measure_set(handoff: HandoffEvaluation, items, stop: str, strategies, fractions) -> dict:
    handoff.repair = None
    target = evaluate_items(handoff, "exact_match", items, "target", stop=stop)
    mapped = evaluate_items(handoff, "exact_match", items, "mapped", stop=stop)
    out = {"items": len(items), "target": target, "mapped": mapped, "mapped_retention": retention(mapped, target)}
    out["repair"] = {}
    for name in strategies:
        points = []
        for fraction in fractions:
            handoff.repair = RepairConfig(_strategy(name), fraction=fraction)
            accuracy = evaluate_items(handoff, "exact_match", items, "mapped", stop=stop)
            points.append({"fraction": fraction, "accuracy": accuracy, "retention": retention(accuracy, target)})
        out["repair"][name] = points
    handoff.repair = None
    return out


def choose(selection: dict, report: dict, goal: float, budget: float) -> dict:
    """Chosen on `selection`, reported on `report`: the cheapest (fraction, strategy) reaching `goal`, and the best
    strategy within `budget` (never a reference-only strategy: the oracle needs the prefill repair avoids)."""
    ranked = sorted(
        (point["fraction"], -(point["retention"] or 0.0), name, index)
        for name, points in selection["repair"].items()
        if name not in REFERENCE_ONLY
        for index, point in enumerate(points)
    )
    cheapest = next(((f, n, i) for f, r, n, i in ranked if -r >= goal), None)
    within = [(-(r), f, n, i) for f, r, n, i in ranked if f <= budget]
    best = max(within, default=None, key=lambda entry: (entry[0], -entry[1]))
    out = {"goal": goal, "budget": budget}
    if cheapest is not None:
        fraction, name, index = cheapest
        out["cheapest_reaching_goal"] = {
            "strategy": name,
            "fraction": fraction,
            "selection_retention": selection["repair"][name][index]["retention"],
            "report_retention": report["repair"][name][index]["retention"],
        }
    if best is not None:
        _, fraction, name, index = best
        out["best_within_budget"] = {
            "strategy": name,
            "fraction": fraction,
            "selection_retention": selection["repair"][name][index]["retention"],
            "report_retention": report["repair"][name][index]["retention"],
            "report_meets_goal": (report["repair"][name][index]["retention"] or 0.0) >= goal,
        }
    return out


def merge(results: dict, earlier: dict, args) -> None:
    """Add the strategies of an `earlier` run to `results` (same directions, tasks, sets: checked), and choose again."""
    keys = ("items_per_set", "selection_seed", "report_seed", "fractions")
    if any(earlier["run"][key] != results["run"][key] for key in keys):
        raise SystemExit(f"--merge {args.merge}: its {keys} differ from this run's; they cannot share a frontier.")
    for direction, tasks in results["directions"].items():
        for task, sets in tasks.items():
            old = earlier["directions"][direction][task]
            for role in ("selection", "report"):
                if old[role]["target"] != sets[role]["target"] or old[role]["mapped"] != sets[role]["mapped"]:
                    raise SystemExit(f"--merge {args.merge}: {direction} {task} {role} differs from this run's.")
                sets[role]["repair"] = {**old[role]["repair"], **sets[role]["repair"]}
            sets["choice"] = choose(sets["selection"], sets["report"], args.goal, args.budget)
    results["run"]["strategies"] = sorted({*earlier["run"]["strategies"], *results["run"]["strategies"]})
    chain = list(earlier["run"].get("merged") or [])  # the earlier runs, the first one first
    results["run"]["merged"] = [*chain, {"file": args.merge, "command": earlier["run"]["command"]}]


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(d, t) for d in results["directions"] for t in results["directions"][d]]
    fig, axes = plt.subplots(1, len(cells), figsize=(3.6 * len(cells), 3.4), squeeze=False)
    for axis, (direction, task) in zip(axes[0], cells):
        data = results["directions"][direction][task]["report"]
        for name, points in data["repair"].items():
            xs = [0.0] + [p["fraction"] for p in points]
            ys = [data["mapped_retention"]] + [p["retention"] for p in points]
            axis.plot(xs, ys, marker="o", markersize=3, label=name)
        axis.axhline(results["run"]["goal"], color="grey", linestyle=":", linewidth=1)
        axis.axvline(results["run"]["budget"], color="grey", linestyle=":", linewidth=1)
        axis.set_title(f"{direction} {task} (report set)", fontsize=9)
        axis.set_xlabel("fraction recomputed")
        axis.set_ylim(0, 1.15)
    axes[0][0].set_ylabel("floor-normalized retention")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--directions", default=",".join(DIRECTIONS), help="source:target pairs (tiny-family)")
    parser.add_argument("--mapper", default=None, help="mapper folder (one direction only)")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--strategies", default=",".join(sorted(STRATEGIES)))
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    parser.add_argument("--items", type=int, default=64, help="items per set and task")
    parser.add_argument("--selection-seed", type=int, default=4321)
    parser.add_argument("--report-seed", type=int, default=1234)
    parser.add_argument("--goal", type=float, default=0.95)
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="two strategies, two fractions")
    parser.add_argument(
        "--merge",
        default=None,
        help="an earlier results file of the same directions, tasks, items and seeds: its strategies are kept beside "
        "this run's (choices and plot over both)",
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "repair_frontier.json"))
    parser.add_argument("--plot", default=str(REPO / "benchmarks" / "results" / "repair_frontier.png"))
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    directions = [pair.split(":") for pair in args.directions.split(",")]
    if args.mapper and len(directions) != 1:
        raise SystemExit("--mapper names one mapper: give exactly one --directions pair with it.")
    strategies = [s for s in args.strategies.split(",") if s]
    fractions = [float(f) for f in args.fractions.split(",")]
    if args.quick:
        strategies, fractions = strategies[:2], fractions[:2]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; registered: {sorted(STRATEGIES)}")
    tasks = {name: TASKS[name] for name in args.tasks.split(",")}
    started = time.perf_counter()
    results = {"run": {}, "directions": {}}
    for source_name, target_name in directions:
        source, target = load_causal_lm(source_name), load_causal_lm(target_name)
        mapper_path = resolve_mapper(args.mapper, source_name, target_name)
        handoff = HandoffEvaluation(
            source, target, MapperModel.from_pretrained(mapper_path), load_tokenizer(target_name)
        )
        per_task = {}
        for task, stop in tasks.items():
            sets = {
                role: measure_set(
                    handoff, corpus.make_eval_set(task, args.items, seed=seed), stop, strategies, fractions
                )
                for role, seed in (("selection", args.selection_seed), ("report", args.report_seed))
            }
            sets["choice"] = choose(sets["selection"], sets["report"], args.goal, args.budget)
            per_task[task] = sets
            print(f"{source_name}->{target_name} {task}: {sets['choice']}", flush=True)
        results["directions"][f"{source_name}->{target_name}"] = per_task
    results["run"] = {
        "directions": [f"{s}->{t}" for s, t in directions],
        "tasks": list(tasks),
        "strategies": strategies,
        "fractions": fractions,
        "items_per_set": args.items,
        "selection_seed": args.selection_seed,
        "report_seed": args.report_seed,
        "goal": args.goal,
        "budget": args.budget,
        "seconds": time.perf_counter() - started,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/repair/repair_frontier.py " + " ".join(argv or __import__("sys").argv[1:]),
    }
    if args.merge:
        merge(results, json.loads(Path(args.merge).read_text()), args)
    results["environment"] = environment_info()
    write_json(args.out, results)
    plot(results, args.plot)
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
