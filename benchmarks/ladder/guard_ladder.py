"""The guard ladder, calibrated on one item set and reported on another: per request, serve the mapped cache, repair
the fraction the probe's risk calls for, or fall back to the target's prefill; every stage's cost counted.

For each direction, every item of both sets is measured once through the serving code (`hf_kvmap.calibration.ladder_items`): the
target's own greedy answer, each candidate probe's risk on the mapped cache, and the answer and seconds of every
candidate repair strategy at every fraction. On the selection set the cheapest (probe, strategy) ladder whose changed
answers served stay within `--max-changed` on every task is calibrated (`hf_kvmap.calibration.ladder_items.ladder_from_records`);
beside it, the binary guard (the mapped cache or the fallback, same budget) and every fixed (strategy, fraction).
All of them are then replayed on the report set. Costs are relative to each item's own target prefill, measured side
by side in this run.

    python -m benchmarks.ladder.guard_ladder                                  # tiny-s/m/x -> tiny-l, 60 + 120 items per task
    python -m benchmarks.ladder.guard_ladder --directions tiny-m:tiny-l --selection-items 8 --report-items 8 --quick
    python -m benchmarks.ladder.guard_ladder --family real --directions 0.5b:1.5b --mapper $WORK/mappers/0.5b-to-1.5b/ridge-k8 \
        --work $WORK/ladder --out benchmarks/results/guard_ladder_real.json --plot benchmarks/results/guard_ladder_real.png

Records are kept as JSONL under `--work` (one file per direction and set), so a stopped run resumes.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

from hf_kvmap import MapperModel
from hf_kvmap.calibration.ladder import refused_by_check
from hf_kvmap.calibration.ladder_items import (
    CHECK_TOKENS,
    LadderItem,
    has_margins,
    held_strategies,
    items_from_tasks,
    ladder_from_records,
    measure_ladder_items,
    probe_key,
    record_margins,
    replay_ladder,
    strategy_key,
)
from hf_kvmap.loading import load_causal_lm, load_tokenizer, resolve_mapper
from hf_kvmap.repair import resolve_markup
from hf_kvmap.reporting import environment_info, write_json
from lab.ladder_migration import has_source_answers, machines, with_side_measurements

from ..formatting import strategy_text
from ..switch.long_switch_args import parse_strategy, split_rungs
from .ladder_lengths import GATED, changed_outcome, gated_way

REPO = Path(__file__).resolve().parents[2]
TINY_DIRECTIONS = ("tiny-s:tiny-l", "tiny-m:tiny-l", "tiny-x:tiny-l")
TASKS = {"tiny": ("recall", "chat"), "real": ("prose_retrieval", "chat_recall")}
REAL_MODELS = {"0.5b": "qwen2.5-coder-0.5b-instruct", "1.5b": "qwen2.5-coder-1.5b-instruct"}
PROBES = "draft_agreement:2,lookahead_margin:1,confident_draft:2"
STRATEGIES = "tail,source_attention,target_attention,early_deviation"
FRACTIONS = "0.1,0.2,0.3,0.5"
#: the real family's long forms (`lab.real.long_tasks`), built at `--tokens`
LONG_TASKS = ("long_chat", "long_doc")


def load_pair(args, direction: str):
    """(source, target, mapper, tokenizer, mapper name) of one direction."""
    source_name, target_name = direction.split(":")
    if args.family == "real":
        from hf_kvmap.real import converted_path, is_converted

        folders = []
        for side in (source_name, target_name):
            if side not in REAL_MODELS:
                raise SystemExit(f"--family real takes directions of {sorted(REAL_MODELS)}; got {side!r}.")
            if not is_converted(REAL_MODELS[side], args.cache_dir):
                raise SystemExit(f"{REAL_MODELS[side]} is not here; run: hf-kvmap obtain {REAL_MODELS[side]}")
            folders.append(str(converted_path(REAL_MODELS[side], args.cache_dir)))
        source_name, target_name = folders
        if args.mapper is None:
            raise SystemExit("--family real needs --mapper (a fitted real mapper folder).")
    dtype = getattr(torch, args.dtype)
    source, target = load_causal_lm(source_name, dtype), load_causal_lm(target_name, dtype)
    tokenizer = load_tokenizer(target_name)
    mapper_name = args.mapper or resolve_mapper(None, source_name, target_name)
    mapper = MapperModel.from_pretrained(mapper_name, dtype=dtype)
    # the real models are local conversions of the weights the real mappers were fitted on (`hf-kvmap obtain`)
    mapper.check_compatible(source, target, tokenizer, same_weights=args.family == "real")
    return source, target, mapper, tokenizer, mapper_name


def task_items(args, tokenizer, items: int, seed: int, tokens: int):
    names = args.tasks.split(",")
    long_items = []
    if args.family == "real":
        from hf_kvmap.real.corpus import load_manifest
        from lab.real import long_tasks
        from lab.real.tasks import real_family_tasks

        documents = load_manifest(args.manifest)
        short = [name for name in names if name not in LONG_TASKS]
        tasks = real_family_tasks(tokenizer, documents, items=items, seed=seed, names=short) if short else []
        for name in (name for name in names if name in LONG_TASKS):  # at --tokens: the long conversation forms
            built = getattr(long_tasks, name)(tokenizer, documents, items, tokens, seed)
            long_items += [LadderItem(item.prompt, item.answer, "<|im_end|>", name) for item in built]
    else:
        from hf_kvmap import zoo

        tasks = [task for task in zoo.tiny_family_tasks(items, seed) if task.name in names]
    found, skipped = items_from_tasks(tasks)
    found += long_items
    if skipped or {item.task for item in found} != set(names):
        raise SystemExit(f"--tasks {args.tasks}: these must be exact-match tasks of the {args.family} family.")
    # the tasks in turn, so that a run stopped part-way has measured every task alike
    per_task = [[item for item in found if item.task == name] for name in names]
    return [item for group in itertools.zip_longest(*per_task) for item in group if item is not None]


def records_for(path: Path, pair, items, args) -> list[dict]:
    """Every item's record, resumed from (and appended to) the JSONL file at `path`."""
    source, target, mapper, tokenizer, _ = pair
    done = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    path.parent.mkdir(parents=True, exist_ok=True)

    def keep(record):
        with path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    asked = [resolve_markup(parse_strategy(text), tokenizer) for text in split_rungs(args.strategies)]
    # a records file keeps the strategies it was first measured with; one asked for later is measured beside it
    # (<set>.strategies.jsonl), against the target's answers the records hold
    held = list(done[0]["strategies"].values()) if done else asked
    records = measure_ladder_items(
        source,
        target,
        mapper,
        tokenizer,
        items,
        probes=args.probes.split(","),
        strategies=held,  # names: measure_ladder_items canonicalizes them
        fractions=[float(f) for f in args.fractions.split(",")],
        done=done[: len(items)],
        on_record=keep,
    )
    flags = {
        "strategies": True,
        "margins": args.margins,
        "token_margins": args.token_margins,
        "source": args.source_answers,
    }
    kinds = [kind for kind, flag in flags.items() if flag]
    return with_side_measurements(path, pair, items, records, measure=kinds, strategies=asked)


