"""Cost of selective repair to the first token, beside the mapped handoff and the target's full re-prefill.

For each context length T, in one run, interleaved (the order rotates every trial), after warm-up, medians of the
timed repeats, each path from the source cache in hand to the target's first generated token:

  prefill   the target prefilling all T tokens (LM head on the last);
  mapped    `MappedCache.from_source` + the target's forward of the held-back token;
  repair    mapped + `repair_cache(strategy, fraction f)` before that forward, for every strategy and f; the time of
            the repair alone (selection + recompute) is reported beside it.

Next to each repair: the FLOP bound of recomputing its share (`2 n P + 4 L H d sum(p + 1)` over the recomputed
positions p, P the body parameters) as a fraction of the prefill's FLOPs, and the time the recompute takes as a
fraction of the prefill's time. The attention check: the recompute of the tail (a custom 4-D mask, boolean under
sdpa) against the target re-prefilling the same suffix over the cropped cache (its own mask path), and against the
same recompute with an additive float mask (`--float-mask`).

    python benchmarks/repair/repair_cost.py                               # tiny-s -> tiny-l, 512..4096 tokens, CPU
    python benchmarks/repair/repair_cost.py --quick                       # a few seconds
    python benchmarks/repair/repair_cost.py --source SRC_FOLDER --target TGT_FOLDER --mapper MAPPER_FOLDER \\
        --device cuda --dtype bfloat16 --out benchmarks/results/repair_cost_real.json

Writes JSON (run info, environment, rows) to `--out`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import time
from pathlib import Path

import torch

from hf_kvmap import MappedCache, MapperModel, cache_kwargs, output_cache
from hf_kvmap.flops import prefill_flops, repair_flops
from hf_kvmap.loading import load_causal_lm, resolve_mapper
from hf_kvmap.repair import STRATEGIES, RepairConfig, recompute, repair_cache
from hf_kvmap.reporting import environment_info, write_json

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TOKENS = (512, 1024, 2048, 4096)
DEFAULT_FRACTIONS = (0.1, 0.2, 0.3, 0.5)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> tuple[float, object]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def _strategy(name: str, last_tokens: int) -> dict | str:
    return {"name": name, "last_tokens": last_tokens} if name in ("source_attention", "target_attention") else name


def measure(source, target, mapper, tokens: int, strategies, fractions, repeats: int, warmup: int, args) -> dict:
    device = next(target.parameters()).device
    vocab = target.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens)).to(device)
    with torch.no_grad():
        source_cache = output_cache(source(input_ids=ids, use_cache=True))
    length = tokens - 1

    @torch.no_grad()
    def prefill():
        return target(input_ids=ids, logits_to_keep=1).logits.argmax(-1)

    @torch.no_grad()
    def handoff(repair=None):
        times = {}
        times["map"], cache = _timed(lambda: MappedCache.from_source(source_cache, mapper), device)
        if repair is not None:
            times["repair"], _ = _timed(
                lambda: repair_cache(target, cache, ids, repair, source=source, source_cache=source_cache), device
            )
        times["first_token"], _ = _timed(
            lambda: target(input_ids=ids[:, -1:], **cache_kwargs(cache), logits_to_keep=1).logits.argmax(-1), device
        )
        return times

    @torch.no_grad()
    def suffix_prefill(count):
        cache = MappedCache.from_source(source_cache, mapper)
        cache.crop(-count)
        seconds, _ = _timed(
            lambda: target(input_ids=ids[:, length - count : length], **cache_kwargs(cache), use_cache=True), device
        )
        return {"suffix_prefill": seconds}

    @torch.no_grad()
    def float_mask_recompute(count):
        cache = MappedCache.from_source(source_cache, mapper)
        kinds = dict(recompute.MASK_KINDS)
        recompute.MASK_KINDS.update(dict.fromkeys(kinds, "additive"))
        try:
            seconds, _ = _timed(lambda: repair_cache(target, cache, ids, RepairConfig("tail", tokens=count)), device)
        finally:
            recompute.MASK_KINDS.update(kinds)
        return {"float_mask_recompute": seconds}

    jobs = {"prefill": lambda: {"total": _timed(prefill, device)[0]}, "mapped": handoff}
    for name in strategies:
        for fraction in fractions:
            config = RepairConfig(_strategy(name, args.last_tokens), fraction=fraction)
            jobs[f"{name}@{fraction}"] = lambda config=config: handoff(config)
    for fraction in fractions:
        count = int(fraction * length + 1e-9)
        jobs[f"suffix_prefill@{fraction}"] = lambda count=count: suffix_prefill(count)
        if args.float_mask:
            jobs[f"float_mask@{fraction}"] = lambda count=count: float_mask_recompute(count)
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in jobs}
    names = list(jobs)
    for trial in range(warmup + repeats):
        order = names[trial % len(names) :] + names[: trial % len(names)]
        for name in order:
            times = jobs[name]()
            times.setdefault("total", sum(times.values()))
            if trial >= warmup:
                for key, value in times.items():
                    samples[name].setdefault(key, []).append(1000 * value)
    medians = {name: {key: statistics.median(v) for key, v in parts.items()} for name, parts in samples.items()}
    prefill_ms = medians["prefill"]["total"]
    full = prefill_flops(target.config, tokens)
    row = {
        "tokens": tokens,
        "prefill_ms": prefill_ms,
        "mapped_ms": medians["mapped"]["total"],
        "mapped_speedup": prefill_ms / medians["mapped"]["total"],
        "prefill_flops": full,
        "repair": [],
        "attention_check": [],
    }
    for name in strategies:
        for fraction in fractions:
            times = medians[f"{name}@{fraction}"]
            count = int(fraction * length + 1e-9)
            tail_bound = repair_flops(target.config, list(range(length - count, length))) / full
            row["repair"].append(
                {
                    "strategy": name,
                    "fraction": fraction,
                    "recomputed": count,
                    "total_ms": times["total"],
                    "repair_ms": times["repair"],
                    "speedup": prefill_ms / times["total"],
                    "repair_share_of_prefill": times["repair"] / prefill_ms,
                    "flop_share_bound_tail": tail_bound,
                    "flop_share_bound_uniform": repair_flops(
                        target.config, [round(i * length / max(count, 1)) for i in range(count)]
                    )
                    / full,
                }
            )
    for fraction in fractions:
        count = int(fraction * length + 1e-9)
        check = {
            "fraction": fraction,
            "recomputed": count,
            "recompute_ms": medians[f"tail@{fraction}"]["repair"] if "tail" in strategies else None,
            "suffix_prefill_ms": medians[f"suffix_prefill@{fraction}"]["suffix_prefill"],
            "flop_share_bound": repair_flops(target.config, list(range(length - count, length))) / full,
        }
        if args.float_mask:
            check["float_mask_recompute_ms"] = medians[f"float_mask@{fraction}"]["float_mask_recompute"]
        row["attention_check"].append(check)
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="tiny-s", help="tiny-family member, model folder or Hub id")
    parser.add_argument("--target", default="tiny-l")
    parser.add_argument("--mapper", default=None, help="mapper folder (default: the shipped tiny-family one)")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    parser.add_argument("--fractions", default=",".join(map(str, DEFAULT_FRACTIONS)))
    parser.add_argument("--strategies", default=",".join(sorted(STRATEGIES)))
    parser.add_argument("--last-tokens", type=int, default=16, help="queries the attention strategies read")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--float-mask", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--quick", action="store_true", help="64 and 128 tokens, one repeat")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "repair_cost.json"))
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = [64, 128] if args.quick else [int(t) for t in args.tokens.split(",")]
    repeats = 1 if args.quick else args.repeats
    fractions = [float(f) for f in args.fractions.split(",")]
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; registered: {sorted(STRATEGIES)}")
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    source = load_causal_lm(args.source, dtype=dtype).to(device)
    target = load_causal_lm(args.target, dtype=dtype).to(device)
    mapper_path = resolve_mapper(args.mapper, args.source, args.target)
    mapper = MapperModel.from_pretrained(mapper_path).to(device)
    started = time.perf_counter()
    rows = []
    for count in tokens:
        rows.append(measure(source, target, mapper, count, strategies, fractions, repeats, args.warmup, args))
        print(
            f"{count} tokens: prefill {rows[-1]['prefill_ms']:.1f} ms, mapped {rows[-1]['mapped_ms']:.1f} ms; "
            + ", ".join(f"{r['strategy']}@{r['fraction']} {r['total_ms']:.1f}" for r in rows[-1]["repair"]),
            flush=True,
        )
    write_json(
        args.out,
        {
            "run": {
                "source": args.source,
                "target": args.target,
                "mapper": str(mapper_path),
                "tokens": tokens,
                "fractions": fractions,
                "strategies": strategies,
                "last_tokens": args.last_tokens,
                "repeats": repeats,
                "warmup": args.warmup,
                "dtype": args.dtype,
                "attn_implementation": target.config._attn_implementation,
                "seconds": time.perf_counter() - started,
                "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "command": "python benchmarks/repair/repair_cost.py " + " ".join(argv or __import__("sys").argv[1:]),
            },
            "environment": environment_info(),
            "rows": rows,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
