"""`scale swap` (`hf_kvmap.diagnostics.layer_swap` on real weights) and `scale keys` (mapped keys against the
target's)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .common import (
    BENCHMARKS,
    DTYPES,
    SMALL,
    PrefillStore,
    layer_r2,
    load_model,
    load_tokenizer,
    model_folder,
    write_json,
)
from .evaluate import mapped_and_true_parts
from .scale import Scorer, direction_models, each_fit, fitted_mapper, int_list, mapper_folder, perplexity_contexts


def cmd_swap(args) -> int:
    """`hf_kvmap.diagnostics.layer_swap` on real weights: the target reads its own cache except one mapped layer
    (then only the mapped keys, only the mapped values of every layer), for the mapper fitted at `--positions`
    (default: the largest scored); prefills from the store, so each swap costs only the target's reading."""
    from hf_kvmap import MapperModel
    from hf_kvmap.diagnostics import layer_swap

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    source, target, positions = fitted_mapper(work, args.direction, args.variant, args.positions)
    scorer = Scorer(args)
    folder = mapper_folder(work, positions, args.direction, args.variant)
    mapper = MapperModel.from_pretrained(folder, dtype=scorer.models[target].dtype)
    handoff = scorer.handoff(source, target, mapper)
    path = work / f"swap-items{args.items}-seed{args.seed}-{args.dtype}.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    layers = None if args.layers == "all" else int_list(args.layers)
    own_layers, own_first, own_tokens = (int_list(text) for text in (args.own_layers, args.own_first, args.own_tokens))
    suffix = "" if layers is None and not own_layers else f"|swap-{args.layers}|own-{args.own_layers or 'none'}"
    suffix += f"|own-first-{args.own_first}" if own_first else ""
    suffix += f"|own-tokens-{args.own_tokens}" if own_tokens else ""
    for task in scorer.tasks:
        key = f"{task.name}|{positions}|{args.direction}|{args.variant}{suffix}"
        if key in results:
            continue
        start = time.perf_counter()
        row = layer_swap(
            handoff, task, layers=layers, own_layers=own_layers, own_first=own_first, own_tokens=own_tokens
        )
        results[key] = {**row, "seconds": time.perf_counter() - start, "n_items": args.items}
        write_json(path, results)
        worst = sorted(row["layers"].items(), key=lambda kv: kv[1], reverse=task.task_type == "perplexity")[:4]
        print(
            f"{key}: target {row['target']:.3f}, mapped {row['mapped']:.3f}, keys only {row['keys_only']:.3f}, "
            f"values only {row['values_only']:.3f}; worst single layers {worst}; all but {row.get('all_but')}; "
            f"own first {row.get('own_first')}; own tokens {row.get('own_tokens')}",
            flush=True,
        )
    return 0


KEYS_RESULTS = BENCHMARKS / "results" / "real_family_keys.json"


def key_geometry(mapped: list[torch.Tensor], true: list[torch.Tensor]) -> dict:
    """How one layer's mapped keys (content space, `(batch, heads, T, dim)` per sequence) sit against the target's:
    `norm_ratio` (mean mapped key norm over mean target key norm), `cosine` (mean over tokens and heads) and `r2`
    (centered per dimension, pooled: a layer whose keys share a large mean has a small variance to explain, so a
    small error there is a large negative R^2 while the cosine stays near 1)."""
    norms = [(m.double().norm(dim=-1).mean(), t.double().norm(dim=-1).mean()) for m, t in zip(mapped, true)]
    cosines = [
        torch.nn.functional.cosine_similarity(m.double(), t.double(), dim=-1).mean() for m, t in zip(mapped, true)
    ]
    return {
        "norm_ratio": float(sum(m for m, _ in norms) / sum(t for _, t in norms)),
        "cosine": float(sum(cosines) / len(cosines)),
        "r2": layer_r2(mapped, true),
    }


class _LazyModel:
    """A model loaded only when the prefill store misses (`PrefillStore.cache` reads `dtype`, calls `get_decoder`);
    its `config` is read from the model folder without loading the weights."""

    def __init__(self, name: str, cache_dir, dtype: str):
        from transformers import AutoConfig

        self.name, self.cache_dir, self.dtype_name, self.model = name, cache_dir, dtype, None
        self.dtype = DTYPES[dtype]
        self.config = AutoConfig.from_pretrained(model_folder(name, cache_dir))

    def get_decoder(self):
        if self.model is None:
            self.model = load_model(self.name, self.cache_dir, self.dtype_name)
        return self.model.get_decoder()


def cmd_keys(args) -> int:
    """Per target layer, how the mapped keys of each `--fits` mapper sit against the target's own on the
    perplexity tasks' held-out contexts (`key_geometry`), from the prefill store (a model loads only on a miss)."""
    from hf_kvmap.real import corpus
    from lab.real.tasks import real_family_tasks

    torch.set_num_threads(args.threads)
    source, target = direction_models(args.direction)
    tokenizer = load_tokenizer(SMALL, args.cache_dir)
    tasks = real_family_tasks(
        tokenizer, corpus.load_manifest(args.manifest), items=args.items, seed=args.seed, names=args.tasks.split(",")
    )
    contexts = perplexity_contexts(tokenizer, tasks)
    store = PrefillStore(Path(args.work) / "prefills")
    models = {name: _LazyModel(name, args.cache_dir, args.dtype) for name in (source, target)}
    fits = {}
    for spec, *_, mapper in each_fit(args):
        mapped, true = mapped_and_true_parts(
            mapper.to(models[target].dtype), models[source], models[target], source, target, store, contexts
        )
        layers = [key_geometry(m, t) for m, t in zip(mapped["key"], true["key"])]
        fits[spec] = {name: [layer[name] for layer in layers] for name in ("norm_ratio", "cosine", "r2")}
        print(spec, "norm ratio by layer:", " ".join(f"{r:.2f}" for r in fits[spec]["norm_ratio"]), flush=True)
    result = {
        "run": {"direction": args.direction, "tasks": args.tasks, "items_per_task": args.items, "seed": args.seed},
        "positions": sum(int(ids.shape[1] - 1) for ids in contexts),
        "fits": fits,
    }
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0