def mapped_only(records: list[dict]) -> list[dict]:
    """The records as if only the mapped cache had been measured (the binary guard's choice)."""
    out = []
    for record in records:
        first = sorted(record["answers"])[0]
        out.append(
            {
                **record,
                "strategies": {first: record["strategies"][first]},
                "answers": {first: {"0": record["answers"][first]["0"]}},
                "seconds": {**record["seconds"], "repair": {first: {"0": record["seconds"]["repair"][first]["0"]}}},
            }
        )
    return out


def lost_only(records: list[dict]) -> list[dict]:
    """The records with each answer's `changed` read as *lost*: wrong where the target's own answer is right. An
    answer that differs from the target's but is right, or that replaces a wrong answer of the target's, is not lost,
    so a ladder calibrated on this view holds its budget to the accuracy it loses, not to faithfulness."""
    return [
        {
            **record,
            "answers": {
                strategy: {
                    fraction: {**answer, "changed": bool(record["correct_target"] and not answer["correct"])}
                    for fraction, answer in by_fraction.items()
                }
                for strategy, by_fraction in record["answers"].items()
            },
        }
        for record in records
    ]


def served_accuracy(plan, records: list[dict], strategy: str) -> dict[str, float]:
    """Per task: the share of exact answers served under `plan` (fraction or None per record), the target's, and,
    where every record holds it, the source's (what not switching serves)."""
    out: dict[str, list] = {}
    for fraction, record in zip(plan, records):
        correct = (
            record["correct_target"] if fraction is None else record["answers"][strategy][f"{fraction:g}"]["correct"]
        )
        out.setdefault(record["task"], []).append((correct, record))
    return {
        task: {"served": _share([c for c, _ in pairs]), **_own_scores([r for _, r in pairs])}
        for task, pairs in sorted(out.items())
    }


