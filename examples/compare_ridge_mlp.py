"""Ridge vs MLP mappers on the shipped tiny family: held-out content-space MSE / R^2 and task retention.

For every `source:target` direction asked, both mappers are fitted on the same calibration text (one statistics pass
shared by the ridge solve and the MLP's layer selection, plus the MLP's feature pass), then compared on

- held-out content space: calibration-style text from another seed (documents neither mapper saw), mapped by each
  mapper layer by layer; raw MSE and per-head R^2 (averaged over heads, layers, K and V);
- the MLP's own validation split (whole calibration sequences held out of its training), where the ridge refitted on
  the same training split is the baseline (`config.calibration["mlp_training"]`);
- task retention (`hf_kvmap.evaluation`): source alone, target alone, source prefill -> mapped cache -> target.

It writes one self-describing JSON and prints a table. Until the family's weights are trained, `--random-models`
(or a missing member) builds untrained members from `hf_kvmap.zoo.family.make_config` so the script can be developed.

    python examples/compare_ridge_mlp.py --pairs tiny-s:tiny-l tiny-s:tiny-x --json compare_ridge_mlp.json
    python examples/compare_ridge_mlp.py --pairs tiny-s:tiny-m --hidden 256 --epochs 10 --items 50 --threads 1
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from hf_kvmap import fit_mapper, mapper_from_statistics, zoo
from hf_kvmap.artifacts import tokenizer_fingerprint
from hf_kvmap.diagnostics import diagnose
from hf_kvmap.evaluation import HandoffEvaluation, evaluate_items, evaluate_tasks
from hf_kvmap.features import gather_features
from hf_kvmap.fitting import content_space_metrics
from hf_kvmap.reporting import environment_info, write_json
from hf_kvmap.statistics import CalibrationStatistics

DEFAULT_PAIRS = ("tiny-s:tiny-l", "tiny-s:tiny-x")


def load_member(name: str, random_models: bool, seed: int, paths: dict[str, str] | None = None):
    """`(model, label)`: weights from `paths[name]` (a `from_pretrained` folder), the shipped weights, or an untrained
    member built from its config (label `"path:<folder>"`, `"trained"` or `"random"`)."""
    if paths and name in paths:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(paths[name], dtype=torch.float32).eval()
        return model, f"path:{paths[name]}"
    if not random_models:
        try:
            return zoo.load_model(name), "trained"
        except FileNotFoundError:
            print(f"[compare] weights of {name} are missing; using an untrained {name} (numbers are not meaningful)")
    from transformers import Qwen3ForCausalLM

    from hf_kvmap.zoo.family import make_config

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(make_config(name)).eval(), "random"


def retention(mapped: float, target: float) -> float:
    """Raw retention (docs/method.md, "Evaluation protocol and published retention"): mapped / target."""
    return mapped / target if target else float("nan")


def floor_normalized_retention(mapped: float, target: float, chance: float) -> float:
    """(mapped - chance) / (target - chance)."""
    return (mapped - chance) / (target - chance) if target != chance else float("nan")


def task_retention(source, target, ridge, mlp, tokenizer, items: int, seed: int) -> dict:
    """Every task three ways with the ridge (source/target once), then the MLP's mapped mode on the same items."""
    tasks = zoo.tiny_family_tasks(items, seed)
    results = evaluate_tasks(HandoffEvaluation(source=source, target=target, mapper=ridge, tokenizer=tokenizer), tasks)
    mlp_handoff = HandoffEvaluation(source=source, target=target, mapper=mlp, tokenizer=tokenizer)
    table = {}
    for task in tasks:
        kwargs = {"stop": task.stop} if task.task_type == "exact_match" else {}
        mapped = evaluate_items(mlp_handoff, task.task_type, task.items, "mapped", **kwargs)
        if task.task_type == "perplexity":
            row = dict(results["perplexity"][task.name])
            table[task.name] = {
                "task_type": "perplexity",
                "source": row["source"],
                "target": row["target"],
                "ridge": row["mapped"],
                "mlp": mapped,
            }
            continue
        row = results["tasks"][task.name]
        table[task.name] = {
            "task_type": task.task_type,
            "chance": task.chance,
            "source": row["source"],
            "target": row["target"],
            "ridge": row["mapped"],
            "mlp": mapped,
            "ridge_retention": retention(row["mapped"], row["target"]),
            "mlp_retention": retention(mapped, row["target"]),
            "ridge_floor_normalized": floor_normalized_retention(row["mapped"], row["target"], task.chance),
            "mlp_floor_normalized": floor_normalized_retention(mapped, row["target"], task.chance),
            "n_items": len(task.items),
        }
    return table


