"""Fit-time benchmark: how much a fit costs on top of the two forward passes it cannot avoid.

On a tiny pair of random Qwen3 models (built from configs, no download), at a few calibration sizes, times
separately: the source forward, the target forward, the accumulation of the statistics (feature extraction, RoPE
strip, Gram and cross moments), and the solve (selection probe + ridge), and reports
`ratio = total fit time / (source + target forward time inside the fit)`; `ratio_over_plain_forwards` divides by
plain forward passes of both models over the same batches instead (noisier on a shared machine).
Each size is repeated and the fastest fit is reported.

Writes self-describing JSON (run info, environment, numbers) to `--out`.

    python -m benchmarks.speed.fit --out benchmarks/results/fit.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch


def tiny_pair(source_layers: int, target_layers: int, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def build(layers, offset):
        torch.manual_seed(seed + offset)
        config = Qwen3Config(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=4096,
        )
        return Qwen3ForCausalLM(config).eval()

    return build(source_layers, 0), build(target_layers, 1)


def environment() -> dict:
    import transformers

    import hf_kvmap

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "hf_kvmap": hf_kvmap.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


@torch.no_grad()
def plain_forward_seconds(model, batches) -> float:
    start = time.perf_counter()
    for ids in batches:
        model(ids.to(model.device), use_cache=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_size(source, target, sequences: int, seq_len: int, batch_size: int, stride: int, top_k: int, repeats: int):
    from hf_kvmap import LayerSelection, mapper_from_statistics
    from hf_kvmap.statistics import CalibrationStatistics

    generator = torch.Generator().manual_seed(sequences)
    ids = torch.randint(0, source.config.vocab_size, (sequences, seq_len), generator=generator)
    batches = list(ids.split(batch_size))
    best = None
    for _ in range(repeats):
        floor_source = plain_forward_seconds(source, batches)
        floor_target = plain_forward_seconds(target, batches)
        start = time.perf_counter()
        stats = CalibrationStatistics.collect(source, target, batches, stride=stride, progress=False)
        collect_seconds = time.perf_counter() - start
        start = time.perf_counter()
        selection = LayerSelection.from_statistics(stats, top_k)
        probe_seconds = time.perf_counter() - start
        start = time.perf_counter()
        mapper_from_statistics(stats, selection=selection, ridge_lambda=0.01)
        ridge_seconds = time.perf_counter() - start
        total = collect_seconds + probe_seconds + ridge_seconds
        row = {
            "sequences": sequences,
            "seq_len": seq_len,
            "batch_size": batch_size,
            "stride": stride,
            "top_k": top_k,
            "tokens": int(stats.tokens),
            "positions": stats.count(),
            "source_forward_s": stats.timings["source_forward"],
            "target_forward_s": stats.timings["target_forward"],
            "accumulation_s": stats.timings["accumulate"],
            "collect_overhead_s": collect_seconds - sum(stats.timings.values()),
            "probe_s": probe_seconds,
            "ridge_s": ridge_seconds,
            "solve_s": probe_seconds + ridge_seconds,
            "total_fit_s": total,
            "plain_source_forward_s": floor_source,
            "plain_target_forward_s": floor_target,
            "ratio": total / (stats.timings["source_forward"] + stats.timings["target_forward"]),
            "ratio_over_plain_forwards": total / (floor_source + floor_target),
            "statistics_bytes": stats.nbytes(),
        }
        if best is None or row["total_fit_s"] < best["total_fit_s"]:
            best = row
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/fit.json")
    parser.add_argument("--sizes", default="8,32,128", help="Comma-separated numbers of calibration sequences.")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--stride", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--source-layers", type=int, default=4)
    parser.add_argument("--target-layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="Repeats per size; the fastest is reported.")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: leave torch's default).")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    source, target = tiny_pair(args.source_layers, args.target_layers)
    # Warm-up (allocator, kernels, lazy imports).
    run_size(source, target, 2, 32, 2, args.stride, args.top_k, 1)
    results = []
    for sequences in (int(s) for s in args.sizes.split(",")):
        row = run_size(source, target, sequences, args.seq_len, args.batch_size, args.stride, args.top_k, args.repeats)
        results.append(row)
        print(
            f"{sequences:4d} seqs x {args.seq_len}: fwd src {row['source_forward_s']:.3f}s tgt "
            f"{row['target_forward_s']:.3f}s | accumulate {row['accumulation_s']:.3f}s | solve {row['solve_s']:.3f}s "
            f"| total {row['total_fit_s']:.3f}s | ratio {row['ratio']:.2f}x its forwards "
            f"({row['ratio_over_plain_forwards']:.2f}x plain forwards)"
        )
    report = {
        "benchmark": "fit",
        "description": __doc__.splitlines()[0],
        "run": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv[1:] if argv is None else list(argv),
            "source": {"layers": args.source_layers, "kv_heads": 2, "head_dim": 32, "hidden": 128},
            "target": {"layers": args.target_layers, "kv_heads": 2, "head_dim": 32, "hidden": 128},
            "statistics_dtype": "float64",
        },
        "environment": environment(),
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)
        handle.write("\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
