"""Latency of applying a mapper vs re-prefilling the target, next to the FLOP bound (docs/method.md, "Latency protocol and published speedups").

For each context length T, in one run, interleaved (the order rotates every trial), after warm-up, medians of the
timed repeats:

  (a) mapper    `MappedCache.from_source(source_cache, mapper)`: validation, RoPE tables, strip, matmul, apply and
                cache construction, for the first T-1 tokens (the last one is held back);
  (b) prefill   the target body (`target.get_decoder()`, no LM head) re-prefilling the same T-1 tokens, with
                `use_cache=True`, best attention available (flash_attention_2 when installed, else sdpa);
  (c) handoff   source cache in hand -> first target token: (a) + the target forward of the held-back token
                (LM head on that token, argmax);
  (d) baseline  no mapper -> first target token: the target prefilling all T tokens (LM head on the last, argmax).

Reported: (b)/(a) next to the FLOP bound body/mapper (`hf_kvmap.flops`) and the fraction of the bound achieved, and
(d)/(c) next to its own bound. Peak memory of (a) is measured in a separate, untimed call: on CUDA with
`torch.cuda.max_memory_allocated`; on CPU as the peak of live tensor storage bytes allocated by torch ops during the
call (a `TorchDispatchMode` that tracks every new storage until it is freed), which excludes allocator caching and
Python overhead.

    python -m benchmarks.speed.apply                     # tiny-s -> tiny-l, 256..8192 tokens, CPU
    python -m benchmarks.speed.apply --quick             # a few seconds
    python -m benchmarks.speed.apply --source tiny-m --target tiny-l --mapper path/to/mapper --tokens 512,1024

Writes JSON (run info, environment, rows) to `--out` and a PNG of speedup vs tokens with the bound to `--plot`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TOKENS = (256, 512, 1024, 2048, 4096, 8192)
QUICK_TOKENS = (64, 128)


# ----------------------------------------------------------------------------------------------------------- timing
def synchronize(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device | str) -> tuple[float, float]:
    """`(wall, cpu)` seconds of `fn()`, the device synchronized before and after; `cpu` is the process CPU time
    (all threads), which a busy machine inflates much less than wall time (meaningless for GPU work)."""
    synchronize(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    fn()
    synchronize(device)
    return time.perf_counter() - start, time.process_time() - cpu_start


def interleaved_medians(
    tasks: dict[str, Callable[[], object]],
    device: torch.device | str,
    repeats: int,
    warmup: int,
    budget_s: float | None = None,
    min_repeats: int = 3,
) -> dict[str, dict]:
    """Run every task once per trial (the order rotates by one each trial), `warmup` untimed trials first.

    Stops early after `min_repeats` timed trials once `budget_s` seconds of timed trials have passed. Returns
    `{name: {"median_ms", "min_ms", "max_ms", "times_ms", "cpu_median_ms", "cpu_times_ms"}}` (wall time; `cpu_*`:
    process CPU time).
    """
    names = list(tasks)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu_times: dict[str, list[float]] = {name: [] for name in names}
    spent = 0.0
    for trial in range(warmup + repeats):
        shift = trial % len(names)
        for name in names[shift:] + names[:shift]:
            seconds, cpu_seconds = timed(tasks[name], device)
            if trial >= warmup:
                times[name].append(seconds)
                cpu_times[name].append(cpu_seconds)
                spent += seconds
        done = trial + 1 - warmup
        if budget_s is not None and done >= min_repeats and spent > budget_s:
            break
    return {
        name: {
            "median_ms": 1000 * statistics.median(values),
            "min_ms": 1000 * min(values),
            "max_ms": 1000 * max(values),
            "times_ms": [round(1000 * v, 4) for v in values],
            "cpu_median_ms": 1000 * statistics.median(cpu_times[name]),
            "cpu_times_ms": [round(1000 * v, 4) for v in cpu_times[name]],
        }
        for name, values in times.items()
    }


# ----------------------------------------------------------------------------------------------------------- memory
class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storages that torch ops allocate while the mode is active (CPU or any device).

    Every op output whose storage is neither one of the op's inputs nor already tracked counts as a new allocation
    until the storage is freed (a `weakref.finalize` on the storage). Views, in-place ops and no-op `.to()` calls
    allocate nothing. Storages that existed before the mode was entered (weights, the source cache) never count.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: dict[int, weakref.finalize] = {}

    def _free(self, key: int, nbytes: int) -> None:
        self._tracked.pop(key, None)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            id(t.untyped_storage())
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._tracked:
                continue
            nbytes = storage.nbytes()
            self._tracked[key] = weakref.finalize(storage, self._free, key, nbytes)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        return out


def peak_memory(fn: Callable[[], object], device: torch.device | str) -> dict:
    """Peak extra memory of `fn()` (bytes) and the method used; the result is kept alive until measured."""
    device = torch.device(device)
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        kept = torch.cuda.memory_allocated(device) - before
        del result
        return {"method": "torch.cuda.max_memory_allocated", "peak_bytes": int(peak), "result_bytes": int(kept)}
    with LiveTensorBytes() as mode:
        result = fn()
        kept = mode.live
    del result
    return {"method": "live tensor storage bytes (TorchDispatchMode)", "peak_bytes": mode.peak, "result_bytes": kept}


def cache_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


# ------------------------------------------------------------------------------------------------------ environment
def environment(device: torch.device | str) -> dict:
    import transformers

    import hf_kvmap

    def _git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001 - provenance only
            return None

    device = torch.device(device)
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_kvmap": hf_kvmap.__version__,
        "flash_attn": importlib.util.find_spec("flash_attn") is not None,
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }
    if hasattr(os, "getloadavg"):
        info["loadavg_start"] = list(os.getloadavg())
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def attention_implementation(device: torch.device | str) -> str:
    """flash_attention_2 when `flash_attn` is installed and the device is CUDA, else sdpa."""
    if torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


# ------------------------------------------------------------------------------------------------------------ models
def load_model(name: str, max_positions: int, dtype: torch.dtype, device, attn: str, random_weights: bool):
    """A causal LM from a tiny-family name, a folder or a Hub id; `(model, provenance)`.

    `max_position_embeddings` is raised to `max_positions` when smaller (the tiny family has 1024): with the default
    rope this changes nothing in the computation, but trained weights then run past their training length, which is
    fine for timing only.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_kvmap import zoo
    from hf_kvmap.zoo.family import make_config

    info: dict = {"name": name}
    if name in zoo.FAMILY:
        path = zoo.model_path(name)
        has_weights = (path / "model.safetensors").exists()
        config = AutoConfig.from_pretrained(str(path)) if has_weights else make_config(name)
        source_of_weights = str(path) if has_weights and not random_weights else None
    else:
        config = AutoConfig.from_pretrained(name)
        source_of_weights = None if random_weights else name
    original = getattr(config, "max_position_embeddings", None)
    if original is not None and original < max_positions:
        config.max_position_embeddings = max_positions
        info["max_position_embeddings_raised"] = {"from": original, "to": max_positions}
    if source_of_weights is None:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
        info["weights"] = "random"
    else:
        model = AutoModelForCausalLM.from_pretrained(
            source_of_weights, config=config, attn_implementation=attn, dtype=dtype
        )
        info["weights"] = source_of_weights
    info["attn_implementation"] = attn
    return model.to(device).eval(), info