def compare_pair(pair: str, args, tokenizer, calibration, held_out) -> dict:
    source_name, target_name = pair.split(":")
    paths = dict(item.split("=", 1) for item in args.member_path)
    source, source_weights = load_member(source_name, args.random_models, seed=1, paths=paths)
    target, target_weights = load_member(target_name, args.random_models, seed=2, paths=paths)
    fingerprint = tokenizer_fingerprint(tokenizer)
    timings = {}

    started = time.perf_counter()
    stats = CalibrationStatistics.collect(
        source, target, calibration, stride=args.stride, tokenizer_fingerprint=fingerprint, progress=args.progress
    )
    timings["statistics_s"] = time.perf_counter() - started
    started = time.perf_counter()
    ridge = mapper_from_statistics(stats, top_k=args.top_k, ridge_lambda=args.ridge_lambda)
    timings["ridge_solve_s"] = time.perf_counter() - started
    started = time.perf_counter()
    mlp = fit_mapper(
        source,
        target,
        calibration,
        kind="mlp",
        top_k=args.top_k,
        hidden_size=args.hidden,
        epochs=args.epochs,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        val_fraction=args.val_fraction,
        patience=args.patience,
        stride=args.stride,
        seed=args.seed,
        init=args.init,
        ridge_lambda=args.ridge_lambda,
        warmup_steps=args.warmup_steps,
        statistics=stats,
        tokenizer=tokenizer,
        progress=args.progress,
    )
    timings["mlp_fit_s"] = time.perf_counter() - started  # feature pass + training (statistics shared above)

    started = time.perf_counter()
    features = gather_features(source, target, held_out, progress=False)
    held_out_metrics = {"ridge": content_space_metrics(ridge, features), "mlp": content_space_metrics(mlp, features)}
    timings["held_out_eval_s"] = time.perf_counter() - started
    diagnostics = None
    if args.diagnostics:
        started = time.perf_counter()
        diagnostics = {
            name: diagnose(source, target, mapper, held_out)["summary"]
            for name, mapper in (("ridge", ridge), ("mlp", mlp))
        }
        timings["diagnostics_s"] = time.perf_counter() - started
    training = mlp.config.calibration["mlp_training"]

    def split_mean(key: str) -> float:
        values = [entry[kind][key] for entry in training["layers"] for kind in ("key", "value")]
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else float("nan")

    result = {
        "source": source_name,
        "target": target_name,
        "weights": {"source": source_weights, "target": target_weights},
        "source_layers": ridge.config.source_layers,
        "held_out": {
            "positions": features.num_positions,
            "ridge": held_out_metrics["ridge"],
            "mlp": held_out_metrics["mlp"],
        },
        "attention_diagnostics": diagnostics,
        "mlp_validation_split": {
            "positions_val": training["positions_val"],
            "ridge_val_mse": split_mean("ridge_val_mse"),
            "mlp_val_mse": split_mean("val_mse"),
            "ridge_val_r2": split_mean("ridge_val_r2"),
            "mlp_val_r2": split_mean("val_r2"),
            "per_layer": training["layers"],
        },
        "mlp_parameters": sum(p.numel() for p in mlp.parameters()),
        "ridge_parameters": sum(p.numel() for p in ridge.parameters()),
        "calibration": {k: v for k, v in mlp.config.calibration.items() if k != "mlp_training"},
        "timings": timings,
    }
    if args.items > 0:
        started = time.perf_counter()
        result["tasks"] = task_retention(source, target, ridge, mlp, tokenizer, args.items, args.eval_seed)
        timings["tasks_s"] = time.perf_counter() - started
    if args.save_dir:
        out = Path(args.save_dir) / f"{source_name}-to-{target_name}-mlp"
        mlp.save_pretrained(out)
        result["mlp_mapper"] = str(out)
    return result


