"""`family manifest` and `family calibrate`: the pinned corpus and the resumable statistics of both directions."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hf_kvmap.real.calibrating import calibrate
from hf_kvmap.real.registry import registered_id

from .common import DIRECTIONS, LARGE, SHORT, SMALL, load_model, load_tokenizer


def cmd_manifest(args) -> int:
    from hf_kvmap.real import corpus

    manifest = corpus.build_manifest(args.out)
    kinds = {}
    for _, kind, split, _ in manifest["files"]:
        kinds[f"{kind}/{split}"] = kinds.get(f"{kind}/{split}", 0) + 1
    print(f"{args.out}: {len(manifest['files'])} files {kinds}, sha256 {manifest['sha256']}")
    return 0


def cmd_calibrate(args, models: dict | None = None, after_checkpoint=None) -> int:
    """Resumable (`hf_kvmap.real.calibrating.calibrate`): the checkpoint's `progress.json` lists the chunks summed into
    its statistics; a run skips them.

    `models` (`{name: model}`) reuses models a caller has loaded; `after_checkpoint(progress, snapshot)` is called
    after every checkpoint (`snapshot`: the folder kept for `--snapshots`, else None), in this process, so a caller
    can score a snapshot with the same models instead of a second process holding a second copy of them."""
    from hf_kvmap.artifacts import tokenizer_fingerprint
    from hf_kvmap.real import corpus

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    documents = corpus.load_manifest(args.manifest)
    manifest_sha = json.loads(Path(args.manifest).read_text())["sha256"]
    tokenizer = load_tokenizer(SMALL, args.cache_dir)
    if tokenizer_fingerprint(tokenizer) != tokenizer_fingerprint(load_tokenizer(LARGE, args.cache_dir)):
        raise SystemExit("The two Qwen sizes should share a tokenizer, and these do not.")
    corpus_form = getattr(args, "corpus", "mixed")  # `scale follow` calibrates the mixed corpus
    if corpus_form == "conversations":  # long multi-turn chats of calibration text, for serving at length
        sequences = corpus.conversation_sequences(tokenizer, documents, args.sequences, args.seq_len, seed=args.seed)
    else:
        sequences = corpus.calibration_sequences(tokenizer, documents, args.sequences, args.seq_len, seed=args.seed)
    chunks = [sequences[i : i + args.chunk] for i in range(0, len(sequences), args.chunk)]
    setting = {
        "manifest_sha256": manifest_sha,
        "seq_len": args.seq_len,
        "chunk": args.chunk,
        "stride": args.stride,
        "seed": args.seed,
        "dtype": args.dtype,
    }
    if corpus_form != "mixed":  # named only when not the default, so checkpoints made before the flag still resume
        setting["corpus"] = corpus_form

    def report(progress, snapshot):
        index = list(progress["done"])[-1]  # chunks are done in order, each recorded last
        print(
            f"chunk {index}: {progress['done'][index]['seconds']:.0f} s, {len(progress['done'])}/{len(chunks)} "
            f"done, {progress['positions']} positions",
            flush=True,
        )
        if after_checkpoint is not None:
            after_checkpoint(progress, snapshot)

    try:
        run = calibrate(
            out,
            chunks,
            setting,
            models if models is not None else lambda: {n: load_model(n, args.cache_dir, args.dtype) for n in SHORT},
            DIRECTIONS,
            stride=args.stride,
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
            model_ids={name: registered_id(name) for name in (SMALL, LARGE)},
            labels=SHORT,
            max_minutes=args.max_minutes or None,  # 0, as before: no limit
            snapshots=args.snapshots,
            after_checkpoint=report,
            progress=False,
        )
    except ValueError as error:
        raise SystemExit(str(error)) from None
    print(f"calibration: {run.done}/{run.chunks} chunks of {args.chunk} x {args.seq_len} tokens done", flush=True)
    if run.stopped:
        print(f"stopped after {args.max_minutes} minutes; run the same command again to resume", flush=True)
    return 0
