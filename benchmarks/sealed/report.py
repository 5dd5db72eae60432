"""The report of a sealed protocol's records: every figure with its interval, verdicts on lower bounds.

    python -m benchmarks.sealed.report --protocol benchmarks/protocols/switch-chat-doc.json \
        --records benchmarks/results/sealed/switch-chat-doc/*.jsonl --out benchmarks/results/sealed/switch-chat-doc.json

Only records stamped with the protocol's sha256 are read (a record made under other choices is refused by file and
key), and only items of the protocol's cells at their seeds. Per cell (task, length), over the items that hold every
arm: each arm's accuracy, its retention floor-normalized at the task's chance, the share of the source-to-target gap
it recovers (given only where the target beats the source on at least `min_gap_items` items: else "no gap to
recover"), how often its answer differs from the target's and how often it scores below it (descriptive, no
verdict reads it: added once the 4K list answers had shown that another order of the same names changes an answer
without costing it anything), its first token against the target's re-prefill, and for
each repair what the map adds over the sparse prefill of the same positions (repaired minus sparse, paired). Every
figure has a paired bootstrap interval over items at the protocol's level; the verdicts of the chosen rung read the
lower bounds.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from statistics import mean

from hf_kvmap.reporting import retention_measurable, write_json
from lab.real.context_tasks import CHANCE as CONTEXT_CHANCE
from lab.real.long_tasks import CHANCE as LONG_CHANCE

from ..switch.long_switch_report import load
from .protocol import SPARSE, Protocol, ProtocolError, existing_files, protocol_from_flag


def read_records(protocol: Protocol, paths: list[str]) -> dict[tuple[str, int], list[dict]]:
    """`{(task, length): rows}` of the records made under `protocol` (refusing any other stamp or seed)."""
    cells: dict[tuple[str, int], dict[str, dict]] = {}
    for path in paths:
        for key, row in load(path).items():
            stamp = row.get("setup", {}).get("protocol")
            if stamp != protocol.sha256:
                raise SystemExit(
                    f"{path}: {key} was made under {'no protocol' if stamp is None else 'protocol ' + stamp[:12]}, "
                    f"not {protocol.path} ({protocol.sha256[:12]}): leave the file out, or report it under its own "
                    "protocol."
                )
            task, length = row["task"], int(row["length"])
            try:
                cell = protocol.cell(task, length)
            except ProtocolError as err:
                raise SystemExit(f"{path}: {key}: {err}") from None
            if int(key.split("/")[3]) != cell["seed"]:
                raise SystemExit(f"{path}: {key} is not of the cell's seed {cell['seed']}.")
            for extra, follow in follow_up_rows(key, row):  # each follow-up question, a cell of its own
                cells.setdefault((follow["task"], length), {})[extra] = follow
            rows = cells.setdefault((task, length), {})
            if key in rows and rows[key]["setup"].get("mapper") != row["setup"].get("mapper"):
                raise SystemExit(
                    f"{path}: {key} was measured with two fits of the map ({rows[key]['setup'].get('mapper')} and "
                    f"{row['setup'].get('mapper')}): an item is served on one; leave one of its records out."
                )
            if key in rows:
                rows[key]["arms"].update(row["arms"])
            else:
                rows[key] = {**row, "arms": dict(row["arms"])}
    return {cell: list(rows.values()) for cell, rows in sorted(cells.items())}


def follow_up_rows(key: str, row: dict) -> list[tuple[str, dict]]:
    """A conversation's follow-up questions as rows of their own (`followups:q2`, `followups:q3`): every arm's reply
    to question `i`, asked on the cache that arm served (`benchmarks.switch.long_switch`); its first token is the
    follow-up's."""
    arms = row["arms"]
    count = min((len(record.get("followups", [])) for record in arms.values()), default=0)
    out = []
    for index in range(count):
        name = f"{row['task']}:q{index + 2}"
        follow = {
            arm: {
                **record["followups"][index],
                "load": record.get("load"),
                "score": record["followups"][index]["score"],
            }
            for arm, record in arms.items()
        }
        out.append((f"{key}:q{index + 2}", {**row, "task": name, "arms": follow}))
    return out


#: each task's floor: the chance of guessing one of a prompt's candidates (`long_tasks`, `context_tasks`)
CHANCE = {**LONG_CHANCE, **CONTEXT_CHANCE}

#: the fewest items a figure's interval is given on (on a few items every resample can agree: a one-point interval
#: that bounds nothing)
MIN_ITEMS = 24


def answer_changed(arms: dict, arm: str) -> bool:
    """Whether `arm` of an item's arms answered otherwise than the target (the text, its ends stripped)."""
    return arms[arm]["text"].strip() != arms["target"]["text"].strip()


def _changed(row: dict, arm: str) -> float:
    return float(answer_changed(row["arms"], arm))


