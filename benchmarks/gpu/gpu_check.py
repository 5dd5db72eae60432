"""Issue 2 item 6: a real cuda/cpu split of the target, the mapper placed with `mapper_device_map(target)`.

Checks, for each placement of the target:

  1. every mapped layer's keys and values land on the device where the *target itself* keeps that layer's cache
     (ground truth: the target's own `DynamicCache` after a prefill, so accelerate's execution device counts, not
     where the weights are stored), and on `target_layer_devices(target)`;
  2. `target.generate(ids, cache=mapped_cache)` runs;
  3. with an identity mapper (target onto itself) the generated tokens equal plain `target.generate(ids)`.

Placements (with a GPU):

  - ``from_pretrained``: `from_pretrained(path, device_map={... cuda:0 ..., ... "cpu" ...})`, the way users load a
    model that does not fit; accelerate then *offloads* the "cpu" layers (weights on CPU, executed on cuda:0);
  - ``dispatch_cpu_main``: `accelerate.dispatch_model(model, device_map, main_device="cpu")`, where the "cpu"
    layers really execute on the CPU.

The mapper is loaded with `MapperModel.from_pretrained(path, device_map=mapper_device_map(target))` in both.

`--dry-run` runs on CPU with the `meta` device as the second device: the target's `hf_device_map` names "meta" for
its upper layers (as `tests/test_placement.py` does), so only the placement checks run there (a meta layer cannot
execute); generate and exactness run on an all-CPU placement.

    python -m benchmarks.gpu.gpu_check             # needs CUDA; exits 1 if a check fails
    python -m benchmarks.gpu.gpu_check --dry-run   # CPU + meta

Writes JSON (every check, pass/fail, the devices seen) to `--out`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

from ..speed.apply import environment

REPO = Path(__file__).resolve().parents[2]


def tiny_pair(workdir: Path):
    """Save a source (tiny-s) and target (tiny-l) to `workdir`: the trained family when present, else random."""
    from transformers import AutoModelForCausalLM

    from hf_kvmap import zoo
    from hf_kvmap.zoo.family import make_config

    paths = {}
    for role, name in (("source", "tiny-s"), ("target", "tiny-l")):
        if (zoo.model_path(name) / "model.safetensors").exists():
            paths[role] = (str(zoo.model_path(name)), "trained")
            continue
        torch.manual_seed(0 if role == "source" else 1)
        model = AutoModelForCausalLM.from_config(make_config(name))
        with torch.no_grad():  # sharpen random logits so greedy decoding is not decided by rounding noise
            model.get_output_embeddings().weight.mul_(20.0)
        model.save_pretrained(workdir / name)
        paths[role] = (str(workdir / name), "random")
    return paths


def split_map(num_layers: int, first, second, split: int | None = None) -> dict:
    """`model.*` device map: embeddings, LM head (tied to them in the tiny family) and the lower half of the layers
    on `first`, the upper layers and the final norm on `second`."""
    split = num_layers // 2 if split is None else split
    device_map = {"model.embed_tokens": first, "model.rotary_emb": first}
    for idx in range(num_layers):
        device_map[f"model.layers.{idx}"] = first if idx < split else second
    device_map.update({"model.norm": second, "lm_head": first})
    return device_map


class Checks:
    def __init__(self):
        self.results: list[dict] = []

    def record(self, name: str, ok: bool, **details) -> bool:
        self.results.append({"check": name, "ok": bool(ok), **details})
        print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  {details}" if details else ""), flush=True)
        return ok

    def guard(self, name: str, fn):
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - a check reports, it does not crash the run
            self.record(name, False, error=f"{type(error).__name__}: {error}", trace=traceback.format_exc()[-1500:])
            return None


def _devices(cache) -> list[str]:
    return [str(layer.keys.device) for layer in cache.layers]


def check_placement(checks: Checks, label: str, target, mapper_dir: Path, source_cache, ids, *, run: bool):
    """Load the mapper beside `target`, map, and check devices (and generation when `run`)."""
    from hf_kvmap import MappedCache, MapperModel, cache_kwargs, mapper_device_map, output_cache, target_layer_devices

    device_map = mapper_device_map(target)
    mapper = MapperModel.from_pretrained(mapper_dir, device_map=device_map)
    expected = [str(device) for device in target_layer_devices(target)]
    cache = checks.guard(f"{label}: from_source", lambda: MappedCache.from_source(source_cache, mapper))
    if cache is None:
        return
    mapped = _devices(cache)
    values = [str(layer.values.device) for layer in cache.layers]
    checks.record(
        f"{label}: mapped layers on target_layer_devices",
        mapped == expected and values == expected,
        mapped=mapped,
        expected=expected,
        mapper_device_map={k: str(v) for k, v in device_map.items()},
    )
    if not run:
        return
    with torch.no_grad():
        own = output_cache(target(input_ids=ids[:, :-1], use_cache=True))
    truth = _devices(own)
    checks.record(
        f"{label}: mapped layers where the target keeps its own cache",
        mapped == truth,
        mapped=mapped,
        target_own_cache=truth,
    )
    plain = checks.guard(
        f"{label}: plain generate",
        lambda: target.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=target.config.pad_token_id),
    )
    handed = checks.guard(
        f"{label}: generate with mapped cache",
        lambda: target.generate(
            ids, max_new_tokens=8, do_sample=False, pad_token_id=target.config.pad_token_id, **cache_kwargs(cache)
        ),
    )
    if handed is not None:
        checks.record(f"{label}: generate with mapped cache runs", True, new_tokens=handed[0, ids.shape[1] :].tolist())
    if plain is not None and handed is not None and mapper.config.source_summary == mapper.config.target_summary:
        checks.record(
            f"{label}: identity mapper generates the same tokens",
            torch.equal(plain.cpu(), handed.cpu()),
            plain=plain[0, ids.shape[1] :].tolist(),
            mapped=handed[0, ids.shape[1] :].tolist(),
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU with meta as the second device")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("No CUDA device: run this on a GPU machine, or pass --dry-run.", file=sys.stderr)
        return 2
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    from hf_kvmap import MapperModel, output_cache

    out = args.out or REPO / "benchmarks" / "results" / (
        "gpu_check_dry_run.json" if args.dry_run else "gpu_check.json"
    )
    checks = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        paths = tiny_pair(workdir)
        source = AutoModelForCausalLM.from_pretrained(paths["source"][0]).eval()
        target_cpu = AutoModelForCausalLM.from_pretrained(paths["target"][0]).eval()
        identity_dir = workdir / "identity"
        MapperModel.identity(target_cpu.config).save_pretrained(identity_dir)
        # a cross-model (random ridge, k=2) mapper: placement only, its tokens are meaningless
        from ..speed.apply import random_mapper

        cross_dir = workdir / "cross"
        random_mapper(source.config, target_cpu.config, k=2, dtype=torch.float32, device="cpu").save_pretrained(
            cross_dir
        )
        vocab = target_cpu.config.vocab_size
        ids = torch.randint(3, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        layers = target_cpu.config.num_hidden_layers
        placements = []
        if args.dry_run:
            meta_target = AutoModelForCausalLM.from_pretrained(paths["target"][0]).eval()
            meta_target.hf_device_map = split_map(layers, "cpu", "meta")
            placements.append(("cpu+meta (placement only)", meta_target, "cpu", False))
            placements.append(("all cpu", target_cpu, "cpu", True))
        else:
            offloaded = AutoModelForCausalLM.from_pretrained(
                paths["target"][0], device_map=split_map(layers, 0, "cpu")
            ).eval()
            placements.append(("from_pretrained cuda:0+cpu (accelerate offload)", offloaded, "cuda:0", True))
            real = AutoModelForCausalLM.from_pretrained(paths["target"][0]).eval()
            real = dispatch_model(real, split_map(layers, 0, "cpu"), main_device="cpu")
            placements.append(("dispatch_model cuda:0+cpu, main_device=cpu", real, "cuda:0", True))
        for label, target, input_device, run in placements:
            print(f"--- {label}: hf_device_map={getattr(target, 'hf_device_map', None)}", flush=True)
            device_ids = ids.to(input_device)
            with torch.no_grad():
                own_source = output_cache(target(input_ids=device_ids, use_cache=True)) if run else None
                cross_source = output_cache(source.to(input_device)(input_ids=device_ids, use_cache=True))
                source.to("cpu")
            if own_source is None:  # meta layers cannot run: take the identity's source cache from the CPU copy
                with torch.no_grad():
                    own_source = output_cache(target_cpu(input_ids=ids, use_cache=True))
            for mapper_label, mapper_dir, source_cache in (
                ("identity", identity_dir, own_source),
                ("tiny-s->tiny-l", cross_dir, cross_source),
            ):
                name = f"{label} {mapper_label}"
                checks.guard(
                    name,
                    functools.partial(
                        check_placement, checks, name, target, mapper_dir, source_cache, device_ids, run=run
                    ),
                )
    failed = [result["check"] for result in checks.results if not result["ok"]]
    result = {
        "benchmark": "gpu_check",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "run": {"dry_run": args.dry_run, "models": {k: v[1] for k, v in paths.items()}, "tokens": args.tokens},
        "environment": environment("cuda:0" if not args.dry_run else "cpu"),
        "checks": checks.results,
        "failed": failed,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"{len(checks.results) - len(failed)}/{len(checks.results)} checks passed; wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
