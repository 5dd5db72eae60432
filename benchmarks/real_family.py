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


# ----------------------------------------------------------------------------------------------------- fit


def mapper_dir(work: Path, source: str, target: str, variant: str) -> Path:
    return work / "mappers" / direction_name(source, target) / variant


def self_statistics(stats, side: str):
    """Statistics of a model mapped onto itself, from either direction's statistics (its Gram is in both ways of
    holding it: as the source Gram, or, for the target side, not at all, so only `side="source"` is possible)."""
    from hf_kvmap import CalibrationStatistics
    from hf_kvmap.statistics import KindStatistics

    if side != "source":
        raise ValueError("Only the source side of a statistics object carries its full Gram.")
    config = stats.source_config
    self_stats = CalibrationStatistics(
        config,
        config,
        kinds=stats.kinds,
        stride=stats.stride,
        dtype=stats.dtype,
        source_model_id=stats.source_model_id,
        target_model_id=stats.source_model_id,
        tokenizer_fingerprint=stats.tokenizer_fingerprint,
        _allocate=False,
    )
    for kind in stats.kinds:
        own = stats[kind]
        self_stats.stats[kind] = KindStatistics(
            count=own.count.clone(),
            source_sum=own.source_sum.clone(),
            target_sum=own.source_sum.clone(),
            target_sumsq=own.gram.diagonal().clone(),
            gram=own.gram,
            cross=own.gram,
        )
    self_stats.tokens, self_stats.sequences = stats.tokens.clone(), stats.sequences.clone()
    self_stats.fingerprint_limbs = stats.fingerprint_limbs.clone()
    return self_stats


VARIANTS = {"ridge-k8": 8, "ridge-all": None}


def cmd_fit(args) -> int:
    from hf_kvmap import CalibrationStatistics, mapper_from_statistics
    from hf_kvmap.fitting import LayerSelection

    work = Path(args.work)
    progress = json.loads((work / "calib" / "progress.json").read_text())
    fitted = {}
    for source, target in DIRECTIONS:
        stats = CalibrationStatistics.load(_stats_dir(work / "calib", source, target))
        start = time.perf_counter()
        selection = LayerSelection.from_statistics(stats)
        for variant, top_k in VARIANTS.items():
            mapper = mapper_from_statistics(
                stats, ridge_lambda=args.ridge_lambda, selection=selection.with_top_k(top_k)
            )
            folder = mapper_dir(work, source, target, variant)
            mapper.save_pretrained(folder)
            fitted[f"{direction_name(source, target)}/{variant}"] = {
                "seconds": time.perf_counter() - start,
                "positions": stats.count(),
                "sequences": int(stats.sequences),
                "folder": str(folder),
            }
            start = time.perf_counter()
        # the source model onto itself: a sanity bound on what a ridge of these features can do at all
        self_stats = self_statistics(stats, "source")
        mapper = mapper_from_statistics(self_stats, top_k=None, ridge_lambda=args.ridge_lambda)
        folder = mapper_dir(work, source, source, "ridge-all")
        mapper.save_pretrained(folder)
        fitted[f"{direction_name(source, source)}/ridge-all"] = {
            "seconds": time.perf_counter() - start,
            "positions": stats.count(),
            "sequences": int(stats.sequences),
            "folder": str(folder),
        }
        del stats, self_stats
    write_json(work / "fit.json", {"ridge_lambda": args.ridge_lambda, "calibration": progress, "mappers": fitted})
    print(json.dumps(fitted, indent=1))
    return 0


# ----------------------------------------------------------------------------------------------------- evaluate


