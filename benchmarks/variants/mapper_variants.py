"""Compare mapper variants (ridge, MLP, context window, ...) fitted for the same directions of the tiny family.

Each variant is a folder of mapper folders named `<source>-to-<target>`, each holding the `evaluation.json` that
`examples/fit_tiny_family_mappers.py` writes (the same tasks, items and seed for every variant). This script reads
them, writes one JSON (`--json`) with every task's mapped score, retention, perplexity and attention cosine per
direction and variant, a Markdown table (`--markdown`) and a bar chart (`--plot`), and copies each evaluation into
`--keep` so the numbers stay traceable after the candidate mappers are deleted. Nothing is fitted here. With
`--latency-tokens`, every variant's mapper (the folder beside its evaluation.json) is also timed against the target's
re-prefill (`hf_kvmap.evaluation.measure_latency`, interleaved in this run), since a better mapper that is slower
than re-reading the context defeats its purpose.

    python -m benchmarks.variants.mapper_variants \\
        --variant ridge=hf_kvmap/zoo/mappers --variant mlp=/tmp/mlp-mappers \\
        --json benchmarks/results/mapper_variants.json --plot benchmarks/results/mapper_variants.png
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from hf_kvmap.metrics.retention.retention import target_beats_chance
from hf_kvmap.reporting import environment_info, fmt_number, write_json


def variant_folders(specs: list[str]) -> dict[str, Path]:
    """`{variant: folder}` from `NAME=FOLDER` specs."""
    folders = {}
    for spec in specs:
        if "=" not in spec:
            raise SystemExit(f"--variant takes NAME=FOLDER, got {spec!r}.")
        name, folder = spec.split("=", 1)
        folders[name] = Path(folder)
    return folders


def load_variants(folders: dict[str, Path]) -> dict[str, dict[str, Path]]:
    """`{variant: {direction: path of its evaluation.json}}`; a folder without any is refused."""
    variants = {}
    for name, folder in folders.items():
        found = {path.parent.name: path for path in sorted(folder.glob("*-to-*/evaluation.json"))}
        if not found:
            raise SystemExit(f"--variant {name}: no <source>-to-<target>/evaluation.json under {folder}.")
        variants[name] = found
    return variants


def summarize(evaluation: dict) -> dict:
    """The numbers compared: per task source/target/mapped and retention, perplexity, diagnostics, fit settings."""
    tasks = {
        name: {
            key: row.get(key)
            for key in ("source", "target", "mapped", "chance", "retention", "floor_normalized_retention", "n_items")
        }
        for name, row in evaluation.get("tasks", {}).items()
    }
    perplexity = {
        name: {key: row.get(key) for key in ("source", "target", "mapped")}
        for name, row in evaluation.get("perplexity", {}).items()
    }
    return {
        "tasks": tasks,
        "perplexity": perplexity,
        "attention_cosine": evaluation.get("diagnostics_summary", {}).get("mean_attention_cosine"),
        "min_layer_attention_cosine": evaluation.get("diagnostics_summary", {}).get("min_layer_attention_cosine"),
        "run": evaluation.get("run", {}),
        "latency": [],
    }


def measure(variants: dict[str, dict[str, dict]], folders: dict[str, Path], direction: str, tokens, repeats: int):
    """`{variant: (latency rows, parameters)}` for one direction: each variant's mapper vs the target's re-prefill."""
    import torch

    from hf_kvmap import MapperModel, flops, zoo
    from hf_kvmap.evaluation import HandoffEvaluation, measure_latency

    source_name, target_name = direction.split("-to-")
    source, target = zoo.load_model(source_name), zoo.load_model(target_name)
    rows = {}
    for name in variants:
        mapper = MapperModel.from_pretrained(folders[name] / direction)
        handoff = HandoffEvaluation(source=source, target=target, mapper=mapper, tokenizer=None)
        with torch.no_grad():
            rows[name] = (measure_latency(handoff, tokens, repeats=repeats), flops.mapper_parameters(mapper.config))
    return rows


def target_does(row: dict) -> bool:
    """A task decides the choice only if the target alone beats chance over its items (the test retention is
    reported under, `hf_kvmap.metrics`); on the others every variant measures noise."""
    return target_beats_chance(row.get("target"), row.get("n_items"), row.get("chance") or 0.0)[0]


def choose(variants: dict[str, dict]) -> dict:
    """The variant to ship for one direction, by a fixed rule: among the variants faster than the target's own
    re-prefill at every timed length (when timed), the highest mean floor-normalized retention over the tasks the
    target can do (`target_does`); ties, or no such task, go to the lower mapped perplexity. Returns
    `{"variant", "rule", "tasks", "scores", "excluded"}`."""
    excluded = sorted(name for name, row in variants.items() if any(r["speedup"] < 1 for r in row.get("latency", [])))
    if len(excluded) < len(variants):
        variants = {name: row for name, row in variants.items() if name not in excluded}
    first = next(iter(variants.values()))
    tasks = [name for name, row in first["tasks"].items() if target_does(row)]

    def perplexity(row):
        values = [r["mapped"] for r in row["perplexity"].values() if r.get("mapped") is not None]
        return sum(values) / len(values) if values else float("inf")

    scores = {}
    for name, row in variants.items():
        retained = [
            (row["tasks"][task]["mapped"] - (row["tasks"][task].get("chance") or 0.0))
            / (row["tasks"][task]["target"] - (row["tasks"][task].get("chance") or 0.0))
            for task in tasks
        ]
        scores[name] = {
            "mean_floor_normalized_retention": sum(retained) / len(retained) if retained else None,
            "mean_mapped_perplexity": perplexity(row),
        }
    best = max(
        variants,
        key=lambda name: (
            round(scores[name]["mean_floor_normalized_retention"] or 0.0, 6),
            -scores[name]["mean_mapped_perplexity"],
        ),
    )
    return {
        "variant": best,
        "rule": "faster than re-prefill at every timed length; then mean floor-normalized retention over the tasks "
        "the target does (beats chance over the items: one-sided exact binomial test at 5 %); then lower mapped "
        "perplexity",
        "excluded": excluded,
        "tasks": tasks,
        "scores": scores,
    }


def markdown(table: dict, choices: dict | None = None) -> str:
    """One row per direction and variant: mapped score of every task (target alone in the header row)."""
    lines = []
    for direction, variants in table.items():
        first = next(iter(variants.values()))
        tasks = list(first["tasks"])
        texts = list(first["perplexity"])
        header = [f"{task} (target {fmt_number(first['tasks'][task]['target'])})" for task in tasks]
        header += [f"ppl {text} (target {fmt_number(first['perplexity'][text]['target'])})" for text in texts]
        lines.append(
            f"**{direction}** (mapped scores; source alone: "
            + ", ".join(f"{task} {fmt_number(first['tasks'][task]['source'])}" for task in tasks)
            + ")\n"
        )
        latency_tokens = sorted({r["tokens"] for row in variants.values() for r in row.get("latency", [])})
        header += [f"speedup @{n}" for n in latency_tokens] + ["parameters", "fit (s)"]
        lines.append("| variant | " + " | ".join(header) + " | attention cosine |")
        lines.append("|---" * (len(header) + 2) + "|")
        chosen = (choices or {}).get(direction, {}).get("variant")
        for name, row in variants.items():
            cells = [fmt_number(row["tasks"][task]["mapped"]) for task in tasks]
            cells += [fmt_number(row["perplexity"][text]["mapped"]) for text in texts]
            speedups = {r["tokens"]: r["speedup"] for r in row.get("latency", [])}
            cells += [f"{fmt_number(speedups[n], 1)}x" if n in speedups else "n/a" for n in latency_tokens]
            parameters = row.get("run", {}).get("parameters")
            cells += [f"{parameters:,}" if parameters else "n/a", fmt_number(row.get("run", {}).get("fit_seconds"), 0)]
            label = f"**{name}** (chosen)" if name == chosen else name
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {fmt_number(row['attention_cosine'])} |")
        lines.append("")
    return "\n".join(lines)


def held_out_markdown(paths: list[Path]) -> str:
    """The chosen variants scored on items not used to choose them: one row per `hf-kvmap eval` JSON (its direction,
    seed, and per task the mapped score, the target's and the floor-normalized retention)."""
    lines = [
        "| direction (mapper) | items, seed | task: mapped / target alone (floor-normalized retention) | ppl mapped / target |"
    ]
    lines.append("|---|---|---|---|")
    for path in paths:
        result = json.loads(path.read_text())
        run = result["run"]
        tasks = "; ".join(
            f"{name} {fmt_number(row['mapped'])} / {fmt_number(row['target'])} "
            f"({fmt_number(row['floor_normalized_retention']) if row.get('retention_measurable', True) else 'not measurable'})"
            for name, row in result["tasks"].items()
        )
        ppl = "; ".join(
            f"{fmt_number(r['mapped'])} / {fmt_number(r['target'])}" for r in result["perplexity"].values()
        )
        name = path.stem.split("_")[0]
        lines.append(
            f"| {run['source']} -> {run['target']} ({name}) | {run['items_per_task']}, {run['seed']} | {tasks} | {ppl} |"
        )
    return "\n".join(lines)


def held_out_section(paths: list[Path]) -> str:
    """The README section of [`held_out_markdown`], naming its sources."""
    sources = ", ".join(f"`{path.as_posix()}`" for path in paths)
    return f"Generated from {sources} (`hf-kvmap eval`).\n\n{held_out_markdown(paths)}"


def plot(table: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    directions = list(table)
    fig, axes = plt.subplots(1, len(directions), figsize=(4.2 * len(directions), 3.6), squeeze=False)
    for ax, direction in zip(axes[0], directions):
        variants = table[direction]
        first = next(iter(variants.values()))
        tasks = list(first["tasks"])
        width = 0.8 / (len(variants) + 1)
        for slot, name in enumerate(["target alone", *variants]):
            values = [
                (first["tasks"][t]["target"] if name == "target alone" else variants[name]["tasks"][t]["mapped"]) or 0
                for t in tasks
            ]
            ax.bar([i + slot * width for i in range(len(tasks))], values, width, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))], tasks, rotation=30)
        ax.set_ylim(0, 1.05)
        ax.set_title(direction)
    axes[0][0].set_ylabel("accuracy (handoff; target alone for reference)")
    axes[0][-1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", default=[], help="NAME=FOLDER of <src>-to-<tgt> mappers")
    parser.add_argument(
        "--rechoose",
        action="store_true",
        help="re-apply the choice rule to the comparison already in --json (nothing read, fitted or timed anew)",
    )
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/mapper_variants.json"))
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    parser.add_argument("--plot", type=Path, default=None, help="bar chart (PNG, needs matplotlib)")
    parser.add_argument(
        "--latency-tokens", default="", help="also time each mapper vs re-prefill at these lengths (e.g. 256,1024)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per length (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for the timing")
    parser.add_argument("--keep", type=Path, default=None, help="copy each evaluation.json to KEEP/<variant>/")
    parser.add_argument(
        "--reuse",
        type=Path,
        default=None,
        help="a previous JSON of this script: its variants not given by --variant join the table as they were "
        "measured then (their latency included; their mapper folders need not exist any more)",
    )
    args = parser.parse_args(argv)
    if args.rechoose:
        result = json.loads(args.json.read_text())
        result["choice"] = {direction: choose(variants) for direction, variants in result["directions"].items()}
        write_json(args.json, result)
        return result
    if not args.variant:
        raise SystemExit("mapper_variants: pass --variant NAME=FOLDER (at least one), or --rechoose.")

    folders = variant_folders(args.variant)
    variants = load_variants(folders)
    directions = sorted({d for found in variants.values() for d in found})
    table = {
        direction: {
            name: summarize(json.loads(found[direction].read_text()))
            for name, found in variants.items()
            if direction in found
        }
        for direction in directions
    }
    tokens = [int(n) for n in args.latency_tokens.split(",") if n]
    reused = {}
    if args.reuse:
        previous = json.loads(args.reuse.read_text())
        for direction, rows in previous["directions"].items():
            for name, row in rows.items():
                if name not in folders:
                    reused.setdefault(direction, {})[name] = row
    if tokens:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        for direction, rows in table.items():
            for name, (latency, parameters) in measure(rows, folders, direction, tokens, args.repeats).items():
                rows[name]["latency"] = latency
                rows[name]["run"].setdefault("parameters", parameters)
    for direction, rows in reused.items():
        table.setdefault(direction, {})
        table[direction] = {**rows, **table[direction]}
    if args.keep:
        for name, found in variants.items():
            for direction, path in found.items():
                destination = args.keep / name / f"{direction}.json"
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, destination)
    choices = {direction: choose(variants) for direction, variants in table.items()}
    result = {
        "run": {
            "script": "benchmarks/variants/mapper_variants.py",
            "variants": args.variant,
            "reused": {direction: sorted(rows) for direction, rows in reused.items()},
            "reused_from": str(args.reuse) if args.reuse else None,
            "latency_tokens": tokens,
            "repeats": args.repeats,
        },
        "directions": table,
        "choice": choices,
        "environment": environment_info(),
    }
    write_json(args.json, result)
    text = markdown(table, choices)
    if args.markdown:
        args.markdown.write_text(text + "\n", encoding="utf-8")
    if args.plot:
        plot(table, args.plot)
    print(text)
    return result


if __name__ == "__main__":
    main()
