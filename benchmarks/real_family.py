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
    return f"{SHORT.get(source, source)}-to-{SHORT.get(target, target)}"


def model_folder(name: str, cache_dir: str | None) -> Path:
    from hf_kvmap.real import converted_path, is_converted

    if not is_converted(name, cache_dir):
        raise SystemExit(f"{name} is not converted in this cache; run: hf-kvmap obtain {name}")
    return converted_path(name, cache_dir)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_model(name: str, cache_dir: str | None, dtype: str = "float32"):
    """float32 by default: on CPUs without AVX512-BF16/AMX (these machines) a float32 forward is ~4x faster than a
    bfloat16 one (measured: Qwen2.5 0.5B, 1,024 tokens, one thread: 6.8 s vs 25.9 s)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_folder(name, cache_dir), dtype=DTYPES[dtype]).eval()


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


def _stats_dir(checkpoint: Path, source: str, target: str) -> Path:
    return checkpoint / f"statistics-{direction_name(source, target)}"


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
            stats[(source, target)] = CalibrationStatistics.load(_stats_dir(checkpoint, source, target))
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
            stat.save(_stats_dir(tmp, source, target))
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


# ----------------------------------------------------------------------------------------------------- fit


def mapper_dir(work: Path, source: str, target: str, variant: str) -> Path:
    return work / "mappers" / direction_name(source, target) / variant


def self_statistics(stats, side: str):
    """Statistics of a model mapped onto itself, from either direction's statistics (its Gram is in both ways of
    holding it: as the source Gram, or, for the target side, not at all, so only `side="source"` is possible)."""
    from hf_kvmap import CalibrationStatistics
    from hf_kvmap.moments import PartStatistics

    if side != "source":
        raise ValueError("Only the source side of a statistics object carries its full Gram.")
    config = stats.source_summary
    self_stats = CalibrationStatistics(
        config,
        config,
        parts=stats.parts,
        stride=stats.stride,
        dtype=stats.dtype,
        source_model_id=stats.source_model_id,
        target_model_id=stats.source_model_id,
        tokenizer_fingerprint=stats.tokenizer_fingerprint,
        _allocate=False,
    )
    for part in stats.parts:
        own = stats[part]
        self_stats.stats[part] = PartStatistics(
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


def save_atomically(mapper, folder: Path) -> None:
    """Save to `<folder>.tmp` and rename, so a reader (a running evaluate) never sees half a mapper."""
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    mapper.save_pretrained(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


@torch.no_grad()
def ridge_all_mapper(stats, selection, ridge_lambda: float):
    """The k = all ridge mapper, solved with one Cholesky factorization per part for every target layer at once.

    `mapper_from_statistics` factors the same source Gram once per target layer and part; with k = all every
    target layer reads the same inputs, so one factorization serves all of them (2 instead of 2 L_t for a
    7,168-wide Gram). Same centered ridge with bias and absolute lambda; a test ties it to the library's solve.
    """
    from hf_kvmap import FitOptions, MapperModel
    from hf_kvmap.fitting import FittedMapper, fitted_config

    selection = selection.with_top_k(None)
    options = FitOptions(kind="ridge", top_k=None, ridge_lambda=ridge_lambda, lambda_convention="absolute")
    config = fitted_config(stats, selection, options)
    state = {}
    for part in ("key", "value"):
        moments = stats[part]
        n = float(moments.count)
        sx, sy = moments.source_sum.double(), moments.target_sum.double()
        sxx = moments.gram.double() - torch.outer(sx, sx) / n
        sxx.diagonal().add_(ridge_lambda)
        sxy = moments.cross.double() - torch.outer(sx, sy) / n
        weight = torch.cholesky_solve(sxy, torch.linalg.cholesky(sxx))  # (F_s, F_t)
        bias = sy / n - (sx / n) @ weight
        del sxx, sxy
        for layer_idx in range(stats.target_geometry.num_layers):
            rows = stats.source_columns(config.source_layers[layer_idx])
            cols = stats.target_columns(layer_idx)
            state[f"layers.{layer_idx}.{part}_proj.weight"] = weight[:, cols][rows].T.contiguous()
            state[f"layers.{layer_idx}.{part}_proj.bias"] = bias[cols].clone()
    return MapperModel.from_fitted(FittedMapper(config, state, selection, torch.float32))


def cmd_fit(args) -> int:
    from hf_kvmap import CalibrationStatistics, LayerSelection, mapper_from_statistics

    work = Path(args.work)
    calibration = Path(args.calibration) if args.calibration else work / "calib"
    checkpoint = checkpoint_dir(calibration)
    if checkpoint is None:
        raise SystemExit(f"No calibration checkpoint under {calibration}; run the calibrate command first.")
    progress = json.loads((checkpoint / "progress.json").read_text())
    fitted = {}
    for source, target in DIRECTIONS:
        stats = CalibrationStatistics.load(_stats_dir(checkpoint, source, target))
        start = time.perf_counter()
        selection = LayerSelection.from_statistics(stats)
        for variant, top_k in VARIANTS.items():
            if top_k is None:
                mapper = ridge_all_mapper(stats, selection, args.ridge_lambda)
            else:
                mapper = mapper_from_statistics(
                    stats, ridge_lambda=args.ridge_lambda, selection=selection.with_top_k(top_k)
                )
            folder = mapper_dir(work, source, target, variant)
            save_atomically(mapper, folder)
            fitted[f"{direction_name(source, target)}/{variant}"] = {
                "seconds": time.perf_counter() - start,
                "positions": stats.count(),
                "sequences": int(stats.sequences),
                "folder": str(folder),
            }
            start = time.perf_counter()
        # the source model onto itself: a sanity bound on what a ridge of these features can do at all
        self_stats = self_statistics(stats, "source")
        mapper = ridge_all_mapper(self_stats, LayerSelection.from_statistics(self_stats), args.ridge_lambda)
        folder = mapper_dir(work, source, source, "ridge-all")
        save_atomically(mapper, folder)
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

        from hf_kvmap._compat import output_cache
        from hf_kvmap.rope import positions_from_attention_mask

        # the dtype is part of the key: a bfloat16 prefill must never stand in for a float32 one
        path = self._path(f"{name}-{str(model.dtype).removeprefix('torch.')}", ids, mask)
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
        cache = output_cache(model.get_decoder()(input_ids=ids, use_cache=True, **kwargs))
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
                cache = self.mapped_cache(cache, ids, mask)
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
    models = {
        SMALL: load_model(SMALL, args.cache_dir, args.dtype),
        LARGE: load_model(LARGE, args.cache_dir, args.dtype),
    }
    names = {id(model): SHORT[name] for name, model in models.items()}
    store = PrefillStore(work / "eval" / "prefills")
    CachedHandoff = cached_handoff_class()

    def record(key: str, task, handoff, mode: str) -> None:
        if key in scores:
            return
        start = time.perf_counter()
        kwargs = {"stop": task.stop} if task.task_type == "exact_match" else {}
        value = evaluate_items(handoff, task.task_type, task.items, mode, **kwargs)
        seconds = time.perf_counter() - start
        scores[key] = {"score": value, "n_items": len(task.items), "seconds": seconds, "dtype": args.dtype}
        write_json(path, scores)
        print(f"{key}: {value:.4f} ({scores[key]['seconds']:.0f} s)", flush=True)

    # Task by task: each model alone (the "source alone" and "target alone" of both directions), then every fitted
    # mapper that exists (directions, and self-maps with --self-maps), in the target's dtype. A second pass picks up
    # mappers that were fitted while the first one ran.
    alone = CachedHandoff(models[SMALL], models[LARGE], None, tokenizer, store=store, names=names)
    pairs = [*DIRECTIONS] + ([(SMALL, SMALL), (LARGE, LARGE)] if args.self_maps else [])
    loaded = {}
    for _ in range(2):
        for task in tasks:
            record(f"{task.name}|alone|{SHORT[SMALL]}", task, alone, "source")
            record(f"{task.name}|alone|{SHORT[LARGE]}", task, alone, "target")
            for variant in args.variants.split(","):
                for source, target in pairs:
                    folder = mapper_dir(work, source, target, variant)
                    if not (folder / "config.json").is_file():
                        continue
                    if folder not in loaded:
                        mapper = MapperModel.from_pretrained(folder, dtype=models[target].dtype)
                        loaded[folder] = CachedHandoff(
                            models[source], models[target], mapper, tokenizer, store=store, names=names
                        )
                    key = f"{task.name}|{direction_name(source, target)}|{variant}"
                    record(key, task, loaded[folder], "mapped")
    print(f"prefills computed {store.computed}, loaded {store.loaded}")
    return 0


# ----------------------------------------------------------------------------------------------------- analyze


def _layer_r2(predicted: list[torch.Tensor], true: list[torch.Tensor]) -> float:
    """R^2 over all heads and dims of one layer, pooled over sequences (centered per dim)."""
    x = torch.cat([p.double().transpose(1, 2).reshape(-1, p.shape[1] * p.shape[3]) for p in predicted])
    y = torch.cat([t.double().transpose(1, 2).reshape(-1, t.shape[1] * t.shape[3]) for t in true])
    ss_res = (x - y).square().sum()
    ss_tot = (y - y.mean(0)).square().sum()
    return float(1 - ss_res / ss_tot)


def mapped_and_true_parts(mapper, source_model, target_model, source, target, store, contexts) -> tuple[dict, dict]:
    """Per target layer, the mapped and the target's own keys (content space: RoPE stripped) and values of every
    context (prefills from `store`), as `({"key": [[per context] per layer], "value": ...}, same for the target)`."""
    from hf_kvmap import MappedCache
    from hf_kvmap.rope import RotaryCodec

    codec = RotaryCodec(target_model.config)
    layers = target_model.config.num_hidden_layers
    mapped_parts = {"key": [[] for _ in range(layers)], "value": [[] for _ in range(layers)]}
    true_parts = {"key": [[] for _ in range(layers)], "value": [[] for _ in range(layers)]}
    for ids in contexts:
        mapped = MappedCache.from_source(store.cache(SHORT[source], source_model, ids, None), mapper)
        true = store.cache(SHORT[target], target_model, ids, None)
        table = codec.table(torch.arange(ids.shape[1] - 1)[None])
        for layer, (m, t) in enumerate(zip(mapped.layers, true.layers)):
            mapped_parts["key"][layer].append(table.strip(m.keys.float()))
            true_parts["key"][layer].append(table.strip(t.keys[:, :, :-1].float()))
            mapped_parts["value"][layer].append(m.values.float())
            true_parts["value"][layer].append(t.values[:, :, :-1].float())
    return mapped_parts, true_parts


def held_out_r2(mapper, source_model, target_model, source, target, store, contexts) -> dict:
    """Per target layer R^2 of the mapped keys (content space) and values against the target's own cache."""
    mapped_parts, true_parts = mapped_and_true_parts(
        mapper, source_model, target_model, source, target, store, contexts
    )
    layers = len(mapped_parts["key"])
    entry = {
        f"{part}_r2": [_layer_r2(mapped_parts[part][i], true_parts[part][i]) for i in range(layers)]
        for part in ("key", "value")
    }
    entry["positions"] = sum(int(ids.shape[1] - 1) for ids in contexts)
    return entry


