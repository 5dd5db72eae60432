"""The report of `benchmarks.switch.long_switch`: its records assembled into one JSON per run, a docs table and a plot.

    python -m benchmarks.switch.long_switch_report --records $WORK/long/records.jsonl \
        --out benchmarks/results/long_switch.json --plot benchmarks/results/long_switch.png

Per direction, task and length: each arm's mean score over the items every arm was measured on, its floor-normalized
retention (`(score - chance) / (target - chance)`, the chance of guessing one of the prompt's candidates,
`long_tasks.CHANCE`; none where the target does not beat chance on the items by an exact binomial test), the share
of the source-to-target gap it recovers (`(score - source) / (target - source)`, only where the target beats the
source), its mean time to first token and
the re-prefill's over it (measured side by side on the same items), how often it gives the target's own answer (right
or wrong: what a switch promises), the seconds of the whole answer, the share of the
prompt recomputed (before the first token, plus what a `+refresh` rung recomputed while decoding), and for
continuations the NLL of the real text.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import sys
from pathlib import Path
from statistics import mean

from hf_kvmap.reporting import floor_retention, gap_recovered, retention_measurable
from lab.real.context_tasks import CHANCE as CONTEXT_CHANCE
from lab.real.long_tasks import CHANCE

from ..formatting import break_even_text, retention_text

#: `strategy@fraction`, optionally `+refresh:...` (a repair while decoding), or `mapped+refresh:...`
RUNG = re.compile(r"^(?:(?P<strategy>[^@+]+)@(?P<fraction>[0-9.]+)|mapped)(?P<refresh>\+refresh\b.*)?$")
FIXED_ARMS = ("target", "source", "mapped")


def load(path: str | Path, *, resume: bool = False) -> dict:
    """`{key: row}` with every arm a key was measured on (later lines add arms to earlier ones). An incomplete last
    line (a run stopped while writing it) is left out, and with `resume` cut off the file; any other bad line raises
    `ValueError` naming the file and the line (`reporting.resumable_jsonl`)."""
    from hf_kvmap.reporting import resumable_jsonl

    rows: dict[str, dict] = {}
    current = f"{path}#0"
    lines, note = resumable_jsonl(
        path, "a record of benchmarks.switch.long_switch (a JSON object)", check=_problem, cut=resume
    )
    if note:
        print(note, file=sys.stderr)
    for number, row in ((number - 1, row) for number, row in lines):
        if "run" in row:  # a line without a key says what ran the rows after it
            current = row["run"].get("id") or f"{path}#{number}"
        if "key" in row:
            for record in row["arms"].values():
                record.setdefault("run", current)  # rows written before runs had ids: the run line above them
            rows.setdefault(row["key"], {**row, "arms": {}})["arms"].update(row["arms"])
    return rows


def _problem(row: dict) -> str | None:
    """What is wrong with a records line that is a JSON object (`None`: nothing)."""
    if "key" in row:
        arms = row.get("arms")
        if not isinstance(arms, dict) or not all(isinstance(record, dict) for record in arms.values()):
            return "a measured item without its 'arms' (an object of one record per arm)"
        return None
    if not isinstance(row.get("run"), dict):
        return "neither a measured item ('key', 'arms') nor a run line ('run')"
    return None


def merge(loaded: dict[str, dict]) -> dict:
    """The rows of several records files (`{path: load(path)}`) as one `{key: row}`, a key's arms gathered from every
    file. Refuses a key measured with two mappers: its arms would compare two mapped caches."""
    rows: dict[str, dict] = {}
    seen: dict[str, str] = {}  # key -> the file whose mapper it holds
    for path, found in loaded.items():
        for key, row in found.items():
            if key in rows and _mapper(rows[key]) != _mapper(row):
                raise SystemExit(
                    f"{key} was measured with mapper {_mapper(rows[key])} in {seen[key]} and with {_mapper(row)} in "
                    f"{path}: one report compares one mapped cache per item; leave one of the two files out."
                )
            rows.setdefault(key, {**row, "arms": {}})["arms"].update(row["arms"])
            seen.setdefault(key, path)
    return rows


def _mapper(row: dict) -> str | None:
    return row.get("setup", {}).get("mapper")


def _group(rows: dict) -> dict:
    groups: dict[tuple, list[dict]] = {}
    for key, row in rows.items():
        direction, seed = key.split("/")[0], key.split("/")[3]
        groups.setdefault((direction, row["task"], row["length"], seed), []).append(row)
    return groups


def summarize(items: list[dict], pool_fits: bool = False) -> dict:
    """One (direction, task, length) group: every arm measured on all of `items` that hold the three fixed arms.
    Items measured with different fits of the mapper are refused unless `pool_fits` (then the group measures the
    recipe, each item on one fit, and `mappers` counts the items of each)."""
    complete = [row for row in items if all(arm in row["arms"] for arm in FIXED_ARMS)]
    if not complete:
        return {"items": 0}
    mappers: dict[str, int] = {}
    for row in complete:
        mappers[str(_mapper(row))] = mappers.get(str(_mapper(row)), 0) + 1
    if len(mappers) > 1 and not pool_fits:
        task = f"{complete[0]['task']} at {complete[0]['length']}"
        raise SystemExit(
            f"the {task} items were measured with {len(mappers)} mappers ({', '.join(sorted(mappers))}): one "
            "group's mean would average two mapped caches. Report the records of one mapper, or pass --pool-fits "
            "where they are fits of one recipe (each item is served on one of them; the report names each)."
        )
    arms = sorted(set.intersection(*(set(row["arms"]) for row in complete)))
    scores = {arm: mean(row["arms"][arm]["score"] for row in complete) for arm in arms}
    target, source = scores["target"], scores["source"]
    chance = CHANCE.get(complete[0]["task"], CONTEXT_CHANCE.get(complete[0]["task"], 0.0))
    measurable = retention_measurable({"target": target, "n_items": len(complete), "chance": chance})
    out = {
        "items": len(complete),
        "tokens": round(mean(row["tokens"] for row in complete)),
        "chance": chance,
        "target_beats_chance": measurable,
        "target_beats_source": target > source,
        "mappers": dict(sorted(mappers.items())),
        "arms": {},
    }
    served = [arm for arm in arms if arm not in ("target", "source")]
    bootstrap = intervals(complete, served, chance) if len(complete) >= MIN_ITEMS and measurable else {}
    for arm in arms:
        record = {
            "score": scores[arm],
            "retention": floor_retention(scores[arm], target, chance, len(complete)),
            "gap_recovered": gap_recovered(scores[arm], target, source),
            "ttft_s": mean(row["arms"][arm]["ttft_s"] for row in complete),
        }
        if arm != "source":  # the source's prefill is paid before a switch: its first token is not a switch's
            record["speedup"] = _speedup(complete, arm)
        wins = _wins_kept(complete, arm)
        if wins is not None:
            record["wins_kept"] = wins
        record.update(bootstrap.get(arm, {}))
        if "nll" in complete[0]["arms"][arm]:
            record["nll"] = mean(row["arms"][arm]["nll"] for row in complete)
            record["nll_gap_recovered"] = _nll_gap(complete, arm)
            record["prefix"] = mean(_prefix(row["arms"][arm], row["arms"]["target"]) for row in complete)
        texts = [(row["arms"][arm].get("text"), row["arms"]["target"].get("text")) for row in complete]
        if all(a is not None and b is not None for a, b in texts):  # the target's answer, right or wrong
            record["same_as_target"] = mean(float(a.strip() == b.strip()) for a, b in texts)
        if all("answer_s" in row["arms"][arm] for row in complete):
            record["answer_s"] = mean(row["arms"][arm]["answer_s"] for row in complete)
        match = RUNG.match(arm)
        if match and (match["strategy"] or match["refresh"]):
            before = float(match["fraction"] or 0.0)
            record["strategy"] = (match["strategy"] or "mapped") + ("+refresh" if match["refresh"] else "")
            record["fraction"] = before
            if match["refresh"]:  # what the refreshes recomputed while decoding, measured per item
                during = mean(row["arms"][arm]["refresh"]["recomputed_fraction"] for row in complete)
                record["refresh_fraction"] = during
                record["fraction"] = before + during
        out["arms"][arm] = record
    depths = sorted({row["meta"]["depth"] for row in complete if "depth" in row.get("meta", {})})
    if depths:
        out["by_depth"] = {
            str(depth): {
                arm: mean(r["arms"][arm]["score"] for r in complete if r["meta"].get("depth") == depth) for arm in arms
            }
            for depth in depths
        }
    return out


#: resamples of the paired bootstrap behind each arm's intervals, its level, the share of resamples that must have a
#: gap to recover (the target above the source) for the gap's interval to be given, and the fewest items a group
#: needs for any interval (on a few items every resample can agree: a one-point interval that bounds nothing)
BOOTSTRAP, LEVEL, GAP_DEFINED, MIN_ITEMS = 2000, 0.95, 0.95, 24


def intervals(
    items: list[dict], arms: list[str], chance: float = 0.0, resamples: int = BOOTSTRAP, seed: int = 0
) -> dict[str, dict]:
    """Per arm of `arms`, `retention_interval` and `gap_interval`: `LEVEL` percentile intervals of its retention
    (floor-normalized at `chance`; a resample whose target is not above it has none) and share of the gap over a
    paired bootstrap of `items` (each resample draws items with replacement once and scores the target, the source
    and every arm on that draw). The gap's is left out (None) where fewer than `GAP_DEFINED`
    of the resamples have a gap (the target's score above the source's): on a few wins it is not bounded."""
    import random

    columns = ["target", "source", *arms]
    scores = [[row["arms"][arm]["score"] for arm in columns] for row in items]
    draw, n = random.Random(seed), len(scores)
    retention: dict[str, list[float]] = {arm: [] for arm in arms}
    gap: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(resamples):
        sums = [0.0] * len(columns)
        for index in (draw.randrange(n) for _ in range(n)):
            sums = [total + score for total, score in zip(sums, scores[index])]
        target, source = sums[0], sums[1]
        for arm, served in zip(arms, sums[2:]):
            kept = floor_retention(served / n, target / n, chance)  # a draw's target at chance has none
            if kept is not None:
                retention[arm].append(kept)
            if target > source:
                gap[arm].append((served - source) / (target - source))

    def bounds(values: list[float]) -> list[float]:
        values = sorted(values)
        low, high = (1 - LEVEL) / 2, 1 - (1 - LEVEL) / 2
        return [values[int(low * (len(values) - 1))], values[round(high * (len(values) - 1))]]

    return {
        arm: {
            "retention_interval": bounds(retention[arm]) if retention[arm] else None,
            "gap_interval": bounds(gap[arm]) if len(gap[arm]) >= GAP_DEFINED * resamples else None,
        }
        for arm in arms
    }


def _wins_kept(items: list[dict], arm: str) -> list[int] | None:
    """`[kept, wins]`: of the items the target answers right and the source wrong (the answers a switch is made for),
    how many `arm` answers right. Unlike the share of the gap it does not net the arm's other losses and gains
    against each other, so it reads where the two models differ on few items. None where a score is not right or
    wrong (continuations)."""
    if any(row["arms"][a]["score"] not in (0, 1) for row in items for a in ("target", "source", arm)):
        return None
    wins = [row for row in items if row["arms"]["target"]["score"] == 1 and row["arms"]["source"]["score"] == 0]
    return [int(sum(row["arms"][arm]["score"] for row in wins)), len(wins)]


def _prefix(record: dict, target: dict) -> float:
    """The share of the target's tokens an arm decodes before its first different one (1.0: all of them)."""
    reference = target.get("tokens") or []
    tokens = record.get("tokens") or []
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    return same / len(reference) if reference else 0.0


