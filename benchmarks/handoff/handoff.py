"""Guarded handoff: which probe predicts that the mapped cache changes the target's answer, at what cost, and what a
request saves in the end.

Stages (each resumable; `all` runs them in order):

  items    For every shipped direction and the family's generation tasks (recall, chat), on two disjoint item sets
           (`calibration` and `report`, different seeds): the target's own greedy answer, the answer on the mapped
           cache (with the hold-back each probe needs), and every candidate probe's risk. One checkpoint per direction
           in `--work`.
  costs    At `--tokens` (1,024) tokens, in one run, interleaved, medians: the target's re-prefill (what a handoff
           avoids), the mapper, each probe, the source draft, and saving + loading the mapped cache as safetensors.
  report   Per direction: ROC (every threshold) per task and probe on the report set; the threshold calibrated on the
           calibration set (false alarms <= `--max-false-alarm`, both tasks pooled) and its true/false-alarm rates on
           the report set; the probe chosen per direction (the most changed answers caught on the calibration set
           within the false-alarm budget: the cheapest probe that catches 80 %, else the one that catches the most); net
           saving per request. `--write-configs` stores the
           chosen probe and threshold in the shipped mappers' `config.json` (`handoff_probe`).

    OMP_NUM_THREADS=1 python -m benchmarks.handoff.handoff all --write-configs
    python -m benchmarks.handoff.handoff report          # re-analyse the checkpoints

Writes `benchmarks/results/handoff.json` and `benchmarks/results/handoff_roc.png`.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_kvmap import MapperModel, cache_kwargs, output_cache, zoo
from hf_kvmap.calibration.probe_thresholds import auc, calibrate_probe, calibrate_threshold, roc_curve
from hf_kvmap.delivery import load_cache, save_cache
from hf_kvmap.reporting import environment_info, write_json
from hf_kvmap.serving.pipeline import prepare_context, target_prefill
from hf_kvmap.serving.probes import fit_linear_probe, probe_from_dict
from hf_kvmap.zoo import corpus, mapper_path

REPO = Path(__file__).resolve().parents[2]
DIRECTIONS = (("tiny-s", "tiny-l"), ("tiny-m", "tiny-l"), ("tiny-x", "tiny-l"), ("tiny-l", "tiny-s"))
TASKS = {"recall": "\n", "chat": corpus.END}
SETS = {"calibration": 11, "report": 12}
CANDIDATES = (
    {"name": "tail_nll", "tokens": 16},
    {"name": "draft_agreement", "tokens": 4},
    {"name": "draft_agreement", "tokens": 2},
    {"name": "confident_draft", "tokens": 4},
    {"name": "confident_draft", "tokens": 2},
    {"name": "lookahead_margin", "tokens": 1},
    {"name": "lookahead_margin", "tokens": 4},
    {"name": "prefix_audit", "tokens": 48},
)


def key(settings: dict) -> str:
    return f"{settings['name']}:{settings['tokens']}"


def direction_name(source: str, target: str) -> str:
    return f"{source}-to-{target}"


def load_direction(source: str, target: str):
    mapper = MapperModel.from_pretrained(str(mapper_path(source, target))).eval()  # as shipped (dtype included)
    return zoo.load_model(source), zoo.load_model(target), mapper


@torch.no_grad()
def greedy(model, ids, cache, steps: int) -> list[int]:
    out = model.generate(
        ids, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0, **cache_kwargs(cache)
    )
    return out[0, ids.shape[1] :].tolist()


# ----------------------------------------------------------------------------------------------------------- items
@torch.no_grad()
def item_row(source, target, mapper, ids: torch.Tensor, gold: list[int], probes=None) -> dict:
    """One item: the target's own greedy answer (as many tokens as `gold`), the answer on the mapped cache at each
    hold-back the probes need (changed from the target's own? correct?), and every probe's risk."""
    probes = probes or [probe_from_dict(settings) for settings in CANDIDATES]
    steps = len(gold)
    own = greedy(target, ids, target_prefill(target, ids), steps)
    row = {"tokens": ids.shape[1], "own_correct": own == gold, "changed": {}, "mapped_correct": {}, "risk": {}}
    for hold_back in sorted({probe.hold_back for probe in probes}):
        source_cache = output_cache(source(input_ids=ids, use_cache=True))
        context = prepare_context(source, target, mapper, ids, source_cache=source_cache, hold_back=hold_back)
        for probe in probes:
            if probe.hold_back == hold_back:
                row["risk"][key(probe.settings())] = float(probe.risks(context)[0])
        mapped = greedy(target, ids, context.cache, steps)
        row["changed"][str(hold_back)] = mapped != own
        row["mapped_correct"][str(hold_back)] = mapped == gold
    return row


def item_rows(source, target, mapper, tokenizer, task: str, pairs: list[tuple[str, str]]) -> list[dict]:
    """`item_row` of every `(prompt, expected continuation)` pair of `task` (the continuation is the answer followed
    by the task's stop string; the prompt is tokenized with the tokenizer's special tokens, the continuation without)."""
    from tqdm.auto import tqdm

    probes = [probe_from_dict(settings) for settings in CANDIDATES]
    rows = []
    for prompt, expected in tqdm(pairs, desc=task, leave=False):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        gold = tokenizer(expected, add_special_tokens=False)["input_ids"]
        rows.append(item_row(source, target, mapper, ids, gold, probes))
    return rows


def run_items(args) -> None:
    tokenizer = zoo.load_tokenizer()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for source_name, target_name in DIRECTIONS:
        path = work / f"{direction_name(source_name, target_name)}.json"
        if path.exists():
            print(f"{path} exists, skipping", flush=True)
            continue
        source, target, mapper = load_direction(source_name, target_name)
        result = {}
        for set_name, seed in SETS.items():
            for task in TASKS:
                items = corpus.make_eval_set(task, args.items, seed=seed)
                pairs = [(item.context, item.answer + TASKS[task]) for item in items]
                result[f"{set_name}/{task}"] = item_rows(source, target, mapper, tokenizer, task, pairs)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"items": args.items, "sets": SETS, "rows": result}))
        tmp.replace(path)
        print(f"wrote {path}", flush=True)


@torch.no_grad()
def run_augment(args) -> None:
    """Add the risks of candidates missing from existing checkpoints (same items, same seeds), in place."""
    tokenizer = zoo.load_tokenizer()
    from tqdm.auto import tqdm

    for source_name, target_name in DIRECTIONS:
        path = Path(args.work) / f"{direction_name(source_name, target_name)}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        missing = [
            s for s in CANDIDATES if any(key(s) not in r["risk"] for rows in data["rows"].values() for r in rows)
        ]
        if not missing:
            continue
        source, target, mapper = load_direction(source_name, target_name)
        probes = [probe_from_dict(settings) for settings in missing]
        for set_name, seed in data["sets"].items():
            for task in TASKS:
                items = corpus.make_eval_set(task, data["items"], seed=seed)
                rows = data["rows"][f"{set_name}/{task}"]
                for item, row in tqdm(list(zip(items, rows)), desc=f"{set_name}/{task}", leave=False):
                    ids = torch.tensor([tokenizer(item.context)["input_ids"]])
                    assert ids.shape[1] == row["tokens"], "checkpoint and items disagree"
                    for probe, settings in zip(probes, missing):
                        source_cache = output_cache(source(input_ids=ids, use_cache=True))
                        context = prepare_context(
                            source, target, mapper, ids, source_cache=source_cache, hold_back=probe.hold_back
                        )
                        row["risk"][key(settings)] = float(probe.risks(context)[0])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
        print(f"added {[key(s) for s in missing]} to {path}", flush=True)


# ----------------------------------------------------------------------------------------------------------- costs
def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.no_grad()
def direction_costs(source, target, mapper, ids: torch.Tensor, args) -> dict:
    """Interleaved medians (ms) of every cost of one request at `ids.shape[1]` tokens."""
    import tempfile

    probes = [probe_from_dict(settings) for settings in CANDIDATES]
    source_cache = output_cache(source(input_ids=ids, use_cache=True))
    context = prepare_context(source, target, mapper, ids, source_cache=source_cache, hold_back=1)
    path = Path(tempfile.mkdtemp()) / "cache.safetensors"
    upcast = copy.deepcopy(mapper).float()  # the same weights in float32: a serving choice, timed for reference
    jobs = {
        "target_prefill": lambda: target_prefill(target, ids),
        "map": lambda: prepare_context(source, target, mapper, ids, source_cache=source_cache, hold_back=1),
        "map_float32": lambda: prepare_context(source, target, upcast, ids, source_cache=source_cache, hold_back=1),
        "save": lambda: save_cache(context.cache, path, input_ids=ids),
        "load": lambda: load_cache(path, input_ids=ids),
    }
    audit = probe_from_dict(EXACT_AUDIT)
    jobs[key(EXACT_AUDIT)] = lambda: audit.risks(context)
    for probe, settings in zip(probes, CANDIDATES):
        if probe.hold_back > 1:  # timed as the map with the longer hold-back plus the target's tail run
            jobs[key(settings) + "+map"] = lambda h=probe.hold_back: prepare_context(
                source, target, mapper, ids, source_cache=source_cache, hold_back=h
            )
        else:
            jobs[key(settings)] = lambda p=probe: p.risks(context)
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(args.warmup + args.repeats):
        for name, job in jobs.items():
            times[name].append(timed(job))
    medians = {name: 1000 * statistics.median(values[args.warmup :]) for name, values in times.items()}
    for probe, settings in zip(probes, CANDIDATES):
        if probe.hold_back > 1:
            medians[key(settings)] = max(medians.pop(key(settings) + "+map") - medians["map"], 0.0)
    return {
        "tokens": ids.shape[1],
        "median_ms": medians,
        "cache_bytes": path.stat().st_size,
        "mapper_dtype": str(next(mapper.parameters()).dtype).removeprefix("torch."),
        "probe_target_tokens": {
            key(s): p.target_tokens(ids.shape[1]) for p, s in zip(probes + [audit], CANDIDATES + (EXACT_AUDIT,))
        },
    }


def run_costs(args) -> dict:
    tokenizer = zoo.load_tokenizer()
    text = "".join(corpus.calibration_text(n_docs=8, seed=5, n_chars=args.tokens + 64))
    ids = torch.tensor([tokenizer(text)["input_ids"][: args.tokens]])
    if ids.shape[1] < args.tokens:
        raise SystemExit(f"calibration text gave only {ids.shape[1]} tokens")
    out = {}
    for source_name, target_name in DIRECTIONS:
        name = direction_name(source_name, target_name)
        out[name] = direction_costs(*load_direction(source_name, target_name), ids, args)
        print(name, {k: round(v, 2) for k, v in out[name]["median_ms"].items()}, flush=True)
    return out


# ---------------------------------------------------------------------------------------------------------- report
#: linear combinations of hold-back-1 probes, fitted by logistic regression on the calibration set of each direction
COMBINATIONS = {
    "linear:cdraft4+look1": ({"name": "confident_draft", "tokens": 4}, {"name": "lookahead_margin", "tokens": 1}),
    "linear:cdraft4+look4": ({"name": "confident_draft", "tokens": 4}, {"name": "lookahead_margin", "tokens": 4}),
    "linear:all": tuple(settings for settings in CANDIDATES if probe_from_dict(settings).hold_back == 1),
}
#: the issue's targets: catch this share of changed answers within the false-alarm budget
MIN_CAUGHT = 0.8
EXACT_AUDIT = {"name": "prefix_audit", "tokens": 8}


def rates(risks, labels, threshold) -> dict:
    pos = [r for r, lab in zip(risks, labels) if lab]
    neg = [r for r, lab in zip(risks, labels) if not lab]
    return {
        "changed": len(pos),
        "kept": len(neg),
        "true_alarm": sum(r > threshold for r in pos) / len(pos) if pos else None,
        "false_alarm": sum(r > threshold for r in neg) / len(neg) if neg else None,
        "refused": sum(r > threshold for r in risks) / len(risks),
    }


def scored_candidates(rows: dict, tasks=TASKS) -> dict:
    """Per candidate: settings, hold-back, and per `set/task` the risks and labels (the answer changed); the linear
    combinations are fitted on the calibration set of `tasks`."""
    out = {}
    for settings in CANDIDATES:
        probe = probe_from_dict(settings)
        out[key(settings)] = {
            "settings": settings,
            "hold_back": probe.hold_back,
            "risks": {name: [r["risk"][key(settings)] for r in items] for name, items in rows.items()},
            "labels": {name: [r["changed"][str(probe.hold_back)] for r in items] for name, items in rows.items()},
        }
    for combo, components in COMBINATIONS.items():
        calibration = [f"calibration/{task}" for task in tasks]
        features = [[r["risk"][key(c)] for c in components] for name in calibration for r in rows[name]]
        labels = [r["changed"]["1"] for name in calibration for r in rows[name]]
        probe = fit_linear_probe(list(components), features, labels)
        out[combo] = {
            "settings": probe.settings(),
            "hold_back": 1,
            "risks": {
                name: [
                    probe.bias + sum(w * r["risk"][key(c)] for w, c in zip(probe.weights, components)) for r in items
                ]
                for name, items in rows.items()
            },
            "labels": {name: [r["changed"]["1"] for r in items] for name, items in rows.items()},
        }
    return out


def candidate_cost(settings: dict, cost: dict) -> float:
    """Median ms of a probe at the costs' length, plus the audit `handoff` runs before every probe."""
    probe = probe_from_dict(settings)
    if probe.name == "linear":
        total = sum(cost[key(component.settings())] for component in probe.components)
    else:
        total = cost[key(settings)]
    return total + cost[key(EXACT_AUDIT)]  # handoff audits every mapping before the probe


def candidate_tokens(settings: dict, tokens: int) -> int:
    probe = probe_from_dict(settings)
    return probe.target_tokens(tokens) + probe_from_dict(EXACT_AUDIT).target_tokens(tokens)


def items_per_set(args) -> int | None:
    """Items per task and set, as the checkpoints record them."""
    counts = {json.loads(path.read_text())["items"] for path in Path(args.work).glob("*.json")}
    if len(counts) > 1:
        raise SystemExit(f"the checkpoints in {args.work} hold different item counts {sorted(counts)}")
    return counts.pop() if counts else None


def analyse(args, costs: dict | None, directions=DIRECTIONS, tasks=TASKS) -> dict:
    """Per direction of `directions` (the checkpoints `args.work/<source>-to-<target>.json` of `tasks`): every
    candidate's threshold from the calibration set, its rates and ROC on the report set, the chosen probe, accuracy
    and guarded serving on the report set, and the net saving per request where `costs` has the direction."""
    work = Path(args.work)
    result = {"directions": {}}
    for source_name, target_name in directions:
        name = direction_name(source_name, target_name)
        path = work / f"{name}.json"
        if not path.exists():
            print(f"missing {path}; run the items stage", flush=True)
            continue
        rows = json.loads(path.read_text())["rows"]
        probes = {}
        for probe_key, scored in scored_candidates(rows, tasks).items():

            def pooled(set_name, scored=scored):
                names = [f"{set_name}/{task}" for task in tasks]
                return sum((scored["risks"][n] for n in names), []), sum((scored["labels"][n] for n in names), [])

            calib_risks, calib_labels = pooled("calibration")
            threshold = calibrate_threshold(calib_risks, calib_labels, args.max_false_alarm)
            report_risks, report_labels = pooled("report")
            entry = {
                "settings": scored["settings"],
                "hold_back": scored["hold_back"],
                "threshold": threshold,
                "calibration": rates(calib_risks, calib_labels, threshold),
                "report": {"pooled": rates(report_risks, report_labels, threshold)},
                "roc": {},
                "auc": {"pooled": auc(report_risks, report_labels)},
            }
            for task in tasks:
                risks, labels = scored["risks"][f"report/{task}"], scored["labels"][f"report/{task}"]
                entry["report"][task] = rates(risks, labels, threshold)
                curve = roc_curve(risks, labels)
                entry["roc"][task] = {
                    field: [round(row[field], 6) for row in curve]
                    for field in ("threshold", "true_alarm", "false_alarm")
                }
                entry["auc"][task] = auc(risks, labels)
            if costs and name in costs:
                cost = costs[name]["median_ms"]
                entry["cost_ms"] = candidate_cost(scored["settings"], cost)
                entry["cost_fraction_of_prefill"] = entry["cost_ms"] / cost["target_prefill"]
                entry["target_token_fraction"] = (
                    candidate_tokens(scored["settings"], costs[name]["tokens"]) / costs[name]["tokens"]
                )
            entry["_risks"], entry["_labels"] = scored["risks"], scored["labels"]
            probes[probe_key] = entry

        def rank(item):
            # the cheapest probe that catches MIN_CAUGHT of the changed calibration answers; if none does, the one
            # that catches the most (to 0.01), then the cheapest
            entry = item[1]
            caught = round(entry["calibration"]["true_alarm"] or 0.0, 2)
            meets = caught >= MIN_CAUGHT
            return (not meets, 0.0 if meets else -caught, entry.get("cost_ms", 0.0))

        chosen_key, chosen = sorted(probes.items(), key=rank)[0]
        direction = {
            "source": source_name,
            "target": target_name,
            "probes": probes,
            "chosen": chosen_key,
            "chosen_meets_catch_target": round(chosen["calibration"]["true_alarm"] or 0.0, 2) >= MIN_CAUGHT,
            "accuracy": {},
        }
        if "cost_fraction_of_prefill" in chosen:  # only where the probes' costs were measured
            direction["chosen_within_cost_budget"] = chosen["cost_fraction_of_prefill"] <= args.max_cost_fraction
        for set_name in SETS:
            for task in tasks:
                task_rows = rows[f"{set_name}/{task}"]
                direction["accuracy"][f"{set_name}/{task}"] = {
                    "items": len(task_rows),
                    "target_own": sum(r["own_correct"] for r in task_rows) / len(task_rows),
                    "mapped": {
                        h: sum(r["mapped_correct"][h] for r in task_rows) / len(task_rows)
                        for h in task_rows[0]["mapped_correct"]
                    },
                    "changed": {
                        h: sum(r["changed"][h] for r in task_rows) / len(task_rows) for h in task_rows[0]["changed"]
                    },
                }
        # Guarded serving on the report set: the mapped answer when accepted, the target's own when refused.
        hold_back = str(chosen["hold_back"])
        guarded = {}
        for task in tasks:
            task_rows = rows[f"report/{task}"]
            refused = [risk > chosen["threshold"] for risk in chosen["_risks"][f"report/{task}"]]
            served = [r["own_correct"] if no else r["mapped_correct"][hold_back] for r, no in zip(task_rows, refused)]
            changed = [r["changed"][hold_back] and not no for r, no in zip(task_rows, refused)]
            guarded[task] = {
                "accuracy": sum(served) / len(served),
                "changed_answers_served": sum(changed) / len(changed),
                "fallback_rate": sum(refused) / len(refused),
            }
        direction["guarded_report"] = guarded
        if costs and name in costs:
            cost = costs[name]["median_ms"]
            fallback = chosen["report"]["pooled"]["refused"]
            spent = cost["map"] + chosen["cost_ms"] + cost["save"] + cost["load"]
            direction["cost_per_request_ms"] = {
                "tokens": costs[name]["tokens"],
                "target_prefill_avoided": cost["target_prefill"],
                "mapper": cost["map"],
                "probe": chosen["cost_ms"],
                "transport_save_load": cost["save"] + cost["load"],
                "fallback_rate": fallback,
                "expected_fallback": fallback * cost["target_prefill"],
                "net_saving": cost["target_prefill"] - spent - fallback * cost["target_prefill"],
                "net_saving_fraction": (cost["target_prefill"] - spent - fallback * cost["target_prefill"])
                / cost["target_prefill"],
                "net_saving_same_host": cost["target_prefill"]
                - (cost["map"] + chosen["cost_ms"])
                - fallback * cost["target_prefill"],
                "cache_bytes": costs[name]["cache_bytes"],
                "mapper_dtype": costs[name].get("mapper_dtype"),
            }
            if "map_float32" in cost:
                direction["cost_per_request_ms"]["mapper_float32"] = cost["map_float32"]
                direction["cost_per_request_ms"]["net_saving_float32_mapper"] = (
                    cost["target_prefill"] - (cost["map_float32"] + chosen["cost_ms"] + cost["save"] + cost["load"])
                ) - fallback * cost["target_prefill"]
        for entry in probes.values():
            entry.pop("_risks"), entry.pop("_labels")
        result["directions"][name] = direction
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["directions"])
    fig, axes = plt.subplots(len(TASKS), len(names), figsize=(4 * len(names), 4 * len(TASKS)), squeeze=False)
    for col, name in enumerate(names):
        direction = result["directions"][name]
        for row, task in enumerate(TASKS):
            ax = axes[row][col]
            for probe_key, entry in direction["probes"].items():
                roc = sorted(zip(entry["roc"][task]["false_alarm"], entry["roc"][task]["true_alarm"]))
                ax.plot(
                    [fa for fa, _ in roc],
                    [ta for _, ta in roc],
                    label=f"{probe_key} (AUC {entry['auc'][task]:.2f})",
                    lw=2.5 if probe_key == direction["chosen"] else 1.0,
                )
            ax.axvline(0.1, color="gray", ls=":")
            ax.axhline(0.8, color="gray", ls=":")
            ax.set_title(f"{name} / {task} (report set)", fontsize=9)
            ax.set_xlabel("false alarms (answer kept, refused)")
            ax.set_ylabel("caught (answer changed, refused)")
            ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=70)


