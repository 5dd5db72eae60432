"""`scale report`: the scale study's results JSON, plot and cards, and the markdown of its docs page."""

from __future__ import annotations

import json
from pathlib import Path

from .common import (
    CARDS,
    CONFIGS,
    VARIANTS,
    assemble,
    card_results,
    weightless_mapper,
    write_json,
)
from .finetune import finetune_metric
from .scale import PAPER_POSITIONS, SCALE_PLOT, SCALE_RESULTS, mapper_folder


def assemble_curve(scores: dict) -> dict:
    """Per (direction, variant): one three-way results row (retention, floor-normalized) per calibration size."""
    curves: dict = {}
    for key in scores:
        parts = key.split("|")
        if len(parts) != 4 or parts[0] in ("r2", "calibration"):
            continue
        _, positions, direction, variant = parts
        curves.setdefault(f"{direction}/{variant}", set()).add(int(positions))
    out = {}
    for name, sizes in sorted(curves.items()):
        direction, variant = name.split("/")
        source, target = direction.split("-to-")
        rows = []
        for positions in sorted(sizes):
            results = assemble(scores, source, target, variant, run=str(positions))
            if results is None:
                continue
            r2 = scores.get(f"r2|{positions}|{direction}|{variant}")
            if r2 is not None:
                results["held_out_r2"] = {
                    part: sum(r2[f"{part}_r2"]) / len(r2[f"{part}_r2"]) for part in ("key", "value")
                }
            fit_seconds = [
                v["fit_seconds"]
                for k, v in scores.items()
                if k.endswith(f"|{positions}|{name.replace('/', '|')}") and "fit_seconds" in v
            ]
            if fit_seconds:
                results["fit_seconds"] = fit_seconds[0]
            if f"calibration|{positions}" in scores:
                results["calibration_seconds"] = scores[f"calibration|{positions}"]["seconds"]
            rows.append({"positions": positions, **results})
        out[name] = rows
    return out


def split_curves(curves: dict, direction: str) -> tuple[dict, list[tuple[str, dict]]]:
    """The curves fitted at three or more sizes, and `(label, row)` of every other fit of `direction` with the largest
    fit of each of those curves beside them (what the plot's two rows show)."""
    scale = {name: rows for name, rows in curves.items() if len(rows) >= 3}
    points = [
        (f"{name.split('/')[1]} @{row['positions'] // 1024}K", row)
        for name, rows in curves.items()
        if name.startswith(direction + "/")
        for row in (rows[-1:] if name in scale else rows)
    ]
    return scale, points


