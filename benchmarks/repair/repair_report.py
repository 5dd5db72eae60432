"""The markdown of selective repair and the guard ladder, for `python -m benchmarks.docs` (`docs/repair.md`, `docs/ladder.md`).

One renderer per section, each from the JSON one benchmark wrote (never typed by hand):

- `frontier_markdown`: `benchmarks/repair/repair_frontier.py` (retention vs fraction recomputed per strategy, tiny family);
- `cost_markdown`: `benchmarks/repair/repair_cost.py` (the repair's time vs its FLOP share, first token vs re-prefill);
- `real_repair_markdown`: `benchmarks.repair.real_repair` (the real pair, Qwen2.5-Coder 0.5B -> 1.5B);
- `ladder_markdown`: `benchmarks.ladder.guard_ladder` (the calibrated ladder vs the binary guard and every fixed repair).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from hf_kvmap.reporting import floor_retention, gap_recovered
from lab.real.long_tasks import CHANCE

from ..formatting import fraction_text, number_text, pct, retention_text, rung_label, rung_order, strategy_text

#: options whose values are paths on the machine that ran a benchmark (left out of the commands shown)
LOCAL_OPTIONS = ("--out", "--plot", "--points", "--work", "--merge", "--cache-dir")
#: strategies measured for reference only: they need the target's own prefill, which repair exists to avoid
REFERENCE_ONLY = ("oracle",)


def _bold(text: str, on: bool) -> str:
    return f"**{text}**" if on else text


def portable_path(word: str) -> str:
    """A path of the machine that ran, written as the README writes it: a fitted mapper under `$WORK/mappers/` (where
    `benchmarks.real family fit --work $WORK` puts it), a model `hf-kvmap obtain` fetched under
    `~/.cache/hf-kvmap/models/`; any other word as it is."""
    if not word.startswith("/"):
        return word
    if "/mappers/" in word and "/zoo/mappers/" not in word:
        return "$WORK/mappers/" + word.rsplit("/mappers/", 1)[1]
    if "/.cache/hf-kvmap/models/" in word:
        return "~/.cache/hf-kvmap/models/" + word.rsplit("/.cache/hf-kvmap/models/", 1)[1]
    return word


def portable_command(command: str) -> str:
    """A benchmark's recorded command without the options that name local paths (`LOCAL_OPTIONS`), and with the
    mappers and models it read written where the README puts them ([`portable_path`])."""
    words, kept = shlex.split(command), []
    skip = False
    for word in words:
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if name in LOCAL_OPTIONS:
            skip = "=" not in word
            continue
        kept.append(portable_path(word))
    return " ".join(kept)


def _option(command: str, name: str) -> str | None:
    """The value of option `name` in a recorded command (`None` when it is not given)."""
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word == name and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def _machine(environment: dict) -> str:
    threads = environment.get("threads")
    return f"{environment.get('device', '?')}, {threads} torch thread{'' if threads == 1 else 's'}"


def mapper_name(path: str) -> str:
    """`` `tiny-m-to-tiny-l` (shipped) `` for a mapper of the package, else the last two parts of its folder
    (`0.5b-to-1.5b/ridge-k8`), not where it lay on the machine that ran."""
    parts = Path(path).parts
    if parts[-3:-1] == ("zoo", "mappers"):
        return f"`{parts[-1]}` (shipped)"
    return "`" + "/".join(parts[-2:]) + "`"


# ------------------------------------------------------------------------------------------------ frontier


def _best_within(selection: dict, report: dict, name: str, budget: float) -> tuple[float, float, float] | None:
    """`(fraction, selection retention, report retention)` of strategy `name`'s best point on the selection set at a
    fraction <= `budget` (ties go to the cheaper fraction)."""
    points = [
        (point["retention"] or 0.0, -point["fraction"], index)
        for index, point in enumerate(selection["repair"][name])
        if point["fraction"] <= budget
    ]
    if not points:
        return None
    _, _, index = max(points)
    chosen = selection["repair"][name][index]
    return chosen["fraction"], chosen["retention"], report["repair"][name][index]["retention"]


def frontier_markdown(result: dict, source: str = "benchmarks/results/repair_frontier.json") -> str:
    """The `repair-frontier` section: per direction and task of the tiny family, the target's and the mapped cache's
    accuracy, the chosen strategy's retention at every fraction, and each strategy's best point within the budget."""
    run = result["run"]
    fractions, goal, budget = run["fractions"], run["goal"], run["budget"]
    strategies = sorted(run["strategies"], key=lambda name: (name in REFERENCE_ONLY, name))
    merged = run.get("merged")  # the earlier runs, the first one first
    command = f"`{portable_command(run['command'])}`"
    if merged:
        earlier = [f"`{portable_command(entry['command'])}`" for entry in merged]
        command = f"{earlier[0]}, with {' then '.join([*earlier[1:], command])} merged into it"
    mapper = _option(run["command"], "--mapper")
    mappers = "the shipped tiny-family mappers" if mapper is None else f"mapper {mapper_name(mapper)}"
    lines = [
        f"Generated from `{source}`, written by {command} ({_machine(result.get('environment', {}))}): "
        f"{mappers}, {run['items_per_set']} items per task on a selection set (seed {run['selection_seed']}: "
        f"every choice is made there) and {run['items_per_set']} on a report set (seed {run['report_seed']}: every "
        "number below). Exact match; retention is the repaired handoff's accuracy over the target's own (chance 0), "
        "so the mapped cache's retention is the point at fraction 0.",
        "",
        f"The choice per direction and task: the strategy with the best selection-set retention at a fraction of at "
        f"most {fraction_text(budget)} (its fraction in bold), its report-set retention at every fraction measured, and "
        f"the cheapest point reaching a retention of {goal:g} on the selection set, where one does "
        "(selection -> report).",
        "",
        "| direction | task | target right | mapped right (retention) | chosen strategy | "
        + " | ".join(fraction_text(f) for f in fractions)
        + f" | cheapest reaching {goal:g} |",
        "|---|---|---|---|---|" + "---|" * len(fractions) + "---|",
    ]
    for direction, tasks in result["directions"].items():
        for task, sets in tasks.items():
            report, choice = sets["report"], sets["choice"]
            best = choice.get("best_within_budget")
            cells = ["-"] * len(fractions)
            chosen = "none"
            if best is not None:
                chosen = f"`{best['strategy']}`"
                for i, point in enumerate(report["repair"][best["strategy"]]):
                    cells[i] = _bold(number_text(point["retention"]), point["fraction"] == best["fraction"])
            cheapest = choice.get("cheapest_reaching_goal")
            reaching = (
                f"`{cheapest['strategy']}` at {fraction_text(cheapest['fraction'])}: "
                f"{number_text(cheapest['selection_retention'])} -> {number_text(cheapest['report_retention'])}"
                if cheapest
                else "none measured"
            )
            lines.append(
                f"| {direction} | {task} | {number_text(report['target'])} | {number_text(report['mapped'])} "
                f"({number_text(report['mapped_retention'])}) | {chosen} | {' | '.join(cells)} | {reaching} |"
            )
    references = [f"`{name}`" for name in strategies if name in REFERENCE_ONLY]
    lines += [
        "",
        f"Each strategy at its best fraction of at most {fraction_text(budget)}, chosen on the selection set: retention "
        "selection -> report (fraction)."
        + (
            f" {', '.join(references)}: a reference, never a serving choice (it reads the target's own cache)."
            if references
            else ""
        ),
        "",
        "| direction | task | "
        + " | ".join(f"`{name}`" + (" (reference)" if name in REFERENCE_ONLY else "") for name in strategies)
        + " |",
        "|---|---|" + "---|" * len(strategies),
    ]
    for direction, tasks in result["directions"].items():
        for task, sets in tasks.items():
            cells = []
            for name in strategies:
                best = _best_within(sets["selection"], sets["report"], name, budget)
                cells.append(
                    "-"
                    if best is None
                    else f"{number_text(best[1])} -> {number_text(best[2])} ({fraction_text(best[0])})"
                )
            lines.append(f"| {direction} | {task} | {' | '.join(cells)} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ cost


def cost_markdown(result: dict, source: str = "benchmarks/results/repair_cost.json") -> str:
    """The `repair-cost` section: per context length and fraction, each strategy's repair time as a share of the
    target's prefill beside the FLOP share of the recompute, the first-token speedup of the repaired handoff over the
    target's re-prefill, and the attention check (the recompute of the tail vs a re-prefill of that suffix)."""
    run, rows = result["run"], result["rows"]
    strategies = sorted(run["strategies"], key=lambda name: (name in REFERENCE_ONLY, name))
    lines = [
        f"Generated from `{source}`, written by `{portable_command(run['command'])}` ({portable_path(run['source'])} -> {portable_path(run['target'])}, "
        f"mapper {mapper_name(run['mapper'])}, {run['dtype']}, {run['attn_implementation']} attention, "
        f"{_machine(result.get('environment', {}))}; one random prompt per length; medians of {run['repeats']} "
        f"interleaved repeats after {run['warmup']} warm-up; the attention strategies read the last "
        f"{run['last_tokens']} prompt tokens).",
        "",
        "Per strategy: the repair's own time (selection and recompute) as a share of the target's full prefill, then "
        "the first-token speedup of the repaired handoff (mapping, repair, the held-back token) over that prefill. "
        "The FLOP share is the bound of recomputing that many positions (`hf_kvmap.flops.repair_flops` over the "
        "prefill's FLOPs) when they are the tail / when they are spread evenly over the prompt.",
        "",
        "| tokens | prefill (ms) | mapped handoff speedup | fraction | FLOP share: tail / spread | "
        + " | ".join(f"`{name}`" for name in strategies)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(strategies),
    ]
    for row in rows:
        by_key = {(entry["strategy"], entry["fraction"]): entry for entry in row["repair"]}
        for i, fraction in enumerate(run["fractions"]):
            first = next(entry for entry in row["repair"] if entry["fraction"] == fraction)
            head = (
                [str(row["tokens"]), f"{row['prefill_ms']:.1f}", f"{row['mapped_speedup']:.1f}x"]
                if i == 0
                else ["", "", ""]
            )
            cells = [
                f"{pct(by_key[(name, fraction)]['repair_share_of_prefill'])} · "
                f"{by_key[(name, fraction)]['speedup']:.1f}x"
                if (name, fraction) in by_key
                else "-"
                for name in strategies
            ]
            lines.append(
                f"| {' | '.join(head)} | {fraction_text(fraction)} | {pct(first['flop_share_bound_tail'])} / "
                f"{pct(first['flop_share_bound_uniform'])} | {' | '.join(cells)} |"
            )
    checks = [(row["tokens"], check) for row in rows for check in row.get("attention_check", [])]
    if checks:
        lines += [
            "",
            "The attention check: recomputing the tail (one forward of the selected positions under a custom 4-D "
            "mask, boolean under sdpa) beside the target re-prefilling the same suffix over the cropped cache "
            "(transformers' own mask path) and beside the same recompute with an additive float mask (ms).",
            "",
            "| tokens | fraction | positions | FLOP share | recompute of the tail | suffix re-prefill | recompute, "
            "float mask |",
            "|---|---|---|---|---|---|---|",
        ]
        for tokens, check in checks:
            lines.append(
                f"| {tokens} | {fraction_text(check['fraction'])} | {check['recomputed']} | "
                f"{pct(check['flop_share_bound'])} | {number_text(check.get('recompute_ms'), 1)} | "
                f"{number_text(check['suffix_prefill_ms'], 1)} | {number_text(check.get('float_mask_recompute_ms'), 1)} |"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the real pair


def task_value(data: dict, row: dict) -> float | None:
    """A measured point's retention, or (a perplexity task) the share of the mapped cache's perplexity gap closed."""
    return row.get("gap_closed") if data.get("task_type") == "perplexity" else row.get("retention")


def score_text(data: dict, value) -> str:
    """A task's raw score: items right of items, or a perplexity."""
    if data.get("task_type") == "perplexity":
        return number_text(value, 3)
    return "n/a" if value is None else f"{round(value * data['items'])}/{data['items']}"


def task_label(name: str, data: dict) -> str:
    if data.get("task_type") == "perplexity":
        return f"{name} (perplexity: gap closed)"
    if data.get("chance"):
        return f"{name} (choice, chance {data['chance']:g})"
    return f"{name} (exact match)"


def real_repair_markdown(result: dict, source: str = "benchmarks/results/real_repair.json") -> str:
    """The `real-repair` section: per task and strategy on the selection set, the retention (or perplexity gap
    closed) at every fraction; the point chosen there; and the chosen strategy at every fraction on the report set,
    task by task as far as the run got."""
    run, sets = result["run"], result["sets"]
    chosen = result["chosen_on_selection"]
    config = run.get("mapper_config") or {}
    kind = ", ".join(
        part
        for part in (
            config.get("kind"),
            f"k = {config['top_k']}" if config.get("top_k") else "",
            f"lambda {config['ridge_lambda']:g}" if config.get("ridge_lambda") is not None else "",
        )
        if part
    )
    direction = run["direction"].replace(":", " -> ").upper()
    selection, report = run["selection"], run["report"]
    lines = [
        f"Generated from `{source}`, written by `{portable_command(run['command'])}` (Qwen2.5-Coder {direction}, mapper "
        f"{mapper_name(run['mapper'])}{f' ({kind})' if kind else ''}, models and mapper in {run['dtype']}, "
        f"{_machine(result.get('environment', {}))}). Selection set (seed {selection['seed']}): every strategy at "
        "every fraction, and the choice is made there. Report set (seed "
        f"{report['seed']}): the chosen strategy only. Retention is floor-normalized (exact match: chance 0, above 1 "
        "where the repaired handoff answers more items than the target; choice: chance 0.25, none where the target "
        "does not beat chance); a perplexity task shows the share of the mapped cache's perplexity gap to the "
        "target's that the repair closes (1 = the target's own perplexity).",
        "",
    ]
    first = next(iter(sets["selection"].values()))
    fractions = [row["fraction"] for row in next(iter(first["repair"].values()))]
    lines += [
        "Selection set (target and mapped: the raw scores, items right or the perplexity; per fraction: retention or "
        "the gap closed; the chosen point in bold):",
        "",
        "| task | items | target | mapped | strategy | " + " | ".join(fraction_text(f) for f in fractions) + " |",
        "|---|---|---|---|---|" + "---|" * len(fractions),
    ]
    for task, data in sets["selection"].items():
        for i, (strategy, rows) in enumerate(data["repair"].items()):
            head = ["", "", "", ""]
            if i == 0:
                head = [
                    task_label(task, data),
                    str(data["items"]),
                    score_text(data, data["target"]),
                    score_text(data, data["mapped"]),
                ]
            cells = [
                _bold(
                    number_text(task_value(data, row)),
                    strategy == chosen["strategy"]
                    and row["fraction"] == chosen["fraction"]
                    and data.get("task_type") != "perplexity",
                )
                for row in rows
            ]
            lines.append(f"| {' | '.join(head)} | `{strategy}` | {' | '.join(cells)} |")
    reached = "reaches" if chosen["reaches_goal"] else "does not reach"
    lines += [
        "",
        f"Chosen on the selection set (the cheapest point whose worst-task retention reaches {run['goal']:g} on every "
        f"task with a retention, else the best worst-task retention): `{chosen['strategy']}` at "
        f"{fraction_text(chosen['fraction'])}, worst-task retention {number_text(chosen['selection_worst_retention'])} "
        f"({reached} the goal).",
    ]
    if sets.get("report"):
        report_fractions = [
            row["fraction"] for row in next(iter(sets["report"].values()))["repair"][chosen["strategy"]]
        ]
        lines += [
            "",
            f"Report set: `{chosen['strategy']}` at {', '.join(fraction_text(f) for f in report_fractions)} (the chosen "
            "fraction in bold); the raw score (items right, or the perplexity) after each value.",
            "",
            "| task | items | target | mapped (retention) | "
            + " | ".join(fraction_text(f) for f in report_fractions)
            + " |",
            "|---|---|---|---|" + "---|" * len(report_fractions),
        ]
        for task, data in sets["report"].items():
            cells = [
                _bold(
                    f"{number_text(task_value(data, row))} ({score_text(data, row['score'])})",
                    row["fraction"] == chosen["fraction"],
                )
                for row in data["repair"][chosen["strategy"]]
            ]
            mapped = score_text(data, data["mapped"])
            if data.get("task_type") != "perplexity":
                mapped += f" ({number_text(data.get('mapped_retention'))})"
            lines.append(
                f"| {task_label(task, data)} | {data['items']} | {score_text(data, data['target'])} | {mapped} | "
                f"{' | '.join(cells)} |"
            )
        missing = [name for name in sets["selection"] if name not in sets["report"]]
        if missing:
            lines += [
                "",
                f"Not yet measured on the report set (the run resumes from its points): {', '.join(missing)}.",
            ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the guard ladder


def _rungs(ladder: dict, repairs: bool = True) -> str:
    """`risk <= 0.5: recompute 20 %; above: prefill` for a ladder's settings."""
    parts = []
    for rung in ladder["rungs"]:
        verb = "sparse prefill" if rung.get("sparse") else "recompute"  # sparse: the selection alone, no map
        what = f"{verb} {fraction_text(rung['fraction'])}" if rung["fraction"] else "mapped"
        if repairs and not rung["fraction"]:
            what = "recompute 0 % (mapped)"
        parts.append(f"risk <= {rung['max_risk']:.4g}: {what}")
    parts.append("above: prefill" if parts else "none: every request prefills")
    return "; ".join(parts)


def _direction_markdown(tag: str, data: dict, tasks: list[str]) -> list[str]:
    ways = {"binary guard": data["binary_guard"], "ladder": data["ladder"]}
    confident = {  # calibrated with the budget held as an upper confidence bound (`--confidence`)
        name: data[key]
        for name, key in (("binary guard, bound", "binary_guard_confident"), ("ladder, bound", "ladder_confident"))
        if key in data
    }
    if confident:
        level = data["ladder_confident"]["ladder"]["calibration"]["confidence"]
        confident = {f"{name} at {level:g}": way for name, way in confident.items()}
        ways.update(confident)
    for key, name in (("ladder_checked", "ladder + check"), ("ladder_checked_confident", "ladder + check, bound")):
        if key in data:  # the check after the rung (the target's answer margin), where the records hold margins
            level = data[key]["ladder"]["calibration"]["confidence"]
            ways[name.replace("bound", f"bound at {level:g}") if level else name] = data[key]
    lines = [
        f"**{tag}** (mapper {mapper_name(data['mapper'])}; "
        + (f"{data['report_items_per_task']} report items per task; " if "report_items_per_task" in data else "")
        + f"report prompts of {data['tokens']:.0f} tokens on "
        f"average, the target's prefill {1000 * data['prefill_seconds']:.1f} ms on average)",
        "",
        "| calibrated on the selection set | probe | repair strategy | rungs | selection: mean cost, worst-task "
        "changed served |",
        "|---|---|---|---|---|",
    ]
    for name, way in ways.items():
        ladder, outcome = way["ladder"], way["selection"]
        probe = f"{ladder['probe']['name']}:{ladder['probe'].get('tokens', '?')}"
        repairs = name.startswith("ladder")
        strategy = f"`{strategy_text(ladder['strategy'])}`" if repairs else "none (mapped or prefill)"
        worst = max(group["changed_served"] for group in outcome["per_group"].values())
        rungs = _rungs(ladder, repairs)
        if ladder.get("min_margin") is not None:
            over = f" over {ladder['check_tokens']} answer tokens" if ladder.get("check_tokens", 1) > 1 else ""
            rungs += f"; then the check: answer margin{over} < {ladder['min_margin']:g}: prefill"
        elif name.startswith("ladder + check"):
            rungs += "; no check (none was cheaper on the selection set)"
        lines.append(
            f"| {name} | `{probe}` | {strategy} | {rungs} | {number_text(outcome['mean_cost'])}, {pct(worst, 1)} |"
        )
    rungs = sorted({rung for way in ways.values() for rung in way["report"]["rungs"]}, key=rung_order)
    with_source = all("source" in way["report_accuracy"][task] for way in ways.values() for task in tasks)
    lines += [
        "",
        "| report set | "
        + " | ".join(rung_label(rung) for rung in rungs)
        + " | "
        + " | ".join(f"changed served: {task}" for task in tasks)
        + " | "
        + " | ".join(f"right, served / target{' / source' if with_source else ''}: {task}" for task in tasks)
        + " | mean cost | net saving |",
        "|---|" + "---|" * (len(rungs) + 2 * len(tasks) + 2),
    ]
    for name, way in ways.items():
        report, accuracy = way["report"], way["report_accuracy"]
        cells = [pct(report["rungs"].get(rung, 0.0)) for rung in rungs]
        cells += [pct(report["per_group"][task]["changed_served"], 1) for task in tasks]
        cells += [
            " / ".join(number_text(accuracy[task][key]) for key in ("served", "target", "source")[: 2 + with_source])
            for task in tasks
        ]
        cells += [number_text(report["mean_cost"]), pct(report["net_saving"])]
        if "checked_fallback" in report:
            name = f"{name} (the check sent back {pct(report['checked_fallback'])})"
        lines.append(f"| {name} | {' | '.join(cells)} |")
    sweep = data.get("budget_sweep", [])
    if sweep:
        lines += [
            "",
            "Other budgets (calibrated on the selection set at each, replayed on the report set): worst task's changed "
            "answers served · mean cost.",
            "",
            "| budget | ladder | binary guard |" + (" ladder, bound | binary guard, bound |" if confident else ""),
            "|---|---|---|" + ("---|---|" if confident else ""),
        ]
        names = ("ladder", "binary_guard") + (("ladder_confident", "binary_guard_confident") if confident else ())
        for row in sweep:
            cells = [
                f"{pct(row[name]['worst_changed'], 1)} · {number_text(row[name]['mean_cost'])}" if name in row else "-"
                for name in names
            ]
            lines.append(f"| {pct(row['max_changed'], 1)} | {' | '.join(cells)} |")
    fixed = data["fixed_report"]
    fractions = sorted({row["fraction"] for rows in fixed.values() for row in rows})
    columns = " | ".join(fraction_text(f) + (" (mapped)" if not f else "") for f in fractions)

    def cell(rows: list[dict], fraction: float, show) -> str:
        row = next((row for row in rows if row["fraction"] == fraction), None)
        return "-" if row is None else show(row)

    def worst(row: dict) -> str:
        changed = max(task["changed"] for task in row["tasks"].values())
        return f"{number_text(row['mean_cost'])} · {pct(changed, 1)}"

    def retention(task: str):  # floor-normalized at guessing one of the prompt's candidates, as long_switch_report
        chance, items = CHANCE.get(task, 0.0), data.get("report_items_per_task")

        def show(row: dict) -> str:
            result = row["tasks"][task]
            kept = retention_text(floor_retention(result["accuracy"], result["target"], chance, items))
            if "source" not in result:
                return kept
            gap = gap_recovered(result["accuracy"], result["target"], result["source"])
            return f"{kept} · {'target <= source' if gap is None else number_text(gap)}"

        return show

    gapped = all("source" in task for rows in fixed.values() for row in rows for task in row["tasks"].values())
    lines += ["", f"| always serve, no probe (report set) | {columns} |", "|---|" + "---|" * len(fractions)]
    for strategy, rows in fixed.items():
        lines.append(f"| `{strategy_text(strategy)}` | {' | '.join(cell(rows, f, worst) for f in fractions)} |")
    lines += [
        "",
        f"| retention{' · gap recovered' if gapped else ''} of every fixed repair (report set) | task | {columns} |",
        "|---|---|" + "---|" * len(fractions),
    ]
    for strategy, rows in fixed.items():
        for index, task in enumerate(tasks):
            cells = " | ".join(cell(rows, f, retention(task)) for f in fractions)
            lines.append(f"| {f'`{strategy_text(strategy)}`' if not index else ''} | {task} | {cells} |")
    return lines


def _ladder_strategies(result: dict) -> list[str]:
    """The run's strategies, then those measured beside its records later (in every direction that holds them)."""
    beside = [key for data in result["directions"].values() for key in data.get("measured_beside", {})]
    return list(dict.fromkeys([*result["run"]["strategies"], *beside]))


def _beside_text(result: dict) -> str:
    """What the results say of strategies measured beside the records later: on which records, on whose clock (the
    selection set once, as every report length shares it)."""

    def clock(row: dict) -> str:
        if row["clock"] is None:
            text = "its seconds taken as timed (measured before yardsticks)"
        else:
            text = f"its seconds put on the records' clock by a yardstick (median factor {row['clock']:.2f})"
        unchecked = row.get("mappers_unchecked", [])
        if unchecked:  # the records of before they named their mapper: the side pass's cannot be checked against it
            text += ", with mapper " + ", ".join(f"`{h.removeprefix('sha256:')[:12]}`" for h in unchecked)
            text += " (the records do not name theirs)"
        return text

    found: dict[str, list[str]] = {}
    for direction, data in result["directions"].items():
        for key, sets in data.get("measured_beside", {}).items():
            parts = found.setdefault(key, [])
            if not parts and sets["selection"]["records"]:
                parts.append(f"{sets['selection']['records']} selection records, {clock(sets['selection'])}")
            if sets["report"]["records"]:
                parts.append(f"{sets['report']['records']} report records of {direction}, {clock(sets['report'])}")
    return "".join(
        f" `{strategy_text(key)}` was measured beside the records later, timed apart from their prefills: "
        + "; ".join(parts)
        + "."
        for key, parts in found.items()
        if parts
    )


def ladder_markdown(result: dict, source: str = "benchmarks/results/guard_ladder.json") -> str:
    """The `guard-ladder` section: per direction, the calibrated ladder and the binary guard (probe, strategy, rungs),
    both replayed on the report set (share of requests per rung, changed answers served and accuracy per task, mean
    cost and net saving), and every fixed repair served to every request (cost, worst-task changed share)."""
    run = result["run"]
    tasks = run["tasks"]
    selection, report = run["selection"], run["report"]
    lines = [
        f"Generated from `{source}`, written by `{portable_command(run['command'])}` ({run['family']} family, {run['dtype']}, "
        f"{_machine(result.get('environment', {}))}). Candidates: probes "
        + ", ".join(f"`{probe}`" for probe in run["probes"])
        + "; repair strategies "
        + ", ".join(f"`{strategy_text(strategy)}`" for strategy in _ladder_strategies(result))
        + "; fractions "
        + ", ".join(fraction_text(f) for f in run["fractions"])
        + f" (0, the mapped cache, always). Calibrated on a selection set ({selection['items_per_task']} items per "
        f"task, seed {selection['seed']}) with at most {pct(run['max_changed'])} changed answers served per task "
        f"({', '.join(tasks)}), replayed on a report set ({report['items_per_task']} items per task, seed "
        f"{report['seed']}). *Changed*: the greedy answer differs from the target's own (the prefill never changes "
        "one). *Cost*: the seconds of every stage over the item's own target prefill, measured side by side (the "
        "mapping and the probe on every rung, the recompute on a repairing one, the prefill on the fallback); net "
        "saving = 1 - mean cost. The binary guard is calibrated on the same items with the mapped cache as its only "
        "rung. The last table serves every request one fixed repair, no probe: mean cost · worst-task changed share.",
    ]
    lines[-1] += _beside_text(result)
    if run.get("confidence") is not None:
        lines[-1] += (
            f" Rows marked *bound* are calibrated with the budget held as a one-sided Clopper-Pearson upper bound at "
            f"{run['confidence']:g} on each task's selection items instead of on the items alone (a task with too few "
            "items to vouch for the budget is served only the fallback)."
        )
    if any("ladder_checked" in data for data in result["directions"].values()):
        lines[-1] += (
            " Rows marked *+ check* are ladders that also check each request after its rung: the target runs the "
            "prompt's last token on the served cache (the first step of its generation) and a request whose first "
            "answer token it takes with a probability margin (top-1 minus top-2) below the calibrated one falls back "
            "after all, paying its rung and the prefill; the margin is calibrated with the rungs on the selection set."
        )
    for tag, data in result["directions"].items():
        lines += ["", *_direction_markdown(tag, data, tasks)]
    return "\n".join(lines)


__all__ = ["cost_markdown", "frontier_markdown", "ladder_markdown", "real_repair_markdown"]
