"""`hf-kvmap demo`: hand conversations from a small to a large member of the shipped tiny family."""

from __future__ import annotations

import argparse
import os
import time

from ..payoff import WAY_LABELS
from . import _args
from .demo_long import DEFAULT_LONG_ITEMS, DEFAULT_LONG_LENGTHS, DEFAULT_REACH

DEFAULT_LENGTHS = (64, 128, 256, 384, 512, 1000)
#: the repair of the `repaired` way: the positions the source reads while it drafts the answer, a fifth of them
DEFAULT_REPAIR = "draft_attention:0.2"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="Hand conversations from a small to a large tiny-family model: the target alone, the mapped, the repaired "
        "and the guarded handoff, with accuracy and time to first token, and where the switch pays.",
        description="Loads the shipped tiny family and mapper and prints first where the switch pays: the long forms "
        "of recall and chat (one fact in a long prompt of the family's own text, the question about it last) at "
        "--long-lengths, each request served four ways (the target alone, the mapped cache, the repaired cache, the "
        "guarded handoff) with accuracy and time to the first token, the rows where a handoff answers at the "
        "target's accuracy sooner, and each way's break-even length. Then it evaluates every short task (source "
        "alone, target alone, source prefill -> mapped cache -> target), reports the tasks the target does better "
        "than chance (and names the others, with why), serves each of their requests the same four ways, and times "
        "the mapper against the target's re-prefill per context length.",
    )
    parser.add_argument("--source", default="tiny-s", help="source member (default: tiny-s)")
    parser.add_argument("--target", default="tiny-l", help="target member (default: tiny-l)")
    parser.add_argument("--mapper", default=None, help="mapper folder or Hub id (default: the shipped one)")
    parser.add_argument(
        "--items", type=_args.positive_int, default=200, help="evaluation items per task (default: 200)"
    )
    parser.add_argument("--seed", type=int, default=1234, help="evaluation seed (default: 1234)")
    parser.add_argument(
        "--repair",
        default=DEFAULT_REPAIR,
        help=f"strategy:fraction of the repaired way (default: {DEFAULT_REPAIR}; strategies: hf_kvmap.repair)",
    )
    parser.add_argument(
        "--ladder",
        type=_args.input_file,
        default=None,
        help="a JSON file of guard-ladder settings (probe, strategy, rungs: hf_kvmap.GuardLadder) for the guarded way "
        "(default: the mapper's calibrated ladder, or its calibrated probe)",
    )
    parser.add_argument(
        "--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="context lengths timed for latency"
    )
    parser.add_argument(
        "--repeats", type=_args.positive_int, default=7, help="timed repeats per length (median reported)"
    )
    parser.add_argument(
        "--long-lengths",
        default=",".join(map(str, DEFAULT_LONG_LENGTHS)),
        help="prompt lengths (tokens) of the long forms of recall and chat served four ways, the first screen "
        f"(default: {','.join(map(str, DEFAULT_LONG_LENGTHS))}; an empty string for none)",
    )
    parser.add_argument(
        "--long-items",
        type=_args.positive_int,
        default=DEFAULT_LONG_ITEMS,
        help=f"long items per task and length (default: {DEFAULT_LONG_ITEMS})",
    )
    parser.add_argument(
        "--reach",
        default=str(DEFAULT_REACH),
        help=f"tokens from the long prompts' fact to their end (default: {DEFAULT_REACH}), or 'first' to state the "
        "fact first",
    )
    parser.add_argument("--json", type=_args.output_file, default=None, help="write the results JSON here")
    parser.add_argument(
        "--plot", type=_args.output_file, default=None, help="write a PNG plot here (needs matplotlib)"
    )
    parser.add_argument(
        "--threads",
        type=_args.positive_int,
        default=1,
        help="torch CPU threads (default: 1; the tiny models' products are too small to gain from more, and on a busy "
        "machine more threads wait on each other)",
    )
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


def _fail(message: str):
    raise SystemExit(f"hf-kvmap demo: {message}")


def shipped_pairs() -> list[str]:
    """`source -> target` of every mapper the package ships."""
    from .. import zoo

    return [p.name.replace("-to-", " -> ") for p in sorted(zoo.MAPPERS_DIR.iterdir()) if (p / "config.json").exists()]


