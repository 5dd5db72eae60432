"""`hf-kvmap eval`: evaluate a (source, target, mapper) three ways on a task set, with optional diagnostics."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from . import _args


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="Evaluate source alone, target alone and the handoff on a task set; write a self-describing JSON.",
    )
    parser.add_argument("--source", required=True, help="tiny-family member, folder or Hub id")
    parser.add_argument("--target", required=True, help="tiny-family member, folder or Hub id")
    parser.add_argument("--mapper", default=None, help="mapper folder or Hub id (default: the shipped one)")
    parser.add_argument(
        "--tasks",
        default="tiny-family",
        help="'tiny-family' or a JSONL file (see hf_kvmap.evaluation.load_jsonl_tasks)",
    )
    parser.add_argument(
        "--items", type=_args.positive_int, default=200, help="items per task for the tiny-family task set"
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--diagnostics",
        type=_args.non_negative_int,
        default=0,
        metavar="N",
        help="also compute K/V R^2 and attention cosine on N held-out calibration-style sequences",
    )
    parser.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="evaluate even if the models differ from the mapper's recorded approval tuple (for experiments)",
    )
    parser.add_argument("--json", type=_args.output_file, default=None, help="write results here")
    parser.add_argument("--plot", type=_args.output_file, default=None, help="write a diagnostics heat map PNG here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from .. import zoo
    from ..artifacts import content_hash
    from ..evaluation import HandoffEvaluation, evaluate_tasks, load_jsonl_tasks
    from ..reporting import environment_info, retention_cells
    from . import models as _models
    from ._output import finish
    from .models import load_tokenizer, resolve_mapper

    started = time.perf_counter()
    if args.plot is not None and not args.diagnostics:
        raise SystemExit("hf-kvmap eval: --plot draws the diagnostics heat maps: pass --diagnostics N with it.")
    if args.tasks != "tiny-family":  # every malformed line is reported before any model runs
        try:
            tasks = load_jsonl_tasks(args.tasks)
        except (OSError, ValueError) as err:
            raise SystemExit(f"hf-kvmap eval: {err}") from None
    source, target = _models.load_causal_lm(args.source), _models.load_causal_lm(args.target)
    tokenizer = load_tokenizer(args.source)
    mapper_name = resolve_mapper(args.mapper, args.source, args.target)
    mapper = _models.load_mapper(mapper_name, "eval")
    try:
        mismatches = mapper.check_compatible(source, target, tokenizer, allow_mismatch=args.allow_mismatch)
    except ValueError as err:  # the hint names the command's flag, not the Python argument
        message = str(err).replace("allow_mismatch=True", "pass --allow-mismatch to evaluate anyway")
        raise SystemExit(f"hf-kvmap eval: --mapper {mapper_name}: {message}") from None
    if args.tasks == "tiny-family":
        tasks = zoo.tiny_family_tasks(args.items, args.seed)
    handoff = HandoffEvaluation(source=source, target=target, mapper=mapper, tokenizer=tokenizer)
    try:
        results = evaluate_tasks(handoff, tasks)
    except ValueError as err:  # e.g. --allow-mismatch with a mapper of another geometry: the mapping refuses it
        raise SystemExit(f"hf-kvmap eval: {err}") from None
    if args.diagnostics:
        from ..diagnostics import diagnose
        from ..zoo import corpus

        if args.source not in zoo.FAMILY:
            raise SystemExit("--diagnostics uses the tiny-family held-out text; pass tiny-family models.")

        texts = corpus.make_eval_set("text", args.diagnostics, seed=args.seed + 1, n_chars=256)
        batches = [torch.tensor([tokenizer(item.text)["input_ids"]]) for item in texts]
        results["diagnostics"] = diagnose(source, target, mapper, batches)
        results["diagnostics_summary"] = results["diagnostics"]["summary"]
        if args.plot:
            from ..plotting import plot_diagnostics

            plot_diagnostics(results["diagnostics"], args.plot)
    results["run"] = {
        "source": args.source,
        "target": args.target,
        "mapper": mapper_name,
        "mapper_content_hash": mapper.config.content_hash or content_hash(mapper.state_dict(), mapper.config),
        "source_revision": mapper.config.source_revision,
        "target_revision": mapper.config.target_revision,
        "task_set": args.tasks if args.tasks == "tiny-family" else Path(args.tasks).name,
        "items_per_task": args.items if args.tasks == "tiny-family" else None,
        "seed": args.seed,
        "approval_mismatches": mismatches,
        "seconds": time.perf_counter() - started,
    }
    results["environment"] = environment_info()
    for name, row in results["tasks"].items():
        print(
            f"{name:<14} source {row['source']:.3f}  target {row['target']:.3f}  mapped {row['mapped']:.3f}  "
            f"retention {retention_cells(row)[0]}"
        )
    return finish(args.json, results)
