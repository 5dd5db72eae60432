"""`scale long-finetune`: the read-back KL fine-tune of one fitted map at serving lengths (issue 54, "a map that
carries the context"; `hf_kvmap.long_kl`).

Rows are long conversations of the calibration split (`hf_kvmap.real.corpus.conversation_sequences`, the text of
`family calibrate --corpus conversations`; the held-out split the tasks read never enters), each cut at the last turn
that leaves `--tail` tokens: the 1.5B reads that turn's first `--tail` tokens through the mapped cache of everything
before it, and the map is trained so that it predicts there what it predicts from its own cache. The rows' source
caches and teacher distributions are computed once into `--work` (resumable), then the fine-tune checkpoints there
and stops at `--max-minutes` (run the same command again to go on). The fine-tuned map is written to `--out` once the
run is over, with `long_finetune.json` (the record, the timings) beside it.
"""

from __future__ import annotations

import time
from pathlib import Path
from statistics import mean

import torch

from hf_kvmap.real.registry import MODEL_ID_PREFIX

from .common import SHORT, load_model, load_tokenizer, save_atomically, write_json

TURN_START = "<|im_start|>"


def pair_of(mapper) -> tuple[str, str]:
    """The real models a mapper maps between, from the ids its config records (`hf-kvmap-real:NAME`)."""
    names = []
    for side in ("source", "target"):
        model_id = getattr(mapper.config, f"{side}_model_id") or ""
        if not model_id.startswith(MODEL_ID_PREFIX) or model_id[len(MODEL_ID_PREFIX) :] not in SHORT:
            raise SystemExit(
                f"The mapper's {side} is {model_id!r}; this command fine-tunes maps between the real pair "
                f"({', '.join(MODEL_ID_PREFIX + name for name in SHORT)})."
            )
        names.append(model_id[len(MODEL_ID_PREFIX) :])
    return names[0], names[1]


def cmd_long_finetune(args) -> int:
    """Prepare the rows (resumable), fine-tune (resumable, within `--max-minutes` in all), write the map."""
    from hf_kvmap import MapperModel
    from hf_kvmap.long_kl import RowStore, long_kl_finetune
    from hf_kvmap.real import corpus

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    work = args.work or args.out.with_name(args.out.name + ".work")
    mapper = MapperModel.from_pretrained(args.mapper, dtype=torch.float32)
    source_name, target_name = pair_of(mapper)
    tokenizer = load_tokenizer(target_name, args.cache_dir)
    source = load_model(source_name, args.cache_dir, args.dtype)
    target = load_model(target_name, args.cache_dir, args.dtype)
    mapper.check_compatible(source, target, tokenizer, same_weights=True)
    sequences = corpus.conversation_sequences(
        tokenizer,
        corpus.load_manifest(args.manifest),
        args.rows,
        args.seq_len,
        seed=args.calibration_seed,
        turn_tokens=args.turn_tokens,
    )
    boundary = tokenizer.convert_tokens_to_ids(TURN_START) if args.tail_start == "turn" else None
    models = {"source": source_name, "target": target_name, "dtype": args.dtype}
    models |= {"calibration_seed": args.calibration_seed, "turn_tokens": args.turn_tokens}
    store = RowStore.create(
        work / "rows", sequences, tail=args.tail, top_k=args.top_k, boundary=boundary, models=models
    )
    budget = args.max_minutes
    prepared = store.prepare(source, target, max_minutes=budget)
    for index, seconds in prepared.items():
        print(f"row {index}: prefix {store.settings['starts'][index]} tokens, prepared in {seconds:.1f} s", flush=True)
    if store.missing():
        print(f"{len(store.missing())} rows still to prepare after --max-minutes; run again to go on.", flush=True)
        return 0
    rest = [float(store.metadata(i)["rest_mass"]) for i in range(len(store))]
    print(f"teacher mass outside its top {args.top_k}: mean {mean(rest):.2e}, largest row {max(rest):.2e}", flush=True)
    left = None if budget is None else max(0.0, budget - (time.perf_counter() - started) / 60)
    result = long_kl_finetune(
        mapper,
        target,
        store,
        steps=args.steps,
        lr=args.lr,
        batch_rows=args.batch_rows,
        eval_every=args.eval_every,
        patience=args.patience,
        val_rows=args.val_rows,
        seed=args.split_seed,
        checkpoint=work / "checkpoint",
        max_minutes=left,
    )
    steps = [r["step_seconds"] for r in result.history if "step_seconds" in r]
    evals = [r["eval_seconds"] for r in result.history if "eval_seconds" in r]
    print(
        f"held-out KL {result.initial_val_kl:.4f} -> {result.best_val_kl:.4f} (best step {result.best_step} of "
        f"{result.steps_run}); {mean(steps) if steps else float('nan'):.1f} s a step, "
        f"{mean(evals):.1f} s a held-out evaluation",
        flush=True,
    )
    if not result.finished:
        print(f"stopped at step {result.steps_run} of {args.steps} (--max-minutes); run again to go on.", flush=True)
        return 0
    save_atomically(mapper, args.out)
    write_json(
        args.out / "long_finetune.json",
        {
            "mapper": str(args.mapper),
            "row_seconds": {str(k): v for k, v in prepared.items()},
            "rest_mass": rest,
            **result.to_dict(),
        },
    )
    print(f"wrote {args.out}", flush=True)
    return 0


def add_command(sub) -> None:
    """The `long-finetune` sub-command of `scale` (the study's `--cache-dir` and `--dtype` apply)."""
    from .common import MANIFEST

    p = sub.add_parser(
        "long-finetune", help="read-back KL fine-tune of a fitted map on long conversations (resumable)"
    )
    p.add_argument("--mapper", type=Path, required=True, help="the fitted map's folder (e.g. .../ridge-k8)")
    p.add_argument("--out", type=Path, required=True, help="the fine-tuned map's folder")
    p.add_argument("--work", type=Path, default=None, help="rows and checkpoint (default: <out>.work beside --out)")
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p.add_argument("--rows", type=int, default=16, help="conversations (--val-rows of them held out, a seeded choice)")
    p.add_argument("--val-rows", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096, help="tokens a conversation (2048-4096)")
    p.add_argument("--tail", type=int, default=128, help="tokens of the last turn read through the mapped cache")
    p.add_argument(
        "--tail-start", choices=("turn", "end"), default="turn", help="the tail starts a turn, or ends the row"
    )
    p.add_argument(
        "--top-k", type=int, default=4096, help="teacher tokens kept per tail position (and the rest's mass)"
    )
    p.add_argument("--turn-tokens", type=int, default=192)
    p.add_argument("--calibration-seed", type=int, default=1, help="the conversations (not the calibration's seed 0)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-rows", type=int, default=1, help="rows a step (gradients accumulated)")
    p.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations and checkpoints")
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--split-seed", type=int, default=0, help="the held-out choice and the order of the rows")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--max-minutes", type=float, default=None, help="stop at a checkpoint after this long (resume later)"
    )
    p.set_defaults(func=cmd_long_finetune)