def spread_selection(source_layers: int, target_layers: int, k: int) -> list[list[int]]:
    """For every target layer, the `k` source layers nearest to its relative depth (a stand-in for a fitted mapper)."""
    k = min(k, source_layers)
    selection = []
    for layer in range(target_layers):
        centre = layer * (source_layers - 1) / max(target_layers - 1, 1)
        nearest = sorted(range(source_layers), key=lambda s: (abs(s - centre), s))[:k]
        selection.append(sorted(nearest))
    return selection


def random_mapper(source_config, target_config, k: int, dtype: torch.dtype, device, seed: int = 0):
    """A ridge `MapperModel` with random weights and the shape of a fitted top-`k` mapper."""
    from hf_kvmap import MapperConfig, MapperModel
    from hf_kvmap.configuration_mapper import summarize_model_config

    config = MapperConfig(
        source_summary=summarize_model_config(source_config),
        target_summary=summarize_model_config(target_config),
        source_layers=spread_selection(source_config.num_hidden_layers, target_config.num_hidden_layers, k),
    )
    torch.manual_seed(seed)
    with torch.device(device):
        mapper = MapperModel(config)
    return mapper.to(dtype).eval()


def load_mapper(args, source, target, dtype, device):
    from hf_kvmap import MapperModel

    path = args.mapper
    if path is None:
        shipped = REPO / "hf_kvmap" / "zoo" / "mappers" / f"{args.source}-to-{args.target}"
        if (shipped / "config.json").exists():
            path = str(shipped)
    if path is not None and not args.random_weights:
        mapper_dtype = dtype if args.mapper_dtype == "models" else getattr(torch, args.mapper_dtype)
        mapper = MapperModel.from_pretrained(path, dtype=mapper_dtype).to(device).eval()
        return mapper, {"mapper": path, "weights": "fitted", "dtype": str(mapper.dtype).removeprefix("torch.")}
    mapper = random_mapper(source.config, target.config, args.k, dtype, device)
    return mapper, {"mapper": None, "weights": "random", "k": min(args.k, source.config.num_hidden_layers)}


