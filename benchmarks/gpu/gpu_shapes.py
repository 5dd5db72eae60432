"""The paper's latency table at the real Qwen3 14B / 32B shapes, with random weights, on one GPU (not run by CI).

No download: the two configs are written below (from the public `config.json` of Qwen/Qwen3-14B and Qwen/Qwen3-32B).
Only the target's transformer body (`Qwen3Model`: embeddings + decoder layers + final norm, no LM head) is built,
directly on the GPU in bf16; the source cache is random `(1, 8, T, 128)` bf16 tensors for every source layer (the
source model never runs), and the mapper is a random-weight ridge `MapperModel` of the k=8 shape. Timed exactly like
`benchmarks/speed/apply.py` (interleaved, rotating order, warm-up, medians); the mapper includes validation (the NaN/inf
check), RoPE tables, strip, matmul, apply and cache construction.

    python -m benchmarks.gpu.gpu_shapes                          # both directions, 64..32768 tokens, about 4-6 minutes
    python -m benchmarks.gpu.gpu_shapes --directions 14b-32b --tokens 64,8192,32768
    python -m benchmarks.gpu.gpu_shapes --dry-run                # same code on CPU with tiny shapes (seconds)

Prints the table in the paper's format (docs/method.md) (mapper / re-prefill ms, speedup) with the FLOP bound, the fraction of the
bound and the paper's numbers where it has them, and writes JSON to `--out`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..speed.apply import (
    attention_implementation,
    environment,
    interleaved_medians,
    peak_memory,
    spread_selection,
    synchronize,
)

REPO = Path(__file__).resolve().parents[2]

_QWEN3_COMMON = dict(
    model_type="qwen3",
    vocab_size=151936,
    head_dim=128,
    num_key_value_heads=8,
    hidden_act="silu",
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    attention_bias=False,
    tie_word_embeddings=False,
    use_sliding_window=False,
    sliding_window=None,
)
#: Qwen/Qwen3-14B and Qwen/Qwen3-32B config.json (the fields that shape compute)
QWEN3 = {
    "14B": dict(
        _QWEN3_COMMON, hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, intermediate_size=17408
    ),
    "32B": dict(
        _QWEN3_COMMON, hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, intermediate_size=25600
    ),
}
#: the same structure scaled down for --dry-run on CPU
TINY = {
    "14B": dict(
        _QWEN3_COMMON,
        vocab_size=256,
        head_dim=16,
        num_key_value_heads=2,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
    ),
    "32B": dict(
        _QWEN3_COMMON,
        vocab_size=256,
        head_dim=16,
        num_key_value_heads=2,
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        intermediate_size=192,
        max_position_embeddings=512,
    ),
}
DIRECTIONS = {"14b-32b": ("14B", "32B"), "32b-14b": ("32B", "14B")}
DEFAULT_TOKENS = tuple(64 * 2**i for i in range(10))  # 64 .. 32768
#: the paper's latency table (docs/method.md renders it from here) (8xH100, bf16, flash_attention_2): tokens -> (mapper ms, re-prefill ms, speedup)
PAPER = {
    "14b-32b": {64: (14.0, 61.7, 4), 8192: (67.8, 1154.8, 17), 32768: (277.6, 6975.3, 25)},
    "32b-14b": {64: (11.6, 39.2, 3), 8192: (101.9, 501.0, 5), 32768: (427.1, 2952.7, 7)},
}


def qwen3_config(fields: dict):
    from transformers import Qwen3Config

    fields = {key: value for key, value in fields.items() if key != "model_type"}
    layers = fields["num_hidden_layers"]
    return Qwen3Config(**fields, layer_types=["full_attention"] * layers, max_window_layers=layers)


@torch.no_grad()
def build_body(config, device, dtype, attn: str):
    """A random-weight `Qwen3Model` built directly on `device` (init runs there; nothing is downloaded)."""
    from transformers import AutoModel

    torch.manual_seed(0)
    with torch.device(device):
        body = AutoModel.from_config(config, dtype=dtype, attn_implementation=attn)
    return body.eval()


@torch.no_grad()
def build_mapper(source_config, target_config, k: int, device, dtype):
    """A random ridge `MapperModel` with the top-`k` shape, built on `device`."""
    from hf_kvmap import MapperConfig, MapperModel
    from hf_kvmap.configuration_mapper import summarize_model_config

    config = MapperConfig(
        source_summary=summarize_model_config(source_config),
        target_summary=summarize_model_config(target_config),
        source_layers=spread_selection(source_config.num_hidden_layers, target_config.num_hidden_layers, k),
    )
    torch.manual_seed(1)
    with torch.device(device):
        mapper = MapperModel(config)
    return mapper.to(dtype).eval()


def random_source_cache(config, tokens: int, device, dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (1, config.num_key_value_heads, tokens, config.head_dim)
    generator = torch.Generator(device=device).manual_seed(tokens)
    return [
        (
            torch.randn(shape, generator=generator, device=device, dtype=dtype),
            torch.randn(shape, generator=generator, device=device, dtype=dtype),
        )
        for _ in range(config.num_hidden_layers)
    ]


def shape_tasks(source_kv, mapper, body, ids: torch.Tensor) -> dict:
    """The two timed tasks: map the random source cache (one token held back), re-prefill `ids` with the body."""
    from hf_kvmap import MappedCache

    @torch.no_grad()
    def run_mapper():
        return MappedCache.from_source(source_kv, mapper, hold_back=1)

    @torch.no_grad()
    def run_prefill():
        return body(input_ids=ids, use_cache=True)

    return {"mapper": run_mapper, "prefill": run_prefill}


def run_direction(name: str, configs: dict, args, device, dtype, attn: str) -> list[dict]:
    from hf_kvmap.flops import flop_bound, mapper_parameters

    source_name, target_name = DIRECTIONS[name]
    source_config, target_config = qwen3_config(configs[source_name]), qwen3_config(configs[target_name])
    started = time.perf_counter()
    body = build_body(target_config, device, dtype, attn)
    mapper = build_mapper(source_config, target_config, args.k, device, dtype)
    synchronize(device)
    print(
        f"[{name}] built target body ({sum(p.numel() for p in body.parameters()) / 1e9:.2f} B params) and mapper "
        f"({mapper_parameters(mapper.config) / 1e9:.3f} B params) in {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    rows = []
    for tokens in args.tokens:
        try:
            source_kv = random_source_cache(source_config, tokens, device, dtype)
            ids = torch.randint(0, target_config.vocab_size, (1, tokens - 1), device=device)

            tasks = shape_tasks(source_kv, mapper, body, ids)
            warmup = args.warmup if tokens <= args.long_from else min(args.warmup, 1)
            timings = interleaved_medians(tasks, device, args.repeats, warmup, args.budget_s)
            memory = peak_memory(tasks["mapper"], device)
        except torch.OutOfMemoryError as error:  # report and go on with the next direction
            print(f"[{name}] {tokens} tokens: out of memory ({error})", flush=True)
            rows.append({"direction": name, "tokens": tokens, "error": "out of memory"})
            break
        finally:
            source_kv = tasks = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        bound = flop_bound(mapper, target_config, tokens - 1)
        mapper_ms, prefill_ms = timings["mapper"]["median_ms"], timings["prefill"]["median_ms"]
        row = {
            "direction": name,
            "tokens": tokens,
            "mapper_ms": mapper_ms,
            "prefill_ms": prefill_ms,
            "speedup": prefill_ms / mapper_ms,
            "bound": bound.ratio,
            "fraction_of_bound": prefill_ms / mapper_ms / bound.ratio,
            "mapper_tflops_per_s": bound.mapper_flops / mapper_ms / 1e9,
            "prefill_tflops_per_s": bound.prefill_flops / prefill_ms / 1e9,
            "mapper_peak_bytes": memory["peak_bytes"],
            "mapped_cache_bytes": memory["result_bytes"],
            "memory_method": memory["method"],
            "repeats": len(timings["mapper"]["times_ms"]),
            "timings": timings,
            "flops": bound.to_dict(),
            "paper": PAPER[name].get(tokens) if not args.dry_run else None,
        }
        rows.append(row)
        print(
            f"[{name}] {tokens:>6} tokens: mapper {mapper_ms:9.2f} ms  re-prefill {prefill_ms:10.2f} ms  "
            f"speedup {row['speedup']:6.1f}x  bound {bound.ratio:5.1f}x  ({100 * row['fraction_of_bound']:.0f}%)  "
            f"mapper peak {memory['peak_bytes'] / 2**20:.2f} MiB",
            flush=True,
        )
    del body, mapper
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def format_table(rows: list[dict], directions: Sequence[str]) -> str:
    """The paper's latency table (docs/method.md): per direction `mapper / re-prefill (ms) | speedup`, plus bound and fraction."""
    by_key = {(row["direction"], row["tokens"]): row for row in rows if "error" not in row}
    tokens = sorted({row["tokens"] for row in rows})
    head = "| tokens |"
    rule = "|---|"
    for name in directions:
        label = "->".join(DIRECTIONS[name])
        head += f" {label} mapper / re-prefill (ms) | speedup | bound | of bound | paper |"
        rule += "---|---|---|---|---|"
    lines = [head, rule]
    for count in tokens:
        label = f"{count // 1024}K" if count >= 1024 and count % 1024 == 0 else str(count)
        line = f"| {label} |"
        for name in directions:
            row = by_key.get((name, count))
            if row is None:
                line += " - | - | - | - | - |"
                continue
            paper = row.get("paper")
            paper_text = f"{paper[0]} / {paper[1]} ({paper[2]}x)" if paper else ""
            line += (
                f" {row['mapper_ms']:.1f} / {row['prefill_ms']:.1f} | {row['speedup']:.1f}x | {row['bound']:.1f}x |"
                f" {100 * row['fraction_of_bound']:.0f}% | {paper_text} |"
            )
        lines.append(line)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--directions", default="14b-32b,32b-14b", help="comma-separated: 14b-32b, 32b-14b")
    parser.add_argument("--tokens", default=None, help="comma-separated context lengths (default 64..32768)")
    parser.add_argument("--k", type=int, default=8, help="source layers per target layer (default 8, as the paper)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="untimed trials (1 above --long-from tokens)")
    parser.add_argument("--long-from", type=int, default=8192)
    parser.add_argument("--budget-s", type=float, default=12.0, help="timed seconds per length before stopping early")
    parser.add_argument("--device", default=None, help="default cuda:0 (cpu with --dry-run)")
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON path (default benchmarks/results/gpu_shapes.json)"
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: checks that the script runs")
    return parser


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    directions = [name.strip() for name in args.directions.split(",") if name.strip()]
    unknown = [name for name in directions if name not in DIRECTIONS]
    if unknown:
        raise SystemExit(f"unknown direction(s) {unknown}; choose from {sorted(DIRECTIONS)}")
    if args.dry_run:
        configs, dtype = TINY, torch.float32
        torch.set_num_threads(1)
        device = torch.device(args.device or "cpu")
        default_tokens, args.repeats, args.warmup = (16, 64), min(args.repeats, 2), min(args.warmup, 1)
        out = args.out or REPO / "benchmarks" / "results" / "gpu_shapes_dry_run.json"
    else:
        configs, dtype = QWEN3, torch.bfloat16
        device = torch.device(args.device or "cuda:0")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("No CUDA device: run this on a GPU machine, or pass --dry-run to check it on CPU.")
        default_tokens = DEFAULT_TOKENS
        out = args.out or REPO / "benchmarks" / "results" / "gpu_shapes.json"
    args.tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(default_tokens)
    attn = attention_implementation(device)
    env = environment(device)
    started = time.perf_counter()
    rows: list[dict] = []
    for name in directions:
        rows.extend(run_direction(name, configs, args, device, dtype, attn))
    table = format_table(rows, directions)
    print(table)
    result = {
        "benchmark": "gpu_shapes",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "run": {
            "dry_run": args.dry_run,
            "directions": directions,
            "configs": {name: configs[name] for name in ("14B", "32B")},
            "k": args.k,
            "dtype": str(dtype).removeprefix("torch."),
            "attn_implementation": attn,
            "tokens": args.tokens,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "budget_s": args.budget_s,
            "weights": "random",
            "wall_s": time.perf_counter() - started,
            "argv": sys.argv[1:] if argv is None else list(argv),
        },
        "environment": env,
        "rows": rows,
        "table_markdown": table,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
