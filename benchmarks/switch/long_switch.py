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
import re
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_kvmap.input_checks import eos_token_ids
from hf_kvmap.reporting import environment_info
from lab.real.context_tasks import CONTEXT_TASK_NAMES, CONTEXT_TASKS

from ..decoding import continue_batch, first_token, follow_ups, greedy, rounded, text_nll
from ..sealed.protocol import SPARSE, ProtocolError, protocol_from_flag
from . import long_switch_report
from .long_switch_args import records_argument, rungs_argument

REPO = Path(__file__).resolve().parents[2]
MODELS = {"0.5b": "qwen2.5-coder-0.5b-instruct", "1.5b": "qwen2.5-coder-1.5b-instruct"}
MAX_NEW = {"long_chat": 12, "long_doc": 12, "humaneval": 320, "continuation": 128}
MAX_NEW.update({name: task.max_new for name, task in CONTEXT_TASKS.items()})  # lab.real.context_tasks


def parse_options(options: str) -> dict:
    """`key=value,...` -> settings (each value read as JSON where it is, else kept as text)."""
    settings = {}
    for option in filter(None, options.split(",")):
        key, _, raw = option.partition("=")
        try:
            settings[key] = json.loads(raw)
        except json.JSONDecodeError:
            settings[key] = raw
    return settings


def split_rungs(text: str) -> list[str]:
    """`--rungs` (or `--strategies`) split into entries at the commas that start a new entry (an option's own
    comma, `a=1,b=2`, is followed by `name=`, which no entry starts with)."""
    entries: list[str] = []
    for piece in text.split(","):
        if entries and re.match(r"[A-Za-z_]\w*=", piece):
            entries[-1] += "," + piece
        elif piece:
            entries.append(piece)
    return entries