def _worse(row: dict, arm: str) -> float:
    """Whether `arm` scored below the target on the item: a changed answer that cost something (on a list answer,
    another order of the same names changes the text and not the score)."""
    return float(row["arms"][arm]["score"] < row["arms"]["target"]["score"])


def percentile_bounds(values: list[float], level: float) -> list[float]:
    """The two-sided percentile interval at `level` of bootstrap `values` (sorted here)."""
    values = sorted(values)
    low, high = (1 - level) / 2, 1 - (1 - level) / 2
    return [values[int(low * (len(values) - 1))], values[round(high * (len(values) - 1))]]


def timed(row: dict, max_load: float) -> bool:
    """Whether an item's times are read: every arm measured while the machine's 1-minute load average was at most
    `max_load` (what else ran stretches each arm's seconds by its own share; a record without a load is not read)."""
    return all(record.get("load", float("inf")) <= max_load for record in row["arms"].values())


def _statistics(rows: list[dict], arms: list[str], chance: float, max_load: float) -> dict[str, float | None]:
    """Every figure of one cell on `rows` (the items as measured, or one bootstrap draw of them); first tokens on the
    items `timed` at `max_load`."""
    score = {arm: mean(row["arms"][arm]["score"] for row in rows) for arm in arms}
    target, source = score["target"], score["source"]
    out: dict[str, float | None] = {}
    clocked = [row for row in rows if timed(row, max_load)]
    re_prefill = mean(row["arms"]["target"]["ttft_s"] for row in clocked) if clocked else None
    for arm in arms:
        out[f"{arm}/score"] = score[arm]
        if arm in ("target", "source"):
            continue
        out[f"{arm}/retention"] = (score[arm] - chance) / (target - chance) if target > chance else None
        out[f"{arm}/gap"] = (score[arm] - source) / (target - source) if target > source else None
        out[f"{arm}/changed"] = mean(_changed(row, arm) for row in rows)
        out[f"{arm}/worse"] = mean(_worse(row, arm) for row in rows)
        if re_prefill is not None:
            out[f"{arm}/speedup"] = re_prefill / mean(row["arms"][arm]["ttft_s"] for row in clocked)
        if SPARSE + arm in arms:
            out[f"{arm}/map_adds"] = score[arm] - score[SPARSE + arm]
    return out


def summarize(protocol: Protocol, task: str, length: int, rows: list[dict]) -> dict:
    """One cell's figures with their intervals and the chosen rung's verdicts."""
    arms = protocol.arms
    complete = [row for row in rows if all(arm in row["arms"] for arm in arms)]
    cell = protocol.cell(task, length)
    out = {"task": task, "length": length, "items": len(complete), "planned": cell["items"], "seed": cell["seed"]}
    if not complete:
        return out
    chance = CHANCE.get(task.split(":")[0], 0.0)
    max_load = protocol.settings["timing"]["max_load"]
    point = _statistics(complete, arms, chance, max_load)
    interval = protocol.settings["interval"]
    draw, n = random.Random(interval["seed"]), len(complete)
    samples: dict[str, list[float]] = {}
    for _ in range(interval["resamples"]):
        drawn = [complete[draw.randrange(n)] for _ in range(n)]
        for name, value in _statistics(drawn, arms, chance, max_load).items():
            if value is not None:
                samples.setdefault(name, []).append(value)
    level = interval["level"]
    wins = sum(row["arms"]["target"]["score"] > row["arms"]["source"]["score"] for row in complete)
    verdicts = protocol.settings["verdicts"]
    out.update(
        tokens=round(mean(row["tokens"] for row in complete)),
        chance=chance,
        target_beats_chance=retention_measurable({"target": point["target/score"], "n_items": n, "chance": chance}),
        target_wins=wins,
        timed_items=sum(timed(row, max_load) for row in complete),
        gap_to_recover=wins >= verdicts["min_gap_items"],
        figures={},
    )
    for name, value in point.items():
        if name.endswith("/retention") and not out["target_beats_chance"]:
            value = None  # a target no better than guessing has no retention
        if name.endswith("/gap") and not out["gap_to_recover"]:
            value = None  # "no gap to recover"
        values = sorted(samples.get(name, []))
        bounds = None
        if value is not None and n >= MIN_ITEMS and len(values) >= level * interval["resamples"]:
            bounds = percentile_bounds(values, level)
        out["figures"][name] = {"value": value, "interval": bounds}
    if n < cell["items"]:  # a verdict reads the whole cell
        out["verdict"] = {"rung": protocol.chosen(task), "pending": f"{n} of {cell['items']} items measured"}
    else:
        out["verdict"] = verdict(protocol, out, protocol.chosen(task))
    return out


