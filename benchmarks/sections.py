"""Marked sections of the docs (`<!-- name:start -->` ... `<!-- name:end -->`) and the markdown of the demo and
`benchmarks.speed.apply` JSON: what `python -m benchmarks.docs` writes. The library never writes documentation files."""

from __future__ import annotations

import re
from pathlib import Path

from hf_kvmap.payoff import WAY_LABELS
from hf_kvmap.reporting import fmt_number, retention_cells


def _mapper_summary(config: dict | None) -> str:
    """` (ridge, k=6, context window 3, keys and values)` for a demo run's `mapper_config` (empty when unknown)."""
    if not config:
        return ""
    parts = [config.get("kind", "?"), f"k={config.get('top_k')}"]
    if config.get("context_window"):
        parts.append(f"context window {config['context_window']}")
    if config.get("input_kinds") == "both":
        parts.append("keys and values")
    for layer, maps in sorted((config.get("layer_inputs") or {}).items(), key=lambda item: int(item[0])):
        for part, spec in sorted(maps.items()):
            kinds = ", keys and values" if spec.get("input_kinds") == "both" else ""
            parts.append(f"layer {layer} {part}s: context window {spec.get('context_window', 0)}{kinds}")
    if config.get("key_norm"):
        parts.append("target key norm")
    stages = [stage for stage in (config.get("objective") or "").split("+") if stage and stage != "mse"]
    if stages:
        parts.append(" then ".join({"kl": "KL", "attention": "attention"}[stage] for stage in stages) + " fine-tuned")
    return " (" + ", ".join(parts) + ")"


def _repair_summary(repair: dict) -> str:
    strategy = repair["strategy"]
    name = strategy["name"] if isinstance(strategy, dict) else strategy
    budget = (
        f"{100 * repair['fraction']:.0f} %" if repair.get("fraction") is not None else f"{repair['tokens']} tokens"
    )
    return f"`{name}`, {budget} of the positions"


def _guard_summary(guard: dict) -> str:
    if guard.get("ladder"):
        ladder = guard["ladder"]
        return f"the mapper's calibrated ladder ({len(ladder['rungs'])} rungs, probe `{ladder['probe']['name']}`)"
    probe = guard.get("probe") or {}
    return f"the mapper's calibrated probe (`{probe.get('name', '?')}`, threshold {fmt_number(guard.get('threshold'), 3)})"


def serving_markdown(results: dict) -> str:
    """The demo's four ways per task: accuracy and median time to first token, and what the guard served."""
    run = results["run"]
    ways = list(WAY_LABELS)
    lines = [
        "Each request served four ways from the source's prefill (accuracy / median time to first token, ms; the "
        f"repair: {_repair_summary(run['repair'])}; the guard: {_guard_summary(run['guard'])}, served per request "
        "with `hf_kvmap.handoff`):",
        "",
        "| task | " + " | ".join(WAY_LABELS[way] for way in ways) + " | guarded served |",
        "|---|" + "---|" * (len(ways) + 1),
    ]
    for name, served in results["serving"].items():
        cells = [f"{fmt_number(served[way]['accuracy'])} / {fmt_number(served[way]['ttft_ms'], 1)}" for way in ways]
        rungs = ", ".join(f"{rung} {100 * share:.0f} %" for rung, share in served["guarded"]["rungs"].items())
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {rungs} |")
    return "\n".join(lines)


def long_markdown(results: dict) -> str:
    """The demo's first screen as markdown: the long rows (the ways that pay in bold), the rows where the switch pays,
    the break-even lengths and how they were obtained."""
    from hf_kvmap.payoff import (
        BREAK_EVEN_RULE,
        HANDOFF_WAYS,
        break_even_text,
        kept_text,
        paying_text,
        pays,
    )

    long = results["long"]
    reach = long["reach"]
    where = "stated first" if reach is None else f"stated {reach} tokens before the prompt's end"
    tolerance = fmt_number(long["tolerance"], 2)
    lines = [
        f"**Where the switch pays** (what the demo prints first): long prompts of the family's own text, one fact {where} "
        f"and the question about it last, {long['items']} items per task and length; accuracy / median time to the first "
        "token (ms) from the source's prefill, each length warmed up; in bold where a handoff pays (its first token "
        f"sooner than the target alone's, its accuracy within {tolerance} of it, where the target alone beats chance).",
        "",
        "| task | prompt tokens | " + " | ".join(WAY_LABELS[way] for way in ("target", *HANDOFF_WAYS)) + " |",
        "|---|---|" + "---|" * (1 + len(HANDOFF_WAYS)),
    ]
    for task, rows in long["tasks"].items():
        for row in rows:
            cells = []
            for way in ("target", *HANDOFF_WAYS):
                served = row["ways"][way]
                cell = f"{fmt_number(served['accuracy'])} / {fmt_number(served['ttft_ms'], 1)}"
                cells.append(f"**{cell}**" if way != "target" and pays(row, way) else cell)
            note = "" if row["target_does_task"] else " (the target alone does not beat chance)"
            lines.append(f"| {task} | {row['tokens']}{note} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- {sentence}" for sentence in paying_text(long["tasks"], long["tolerance"])]
    lines.append(f"- {kept_text(long['tasks'], long['tolerance'])}")
    lines.append(f"- Where it does not pay: below the break-even length, {BREAK_EVEN_RULE}:")
    for task, entries in long["break_even"].items():
        text = "; ".join(f"{WAY_LABELS[way]} {break_even_text(e)}" for way, e in entries.items())
        lines.append(f"  - {task}: {text}.")
    latency = results.get("latency_break_even") or {}
    if latency:
        text = "; ".join(f"{WAY_LABELS[way]} {break_even_text(e)}" for way, e in latency.items())
        lines.append(f"  - random tokens (the latency table below): {text}.")
    return "\n".join(lines)


