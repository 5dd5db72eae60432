"""The curve reached: retention of every mapper variant vs its size and its speed, per direction of the tiny family.

Reads one comparison of `benchmarks/variants/mapper_variants.py` (every variant's mapped scores on the choice items and its
speed vs the target's re-prefill, timed side by side) and the `hf-kvmap eval` JSONs of the variants scored on held-out
items (named `<variant>_<direction>.json`), and writes, per direction and variant:

- the floor-normalized retention on each task the target does (the choice rule's tasks) and their mean, on the choice
  items and, where measured, on the held-out items;
- the parameters of the mapper at the tiny family's shape and at Qwen3 14B -> 32B, k = 8, both counted from its config
  fields by `hf_kvmap.flops.mapper_parameters` (the tiny count is checked against the one the comparison recorded);
- its speedup over the target's re-prefill at each timed length;
- the frontier: the variants no other variant beats on both retention and size (resp. speed).

A fine-tune changes a mapper's weights, never its shape, so every objective of one design shares its design's fields.

    python -m benchmarks.variants.retention_curve --comparison benchmarks/results/mapper_variants_longer.json \\
        --held-out benchmarks/results/held_out/*.json benchmarks/results/held_out_attention/*.json benchmarks/results/held_out_longer/*.json \\
        --json benchmarks/results/retention_curve.json --plot benchmarks/results/retention_curve.png
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from hf_kvmap import MapperConfig, flops, zoo
from hf_kvmap.configuration_mapper import summarize_model_config
from hf_kvmap.reporting import environment_info, fmt_number, write_json

from ..gpu.gpu_shapes import QWEN3
from .mapper_variants import choose

K = 8
WINDOW = {"context_window": 3, "input_kinds": "both"}
#: the design of each variant (config fields; `{layer}` is the one windowed key map), by the name's stem
DESIGNS = {
    "ridge": {},
    "mlp": {"kind": "mlp", "mlp_hidden_size": 128},
    "ridge-w3": dict(WINDOW),
    "mlp-w3": {"kind": "mlp", "mlp_hidden_size": 128, **WINDOW},
    "ridge-lNw3-kn": {"key_norm": True, "layer_inputs": "one windowed key map"},
}
#: suffixes that name a training choice (epochs, objective), not a shape
TRAINING_SUFFIX = re.compile(r"(-e\d+|-kl|-attn\d*|-attn-kl)+$")


def design_of(variant: str) -> tuple[str, int | None]:
    """`(design, windowed layer)` of a variant name, e.g. `ridge-l3w3-kn-attn-kl` -> `("ridge-lNw3-kn", 3)`."""
    stem = TRAINING_SUFFIX.sub("", variant)
    match = re.fullmatch(r"ridge-l(\d+)w3-kn", stem)
    if match:
        return "ridge-lNw3-kn", int(match.group(1))
    if stem not in DESIGNS:
        raise SystemExit(
            f"retention_curve: no design known for variant {variant!r} (stem {stem!r}); add it to DESIGNS."
        )
    return stem, None


def design_fields(design: str, layer: int) -> dict:
    fields = dict(DESIGNS[design])
    if fields.get("layer_inputs") == "one windowed key map":
        fields["layer_inputs"] = {layer: {"key": dict(WINDOW)}}
    return fields


def count(design: str, layer: int | None, source: dict, target: dict, k: int | None) -> int:
    """Parameters of one design between two model config summaries (`k` source layers per map; None: all)."""
    layers = target["num_hidden_layers"]
    chosen = list(range(k if k is not None else source["num_hidden_layers"]))
    windowed = layer if layer is not None else layers // 2
    config = MapperConfig(
        source_summary=source,
        target_summary=target,
        source_layers=[chosen] * layers,
        **design_fields(design, windowed),
    )
    return flops.mapper_parameters(config)


def tiny_summary(name: str) -> dict:
    from transformers import AutoConfig

    return summarize_model_config(AutoConfig.from_pretrained(zoo.model_path(name)))


def retention(tasks: dict, names: list[str]) -> dict:
    """Floor-normalized retention per task of `names` and their mean (None where a task is missing)."""
    out = {}
    for name in names:
        row = tasks.get(name)
        if row is None or row.get("mapped") is None:
            out[name] = None
            continue
        chance = row.get("chance") or 0.0
        out[name] = (row["mapped"] - chance) / (row["target"] - chance)
    values = [v for v in out.values() if v is not None]
    return {"tasks": out, "mean": sum(values) / len(values) if len(values) == len(names) and values else None}


def frontier(points: list[tuple[str, float, float]], larger_is_better: bool) -> list[str]:
    """Names of the points `(name, x, retention)` that no other point beats on both axes (x: size, smaller better;
    or speed, larger better)."""
    kept = []
    for name, x, y in points:
        dominated = any(
            (x2 >= x if larger_is_better else x2 <= x) and y2 >= y and (x2 != x or y2 != y)
            for other, x2, y2 in points
            if other != name
        )
        if not dominated:
            kept.append(name)
    return kept


def build(comparison: dict, held_out: dict[tuple[str, str], dict], qwen: tuple[dict, dict]) -> dict:
    directions = {}
    for direction, variants in comparison["directions"].items():
        source_name, target_name = direction.split("-to-")
        source, target = tiny_summary(source_name), tiny_summary(target_name)
        tasks = choose(variants)["tasks"]
        rows = {}
        for name, row in variants.items():
            design, layer = design_of(name)
            tiny = count(design, layer, source, target, None)
            recorded = row.get("run", {}).get("parameters")
            if recorded is not None and recorded != tiny:
                raise SystemExit(
                    f"retention_curve: {direction}/{name}: the comparison recorded {recorded:,} parameters, its "
                    f"design {design!r} counts {tiny:,}; the design table is wrong for this variant."
                )
            evaluation = held_out.get((name, direction))
            rows[name] = {
                "design": design,
                "windowed_layer": layer,
                "parameters_tiny": tiny,
                "parameters_qwen3_14b_32b_k8": count(design, layer, *qwen, K),
                "speedup": {str(r["tokens"]): r["speedup"] for r in row.get("latency", [])},
                "choice_items": retention(row["tasks"], tasks),
                "held_out": None
                if evaluation is None
                else {
                    **retention(evaluation["tasks"], tasks),
                    "items_per_task": evaluation["run"]["items_per_task"],
                    "seed": evaluation["run"]["seed"],
                },
            }
        points = [(n, r["parameters_qwen3_14b_32b_k8"], r["choice_items"]["mean"]) for n, r in rows.items()]
        speed = [(n, r["speedup"].get("1024"), r["choice_items"]["mean"]) for n, r in rows.items()]
        directions[direction] = {
            "tasks": tasks,
            "variants": rows,
            "frontier_size": frontier([p for p in points if p[2] is not None], larger_is_better=False),
            "frontier_speed_1024": frontier([p for p in speed if None not in p[1:]], larger_is_better=True),
        }
    return directions


def markdown(result: dict) -> str:
    lines = []
    for direction, data in result["directions"].items():
        lines.append(f"**{direction}** (tasks the target does: {', '.join(data['tasks']) or 'none'})\n")
        lines.append(
            "| variant | parameters (tiny) | parameters (Qwen3 14B -> 32B, k=8) | speedup @1024 | retention, choice "
            "items | retention, held out | frontier (size / speed) |"
        )
        lines.append("|---|---|---|---|---|---|---|")
        for name, row in data["variants"].items():
            held = row["held_out"]
            marks = ("size" if name in data["frontier_size"] else "") + (
                " / speed" if name in data["frontier_speed_1024"] else ""
            )
            speedup = row["speedup"].get("1024")
            lines.append(
                f"| {name} | {row['parameters_tiny']:,} | {row['parameters_qwen3_14b_32b_k8'] / 1e9:.3f} B | "
                f"{fmt_number(speedup, 1) + 'x' if speedup else 'n/a'} | "
                f"{fmt_number(row['choice_items']['mean'])} | {fmt_number(held['mean']) if held else 'n/a'} | "
                f"{marks.strip(' /') if marks.strip() else ''} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    directions = list(result["directions"])
    fig, axes = plt.subplots(2, len(directions), figsize=(4.4 * len(directions), 7.4), squeeze=False)
    for column, direction in enumerate(directions):
        rows = result["directions"][direction]["variants"]
        for row_index, (axis_key, label, log) in enumerate(
            (
                ("parameters_qwen3_14b_32b_k8", "parameters at Qwen3 14B -> 32B, k=8", True),
                ("speedup_1024", "speedup over re-prefill @1024 tokens (tiny)", False),
            )
        ):
            ax = axes[row_index][column]
            tasks = result["directions"][direction]["tasks"]
            top = 1.0
            for name, row in rows.items():
                x = row["speedup"].get("1024") if axis_key == "speedup_1024" else row[axis_key]
                if x is None:
                    continue
                for slot, task in enumerate(tasks):
                    y = row["choice_items"]["tasks"][task]
                    if y is None:
                        continue
                    color = f"C{slot}"
                    ax.scatter([x], [y], marker="o", color=color, label=f"{task} (choice items)")
                    held = (row["held_out"] or {}).get("tasks", {}).get(task)
                    top = max(top, y, held or 0.0)
                    if held is not None:
                        ax.scatter([x], [held], marker="x", color=color, label=f"{task} (held out)")
                    if slot == 0:
                        ax.annotate(name, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
            handles, labels = ax.get_legend_handles_labels()
            unique = dict(zip(labels, handles))
            ax.legend(unique.values(), unique.keys(), fontsize=6, loc="lower right")
            if log:
                from matplotlib.ticker import NullFormatter

                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(NullFormatter())
            ax.axhline(0.9, color="grey", linestyle=":", linewidth=0.8)
            ax.set_xlabel(label, fontsize=8)
            ax.set_ylim(-0.05, top + 0.05)
            if column == 0:
                ax.set_ylabel("floor-normalized retention per task", fontsize=8)
            ax.set_title(direction, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--comparison", type=Path, required=True, help="a JSON of benchmarks/variants/mapper_variants.py"
    )
    parser.add_argument("--held-out", type=Path, nargs="*", default=[], help="<variant>_<direction>.json eval files")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/retention_curve.json"))
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    from transformers import Qwen3Config

    comparison = json.loads(args.comparison.read_text())
    held_out = {}
    for path in args.held_out:
        variant, _, direction = path.stem.partition("_")
        if not direction:
            raise SystemExit(f"retention_curve: {path} is not named <variant>_<direction>.json.")
        held_out[(variant, direction)] = json.loads(path.read_text())
    qwen = tuple(summarize_model_config(Qwen3Config(**QWEN3[name])) for name in ("14B", "32B"))
    result = {
        "run": {
            "script": "benchmarks/variants/retention_curve.py",
            "comparison": args.comparison.as_posix(),
            "held_out": [path.as_posix() for path in args.held_out],
            "retention": "mean floor-normalized retention over the tasks the target does (the choice rule's)",
            "large_shape": {"source": "Qwen3-14B", "target": "Qwen3-32B", "k": K},
        },
        "directions": build(comparison, held_out, qwen),
        "environment": environment_info(),
    }
    write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
    text = markdown(result)
    print(text)
    return result


if __name__ == "__main__":
    main()