def _share(flags) -> float:
    return sum(flags) / len(flags)


def _own_scores(records: list[dict]) -> dict[str, float]:
    """The target's exact answers among `records`, and the source's where every record holds it."""
    scores = {"target": _share([r["correct_target"] for r in records])}
    if has_source_answers(records):
        scores["source"] = _share([r["correct_source"] for r in records])
    return scores


def _cost(record: dict, strategy: str, fraction: str) -> float:
    """A fixed repair's cost on one record, over its own prefill: the mapping and the repair."""
    seconds = record["seconds"]
    return (seconds["map"] + seconds["repair"][strategy][fraction]) / seconds["prefill"]


def fixed_points(records: list[dict]) -> dict[str, list[dict]]:
    """Every (strategy, fraction) served to every request, no probe: cost, changed answers and accuracy per task."""
    out = {}
    for strategy in held_strategies(records):
        rows = []
        for fraction in sorted(float(f) for f in records[0]["answers"][strategy]):
            key = f"{fraction:g}"
            cost = sum(_cost(r, strategy, key) for r in records) / len(records)
            per_task = {}
            for task in sorted({r["task"] for r in records}):
                mine = [r for r in records if r["task"] == task]
                per_task[task] = {
                    "mean_cost": sum(_cost(r, strategy, key) for r in mine) / len(mine),
                    "changed": _share([r["answers"][strategy][key]["changed"] for r in mine]),
                    "accuracy": _share([r["answers"][strategy][key]["correct"] for r in mine]),
                    **_own_scores(mine),
                }
            rows.append({"fraction": fraction, "mean_cost": cost, "tasks": per_task})
        out[strategy] = rows
    return out


#: changed-answer budgets the sweep calibrates at (on the selection set), each replayed on the report set
SWEEP = (0.0, 0.025, 0.05, 0.1)


def _same(records: list[dict]) -> list[dict]:
    return records


def _ways(confidence: float | None, checked: bool = False) -> list[tuple[str, object, float | None, bool]]:
    """(name, view of the records, confidence, check) of every calibration compared: the ladder and the binary guard
    with the budget held on the selection items, and with `confidence` also held as an upper confidence bound; the
    ladder with its budget on lost answers instead of changed ones (`lost_only`; at `confidence` where given); and,
    where every record holds the answer margins (`checked`), the ladder with a check after the rung."""
    ways = [("ladder", _same, None, False), ("binary_guard", mapped_only, None, False)]
    if confidence is not None:
        ways += [
            ("ladder_confident", _same, confidence, False),
            ("binary_guard_confident", mapped_only, confidence, False),
        ]
    ways.append(("ladder_lost", lost_only, confidence, False))
    if checked:
        ways.append(("ladder_checked", _same, None, True))
        if confidence is not None:
            ways.append(("ladder_checked_confident", _same, confidence, True))
    return ways