# ----------------------------------------------------------------------------------------------------------- bounds
def bounds(mapper, target_config, tokens: int) -> dict:
    """FLOP bounds for T tokens: mapper vs body re-prefill of T-1 tokens, and the handoff to the first token."""
    from hf_kvmap.flops import attention_flops, body_parameters, flop_bound

    text = target_config.get_text_config(decoder=True)
    mapped = tokens - 1
    prefill = flop_bound(mapper, target_config, mapped)
    hidden, vocab = text.hidden_size, text.vocab_size
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    lm_head = 2 * hidden * vocab
    # one query token attending to T keys: QK^T and AV, 2 * 2 * T * heads * head_dim per layer
    step = 2 * body_parameters(target_config) + 4 * tokens * heads * head_dim * text.num_hidden_layers + lm_head
    baseline = 2 * tokens * body_parameters(target_config) + attention_flops(target_config, tokens) + lm_head
    handoff = prefill.mapper_flops + step
    return {
        "prefill": prefill.to_dict(),
        "handoff": {"baseline_flops": baseline, "handoff_flops": handoff, "ratio": baseline / handoff},
    }


# -------------------------------------------------------------------------------------------------------------- run
def handoff_tasks(source_cache, mapper, target, ids: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The four timed tasks for one context `ids` `(1, T)`: mapper, prefill, handoff, baseline (see the module doc)."""
    from hf_kvmap import MappedCache, cache_kwargs

    body = target.get_decoder()
    held, prefix = ids[:, -1:], ids[:, :-1]

    @torch.no_grad()
    def run_mapper():
        return MappedCache.from_source(source_cache, mapper, hold_back=1)

    @torch.no_grad()
    def run_prefill():
        return body(input_ids=prefix, use_cache=True)

    @torch.no_grad()
    def run_handoff():
        cache = MappedCache.from_source(source_cache, mapper, hold_back=1)
        logits = target(input_ids=held, use_cache=True, logits_to_keep=1, **cache_kwargs(cache)).logits
        return logits[:, -1].argmax(-1).tolist()

    @torch.no_grad()
    def run_baseline():
        logits = target(input_ids=ids, use_cache=True, logits_to_keep=1).logits
        return logits[:, -1].argmax(-1).tolist()

    return {"mapper": run_mapper, "prefill": run_prefill, "handoff": run_handoff, "baseline": run_baseline}


def measure(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    attn = attention_implementation(device)
    tokens = sorted(args.tokens)
    env = environment(device)
    source, source_info = load_model(args.source, max(tokens), dtype, device, attn, args.random_weights)
    target, target_info = load_model(args.target, max(tokens), dtype, device, attn, args.random_weights)
    mapper, mapper_info = load_mapper(args, source, target, dtype, device)
    from hf_kvmap import output_cache
    from hf_kvmap.flops import mapper_parameters

    mapper_info["parameters"] = mapper_parameters(mapper.config)
    vocab = target.config.vocab_size
    rows = []
    started = time.perf_counter()
    for length in tokens:
        ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(length)).to(device)
        with torch.no_grad():
            source_cache = output_cache(source.get_decoder()(input_ids=ids, use_cache=True))
        tasks = handoff_tasks(source_cache, mapper, target, ids)
        timings = interleaved_medians(
            tasks,
            device,
            repeats=args.repeats,
            warmup=args.warmup,
            budget_s=args.budget_s,
        )
        memory = peak_memory(tasks["mapper"], device)
        mapped_bytes = cache_bytes(tasks["mapper"]())
        bound = bounds(mapper, target.config, length)
        mapper_ms, prefill_ms = timings["mapper"]["median_ms"], timings["prefill"]["median_ms"]
        handoff_ms, baseline_ms = timings["handoff"]["median_ms"], timings["baseline"]["median_ms"]
        speedup = prefill_ms / mapper_ms
        handoff_speedup = baseline_ms / handoff_ms
        row = {
            "tokens": length,
            "mapped_tokens": length - 1,
            "mapper_ms": mapper_ms,
            "prefill_ms": prefill_ms,
            "handoff_ms": handoff_ms,
            "baseline_ms": baseline_ms,
            "speedup": speedup,
            "bound": bound["prefill"]["ratio"],
            "fraction_of_bound": speedup / bound["prefill"]["ratio"],
            "handoff_speedup": handoff_speedup,
            "handoff_bound": bound["handoff"]["ratio"],
            "handoff_fraction_of_bound": handoff_speedup / bound["handoff"]["ratio"],
            "cpu_time_speedup": timings["prefill"]["cpu_median_ms"] / timings["mapper"]["cpu_median_ms"],
            "mapper_gflops_per_s": bound["prefill"]["mapper_flops"] / mapper_ms / 1e6,
            "prefill_gflops_per_s": bound["prefill"]["prefill_flops"] / prefill_ms / 1e6,
            "mapper_peak_bytes": memory["peak_bytes"],
            "mapped_cache_bytes": mapped_bytes,
            "memory_method": memory["method"],
            "repeats": len(timings["mapper"]["times_ms"]),
            "timings": timings,
            "flops": bound,
        }
        rows.append(row)
        print(format_row(row), flush=True)
        del source_cache, tasks
    env["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {
        "benchmark": "apply",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "run": {
            "source": source_info,
            "target": target_info,
            "mapper": mapper_info,
            "dtype": args.dtype,
            "tokens": tokens,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "budget_s": args.budget_s,
            "hold_back": 1,
            "order": "interleaved, rotating by one each trial",
            "wall_s": time.perf_counter() - started,
            "argv": sys.argv[1:],
        },
        "environment": env,
        "rows": rows,
    }


HEADER = (
    f"{'tokens':>7} {'mapper ms':>10} {'prefill ms':>11} {'speedup':>8} {'bound':>7} {'of bound':>9} "
    f"{'handoff ms':>11} {'to-1st ms':>10} {'handoff x':>10} {'bound':>7} {'peak MiB':>9} {'cpu-time x':>10}"
)


def format_row(row: dict) -> str:
    return (
        f"{row['tokens']:>7} {row['mapper_ms']:>10.2f} {row['prefill_ms']:>11.2f} {row['speedup']:>7.1f}x "
        f"{row['bound']:>6.1f}x {100 * row['fraction_of_bound']:>8.1f}% {row['handoff_ms']:>11.2f} "
        f"{row['baseline_ms']:>10.2f} {row['handoff_speedup']:>9.1f}x {row['handoff_bound']:>6.1f}x "
        f"{row['mapper_peak_bytes'] / 2**20:>9.1f} {row['cpu_time_speedup']:>9.1f}x"
    )


def plot(result: dict, path: Path) -> bool:
    """Speedup vs tokens with the FLOP bound; returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["rows"]
    tokens = [row["tokens"] for row in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(tokens, [row["bound"] for row in rows], "k--", label="FLOP bound (body / mapper)")
    ax.plot(tokens, [row["speedup"] for row in rows], "o-", label="measured: re-prefill / mapper")
    ax.plot(tokens, [row["handoff_speedup"] for row in rows], "s-", label="measured: to first token, handoff")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("speedup (x)")
    run = result["run"]
    ax.set_title(
        f"{run['source']['name']} -> {run['target']['name']} ({result['environment']['device']}, "
        f"{result['environment']['torch_threads']} threads, {run['dtype']})",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_tokens(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"--tokens {text!r}: give comma-separated lengths >= 2")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="tiny-s", help="tiny-family name, folder or Hub id (default: tiny-s)")
    parser.add_argument("--target", default="tiny-l", help="tiny-family name, folder or Hub id (default: tiny-l)")
    parser.add_argument("--mapper", default=None, help="mapper folder or Hub id (default: shipped one, else random)")
    parser.add_argument("--k", type=int, default=8, help="source layers per target layer of a random mapper")
    parser.add_argument("--random-weights", action="store_true", help="build models and mapper with random weights")
    parser.add_argument("--tokens", type=parse_tokens, default=list(DEFAULT_TOKENS), help="context lengths")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per length (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed trials per length")
    parser.add_argument(
        "--budget-s", type=float, default=60.0, help="stop repeating a length after this many timed seconds (min 3)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument(
        "--mapper-dtype",
        default="models",
        choices=("models", "float32", "bfloat16", "float16"),
        help="dtype of a fitted mapper (default: the models' --dtype)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "apply.json")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out with .png)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny fast run: 64,128 tokens, 3 repeats")
    return parser


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.tokens = list(QUICK_TOKENS) if args.tokens == list(DEFAULT_TOKENS) else args.tokens
        args.repeats, args.warmup = min(args.repeats, 3), min(args.warmup, 1)
    print(HEADER, flush=True)
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if not args.no_plot:
        png = args.plot or args.out.with_suffix(".png")
        if plot(result, png):
            result["plot"] = str(png)
            print(f"wrote {png}")
    return result


if __name__ == "__main__":
    main()