def _nll_gap(items: list[dict], arm: str) -> float | None:
    """The share of the source-to-target NLL gap an arm closes, `(source - arm) / (source - target)` on mean NLLs;
    None where the target's NLL is not lower."""
    nll = {a: mean(row["arms"][a]["nll"] for row in items) for a in ("target", "source", arm)}
    gap = nll["source"] - nll["target"]
    return (nll["source"] - nll[arm]) / gap if gap > 0 else None


def _speedup(items: list[dict], arm: str) -> float | None:
    """The target's mean time to first token over `arm`'s, on the items where both were timed in one run (a row's
    arms measured by different invocations of the benchmark ran under different loads); None where none was."""
    paired = [r for r in items if r["arms"][arm].get("run", "") == r["arms"]["target"].get("run", "")]
    if not paired:
        return None
    arm_time = mean(r["arms"][arm]["ttft_s"] for r in paired)
    return mean(r["arms"]["target"]["ttft_s"] for r in paired) / arm_time if arm_time > 0 else None


def break_even(groups: dict) -> dict:
    """Per arm of one direction: the prompt length at which its first token comes as soon as the re-prefill's, from
    its speedups at the lengths measured (every task pooled, sorted by tokens): interpolated linearly between the
    last length below 1x and the first at or above it; `below`/`above` when every length measured is on one side."""
    points: dict[str, list[tuple[int, float]]] = {}
    for group in groups.values():
        for arm, record in group.get("arms", {}).items():
            if record.get("speedup") is not None and arm != "target":
                points.setdefault(arm, []).append((group["tokens"], record["speedup"]))
    return {arm: break_even_length(measured) for arm, measured in points.items()}