def served_summary(outcome: dict) -> dict:
    """Of a `ladder_outcome`: its worst task's changed answers served, mean cost and rungs' shares."""
    return {
        "worst_changed": max(g["changed_served"] for g in outcome["per_group"].values()),
        "mean_cost": outcome["mean_cost"],
        "rungs": outcome["rungs"],
    }


def calibrated_replay(
    selection: list[dict],
    report: list[dict],
    max_changed: float,
    confidence: float | None,
    check: bool = False,
    check_tokens: tuple[int, ...] = (1,),
) -> dict:
    """The cheapest ladder of `selection` at this budget, replayed on `report` (`served_summary`); with `check`, over
    checks of each number of answer tokens of `check_tokens`."""
    ladder = ladder_from_records(
        selection, max_changed=max_changed, confidence=confidence, check=check, check_tokens=check_tokens
    )
    return served_summary(replay_ladder(ladder, report))


def budget_sweep(
    selection: list[dict],
    report: list[dict],
    confidence: float | None = None,
    checked: bool = False,
    check_tokens: tuple[int, ...] = (1,),
) -> list[dict]:
    """The ladder and the binary guard calibrated at every budget of `SWEEP` on `selection`: what each serves on
    `report` (worst task's changed answers, mean cost). A budget met on the selection set can be exceeded on another."""
    rows = []
    for budget in SWEEP:
        row = {"max_changed": budget}
        for name, view, sure, check in _ways(confidence, checked):
            if sure is not None and budget == 0.0:
                continue  # no number of items vouches for a zero rate
            row[name] = calibrated_replay(view(selection), view(report), budget, sure, check, check_tokens)
        rows.append(row)
    return rows


def served_plan(ladder, records: list[dict]) -> list[float | None]:
    """The rung `ladder` serves each record: its probe's plan, and the fallback where its check sends the record back."""
    plan = ladder.plan([r["risks"][probe_key(ladder.probe)] for r in records], [r["tokens"] for r in records])
    if ladder.min_margin is None:
        return plan
    margins = record_margins(records, strategy_key(ladder.strategy), ladder.check_tokens)
    refused = refused_by_check(margins, ladder.min_margin)
    return [None if f is None or refused[f][i] else f for i, f in enumerate(plan)]


def study(selection: list[dict], report: list[dict], max_changed: float, confidence: float | None = None) -> dict:
    """The ladder and the binary guard calibrated on `selection` (also with the budget held at `confidence`), each
    replayed on `report`, and the fixed points."""
    out = {}
    checked = all(has_margins(r) for r in [*selection, *report])
    # a check over more answer tokens than the first is tried where every record holds each answer token's margin
    check_tokens = CHECK_TOKENS if all(has_margins(r, tokens=2) for r in [*selection, *report]) else (1,)
    for name, view, sure, check in _ways(confidence, checked):
        ladder = ladder_from_records(
            view(selection), max_changed=max_changed, confidence=sure, check=check, check_tokens=check_tokens
        )
        strategy = strategy_key(ladder.strategy)
        plan = served_plan(ladder, report)
        out[name] = {
            "ladder": ladder.to_dict(),
            "selection": ladder.calibration["outcome"],
            "report": replay_ladder(ladder, view(report)),
            "report_accuracy": served_accuracy(plan, report, strategy),
        }
        if view is lost_only:  # what it serves measured as the others are: answers changed from the target's
            out[name]["report_changed"] = replay_ladder(ladder, report)
        if name in GATED:
            out[GATED[name]] = gated_way(ladder, view(selection), view(report))
    out["measured_beside"] = measured_beside(selection, report)
    out["machines"] = {"selection": machines(selection), "report": machines(report)}
    out["budget_sweep"] = budget_sweep(selection, report, confidence, checked, check_tokens)
    out["fixed_report"] = fixed_points(report)
    out["prefill_seconds"] = sum(r["seconds"]["prefill"] for r in report) / len(report)
    out["tokens"] = sum(r["tokens"] for r in report) / len(report)
    return out


