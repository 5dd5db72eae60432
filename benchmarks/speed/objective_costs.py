"""What one fine-tune step of each objective costs: counted at the paper's scale (Qwen3 14B -> 32B, k = 8) by
`hf_kvmap.flops.finetune_step_cost`, and timed side by side on the tiny family.

- Counted: FLOPs and memory of one step (batch of 8 sequences cut in half) of the per-layer attention objective and
  of the end-to-end KL objective, for the per-position ridge and for `ridge-l3w3-kn` with 11 windowed key maps (the
  tiny family's share, 1 layer in 6), at 1,024 and 4,096 tokens.
- Timed (`--mapper`): one step of each (loss, backward; streaming, i.e. the reference forwards included) on the
  same batches and cuts, interleaved, median of `--repeats`.

    python -m benchmarks.speed.objective_costs --mapper hf_kvmap/zoo/mappers/tiny-m-to-tiny-l --threads 1 \\
        --json benchmarks/results/objective_costs.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import Qwen3Config

from hf_kvmap import MapperConfig, flops
from hf_kvmap.configuration_mapper import summarize_model_config
from hf_kvmap.reporting import environment_info, write_json

from ..gpu.gpu_shapes import QWEN3

K = 8
BATCH = 8


def counted() -> dict:
    """`{variant: {tokens: {objective: finetune_step_cost}}}` at Qwen3 14B -> 32B."""
    source, target = (summarize_model_config(Qwen3Config(**QWEN3[name])) for name in ("14B", "32B"))
    layers = target["num_hidden_layers"]
    windowed = {layer: {"key": {"context_window": 3, "input_kinds": "both"}} for layer in range(11)}
    out = {}
    for name, fields in (("ridge", {}), ("ridge-l3w3-kn (11 windowed key maps)", {"key_norm": True,
                                                                             "layer_inputs": windowed})):  # fmt: skip
        config = MapperConfig(source_summary=source, target_summary=target, source_layers=[list(range(K))] * layers,
                              **fields)  # fmt: skip
        params = flops.mapper_parameters(config)
        out[name] = {"mapper_parameters": params, "tokens": {}}
        for tokens in (1024, 4096):
            costs = {
                objective: flops.finetune_step_cost(
                    objective, QWEN3["14B"], QWEN3["32B"], params, batch=BATCH, tokens=tokens, prefix=tokens // 2
                )
                for objective in flops.FINETUNE_OBJECTIVES
            }
            costs["kl_over_attention_flops"] = costs["kl"]["total_flops"] / costs["attention"]["total_flops"]
            costs["kl_over_attention_flops_cached_references"] = (
                costs["kl"]["total_flops_cached_references"] / costs["attention"]["total_flops_cached_references"]
            )
            costs["kl_over_attention_memory"] = (
                costs["kl"]["total_memory_bytes"] / costs["attention"]["total_memory_bytes"]
            )
            out[name]["tokens"][str(tokens)] = costs
    return out


def timed(mapper_path: Path, repeats: int, sequences: int, length: int) -> dict:
    """Median seconds of one step of each objective on tiny-family batches (interleaved)."""
    from hf_kvmap import MapperModel, output_cache, zoo
    from hf_kvmap.objectives import attention_errors, mapped_kl, target_reads

    mapper = MapperModel.from_pretrained(mapper_path).float()
    source = zoo.load_model(mapper.config.source_model_id.split(":")[-1])
    target = zoo.load_model(mapper.config.target_model_id.split(":")[-1])
    for model in (source, target):
        model.requires_grad_(False)
    tokenizer = zoo.load_tokenizer(padding_side="left")
    rows = torch.cat(list(zoo.context_batches(tokenizer, sequences, length, batch_size=BATCH)))
    generator = torch.Generator().manual_seed(0)

    def attention_step(index, split):
        with torch.no_grad():  # what the fine-tune reads of each row (computed once there, per step here)
            source_cache = output_cache(source.base_model(input_ids=rows[index], use_cache=True))
            source_kv = [(layer.keys.float(), layer.values.float()) for layer in source_cache.layers]
            reads = target_reads(target, rows[index])
        attention_errors(mapper, source_kv, reads, split, backward=1 / len(reads.keys))  # as it trains

    def kl_step(index, split):
        mapped_kl(mapper, source, target, rows[index], split).backward()

    seconds = {"attention": [], "kl": []}
    for _ in range(repeats):
        index = torch.randint(len(rows), (BATCH,), generator=generator)
        split = int(torch.randint(32, length - 32 + 1, (), generator=generator))
        for name, step in (("attention", attention_step), ("kl", kl_step)):
            mapper.zero_grad(set_to_none=True)
            started = time.perf_counter()
            step(index, split)
            seconds[name].append(time.perf_counter() - started)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    return {
        "mapper": str(mapper_path),
        "batch": BATCH,
        "sequence_length": length,
        "repeats": repeats,
        "median_seconds": median,
        "kl_over_attention": median["kl"] / median["attention"],
        "threads": torch.get_num_threads(),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/objective_costs.json"))
    parser.add_argument("--mapper", type=Path, default=None, help="a tiny-family mapper folder to time steps with")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sequences", type=int, default=32, help="tiny-family sequences to draw batches from")
    parser.add_argument("--length", type=int, default=320, help="tokens per sequence (as the shipped fine-tunes)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {
        "run": {
            "script": "benchmarks/speed/objective_costs.py",
            "source": "Qwen3-14B",
            "target": "Qwen3-32B",
            "k": K,
            "batch": BATCH,
            "prefix": "half the tokens",
        },  # fmt: skip
        "counted": counted(),
        "timed": timed(args.mapper, args.repeats, args.sequences, args.length) if args.mapper else None,
        "environment": environment_info(),
    }
    write_json(args.json, result)
    for name, row in result["counted"].items():
        for tokens, costs in row["tokens"].items():
            print(
                f"{name} @{tokens}: attention {costs['attention']['total_flops'] / 1e15:.1f} PFLOP "
                f"{costs['attention']['total_memory_bytes'] / 2**30:.1f} GiB; kl {costs['kl']['total_flops'] / 1e15:.1f} "
                f"PFLOP {costs['kl']['total_memory_bytes'] / 2**30:.1f} GiB "
                f"(kl/attention {costs['kl_over_attention_flops']:.2f}x FLOPs, "
                f"{costs['kl_over_attention_flops_cached_references']:.1f}x with cached references, "
                f"{costs['kl_over_attention_memory']:.1f}x memory)"
            )
    if result["timed"]:
        print(f"tiny family, one step: {result['timed']['median_seconds']} (kl/attention "
              f"{result['timed']['kl_over_attention']:.1f}x)")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