def cmd_analyze(args) -> int:
    """Held-out per-layer R^2 of every fitted mapper on the perplexity tasks' contexts (prefills from the store),
    and the attention-output cosine (`hf_kvmap.diagnostics.diagnose`) of the direction mappers on held-out text."""
    from hf_kvmap import MapperModel
    from hf_kvmap.diagnostics import diagnose
    from hf_kvmap.real import corpus
    from hf_kvmap.real.tasks import real_family_tasks

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    tokenizer = load_tokenizer(SMALL, args.cache_dir)
    documents = corpus.load_manifest(args.manifest)
    names = args.contexts.split(",")
    tasks = real_family_tasks(tokenizer, documents, items=args.items, seed=args.seed, names=names)
    models = {
        SMALL: load_model(SMALL, args.cache_dir, args.dtype),
        LARGE: load_model(LARGE, args.cache_dir, args.dtype),
    }
    store = PrefillStore(work / "eval" / "prefills")
    contexts = []  # exactly the prefixes the evaluation prefilled (so the store has both models' caches)
    for task in tasks:
        for item in task.items:
            if task.task_type == "perplexity":
                ids = torch.tensor([tokenizer(item.text)["input_ids"]])
                contexts.append(ids[:, : max(2, int(ids.shape[1] * 0.5))])
            elif task.task_type == "choice":
                contexts.append(torch.tensor([tokenizer(item.context)["input_ids"]]))
            else:
                raise SystemExit(f"analyze reads single-sequence contexts; {task.name} is batched with padding.")
    out_path = work / "analysis.json"
    results = json.loads(out_path.read_text()) if out_path.is_file() else {}
    for source, target in [*DIRECTIONS, (SMALL, SMALL), (LARGE, LARGE)]:
        for variant in args.variants.split(","):
            folder = mapper_dir(work, source, target, variant)
            key = f"{direction_name(source, target)}/{variant}"
            if not (folder / "config.json").is_file():
                continue
            wants_attention = source != target and args.attention_sequences > 0
            if key in results and ("attention_summary" in results[key] or not wants_attention):
                continue
            start = time.perf_counter()
            mapper = MapperModel.from_pretrained(folder, dtype=torch.float32)
            entry = results.get(key) or held_out_r2(
                mapper, models[source], models[target], source, target, store, contexts
            )
            entry["contexts"] = names
            if wants_attention:
                ids = contexts[0][:, : args.attention_tokens]
                diag = diagnose(models[source], models[target], mapper.to(models[target].dtype), [ids], query_tokens=8)
                entry["attention_cosine"] = [
                    sum(layer["attention_cosine"]) / len(layer["attention_cosine"]) for layer in diag["layers"]
                ]
                entry["attention_summary"] = diag["summary"]
            entry["seconds"] = entry.get("seconds", 0.0) + time.perf_counter() - start
            results[key] = entry
            write_json(out_path, results)
            mean = {k: sum(entry[f"{k}_r2"]) / len(entry[f"{k}_r2"]) for k in ("key", "value")}
            cosine = entry.get("attention_summary", {}).get("mean_attention_cosine")
            print(
                f"{key}: held-out R^2 K {mean['key']:.3f} V {mean['value']:.3f}, attention cosine {cosine}", flush=True
            )
    return 0


