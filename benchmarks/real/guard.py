"""`scale guard`: the guarded handoff's candidate probes on one fitted real mapper, and the markdown of its docs page."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .common import SHORT, SMALL, load_model, load_tokenizer, write_json
from .scale import GUARD_RESULTS, GUARD_TASKS, fitted_mapper, mapper_folder


def cmd_guard(args) -> int:
    """The guarded handoff on real weights: `benchmarks/handoff/handoff.py`'s candidate probes on one fitted mapper, their
    thresholds chosen on the `--seed` items (calibration set) and their rates reported on the `--report-seed` items;
    resumable per set and task. Writes `results/real_family_guard.json`."""
    import handoff as bench

    from hf_kvmap import MapperModel
    from hf_kvmap.real import corpus
    from hf_kvmap.reporting import environment_info
    from lab.real.tasks import real_family_tasks

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    source, target, positions = fitted_mapper(work, args.direction, args.variant, args.positions)
    sets = {"calibration": args.seed, "report": args.report_seed}
    folder = work / "guard" / f"{positions}-{args.variant}-items{args.items}"
    path = folder / f"{args.direction}.json"
    data = json.loads(path.read_text()) if path.is_file() else {"items": args.items, "sets": sets, "rows": {}}
    if data["sets"] != sets:
        raise SystemExit(f"{path} holds the item sets {data['sets']}, not {sets}; pass those seeds or another --work.")
    tokenizer = load_tokenizer(SMALL, args.cache_dir)
    documents = corpus.load_manifest(args.manifest)
    models, mapper = None, None
    for set_name, seed in sets.items():
        for task in real_family_tasks(tokenizer, documents, items=args.items, seed=seed, names=list(GUARD_TASKS)):
            if f"{set_name}/{task.name}" in data["rows"]:
                continue
            if models is None:
                models = {name: load_model(name, args.cache_dir, args.dtype) for name in (source, target)}
                mapper = MapperModel.from_pretrained(mapper_folder(work, positions, args.direction, args.variant))
                mapper = mapper.to(models[target].dtype).eval()
            start = time.perf_counter()
            pairs = [(item.prompt, item.answer + task.stop) for item in task.items]
            rows = bench.item_rows(models[source], models[target], mapper, tokenizer, task.name, pairs)
            data["rows"][f"{set_name}/{task.name}"] = rows
            write_json(path, data)
            print(f"{set_name}/{task.name}: {len(rows)} items ({time.perf_counter() - start:.0f} s)", flush=True)
    settings = argparse.Namespace(work=folder, max_false_alarm=args.max_false_alarm)
    pair = (SHORT[source], SHORT[target])
    try:
        result = bench.analyse(settings, None, directions=[pair], tasks=GUARD_TASKS)
    except ValueError as error:  # e.g. no calibration item kept its answer: no false-alarm rate to choose by
        raise SystemExit(f"{path}: {error}") from error
    result["run"] = {
        "mapper": f"{positions}/{args.direction}/{args.variant}",
        "items_per_task_and_set": args.items,
        "sets": sets,
        "tasks": list(GUARD_TASKS),
        "candidates": list(bench.CANDIDATES),
        "max_false_alarm": args.max_false_alarm,
        "dtype": args.dtype,
        "label": "changed = the greedy answer on the mapped cache differs from the target's own",
    }
    result["environment"] = environment_info()
    write_json(GUARD_RESULTS, result)
    # from the file, as the drift test reads it (non-finite values are null there)
    direction = result["directions"][args.direction]
    print(f"chosen {direction['chosen']}; guarded report set: {json.dumps(direction['guarded_report'])}")
    print(f"wrote {GUARD_RESULTS}")
    return 0


def _share(rate: float | None, count: int) -> str:
    """`3/4` from a rate over `count` items; `-` where there were none."""
    return "-" if rate is None or not count else f"{round(rate * count)}/{count}"


def guard_markdown(result: dict) -> str:
    """The `docs/guard.md` section of the guard on real weights, from `results/real_family_guard.json`."""
    run = result["run"]
    (direction, data), *_ = result["directions"].items()
    tasks = run["tasks"]
    lines = [
        f"Written by `python -m benchmarks.real scale --items {run['items_per_task_and_set']} --seed "
        f"{run['sets']['calibration']} guard --work $WORK/scale --positions {run['mapper'].split('/')[0]} --variant "
        f"{run['mapper'].split('/')[-1]} --report-seed {run['sets']['report']}` from "
        f"`benchmarks/results/real_family_guard.json`: the mapper `{run['mapper']}` ({direction}), "
        f"{run['items_per_task_and_set']} items per task on a calibration set (seed {run['sets']['calibration']}; "
        f"each probe's threshold is chosen there, false alarms <= {run['max_false_alarm']:.0%}, both tasks pooled) "
        f"and as many on a report set (seed {run['sets']['report']}; the rates below). *Changed*: the greedy "
        "answer on the mapped cache differs from the target's own; *caught*: changed answers the probe refuses; "
        "*false alarms*: kept answers it refuses.",
        "",
        "| set / task | items | target alone right | mapped right (hold back 1) | answers changed (hold back 1) |",
        "|---|---|---|---|---|",
    ]
    for name, acc in data["accuracy"].items():
        n = acc["items"]
        lines.append(
            f"| {name} | {n} | {_share(acc['target_own'], n)} | {_share(acc['mapped']['1'], n)} | "
            f"{_share(acc['changed']['1'], n)} |"
        )
    head = " | ".join(f"caught {t}" for t in tasks) + " | " + " | ".join(f"false alarms {t}" for t in tasks)
    lines += [
        "",
        f"| probe | hold back | threshold | {head} | AUC {' / '.join(tasks)} |",
        "|---|---|---|" + "---|" * (2 * len(tasks) + 1),
    ]
    for name, probe in data["probes"].items():
        report = probe["report"]
        caught = [_share(report[t]["true_alarm"], report[t]["changed"]) for t in tasks]
        false = [_share(report[t]["false_alarm"], report[t]["kept"]) for t in tasks]
        aucs = " / ".join("-" if probe["auc"][t] is None else f"{probe['auc'][t]:.2f}" for t in tasks)
        threshold = "-" if probe["threshold"] is None else f"{probe['threshold']:.4g}"
        lines.append(f"| {name} | {probe['hold_back']} | {threshold} | {' | '.join(caught + false)} | {aucs} |")
    guarded = data["guarded_report"]
    served = "; ".join(
        f"{t}: right {guarded[t]['accuracy']:.0%}, fallback {guarded[t]['fallback_rate']:.0%}, changed answers "
        f"served {guarded[t]['changed_answers_served']:.0%}"
        for t in tasks
    )
    lines += [
        "",
        "Chosen on the calibration set (the first in the table that catches 80 % of its changed answers, else the "
        f"one that catches the most; probe costs are not measured here): `{data['chosen']}`. Guarded serving on the "
        f"report set (the mapped answer where it accepts, the target's own prefill where it refuses): {served}.",
    ]
    return "\n".join(lines)
