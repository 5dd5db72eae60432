"""Selective repair on the real pair (Qwen2.5-Coder 0.5B <-> 1.5B, from `hf-kvmap obtain`): retention vs fraction
recomputed for each repair strategy, on the five tasks of `lab.real.tasks`, with a fitted real mapper.
Strategies and fractions are chosen on one item set (seed `--selection-seed`) and reported on another
(`--report-seed`); every point is written as soon as it is measured, so a stopped run resumes where it stopped.

Each task is scored its own way: the two read-back tasks by exact match (retention = accuracy over the target's,
chance 0), `code_recall` by a four-way choice (floor-normalized retention, chance 0.25; none where the target does
not beat chance), and the two perplexity tasks by the share of the mapped cache's perplexity gap to the target that
the repair closes.

    python -m benchmarks.repair.real_repair --mapper $WORK/mappers/0.5b-to-1.5b/ridge-k8 --dtype float32 \
        --selection-items 32 --report-items 200 --report-items-other 64 --out benchmarks/results/real_repair.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_kvmap import MapperModel
from hf_kvmap.evaluation import HandoffEvaluation, evaluate_items
from hf_kvmap.real import converted_path, is_converted
from hf_kvmap.real.corpus import load_manifest, manifest_sha256
from hf_kvmap.repair import STRATEGIES, RepairConfig
from hf_kvmap.reporting import environment_info, write_json
from lab.real.tasks import TASK_NAMES, real_family_tasks

REPO = Path(__file__).resolve().parents[2]
MODELS = {"0.5b": "qwen2.5-coder-0.5b-instruct", "1.5b": "qwen2.5-coder-1.5b-instruct"}
GENERATION_TASKS = ("prose_retrieval", "chat_recall")
FRACTIONS = (0.1, 0.2, 0.3, 0.5)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _folder(name: str, cache_dir: str | None) -> Path:
    if not is_converted(name, cache_dir):
        raise SystemExit(f"{name} is not converted in this cache; run: hf-kvmap obtain {name}")
    return converted_path(name, cache_dir)


def _strategy(name: str) -> dict:
    """A strategy's settings from its name on the command line; `mix:a+b` is an equal-weight `mix` of a and b."""
    if name.startswith("mix:"):
        return {"name": "mix", "components": [{**_settings(part), "weight": 1.0} for part in name[4:].split("+")]}
    return _settings(name)


def _settings(name: str) -> dict:
    if name not in STRATEGIES:
        raise SystemExit(f"unknown repair strategy {name!r}; known: {', '.join(sorted(STRATEGIES))} (or mix:a+b)")
    return {"name": name, "last_tokens": 16} if name in ("source_attention", "target_attention") else {"name": name}


def _retention(score: float, target: float, chance: float) -> float | None:
    """Floor-normalized retention; none where the target does not beat chance."""
    return (score - chance) / (target - chance) if target > chance else None


def _gap_closed(perplexity: float, target: float, mapped: float) -> float | None:
    """The share of the mapped cache's perplexity gap to the target's that a repair closes (1 = the target's)."""
    return (mapped - perplexity) / (mapped - target) if mapped > target else None


def value(row: dict) -> float | None:
    """The number a frontier plots for one measured point: retention, or the perplexity gap closed."""
    return row["retention"] if "retention" in row else row.get("gap_closed")


class Points:
    """Measured points, kept in `path` (JSON) after every measurement so a run resumes.

    The file records the `setup` its points were measured under (direction, mapper, dtype, manifest, both item
    sets); a resume under another setup is refused, since a point's key (`set/task/mode`) does not say how many
    items it scored or which mapper it used."""

    def __init__(self, path: Path, setup: dict):
        self.path = path
        self.setup = setup
        self.data = {}
        if path.is_file():
            stored = _stored(path)
            differ = _differences(stored["setup"], setup)
            if differ:
                raise SystemExit(
                    f"{path} was measured under another setup ({'; '.join(differ)}); pass another --points file, or "
                    "the arguments it was measured with"
                )
            self.data = stored["points"]

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"setup": self.setup, "points": self.data}, indent=1, sort_keys=True))
        tmp.replace(self.path)

    def get(self, key: str, measure) -> dict:
        """The point `key`, measured by `measure(key)` (its score) unless it was already."""
        if key not in self.data:
            start = time.perf_counter()
            score = measure(key)
            self.data[key] = {"score": score, "seconds": round(time.perf_counter() - start, 1)}
            self._write()
            print(f"{key}: {score:.3f} ({self.data[key]['seconds']} s)", flush=True)
        return self.data[key]

    def adopt_targets(self, other: Path) -> int:
        """Take the target-alone points of another run whose setup differs only in the mapper (the target alone
        reads no mapper): the same items, dtype and models. Returns how many were taken."""
        stored = _stored(other)
        differ = _differences(stored["setup"], self.setup, ignore=("mapper",))
        if differ:
            raise SystemExit(f"--targets-from {other} was measured under another setup ({'; '.join(differ)})")
        taken = 0
        for key, point in stored["points"].items():
            if key.endswith("/target") and key not in self.data:
                self.data[key] = {**point, "from": str(other)}
                taken += 1
        if taken:
            self._write()
        return taken