def plot_curve(curves: dict, path: Path, alone: dict | None = None, direction: str = "0.5b-to-1.5b") -> None:
    """Top row: the variants fitted at three or more calibration sizes, against the size. Bottom row: every other
    variant of `direction` (and the largest fit of each curve, for reference) as one dot per fit, read across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alone = alone or {}
    source, target = direction.split("-to-")
    tasks = sorted({t for rows in curves.values() for row in rows for t in row["tasks"]})
    metrics = [*tasks, "code_nll", "prose_ppl", "held_out_r2"]

    def value(row: dict, metric: str, part: str = "key"):
        if metric == "held_out_r2":
            return row.get("held_out_r2", {}).get(part)
        return (row["tasks"].get(metric) or row["perplexity"].get(metric, {})).get("mapped")

    def title(metric: str) -> str:
        if metric == "held_out_r2":
            return "held-out R^2 (K; V dashed / hollow)"
        return f"{metric} after the handoff" + (", lower is better" if metric in ("code_nll", "prose_ppl") else "")

    scale, points = split_curves(curves, direction)
    fig, axes = plt.subplots(2, len(metrics), figsize=(3.6 * len(metrics), 3.4 + 0.28 * len(points) + 1.0))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ticks = sorted({row["positions"] for rows in scale.values() for row in rows})
    for color, (name, rows) in zip(colors, scale.items()):
        x = [row["positions"] for row in rows]
        for ax, metric in zip(axes[0], metrics):
            ax.plot(x, [value(row, metric) for row in rows], marker="o", color=color, label=name)
            if metric == "held_out_r2":
                ax.plot(x, [value(row, metric, "value") for row in rows], "--", marker="o", color=color)
    for ax, metric in zip(axes[0], metrics):
        ax.set_title(title(metric), fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t // 1024}K" if t >= 1024 else str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("calibration positions")
    y = range(len(points))
    for ax, metric in zip(axes[1], metrics):
        ax.scatter([value(row, metric) for _, row in points], y, color="C0", zorder=3)
        if metric == "held_out_r2":
            ax.scatter([value(row, metric, "value") for _, row in points], y, facecolors="none", edgecolors="C0")
        ax.set_yticks(list(y), [label for label, _ in points] if metric == metrics[0] else [""] * len(points))
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(title(metric), fontsize=9)
    axes[1][0].set_ylabel(f"{direction}, every fit")
    for metric, top, bottom in zip(metrics, axes[0], axes[1]):
        for model, style in ((target, ":"), (source, "-.")):
            entry = alone.get(f"{metric}|alone|{model}")
            if entry is not None:
                top.axhline(entry["score"], color="gray", ls=style, lw=1, label=f"{model} alone")
                bottom.axvline(entry["score"], color="gray", ls=style, lw=1)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cell(row: dict, task: str) -> str:
    entry = row["tasks"].get(task) or row["perplexity"].get(task)
    if entry is None:
        return "n/a"
    if task in row["perplexity"]:
        return f"{entry['mapped']:.2f}"
    hits = round(entry["mapped"] * entry["n_items"])
    return f"{hits}/{entry['n_items']}"


def curve_table(alone: dict, curves: dict) -> list[str]:
    """One markdown row per model alone and per fit: every task, held-out R^2, fit and calibration seconds."""
    tasks = sorted({t for rows in curves.values() for row in rows for t in row["tasks"]})
    ppl = sorted({t for rows in curves.values() for row in rows for t in row["perplexity"]})
    lines = [
        "| mapper | calibration positions | "
        + " | ".join(tasks + ppl)
        + " | held-out key R^2 | held-out value R^2 | fit s | calibration s |",
        "|---|---|" + "---|" * (len(tasks) + len(ppl) + 4),
    ]
    for model in ("0.5b", "1.5b"):
        cells = []
        for task in tasks + ppl:
            entry = alone.get(f"{task}|alone|{model}")
            if entry is None:
                cells.append("n/a")
            elif task in ppl:
                cells.append(f"{entry['score']:.2f}")
            else:
                cells.append(f"{round(entry['score'] * entry['n_items'])}/{entry['n_items']}")
        lines.append(f"| {model} alone | | " + " | ".join(cells) + " | | | | |")
    for name, rows in curves.items():
        for row in rows:
            r2 = row.get("held_out_r2", {})
            r2_cells = [f"{r2[p]:.3f}" if p in r2 else "n/a" for p in ("key", "value")]
            cells = [_cell(row, t) for t in tasks + ppl]
            r2_cells += [f"{row[k]:,.0f}" if k in row else "" for k in ("fit_seconds", "calibration_seconds")]
            lines.append(f"| {name} | {row['positions']:,} | " + " | ".join(cells + r2_cells) + " |")
    return lines


def report_markdown(report: dict) -> str:
    """The `docs/real-family.md` section: the curve as a table (one row per fit), the swap diagnosis, what they say."""
    run = report["run"]
    lines = [
        f"Written by `python -m benchmarks.real scale report` from `benchmarks/results/real_family_scale.json`: the "
        f"paper's ridge fitted on growing prefixes of one calibration stream (1,024-token sequences of the pinned "
        f"corpus, stride 2, models in {run['dtype']}, ridge lambda {', '.join(f'{v:g}' for v in run['ridge_lambda'])}), every fit scored on the "
        f"same {run['items_per_task']} items per task (seed {run['seed']}). The paper calibrates on about 128K "
        "positions. Reproduce with `python -m benchmarks.real scale follow --out $WORK/calib --work $WORK/scale` "
        "(calibrates, keeps snapshots, scores each; resumable), then `report`.",
        "",
        *curve_table(report["alone"], report["curves"]),
    ]
    lines += [
        "",
        "Exact-match and choice tasks: items right / items scored; perplexity tasks: mean NLL per "
        "token of the continuation (lower is better). Held-out R^2: mean over target layers on the contexts of the "
        "perplexity items (keys in content space). Fit s: solving the ridge from the statistics (layer selection "
        "included); calibration s: the pass that gathered them (both models' forwards and the sums, in "
        "chunks of 4 x 1,024 tokens on one or two threads of a machine shared with other work).",
    ]
    for held in report.get("held_out") or []:
        lines += [
            "",
            f"The same fits on a second item set (`python -m benchmarks.real scale --items {held['items']} --seed {held['seed']} score`, "
            f"{held['items']} items per task, seed {held['seed']}: items the variants were not compared on):",
            "",
            *curve_table(held["alone"], held["curves"]),
        ]
    for name, result in (report.get("finetunes") or {}).items():
        settings = result["settings"]
        objective = result.get("objective", "attention")  # the first fine-tunes ran before `--objective`
        described = {"attention": "the per-layer attention objective", "kl": "the end-to-end KL through the target"}
        metric, initial, best = finetune_metric(result)
        data = (
            "retrieval and chat-recall prompts with their answers, built from the calibration split"
            if result.get("data") == "readback"
            else "another calibration seed"
        )
        option = " --data readback" if result.get("data") == "readback" else ""
        start = "the ridge fitted at that size"
        if result.get("start", "ridge-k8") not in VARIANTS:  # a fine-tune of a fine-tune
            start = f"`{result['start']}`"
            option += f" --variant {result['start']} --name {name.split('/')[-1].split('@')[0]}"
            if "calibration_seed" in result:
                option += f" --calibration-seed {result['calibration_seed']}"
        lines += [
            "",
            f"`{name}`: {start}, then fine-tuned by {described[objective]} "
            f"(`python -m benchmarks.real scale finetune --objective {objective}{option}`: {result['sequences_train']} sequences of "
            f"{result['sequence_length']} tokens of {data}, {result['sequences_val']} held out, "
            f"Adam {settings['lr']:g}, {result['steps_run']} steps in {result['seconds']:.0f} s): held-out {metric} "
            f"{initial:.4f} -> {best:.4f} (best at step {result['best_step']}).",
        ]
    feature_fits = report.get("feature_fits") or {}
    if feature_fits:
        lines += [
            "",
            "Fitted on features (`python -m benchmarks.real scale features`: one pass of both models keeping the content-space features "
            "in memory, every variant solved or trained on them with the k = 8 selection of a snapshot's statistics; "
            "`ridge-k8-feat` is the per-position ridge on the same features, the control; `-w1`/`-w3`: each map also "
            "reads the 1 / 3 positions before; `-both`: keys and values together; `mlp-k8-h256`: the paper's MLP at "
            "hidden size 256, ridge-initialized, 10 epochs):",
            "",
            "| fit | sequences x tokens (stride) | calibration seed | selection from | feature pass s | fit s |",
            "|---|---|---|---|---|---|",
        ]
        for name, record in feature_fits.items():
            lines.append(
                f"| `{name}` | {record['sequences']} x {record['seq_len']:,} ({record['stride']}) | "
                f"{record['calibration_seed']} | {record['selection_positions']:,} positions | "
                f"{record['feature_seconds']:.0f} | {record['fit_seconds']:.0f} |"
            )
    swap = report.get("layer_swap") or {}
    if swap:
        lines += [
            "",
            "Which layers break it (`hf_kvmap.diagnostics.layer_swap` on real weights: the target reads its own cache "
            "except one mapped layer; then only the mapped keys, only the mapped values, of every layer; and the converse, "
            "every layer mapped except one that stays the target's own; and the target's own first n layers with the "
            "rest mapped, the cache a target gets by running its first n layers itself; and every layer mapped but the "
            "prompt's first n tokens, which are the target's own, the cache a target gets by prefilling them itself):",
            "",
            "| task / fit | target alone | all mapped | keys only mapped | values only mapped | worst single layers | "
            "all mapped but one, the target's own | the target's own first n layers, the rest mapped | "
            "the target's own first n tokens, the rest mapped |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for key, row in swap.items():
            task = key.split("|")[0]
            higher_is_better = not task.endswith(("nll", "ppl"))
            worst = sorted(row["layers"].items(), key=lambda kv: kv[1], reverse=not higher_is_better)[:4]
            worst_cells = ", ".join(f"L{layer} {score:.3f}" for layer, score in worst) or "not run"
            own_cells = ", ".join(f"all but L{layer}: {score:.3f}" for layer, score in row.get("all_but", {}).items())
            first_cells = ", ".join(f"{n}: {score:.3f}" for n, score in row.get("own_first", {}).items())
            token_cells = ", ".join(f"{n}: {score:.3f}" for n, score in row.get("own_tokens", {}).items())
            lines.append(
                f"| {task}, {key.split('|')[2]}/{key.split('|')[3]} at {int(key.split('|')[1]):,} positions | "
                f"{row['target']:.3f} | {row['mapped']:.3f} | "
                f"{row['keys_only']:.3f} | {row['values_only']:.3f} | {worst_cells} | {own_cells or 'not run'} | "
                f"{first_cells or 'not run'} | {token_cells or 'not run'} |"
            )
    lines += ["", "![real family, calibration scale](../benchmarks/results/real_family_scale.png)"]
    return "\n".join(lines)


def mapper_records(work: Path, filename: str) -> dict:
    """`{"<direction>/<variant>@<positions>": record}` of the `filename` JSON kept beside each fitted mapper (its
    `history`, when it has one, left out)."""
    records = {}
    for path in sorted((work / "mappers").glob(f"*/*/*/{filename}")):
        positions, direction, variant = path.parent.relative_to(work / "mappers").parts
        record = json.loads(path.read_text())
        records[f"{direction}/{variant}@{positions}"] = {k: v for k, v in record.items() if k != "history"}
    return records


def cmd_report(args) -> int:
    from hf_kvmap.reporting import environment_info

    work = Path(args.work)
    path = work / f"scores-items{args.items}-seed{args.seed}-{args.dtype}.json"
    scores = json.loads(path.read_text())
    curves = assemble_curve(scores)
    report = {
        "run": {
            "items_per_task": args.items,
            "seed": args.seed,
            "dtype": args.dtype,
            "ridge_lambda": sorted({v["ridge_lambda"] for v in scores.values() if "ridge_lambda" in v}),
        },
        "alone": {k: v for k, v in scores.items() if "|alone|" in k},
        "curves": curves,
    }
    for key, filename in (("finetunes", "finetune.json"), ("feature_fits", "features.json")):
        records = mapper_records(work, filename)
        if records:
            report[key] = records
    for spec in args.held_out:
        items, seed = (int(n) for n in spec.split(":"))
        held = json.loads((work / f"scores-items{items}-seed{seed}-{args.dtype}.json").read_text())
        report.setdefault("held_out", []).append(
            {"items": items, "seed": seed, "alone": {k: v for k, v in held.items() if "|alone|" in k},
             "curves": assemble_curve(held)}
        )  # fmt: skip
    swap = work / f"swap-items{args.items}-seed{args.seed}-{args.dtype}.json"
    if swap.is_file():
        report["layer_swap"] = json.loads(swap.read_text())
    report["environment"] = environment_info()
    cards = write_cards(work, report)
    write_json(SCALE_RESULTS, report)
    plot_curve(curves, SCALE_PLOT, report["alone"])
    for name, rows in curves.items():
        for row in rows:
            cells = ", ".join(
                f"{t} {r['mapped']:.3f}/{r['target']:.3f}" for t, r in {**row["tasks"], **row["perplexity"]}.items()
            )
            print(f"{name} @ {row['positions']}: {cells}")
    print(f"wrote {SCALE_RESULTS}, {SCALE_PLOT}, cards {', '.join(cards) or 'none'}")
    return 0


def paper_scale_fits(report: dict) -> dict[str, tuple[str, dict]]:
    """Card name -> `(curve, row)` of each plain ridge (`ridge-k8`, `ridge-all`) fitted at the paper's calibration
    scale (`PAPER_POSITIONS` or more; the largest fit of its curve, e.g. `0.5b-to-1.5b/ridge-k8`)."""
    fits = {}
    for curve, rows in report["curves"].items():
        direction, variant = curve.split("/")
        if variant in VARIANTS and rows[-1]["positions"] >= PAPER_POSITIONS:
            fits[f"qwen2.5-coder-{direction}-{variant}-{rows[-1]['positions'] // 1024}k"] = (curve, rows[-1])
    return fits


def render_scale_card(name: str, config, report: dict, row: dict):
    """The card of one paper-scale fit: its results on the curve's items and its held-out R^2."""
    from hf_kvmap.card import render_card

    results = {key: row[key] for key in ("tasks", "perplexity", "summary") if key in row}
    if "held_out_r2" in row:
        results["diagnostics_summary"] = {
            f"held-out {part} R^2 (mean over target layers)": value for part, value in row["held_out_r2"].items()
        }
    return render_card(weightless_mapper(config), card_results(report, results), model_name=name)


def write_cards(work: Path, report: dict) -> list[str]:
    """A card in `model_cards/real/` for each fit of `paper_scale_fits`; its config is kept beside the 16K fits'
    (`real_family_configs/`), so the card can be rendered again without the weights."""
    from hf_kvmap import MapperConfig

    fits = paper_scale_fits(report)
    for name, (curve, row) in fits.items():
        config = MapperConfig.from_pretrained(mapper_folder(work, row["positions"], *curve.split("/")))
        config.save_pretrained(CONFIGS / name)
        render_scale_card(name, config, report, row).save(CARDS / f"{name}.md")
    return list(fits)