def break_even_length(measured: list[tuple[float, float]]) -> dict:
    """From `(tokens, speedup)` points (any order): the length at which the speedup reaches 1x, interpolated linearly
    between the last length below 1x and the first at or above it (`tokens`); `below` (the shortest length) when
    every length measured pays, `above` (the longest) when none does; `points` sorted, as measured."""
    measured = sorted(measured)
    entry: dict = {"points": [[tokens, round(speed, 3)] for tokens, speed in measured]}
    crossing = next((i for i in range(1, len(measured)) if measured[i - 1][1] < 1.0 <= measured[i][1]), None)
    if crossing is not None:
        (t0, s0), (t1, s1) = measured[crossing - 1], measured[crossing]
        entry["tokens"] = round(t0 + (1.0 - s0) * (t1 - t0) / (s1 - s0))
    elif all(speed >= 1.0 for _, speed in measured):
        entry["below"] = measured[0][0]  # it pays at every length measured, the shortest included
    elif all(speed < 1.0 for _, speed in measured):
        entry["above"] = measured[-1][0]
    return entry


def assemble(rows: dict, records: str, command: str, report_seed: int = 1234, pool_fits: bool = False) -> dict:
    """Every group's summary, and the break-even lengths from the report set's groups (`report_seed`: the item set
    every number is reported on; the selection set's runs were tuned on and may have shared the machine)."""
    results: dict = {}
    for (direction, task, length, seed), items in sorted(_group(rows).items()):
        results.setdefault(direction, {})[f"{task}@{length}#{seed}"] = {
            "seed": int(seed),
            **summarize(items, pool_fits),
        }
    return {
        "break_even": {
            direction: break_even({n: g for n, g in groups.items() if g["seed"] == report_seed})
            for direction, groups in results.items()
        },
        "run": {
            "what": "switching a conversation from one model of the pair to the other at serving lengths: each way "
            "of serving the larger model's continuation, against the target and the source alone",
            "records": records,
            "pool_fits": pool_fits,
            "command": command,
            "date": _dt.date.today().isoformat(),
        },
        "results": results,
    }


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _wins_cell(row: dict) -> str:
    """`kept/wins` of the target's right answers where the source is wrong, `-` where not counted."""
    wins = row.get("wins_kept")
    return "-" if wins is None else f"{wins[0]}/{wins[1]}"


