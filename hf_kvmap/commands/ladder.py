"""`hf-kvmap calibrate-ladder`: measure the guard ladder's rungs on your items and store the calibrated ladder in the
mapper's config and card.

    hf-kvmap calibrate-ladder --source S --target T --mapper M --tasks my_tasks.jsonl --out M-laddered
    hf-kvmap calibrate-ladder --source tiny-m --target tiny-l --tasks tiny-family --items 50 --out /tmp/m2l

Every exact-match item is measured one prompt at a time (the target's own answer; each candidate probe's risk on the
mapped cache; the answer and cost of every repair fraction), and the cheapest ladder whose changed answers stay within
`--max-changed` on every task is kept (with `--confidence 0.9`, the budget must hold as a one-sided upper confidence
bound: about 60 items per task vouch for 5 % at 0.95, 45 at 0.9). `--records` keeps the measurements (JSONL) so a
stopped run resumes; a strategy asked for that the records lack is measured beside them (`<records>.strategies.jsonl`,
resumable too; the target's own answers are read from the records, its prefill is not run again), so a new repair
strategy joins a calibrated ladder's candidates without measuring the items again. `--sparse` also measures each
strategy's sparse rung (the target's prefill of the positions the repair of a fraction selects, alone) and lets the
ladder place one where it keeps the answers as well and costs less than that repair.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from . import _args


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate-ladder",
        help="Calibrate the guard ladder (serve / repair / fall back per request) on your items; store it in a mapper.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--source", required=True, help="tiny-family member, folder or Hub id")
    parser.add_argument("--target", required=True, help="tiny-family member, folder or Hub id")
    parser.add_argument("--mapper", default=None, help="mapper folder or Hub id (default: the shipped one)")
    parser.add_argument("--tasks", default="tiny-family", help="'tiny-family' or a JSONL file of exact-match items")
    parser.add_argument(
        "--items", type=_args.positive_int, default=50, help="items per task for the tiny-family task set"
    )
    parser.add_argument("--seed", type=int, default=4321, help="seed of the tiny-family items (not the report's)")
    parser.add_argument(
        "--probes",
        type=_args.probes,
        default="draft_agreement:2,lookahead_margin:1,confident_draft:2",
        help="candidate probes (name:tokens, one hold-back); the cheapest ladder's is kept",
    )
    parser.add_argument(
        "--strategies",
        type=_args.strategies,
        default="tail,source_attention,draft_attention",
        help="candidate repair strategies (hf_kvmap.repair.STRATEGIES), comma-separated or a JSON list of settings "
        '(\'[{"name": "query_overlap", "skip": "markup"}]\': "markup" is the tokenizer\'s special tokens); the '
        "cheapest ladder's is kept",
    )
    parser.add_argument(
        "--fractions", type=_args.fractions, default="0.1,0.2,0.3,0.5", help="repair fractions measured (0 is always)"
    )
    parser.add_argument("--max-changed", type=float, default=0.05, help="changed answers a task may be served")
    parser.add_argument(
        "--confidence",
        type=float,
        default=None,
        help="hold --max-changed as an upper confidence bound at this level (e.g. 0.9), not on the items alone",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also calibrate a check after the rung: a served request whose first answer tokens (1, 2, 4 or 8 of "
        "them, calibrated) the target takes with a probability margin below the calibrated one falls back (kept "
        "where it is cheaper than no check)",
    )
    parser.add_argument(
        "--sparse",
        action="store_true",
        help="also measure each strategy's sparse rung at every fraction (the target's prefill of that repair's "
        "selection alone, no map), and let the ladder place one where it keeps the answers within --max-changed and "
        "costs less than the repair of its fraction (a one-row request is served it; a batch repairs instead)",
    )
    parser.add_argument(
        "--min-tokens",
        type=_args.positive_int,
        default=None,
        help="map no prompt shorter than this: the target prefills it (the break-even length "
        "benchmarks/ladder/ladder_lengths.py measures); items below it count as prefilled in the calibration's outcome",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the models' dtype (bfloat16 halves a long prompt's prefill on CPUs with bf16 matmuls)",
    )
    parser.add_argument(
        "--records", type=_args.appendable_file, default=None, help="JSONL of the measurements (resumes)"
    )
    parser.add_argument(
        "--out",
        type=_args.mapper_folder,
        required=True,
        help="folder for the mapper with its ladder (may be --mapper)",
    )
    parser.add_argument("--json", type=_args.output_file, default=None, help="write the calibration summary here")
    parser.add_argument(
        "--same-weights",
        action="store_true",
        help="the models are local copies of the weights the mapper was fitted on (their ids differ from the "
        "mapper's record; geometry, rope and tokenizer are still checked)",
    )
    parser.set_defaults(func=run)


def _items(args):
    from .. import zoo
    from ..calibration.ladder_items import items_from_tasks
    from ..evaluation import load_jsonl_tasks

    if args.tasks == "tiny-family":
        tasks = zoo.tiny_family_tasks(args.items, args.seed)
    else:
        try:
            tasks = load_jsonl_tasks(args.tasks)
        except (OSError, ValueError) as err:
            raise SystemExit(f"hf-kvmap calibrate-ladder: {err}") from None
    items, skipped = items_from_tasks(tasks)
    if not items:
        raise SystemExit(
            "hf-kvmap calibrate-ladder: no exact-match items: the ladder compares generated answers, so give tasks of "
            '`"type": "exact_match"` (prompt, answer, stop).'
        )
    return items, skipped


def _records(path: Path | None) -> list[dict]:
    """The records a stopped run wrote to `path` (JSONL), read before any model loads: a malformed line is refused by
    number; an incomplete last line after complete records (the run was stopped while writing it) is cut off and
    that item measured again (`reporting.resumable_jsonl`)."""
    from ..reporting import resumable_jsonl

    if path is None or not path.is_file():
        return []
    try:
        rows, note = resumable_jsonl(path, "a measured item (a JSON object)")
    except ValueError as err:
        raise SystemExit(
            f"hf-kvmap calibrate-ladder: --records {path} is not a records file of this command:\n  {err}\n"
            "Pass a new file (or the one a stopped run of these items wrote)."
        ) from None
    if note:
        print(note)
    return [record for _, record in rows]


def _with_strategies_beside(args, done: list[dict], items, pair, strategies, fractions) -> list[dict]:
    """The records measured before with what was kept beside them merged in, and the strategies asked for that they
    lack measured beside them first (where the records hold only strategies asked for, at the fractions asked for:
    anything else is refused by the measurement, which names it)."""
    from ..calibration.ladder_items import strategy_key
    from ..calibration.ladder_side import side_path, with_side_measurements

    records = with_side_measurements(args.records, pair, items, done)
    asked = [strategy_key(s) for s in strategies]
    held = [set(record.get("answers", {})) for record in records]
    rungs = {f"{f:g}" for f in {0.0, *fractions}}
    same_rungs = all(
        set(next(iter(record["answers"].values()), {})) == rungs for record in records if record.get("answers")
    )
    lacking = sorted({key for keys in held for key in asked if key not in keys})
    if not lacking or not same_rungs or not all(keys and keys <= set(asked) for keys in held):
        return records
    print(
        f"measuring {', '.join(lacking)} beside the {len(records)} records of --records "
        f"(kept in {side_path(args.records, 'strategies')})"
    )
    try:
        return with_side_measurements(
            args.records, pair, items, records, measure=["strategies"], strategies=strategies
        )
    except ValueError as err:  # the records are of other prompts than these items
        raise SystemExit(f"hf-kvmap calibrate-ladder: --records {args.records}: {err}") from None


def run(args: argparse.Namespace) -> int:
    from ..calibration.ladder import items_to_vouch
    from ..calibration.ladder_items import (
        ladder_from_records,
        measure_ladder_items,
        perfect_probe_outcome,
        probe_key,
        strategy_key,
        with_min_tokens,
    )
    from . import models as _models
    from ._output import finish

    started = time.perf_counter()
    if not 0.0 <= args.max_changed <= 1.0:
        raise SystemExit(f"hf-kvmap calibrate-ladder: --max-changed {args.max_changed} must be in [0, 1].")
    if args.min_tokens is not None and args.min_tokens < 2:  # checked before anything is measured
        raise SystemExit(
            f"hf-kvmap calibrate-ladder: --min-tokens {args.min_tokens} maps every prompt; give at least 2 (the "
            "break-even length benchmarks/ladder/ladder_lengths.py measures), or leave it out."
        )
    if args.confidence is not None and not 0.0 < args.confidence < 1.0:
        raise SystemExit(f"hf-kvmap calibrate-ladder: --confidence {args.confidence} must be in (0, 1), e.g. 0.9.")
    probes, strategies, fractions = args.probes, args.strategies, args.fractions  # parsed by their types (_args)
    for flag, path in (("--records", args.records), ("--json", args.json)):
        if path is not None and args.out.resolve() in path.resolve().parents:
            raise SystemExit(
                f"hf-kvmap calibrate-ladder: {flag} {path} lies inside --out {args.out}, which the save replaces "
                "whole (and a mapper folder holds only the mapper's files): keep it beside the folder."
            )
    done = _records(args.records)
    items, skipped = _items(args)
    import torch

    dtype = getattr(torch, args.dtype)
    source, target = _models.load_causal_lm(args.source, dtype), _models.load_causal_lm(args.target, dtype)
    tokenizer = _models.load_tokenizer(args.source)
    from ..repair import resolve_markup, strategy_from_dict

    strategies = [strategy_from_dict(resolve_markup(s, tokenizer)).settings() for s in strategies]  # "skip": "markup"
    mapper_name = _models.resolve_mapper(args.mapper, args.source, args.target)
    mapper = _models.load_mapper(mapper_name, "calibrate-ladder")
    try:
        mapper.check_compatible(source, target, tokenizer, same_weights=args.same_weights)
    except ValueError as err:
        hint = "calibrate a ladder for the mapper fitted for these models (a ladder vouches for one pair)"
        raise SystemExit(f"hf-kvmap calibrate-ladder: {str(err).replace('or allow_mismatch=True', hint)}") from None
    if done:
        print(f"resuming: {len(done)} of {len(items)} items measured in {args.records}")
        done = _with_strategies_beside(args, done, items, (source, target, mapper, tokenizer), strategies, fractions)

    def keep(record):
        if args.records is not None:
            args.records.parent.mkdir(parents=True, exist_ok=True)
            with args.records.open("a") as handle:
                handle.write(json.dumps(record) + "\n")

    try:
        records = measure_ladder_items(
            source,
            target,
            mapper,
            tokenizer,
            items,
            probes=probes,
            strategies=strategies,
            fractions=fractions,
            done=done,
            on_record=keep,
            sparse=args.sparse,
        )
    except ValueError as err:
        raise SystemExit(f"hf-kvmap calibrate-ladder: {err}") from None
    provenance = {
        "tasks": sorted({item.task for item in items}),
        "task_set": args.tasks if args.tasks == "tiny-family" else Path(args.tasks).name,
        "seed": args.seed if args.tasks == "tiny-family" else None,
        "probes": [f"{p.name}:{p.tokens}" for p in probes],
        "strategies": [strategy_key(s) for s in strategies],
        "dtype": args.dtype,
    }
    try:
        ladder = ladder_from_records(
            records,
            max_changed=args.max_changed,
            confidence=args.confidence,
            provenance=provenance,
            check=args.check,
            sparse=args.sparse,
        )
    except ValueError as err:  # records of before margins were recorded, with --check
        raise SystemExit(f"hf-kvmap calibrate-ladder: {err}") from None
    if args.min_tokens is not None:  # served unmapped below it: only fewer changed answers than calibrated
        ladder = with_min_tokens(ladder, args.min_tokens, records)
    mapper.config.handoff_ladder = ladder.to_dict()
    try:
        mapper.save_pretrained(args.out)
    except (OSError, ValueError) as err:  # the folder changed while measuring (checked when the command started)
        raise SystemExit(f"hf-kvmap calibrate-ladder: --out {args.out}: {err}") from None
    outcome = ladder.calibration["outcome"]
    print(
        f"ladder on {len(records)} items, probe {ladder.probe['name']}:{ladder.probe['tokens']}, "
        f"repair {strategy_key(ladder.strategy)}:"
    )
    for rung in ladder.rungs:
        what = (
            f"prefill {rung.fraction:.0%} alone (sparse, no map)" if rung.sparse else f"recompute {rung.fraction:.0%}"
        )
        print(f"  risk <= {rung.max_risk:.4g}: {what}")
    print("  above: the target's own prefill")
    if ladder.min_tokens is not None:
        print(
            f"  a prompt of fewer than {ladder.min_tokens} tokens: the target's own prefill, unmapped "
            f"({outcome['rungs'].get('short', 0):.0%} of the items)"
        )
    if ladder.min_margin is not None:
        read = (
            "a first answer token" if ladder.check_tokens == 1 else f"an answer's first {ladder.check_tokens} tokens"
        )
        print(
            f"  then the check: {read} taken with a margin below {ladder.min_margin:g} falls back "
            f"({outcome['checked_fallback']:.0%} of the items)"
        )
    for task, row in outcome["per_group"].items():
        print(f"  {task:<16} changed served {row['changed_served']:.3f}  net saving {row['net_saving']:.3f}")
    # what a probe that knew each request's cheapest safe rung would cost with the same rungs: the room a better
    # probe has (the ladder's own probe and strategy)
    chosen_probe, chosen_strategy = probe_key(ladder.probe), strategy_key(ladder.strategy)
    headroom = {
        "perfect_probe_free": perfect_probe_outcome(records, chosen_strategy)["mean_cost"],
        "perfect_probe_at_this_probes_cost": perfect_probe_outcome(records, chosen_strategy, chosen_probe)[
            "mean_cost"
        ],
        "ladder": outcome["mean_cost"],
    }
    print(
        f"  a perfect probe (each item its cheapest rung that keeps the answer) would cost "
        f"{headroom['perfect_probe_at_this_probes_cost']:.3f} of a prefill at {chosen_probe}'s cost "
        f"({headroom['perfect_probe_free']:.3f} free); this ladder costs {outcome['mean_cost']:.3f}"
    )
    print(f"wrote {args.out} (config.json handoff_ladder, README.md)")
    if args.confidence is None:
        print(
            f"note: the {args.max_changed:g} budget holds on these items only; on other requests the same thresholds "
            "can serve more changed answers. --confidence 0.95 holds it as an upper confidence bound instead "
            "(docs/ladder.md, 'How many calibration items does a ladder need?')."
        )
    short = sorted(task for task, budget in ladder.calibration["budget_per_group"].items() if budget < 0)
    if short:
        print(
            f"note: {', '.join(short)} cannot vouch for --max-changed {args.max_changed:g} at --confidence "
            f"{args.confidence:g} (even none changed would not), so the ladder falls back there; it takes at least "
            f"{items_to_vouch(args.max_changed, args.confidence)} items of a task."
        )
    if outcome["mean_cost"] >= 1.0:
        print(
            f"note: on these items the ladder costs {outcome['mean_cost']:.2f} of the target's own prefill (the "
            "mapping and the probe are paid on every request): serving without a handoff is cheaper here. More "
            "items (the changed-answer budget is a share of each task's items), a cheaper probe, or a better mapper "
            "may change that."
        )
    summary = {
        "ladder": ladder.to_dict(),
        "skipped_tasks": skipped,
        "headroom": headroom,
        "run": {
            "source": args.source,
            "target": args.target,
            "mapper": mapper_name,
            "out": str(args.out),
            "items": len(records),
            "seconds": time.perf_counter() - started,
        },
    }
    return finish(args.json, summary)
