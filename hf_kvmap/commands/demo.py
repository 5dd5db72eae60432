"""`hf-kvmap demo`: hand conversations from a small to a large member of the shipped tiny family."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

DEFAULT_LENGTHS = (64, 256, 512, 1000)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="Hand conversations from a small to a large tiny-family model and report retention and latency.",
        description="Loads the shipped tiny family and mapper, evaluates every task three ways (source alone, "
        "target alone, source prefill -> mapped cache -> target), reports the tasks the target does better than "
        "chance (and names the others, with why), and times the mapper against target re-prefill.",
    )
    parser.add_argument("--source", default="tiny-s", help="source member (default: tiny-s)")
    parser.add_argument("--target", default="tiny-l", help="target member (default: tiny-l)")
    parser.add_argument("--mapper", default=None, help="mapper folder or Hub id (default: the shipped one)")
    parser.add_argument("--items", type=int, default=200, help="evaluation items per task (default: 200)")
    parser.add_argument("--seed", type=int, default=1234, help="evaluation seed (default: 1234)")
    parser.add_argument(
        "--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="context lengths timed for latency"
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per length (median reported)")
    parser.add_argument("--json", type=Path, default=None, help="write the results JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG plot here (needs matplotlib)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.set_defaults(func=run)


def drop_unmeasurable_tasks(results: dict) -> dict:
    """Move every task the target alone does not do better than chance from `results["tasks"]` to
    `results["dropped_tasks"]`, keeping its scores and the reason (`retention_measurable` of
    `hf_kvmap.evaluation.summarize_retention`: a one-sided exact binomial test over the task's items at the 5 % level;
    for free generation, where chance is 0, the null is one lucky item). Returns `results`, changed in place."""
    dropped = {name: row for name, row in results["tasks"].items() if not row.get("retention_measurable", True)}
    results["tasks"] = {name: row for name, row in results["tasks"].items() if name not in dropped}
    for row in dropped.values():
        p = row.get("target_vs_chance_p")
        p_text = f", p = {p:.2f}" if p is not None else ""
        row["reason"] = (
            f"the target alone scores {row['target']:.3f} against chance {row['chance']:.2f} over {row['n_items']} "
            f"items{p_text}: not better than chance, so there is nothing for a handoff to retain"
        )
    results["dropped_tasks"] = dropped
    return results


def dropped_lines(results: dict) -> list[str]:
    """One line per dropped task, naming it and why it was dropped."""
    return [f"dropped {name}: {row['reason']}" for name, row in results.get("dropped_tasks", {}).items()]


def format_table(results: dict) -> str:
    from ..reporting import retention_cells

    lines = [
        f"{'task':<12}{'source':>9}{'target':>9}{'mapped':>9}{'chance':>9}{'retention':>16}{'floor-norm':>16}",
    ]
    for name, row in results["tasks"].items():
        raw, floor = retention_cells(row)  # "not measurable" where the target does not beat chance
        lines.append(
            f"{name:<12}{row['source']:>9.3f}{row['target']:>9.3f}{row['mapped']:>9.3f}{row['chance']:>9.2f}"
            f"{raw:>16}{floor:>16}"
        )
    for name, row in results.get("perplexity", {}).items():
        lines.append(f"{name + ' (ppl)':<12}{row['source']:>9.3f}{row['target']:>9.3f}{row['mapped']:>9.3f}")
    lines += dropped_lines(results)
    if results.get("latency"):
        lines.append("")
        lines.append(f"{'tokens':>8}{'mapper ms':>12}{'prefill ms':>12}{'speedup':>9}")
        for row in results["latency"]:
            lines.append(
                f"{row['tokens']:>8}{row['mapper_ms']:>12.2f}{row['prefill_ms']:>12.2f}{row['speedup']:>9.2f}"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    from .. import zoo
    from ..evaluation import HandoffEvaluation, evaluate_tasks, measure_latency
    from ..plotting import plot_demo
    from ..reporting import environment_info
    from ._output import finish

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    tokenizer = zoo.load_tokenizer(padding_side="left")
    from .models import load_mapper

    for flag, name in (("--source", args.source), ("--target", args.target)):
        if name not in zoo.FAMILY:
            raise SystemExit(f"hf-kvmap demo: {flag} {name!r} is not a tiny-family member ({', '.join(zoo.FAMILY)}).")
    source, target = zoo.load_model(args.source), zoo.load_model(args.target)
    mapper = load_mapper(args.mapper or str(zoo.mapper_path(args.source, args.target)), "demo")
    handoff = HandoffEvaluation(source=source, target=target, mapper=mapper, tokenizer=tokenizer)

    results = drop_unmeasurable_tasks(evaluate_tasks(handoff, zoo.tiny_family_tasks(args.items, args.seed)))
    lengths = [int(n) for n in str(args.lengths).split(",") if n]
    results["latency"] = measure_latency(handoff, lengths, repeats=args.repeats) if lengths else []
    results["run"] = {
        "source": args.source,
        "target": args.target,
        "mapper": args.mapper or f"zoo:{args.source}-to-{args.target}",
        "mapper_content_hash": mapper.config.content_hash,
        "mapper_config": {
            "kind": mapper.config.kind,
            "top_k": max(len(layers) for layers in mapper.config.source_layers),
            "ridge_lambda": mapper.config.ridge_lambda,
            "input_kinds": mapper.config.input_kinds,
            "context_window": mapper.config.context_window,
            "layer_inputs": mapper.config.layer_inputs,
            "key_norm": mapper.config.key_norm,
            "objective": mapper.config.objective or ("kl" if mapper.config.calibration.get("kl_finetune") else "mse"),
            "parameters": sum(p.numel() for p in mapper.parameters()),
        },
        "items_per_task": args.items,
        "seed": args.seed,
        "seconds": time.perf_counter() - started,
    }
    results["environment"] = environment_info()
    print(format_table(results))
    finish(args.json, results)
    if args.plot:
        plot_demo(results, args.plot)
        print(f"wrote {args.plot}")
    return 0
