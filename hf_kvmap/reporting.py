"""Markdown rendered from results JSON (README tables and cards are generated, never typed by hand)."""

from __future__ import annotations

import math
import re
from pathlib import Path


def fmt_number(value, digits: int = 3, style: str = "f") -> str:
    """A number for a Markdown table (`digits` decimals, or significant digits with `style="g"`); missing or
    non-finite values read `n/a`."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.{digits}{style}}"


def retention_measurable(row: dict) -> bool:
    """Whether a results row's target beats chance over its items (`hf_kvmap.metrics`: exact binomial test);
    rows without an item count are not."""
    from .metrics.retention.retention import target_beats_chance

    return target_beats_chance(row.get("target"), row.get("n_items"), row.get("chance") or 0.0)[0]


def retention_cells(row: dict) -> tuple[str, str]:
    """`(raw, floor-normalized)` retention of a results row for a table: "not measurable" where the target does not
    beat chance (whatever numbers an older results file holds)."""
    if not retention_measurable(row):
        return "not measurable", "not measurable"
    return fmt_number(row.get("retention")), fmt_number(row.get("floor_normalized_retention"))


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


def demo_markdown(results: dict, source_file: str) -> str:
    """The README block for one `hf-kvmap demo` JSON: per-task table, perplexity and latency."""
    run = results["run"]
    lines = [
        f"Generated from `{source_file}` (`{run['source']}` -> `{run['target']}`, mapper `{run['mapper']}`"
        f"{_mapper_summary(run.get('mapper_config'))}, {run['items_per_task']} items per task, seed {run['seed']}).",
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
    if results.get("latency"):
        env = results.get("environment", {})
        lines += [
            "",
            f"Latency (median, {env.get('device', 'cpu')}, {env.get('threads', '?')} threads, measured side by side):",
            "",
            "| context tokens | mapper `from_source` (ms) | target re-prefill (ms) | speedup |",
            "|---|---|---|---|",
        ]
        for row in results["latency"]:
            lines.append(
                f"| {row['tokens']} | {fmt_number(row['mapper_ms'], 2)} | {fmt_number(row['prefill_ms'], 2)} | "
                f"{fmt_number(row['speedup'], 2)}x |"
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


def environment_info() -> dict:
    """Library versions and the device, for self-describing results JSON."""
    import platform

    import torch
    import transformers

    from ._version import __version__

    info = {
        "hf_kvmap": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
    }
    return info


def json_safe(value):
    """Non-finite floats (e.g. retention against a target at chance) become null, so files are strict JSON."""
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def jsonl_objects(path: str | Path, errors: list[str], expected: str = "an object"):
    """`(line number, object)` for every JSON object line of a JSONL file; what is wrong with any other non-blank
    line is appended to `errors` as `path:line: what is wrong` (so a caller reports them all at once)."""
    import json

    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                errors.append(
                    f"{path}:{number}: not UTF-8 text (byte {err.start}: {err.reason}); save the file as UTF-8."
                )
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                errors.append(f"{path}:{number}: not valid JSON ({err.msg}).")
                continue
            if not isinstance(row, dict):
                errors.append(f"{path}:{number}: a {type(row).__name__}, expected {expected}.")
                continue
            yield number, row


def write_json(path: str | Path, data: dict) -> None:
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(data), indent=2, allow_nan=False) + "\n")


def performance_markdown(results: dict, source_file: str) -> str:
    """The README block for one `benchmarks/apply.py` JSON: measured speedups next to the FLOP bound."""
    run, env = results["run"], results["environment"]
    lines = [
        f"Generated from `{source_file}` by `benchmarks/apply.py` ({run['source']['name']} -> {run['target']['name']}, "
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
