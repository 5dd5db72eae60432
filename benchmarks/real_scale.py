"""Retention on the real pair against calibration scale.

The paper's ridge (k = 8 and k = all) is fitted on growing prefixes of one calibration stream (the snapshots that
`real_family.py calibrate --snapshots 2,4,8,...` keeps) and every fit is scored on the same items, three ways
(source alone, target alone, handoff), with the prefills of each model computed once and kept on disk. It answers
"does the paper's method hold on this pair if it gets more calibration text", and how far the answer moves with
the number of calibration positions (the paper's scale: 500 x 1,024 tokens at stride 4 = 128K positions).

    python benchmarks/real_scale.py --cache-dir C run --calibration W/calib --work S [--items 16]
    python benchmarks/real_scale.py report --work S      # benchmarks/results/real_family_scale.{json,png}

`run` is resumable (every score is written as soon as it is known) and picks up snapshots that appeared since the
last run; the running calibration's current checkpoint is scored too, under its position count.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import real_family as rf  # noqa: E402

RESULTS = HERE / "results" / "real_family_scale.json"
PLOT = HERE / "results" / "real_family_scale.png"
TASKS = "prose_retrieval,chat_recall,code_recall,code_nll"


def snapshots(calibration: Path) -> list[tuple[int, Path]]:
    """`(positions, folder)` of every complete snapshot and of the current checkpoint, smallest first."""
    found = {}
    for folder in [*sorted(calibration.glob("snapshot-*")), rf.checkpoint_dir(calibration)]:
        if folder is None or folder.name.endswith(".tmp") or not (folder / "progress.json").is_file():
            continue
        progress = json.loads((folder / "progress.json").read_text())
        found.setdefault(int(progress["positions"]), folder)
    return sorted(found.items())


def fit(stats, variant: str, ridge_lambda: float):
    from hf_kvmap import LayerSelection, mapper_from_statistics

    selection = LayerSelection.from_statistics(stats)
    top_k = rf.VARIANTS[variant]
    if top_k is None:
        return rf.ridge_all_mapper(stats, selection, ridge_lambda)
    return mapper_from_statistics(stats, ridge_lambda=ridge_lambda, selection=selection.with_top_k(top_k))


def cmd_run(args) -> int:
    from hf_kvmap import CalibrationStatistics
    from hf_kvmap.evaluation import evaluate_items
    from hf_kvmap.real import corpus
    from hf_kvmap.real.tasks import real_family_tasks

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = rf.load_tokenizer(rf.SMALL, args.cache_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    documents = corpus.load_manifest(args.manifest)
    tasks = real_family_tasks(tokenizer, documents, items=args.items, seed=args.seed, names=args.tasks.split(","))
    models = {name: rf.load_model(name, args.cache_dir, args.dtype) for name in (rf.SMALL, rf.LARGE)}
    names = {id(model): rf.SHORT[name] for name, model in models.items()}
    store = rf.PrefillStore(work / "prefills")
    CachedHandoff = rf.cached_handoff_class()
    path = work / f"scores-items{args.items}-seed{args.seed}-{args.dtype}.json"
    scores = json.loads(path.read_text()) if path.is_file() else {}

    def record(key: str, task, handoff, mode: str, **extra) -> None:
        if key in scores:
            return
        start = time.perf_counter()
        kwargs = {"stop": task.stop} if task.task_type == "exact_match" else {}
        value = evaluate_items(handoff, task.task_type, task.items, mode, **kwargs)
        scores[key] = {"score": value, "n_items": len(task.items), "seconds": time.perf_counter() - start, **extra}
        rf.write_json(path, scores)
        print(f"{key}: {value:.4f} ({scores[key]['seconds']:.0f} s)", flush=True)

    alone = CachedHandoff(models[rf.SMALL], models[rf.LARGE], None, tokenizer, store=store, names=names)
    for task in tasks:
        record(f"{task.name}|alone|{rf.SHORT[rf.SMALL]}", task, alone, "source")
        record(f"{task.name}|alone|{rf.SHORT[rf.LARGE]}", task, alone, "target")
    directions = [d for d in rf.DIRECTIONS if rf.direction_name(*d) in args.directions.split(",")]
    for positions, folder in snapshots(Path(args.calibration)):
        for source, target in directions:
            direction = rf.direction_name(source, target)
            todo = [
                v
                for v in args.variants.split(",")
                if any(f"{t.name}|{positions}|{direction}|{v}" not in scores for t in tasks)
            ]
            if not todo:
                continue
            stats = CalibrationStatistics.load(rf._stats_dir(folder, source, target))
            for variant in todo:
                start = time.perf_counter()
                mapper = fit(stats, variant, args.ridge_lambda).to(models[target].dtype)
                fit_seconds = time.perf_counter() - start
                handoff = CachedHandoff(models[source], models[target], mapper, tokenizer, store=store, names=names)
                for task in tasks:
                    key = f"{task.name}|{positions}|{direction}|{variant}"
                    record(key, task, handoff, "mapped", fit_seconds=fit_seconds, ridge_lambda=args.ridge_lambda)
            del stats
    print(f"prefills computed {store.computed}, loaded {store.loaded}; scores in {path}")
    return 0


def assemble_curve(scores: dict) -> dict:
    """Per (direction, variant): one three-way results row (retention, floor-normalized) per calibration size."""
    from hf_kvmap.evaluation import summarize_retention
    from hf_kvmap.real.tasks import TASK_META

    curves: dict = {}
    for key in scores:
        parts = key.split("|")
        if len(parts) != 4:
            continue
        _, positions, direction, variant = parts
        curves.setdefault(f"{direction}/{variant}", set()).add(int(positions))
    out = {}
    for name, sizes in sorted(curves.items()):
        direction, variant = name.split("/")
        source, target = direction.split("-to-")
        rows = []
        for positions in sorted(sizes):
            results = {"tasks": {}, "perplexity": {}}
            for task, meta in TASK_META.items():
                keys = {
                    "source": f"{task}|alone|{source}",
                    "target": f"{task}|alone|{target}",
                    "mapped": f"{task}|{positions}|{direction}|{variant}",
                }
                if not all(k in scores for k in keys.values()):
                    continue
                row = {mode: scores[k]["score"] for mode, k in keys.items()}
                row["n_items"] = scores[keys["mapped"]]["n_items"]
                if meta["task_type"] == "perplexity":
                    results["perplexity"][task] = row
                else:
                    results["tasks"][task] = {**row, "chance": meta["chance"], "task_type": meta["task_type"]}
            summarize_retention(results)
            rows.append({"positions": positions, **results})
        out[name] = rows
    return out


def plot_curve(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({t for rows in curves.values() for row in rows for t in row["tasks"]})
    fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(4 * (len(tasks) + 1), 3.4))
    for name, rows in curves.items():
        x = [row["positions"] for row in rows]
        for ax, task in zip(axes, tasks):
            y = [row["tasks"].get(task, {}).get("mapped") for row in rows]
            ax.plot(x, y, marker="o", label=name)
            target = [row["tasks"][task]["target"] for row in rows if task in row["tasks"]]
            if target:
                ax.axhline(target[0], color="gray", ls=":", lw=1)
            ax.set_title(f"{task} (dotted: each target alone)", fontsize=9)
        y = [row["perplexity"].get("code_nll", {}).get("mapped") for row in rows]
        axes[-1].plot(x, y, marker="o", label=name)
        axes[-1].set_title("code NLL after the handoff (lower is better)", fontsize=9)
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("calibration positions")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_report(args) -> int:
    work = Path(args.work)
    path = work / f"scores-items{args.items}-seed{args.seed}-{args.dtype}.json"
    scores = json.loads(path.read_text())
    curves = assemble_curve(scores)
    report = {
        "run": {
            "items_per_task": args.items,
            "seed": args.seed,
            "dtype": args.dtype,
            "ridge_lambda": sorted({v["ridge_lambda"] for v in scores.values() if "ridge_lambda" in v}),
        },
        "alone": {k: v for k, v in scores.items() if "|alone|" in k},
        "curves": curves,
    }
    rf.write_json(RESULTS, report)
    plot_curve(curves, PLOT)
    for name, rows in curves.items():
        for row in rows:
            cells = ", ".join(
                f"{t} {r['mapped']:.3f}/{r['target']:.3f}" for t, r in {**row["tasks"], **row["perplexity"]}.items()
            )
            print(f"{name} @ {row['positions']}: {cells}")
    print(f"wrote {RESULTS}, {PLOT}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=None, help="hf-kvmap obtain cache (default ~/.cache/hf-kvmap)")
    parser.add_argument("--dtype", choices=sorted(rf.DTYPES), default="float32")
    parser.add_argument("--items", type=int, default=16, help="items per task")
    parser.add_argument("--seed", type=int, default=1234)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="fit every snapshot and score it (resumable)")
    p.add_argument("--calibration", type=Path, required=True, help="the calibrate --out folder (its snapshots)")
    p.add_argument("--work", type=Path, required=True, help="scores and prefills are kept here")
    p.add_argument("--manifest", type=Path, default=rf.MANIFEST)
    p.add_argument("--tasks", default=TASKS)
    p.add_argument("--directions", default="0.5b-to-1.5b,1.5b-to-0.5b")
    p.add_argument("--variants", default="ridge-k8,ridge-all")
    p.add_argument("--ridge-lambda", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("report", help="write the results JSON and the plot")
    p.add_argument("--work", type=Path, required=True)
    p.set_defaults(func=cmd_report)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