# ----------------------------------------------------------------------------------------------------- latency


def cmd_latency(args) -> int:
    """`MappedCache.from_source` (mapper in the target's dtype) vs the target body re-prefilling the same tokens,
    interleaved in one run (`hf_kvmap.evaluation.measure_latency`), beside `hf_kvmap.flops.flop_bound`."""
    from hf_kvmap import MapperModel
    from hf_kvmap.evaluation import Handoff, measure_latency
    from hf_kvmap.flops import flop_bound
    from hf_kvmap.reporting import environment_info

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    models = {
        SMALL: load_model(SMALL, args.cache_dir, args.dtype),
        LARGE: load_model(LARGE, args.cache_dir, args.dtype),
    }
    lengths = [int(n) for n in args.tokens.split(",")]
    load_average = os.getloadavg()[0]  # what else ran when the timing started (recorded beside the rows)
    out_path = work / "latency.json"
    results = json.loads(out_path.read_text()) if out_path.is_file() else {"rows": {}}
    for source, target in DIRECTIONS:
        for variant in args.variants.split(","):
            key = f"{direction_name(source, target)}/{variant}"
            folder = mapper_dir(work, source, target, variant)
            if key in results["rows"] or not (folder / "config.json").is_file():
                continue
            mapper = MapperModel.from_pretrained(folder, dtype=models[target].dtype)
            handoff = Handoff(source=models[source], target=models[target], mapper=mapper, tokenizer=None)
            with torch.no_grad():
                rows = measure_latency(handoff, lengths, repeats=args.repeats, warmup=args.warmup, first_token=True)
            for row in rows:
                bound = flop_bound(mapper, models[target].config, row["tokens"] - handoff.hold_back)
                row["flop_bound"] = bound.ratio
                row["fraction_of_bound"] = row["speedup"] / bound.ratio
            results["rows"][key] = {
                "mapper_dtype": str(mapper.dtype).removeprefix("torch."),
                "mapper_parameters": sum(p.numel() for p in mapper.parameters()),
                "rows": rows,
            }
            results["run"] = {
                "repeats": args.repeats,
                "warmup": args.warmup,
                "threads": args.threads,
                "load_average": load_average,
            }
            results["environment"] = environment_info()
            write_json(out_path, results)
            for row in rows:
                print(
                    f"{key} {row['tokens']}: mapper {row['mapper_ms']:.0f} ms, prefill {row['prefill_ms']:.0f} ms, "
                    f"{row['speedup']:.2f}x (bound {row['flop_bound']:.2f}x)",
                    flush=True,
                )
    return 0


