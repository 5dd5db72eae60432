"""Which map carries the context: several fitted maps of one pair served on the same items in one run, each beside
the sparse prefill of the same positions (no map), the target's own prefill computed once for all of them.

Per item, as `benchmarks.switch.long_switch` measures it: the target alone, the source alone, each rung's sparse prefill
(map-free: the same for every map) and, for every map, the mapped cache and each rung's repair of it. The shared arms
are measured once, with the first map, and written into every map's row, so each map's records file is a complete
`benchmarks.switch.long_switch` records file (its report and `benchmarks.sealed.report` read it alone) and two maps compare
item by item. A rerun resumes: an item is measured again only for the maps whose file lacks it, and a rerun that
finds every item measured writes nothing. A map added later
takes the shared arms from the maps measured before it (`--shared-from ridge-k8-5k`, selection runs only), so only
its own arms cost time.

    python -m benchmarks.switch.map_compare --maps ridge-k8-5k=$A,ridge-k8-conv=$B --tasks ruler_vt,chat_split \
        --tokens 4096 --items 8 --seed 4321 --dtype bfloat16 \
        --rungs 'query_overlap:fill=draft_branches@0.1,sparse:query_overlap:fill=draft_branches@0.1' \
        --records-dir benchmarks/results/map-choice/4096
    python -m benchmarks.switch.map_compare --summary --records-dir benchmarks/results/map-choice/4096

Made for choosing among maps on selection items (no protocol: the items and seed given), and for reporting the maps of
sealed protocols side by side (`--protocol A.json[,B.json]`: every map a label of one protocol's `maps`, the
protocols agreeing on every choice a shared run serves, each map's records stamped with its protocol's sha256 as
`benchmarks.switch.long_switch --protocol` stamps them), e.g. a new map's protocol beside the protocol of the map it is
measured against, on the same items.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_kvmap.reporting import environment_info

from ..sealed.protocol import SPARSE
from . import long_switch, long_switch_report
from .long_switch_args import parse_rung, split_rungs
from .long_switch_runner import Runner, target_tokenizer

SHARED = ("target", "source")  # and every sparse arm: none of them reads a map


def parse_maps(text: str, least: int = 2) -> dict[str, Path]:
    """`label=folder,label=folder` -> `{label: folder}` (at least `least` maps, distinct labels, folders that exist)."""
    maps: dict[str, Path] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        label, sep, folder = entry.partition("=")
        if not sep or not label or not folder:
            raise SystemExit(f"--maps entry {entry!r}: write label=folder (e.g. ridge-k8-5k=$WORK/mappers/...)")
        if label in maps:
            raise SystemExit(f"--maps: the label {label!r} is given twice")
        if not Path(folder).expanduser().is_dir():
            raise SystemExit(f"--maps {label}: {folder} is not a folder (a fitted map's folder, with config.json)")
        maps[label] = Path(folder).expanduser()
    if len(maps) < least:
        raise SystemExit(
            f"--maps {text!r}: name at least two maps to compare (one map: benchmarks.switch.long_switch, or one "
            "map beside a map measured earlier on the same items: --shared-from)"
        )
    return maps


def stamps_of(args, labels: list[str]) -> dict[str, str]:
    """`--protocol A.json[,B.json]`: apply the first protocol's choices to `args` (as `benchmarks.switch.long_switch
    --protocol` does) and return `{label: sha256 of the protocol whose maps hold it}`. Every label must be a map of
    exactly one protocol, and the protocols must agree on everything a shared run serves: direction, dtype, rungs, the
    rung the verdicts read, and the cells of the tasks and length asked (seed, items)."""
    from ..sealed.protocol import ProtocolError, load_protocol

    paths = [path for path in args.protocol.split(",") if path]
    try:
        protocols = [load_protocol(path) for path in paths]
    except ProtocolError as err:
        raise SystemExit(f"--protocol: {err}") from None
    owners = {label: [p for p in protocols if label in p.settings["maps"]] for label in labels}
    for label, found in owners.items():
        if len(found) != 1:
            known = sorted({m for p in protocols for m in p.settings["maps"]})
            where = "none" if not found else ", ".join(p.path for p in found)
            raise SystemExit(f"--maps {label}: a map of exactly one protocol is needed ({where}); their maps: {known}")
    first = protocols[0]
    args.protocol, args.map = first.path, next(label for label in labels if owners[label][0] is first)
    long_switch.apply_protocol(args)
    for other in protocols[1:]:
        for name in ("direction", "dtype", "rungs", "chosen"):
            if other.settings[name] != first.settings[name]:
                raise SystemExit(f"--protocol: {other.path} and {first.path} differ in {name}; run them apart.")
        for task in args.tasks.split(","):
            try:
                mine, theirs = first.cell(task, args.tokens), other.cell(task, args.tokens)
            except ProtocolError as err:
                raise SystemExit(f"--tasks: {err}") from None
            if (mine["seed"], mine["items"]) != (theirs["seed"], theirs["items"]):
                raise SystemExit(f"--protocol: {other.path} and {first.path} build other {task} items; run apart.")
    return {label: owners[label][0].sha256 for label in labels}


def shared_rows(out: Path, labels: str | None, args) -> dict[str, list[dict]]:
    """`--shared-from A[,B]`: `{key: [row, ...]}` of maps measured earlier on the same items (`out/A.jsonl`), whose
    shared arms (the target, the source, the sparse prefills: none reads a map) a new map's rows take instead of
    measuring them again. Their rows must be of the same dtype and direction. The arms keep the run that measured
    them, so a report compares first tokens only within a run; sealed runs (`--protocol`) measure every arm side by
    side and refuse it."""
    found: dict[str, list[dict]] = {}
    for label in filter(None, (labels or "").split(",")):
        path = out / f"{label}.jsonl"
        if not path.is_file():
            raise SystemExit(f"--shared-from {label}: {path} does not exist (a map's records file in --records-dir)")
        for key, row in long_switch_report.load(path).items():
            setup = row.get("setup", {})
            if (setup.get("dtype"), setup.get("direction")) != (args.dtype, args.direction):
                raise SystemExit(
                    f"--shared-from {label}: {key} was measured in {setup.get('dtype')} {setup.get('direction')}, "
                    f"this run is {args.dtype} {args.direction}; share arms only between runs of one setting"
                )
            found.setdefault(key, []).append(row)
    return found


def shared(arm: str) -> bool:
    return arm in SHARED or arm.startswith(SPARSE)


def run(args) -> None:
    from hf_kvmap import MapperModel
    from hf_kvmap.repair import resolve_markup

    maps = parse_maps(args.maps, least=1 if args.shared_from else 2)
    tokenizer = target_tokenizer(args)
    rungs = {}
    for entry in split_rungs(args.rungs):
        label, settings, fraction, refresh = parse_rung(entry)
        rungs[label] = (label, resolve_markup(settings, tokenizer), fraction, refresh)
    torch.set_num_threads(args.threads)
    args.mapper = str(maps[next(iter(maps))])
    runner = Runner(args, tokenizer)
    dtype = getattr(torch, args.dtype)
    mappers = {label: MapperModel.from_pretrained(folder, dtype=dtype) for label, folder in maps.items()}
    items = long_switch.build_items(runner.tokenizer, args)
    compare(runner, mappers, items, rungs, Path(args.records_dir), args)


def compare(runner, mappers: dict, items: list[dict], rungs: dict, out: Path, args) -> None:
    """Serve `items` with every map of `mappers` (`{label: MapperModel}`) through `runner` (a
    `benchmarks.switch.long_switch_runner.Runner`), appending one row an item to `out/<label>.jsonl` (resumes what is there)."""
    out.mkdir(parents=True, exist_ok=True)
    records = {}
    for label in mappers:
        path = out / f"{label}.jsonl"
        records[label] = long_switch_report.load(path, resume=True) if path.is_file() else {}
    earlier = shared_rows(out, getattr(args, "shared_from", None), args)
    arms = ["target", "mapped", *rungs, "source"]
    own = [arm for arm in arms if not shared(arm)]
    setups = {
        label: {"mapper": m.config.content_hash, "dtype": args.dtype, "direction": args.direction, "map": label}
        for label, m in mappers.items()
    }
    for label, stamp in getattr(args, "stamps", {}).items():  # as long_switch stamps a protocol's records
        setups[label].update(protocol=stamp)
    waiting: dict[str, list[str]] = {}  # key -> the maps that still lack an arm of it, in the maps' order
    for label in mappers:  # an item stored under another setup is refused here, before anything is written
        for item in long_switch.unmeasured(args, items, records[label], arms, setups[label], out / f"{label}.jsonl"):
            waiting.setdefault(long_switch.key_of(args, item), []).append(label)
    items = [item for item in items if long_switch.key_of(args, item) in waiting]
    if not items:  # a finished run writes nothing: no run line, no warm-up
        print(f"{out}: every item of {args.tasks} at {args.tokens} holds every arm of every map; nothing to measure")
        return
    run_info = {
        "id": time.strftime("%Y%m%dT%H%M%S"),
        "command": "python -m benchmarks.switch.map_compare " + " ".join(sys.argv[1:]),
        "environment": environment_info(),
    }
    for label in mappers:
        with (out / f"{label}.jsonl").open("a") as handle:
            handle.write(json.dumps({"run": run_info}) + "\n")
    runner.mapper = next(iter(mappers.values()))  # first-call costs paid before the first item's times
    runner.measure({**items[0], "ids": items[0]["ids"][-64:]}, arms, rungs, {})
    bar = tqdm(items, desc=f"{args.tasks} at {args.tokens}, {len(mappers)} maps", unit="item")
    for item in bar:
        key = long_switch.key_of(args, item)
        stored = {label: records[label].get(key, {"arms": {}}) for label in mappers}
        missing = waiting[key]
        done = {}  # the shared arms, from whichever map's file has them (`--shared-from`'s first)
        for row in earlier.get(key, ()):
            done.update({a: r for a, r in row["arms"].items() if shared(a) and a not in done})
        for label in mappers:
            done.update({a: r for a, r in stored[label]["arms"].items() if shared(a) and a not in done})
        load = os.getloadavg()[0]
        for label in missing:
            runner.mapper = mappers[label]
            measured = runner.measure(item, arms, rungs, {**done, **stored[label]["arms"]})
            load = max(load, os.getloadavg()[0])
            for record in measured.values():
                record["run"], record["load"] = run_info["id"], round(load, 2)
            done.update({a: r for a, r in measured.items() if shared(a) and a not in done})
            row_arms = {**{a: done[a] for a in arms if shared(a) and a not in stored[label]["arms"]}, **measured}
            row = {
                "key": key,
                "setup": setups[label],
                "task": item["task"],
                "tokens": len(item["ids"]),
                "length": args.tokens,
                "meta": {k: item[k] for k in ("depth", "task_id", "kind", "contexts") if k in item},
                "arms": row_arms,
            }
            with (out / f"{label}.jsonl").open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            records[label].setdefault(key, {**row, "arms": {}})["arms"].update(row_arms)
        bar.set_postfix(
            {f"{label}:{arm}": round(records[label][key]["arms"][arm]["score"], 2) for label in mappers for arm in own}
        )


def summary(args) -> dict:
    """Per map, task and arm over the items every arm of the map's file holds: the mean score, the map's rungs minus
    their sparse peers (paired, the same items), and the mean NLL of the 1.5B's own answer read through each arm's
    cache (`answer_nll`, nats a token; finer than right or wrong, where the maps answer alike)."""
    out = Path(args.records_dir)
    result: dict = {}
    for path in sorted(out.glob("*.jsonl")):
        rows = long_switch_report.load(path).values()
        for row in rows:
            if not all(arm in row["arms"] for arm in ("target", "mapped", "source")):
                continue  # an item still being measured
            cell = result.setdefault(path.stem, {}).setdefault(row["task"], {})
            for arm, record in row["arms"].items():
                cell.setdefault(arm, []).append(record["score"])
                if "answer_nll" in record:
                    cell.setdefault(f"{arm}/nll", []).append(record["answer_nll"])
    table = {}
    for label, tasks in result.items():
        for task, arms in tasks.items():
            means = {arm: round(sum(s) / len(s), 3) for arm, s in arms.items() if not arm.endswith("/nll")}
            nll = {arm[:-4]: round(sum(s) / len(s), 4) for arm, s in arms.items() if arm.endswith("/nll")}
            adds = {arm: round(means[arm] - means[SPARSE + arm], 3) for arm in means if SPARSE + arm in means}
            table.setdefault(label, {})[task] = {
                "items": len(arms["target"]),
                "mean": means,
                "map_adds": adds,
                "answer_nll": nll,
            }
    print(json.dumps(table, indent=1))
    return table


#: the rung the rule reads (benchmarks/README, "Which map carries the context"): the whole-context protocol's chosen one
RULE_RUNG = "query_overlap:fill=draft_branches@0.1"


def _overall(tasks: dict, key: str, arm: str) -> float | None:
    """The item-weighted mean of `key` (`mean` or `answer_nll`) of `arm` over a map's tasks."""
    held = [(cell["items"], cell[key][arm]) for cell in tasks.values() if arm in cell[key]]
    return sum(n * value for n, value in held) / sum(n for n, _ in held) if held else None


def markdown(table: dict, path: str = "benchmarks/results/map-choice/4096-summary.json") -> str:
    """The map choice as a table (one row a map: the 1.5B's own answer NLL through each rung, its sparse peer, the
    mapped cache and the target's own prefill; accuracy of the rule's rung, its sparse peer, the target and the
    source), and which complete map the rule picks (lowest NLL of `RULE_RUNG`; within 0.01, the first listed)."""
    total = max(sum(cell["items"] for cell in tasks.values()) for tasks in table.values())
    rungs = sorted(  # the repairs: every arm read but the target, the mapped cache and the sparse peers
        {
            arm
            for tasks in table.values()
            for cell in tasks.values()
            for arm in cell["answer_nll"]
            if arm not in ("target", "mapped") and not arm.startswith(SPARSE)
        }
    )
    fmt = lambda value, digits=3: "n/a" if value is None else f"{value:.{digits}f}"  # noqa: E731
    header = ["map", "items"] + [f"NLL {r} / its sparse peer" for r in rungs] + ["NLL mapped", "NLL target"]
    header += [f"accuracy {RULE_RUNG} / sparse / target / source"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    complete = {}
    for label, tasks in table.items():
        items = sum(cell["items"] for cell in tasks.values())
        nll = {arm: _overall(tasks, "answer_nll", arm) for arm in rungs + [SPARSE + r for r in rungs]}
        if items == total:
            complete[label] = nll[RULE_RUNG]
        cells = [label if items == total else f"{label} (measuring)", str(items)]
        cells += [f"{fmt(nll[r])} / {fmt(nll[SPARSE + r])}" for r in rungs]
        cells += [fmt(_overall(tasks, "answer_nll", "mapped"), 2), fmt(_overall(tasks, "answer_nll", "target"))]
        accuracy = [_overall(tasks, "mean", arm) for arm in (RULE_RUNG, SPARSE + RULE_RUNG, "target", "source")]
        cells.append(" / ".join(fmt(value, 2) for value in accuracy))
        lines.append("| " + " | ".join(cells) + " |")
    best = min(complete.values())
    tied = [label for label, value in complete.items() if value <= best + 0.01]
    lead = (
        f"**{tied[0]}**"
        if len(tied) == 1
        else "one of " + ", ".join(f"**{label}**" for label in tied) + " (within 0.01: the one of fewer positions)"
    )
    return (
        f"From `{path}` (selection items, seed 4321, 8 a family of ruler_vt, ruler_fwe, chat_split at 4,096 tokens; NLL: "
        "the 1.5B's own answer read through each arm's cache, nats a token). The rule (benchmarks/README): the lowest "
        f"NLL of `{RULE_RUNG}` over the items, within 0.01 the map with fewer calibration positions; among the maps "
        f"measured on all {total} items it picks {lead}.\n\n" + "\n".join(lines)
    )


def main(argv=None) -> None:
    parser = long_switch.build_parser()
    parser.description = __doc__
    parser.add_argument("--maps", default=None, help="label=folder,label=folder: the fitted maps compared")
    parser.add_argument("--records-dir", required=True, help="one records file per map (<label>.jsonl) here")
    parser.add_argument("--summary", action="store_true", help="print the means of the records and stop")
    parser.add_argument(
        "--shared-from",
        default=None,
        help="labels of maps measured earlier on these items in --records-dir: their target, source and sparse arms "
        "are reused (selection only: their first tokens are another run's; refused with --protocol)",
    )
    args = parser.parse_args(argv)
    if args.summary:
        summary(args)
        return
    if args.map or args.mapper:
        raise SystemExit("--map/--mapper: map_compare takes its maps from --maps (label=folder,...)")
    if not args.maps:
        raise SystemExit("--maps is required to measure (label=folder,label=folder)")
    if args.protocol and args.shared_from:
        raise SystemExit(
            "--shared-from with --protocol: a sealed run measures every arm side by side (first tokens of one run); "
            "leave --shared-from out"
        )
    if args.protocol:  # report items: every map one protocol's, every choice from them, its sha256 stamped
        labels = list(parse_maps(args.maps))
        args.stamps = stamps_of(args, labels)
    else:
        args.items = 16 if args.items is None else args.items
        args.seed = 4321 if args.seed is None else args.seed
        long_switch.apply_protocol(args)  # the unsealed defaults for what was not given
    run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