def _nll_cell(row: dict) -> str:
    """`NLL (share of the source-to-target NLL gap closed)`, `-` without an NLL."""
    if row.get("nll") is None:
        return "-"
    gap = row.get("nll_gap_recovered")
    return f"{row['nll']:.3f}" + ("" if gap is None else f" ({gap:.2f})")


def _mapper_lines(groups: dict) -> list[str]:
    """A sentence naming the mapper (content hash, 8 digits) each row set's mapped caches came from; none where the
    results predate the field."""
    by_mapper: dict[str, list[str]] = {}  # the mappers of a row set (with their items where several) -> row sets
    pooled = False  # a row set pools several fits
    for name, group in groups.items():
        if group.get("items") and group.get("mappers"):
            short = {h.split(":")[-1][:8]: n for h, n in group["mappers"].items()}
            pooled |= len(short) > 1
            label = ", ".join(
                f"`{h}`" if len(short) == 1 else f"`{h}` ({n} item{'' if n == 1 else 's'})" for h, n in short.items()
            )
            by_mapper.setdefault(label, []).append(f"{name.split('@')[0]} @ {group['tokens']} ({group['seed']})")
    if not by_mapper:
        return []
    if len(by_mapper) == 1 and not pooled:
        return ["", f"Every mapped cache above comes from one mapper (content hash {next(iter(by_mapper))})."]
    parts = [f"{label} for {', '.join(names)}" for label, names in sorted(by_mapper.items())]
    return [
        "",
        "The mapped caches above come from more than one fit of the mapper's recipe (content hashes; the same recipe "
        "refit on another CPU gives other float bytes): "
        + "; ".join(parts)
        + ". Every item is served on one fit throughout.",
    ]