# ----------------------------------------------------------------------------------------------------- report

RESULTS = HERE / "results" / "real_family.json"
PLOT = HERE / "results" / "real_family.png"
CARDS = HERE.parent / "model_cards" / "real"
CONFIGS = HERE / "results" / "real_family_configs"


def assemble(scores: dict, source: str, target: str, variant: str, run: str | None = None) -> dict | None:
    """One handoff's results in the layout `hf_kvmap.evaluation.evaluate_tasks` returns (the card reads it).

    Scores are keyed `task|alone|model` and `task|direction|variant`, or `task|run|direction|variant` with `run`
    (e.g. the calibration size of a fit along the scale curve); `source`/`target` are full or short names."""
    from hf_kvmap.evaluation import summarize_retention
    from hf_kvmap.real.tasks import TASK_META

    results = {"tasks": {}, "perplexity": {}}
    direction = direction_name(source, target)
    for name, meta in TASK_META.items():
        keys = {
            "source": f"{name}|alone|{SHORT.get(source, source)}",
            "target": f"{name}|alone|{SHORT.get(target, target)}",
            "mapped": f"{name}|{direction}|{variant}" if run is None else f"{name}|{run}|{direction}|{variant}",
        }
        if not all(key in scores for key in keys.values()):
            continue
        row = {mode: scores[key]["score"] for mode, key in keys.items()}
        row["n_items"] = scores[keys["mapped"]]["n_items"]
        if meta["task_type"] == "perplexity":
            results["perplexity"][name] = row
        else:
            results["tasks"][name] = {**row, "chance": meta["chance"], "task_type": meta["task_type"]}
    if not results["tasks"] and not results["perplexity"]:
        return None
    return summarize_retention(results)