def format_table(results: dict) -> str:
    lines = []
    for pair, row in results["pairs"].items():
        weights = "/".join(sorted(set(row["weights"].values())))
        lines.append(f"== {pair} (weights: {weights}, source layers per target: {len(row['source_layers'][0])})")
        lines.append(f"{'metric':<34}{'ridge':>12}{'mlp':>12}")
        held = row["held_out"]
        for kind in ("key", "value"):
            ridge, mlp = held["ridge"][kind], held["mlp"][kind]
            lines.append(f"{'held-out ' + kind + ' MSE':<34}{ridge['mse']:>12.4g}{mlp['mse']:>12.4g}")
            lines.append(f"{'held-out ' + kind + ' R^2':<34}{ridge['r2']:>12.4f}{mlp['r2']:>12.4f}")
        for key, value in (row.get("attention_diagnostics") or {}).get("ridge", {}).items():
            other = row["attention_diagnostics"]["mlp"].get(key)
            if ("cosine" in key or "r2" in key) and isinstance(other, (int, float)):
                lines.append(f"{'held-out ' + key:<34}{value:>12.4f}{other:>12.4f}")
        split = row["mlp_validation_split"]
        lines.append(f"{'val-split MSE (K/V mean)':<34}{split['ridge_val_mse']:>12.4g}{split['mlp_val_mse']:>12.4g}")
        lines.append(f"{'val-split R^2 (K/V mean)':<34}{split['ridge_val_r2']:>12.4f}{split['mlp_val_r2']:>12.4f}")
        for task, t in row.get("tasks", {}).items():
            if t["task_type"] == "perplexity":
                label = f"{task} ppl (src {t['source']:.3f}, tgt {t['target']:.3f})"
                lines.append(f"{label:<34}{t['ridge']:>12.3f}{t['mlp']:>12.3f}")
            else:
                label = f"{task} acc (src {t['source']:.2f}, tgt {t['target']:.2f})"
                lines.append(f"{label:<34}{t['ridge']:>12.3f}{t['mlp']:>12.3f}")
                lines.append(f"{'  retention':<34}{_fmt(t['ridge_retention']):>12}{_fmt(t['mlp_retention']):>12}")
        timings = ", ".join(f"{k} {v:.1f}" for k, v in row["timings"].items())
        lines.append(f"seconds: {timings}")
        lines.append("")
    return "\n".join(lines)


def _fmt(value) -> str:
    return "n/a" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.3f}"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="*", default=list(DEFAULT_PAIRS), help="source:target directions")
    parser.add_argument("--top-k", type=int, default=8, help="source layers per target layer (default: 8)")
    parser.add_argument("--ridge-lambda", type=float, default=0.01)
    parser.add_argument("--docs", type=int, default=64, help="calibration sequences (default: 64)")
    parser.add_argument("--held-out-docs", type=int, default=16, help="held-out sequences (default: 16)")
    parser.add_argument("--length", type=int, default=512, help="tokens per sequence (default: 512)")
    parser.add_argument("--stride", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=1024, help="MLP hidden size (paper: 1024)")
    parser.add_argument("--epochs", type=int, default=20, help="MLP epochs (paper: 20)")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="positions per Adam step (paper: 4096)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (paper: 1e-3)")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--patience", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=50, help="linear lr warmup steps (paper: 0)")
    parser.add_argument("--init", choices=("ridge", "random"), default="ridge")
    parser.add_argument("--seed", type=int, default=0, help="MLP training seed")
    parser.add_argument("--items", type=int, default=100, help="evaluation items per task (0: skip the tasks)")
    parser.add_argument("--eval-seed", type=int, default=1234)
    parser.add_argument("--no-diagnostics", dest="diagnostics", action="store_false", help="skip attention cosine")
    parser.add_argument(
        "--member-path",
        action="append",
        default=[],
        metavar="NAME=FOLDER",
        help="load member NAME from a from_pretrained FOLDER (e.g. a training checkpoint) instead of the zoo",
    )
    parser.add_argument("--random-models", action="store_true", help="untrained members (for development)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    parser.add_argument("--json", type=Path, default=Path("compare_ridge_mlp.json"))
    parser.add_argument("--save-dir", default=None, help="also save the MLP mappers here")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    started = time.perf_counter()
    tokenizer = zoo.load_tokenizer(padding_side="left")
    calibration = zoo.calibration_batches(tokenizer, args.docs, args.length, batch_size=8, seed=0)
    held_out = zoo.calibration_batches(tokenizer, args.held_out_docs, args.length, batch_size=8, seed=1)
    results = {"pairs": {}}
    for pair in args.pairs:
        results["pairs"][pair] = compare_pair(pair, args, tokenizer, calibration, held_out)
        print(format_table({"pairs": {pair: results["pairs"][pair]}}), flush=True)
    results["run"] = {
        "script": "examples/compare_ridge_mlp.py",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "calibration_sequences": sum(b.shape[0] for b in calibration),
        "held_out_sequences": sum(b.shape[0] for b in held_out),
        "seconds": time.perf_counter() - started,
    }
    results["environment"] = environment_info()
    write_json(args.json, results)
    print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