def verdict(protocol: Protocol, cell: dict, rung: str) -> dict:
    """The chosen rung's verdicts: each target read on the interval's lower bound (`met`, `missed` or why none)."""
    rules, figures = protocol.settings["verdicts"], cell["figures"]

    def low(name: str) -> float | None:
        figure = figures.get(f"{rung}/{name}", {})
        return figure["interval"][0] if figure.get("interval") else None

    def value(name: str) -> float | None:
        return figures.get(f"{rung}/{name}", {}).get("value")

    out = {"rung": rung}
    if not cell["gap_to_recover"]:
        wins = cell["target_wins"]
        out["gap"] = f"no gap to recover (the target beats the source on {wins} item{'s' * (wins != 1)})"
    elif value("gap") is None or low("gap") is None:
        out["gap"] = "not measurable"
    else:
        met = value("gap") >= rules["gap"] and low("gap") >= rules["gap_lower"]
        out["gap"] = "met" if met else "missed"
    retention = value("retention")
    out["retention"] = (
        "not measurable" if retention is None else ("met" if retention >= rules["retention"] else "missed")
    )
    floor = rules["speedup"].get(str(cell["length"]))
    if floor is not None:
        measured = low("speedup")
        out["speedup"] = "not timed" if measured is None else ("met" if measured >= floor else "missed")
    adds = value("map_adds")
    if adds is not None:
        out["map_adds"] = (
            "met" if adds >= rules["map_adds"] and (low("map_adds") or 0.0) > rules["map_adds_lower"] else "missed"
        )
    return out


def _cell_text(figure: dict, digits: int = 2) -> str:
    if figure is None or figure.get("value") is None:
        return "-"
    text = f"{figure['value']:.{digits}f}"
    if figure.get("interval"):
        low, high = figure["interval"]
        text += f" [{low:.{digits}f}, {high:.{digits}f}]"
    return text


def markdown(results: dict) -> str:
    """One table per cell: every arm's figures with their intervals, then the chosen rung's verdicts."""
    lines = []
    for cell in results["cells"]:
        head = f"**{cell['task']} at {cell['length']} tokens** ({cell['items']} of {cell['planned']} items"
        if not cell["items"]:
            lines += [head + ": none measured yet)", ""]
            continue
        lines += [
            head + f", mean {cell['tokens']} tokens; the 1.5B right where the 0.5B is wrong on {cell['target_wins']}; "
            f"first tokens timed on the {cell['timed_items']} measured while the machine was otherwise idle)",
            "",
            "| arm | accuracy | retention | share of the gap | changed answers | worse than the 1.5B | first token vs "
            "re-prefill | map adds |",
            "|---|---|---|---|---|---|---|---|",
        ]
        figures = cell["figures"]
        for arm in results["arms"]:
            row = [arm, _cell_text(figures.get(f"{arm}/score"))]
            for name in ("retention", "gap", "changed", "worse", "speedup", "map_adds"):
                figure = figures.get(f"{arm}/{name}")
                if name == "gap" and figure is not None and not cell["gap_to_recover"]:
                    row.append("no gap to recover")
                elif name == "speedup" and figure is not None and figure.get("value") is not None:
                    row.append(_cell_text(figure, 1).replace(" [", "x [", 1) if figure.get("interval") else "-")
                else:
                    row.append(_cell_text(figure))
            lines.append("| " + " | ".join(row) + " |")
        judged = ", ".join(
            f"{key} {value}" for key, value in cell["verdict"].items() if key not in ("rung", "pending")
        )
        if "pending" in cell["verdict"]:
            judged = f"pending, {cell['verdict']['pending']}; intervals from {MIN_ITEMS} items on"
        lines += ["", f"Verdicts of `{cell['verdict']['rung']}` (lower bounds): {judged}.", ""]
    return "\n".join(lines)


def assemble(protocol: Protocol, paths: list[str]) -> dict:
    cells = read_records(protocol, paths)
    planned = [(task, cell["tokens"]) for cell in protocol.settings["cells"] for task in cell["tasks"]]
    planned += sorted(set(cells) - set(planned))  # the follow-up questions of a conversation measured
    return {
        "protocol": {"path": protocol.path, "sha256": protocol.sha256, "name": protocol.settings["name"]},
        "arms": protocol.arms,
        "records": sorted(str(p) for p in paths),
        "cells": [summarize(protocol, task, tokens, cells.get((task, tokens), [])) for task, tokens in planned],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", required=True, help="the sealed protocol the records were made under")
    parser.add_argument("--records", nargs="+", required=True, help="JSONL records of benchmarks.switch.long_switch")
    parser.add_argument("--out", required=True, help="the results JSON to write")
    parser.add_argument("--markdown", default=None, help="also write the tables here")
    args = parser.parse_args(argv)
    protocol = protocol_from_flag(args.protocol)
    existing_files(args.records)
    results = assemble(protocol, args.records)
    write_json(args.out, results)
    text = markdown(results)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