def _fmt(value, digits=3) -> str:
    from hf_kvmap.reporting import fmt_number

    return "n/a" if value is None else fmt_number(value, digits)


# The paper's published retention (%), the reference these results stand beside (`PAPER.md`; not measured here).
PAPER_TABLE = (
    "| pair (k) | avg | avg floor-norm | ARC-C | HellaSwag | WinoGrande | MMLU | GSM8K |",
    "|---|---|---|---|---|---|---|---|",
    "| Qwen3 14B->32B (8) | 97.6 | 96.3 | 101.0 | 97.6 | 98.5 | 95.0 | 95.6 |",
    "| Qwen3 8B->32B (12) | 87.5 | 80.7 | 94.0 | 95.2 | 91.0 | 88.5 | 68.8 |",
    "| Llama 3.1 8B->70B (20) | 72.8 | 62.9 | 90.9 | 94.4 | 87.1 | 73.3 | 18.2 |",
    "| Ministral 3B->8B (all) | 76.2 | 65.9 | 90.6 | 93.3 | 91.3 | 69.4 | 36.6 |",
    "| Ministral 3B->14B (20) | 44.2 | 14.7 | 43.6 | 68.0 | 74.0 | 32.0 | 3.2 |",
    "| Ministral 8B->14B (12) | 41.6 | 11.1 | 40.7 | 58.7 | 74.2 | 32.7 | 1.6 |",
)