def markdown(results: dict, source: str = "benchmarks/results/long_switch.json") -> str:
    """One table per direction: a row per (task, length, arm)."""
    lines = [
        f"Generated from `{source}` by `benchmarks/switch/long_switch_report.py`. Retention is floor-normalized at the "
        "chance of guessing one of the prompt's candidates (`long_tasks.CHANCE`: "
        + ", ".join(f"{task} {chance:.2f}" for task, chance in CHANCE.items())
        + "); it is not measurable where the target does not beat that chance on the items (exact binomial test)."
    ]
    for direction, groups in results["results"].items():
        lines += [
            "",
            f"**{direction.replace(':', ' -> ')}**",
            "",
            "| task @ tokens | item set (seed) | items | arm | score | retention | gap recovered | target's wins kept "
            "| target's answer | recomputed | first token (s) | vs re-prefill | whole answer (s) | NLL (gap closed) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, group in groups.items():
            if not group["items"]:
                continue
            task = f"{name.split('@')[0]} @ {group['tokens']}"
            ordered = [a for a in FIXED_ARMS if a in group["arms"]]
            ordered += sorted((a for a in group["arms"] if a not in FIXED_ARMS), key=lambda a: (a.split("@")[0], a))
            for arm in ordered:
                row = group["arms"][arm]
                gap = _fmt(row["gap_recovered"]) if group["target_beats_source"] else "target <= source"
                speed = f"{row['speedup']:.1f}x" if row.get("speedup") else "-"
                share = {"target": 1.0, "source": None, "mapped": 0.0}.get(arm, row.get("fraction"))
                lines.append(
                    f"| {task} | {group['seed']} | {group['items']} | {arm} | {_fmt(row['score'], 3)} | "
                    f"{retention_text(row['retention'])} | {gap} | {_wins_cell(row)} | {_fmt(row.get('same_as_target'))} | "
                    f"{'-' if share is None else f'{share:.0%}'} | "
                    f"{row['ttft_s']:.1f} | {speed} | {_fmt(row.get('answer_s'), 1)} | {_nll_cell(row)} |"
                )
        lines += _mapper_lines(groups)
    for direction, arms in results.get("break_even", {}).items():
        lines += [
            "",
            f"**Break-even length, {direction.replace(':', ' -> ')}** (the prompt length where an arm's first token "
            "comes as soon as the re-prefill's; interpolated between the lengths measured, every task of the report set "
            "pooled)",
            "",
            "| arm | break-even | speedup at the lengths measured (tokens: speedup) |",
            "|---|---|---|",
        ]
        for arm, entry in sorted(arms.items()):
            where = break_even_text(entry)
            measured = ", ".join(f"{tokens:,}: {speed:.1f}x" for tokens, speed in entry["points"])
            lines.append(f"| {arm} | {where} | {measured} |")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    """Per direction and task: score against the fraction recomputed per strategy (lengths as line styles), with the
    target, the source and the mapped cache as references."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (d, t, seed)
        for d, groups in results["results"].items()
        for t, seed in sorted({(n.split("@")[0], n.split("#")[1]) for n in groups})
    ]
    columns = min(4, max(1, len(panels)))
    rows = -(-max(1, len(panels)) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.6 * rows), squeeze=False)
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    styles = ["-", "--", ":", "-."]
    for axis, (direction, task, seed) in zip(axes.flat, panels):
        groups = {
            n: g
            for n, g in results["results"][direction].items()
            if n.startswith(task + "@") and n.endswith(f"#{seed}") and g["items"]
        }
        for style, (name, group) in zip(styles, sorted(groups.items(), key=lambda kv: int(kv[1]["tokens"]))):
            length = name.split("@")[1].split("#")[0]
            strategies = sorted({r["strategy"] for r in group["arms"].values() if "strategy" in r})
            for strategy in strategies:
                points = sorted(
                    (r["fraction"], r["score"]) for r in group["arms"].values() if r.get("strategy") == strategy
                )
                xs = [0.0] + [p[0] for p in points]
                ys = [group["arms"]["mapped"]["score"]] + [p[1] for p in points]
                axis.plot(xs, ys, style, marker="o", markersize=3, label=f"{strategy} @ {length}")
            axis.axhline(group["arms"]["target"]["score"], color="black", linestyle=style, linewidth=0.8)
            axis.axhline(group["arms"]["source"]["score"], color="grey", linestyle=style, linewidth=0.8)
        chance = max((g.get("chance", 0.0) for g in groups.values()), default=0.0)
        legend = "black: target alone, grey: source alone"
        if chance > 0:  # retention's zero: a score there is what guessing one of the prompt's candidates gets
            axis.axhline(chance, color="tab:red", linestyle=":", linewidth=0.8)
            legend += ", red: guessing"
        axis.set_title(f"{task}, {direction.replace(':', ' -> ')}, item set {seed}\n({legend})", fontsize=9)
        axis.set_xlabel("fraction recomputed (incl. refreshes)", fontsize=8)
        axis.set_ylabel("score")
        axis.set_ylim(-0.05, 1.05)
        axis.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", required=True, nargs="+", help="records files of `benchmarks.switch.long_switch`")
    # no defaults: a look at a few records must not overwrite the committed report (its command names both)
    parser.add_argument(
        "--out", required=True, help="results JSON (the committed: benchmarks/results/long_switch.json)"
    )
    parser.add_argument("--plot", required=True, help="plot PNG (the committed: benchmarks/results/long_switch.png)")
    parser.add_argument("--report-seed", type=int, default=1234, help="the item set the break-even lengths come from")
    parser.add_argument(
        "--pool-fits",
        action="store_true",
        help="pool a task's items measured with different fits of one mapper recipe (a run that outlived the machine "
        "its mapper was fitted on); each item stays on one fit, and the report names each fit's items",
    )
    args = parser.parse_args(argv)
    rows = merge({path: load(path) for path in args.records})
    command = "python -m benchmarks.switch.long_switch_report " + " ".join(sys.argv[1:] if argv is None else argv)
    results = assemble(rows, ", ".join(args.records), command, args.report_seed, args.pool_fits)
    results["runs"] = [
        json.loads(line)["run"]
        for path in args.records
        for line in Path(path).read_text().splitlines()
        if line.strip() and "run" in json.loads(line)
    ]
    from hf_kvmap.reporting import write_json

    write_json(args.out, results)
    plot(results, args.plot)
    print(markdown(results, args.out))


if __name__ == "__main__":
    main()
