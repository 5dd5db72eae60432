"""`hf-kvmap benchmark`: time a mapper against the target's own re-prefill, next to the FLOP bound."""

from __future__ import annotations

import argparse
import time

from . import _args


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "benchmark",
        help="Time MappedCache.from_source against the target re-prefilling the same tokens; write JSON.",
        description=(
            "For each context length, the mapper and the target body (no LM head) are timed interleaved in one run "
            "(medians of --repeats after one warm-up), and the measured speedup is set beside the FLOP bound of "
            "hf_kvmap.flops. benchmarks/speed/apply.py measures more (whole handoff, peak memory, contexts beyond the "
            "models' position limit, GPUs)."
        ),
    )
    parser.add_argument("--source", required=True, help="tiny-family member, folder or Hub id")
    parser.add_argument("--target", required=True, help="tiny-family member, folder or Hub id")
    parser.add_argument("--mapper", default=None, help="mapper folder or Hub id (default: the shipped one)")
    parser.add_argument("--tokens", default="256,1024", help="comma-separated context lengths (default: 256,1024)")
    parser.add_argument("--repeats", type=_args.positive_int, default=5, help="timed repeats per length (default: 5)")
    parser.add_argument(
        "--threads", type=_args.positive_int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument("--json", type=_args.output_file, default=None, help="write results here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..evaluation import HandoffEvaluation, measure_latency
    from ..flops import flop_bound
    from ..reporting import environment_info
    from ._output import finish
    from .models import load_causal_lm, load_mapper, resolve_mapper

    try:
        tokens = [int(n) for n in str(args.tokens).split(",") if n.strip()]
    except ValueError:
        raise SystemExit(
            f"hf-kvmap benchmark: --tokens must be comma-separated integers, got {args.tokens!r}."
        ) from None
    if not tokens or min(tokens) < 2 or args.repeats < 1:
        raise SystemExit("hf-kvmap benchmark: need --tokens of at least 2 and --repeats of at least 1.")
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    source, target = load_causal_lm(args.source), load_causal_lm(args.target)
    limit = min(source.config.max_position_embeddings, target.config.max_position_embeddings)
    if max(tokens) > limit:
        raise SystemExit(
            f"hf-kvmap benchmark: --tokens {max(tokens)} exceeds the models' max_position_embeddings ({limit}); "
            "use shorter contexts, or benchmarks/speed/apply.py, which raises the limit for timing."
        )
    mapper_name = resolve_mapper(args.mapper, args.source, args.target)
    mapper = load_mapper(mapper_name, "benchmark")
    handoff = HandoffEvaluation(source=source, target=target, mapper=mapper, tokenizer=None)
    with torch.no_grad():
        rows = measure_latency(handoff, tokens, repeats=args.repeats)
    for row in rows:
        bound = flop_bound(mapper, target.config, row["tokens"] - handoff.hold_back)
        row["flop_bound"] = bound.ratio
        row["fraction_of_bound"] = row["speedup"] / bound.ratio
    results = {
        "run": {
            "source": args.source,
            "target": args.target,
            "mapper": mapper_name,
            "mapper_dtype": str(mapper.dtype).removeprefix("torch."),
            "mapper_parameters": sum(p.numel() for p in mapper.parameters()),
            "repeats": args.repeats,
            "seconds": time.perf_counter() - started,
        },
        "rows": rows,
        "environment": environment_info(),
    }
    print(f"{'tokens':>8}{'mapper ms':>12}{'prefill ms':>12}{'speedup':>9}{'bound':>9}")
    for row in rows:
        print(
            f"{row['tokens']:>8}{row['mapper_ms']:>12.2f}{row['prefill_ms']:>12.2f}{row['speedup']:>8.1f}x"
            f"{row['flop_bound']:>8.1f}x"
        )
    return finish(args.json, results)