def read_ladder(path) -> object:
    """The `GuardLadder` in the JSON file `path` (`--ladder`), or a clear exit naming the flag and the file."""
    import json

    from .. import GuardLadder

    try:
        return GuardLadder.from_dict(json.loads(path.read_text()))
    except (TypeError, ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        _fail(
            f"--ladder {path}: {err} Give the settings of one ladder: probe, strategy, rungs (hf_kvmap.GuardLadder)."
        )


def _token_counts(flag: str, text, minimum: int, example: str, empty: str, maximum: int | None = None) -> list[int]:
    """Comma-separated token counts of `flag`, each from `minimum` to `maximum`, or a clear exit naming the flag."""
    counts = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < minimum or (maximum is not None and int(part) > maximum):
            bound = f"from {minimum} to {maximum}" if maximum is not None else f"of at least {minimum}"
            _fail(
                f"{flag} {text!r}: {part!r} is not a token count {bound}; give comma-separated counts "
                f"(e.g. {example}), or an empty string for {empty}."
            )
        counts.append(int(part))
    return counts


def check_long_arguments(args: argparse.Namespace) -> None:
    """`--long-lengths` and `--reach` checked (a clear exit naming the flag) and parsed in place: `args.long_lengths`
    a list of token counts within the family's positions, `args.reach` an int or `None` (the fact first)."""
    from ..zoo.family import MAX_POSITIONS
    from ..zoo.long_items import MIN_LENGTH

    args.long_lengths = _token_counts(
        "--long-lengths", args.long_lengths, MIN_LENGTH, "256,384,512", "no long rows", maximum=MAX_POSITIONS
    )
    reach = str(args.reach).strip()
    if reach == "first":
        args.reach = None
        return
    if not reach.isdigit() or int(reach) < MIN_LENGTH:
        _fail(
            f"--reach {args.reach!r}: give the tokens from the fact to the prompt's end (at least {MIN_LENGTH}), or "
            "'first' to state the fact first."
        )
    args.reach = int(reach)
    short = [length for length in args.long_lengths if length <= args.reach]
    if short:
        _fail(
            f"--reach {args.reach} does not fit in --long-lengths {', '.join(map(str, short))}: give lengths longer "
            "than the reach, or a smaller --reach."
        )


def check_arguments(args: argparse.Namespace) -> tuple[list[int], object, str]:
    """`(lengths, RepairConfig, mapper name)` from the command line, every argument checked before any model loads
    (a clear exit naming the flag and what to give instead); `args.ladder` becomes the `GuardLadder` it names."""
    from .. import RepairConfig, zoo

    if args.ladder is not None:
        args.ladder = read_ladder(args.ladder)

    lengths = _token_counts("--lengths", args.lengths, 2, "64,256,1000", "no latency table")
    check_long_arguments(args)
    strategy, _, fraction = str(args.repair).rpartition(":")
    try:
        repair = RepairConfig(strategy, fraction=float(fraction))
    except ValueError as err:
        _fail(f"--repair {args.repair!r}: {err} Give strategy:fraction, e.g. {DEFAULT_REPAIR}.")
    for flag, name in (("--source", args.source), ("--target", args.target)):
        if name not in zoo.FAMILY:
            _fail(f"{flag} {name!r} is not a tiny-family member ({', '.join(zoo.FAMILY)}).")
    if args.mapper:
        return lengths, repair, args.mapper
    try:
        return lengths, repair, str(zoo.mapper_path(args.source, args.target))
    except (FileNotFoundError, KeyError):
        _fail(
            f"no shipped mapper from {args.source} to {args.target}. The shipped pairs are "
            f"{', '.join(shipped_pairs())}: pick one with --source and --target, or pass --mapper FOLDER."
        )


def _rungs(rungs: dict) -> str:
    return ", ".join(f"{name} {100 * share:.0f} %" for name, share in rungs.items())


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
    if results.get("serving"):
        lines += ["", f"{'task':<12}{'served by':<15}{'accuracy':>9}{'first token ms':>16}  rungs served"]
        for name, ways in results["serving"].items():
            for way, row in ways.items():
                rungs = _rungs(row["rungs"]) if way == "guarded" else ""
                lines.append(f"{name:<12}{WAY_LABELS[way]:<15}{row['accuracy']:>9.3f}{row['ttft_ms']:>16.2f}  {rungs}")
    if results.get("latency"):
        lines.append("")
        lines.append(
            f"{'tokens':>8}{'mapper ms':>12}{'prefill ms':>12}{'speedup':>9}"
            f"{'first token ms: target':>24}{'mapped':>9}{'repaired':>10}"
        )
        for row in results["latency"]:
            lines.append(
                f"{row['tokens']:>8}{row['mapper_ms']:>12.2f}{row['prefill_ms']:>12.2f}{row['speedup']:>9.2f}"
                f"{row['ttft_target_ms']:>24.2f}{row['ttft_mapped_ms']:>9.2f}{row['ttft_repaired_ms']:>10.2f}"
            )
    return "\n".join(lines)


def guard_settings(mapper, given=None) -> dict:
    """What the guarded way climbs: the ladder given to the demo, the mapper's calibrated ladder, or its calibrated
    probe and threshold."""
    ladder = given.to_dict() if given is not None else getattr(mapper.config, "handoff_ladder", None)
    if ladder:
        return {"ladder": {key: ladder[key] for key in ("probe", "strategy", "rungs") if key in ladder}}
    probe = mapper.config.handoff_probe or {}
    return {"probe": probe.get("probe"), "threshold": probe.get("threshold")}


def serve_tasks(ways, tasks, kept) -> dict:
    """Each kept exact-match task's requests served the four ways (`demo_ways.DemoWays.task`)."""
    from tqdm.auto import tqdm

    served = [task for task in tasks if task.name in kept and task.task_type == "exact_match"]
    out = {}
    with tqdm(total=sum(len(task.items) for task in served), desc="serving four ways", unit="item") as bar:
        for task in served:
            ways.warm_up(task.items, task.stop)
            out[task.name] = ways.task(task.items, task.stop, progress=lambda: bar.update(1))
    return out


def serve_long_tasks(ways, kept, args) -> dict | None:
    """The long forms of the kept tasks served four ways at `--long-lengths` (`demo_long.measure_long`), or `None`
    without lengths."""
    from tqdm.auto import tqdm

    from ..zoo.long_items import LONG_TASKS
    from .demo_long import measure_long

    if not args.long_lengths:
        return None
    total = len([task for task in LONG_TASKS if task in kept]) * len(args.long_lengths) * args.long_items
    with tqdm(total=total, desc="long prompts, four ways", unit="item") as bar:
        return measure_long(ways, kept, args, progress=lambda: bar.update(1))


def run(args: argparse.Namespace) -> int:
    import torch

    from ..plotting import plot_demo
    from ._output import finish
    from .demo_long import first_screen

    lengths, repair, mapper_name = check_arguments(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:  # the caller's thread count comes back (the demo may run inside a Python process, as in the tests)
        results = measure(args, lengths, repair, mapper_name)
    finally:
        torch.set_num_threads(threads)
    print(first_screen(results))
    print()
    print(format_table(results))
    finish(args.json, results)
    if args.plot:
        plot_demo(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


def measure(args: argparse.Namespace, lengths: list[int], repair, mapper_name: str) -> dict:
    """The demo's results dict: the three-way evaluation, the four ways per request, the latency rows, the run."""
    from .. import zoo
    from ..evaluation import HandoffEvaluation, evaluate_tasks
    from ..payoff import latency_break_evens
    from ..reporting import environment_info
    from .demo_ways import DemoWays
    from .models import load_mapper

    started, load_start = time.perf_counter(), os.getloadavg()
    tokenizer = zoo.load_tokenizer(padding_side="left")
    source, target = zoo.load_model(args.source), zoo.load_model(args.target)
    mapper = load_mapper(mapper_name, "demo")
    handoff = HandoffEvaluation(source=source, target=target, mapper=mapper, tokenizer=tokenizer)

    tasks = zoo.tiny_family_tasks(args.items, args.seed)
    results = drop_unmeasurable_tasks(evaluate_tasks(handoff, tasks))
    ways = DemoWays(source, target, mapper, zoo.load_tokenizer(), repair, ladder=args.ladder)
    results["serving"] = serve_tasks(ways, tasks, results["tasks"])
    results["long"] = serve_long_tasks(ways, results["tasks"], args)
    results["latency"] = ways.latency(lengths, args.repeats) if lengths else []
    results["latency_break_even"] = latency_break_evens(results["latency"])
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
        "repair": repair.to_dict(),
        "guard": guard_settings(mapper, args.ladder),
        "items_per_task": args.items,
        "seed": args.seed,
        "repeats": args.repeats,
        "seconds": time.perf_counter() - started,
    }
    # the machine's load (1, 5 and 15 minute averages) when the run started and ended: timings of a busy machine wait
    results["environment"] = {
        **environment_info(),
        "loadavg_start": list(load_start),
        "loadavg_end": list(os.getloadavg()),
    }
    return results
