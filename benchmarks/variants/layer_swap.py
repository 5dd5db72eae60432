"""Which target layer (and whether its keys or values) breaks a task, for one mapper of the tiny family.

`hf_kvmap.diagnostics.layer_swap` on the tiny-family task set: the target reads its own cache except one layer that
comes from the mapper, for each layer in turn, then only the mapped keys (only the mapped values) of every layer. The
layer whose swap alone collapses the task is the one that gets a context window (`--layer-window`). Writes one JSON
keyed `<direction>|<task>` (earlier keys are kept, so directions accumulate in one file).

    python -m benchmarks.variants.layer_swap --source tiny-l --target tiny-s --tasks recall \\
        --json benchmarks/results/layer_swap.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hf_kvmap.reporting import environment_info, write_json


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, help="tiny-family member")
    parser.add_argument("--target", required=True, help="tiny-family member")
    parser.add_argument("--mapper", type=Path, default=None, help="mapper folder (default: the shipped one)")
    parser.add_argument("--tasks", default="recall", help="comma-separated tiny-family task names")
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/layer_swap.json"))
    args = parser.parse_args(argv)

    import torch

    from hf_kvmap import MapperModel, zoo
    from hf_kvmap.diagnostics import layer_swap
    from hf_kvmap.evaluation import HandoffEvaluation

    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = [name for name in args.tasks.split(",") if name]
    tasks = {task.name: task for task in zoo.tiny_family_tasks(args.items, args.seed)}
    unknown = sorted(set(wanted) - set(tasks))
    if unknown:
        raise SystemExit(f"layer_swap: unknown task(s) {unknown}; the tiny family has {sorted(tasks)}.")
    folder = args.mapper or zoo.mapper_path(args.source, args.target)
    mapper = MapperModel.from_pretrained(folder)
    source, target = zoo.load_model(args.source), zoo.load_model(args.target)
    handoff = HandoffEvaluation(source=source, target=target, mapper=mapper, tokenizer=zoo.load_tokenizer())
    result = json.loads(args.json.read_text()) if args.json.is_file() else {"swaps": {}}
    direction = f"{args.source}-to-{args.target}"
    for name in wanted:
        start = time.perf_counter()
        row = layer_swap(handoff, tasks[name])
        row.update(
            mapper=str(folder),
            mapper_kind=mapper.config.kind,
            n_items=args.items,
            seed=args.seed,
            seconds=time.perf_counter() - start,
        )
        result["swaps"][f"{direction}|{name}"] = row
        cells = ", ".join(f"L{layer} {score:.3f}" for layer, score in row["layers"].items())
        print(
            f"{direction} {name}: target {row['target']:.3f}, mapped {row['mapped']:.3f}, one layer mapped: {cells}; "
            f"keys only {row['keys_only']:.3f}, values only {row['values_only']:.3f}",
            flush=True,
        )
    result["environment"] = environment_info()
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
