"""What every real-pair command shares: the models and directions, loading, atomic JSON and mapper writes, the on-disk
prefill store, the result paths and how scores become one handoff's results."""

from __future__ import annotations

import os
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1]
ROOT = BENCHMARKS.parent
MANIFEST = BENCHMARKS / "real" / "calibration_manifest.json"
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


def stats_dir(checkpoint: Path, source: str, target: str) -> Path:
    from hf_kvmap.real.calibrating import statistics_name

    return checkpoint / statistics_name(source, target, SHORT)


def mapper_dir(work: Path, source: str, target: str, variant: str) -> Path:
    return work / "mappers" / direction_name(source, target) / variant


VARIANTS = {"ridge-k8": 8, "ridge-all": None}


def save_atomically(mapper, folder: Path) -> None:
    """Replace `folder` whole (`save_pretrained` writes beside it and swaps it in), so a reader (a running evaluate)
    never sees half a mapper and a kill leaves the previous one or the new one."""
    mapper.save_pretrained(folder, overwrite=True)


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
    def cache(
        self, name: str, model, ids: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor | None = None
    ):
        """`model`'s cache of `ids` (built at `position_ids`: give them with a `mask`), from disk or computed once."""
        from safetensors.torch import load_file, save_file
        from transformers import DynamicCache

        from hf_kvmap import output_cache

        # the dtype is part of the key: a bfloat16 prefill must never stand in for a float32 one
        path = self._path(f"{name}-{str(model.dtype).removeprefix('torch.')}", ids, mask)
        if path.is_file():
            tensors = load_file(path)
            self.loaded += 1
            layers = len(tensors) // 2
            return DynamicCache(ddp_cache_data=[(tensors[f"k{i}"], tensors[f"v{i}"]) for i in range(layers)])
        if mask is not None and position_ids is None:
            raise ValueError(
                "A masked prefill needs the position_ids it is built at (`HandoffEvaluation.position_ids`)."
            )
        kwargs = {} if mask is None else {"attention_mask": mask, "position_ids": position_ids}
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

    from hf_kvmap.evaluation import HandoffEvaluation

    @dataclass
    class CachedHandoff(HandoffEvaluation):
        """`HandoffEvaluation` whose builder prefills come from a `PrefillStore`. It overrides `prefill` alone: the positions a
        stored cache was built at are the ones `HandoffEvaluation` strips when it maps it (a store that built at other positions
        than the mapping assumed once scored every left-padded row of a batch wrong)."""

        store: PrefillStore | None = None
        names: dict | None = None

        def prefill(self, model, ids, mask=None):
            return self.store.cache(self.names[id(model)], model, ids, mask, self.position_ids(ids, mask))

    return CachedHandoff


def scores_path(work: Path, items: int, seed: int) -> Path:
    return work / "eval" / f"scores-items{items}-seed{seed}.json"


def layer_r2(predicted: list[torch.Tensor], true: list[torch.Tensor]) -> float:
    """R^2 over all heads and dims of one layer, pooled over sequences (centered per dim)."""
    x = torch.cat([p.double().transpose(1, 2).reshape(-1, p.shape[1] * p.shape[3]) for p in predicted])
    y = torch.cat([t.double().transpose(1, 2).reshape(-1, t.shape[1] * t.shape[3]) for t in true])
    ss_res = (x - y).square().sum()
    ss_tot = (y - y.mean(0)).square().sum()
    return float(1 - ss_res / ss_tot)


FAMILY_RESULTS = BENCHMARKS / "results" / "real_family.json"
FAMILY_PLOT = BENCHMARKS / "results" / "real_family.png"
CARDS = ROOT / "model_cards" / "real"
CONFIGS = BENCHMARKS / "results" / "real_family_configs"


def assemble(scores: dict, source: str, target: str, variant: str, run: str | None = None) -> dict | None:
    """One handoff's results in the layout `hf_kvmap.evaluation.evaluate_tasks` returns (the card reads it).

    Scores are keyed `task|alone|model` and `task|direction|variant`, or `task|run|direction|variant` with `run`
    (e.g. the calibration size of a fit along the scale curve); `source`/`target` are full or short names."""
    from hf_kvmap.evaluation import summarize_retention
    from lab.real.tasks import TASK_META

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


# The paper's published retention (%), the reference these results stand beside (docs/method.md; not measured here).


def weightless_mapper(config):
    """A `MapperModel` of `config` on the meta device: what the card needs (shapes, parameter count), no weights."""
    from hf_kvmap import MapperModel

    with torch.device("meta"):
        return MapperModel(config)


def card_results(report: dict, results: dict) -> dict:
    """What a real-family card renders: one handoff's results with the run's setting and environment."""
    run = {"task_set": "real-family tasks", "items_per_task": report["run"]["items_per_task"]}
    return {**results, "run": {**run, "seed": report["run"]["seed"]}, "environment": report["environment"]}