def report_markdown(report: dict) -> str:
    run = report["run"]
    lines = [
        f"Written by `python benchmarks/real_family.py report` from `benchmarks/results/real_family.json`. "
        f"Calibration: {run['calibration']['sequences']} sequences x {run['calibration']['seq_len']} tokens of the "
        f"pinned real corpus (code, prose and chat-formatted prose), stride {run['calibration']['stride']}: "
        f"{run['calibration']['positions']} positions (the paper: 500 x 1,024 at stride 4, about 128K). "
        f"Items per task: {run['items_per_task']} (seed {run['seed']}). Models and mappers in {' and '.join(run.get('dtype', ['bfloat16']))}.",
        "",
        "Every mapper in these tables comes from one command (the weights stay outside the repository; sequence `i` "
        "does not depend on `--sequences`, so this gives the same statistics as the longer run that stopped here):",
        "",
        "```bash",
        f"hf-kvmap obtain {SMALL} && hf-kvmap obtain {LARGE} && python benchmarks/real_family.py "
        f"--dtype {run['calibration'].get('dtype', 'bfloat16')} calibrate --out "
        f"$WORK/calib --sequences {run['calibration']['sequences']} --seq-len {run['calibration']['seq_len']} "
        f"--chunk {run['calibration']['chunk']} --stride {run['calibration']['stride']} && python "
        f"benchmarks/real_family.py fit --work $WORK --ridge-lambda {run['ridge_lambda']}"
        "   # -> $WORK/mappers/<direction>/<variant>/",
        "```",
        "",
    ]
    for direction, entry in report["directions"].items():
        lines += [f"**{direction}**", ""]
        lines += ["| task | type | source alone | target alone | " + " | ".join(entry["variants"]) + " |"]
        lines += ["|---|---|---|---|" + "---|" * len(entry["variants"])]
        names = sorted({n for v in entry["variants"].values() for n in [*v["tasks"], *v["perplexity"]]})
        for name in names:
            first = next(v for v in entry["variants"].values() if name in v["tasks"] or name in v["perplexity"])
            row = first["tasks"].get(name) or first["perplexity"][name]
            kind = row.get("task_type", "perplexity")
            cells = []
            for variant in entry["variants"].values():
                cell = variant["tasks"].get(name) or variant["perplexity"].get(name)
                if cell is None:
                    cells.append("")
                elif kind == "perplexity":
                    cells.append(_fmt(cell["mapped"]))
                else:
                    floor = cell.get("floor_normalized_retention")
                    cells.append(f"{_fmt(cell['mapped'])} (floor-norm. {_fmt(floor)})")
            lines.append(
                f"| {name} | {kind} | {_fmt(row['source'])} | {_fmt(row['target'])} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    if report.get("self_maps"):
        lines += ["Ridge self-maps (each model's cache mapped onto itself; a sanity bound of the fit):", ""]
        lines += ["| model | task | alone | self-mapped |", "|---|---|---|---|"]
        for name, entry in report["self_maps"].items():
            for task, row in {**entry["tasks"], **entry["perplexity"]}.items():
                lines.append(f"| {name} | {task} | {_fmt(row['target'])} | {_fmt(row['mapped'])} |")
        lines.append("")
    if report.get("analysis"):
        contexts = ", ".join(next(iter(report["analysis"].values())).get("contexts", []))
        lines += [
            f"Held-out fit quality (contexts of the {contexts} items; keys in content space), mean over target layers:",
            "",
            "| mapper | key R^2 | value R^2 | attention cosine (mean / min layer) |",
            "|---|---|---|---|",
        ]
        for key, entry in report["analysis"].items():
            k = sum(entry["key_r2"]) / len(entry["key_r2"])
            v = sum(entry["value_r2"]) / len(entry["value_r2"])
            att = entry.get("attention_summary")
            cos = (
                f"{_fmt(att['mean_attention_cosine'])} / {_fmt(att['min_layer_attention_cosine'])}"
                if att
                else "not run"
            )
            lines.append(f"| {key} | {_fmt(k)} | {_fmt(v)} | {cos} |")
        lines.append("")
    if report.get("latency"):
        lines += [
            f"Mapper ({' and '.join(sorted({e['mapper_dtype'] for e in report['latency']['rows'].values()}))}) vs "
            "the target body re-prefilling the same tokens, timed interleaved in one run "
            f"({report['latency']['run']['threads']} thread(s), median of {report['latency']['run']['repeats']} timed "
            f"run(s) after {report['latency']['run']['warmup']} warm-up run(s); "
            + (
                f"1-minute load average {report['latency']['run']['load_average']:.2f} on "
                f"{report['latency']['environment'].get('cpu_count', os.cpu_count())} cores when it started):"
                if "load_average" in report["latency"]["run"]
                else "on a CPU shared with other jobs, so single runs are noisy):"
            ),
            "",
            "| mapper | tokens | mapper ms | re-prefill ms | speedup | FLOP bound | fraction of bound | "
            "to first token: handoff ms | to first token: prefill ms | to first token: speedup |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for key, entry in report["latency"]["rows"].items():
            for row in entry["rows"]:
                first = [row.get(f"first_token_{name}") for name in ("handoff_ms", "prefill_ms", "speedup")]
                first_cells = (
                    f"{_fmt(first[0], 0)} | {_fmt(first[1], 0)} | {_fmt(first[2], 2)}x"
                    if first[0]
                    else "n/a | n/a | n/a"
                )
                lines.append(
                    f"| {key} | {row['tokens']} | {_fmt(row['mapper_ms'], 0)} | {_fmt(row['prefill_ms'], 0)} | "
                    f"{_fmt(row['speedup'], 2)}x | {_fmt(row['flop_bound'], 2)}x | {_fmt(row['fraction_of_bound'], 2)} | "
                    f"{first_cells} |"
                )
        lines += [
            "",
            "To first token: mapping the source's cache, the target reading its held-back token over it and its "
            "next-token logits, against the target prefilling the whole prompt to the same logits (the source's own "
            "prefill is not counted: in a handoff it has already happened).",
            "",
        ]
    lines += [
        "The paper's published retention (%, from `PAPER.md`, lm-evaluation-harness tasks on 8xH100; not measured "
        "here), for comparison with the retention columns above:",
        "",
        *PAPER_TABLE,
        "",
        "![real family](benchmarks/results/real_family.png)",
    ]
    return "\n".join(lines)


def plot_report(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = list(report["directions"])
    analysis = report.get("analysis", {})
    rows = 2 if analysis else 1
    fig, axes = plt.subplots(rows, len(directions), figsize=(6 * len(directions), 4 * rows), squeeze=False)
    for ax, direction in zip(axes[0], directions):
        variants = report["directions"][direction]["variants"]
        first = next(iter(variants.values()))
        names = list(first["tasks"])
        bars = {"source alone": [first["tasks"][n]["source"] for n in names]}
        bars["target alone"] = [first["tasks"][n]["target"] for n in names]
        for variant, entry in variants.items():
            bars[variant] = [entry["tasks"].get(n, {}).get("mapped", float("nan")) for n in names]
        width = 0.8 / len(bars)
        for i, (label, values) in enumerate(bars.items()):
            ax.bar([x + i * width for x in range(len(names))], values, width, label=label)
        for x, name in enumerate(names):
            ax.hlines(
                first["tasks"][name]["chance"], x - width / 2, x + 0.8 - width / 2, colors="k", linestyles="dotted"
            )
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{direction}: accuracy (dotted: chance)")
        ax.legend(fontsize=7)
    if analysis:
        for ax, direction in zip(axes[1], directions):
            target = direction.split("-to-")[1]
            for key, entry in analysis.items():
                if not (key.startswith(direction + "/") or key.startswith(f"{target}-to-{target}/")):
                    continue
                line = ax.plot(entry["key_r2"], label=f"{key} keys")[0]
                ax.plot(entry["value_r2"], linestyle="--", color=line.get_color(), label=f"{key} values")
            ax.set_ylim(-1, 1.02)
            ax.axhline(0, color="k", linewidth=0.5)
            ax.set_xlabel("target layer")
            ax.set_title(f"held-out R^2 per layer (target {target}; clipped at -1)")
            ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def weightless_mapper(config):
    """A `MapperModel` of `config` on the meta device: what the card needs (shapes, parameter count), no weights."""
    from hf_kvmap import MapperModel

    with torch.device("meta"):
        return MapperModel(config)


def card_results(report: dict, results: dict) -> dict:
    """What a real-family card renders: one handoff's results with the run's setting and environment."""
    run = {"task_set": "real-family tasks", "items_per_task": report["run"]["items_per_task"]}
    return {**results, "run": {**run, "seed": report["run"]["seed"]}, "environment": report["environment"]}


def cmd_report(args) -> int:
    from hf_kvmap import MapperConfig
    from hf_kvmap.card import render_card
    from hf_kvmap.reporting import environment_info, update_file_section

    work = Path(args.work)
    scores = json.loads(scores_path(work, args.items, args.seed).read_text())
    fit = json.loads((work / "fit.json").read_text())
    progress = fit["calibration"]
    calibration = {
        "sequences": len(progress["done"]) * progress["setting"]["chunk"],
        "seq_len": progress["setting"]["seq_len"],
        "stride": progress["setting"]["stride"],
        "chunk": progress["setting"]["chunk"],
        "positions": progress["positions"],
        "manifest_sha256": progress["setting"]["manifest_sha256"],
        "forward_seconds": progress.get("forward_seconds"),
        "dtype": progress["setting"].get("dtype", "bfloat16"),  # runs before `--dtype` existed were bfloat16
    }
    report = {
        "run": {
            "items_per_task": args.items,
            "seed": args.seed,
            "calibration": calibration,
            "ridge_lambda": fit["ridge_lambda"],
            "models": {
                SHORT[name]: json.loads((model_folder(name, args.cache_dir) / "obtain.json").read_text())
                for name in (SMALL, LARGE)
            },
            "scores_seconds": sum(entry["seconds"] for entry in scores.values()),
            # scores written before `--dtype` existed were all bfloat16 runs
            "dtype": sorted({entry.get("dtype", "bfloat16") for entry in scores.values()}),
        },
        "directions": {},
        "self_maps": {},
        "fit": fit["mappers"],
        "environment": environment_info(),
    }
    CONFIGS.mkdir(parents=True, exist_ok=True)
    CARDS.mkdir(parents=True, exist_ok=True)
    for source, target in DIRECTIONS:
        direction = direction_name(source, target)
        variants = {}
        for variant in VARIANTS:
            results = assemble(scores, source, target, variant)
            if results is not None:
                variants[variant] = results
        if variants:
            report["directions"][direction] = {"variants": variants}
        for variant, results in variants.items():
            config = MapperConfig.from_pretrained(mapper_dir(work, source, target, variant))
            name = f"qwen2.5-coder-{direction}-{variant}"
            config.save_pretrained(CONFIGS / name)
            card = render_card(weightless_mapper(config), card_results(report, results), model_name=name)
            card.save(CARDS / f"{name}.md")
    for name in (SMALL, LARGE):
        results = assemble(scores, name, name, "ridge-all")
        if results is not None:
            report["self_maps"][SHORT[name]] = results
    if (work / "analysis.json").is_file():
        report["analysis"] = json.loads((work / "analysis.json").read_text())
    if (work / "latency.json").is_file():
        report["latency"] = json.loads((work / "latency.json").read_text())
    write_json(RESULTS, report)
    plot_report(report, PLOT)
    update_file_section(HERE.parent / "README.md", "real-family", report_markdown(report))
    print(f"wrote {RESULTS}, {PLOT}, {CARDS}/, README section real-family")
    return 0


# ----------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=None, help="hf-kvmap obtain cache (default ~/.cache/hf-kvmap)")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="the models' dtype (mappers run in the target's)"
    )
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
    p.add_argument(
        "--snapshots",
        type=lambda text: {int(n) for n in text.split(",") if n},
        default=set(),
        help="chunk counts at which a copy of the checkpoint is kept (e.g. 2,4,8,16,32), for the scale curve",
    )
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("fit", help="ridge mappers (k = 8, k = all) and self-maps from the collected statistics")
    p.add_argument("--work", type=Path, required=True, help="the folder holding calib/ (mappers/ is written)")
    p.add_argument("--calibration", type=Path, default=None, help="a calibration folder or snapshot (default calib/)")
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

    p = sub.add_parser("analyze", help="held-out per-layer R^2 and attention cosine of the fitted mappers")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p.add_argument("--items", type=int, default=200, help="the evaluate run whose perplexity contexts are used")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--variants", default="ridge-k8,ridge-all")
    p.add_argument("--contexts", default="code_nll,prose_ppl", help="tasks whose contexts are scored (no padding)")
    p.add_argument("--attention-sequences", type=int, default=1, help="0 skips the attention cosine")
    p.add_argument("--attention-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("latency", help="mapper vs target re-prefill beside the FLOP bound")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--tokens", default="512,1024,2048,4096")
    p.add_argument("--variants", default="ridge-k8,ridge-all")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_latency)

    p = sub.add_parser("report", help="results JSON, plot, cards and README section from the other commands")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--seed", type=int, default=1234)
    p.set_defaults(func=cmd_report)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