def write_configs(result: dict, args) -> None:
    for name, direction in result["directions"].items():
        chosen = direction["probes"][direction["chosen"]]
        folder = mapper_path(direction["source"], direction["target"])
        config_path = folder / "config.json"
        rows = json.loads((Path(args.work) / f"{name}.json").read_text())["rows"]
        scored = scored_candidates(rows)[direction["chosen"]]
        names = [f"calibration/{task}" for task in TASKS]
        risks = sum((scored["risks"][n] for n in names), [])
        labels = sum((scored["labels"][n] for n in names), [])
        mapper = MapperModel.from_pretrained(str(folder))
        stored = calibrate_probe(
            mapper,
            chosen["settings"],
            risks,
            labels,
            max_false_alarm=args.max_false_alarm,
            provenance={
                "tasks": list(TASKS),
                "items_per_task": len(rows["calibration/recall"]),
                "seed": SETS["calibration"],
                "source": "benchmarks/handoff/handoff.py",
            },
        )
        config = json.loads(config_path.read_text())
        config["handoff_probe"] = stored
        tmp = config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tmp.replace(config_path)
        # the card shows the guard: re-render it (the library's one card writer) and its copy in model_cards/
        card = MapperModel.from_pretrained(str(folder)).write_card(folder)
        (REPO / "model_cards" / f"{name}.md").write_text(card.read_text().rstrip("\n"))
        print(f"{config_path}: handoff_probe = {stored['probe']} threshold {stored['threshold']:.4g}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("items", "augment", "costs", "report", "all"))
    parser.add_argument("--items", type=int, default=150, help="items per task and set")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-false-alarm", type=float, default=0.1)
    parser.add_argument("--max-cost-fraction", type=float, default=0.05, help="probe cost budget (of re-prefill)")
    parser.add_argument("--work", default=str(REPO / "benchmarks" / "results" / "handoff_items"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "handoff.json"))
    parser.add_argument("--plot", default=str(REPO / "benchmarks" / "results" / "handoff_roc.png"))
    parser.add_argument("--costs-file", default=str(REPO / "benchmarks" / "results" / "handoff_costs.json"))
    parser.add_argument("--write-configs", action="store_true", help="store the chosen probes in the shipped mappers")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.stage in ("items", "all"):
        run_items(args)
    if args.stage in ("augment", "all"):
        run_augment(args)
    costs = None
    if args.stage in ("costs", "all"):
        costs = run_costs(args)
        write_json(args.costs_file, {"environment": environment_info(), "costs": costs})
    if args.stage in ("report", "all"):
        if costs is None and Path(args.costs_file).exists():
            costs = json.loads(Path(args.costs_file).read_text())["costs"]
        result = analyse(args, costs)
        result.update(
            {
                "run": {
                    "command": "python -m benchmarks.handoff.handoff "
                    + " ".join(argv if argv is not None else sys.argv[1:]),
                    "items_per_task_and_set": items_per_set(args),
                    "sets": SETS,
                    "tasks": list(TASKS),
                    "candidates": list(CANDIDATES),
                    "max_false_alarm": args.max_false_alarm,
                    "max_cost_fraction": args.max_cost_fraction,
                    "label": "changed = the greedy answer on the mapped cache differs from the target's own",
                },
                "environment": environment_info(),
            }
        )
        write_json(args.out, result)
        plot(result, Path(args.plot))
        if args.write_configs:
            write_configs(result, args)
        print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
