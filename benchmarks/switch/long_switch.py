"""Where a switch pays: the real pair (Qwen2.5-Coder 0.5B <-> 1.5B) on tasks at serving lengths where the larger
model should answer better (`lab.real.long_tasks`), each item served every way in one run.

Per item the source's prefill is taken as paid (a switch happens after the source has read the conversation), and
the target's own prefill is computed once, timed, and serves the target-alone arm; every other arm maps the source's
cache (`MappedCache.from_source`), optionally repairs it (`repair=`, one rung per strategy and fraction), runs the
held-back token and decodes greedily. Each arm records its answer, its score, the seconds it took to prepare the
cache and its time to first token (preparing + the first forward), so ratios to the re-prefill are measured side by
side, and each answer token's margin (top-1 minus top-2 probability: what a guard ladder's probe reads on the mapped
cache and its check reads after a rung, so a ladder can be replayed on the items). Every item is appended to `--records` (JSON lines) as soon as it is measured, and a rerun skips what is there:
a stopped run resumes, and a rung added later is measured without the target's prefill again (the target arm's
record is kept).

    python -m benchmarks.switch.long_switch --mapper $WORK/mappers/0.5b-to-1.5b/ridge-k8 --tasks long_chat,long_doc \
        --tokens 2048 --items 16 --seed 4321 --rungs draft_attention@0.1,draft_attention@0.2 \
        --records $WORK/long/records.jsonl
    python -m benchmarks.switch.long_switch_report --records $WORK/long/records.jsonl

Scores: exact match of the reply (long_chat, long_doc), pass@1 of the problem's tests (humaneval), and for a
continuation the share of its greedy tokens that agree with the target's own (position by position) and the NLL of
the real text. The report gives each arm's mean, its floor-normalized retention (chance 0) and the share of the
source-to-target gap it recovers, with the time to first token beside the re-prefill's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_kvmap.reporting import environment_info
from lab.real.context_tasks import CONTEXT_TASK_NAMES, CONTEXT_TASKS

from ..sealed.protocol import ProtocolError, protocol_from_flag
from . import long_switch_report
from .long_switch_args import parse_rung, records_argument, rungs_argument, split_rungs
from .long_switch_runner import Runner, target_tokenizer

REPO = Path(__file__).resolve().parents[2]


def build_items(tok, args) -> list[dict]:
    """The run's items as plain dicts (`task`, `index`, `ids`, `answer`, metadata), in measuring order."""
    from hf_kvmap.real.corpus import load_manifest
    from lab.real import long_tasks

    documents = load_manifest(args.manifest)
    per_task = []
    for task in args.tasks.split(","):
        items = []
        if task == "long_chat":
            built = long_tasks.long_chat(tok, documents, args.items, args.tokens, args.seed)
        elif task == "long_doc":
            built = long_tasks.long_doc(tok, documents, args.items, args.tokens, args.seed)
        elif task == "humaneval":
            from lab.real.humaneval import humaneval_problems

            problems = humaneval_problems(args.cache_dir)[args.offset : args.offset + args.items]
            built = long_tasks.humaneval(tok, documents, problems, args.tokens, args.seed, contexts=args.contexts)
            for item, problem in zip(built, problems):
                item.meta["problem"] = problem
        elif task == "continuation":
            built = long_tasks.continuation(tok, documents, args.items, args.tokens, seed=args.seed)
        elif task in CONTEXT_TASKS:
            from lab.real.context_tasks import build_items as build_context_items

            built = build_context_items(task, tok, documents, args.items, args.tokens, args.seed)
        else:
            known = ", ".join(long_tasks.LONG_TASK_NAMES + CONTEXT_TASK_NAMES)
            raise SystemExit(f"--tasks: unknown task {task!r}; known: {known}")
        for index, item in enumerate(built):
            ids = item.meta.get("context_ids") or tok(item.prompt, add_special_tokens=False)["input_ids"]
            extra = {k: v for k, v in item.meta.items() if k != "context_ids"}
            items.append(
                {
                    "task": task,
                    "index": index + (args.offset if task == "humaneval" else 0),
                    "ids": ids,
                    "answer": item.answer,
                    **extra,
                }
            )
        per_task.append(items)
    # round-robin over the tasks, so that a run cut short has measured each of them
    shortest = min(map(len, per_task))
    return [item for group in zip(*per_task) for item in group] + [
        item for items in per_task for item in items[shortest:]
    ]


