"""`family evaluate`, `family analyze` and `family latency`: scores three ways, held-out R^2 and attention cosine,
mapper vs re-prefill."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from .common import (
    DIRECTIONS,
    LARGE,
    SHORT,
    SMALL,
    PrefillStore,
    cached_handoff_class,
    direction_name,
    layer_r2,
    load_model,
    load_tokenizer,
    mapper_dir,
    scores_path,
    write_json,
)


def cmd_evaluate(args) -> int:
    """Resumable: every (task, way) score is written to the scores file as soon as it is known and skipped later."""
    from hf_kvmap import MapperModel
    from hf_kvmap.evaluation import evaluate_items
    from hf_kvmap.real import corpus
    from lab.real.tasks import real_family_tasks

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
        value = evaluate_items(handoff, task.task_type, task.items, mode, progress=key, **kwargs)
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
        f"{part}_r2": [layer_r2(mapped_parts[part][i], true_parts[part][i]) for i in range(layers)]
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
    from lab.real.tasks import real_family_tasks

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


def cmd_latency(args) -> int:
    """`MappedCache.from_source` (mapper in the target's dtype) vs the target body re-prefilling the same tokens,
    interleaved in one run (`hf_kvmap.evaluation.measure_latency`), beside `hf_kvmap.flops.flop_bound`."""
    from hf_kvmap import MapperModel
    from hf_kvmap.evaluation import HandoffEvaluation, measure_latency
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
            handoff = HandoffEvaluation(source=models[source], target=models[target], mapper=mapper, tokenizer=None)
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