def _stored(path: Path) -> dict:
    """A points file's `{"setup": ..., "points": ...}`; one without a setup cannot be matched to a run."""
    stored = json.loads(path.read_text())
    if "setup" not in stored or "points" not in stored:
        raise SystemExit(
            f"{path} records no setup (it was written before points files did), so its points cannot be matched to "
            "this run; pass another --points file to measure afresh"
        )
    return stored


def _differences(stored: dict, wanted: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    """`key: stored there, wanted here` for every setup field that differs (but those in `ignore`)."""
    return [
        f"{key}: {stored.get(key)!r} there, {wanted.get(key)!r} here"
        for key in sorted((set(stored) | set(wanted)) - set(ignore))
        if stored.get(key) != wanted.get(key)
    ]


def fine_tunes(config) -> list[str]:
    """The fine-tunes a mapper went through after its fit (`kl`, `attention`: the objectives record themselves in
    `config.calibration` as `<objective>_finetune`), in the order they are recorded."""
    return [key.removesuffix("_finetune") for key in (config.calibration or {}) if key.endswith("_finetune")]


def setup_of(args, mapper_hash: str | None, manifest_sha256: str) -> dict:
    """What a measured point depends on besides its key: the models, the mapper, the dtype, the documents the items
    are built from, and both item sets."""
    return {
        "direction": args.direction,
        "mapper": mapper_hash,
        "dtype": args.dtype,
        "manifest": manifest_sha256,
        "selection": [args.selection_seed, args.selection_items, args.selection_items_other],
        "report": [args.report_seed, args.report_items, args.report_items_other],
    }


def measure(handoff: HandoffEvaluation, points: Points, name: str, task, strategies, fractions) -> dict:
    """The target, the mapped cache, and every (strategy, fraction) on one task: its score (accuracy, or perplexity
    for a perplexity task), and the retention (or the perplexity gap closed) of each."""
    kwargs = {"stop": task.stop} if task.task_type == "exact_match" else {}

    def run(mode: str, repair: RepairConfig | None):
        def go(key: str):
            handoff.repair = repair
            try:
                return evaluate_items(handoff, task.task_type, task.items, mode, progress=key, **kwargs)
            finally:
                handoff.repair = None

        return go

    target = points.get(f"{name}/{task.name}/target", run("target", None))["score"]
    mapped = points.get(f"{name}/{task.name}/mapped", run("mapped", None))["score"]
    perplexity = task.task_type == "perplexity"

    def judged(score: float) -> dict:
        if perplexity:
            return {"gap_closed": _gap_closed(score, target, mapped)}
        return {"retention": _retention(score, target, task.chance)}

    out = {
        "items": len(task.items),
        "task_type": task.task_type,
        "chance": None if perplexity else task.chance,
        "target": target,
        "mapped": mapped,
        "repair": {},
    }
    if not perplexity:
        out["mapped_retention"] = _retention(mapped, target, task.chance)
    for strategy in strategies:
        rows = []
        for fraction in fractions:
            config = RepairConfig(_strategy(strategy), fraction=fraction)
            point = points.get(f"{name}/{task.name}/{strategy}/{fraction}", run("mapped", config))
            rows.append(
                {"fraction": fraction, "score": point["score"], **judged(point["score"]), "seconds": point["seconds"]}
            )
        out["repair"][strategy] = rows
    return out


def choose(selection: dict, goal: float) -> dict:
    """On the selection set: the cheapest (fraction, strategy) whose retention reaches `goal` on every task that has
    a retention (not the perplexity tasks; not a task the target does not beat chance on), else the (fraction,
    strategy) with the best worst-task retention."""
    tasks = [t for t, data in selection.items() if data.get("mapped_retention") is not None]
    if not tasks:
        raise SystemExit("no task of the selection set has a measurable retention: nothing to choose a repair by")
    candidates = []
    for strategy, rows in selection[tasks[0]]["repair"].items():
        for index, row in enumerate(rows):
            worst = min((selection[t]["repair"][strategy][index]["retention"] or 0.0) for t in tasks)
            candidates.append((row["fraction"], strategy, index, worst))
    reaching = sorted((c for c in candidates if c[3] >= goal), key=lambda c: (c[0], -c[3]))
    pick = reaching[0] if reaching else max(candidates, key=lambda c: (c[3], -c[0]))
    return {
        "strategy": pick[1],
        "fraction": pick[0],
        "index": pick[2],
        "selection_worst_retention": pick[3],
        "reaches_goal": bool(reaching),
    }


def fractions_of(results: dict) -> list[float]:
    """Every fraction the selection set measured."""
    first = next(iter(results["sets"]["selection"].values()))
    return [row["fraction"] for rows in first["repair"].values() for row in rows]


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = [s for s in ("selection", "report") if s in results["sets"]]
    columns = max(len(results["sets"][s]) for s in sets)
    fig, axes = plt.subplots(len(sets), columns, figsize=(3.6 * columns, 3.3 * len(sets)), squeeze=False)
    for axis in axes.flat:
        axis.set_visible(False)
    cells = [(axes[i][j], name, task) for i, name in enumerate(sets) for j, task in enumerate(results["sets"][name])]
    for axis, name, task in cells:
        axis.set_visible(True)
        data = results["sets"][name][task]
        perplexity = data.get("task_type") == "perplexity"
        for strategy, rows in data["repair"].items():
            xs = [0.0] + [r["fraction"] for r in rows]
            ys = [0.0 if perplexity else data["mapped_retention"]] + [value(r) for r in rows]
            axis.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", markersize=3, label=strategy)
        axis.axhline(results["run"]["goal"], color="grey", linestyle=":", linewidth=1)
        measure = "perplexity gap closed" if perplexity else "retention"
        axis.set_title(f"{task} ({measure})\n{name} set ({data['items']} items)", fontsize=9)
        axis.set_xlabel("fraction recomputed")
        shown = [y for r in data["repair"].values() for y in map(value, r) if y is not None]
        axis.set_ylim(min(-0.05, *shown) - 0.05, max(1.15, *shown) + 0.05)  # a repair can overshoot or make it worse
        axis.set_xlim(-0.01, max(results["run"]["report"].get("fractions", [0.0]) + fractions_of(results)) + 0.01)
    for row in axes:
        row[0].set_ylabel("floor-normalized retention")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"selective repair, Qwen2.5-Coder {results['run']['direction'].replace(':', ' -> ')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mapper", required=True, help="fitted real mapper folder")
    parser.add_argument("--direction", default="0.5b:1.5b", help="source:target of the mapper")
    parser.add_argument("--cache-dir", default=None, help="`hf-kvmap obtain` cache directory")
    parser.add_argument("--manifest", default=str(REPO / "benchmarks" / "real" / "calibration_manifest.json"))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--tasks", default=",".join(TASK_NAMES))
    parser.add_argument("--strategies", default=",".join(sorted(STRATEGIES)))
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    parser.add_argument("--selection-items", type=int, default=32, help="selection items of the read-back tasks")
    parser.add_argument("--selection-items-other", type=int, default=16, help="selection items of the other tasks")
    parser.add_argument("--report-items", type=int, default=200, help="report items of the read-back tasks")
    parser.add_argument("--report-items-other", type=int, default=64, help="report items of the other tasks")
    parser.add_argument(
        "--report-fractions", default="chosen", help="fractions measured on the report set: a list, or 'chosen'"
    )
    parser.add_argument("--selection-seed", type=int, default=4321)
    parser.add_argument("--report-seed", type=int, default=1234)
    parser.add_argument("--goal", type=float, default=0.9)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--selection-only", action="store_true", help="stop after the choice (a later run resumes with the report set)"
    )
    parser.add_argument("--points", default=None, help="resume file (default: --out with .points.json)")
    parser.add_argument(
        "--targets-from",
        default=None,
        help="another run's points file (same items, dtype and direction, another mapper): its target-alone points "
        "are taken instead of measured again",
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "real_repair.json"))
    parser.add_argument("--plot", default=str(REPO / "benchmarks" / "results" / "real_repair.png"))
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    for name in args.strategies.split(","):
        RepairConfig(_strategy(name), fraction=0.1)  # a typo or a bad mix fails here, before the models load
    if args.threads:
        torch.set_num_threads(args.threads)
    source_name, target_name = (MODELS[side] for side in args.direction.split(":"))
    dtype = DTYPES[args.dtype]
    tokenizer = AutoTokenizer.from_pretrained(_folder(target_name, args.cache_dir), padding_side="left")
    source = AutoModelForCausalLM.from_pretrained(_folder(source_name, args.cache_dir), dtype=dtype).eval()
    target = AutoModelForCausalLM.from_pretrained(_folder(target_name, args.cache_dir), dtype=dtype).eval()
    mapper = MapperModel.from_pretrained(args.mapper, dtype=dtype)
    handoff = HandoffEvaluation(source=source, target=target, mapper=mapper, tokenizer=tokenizer)
    documents = load_manifest(args.manifest)
    names = args.tasks.split(",")
    strategies = args.strategies.split(",")
    fractions = [float(f) for f in args.fractions.split(",")]
    points = Points(
        Path(args.points or Path(args.out).with_suffix(".points.json")),
        setup_of(args, mapper.config.content_hash, manifest_sha256(documents)),
    )
    if args.targets_from:
        print(f"{points.adopt_targets(Path(args.targets_from))} target points taken from {args.targets_from}")

    results = {
        "run": {
            "what": "selective repair on the real pair: retention vs fraction recomputed per strategy",
            "direction": args.direction,
            "mapper": str(args.mapper),
            "mapper_content_hash": mapper.config.content_hash,
            "targets_from": args.targets_from,
            "mapper_config": {
                **{
                    k: mapper.config.to_dict().get(k)
                    for k in ("source_model_id", "target_model_id", "kind", "top_k", "ridge_lambda", "objective")
                },
                "calibration_positions": (mapper.config.calibration or {}).get("positions"),
                "fine_tunes": fine_tunes(mapper.config),
            },
            "dtype": args.dtype,
            "goal": args.goal,
            "selection": {
                "seed": args.selection_seed,
                "items": args.selection_items,
                "items_other": args.selection_items_other,
            },
            "report": {"seed": args.report_seed, "items": args.report_items, "items_other": args.report_items_other},
            "command": "python -m benchmarks.repair.real_repair " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": _dt.date.today().isoformat(),
        },
        "environment": environment_info(),
        "sets": {},
    }

    def tasks(items: int, items_other: int, seed: int) -> list:
        counts = {name: items if name in GENERATION_TASKS else items_other for name in names}
        return [task for name in names for task in real_family_tasks(tokenizer, documents, counts[name], seed, [name])]

    results["sets"]["selection"] = {}
    for task in tasks(args.selection_items, args.selection_items_other, args.selection_seed):
        results["sets"]["selection"][task.name] = measure(handoff, points, "selection", task, strategies, fractions)
    chosen = choose(results["sets"]["selection"], args.goal)
    results["chosen_on_selection"] = chosen
    report_fractions = (
        [chosen["fraction"]]
        if args.report_fractions == "chosen"
        else sorted({chosen["fraction"], *(float(f) for f in args.report_fractions.split(","))})
    )
    results["run"]["report"]["fractions"] = report_fractions
    write_json(args.out, results)
    if args.selection_only:
        plot(results, args.plot)
        return
    # the report set: the target, the mapped cache, and the chosen strategy at the report fractions (the chosen one
    # among them); written task by task, so a cut run shows what it measured
    results["sets"]["report"] = {}
    results["chosen_reported"] = {}
    for task in tasks(args.report_items, args.report_items_other, args.report_seed):
        data = measure(handoff, points, "report", task, [chosen["strategy"]], report_fractions)
        results["sets"]["report"][task.name] = data
        results["chosen_reported"][task.name] = next(
            row for row in data["repair"][chosen["strategy"]] if row["fraction"] == chosen["fraction"]
        )
        write_json(args.out, results)
    plot(results, args.plot)


if __name__ == "__main__":
    main()