def key_of(args, item: dict) -> str:
    key = f"{args.direction}/{item['task']}/{args.tokens}/{args.seed}/{item['index']}"
    distinct = item["task"] == "humaneval" and getattr(args, "contexts", "sequential") == "distinct"
    return key + "/distinct" if distinct else key  # a records file keeps the two kinds of code context apart


def unmeasured(args, items: list[dict], records: dict, arms: list[str], setup: dict, path) -> list[dict]:
    """The items of `items` that some arm of `arms` is missing from in `records` (a records file's rows by key), in
    order; an item stored under another setup (another fit of the map, dtype or protocol) is refused."""
    todo = []
    for item in items:
        key = key_of(args, item)
        stored = records.get(key, {"arms": {}})
        if stored.get("setup", setup) != setup:
            raise SystemExit(
                f"{path} holds {key} measured under {stored['setup']}, not {setup}: measure into another records file"
            )
        if not all(arm in stored["arms"] for arm in arms):
            todo.append(item)
    return todo


def write_items(args) -> None:
    """`--write-items PATH`: the run's long_chat / long_doc items, or those of a whole-context chat family
    (`lab.real.context_tasks`, with its `references` and `questions` where it has them), as exact-match JSONL
    (`hf_kvmap.evaluation`'s format, one task per task and length, e.g. `long_chat@2048`) for `hf-kvmap calibrate-ladder
    --tasks PATH`; no model is loaded, only the target's tokenizer."""
    from hf_kvmap.atomic import write_text_atomically

    tasks = args.tasks.split(",")
    chat = {"long_chat", "long_doc"} | {name for name, task in CONTEXT_TASKS.items() if not task.code}
    if not set(tasks) <= chat:
        raise SystemExit(f"--write-items writes exact-match items: {', '.join(sorted(chat))}, not {args.tasks!r}")
    tokenizer = target_tokenizer(args)
    lines = []
    for item in build_items(tokenizer, args):
        prompt = tokenizer.decode(item["ids"])
        if tokenizer(prompt, add_special_tokens=False)["input_ids"] != item["ids"]:
            raise SystemExit(f"{item['task']} item {item['index']}: its text does not tokenize back to its ids")
        row = {
            "task": f"{item['task']}@{args.tokens}",
            "prompt": prompt,
            "answer": item["answer"],
            "stop": "<|im_end|>",
        }
        row.update({k: item[k] for k in ("references", "questions") if k in item})
        lines.append(json.dumps(row))
    write_text_atomically(args.write_items, "\n".join(lines) + "\n")
    print(f"{len(lines)} items -> {args.write_items}")


