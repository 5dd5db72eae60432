"""Parameters of every mapper variant at the paper's scale (Qwen3 14B -> 32B, k = 8), counted from configs by
`hf_kvmap.flops.mapper_parameters` (no weights), beside the FLOP bound of each at 1,024 and 32,768 tokens.

The windowed variants of the tiny family read a context window in every map (`ridge-w3`, `mlp-w3`) or only in the
keys of the target layers that need one (`ridge-l3w3-kn`: one of tiny-l's six layers, the one `layer_swap` shows
breaking recall; at 32B the count is given for 1, 4, 8, 11 (the same share, 1/6) and 16 such layers).

    python -m benchmarks.variants.variant_parameters --json benchmarks/results/variant_parameters.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import Qwen3Config

from hf_kvmap import MapperConfig, flops
from hf_kvmap.configuration_mapper import summarize_model_config
from hf_kvmap.reporting import environment_info, fmt_number, write_json

from ..gpu.gpu_shapes import QWEN3

K = 8
WINDOW = {"context_window": 3, "input_kinds": "both"}


def variants(num_target_layers: int) -> dict[str, dict]:
    """`{name: MapperConfig fields}` of every variant measured on the tiny family (and the per-layer one scaled)."""
    out = {
        "ridge": {},
        "mlp (h=128)": {"kind": "mlp", "mlp_hidden_size": 128},
        "ridge-w3": {"context_window": 3, "input_kinds": "both"},
        "mlp-w3 (h=128)": {"kind": "mlp", "mlp_hidden_size": 128, "context_window": 3, "input_kinds": "both"},
    }
    for count in (1, 4, 8, 11, 16):
        layers = range(
            num_target_layers // 2, num_target_layers // 2 + count
        )  # which layers does not change the count
        out[f"ridge-l3w3-kn ({count} windowed key maps)"] = {
            "key_norm": True,
            "layer_inputs": {layer: {"key": dict(WINDOW)} for layer in layers},
        }
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/variant_parameters.json"))
    args = parser.parse_args(argv)
    source, target = (summarize_model_config(Qwen3Config(**QWEN3[name])) for name in ("14B", "32B"))
    target_model = QWEN3["32B"]
    layers = target["num_hidden_layers"]
    selected = [list(range(K))] * layers
    rows = {}
    for name, fields in variants(layers).items():
        config = MapperConfig(source_summary=source, target_summary=target, source_layers=selected, **fields)
        params = flops.mapper_parameters(config)
        rows[name] = {
            "fields": fields,
            "parameters": params,
            "bound_1024": flops.flop_bound(params, target_model, 1024).ratio,
            "bound_32768": flops.flop_bound(params, target_model, 32768).ratio,
        }
    ridge = rows["ridge"]["parameters"]
    for row in rows.values():
        row["vs_ridge"] = row["parameters"] / ridge
    result = {
        "run": {
            "script": "benchmarks/variants/variant_parameters.py",
            "source": "Qwen3-14B",
            "target": "Qwen3-32B",
            "k": K,
        },
        "variants": rows,
        "environment": environment_info(),
    }
    write_json(args.json, result)
    print(markdown(result))
    return result


def markdown(result: dict) -> str:
    """The README table of `result`."""
    lines = [
        "| variant (Qwen3 14B -> 32B, k=8) | parameters | vs ridge | FLOP bound @1024 / @32768 |",
        "|---|---|---|---|",
    ]
    for name, row in result["variants"].items():
        lines.append(
            f"| {name} | {row['parameters'] / 1e9:.3f} B | {row['vs_ridge']:.2f}x | "
            f"{fmt_number(row['bound_1024'], 1)}x / {fmt_number(row['bound_32768'], 1)}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
