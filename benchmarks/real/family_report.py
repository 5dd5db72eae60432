"""`family report`: the real-family results JSON, plot and cards, and the markdown of its docs page."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .common import (
    CARDS,
    CONFIGS,
    DIRECTIONS,
    FAMILY_PLOT,
    FAMILY_RESULTS,
    LARGE,
    SHORT,
    SMALL,
    VARIANTS,
    _fmt,
    assemble,
    card_results,
    direction_name,
    mapper_dir,
    model_folder,
    scores_path,
    weightless_mapper,
    write_json,
)

PAPER_TABLE = (
    "| pair (k) | avg | avg floor-norm | ARC-C | HellaSwag | WinoGrande | MMLU | GSM8K |",
    "|---|---|---|---|---|---|---|---|",
    "| Qwen3 14B->32B (8) | 97.6 | 96.3 | 101.0 | 97.6 | 98.5 | 95.0 | 95.6 |",
    "| Qwen3 8B->32B (12) | 87.5 | 80.7 | 94.0 | 95.2 | 91.0 | 88.5 | 68.8 |",
    "| Llama 3.1 8B->70B (20) | 72.8 | 62.9 | 90.9 | 94.4 | 87.1 | 73.3 | 18.2 |",
    "| Ministral 3B->8B (all) | 76.2 | 65.9 | 90.6 | 93.3 | 91.3 | 69.4 | 36.6 |",
    "| Ministral 3B->14B (20) | 44.2 | 14.7 | 43.6 | 68.0 | 74.0 | 32.0 | 3.2 |",
    "| Ministral 8B->14B (12) | 41.6 | 11.1 | 40.7 | 58.7 | 74.2 | 32.7 | 1.6 |",
)


def report_markdown(report: dict) -> str:
    run = report["run"]
    lines = [
        f"Written by `python -m benchmarks.real family report` from `benchmarks/results/real_family.json`. "
        f"Calibration: {run['calibration']['sequences']} sequences x {run['calibration']['seq_len']} tokens of the "
        f"pinned real corpus (code, prose and chat-formatted prose), stride {run['calibration']['stride']}: "
        f"{run['calibration']['positions']} positions (the paper: 500 x 1,024 at stride 4, about 128K). "
        f"Items per task: {run['items_per_task']} (seed {run['seed']}). Models and mappers in {' and '.join(run.get('dtype', ['bfloat16']))}.",
        "",
        "Every mapper in these tables comes from one command (the weights stay outside the repository; sequence `i` "
        "does not depend on `--sequences`, so this gives the same statistics as the longer run that stopped here):",
        "",
        "```bash",
        f"hf-kvmap obtain {SMALL} && hf-kvmap obtain {LARGE} && python -m benchmarks.real family "
        f"--dtype {run['calibration'].get('dtype', 'bfloat16')} calibrate --out "
        f"$WORK/calib --sequences {run['calibration']['sequences']} --seq-len {run['calibration']['seq_len']} "
        f"--chunk {run['calibration']['chunk']} --stride {run['calibration']['stride']} && "
        f"python -m benchmarks.real family fit --work $WORK --ridge-lambda {run['ridge_lambda']}"
        "   # -> $WORK/mappers/<direction>/<variant>/",
        "```",
        "",
    ]
    for direction, entry in report["directions"].items():
        lines += [f"**{direction}**", ""]
        lines += ["| task | type | source alone | target alone | " + " | ".join(entry["variants"]) + " |"]
        lines += ["|---|---|---|---|" + "---|" * len(entry["variants"])]
        names = sorted({n for v in entry["variants"].values() for n in [*v["tasks"], *v["perplexity"]]})
        for name in names:
            first = next(v for v in entry["variants"].values() if name in v["tasks"] or name in v["perplexity"])
            row = first["tasks"].get(name) or first["perplexity"][name]
            kind = row.get("task_type", "perplexity")
            cells = []
            for variant in entry["variants"].values():
                cell = variant["tasks"].get(name) or variant["perplexity"].get(name)
                if cell is None:
                    cells.append("")
                elif kind == "perplexity":
                    cells.append(_fmt(cell["mapped"]))
                else:
                    floor = cell.get("floor_normalized_retention")
                    cells.append(f"{_fmt(cell['mapped'])} (floor-norm. {_fmt(floor)})")
            lines.append(
                f"| {name} | {kind} | {_fmt(row['source'])} | {_fmt(row['target'])} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    if report.get("self_maps"):
        lines += ["Ridge self-maps (each model's cache mapped onto itself; a sanity bound of the fit):", ""]
        lines += ["| model | task | alone | self-mapped |", "|---|---|---|---|"]
        for name, entry in report["self_maps"].items():
            for task, row in {**entry["tasks"], **entry["perplexity"]}.items():
                lines.append(f"| {name} | {task} | {_fmt(row['target'])} | {_fmt(row['mapped'])} |")
        lines.append("")
    if report.get("analysis"):
        contexts = ", ".join(next(iter(report["analysis"].values())).get("contexts", []))
        lines += [
            f"Held-out fit quality (contexts of the {contexts} items; keys in content space), mean over target layers:",
            "",
            "| mapper | key R^2 | value R^2 | attention cosine (mean / min layer) |",
            "|---|---|---|---|",
        ]
        for key, entry in report["analysis"].items():
            k = sum(entry["key_r2"]) / len(entry["key_r2"])
            v = sum(entry["value_r2"]) / len(entry["value_r2"])
            att = entry.get("attention_summary")
            cos = (
                f"{_fmt(att['mean_attention_cosine'])} / {_fmt(att['min_layer_attention_cosine'])}"
                if att
                else "not run"
            )
            lines.append(f"| {key} | {_fmt(k)} | {_fmt(v)} | {cos} |")
        lines.append("")
    if report.get("latency"):
        lines += [
            f"Mapper ({' and '.join(sorted({e['mapper_dtype'] for e in report['latency']['rows'].values()}))}) vs "
            "the target body re-prefilling the same tokens, timed interleaved in one run "
            f"({report['latency']['run']['threads']} thread(s), median of {report['latency']['run']['repeats']} timed "
            f"run(s) after {report['latency']['run']['warmup']} warm-up run(s); "
            + (
                f"1-minute load average {report['latency']['run']['load_average']:.2f} on "
                f"{report['latency']['environment'].get('cpu_count', os.cpu_count())} cores when it started):"
                if "load_average" in report["latency"]["run"]
                else "on a CPU shared with other jobs, so single runs are noisy):"
            ),
            "",
            "| mapper | tokens | mapper ms | re-prefill ms | speedup | FLOP bound | fraction of bound | "
            "to first token: handoff ms | to first token: prefill ms | to first token: speedup |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for key, entry in report["latency"]["rows"].items():
            for row in entry["rows"]:
                first = [row.get(f"first_token_{name}") for name in ("handoff_ms", "prefill_ms", "speedup")]
                first_cells = (
                    f"{_fmt(first[0], 0)} | {_fmt(first[1], 0)} | {_fmt(first[2], 2)}x"
                    if first[0]
                    else "n/a | n/a | n/a"
                )
                lines.append(
                    f"| {key} | {row['tokens']} | {_fmt(row['mapper_ms'], 0)} | {_fmt(row['prefill_ms'], 0)} | "
                    f"{_fmt(row['speedup'], 2)}x | {_fmt(row['flop_bound'], 2)}x | {_fmt(row['fraction_of_bound'], 2)} | "
                    f"{first_cells} |"
                )
        lines += [
            "",
            "To first token: mapping the source's cache, the target reading its held-back token over it and its "
            "next-token logits, against the target prefilling the whole prompt to the same logits (the source's own "
            "prefill is not counted: in a handoff it has already happened).",
            "",
        ]
    lines += [
        "The paper's published retention (%, from "
        "[docs/method.md](method.md#evaluation-protocol-and-published-retention), lm-evaluation-harness tasks on "
        "8xH100; not measured here), for comparison with the retention columns above:",
        "",
        *PAPER_TABLE,
        "",
        "![real family](../benchmarks/results/real_family.png)",
    ]
    return "\n".join(lines)


def plot_report(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = list(report["directions"])
    analysis = report.get("analysis", {})
    rows = 2 if analysis else 1
    fig, axes = plt.subplots(rows, len(directions), figsize=(6 * len(directions), 4 * rows), squeeze=False)
    for ax, direction in zip(axes[0], directions):
        variants = report["directions"][direction]["variants"]
        first = next(iter(variants.values()))
        names = list(first["tasks"])
        bars = {"source alone": [first["tasks"][n]["source"] for n in names]}
        bars["target alone"] = [first["tasks"][n]["target"] for n in names]
        for variant, entry in variants.items():
            bars[variant] = [entry["tasks"].get(n, {}).get("mapped", float("nan")) for n in names]
        width = 0.8 / len(bars)
        for i, (label, values) in enumerate(bars.items()):
            ax.bar([x + i * width for x in range(len(names))], values, width, label=label)
        for x, name in enumerate(names):
            ax.hlines(
                first["tasks"][name]["chance"], x - width / 2, x + 0.8 - width / 2, colors="k", linestyles="dotted"
            )
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{direction}: accuracy (dotted: chance)")
        ax.legend(fontsize=7)
    if analysis:
        for ax, direction in zip(axes[1], directions):
            target = direction.split("-to-")[1]
            for key, entry in analysis.items():
                if not (key.startswith(direction + "/") or key.startswith(f"{target}-to-{target}/")):
                    continue
                line = ax.plot(entry["key_r2"], label=f"{key} keys")[0]
                ax.plot(entry["value_r2"], linestyle="--", color=line.get_color(), label=f"{key} values")
            ax.set_ylim(-1, 1.02)
            ax.axhline(0, color="k", linewidth=0.5)
            ax.set_xlabel("target layer")
            ax.set_title(f"held-out R^2 per layer (target {target}; clipped at -1)")
            ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_report(args) -> int:
    from hf_kvmap import MapperConfig
    from hf_kvmap.card import render_card
    from hf_kvmap.reporting import environment_info

    work = Path(args.work)
    scores = json.loads(scores_path(work, args.items, args.seed).read_text())
    fit = json.loads((work / "fit.json").read_text())
    progress = fit["calibration"]
    calibration = {
        "sequences": len(progress["done"]) * progress["setting"]["chunk"],
        "seq_len": progress["setting"]["seq_len"],
        "stride": progress["setting"]["stride"],
        "chunk": progress["setting"]["chunk"],
        "positions": progress["positions"],
        "manifest_sha256": progress["setting"]["manifest_sha256"],
        "forward_seconds": progress.get("forward_seconds"),
        "dtype": progress["setting"].get("dtype", "bfloat16"),  # runs before `--dtype` existed were bfloat16
    }
    report = {
        "run": {
            "items_per_task": args.items,
            "seed": args.seed,
            "calibration": calibration,
            "ridge_lambda": fit["ridge_lambda"],
            "models": {
                SHORT[name]: json.loads((model_folder(name, args.cache_dir) / "obtain.json").read_text())
                for name in (SMALL, LARGE)
            },
            "scores_seconds": sum(entry["seconds"] for entry in scores.values()),
            # scores written before `--dtype` existed were all bfloat16 runs
            "dtype": sorted({entry.get("dtype", "bfloat16") for entry in scores.values()}),
        },
        "directions": {},
        "self_maps": {},
        "fit": fit["mappers"],
        "environment": environment_info(),
    }
    CONFIGS.mkdir(parents=True, exist_ok=True)
    CARDS.mkdir(parents=True, exist_ok=True)
    for source, target in DIRECTIONS:
        direction = direction_name(source, target)
        variants = {}
        for variant in VARIANTS:
            results = assemble(scores, source, target, variant)
            if results is not None:
                variants[variant] = results
        if variants:
            report["directions"][direction] = {"variants": variants}
        for variant, results in variants.items():
            config = MapperConfig.from_pretrained(mapper_dir(work, source, target, variant))
            name = f"qwen2.5-coder-{direction}-{variant}"
            config.save_pretrained(CONFIGS / name)
            card = render_card(weightless_mapper(config), card_results(report, results), model_name=name)
            card.save(CARDS / f"{name}.md")
    for name in (SMALL, LARGE):
        results = assemble(scores, name, name, "ridge-all")
        if results is not None:
            report["self_maps"][SHORT[name]] = results
    if (work / "analysis.json").is_file():
        report["analysis"] = json.loads((work / "analysis.json").read_text())
    if (work / "latency.json").is_file():
        report["latency"] = json.loads((work / "latency.json").read_text())
    write_json(FAMILY_RESULTS, report)
    plot_report(report, FAMILY_PLOT)
    print(
        f"wrote {FAMILY_RESULTS}, {FAMILY_PLOT}, {CARDS}/ (then `python -m benchmarks.docs` renders docs/real-family.md)"
    )
    return 0