def apply_protocol(args):
    """`--protocol FILE`: every choice from the sealed protocol (rungs, direction, dtype, threads, each task's cell:
    items and seed), refusing a flag that would change one; returns the protocol (None without the flag)."""
    if not args.protocol:
        args.contexts = args.contexts or "sequential"
        for flag, value, default in (
            ("--rungs", args.rungs, "draft_attention@0.2"),
            ("--direction", args.direction, "0.5b:1.5b"),
            ("--dtype", args.dtype, "float32"),
            ("--threads", args.threads, 2),
        ):
            setattr(args, flag[2:], default if value is None else value)
        return None
    protocol = protocol_from_flag(args.protocol)
    settings = protocol.settings
    given = {"--rungs": args.rungs, "--direction": args.direction, "--dtype": args.dtype, "--threads": args.threads}
    fixed = {"--rungs": None, "--direction": settings["direction"], "--dtype": settings["dtype"], "--threads": None}
    for flag, value in given.items():
        if value is not None and flag != "--threads" and value != fixed[flag]:
            raise SystemExit(
                f"{flag} {value!r}: the sealed protocol {args.protocol} fixes "
                f"{'the rungs' if flag == '--rungs' else flag[2:]}; drop the flag (or write a new protocol)."
            )
    if args.map is None and len(settings["maps"]) == 1:
        args.map = next(iter(settings["maps"]))
    if args.map not in settings["maps"]:
        raise SystemExit(f"--map {args.map!r}: the protocol's maps are {sorted(settings['maps'])}.")
    args.rungs = ",".join(protocol.arms[2:-1])  # every rung and its sparse peer
    args.direction, args.dtype = settings["direction"], settings["dtype"]
    args.threads = args.threads if args.threads is not None else settings["threads"]
    cells = []
    for task in args.tasks.split(","):
        try:
            cells.append(protocol.cell(task, args.tokens))
        except ProtocolError as err:
            raise SystemExit(f"--tasks: {err}") from None
    seeds = {cell["seed"] for cell in cells}
    if args.seed is not None and {args.seed} != seeds:
        raise SystemExit(f"--seed {args.seed}: the protocol's cells of {args.tasks} use seed {sorted(seeds)}.")
    args.seed = seeds.pop() if len(seeds) == 1 else None
    if args.seed is None:
        raise SystemExit(f"--tasks {args.tasks}: their cells use different seeds; run them one at a time.")
    if args.contexts not in (None, "distinct"):
        raise SystemExit(f"--contexts {args.contexts}: a sealed protocol draws one code context a problem (distinct).")
    args.contexts = "distinct"
    most = min(cell["items"] for cell in cells)
    args.items = most if args.items is None else args.items
    if args.offset + args.items > most:
        raise SystemExit(f"--offset {args.offset} --items {args.items}: the protocol's cell holds {most} items.")
    return protocol