def _load_text(env: dict) -> str:
    """`, load average 2.1 at the start and 2.4 at the end` (1 minute) where the run recorded it."""
    if "loadavg_start" not in env:
        return ""
    return (
        f", load average {env['loadavg_start'][0]:.1f} at the start and {env['loadavg_end'][0]:.1f} at the end "
        "(1 minute)"
    )


def demo_markdown(results: dict, source_file: str) -> str:
    """The docs block for one `hf-kvmap demo` JSON: per-task table, perplexity, the four ways and latency."""
    run = results["run"]
    env = results.get("environment", {})
    lines = [
        f"Generated from `{source_file}` (`{run['source']}` -> `{run['target']}`, mapper `{run['mapper']}`"
        f"{_mapper_summary(run.get('mapper_config'))}, {run['items_per_task']} items per task, seed {run['seed']}; "
        f"{env.get('device', 'cpu')}, {env.get('threads', '?')} threads{_load_text(env)}, "
        f"{fmt_number(run.get('seconds'), 0)} s in all).",
    ]
    if results.get("long"):
        lines += ["", long_markdown(results)]
    lines += [
        "",
        "On the tiny family's own (short) items: each model alone and the handoff (mapped) per task.",
        "",
        "| task | source alone | target alone | handoff (mapped) | chance | retention | floor-normalized |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in results["tasks"].items():
        raw, floor = retention_cells(row)
        lines.append(
            f"| {name} | {fmt_number(row['source'])} | {fmt_number(row['target'])} | {fmt_number(row['mapped'])} | "
            f"{fmt_number(row['chance'], 2)} | {raw} | {floor} |"
        )
    for name, row in results.get("perplexity", {}).items():
        lines.append(
            f"| {name} (perplexity, lower is better) | {fmt_number(row['source'])} | {fmt_number(row['target'])} | "
            f"{fmt_number(row['mapped'])} | | | |"
        )
    dropped = results.get("dropped_tasks", {})
    if dropped:
        cells = [
            f"{name} (target alone {fmt_number(row['target'])}, chance {fmt_number(row['chance'], 2)}, "
            f"{row['n_items']} items, p = {fmt_number(row.get('target_vs_chance_p'), 2)})"
            for name, row in dropped.items()
        ]
        lines += [
            "",
            "Not reported, because the target alone does not do them better than chance over the items (one-sided "
            "exact binomial test at the 5 % level), so a handoff has nothing to retain: " + "; ".join(cells) + ".",
        ]
    if results.get("serving"):
        lines += ["", serving_markdown(results)]
    if results.get("latency"):
        lines += [
            "",
            f"Latency per context length (random tokens; median of {run.get('repeats', '?')} interleaved repeats after "
            f"a warm-up run of every length, {env.get('device', 'cpu')}, {env.get('threads', '?')} threads):",
            "",
            "| context tokens | mapper `from_source` (ms) | target re-prefill (ms) | speedup | first token: target alone "
            "(ms) | mapped (ms) | repaired (ms) |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in results["latency"]:
            lines.append(
                f"| {row['tokens']} | {fmt_number(row['mapper_ms'], 2)} | {fmt_number(row['prefill_ms'], 2)} | "
                f"{fmt_number(row['speedup'], 2)}x | {fmt_number(row.get('ttft_target_ms'), 2)} | "
                f"{fmt_number(row.get('ttft_mapped_ms'), 2)} | {fmt_number(row.get('ttft_repaired_ms'), 2)} |"
            )
    return "\n".join(lines)


def replace_section(text: str, name: str, content: str) -> str:
    """Replace what stands between `<!-- name:start -->` and `<!-- name:end -->` in `text`."""
    pattern = re.compile(rf"(<!-- {re.escape(name)}:start -->\n).*?(<!-- {re.escape(name)}:end -->)", re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"No `<!-- {name}:start -->` ... `<!-- {name}:end -->` markers found.")
    return pattern.sub(lambda m: m.group(1) + content.rstrip("\n") + "\n" + m.group(2), text)


def update_file_section(path: str | Path, name: str, content: str) -> bool:
    """Rewrite one marked section of a file; return whether it changed."""
    path = Path(path)
    old = path.read_text()
    new = replace_section(old, name, content)
    if new != old:
        path.write_text(new)
    return new != old


def performance_markdown(results: dict, source_file: str) -> str:
    """The README block for one `benchmarks/speed/apply.py` JSON: measured speedups next to the FLOP bound."""
    run, env = results["run"], results["environment"]
    lines = [
        f"Generated from `{source_file}` by `benchmarks/speed/apply.py` ({run['source']['name']} -> {run['target']['name']}, "
        f"models in {run['dtype']}, mapper in {run.get('mapper', {}).get('dtype', run['dtype'])}, {env['device']}, "
        f"{env['torch_threads']} torch threads, load average "
        f"{env['loadavg_start'][0]:.1f} at start; medians of {run['repeats']} interleaved repeats).",
        "",
        "| context tokens | mapper (ms) | target re-prefill (ms) | speedup | FLOP bound | fraction of bound | "
        "whole handoff to first token (ms) | handoff speedup | mapper peak memory (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['tokens']} | {row['mapper_ms']:.2f} | {row['prefill_ms']:.2f} | {row['speedup']:.1f}x | "
            f"{row['bound']:.1f}x | {100 * row['fraction_of_bound']:.0f} % | {row['handoff_ms']:.2f} | "
            f"{row['handoff_speedup']:.1f}x | {row['mapper_peak_bytes'] / 2**20:.1f} |"
        )
    return "\n".join(lines)