def measured_beside(selection: list[dict], report: list[dict]) -> dict[str, dict]:
    """Per strategy measured beside the records after them (`lab.ladder_migration`), per set: how many
    records hold it, the median factor its yardstick put its seconds on the records' clock by (None: timed apart
    from the records' prefills, before yardsticks), and the content hashes of the mappers it was measured with where
    the records name none of their own (a record naming its mapper refuses a measurement with another)."""
    keys = sorted({key for record in [*selection, *report] for key in record.get("measured_beside", [])})
    out = {}
    for key in keys:
        out[key] = {}
        for name, records in (("selection", selection), ("report", report)):
            mine = [r for r in records if key in r.get("measured_beside", [])]
            clocks = [r["clock"][key] for r in mine if key in r.get("clock", {})]
            unnamed = {
                r["mapper_beside"][key] for r in mine if "mapper" not in r and key in r.get("mapper_beside", {})
            }
            out[key][name] = {
                "records": len(mine),
                "clock": statistics.median(clocks) if clocks else None,
                "mappers_unchecked": sorted(unnamed),
            }
    return out


def plot(results: dict, path: str) -> list[list[str]]:
    """Per direction (and report length): the changed answers served against the mean cost of every fixed repair and
    of each calibrated way. Returns each panel's legend labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = list(results["directions"])
    fig, axes = plt.subplots(1, len(directions), figsize=(4.4 * len(directions) + 2.4, 3.8), squeeze=False)
    # the fixed repairs are lines in blues and greys, each calibrated way a marker of its own colour, alike on every
    # panel, so one legend reads all of them
    strategies = sorted({s for data in results["directions"].values() for s in data["fixed_report"]})
    line_colors = dict(zip(strategies, ("tab:blue", "black", "tab:cyan", "tab:olive", "tab:gray")))
    ways = (
        ("binary_guard", "s", "tab:orange"),
        ("ladder", "*", "tab:green"),
        ("binary_guard_confident", "D", "tab:red"),
        ("ladder_confident", "P", "tab:purple"),
        ("ladder_lost", "X", "tab:brown"),
        ("ladder_checked", "v", "tab:pink"),
        ("ladder_checked_confident", "^", "gold"),
    )
    for axis, direction in zip(axes[0], directions):
        data = results["directions"][direction]
        for strategy, rows in data["fixed_report"].items():
            xs = [row["mean_cost"] for row in rows]
            ys = [max(t["changed"] for t in row["tasks"].values()) for row in rows]
            label = f"always {strategy_text(strategy)}"
            axis.plot(xs, ys, marker="o", markersize=3, linewidth=1, color=line_colors.get(strategy), label=label)
        confidence = results["run"].get("confidence")
        for name, marker, color in ways:
            if name not in data:
                continue
            report = changed_outcome(data[name])
            label = name.replace("_confident", f" (bound at {confidence:g})") if name.endswith("_confident") else name
            if name == "ladder_lost":
                label = "ladder, budget on lost answers" + (f" (bound at {confidence:g})" if confidence else "")
            if name.startswith("ladder_checked"):
                bound = f", bound at {confidence:g}" if name.endswith("_confident") else ""
                margin = data[name]["ladder"].get("min_margin")  # None: no check was cheaper on the selection set
                label = f"ladder + check ({'none chosen' if margin is None else f'margin >= {margin:g}'}{bound})"
            worst = max(g["changed_served"] for g in report["per_group"].values())
            axis.plot(
                [report["mean_cost"]], [worst], marker=marker, markersize=11, linestyle="", color=color, label=label
            )
        axis.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
        axis.axhline(results["run"]["max_changed"], color="grey", linewidth=0.8, linestyle=":")
        axis.set_title(f"{direction} (report set)", fontsize=9)
        axis.set_xlabel("mean cost per request (1 = the target's prefill)")
        axis.set_ylim(bottom=0)
    axes[0][0].set_ylabel("changed answers served (worst task)")
    legend = {}  # every panel's entries once (a strategy measured on one report set only is drawn there alone)
    for axis in axes[0]:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    axes[0][-1].legend(legend.values(), legend.keys(), fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    labels = [axis.get_legend_handles_labels()[1] for axis in axes[0]]
    plt.close(fig)
    return labels


def parse_report_tokens(text: str, default_items: int) -> dict[int, int]:
    """`--report-tokens`: `LENGTH[:ITEMS]` comma-separated (e.g. `2048,4096:48`) -> {length: items per task}, in the
    order given; a length without `:ITEMS` takes `--report-items`."""
    out: dict[int, int] = {}
    try:
        for part in text.split(","):
            length, _, items = part.partition(":")
            out[int(length)] = int(items) if items else default_items
    except ValueError:
        raise SystemExit(f"--report-tokens takes lengths like 2048,4096:48; got {text!r}.") from None
    if not all(length > 0 and items > 0 for length, items in out.items()):
        raise SystemExit(f"--report-tokens takes positive lengths and item counts; got {text!r}.")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--directions", default=None, help="source:target pairs (default: tiny-s/m/x -> tiny-l)")
    parser.add_argument("--mapper", default=None, help="mapper folder (one direction; required for --family real)")
    parser.add_argument("--tasks", default=None, help="exact-match tasks (default: recall,chat or the real two)")
    parser.add_argument("--probes", default=PROBES, help="candidate probes, name:tokens, one hold-back")
    parser.add_argument(
        "--strategies",
        default=STRATEGIES,
        help="candidate repair strategies, name[:option=value,...] comma-separated; records measured before with "
        "fewer have the others measured beside them (<set>.strategies.jsonl)",
    )
    parser.add_argument("--fractions", default=FRACTIONS, help="repair fractions measured (0 always)")
    parser.add_argument("--tokens", type=int, default=2048, help="length of the long_chat / long_doc items (real)")
    parser.add_argument(
        "--report-tokens",
        default=None,
        help="report lengths of the long items, LENGTH[:ITEMS] comma-separated (default: --tokens; ITEMS per task "
        "defaults to --report-items): the ladder calibrated at --tokens is replayed at each; a length other than "
        "--tokens is reported as its own entry, '<direction> at <n> tokens'",
    )
    parser.add_argument("--selection-items", type=int, default=60, help="items per task of the calibration set")
    parser.add_argument("--report-items", type=int, default=120, help="items per task of the report set")
    parser.add_argument("--selection-seed", type=int, default=4321)
    parser.add_argument("--report-seed", type=int, default=1234)
    parser.add_argument("--max-changed", type=float, default=0.05, help="changed answers a task may be served")
    parser.add_argument(
        "--confidence",
        type=float,
        default=None,
        help="also calibrate with --max-changed held as an upper confidence bound at this level (e.g. 0.9)",
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="one probe, two strategies, two fractions")
    parser.add_argument(
        "--margins",
        action="store_true",
        help="measure the answer margin of every rung where the records lack it (records of before margins were "
        "recorded; kept beside them as <set>.margins.jsonl)",
    )
    parser.add_argument(
        "--token-margins",
        action="store_true",
        help="measure the margin of every answer token of every rung where the records lack it (kept beside them as "
        "<set>.token_margins.jsonl): what a check over more than the first answer token is calibrated on",
    )
    parser.add_argument(
        "--source-answers",
        action="store_true",
        help="measure the source's own answer where the records lack it (records of before it was recorded; kept "
        "beside them as <set>.source.jsonl): what the share of the source-to-target gap a rung recovers needs",
    )
    parser.add_argument("--cache-dir", default=None, help="`hf-kvmap obtain` cache (--family real)")
    parser.add_argument("--manifest", default=str(REPO / "benchmarks" / "real" / "calibration_manifest.json"))
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "guard_ladder", help="records (resumable)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "guard_ladder.json"))
    parser.add_argument("--plot", default=str(REPO / "benchmarks" / "results" / "guard_ladder.png"))
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.probes, args.strategies, args.fractions = "draft_agreement:2", "tail,source_attention", "0.2,0.5"
    args.tasks = args.tasks or ",".join(TASKS[args.family])
    directions = (args.directions or ",".join(TINY_DIRECTIONS)).split(",")
    if args.mapper and len(directions) > 1:
        raise SystemExit("--mapper names one mapper: give one --directions pair with it.")
    long_items = args.family == "real" and any(name in LONG_TASKS for name in args.tasks.split(","))
    report_lengths = {args.tokens: args.report_items}  # length -> items per task of its report set
    if args.report_tokens is not None:
        if not long_items:
            raise SystemExit(
                f"--report-tokens sets the length of the long tasks {LONG_TASKS}: use --family real with them."
            )
        report_lengths = parse_report_tokens(args.report_tokens, args.report_items)
    results = {
        "run": {
            "what": "the guard ladder: calibrated on the selection set, replayed on the report set, beside the binary "
            "guard and every fixed repair",
            "family": args.family,
            "tasks": args.tasks.split(","),
            "probes": args.probes.split(","),
            "strategies": split_rungs(args.strategies),
            "fractions": [float(f) for f in args.fractions.split(",")],
            "max_changed": args.max_changed,
            "confidence": args.confidence,
            "dtype": args.dtype,
            "selection": {"seed": args.selection_seed, "items_per_task": args.selection_items},
            "report": {"seed": args.report_seed, "items_per_task": args.report_items},
            "tokens": args.tokens if long_items else None,  # of the long items' selection set
            "cost": "seconds of each stage / the item's own target prefill, side by side in this run; every rung "
            "counts the mapping and the probe, a repair its recompute, the fallback the prefill",
            "command": "python -m benchmarks.ladder.guard_ladder " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": _dt.date.today().isoformat(),
        },
        "environment": environment_info(),
        "directions": {},
    }
    for direction in directions:
        pair = load_pair(args, direction)
        tag = direction.replace(":", "-to-")
        found = task_items(args, pair[3], args.selection_items, args.selection_seed, args.tokens)
        print(f"{direction} selection: {len(found)} items", flush=True)
        selection = records_for(args.work / f"{tag}.selection.jsonl", pair, found, args)
        for tokens, items in report_lengths.items():
            found = task_items(args, pair[3], items, args.report_seed, tokens)
            print(f"{direction} report at {tokens} tokens: {len(found)} items", flush=True)
            name = "report" if tokens == args.tokens else f"report-{tokens}"  # the first file keeps its old name
            report = records_for(args.work / f"{tag}.{name}.jsonl", pair, found, args)
            key = tag if tokens == args.tokens else f"{tag} at {tokens} tokens"
            results["directions"][key] = {
                "mapper": str(pair[4]),
                "report_tokens": tokens if long_items else None,
                "report_items_per_task": items,
                **study(selection, report, args.max_changed, args.confidence),
            }
            write_json(args.out, results)
            replayed = results["directions"][key]["ladder"]["report"]
            print(
                f"{key}: ladder on the report set: mean cost {replayed['mean_cost']:.3f}, rungs {replayed['rungs']}, "
                "changed " + ", ".join(f"{t} {g['changed_served']:.3f}" for t, g in replayed["per_group"].items()),
                flush=True,
            )
    plot(results, args.plot)


if __name__ == "__main__":
    main()