def parse_strategy(text: str) -> dict:
    """`name[:option=value,...]` -> strategy settings, e.g. `query_overlap:fill=draft_branches,after=24` (the
    library's one syntax, `hf_kvmap.repair.base.strategy_from_text`)."""
    from hf_kvmap.repair.base import strategy_from_text

    try:
        return strategy_from_text(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_rung(text: str) -> tuple[str, dict | None, float, dict | None]:
    """`name[:option=value,...]@fraction[+refresh:option=value,...]` -> (label, strategy settings, fraction, refresh
    settings); e.g. `draft_attention@0.2`, `draft_attention:draft_tokens=64@0.2`,
    `draft_attention@0.1+refresh:every=16,tokens=32` (`DecodeRefresh` repairs while the target decodes), or
    `mapped+refresh:every=16,fraction=0.02` (no repair before the first token). `sparse:` before a repair rung
    (`sparse:draft_branches@0.1`) is its map-free peer: the target prefills only the positions the repair selects
    (`hf_kvmap.repair.sparse_prefill`), sharing the repair's selection where both are served. A malformed entry
    raises `argparse.ArgumentTypeError` naming it."""
    if text.startswith(SPARSE):
        label, settings, fraction, refresh = parse_rung(text[len(SPARSE) :])
        if settings is None or refresh is not None:
            raise argparse.ArgumentTypeError(
                f"entry {text!r}: sparse: takes a repair rung without a refresh, e.g. sparse:draft_branches@0.1"
            )
        return text, settings, fraction, None
    head, plus, tail = text.partition("+")
    refresh = None
    if plus:
        kind, _, options = tail.partition(":")
        if kind != "refresh":
            raise argparse.ArgumentTypeError(f"entry {text!r}: after '+' comes refresh[:option=value,...]")
        refresh = parse_options(options)
        if head == "mapped":
            return text, None, 0.0, refresh
    if "@" not in head:
        raise argparse.ArgumentTypeError(f"entry {text!r} needs a fraction: name[:option=value]@fraction")
    spec, fraction = head.rsplit("@", 1)
    if not spec.partition(":")[0]:
        raise argparse.ArgumentTypeError(
            f"entry {text!r} names no repair strategy: name[:option=value]@fraction (e.g. draft_attention@0.2)"
        )
    try:
        share = float(fraction)
    except ValueError:
        raise argparse.ArgumentTypeError(f"entry {text!r}: fraction {fraction!r} is not a number") from None
    if not 0 < share <= 1:
        raise argparse.ArgumentTypeError(f"entry {text!r}: the fraction {fraction} must be a number in (0, 1]")
    return text, parse_strategy(spec), share, refresh


# ----------------------------------------------------------------------------------------------------------- scoring
def score(item: dict, text: str, tokens: list[int], reference: list[int] | None) -> dict:
    """An arm's score on one item (see the module docstring)."""
    if item["task"] in ("long_chat", "long_doc"):
        return {"score": float(text.strip() == item["answer"])}
    if item["task"] in CONTEXT_TASKS:  # the family's own rule, on the item's fields (`meta` flattened into it)
        from lab.real.context_tasks import score as context_score
        from lab.real.long_tasks import LongItem

        return {"score": context_score(LongItem(item["task"], "", item["answer"], item), text)}
    if item["task"] == "humaneval":
        from lab.real.humaneval import passes, truncate_completion

        return {"score": float(passes(item["problem"], truncate_completion(text)))}
    agree = sum(a == b for a, b in zip(tokens, reference or tokens)) / len(reference or tokens)
    return {"score": agree}


def target_tokenizer(args):
    """The tokenizer of `--direction`'s target (no model is loaded)."""
    from transformers import AutoTokenizer

    from hf_kvmap.real.obtain import obtained_path

    return AutoTokenizer.from_pretrained(obtained_path(MODELS[args.direction.split(":")[1]], args.cache_dir))


class Runner:
    """The models, the mapper and the settings one run serves every arm with (`tokenizer`: the target's, where the
    caller loaded it already)."""

    def __init__(self, args, tokenizer=None):
        from transformers import AutoModelForCausalLM

        from hf_kvmap import MapperModel
        from hf_kvmap.real.obtain import obtained_path

        dtype = getattr(torch, args.dtype)
        source_name, target_name = (MODELS[side] for side in args.direction.split(":"))
        self.tokenizer = tokenizer if tokenizer is not None else target_tokenizer(args)
        self.source = AutoModelForCausalLM.from_pretrained(obtained_path(source_name, args.cache_dir), dtype=dtype)
        self.target = AutoModelForCausalLM.from_pretrained(obtained_path(target_name, args.cache_dir), dtype=dtype)
        self.source.eval(), self.target.eval()
        self.mapper = MapperModel.from_pretrained(args.mapper, dtype=dtype)
        self.batch = not args.no_batch
        self.eos = {self.tokenizer.convert_tokens_to_ids("<|im_end|>"), self.tokenizer.eos_token_id}
        self.eos |= set(eos_token_ids(self.target))

    def _stop(self, task: str):
        if task != "humaneval" and not (task in CONTEXT_TASKS and CONTEXT_TASKS[task].code):
            return lambda tokens: False
        from lab.real.humaneval import STOP_SEQUENCES

        return lambda tokens: any(s in self.tokenizer.decode(tokens) for s in STOP_SEQUENCES)

    @torch.no_grad()
    def measure(self, item: dict, arms: list[str], rungs: dict, done: dict) -> dict:
        """Every arm of `arms` not in `done` on one item; returns `{arm: record}`."""
        from hf_kvmap import MappedCache, output_cache
        from hf_kvmap.repair import DecodeRefresh, RepairConfig, repair_cache, select_repair, sparse_prefill

        ids = torch.tensor([item["ids"]])
        last = ids[:, -1:]
        max_new, stop = MAX_NEW[item["task"]], self._stop(item["task"])
        reference = done.get("target", {}).get("tokens")
        out: dict[str, dict] = {}

        def record_of(model, cache, tokens, prepare, first) -> dict:
            text = self.tokenizer.decode([t for t in tokens if t not in self.eos])
            record = {"tokens": tokens, "text": text, "prepare_s": prepare, "ttft_s": prepare + first}
            if item["task"] == "continuation":
                record["nll"] = text_nll(model, cache, last, item["continuation_ids"])
            return record

        def finish(arm: str, model, cache, prepare: float, refresh=None) -> None:
            """Decode `arm` alone (the source, a refreshing rung, or every arm with `batch=False`)."""
            step = None
            if refresh is not None:  # called as generate calls a logits processor
                step = lambda tokens: refresh(torch.tensor([item["ids"] + tokens]), None)  # noqa: E731
            margins: list[float] = []
            tokens, first, rest = greedy(model, cache, last, max_new, stop, self.eos, step, margins)
            out[arm], kept[arm] = record_of(model, cache, tokens, prepare, first), (model, cache)
            out[arm]["answer_s"] = prepare + first + rest  # the whole answer, a refresh's recomputes included
            out[arm]["margins"] = rounded(margins)
            if refresh is not None:
                info = cache.mapping_info["refresh"]
                out[arm]["refresh"] = {
                    k: info[k] for k in ("refreshes", "recomputed", "recomputed_fraction", "seconds")
                }

        batched: list[tuple] = []  # (arm, cache, prepare, first token, its seconds, margins): decoded together below
        kept: dict[str, tuple] = {}  # arm -> (model, its served cache of the prompt): what follow-ups are asked on

        def start(arm: str, cache, prepare: float, refresh=None) -> None:
            if refresh is not None or not self.batch:
                finish(arm, self.target, cache, prepare, refresh)
            else:
                margins: list[float] = []
                token, seconds = first_token(self.target, cache, last, margins)
                batched.append((arm, cache, prepare, token, seconds, margins))

        if "target" in arms and "target" not in done:
            began = time.perf_counter()
            cache = output_cache(self.target(input_ids=ids[:, :-1], use_cache=True))
            start("target", cache, time.perf_counter() - began)
        mapped_arms = [a for a in arms if a not in done and a not in ("source", "target")]
        source_cache = None
        if mapped_arms or ("source" in arms and "source" not in done):
            source_cache = output_cache(self.source(input_ids=ids, use_cache=True))  # paid before a switch
            selections: dict[str, tuple] = {}  # repair label -> (its selection, the seconds it took)

            def selection_of(label: str):
                """The positions rung `label` recomputes, selected once for it and its sparse peer (timed)."""
                if label not in selections:
                    _, settings, fraction, _ = rungs.get(label) or parse_rung(label)
                    began = time.perf_counter()
                    chosen = select_repair(
                        self.target,
                        ids,
                        RepairConfig(settings, fraction=fraction),
                        length=ids.shape[1] - 1,
                        source=self.source,
                        source_cache=source_cache,
                    )
                    selections[label] = (chosen, time.perf_counter() - began)
                return selections[label]

            for arm in mapped_arms:
                refresh_settings = None
                if arm.startswith(SPARSE):
                    (positions, _), select_s = selection_of(arm[len(SPARSE) :])
                    began = time.perf_counter()
                    cache = sparse_prefill(self.target, ids, positions[0], length=ids.shape[1] - 1)
                    finish(arm, self.target, cache, select_s + time.perf_counter() - began)  # a layout of its own
                    out[arm]["selected"] = int(positions.shape[1])
                    continue
                began = time.perf_counter()
                if arm == "mapped":
                    cache = MappedCache.from_source(source_cache, self.mapper)
                    prepare = time.perf_counter() - began
                else:
                    _, settings, fraction, refresh_settings = rungs[arm]
                    if settings is None:  # mapped+refresh
                        cache = MappedCache.from_source(source_cache, self.mapper)
                        prepare = time.perf_counter() - began
                    else:
                        selection, select_s = selection_of(arm)
                        began = time.perf_counter()
                        cache = MappedCache.from_source(
                            source_cache,
                            self.mapper,
                            first_layer="target",
                            target_model=self.target,
                            input_ids=ids,
                            source_model=self.source,
                        )
                        repair_cache(
                            self.target, cache, ids, RepairConfig(settings, fraction=fraction), selection=selection
                        )
                        prepare = select_s + time.perf_counter() - began
                refresh = None if refresh_settings is None else DecodeRefresh(self.target, cache, **refresh_settings)
                start(arm, cache, prepare, refresh)
        if batched:
            caches = [entry[1] for entry in batched]
            margins = [e[5] for e in batched]
            decoded, seconds = continue_batch(
                self.target, caches, [e[3] for e in batched], max_new, stop, self.eos, margins
            )
            for i in range(len(batched)):
                arm, cache, prepare, _, first, _ = batched[i]
                cache.crop(-last.shape[1])  # back to the prompt's cache, for the NLL
                out[arm], kept[arm] = record_of(self.target, cache, decoded[i], prepare, first), (self.target, cache)
                out[arm]["margins"] = rounded(margins[i])
                out[arm]["decoded_with"] = len(batched)  # rows of the batch that decoded it (its seconds shared)
                out[arm]["batch_s"] = seconds
        if source_cache is not None and "source" in arms and "source" not in done:
            source_cache.crop(-1)
            finish("source", self.source, source_cache, 0.0)
        reference = out["target"]["tokens"] if "target" in out else reference  # continuations agree with it
        for arm, record in out.items():
            record.update(score(item, record["text"], record["tokens"], reference if arm != "target" else None))
        if reference and item["task"] != "continuation":  # the 1.5B's own answer read through each arm's cache
            for arm, (model, cache) in kept.items():  # (nats a token): finer than right or wrong, for choosing maps
                if arm != "source":  # the 0.5B reads with other weights: its NLL is not comparable
                    out[arm]["answer_nll"] = text_nll(model, cache, last, reference)
        if len(item.get("questions", [])) > 1:  # the next questions, asked on the cache each arm served
            for arm, (model, cache) in kept.items():
                replies = follow_ups(model, self.tokenizer, cache, last, item["questions"], max_new, stop, self.eos)
                for reply, question in zip(replies, item["questions"][1:]):
                    reply.update(score({**item, "answer": question["answer"]}, reply["text"], reply["tokens"], None))
                out[arm]["followups"] = replies
        return {arm: out[arm] for arm in arms if arm in out}


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
    items = build_items(runner.tokenizer, args)
    run = {
        "id": time.strftime("%Y%m%dT%H%M%S"),
        "command": "python -m benchmarks.switch.long_switch " + " ".join(sys.argv[1:]),
        "environment": environment_info(),
    }
    with path.open("a") as handle:  # what ran the rows after it: a line without a key
        handle.write(json.dumps({"run": run}) + "\n")
    if items:  # first-call costs (allocations, kernel selection) are paid here, not in the first item's times
        warm = {**items[0], "ids": items[0]["ids"][-64:]}
        runner.measure(warm, arms, rungs, {})
    bar = tqdm(items, desc=f"{args.tasks} at {args.tokens}", unit="item")
    for item in bar:
        key = key_of(args, item)
        stored = records.get(key, {"arms": {}})
        if stored.get("setup", setup) != setup:
            raise SystemExit(
                f"{path} holds {key} measured under {stored['setup']}, not {setup}: pass another --records"
            )
        if all(arm in stored["arms"] for arm in arms):
            continue
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
