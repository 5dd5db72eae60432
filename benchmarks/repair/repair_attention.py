"""Where a continuation's attention goes in a part-repaired cache, and why a small repair can read worse than none.

For each perplexity item (the context is the first half, the continuation the second) and each repair fraction: the
continuation's mean negative log-likelihood and the share of its attention (mean over layers, heads and continuation
tokens) that lands on the repaired positions, read through three caches of the context: the target's own, the
mapped one, and the mapped one with those positions recomputed by the target. If the mapped keys of the selected
positions draw far more attention than the target's own keys there do, recomputing them moves that attention onto the
rest of the mapped cache, whose keys are wrong too: the repair helps where the masses agree and can hurt where they
do not. The target runs with eager attention (the only implementation that returns attention weights).

    python -m benchmarks.repair.repair_attention --mapper $WORK/mappers/0.5b-to-1.5b/ridge-k8 --fractions 0.1,0.2 \\
        --out benchmarks/results/repair_attention.json                  # real pair, code_nll, 8 items: ~10 min
    python -m benchmarks.repair.repair_attention --family tiny --fractions 0.1,1.0 --items 4 --out /tmp/ra.json

Writes JSON (run info, environment, one row per item and fraction, a summary per fraction).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import statistics
import sys

import torch

from hf_kvmap import MappedCache, MapperModel, cache_kwargs, output_cache
from hf_kvmap.repair import RepairConfig, repair_cache
from hf_kvmap.reporting import environment_info, write_json

from .repair_report import portable_command, portable_path

REAL = {"0.5b": "qwen2.5-coder-0.5b-instruct", "1.5b": "qwen2.5-coder-1.5b-instruct"}
CACHES = ("own", "mapped", "repaired")


def repaired_positions(mapped, repaired) -> torch.Tensor:
    """`(batch, seq)` booleans: the positions whose keys the repair replaced (in any layer)."""
    changed = [(r.keys != m.keys).any(-1).any(1) for m, r in zip(mapped.layers, repaired.layers)]
    return torch.stack(changed).any(0)


@torch.no_grad()
def continuation_reading(target, cache, continuation: torch.Tensor, selected: torch.Tensor) -> tuple[float, float]:
    """`(nll, mass)`: the continuation's mean negative log-likelihood after `cache` (which it extends: `continuation`
    starts with the context's held-back token), and the mean share of its attention on the `selected` positions of
    `cache` (one row)."""
    out = target(input_ids=continuation, output_attentions=True, **cache_kwargs(copy.deepcopy(cache)))
    logprobs = torch.log_softmax(out.logits.float()[:, :-1], -1).gather(-1, continuation[:, 1:].unsqueeze(-1))
    past = selected.shape[-1]
    masses = [weights[0, :, :, :past][..., selected[0]].sum(-1).mean() for weights in out.attentions]
    return -float(logprobs.mean()), float(torch.stack(masses).mean())


@torch.no_grad()
def measure_item(source, target, mapper, ids: torch.Tensor, repair: RepairConfig) -> dict:
    """One item, one repair: the nll and the attention mass on the repaired positions under each of `CACHES`."""
    split = int(ids.shape[1] * 0.5)
    context, continuation = ids[:, :split], ids[:, split - 1 :]
    source_cache = output_cache(source(input_ids=context, use_cache=True))
    mapped = MappedCache.from_source(source_cache, mapper, hold_back=1)
    repaired = repair_cache(target, copy.deepcopy(mapped), context, repair, source=source, source_cache=source_cache)
    own = output_cache(target(input_ids=context, use_cache=True))
    own.crop(-1)
    selected = repaired_positions(mapped, repaired)
    recorded = repaired.mapping_info["repair"]["recomputed"][0]
    if int(selected.sum()) != recorded:
        raise RuntimeError(f"{int(selected.sum())} positions changed, the repair recorded {recorded}")
    row = {"context": split - 1, "repaired": recorded}
    for name, cache in zip(CACHES, (own, mapped, repaired)):
        row[f"nll_{name}"], row[f"mass_{name}"] = continuation_reading(target, cache, continuation, selected)
    return row


def summary(rows: list[dict]) -> dict:
    """Per fraction: the items where the repair raises the continuation's nll over the mapped cache's ('hurts') and
    the rest ('helps'), each with its mean attention mass on the repaired positions under every cache."""
    out = {}
    for fraction in sorted({row["fraction"] for row in rows}):
        at = [row for row in rows if row["fraction"] == fraction]
        groups = {
            "hurts": [row for row in at if row["nll_repaired"] > row["nll_mapped"]],
            "helps": [row for row in at if row["nll_repaired"] <= row["nll_mapped"]],
        }
        out[str(fraction)] = {
            "items": len(at),
            **{f"nll_{name}": statistics.fmean(row[f"nll_{name}"] for row in at) for name in CACHES},
            **{
                group: {
                    "items": len(members),
                    **{
                        f"mass_{name}": statistics.fmean(row[f"mass_{name}"] for row in members) if members else None
                        for name in CACHES
                    },
                }
                for group, members in groups.items()
            },
        }
    return out


def markdown(result: dict, source: str = "benchmarks/results/repair_attention.json") -> str:
    """The docs table: per fraction, the mean nll under each cache, and the attention on the repaired positions in
    the items a repair hurts and in those it helps."""
    run = result["run"]

    def masses(group: dict) -> str:
        if not group["items"]:
            return "-"
        return " / ".join(f"{group[f'mass_{name}']:.2f}" for name in CACHES) + f" ({group['items']} items)"

    lines = [
        f"Generated from `{source}` (`{portable_command(run['command'])}`; {run['direction']}, mapper "
        f"`{portable_path(run['mapper'])}`, "
        f"`{run['strategy']}`, {run['items']} `{run['task']}` items of seed {run['seed']}, {run['dtype']}). NLL: the "
        "continuation's mean negative log-likelihood. Attention: the continuation's mean share on the repaired "
        "positions, read through the target's own / the mapped / the repaired cache.",
        "",
        "| fraction | NLL own / mapped / repaired | attention where the repair raises NLL | where it lowers NLL |",
        "|---|---|---|---|",
    ]
    for fraction, data in result["summary"].items():
        nll = " / ".join(f"{data[f'nll_{name}']:.3f}" for name in CACHES)
        lines.append(f"| {float(fraction) * 100:g} % | {nll} | {masses(data['hurts'])} | {masses(data['helps'])} |")
    return "\n".join(lines)


def _load(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    if args.family == "tiny":
        from hf_kvmap import zoo

        source_name, target_name = args.direction.split(":")
        source = zoo.load_model(source_name, dtype=dtype)
        target = zoo.load_model(target_name, dtype=dtype, attn_implementation="eager")
        mapper = MapperModel.from_pretrained(args.mapper or zoo.mapper_path(source_name, target_name), dtype=dtype)
        return source, target, mapper, zoo.load_tokenizer()
    from hf_kvmap.real import converted_path

    source_folder, target_folder = (converted_path(REAL[side], args.cache_dir) for side in args.direction.split(":"))
    source = AutoModelForCausalLM.from_pretrained(source_folder, dtype=dtype).eval()
    target = AutoModelForCausalLM.from_pretrained(target_folder, dtype=dtype, attn_implementation="eager").eval()
    mapper = MapperModel.from_pretrained(args.mapper, dtype=dtype)
    return source, target, mapper, AutoTokenizer.from_pretrained(target_folder)


def _items(args, tokenizer) -> list[torch.Tensor]:
    if args.family == "tiny":
        from hf_kvmap.zoo import corpus

        texts = [item.text for item in corpus.make_eval_set("text", args.items, seed=args.seed, n_chars=args.chars)]
    else:
        from benchmarks.real.common import MANIFEST
        from hf_kvmap.real.corpus import load_manifest
        from lab.real.tasks import real_family_tasks

        documents = load_manifest(MANIFEST)
        (task,) = real_family_tasks(tokenizer, documents, args.items, args.seed, [args.task])
        if task.task_type != "perplexity":
            raise SystemExit(f"--task {args.task} is a {task.task_type} task; give a perplexity task")
        texts = [item.text for item in task.items]
    return [torch.tensor([tokenizer(text)["input_ids"]]) for text in texts]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=("real", "tiny"), default="real")
    parser.add_argument("--direction", default=None, help="source:target (default 0.5b:1.5b, or tiny-m:tiny-l)")
    parser.add_argument("--mapper", default=None, help="mapper folder (required for --family real)")
    parser.add_argument("--task", default="code_nll", help="a real perplexity task")
    parser.add_argument("--strategy", default="draft_attention")
    parser.add_argument("--fractions", default="0.1,0.2")
    parser.add_argument("--items", type=int, default=8)
    parser.add_argument("--seed", type=int, default=4321, help="the selection set of benchmarks.repair.real_repair")
    parser.add_argument("--chars", type=int, default=160, help="--family tiny: characters per text item")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", default="benchmarks/results/repair_attention.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.direction = args.direction or ("0.5b:1.5b" if args.family == "real" else "tiny-m:tiny-l")
    if args.family == "real" and not args.mapper:
        raise SystemExit("--family real needs --mapper (a fitted mapper folder)")
    fractions = [float(f) for f in args.fractions.split(",")]
    repairs = {f: RepairConfig(args.strategy, fraction=f) for f in fractions}  # a bad strategy fails before loading
    if args.threads:
        torch.set_num_threads(args.threads)
    source, target, mapper, tokenizer = _load(args)
    rows = []
    for index, ids in enumerate(_items(args, tokenizer)):
        for fraction in fractions:
            row = {"item": index, "fraction": fraction, **measure_item(source, target, mapper, ids, repairs[fraction])}
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
            rows.append(row)
    result = {
        "run": {
            "what": "the continuation's attention on the repaired positions, under the own, mapped and repaired cache",
            "family": args.family,
            "direction": args.direction,
            "mapper": str(args.mapper or "shipped"),
            "task": args.task if args.family == "real" else "text",
            "strategy": args.strategy,
            "items": args.items,
            "seed": args.seed,
            "dtype": args.dtype,
            "command": "python -m benchmarks.repair.repair_attention "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "date": _dt.date.today().isoformat(),
        },
        "environment": environment_info(),
        "rows": rows,
        "summary": summary(rows),
    }
    write_json(args.out, result)
    print(markdown(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
