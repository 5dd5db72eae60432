"""What `hf_kvmap.packed_attention` saves on a CPU: the real pair's arms served with transformers' `sdpa` and with the
packed one-token attention, side by side on the same items.

    python -m benchmarks.speed.packed_attention --mapper $WORK/wconv/mappers/0.5b-to-1.5b/ridge-k8 \
        --tasks ruler_vt --tokens 2048,4096 --items 2 --json benchmarks/results/packed_attention.json

Per item both models are switched to one implementation, then the other (the order alternating from item to item),
and `benchmarks.switch.long_switch_runner.Runner` serves the target's re-prefill, the mapped cache, the repair rung and its
sparse peer; each arm's time to first token is read under both, with whether the answers agree token for token. The
selection seed (4321) is the one the rungs were chosen on, never a report item. Every stage keeps its kernels but the
one-token attention: a prefill runs as `sdpa` runs it, so the re-prefill gains only its first token's step, and a
rung gains its source draft's steps and its first token.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from statistics import mean

import torch

from hf_kvmap.packed_attention import use_packed_attention
from hf_kvmap.reporting import environment_info, write_json

from ..sealed.protocol import SPARSE
from ..switch import long_switch
from ..switch.long_switch_args import parse_rung
from ..switch.long_switch_runner import Runner

MODES = ("sdpa", "packed")


def set_mode(runner, mode: str) -> None:
    for model in (runner.source, runner.target):
        if mode == "packed":
            use_packed_attention(model)
        else:
            model.set_attn_implementation("sdpa")


def measure(runner, item: dict, rung: str, order: tuple[str, ...]) -> dict:
    """One item under each implementation of `order`: each arm's seconds and answer (and, under both, whether they
    agree)."""
    rungs = {
        rung: parse_rung(rung),
        SPARSE + rung: parse_rung(SPARSE + rung),
    }
    arms = ["target", "mapped", *rungs]
    out = {"task": item["task"], "tokens": len(item["ids"]), "index": item["index"], "order": list(order)}
    for mode in order:
        set_mode(runner, mode)
        load = os.getloadavg()[0]
        measured = runner.measure(item, arms, rungs, {})
        out[mode] = {
            arm: {"ttft_s": round(r["ttft_s"], 3), "prepare_s": round(r["prepare_s"], 3), "tokens": r["tokens"]}
            for arm, r in measured.items()
        }
        out[mode]["load"] = round(max(load, os.getloadavg()[0]), 2)
    if all(mode in out for mode in MODES):
        out["same_answers"] = {arm: out["sdpa"][arm]["tokens"] == out["packed"][arm]["tokens"] for arm in arms}
    return out


def summarize(items: list[dict], rung: str) -> list[dict]:
    """Per length: each arm's mean first token under both implementations and their ratio, and the rung's and its
    sparse peer's first token against the re-prefill's under each (means over the items, ratios of means)."""
    rows = []
    for length in sorted({item["length"] for item in items}):
        group = [item for item in items if item["length"] == length]
        row = {"length": length, "items": len(group), "arms": {}}
        for arm in ("target", "mapped", rung, SPARSE + rung):
            seconds = {mode: mean(item[mode][arm]["ttft_s"] for item in group) for mode in MODES}
            row["arms"][arm] = {
                **{f"{mode}_s": round(seconds[mode], 3) for mode in MODES},
                "saved": round(1 - seconds["packed"] / seconds["sdpa"], 3),
                "same_answers": sum(item["same_answers"][arm] for item in group),
            }
        for mode in MODES:
            prefill = row["arms"]["target"][f"{mode}_s"]
            row[f"{mode}_speedup"] = {
                arm: round(prefill / row["arms"][arm][f"{mode}_s"], 2) for arm in (rung, SPARSE + rung)
            }
        rows.append(row)
    return rows


def markdown(result: dict, path: str = "benchmarks/results/packed_attention.json") -> str:
    rung = result["rung"]
    env = result["environment"]
    lines = [
        f"Generated from `{path}` by `benchmarks/speed/packed_attention.py` (Qwen2.5-Coder 0.5B -> 1.5B, "
        f"{result['dtype']}, {env.get('cpu', 'cpu')}, {result['threads']} torch threads; {result['tasks']} items at the "
        f"selection seed; means of each arm's time to first token with transformers' `sdpa` and with "
        "`hf_kvmap.packed_attention`, measured on the same items in one run).",
        "",
        "| tokens | items | re-prefill: sdpa / packed | rung: sdpa / packed | sparse peer: sdpa / packed | rung vs re-prefill: "
        "sdpa / packed | sparse vs re-prefill: sdpa / packed | answers alike |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        arms, sparse = row["arms"], SPARSE + rung

        def pair(arm: str, arms: dict = arms) -> str:
            return f"{arms[arm]['sdpa_s']:.2f} s / {arms[arm]['packed_s']:.2f} s"

        alike = sum(arms[arm]["same_answers"] for arm in arms)
        lines.append(
            f"| {row['length']} | {row['items']} | {pair('target')} | {pair(rung)} | {pair(sparse)} | "
            f"{row['sdpa_speedup'][rung]:.2f}x / {row['packed_speedup'][rung]:.2f}x | "
            f"{row['sdpa_speedup'][sparse]:.2f}x / {row['packed_speedup'][sparse]:.2f}x | "
            f"{alike} of {row['items'] * len(arms)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mapper", required=True, help="a fitted real-pair map's folder")
    parser.add_argument("--tasks", default="ruler_vt")
    parser.add_argument("--tokens", default="2048,4096", help="context lengths, comma-separated")
    parser.add_argument("--items", type=int, default=2, help="items a task and length")
    parser.add_argument("--seed", type=int, default=4321)
    parser.add_argument("--rung", default="query_overlap:fill=draft_branches@0.1")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", required=True, help="the results JSON to write")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = [int(t) for t in args.tokens.split(",")]
    common = ["--mapper", args.mapper, "--tasks", args.tasks, "--items", str(args.items), "--seed", str(args.seed)]
    common += ["--dtype", args.dtype, "--threads", str(args.threads), "--records", os.devnull]
    setup = long_switch.parse_args([*common, "--tokens", str(lengths[0])])
    runner = Runner(setup)
    warm = long_switch.build_items(runner.tokenizer, setup)[0]
    for mode in MODES:  # first-call costs of each implementation paid before any item
        measure(runner, {**warm, "ids": warm["ids"][-64:]}, args.rung, (mode,))
    items = []
    for length in lengths:
        built = long_switch.build_items(runner.tokenizer, long_switch.parse_args([*common, "--tokens", str(length)]))
        for item in built:
            order = MODES if len(items) % 2 == 0 else MODES[::-1]
            measured = measure(runner, item, args.rung, order)
            items.append({**measured, "length": length})
            print(
                f"{item['task']} {length} #{item['index']}: "
                + ", ".join(
                    f"{mode} re-prefill {measured[mode]['target']['ttft_s']:.1f} s, rung {measured[mode][args.rung]['ttft_s']:.1f} s"
                    for mode in MODES
                ),
                flush=True,
            )
    result = {
        "benchmark": "packed_attention",
        "command": "python -m benchmarks.speed.packed_attention " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d"),
        "environment": environment_info(),
        "mapper": runner.mapper.config.content_hash,
        "tasks": args.tasks,
        "seed": args.seed,
        "rung": args.rung,
        "dtype": args.dtype,
        "threads": args.threads,
        "items": items,
        "rows": summarize(items, args.rung),
    }
    write_json(args.json, result)
    print(markdown(result))


if __name__ == "__main__":
    main()