class PrefillStore:
    """Caches of (model, batch) prefills on disk: each model prefills each evaluation batch once, for every way
    (alone, as a handoff source, for every mapper variant) and every later, resumed run."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.computed = 0
        self.loaded = 0

    def _path(self, name: str, ids: torch.Tensor, mask: torch.Tensor | None) -> Path:
        import hashlib

        digest = hashlib.sha256(name.encode())
        digest.update(ids.cpu().numpy().tobytes())
        if mask is not None:
            digest.update(mask.cpu().numpy().tobytes())
        return self.folder / f"{name}-{digest.hexdigest()[:32]}.safetensors"

    @torch.no_grad()
    def cache(self, name: str, model, ids: torch.Tensor, mask: torch.Tensor | None):
        from safetensors.torch import load_file, save_file
        from transformers import DynamicCache

        from hf_kvmap.rope import positions_from_attention_mask

        path = self._path(name, ids, mask)
        if path.is_file():
            tensors = load_file(path)
            self.loaded += 1
            layers = len(tensors) // 2
            return DynamicCache(ddp_cache_data=[(tensors[f"k{i}"], tensors[f"v{i}"]) for i in range(layers)])
        kwargs = {}
        if mask is not None:
            kwargs = {
                "attention_mask": mask,
                "position_ids": positions_from_attention_mask(mask, *ids.shape, ids.device),
            }
        cache = model.get_decoder()(input_ids=ids, use_cache=True, **kwargs).past_key_values
        tensors = {}
        for i, layer in enumerate(cache.layers):
            tensors[f"k{i}"], tensors[f"v{i}"] = layer.keys.contiguous(), layer.values.contiguous()
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, tmp)
        os.replace(tmp, path)
        self.computed += 1
        return cache


def cached_handoff_class():
    from dataclasses import dataclass

    from hf_kvmap import MappedCache
    from hf_kvmap.evaluation import Handoff

    @dataclass
    class CachedHandoff(Handoff):
        """`Handoff` whose builder prefills come from a `PrefillStore` (the reader side is unchanged)."""

        store: PrefillStore | None = None
        names: dict | None = None

        @torch.no_grad()
        def context_cache(self, mode, ids, mask=None):
            builder, reader = self._models(mode)
            cache = self.store.cache(self.names[id(builder)], builder, ids, mask)
            if mode == "mapped":
                cache = MappedCache.from_source(cache, self.mapper, hold_back=self.hold_back, attention_mask=mask)
            else:
                cache.crop(-self.hold_back)
            return reader, cache

    return CachedHandoff


def scores_path(work: Path, items: int, seed: int) -> Path:
    return work / "eval" / f"scores-items{items}-seed{seed}.json"


def cmd_evaluate(args) -> int:
    """Resumable: every (task, way) score is written to the scores file as soon as it is known and skipped later."""
    from hf_kvmap import MapperModel
    from hf_kvmap.evaluation import evaluate_items
    from hf_kvmap.real import corpus
    from hf_kvmap.real.tasks import real_family_tasks

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    tokenizer = load_tokenizer(SMALL, args.cache_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    documents = corpus.load_manifest(args.manifest)
    tasks = real_family_tasks(tokenizer, documents, items=args.items, seed=args.seed, names=args.tasks.split(","))
    path = scores_path(work, args.items, args.seed)
    scores = json.loads(path.read_text()) if path.is_file() else {}
    models = {SMALL: load_model(SMALL, args.cache_dir), LARGE: load_model(LARGE, args.cache_dir)}
    names = {id(model): SHORT[name] for name, model in models.items()}
    store = PrefillStore(work / "eval" / "prefills")
    CachedHandoff = cached_handoff_class()

    def record(key: str, task, handoff, mode: str) -> None:
        if key in scores:
            return
        start = time.perf_counter()
        kwargs = {"stop": task.stop} if task.kind == "exact_match" else {}
        value = evaluate_items(handoff, task.kind, task.items, mode, **kwargs)
        scores[key] = {"score": value, "n_items": len(task.items), "seconds": time.perf_counter() - start}
        write_json(path, scores)
        print(f"{key}: {value:.4f} ({scores[key]['seconds']:.0f} s)", flush=True)

    # 1. each model alone (the "source alone" and "target alone" of both directions)
    alone = CachedHandoff(models[SMALL], models[LARGE], None, tokenizer, store=store, names=names)
    for task in tasks:
        record(f"{task.name}|alone|{SHORT[SMALL]}", task, alone, "source")
        record(f"{task.name}|alone|{SHORT[LARGE]}", task, alone, "target")
    # 2. every fitted mapper that exists (directions and self-maps), in the target's dtype
    pairs = [*DIRECTIONS, (SMALL, SMALL), (LARGE, LARGE)]
    variants = args.variants.split(",")
    for source, target in pairs:
        for variant in variants:
            folder = mapper_dir(work, source, target, variant)
            if not (folder / "config.json").is_file():
                continue
            if source == target and not args.self_maps:
                continue
            mapper = MapperModel.from_pretrained(folder, dtype=models[target].dtype)
            handoff = CachedHandoff(models[source], models[target], mapper, tokenizer, store=store, names=names)
            for task in tasks:
                record(f"{task.name}|{direction_name(source, target)}|{variant}", task, handoff, "mapped")
    print(f"prefills computed {store.computed}, loaded {store.loaded}")
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

    p = sub.add_parser("fit", help="ridge mappers (k = 8, k = all) and self-maps from the collected statistics")
    p.add_argument("--work", type=Path, required=True, help="the folder holding calib/ (mappers/ is written)")
    p.add_argument("--ridge-lambda", type=float, default=0.01)
    p.set_defaults(func=cmd_fit)

    p = sub.add_parser("evaluate", help="tasks three ways; resumable, prefills cached on disk")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p.add_argument("--items", type=int, default=200, help="items per task")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tasks", default="prose_retrieval,chat_recall,code_recall,code_nll,prose_ppl")
    p.add_argument("--variants", default="ridge-k8,ridge-all")
    p.add_argument("--self-maps", action="store_true", help="also evaluate the self-map sanity bounds")
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_evaluate)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