def cmd_run(args) -> None:
    for flag, value in (("--mapper", args.mapper), ("--records", args.records)):
        if not value:
            raise SystemExit(f"{flag} is required to measure (--mapper: a fitted map's folder; --records: a JSONL)")
    protocol = args.sealed
    from hf_kvmap.repair import DecodeRefresh, RepairConfig, resolve_markup

    tokenizer = target_tokenizer(args)  # `skip=markup` reads it; the runner keeps it
    rungs = {}
    for label in split_rungs(args.rungs):
        label, settings, fraction, refresh = parse_rung(label)
        rungs[label] = (label, resolve_markup(settings, tokenizer), fraction, refresh)

    for label, settings, fraction, refresh in rungs.values():  # a typo fails here, before the models load
        if settings is not None:
            RepairConfig(settings, fraction=fraction)
        if refresh is not None:
            try:
                inspect.signature(DecodeRefresh).bind(None, None, **refresh)
            except TypeError as err:
                raise SystemExit(f"--rungs entry {label!r}: {err} (DecodeRefresh's options)") from None
    path = Path(args.records)
    try:  # an incomplete last line (a stopped run) is cut and its item measured again; any other bad line refused
        records = long_switch_report.load(path, resume=True) if path.is_file() else {}
    except ValueError as err:
        raise SystemExit(f"--records {path} is not a records file of this benchmark:\n  {err}") from None
    torch.set_num_threads(args.threads)
    runner = Runner(args, tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    setup = {"mapper": runner.mapper.config.content_hash, "dtype": args.dtype, "direction": args.direction}
    if protocol is not None:  # every record names the sealed choices it was made under
        setup.update(protocol=protocol.sha256, map=args.map)
    arms = ["target", "mapped", *rungs, "source"]
    todo = unmeasured(args, build_items(runner.tokenizer, args), records, arms, setup, path)
    if not todo:  # a finished run writes nothing: no run line, no warm-up
        print(f"{path}: every item of {args.tasks} at {args.tokens} holds every arm; nothing to measure")
        return
    run = {
        "id": time.strftime("%Y%m%dT%H%M%S"),
        "command": "python -m benchmarks.switch.long_switch " + " ".join(sys.argv[1:]),
        "environment": environment_info(),
    }
    with path.open("a") as handle:  # what ran the rows after it: a line without a key
        handle.write(json.dumps({"run": run}) + "\n")
    warm = {**todo[0], "ids": todo[0]["ids"][-64:]}  # first-call costs (allocations, kernel selection) paid here,
    runner.measure(warm, arms, rungs, {})  # not in the first item's times
    bar = tqdm(todo, desc=f"{args.tasks} at {args.tokens}", unit="item")
    for item in bar:
        key = key_of(args, item)
        stored = records.get(key, {"arms": {}})
        load = os.getloadavg()[0]  # what else ran on the machine: its times are read only where it was idle enough
        measured = runner.measure(item, arms, rungs, stored["arms"])
        for record in measured.values():  # times compare only within one run (the machine's load changes)
            record["run"] = run["id"]
            record["load"] = round(max(load, os.getloadavg()[0]), 2)
        row = {
            "key": key,
            "setup": setup,
            "task": item["task"],
            "tokens": len(item["ids"]),
            "length": args.tokens,
            "meta": {k: item[k] for k in ("depth", "task_id", "kind", "contexts") if k in item},
            "arms": measured,
        }
        with path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        records.setdefault(key, {**row, "arms": {}})["arms"].update(measured)
        bar.set_postfix({a: round(measured[a]["score"], 2) for a in measured})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mapper", default=None, help="the mapper folder (every run but --write-items)")
    parser.add_argument("--direction", default=None, choices=["0.5b:1.5b", "1.5b:0.5b"], help="default 0.5b:1.5b")
    parser.add_argument("--tasks", default="long_chat,long_doc")
    parser.add_argument("--tokens", type=int, default=2048, help="context length (humaneval: code before the prompt)")
    parser.add_argument("--items", type=int, default=None, help="default 16 (a protocol: its cell's items)")
    parser.add_argument("--offset", type=int, default=0, help="humaneval: the first problem")
    parser.add_argument(
        "--contexts",
        default=None,
        choices=["sequential", "distinct"],
        help="humaneval: 'distinct' gives each problem its own code window whatever --offset (new runs; a protocol's "
        "cells); 'sequential' (the default) the windows in turn from --offset's problem (how the records before it "
        "were built)",
    )
    parser.add_argument("--seed", type=int, default=None, help="default 4321 (a protocol: its cell's seed)")
    parser.add_argument(
        "--rungs", type=rungs_argument, default=None, help="default draft_attention@0.2 (a protocol: its rungs)"
    )
    parser.add_argument(
        "--protocol",
        default=None,
        help="a sealed protocol (benchmarks/protocols/*.json): rungs, direction, dtype, items and seed from it, its "
        "sha256 in every record",
    )
    parser.add_argument("--map", default=None, help="with --protocol: the label of the map --mapper holds")
    parser.add_argument(
        "--records", type=records_argument, default=None, help="JSON lines of the measurements (resumes)"
    )
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default float32")
    parser.add_argument("--threads", type=int, default=None, help="default 2")
    parser.add_argument(
        "--no-batch",
        action="store_true",
        help="decode every arm alone (by default the target's arms without a refresh decode as one batch after "
        "each has timed its own first token)",
    )
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--manifest", default=str(REPO / "benchmarks" / "real" / "calibration_manifest.json"))
    parser.add_argument("--write-items", default=None, help="write the items as exact-match JSONL here and stop")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The command line with its defaults, or a sealed protocol's choices (`args.sealed`: the protocol, or None)."""
    args = build_parser().parse_args(argv)
    if not args.protocol:
        args.items = 16 if args.items is None else args.items
        args.seed = 4321 if args.seed is None else args.seed
    args.sealed = apply_protocol(args)
    return args


def main(argv=None) -> None:
    from hf_kvmap.real import ObtainError

    args = parse_args(argv)
    try:
        write_items(args) if args.write_items else cmd_run(args)
    except ObtainError as err:  # a model not obtained: the message names `hf-kvmap obtain NAME`
        raise SystemExit(f"benchmarks.switch.long_switch: {err}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
