"""`family manifest` and `family calibrate`: the pinned corpus and the resumable statistics of both directions."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from .common import DIRECTIONS, LARGE, SHORT, SMALL, BodyReplay, load_model, load_tokenizer, stats_dir, write_json


def cmd_manifest(args) -> int:
    from hf_kvmap.real import corpus

    manifest = corpus.build_manifest(args.out)
    kinds = {}
    for _, kind, split, _ in manifest["files"]:
        kinds[f"{kind}/{split}"] = kinds.get(f"{kind}/{split}", 0) + 1
    print(f"{args.out}: {len(manifest['files'])} files {kinds}, sha256 {manifest['sha256']}")
    return 0


def checkpoint_dir(out: Path) -> Path | None:
    """The last complete checkpoint under a calibration folder (None before the first one).

    A checkpoint (`progress.json` and both directions' statistics) is written whole to `checkpoint.tmp` and swapped
    in by renames, so a job killed at any moment leaves either the previous or the new checkpoint complete.
    """
    for name in ("checkpoint", "checkpoint.old"):
        if (out / name / "progress.json").is_file():
            return out / name
    if (out / "progress.json").is_file():  # the first layout: statistics and progress directly in `out`
        return out
    return None


def _swap_in(out: Path, tmp: Path) -> None:
    current, old = out / "checkpoint", out / "checkpoint.old"
    if old.exists():
        shutil.rmtree(old)
    if current.exists():
        os.replace(current, old)
    os.replace(tmp, current)
    if old.exists():
        shutil.rmtree(old)
    for legacy in [out / "progress.json", *out.glob("statistics-*")]:  # the first layout, now superseded
        if legacy.is_dir():
            shutil.rmtree(legacy)
        elif legacy.exists():
            legacy.unlink()


def cmd_calibrate(args, models: dict | None = None, after_checkpoint=None) -> int:
    """Resumable: the checkpoint's `progress.json` lists the chunks summed into its statistics; a run skips them.

    `models` (`{name: model}`) reuses models a caller has loaded; `after_checkpoint(progress, snapshot)` is called
    after every checkpoint (`snapshot`: the folder kept for `--snapshots`, else None), in this process, so a caller
    can score a snapshot with the same models instead of a second process holding a second copy of them."""
    from hf_kvmap import CalibrationStatistics
    from hf_kvmap.artifacts import tokenizer_fingerprint
    from hf_kvmap.real import corpus

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    documents = corpus.load_manifest(args.manifest)
    manifest_sha = json.loads(Path(args.manifest).read_text())["sha256"]
    tokenizer = load_tokenizer(SMALL, args.cache_dir)
    if tokenizer_fingerprint(tokenizer) != tokenizer_fingerprint(load_tokenizer(LARGE, args.cache_dir)):
        raise SystemExit("The two Qwen sizes should share a tokenizer, and these do not.")
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
    checkpoint = checkpoint_dir(out)
    progress = (
        json.loads((checkpoint / "progress.json").read_text()) if checkpoint else {"setting": setting, "done": {}}
    )
    if progress["setting"] != setting:
        raise SystemExit(
            f"{out} holds statistics of another setting ({progress['setting']}, asked {setting}); use another --out."
        )
    todo = [i for i in range(len(chunks)) if str(i) not in progress["done"]]
    for index in list(progress["done"]):
        got = corpus.sequences_sha256(chunks[int(index)]) if int(index) < len(chunks) else None
        if got != progress["done"][index]["sha256"]:
            raise SystemExit(f"Chunk {index} recorded in {checkpoint} is not the chunk this manifest now gives.")
    print(f"calibration: {len(chunks)} chunks of {args.chunk} x {args.seq_len} tokens; {len(todo)} to do", flush=True)
    if not todo:
        return 0
    if models is None:
        models = {name: load_model(name, args.cache_dir, args.dtype) for name in (SMALL, LARGE)}
    replay = {SMALL: BodyReplay(models[SMALL]), LARGE: BodyReplay(models[LARGE])}
    fingerprint = tokenizer_fingerprint(tokenizer)
    stats = {}
    for source, target in DIRECTIONS:
        if checkpoint:
            stats[(source, target)] = CalibrationStatistics.load(stats_dir(checkpoint, source, target))
        else:
            stats[(source, target)] = CalibrationStatistics(
                replay[source].config,
                replay[target].config,
                stride=args.stride,
                source_model_id=f"hf-kvmap-real:{source}",
                target_model_id=f"hf-kvmap-real:{target}",
                tokenizer_fingerprint=fingerprint,
            )
    started = time.perf_counter()
    for index in todo:
        if args.max_minutes and time.perf_counter() - started > 60 * args.max_minutes:
            print(f"stopping after {args.max_minutes} minutes; run the same command again to resume", flush=True)
            break
        batch = [torch.tensor([seq]) for seq in chunks[index]]
        chunk_start = time.perf_counter()
        for source, target in DIRECTIONS:
            stats[(source, target)].accumulate(replay[source], replay[target], batch, progress=False)
        progress["done"][str(index)] = {
            "sha256": corpus.sequences_sha256(chunks[index]),
            "seconds": time.perf_counter() - chunk_start,
        }
        progress["forward_seconds"] = {
            SHORT[n]: progress.get("forward_seconds", {}).get(SHORT[n], 0.0) + r.forward_seconds
            for n, r in replay.items()
        }
        for r in replay.values():
            r.forward_seconds = 0.0
        progress["positions"] = stats[DIRECTIONS[0]].count()
        tmp = out / "checkpoint.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        for (source, target), stat in stats.items():
            stat.save(stats_dir(tmp, source, target))
        write_json(tmp / "progress.json", progress)
        _swap_in(out, tmp)
        snapshot = None
        if len(progress["done"]) in args.snapshots:  # kept whole, for fits along the calibration-scale curve
            snapshot = out / f"snapshot-{progress['positions']}"
            if not snapshot.exists():
                shutil.copytree(out / "checkpoint", snapshot.with_name(snapshot.name + ".tmp"))
                os.replace(snapshot.with_name(snapshot.name + ".tmp"), snapshot)
        print(
            f"chunk {index}: {progress['done'][str(index)]['seconds']:.0f} s, {len(progress['done'])}/{len(chunks)} "
            f"done, {progress['positions']} positions",
            flush=True,
        )
        if after_checkpoint is not None:
            after_checkpoint(progress, snapshot)
    return 0
