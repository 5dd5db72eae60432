"""`hf-kvmap demo`'s long rows and its first screen: where the switch pays, and where it does not.

The long forms of recall and chat (`hf_kvmap.zoo.long_items`: a prompt of the family's own filler, one fact stated
`reach` tokens before its end, the question about it last) are served the four ways of `demo_ways` at each length
asked, every length warmed up before it is timed, accuracy and the median time to the first token side by side.

A way *pays* on a row where its first token comes sooner than the target alone's and its accuracy is within
`TOLERANCE` of the target alone's, on a row where the target alone does the task (it beats chance over the row's
items: `hf_kvmap.reporting.retention_measurable`). The *break-even* of a way is the length from which its first token
comes sooner than the target alone's at every longer length measured, interpolated linearly in the ratio of the two
times between the last measured length where it is not sooner and the first of that run (`break_even`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

#: the long rows' prompt lengths (tokens) and the tokens from the fact to the prompt's end (the family is trained on
#: 256-token windows, and its target does not recall a fact stated first much beyond them: `--reach first` shows it)
DEFAULT_LONG_LENGTHS = (256, 384, 512)
DEFAULT_REACH = 96
DEFAULT_LONG_ITEMS = 32
#: how far below the target alone's accuracy a way may answer on a row and still keep it
TOLERANCE = 0.05
#: the ways compared with the target alone
HANDOFF_WAYS = ("mapped", "repaired", "guarded")


def serve_long(
    ways, tasks: Sequence[str], lengths: Sequence[int], items: int, seed: int, reach: int | None, progress=None
) -> dict:
    """Each task's long form at each length, served by `ways` (`demo_ways.DemoWays`) four ways: `{task: [row]}`, a row
    `{"tokens", "prompt_tokens": [min, max], "target_does_task", "ways": {way: DemoWays.task's row}}`. Each length's
    items are served once, untimed, before they are timed (`DemoWays.warm_up`)."""
    from ..reporting import retention_measurable
    from ..zoo.long_items import make_long_set

    out: dict[str, list[dict]] = {}
    for task in tasks:
        rows = out.setdefault(task, [])
        for length in lengths:
            long_items = make_long_set(task, items, length, seed=seed, reach=reach)
            stop = long_items[0].stop
            ways.warm_up(long_items, stop)
            served = ways.task(long_items, stop, progress=progress)
            target = served["target"]["accuracy"]
            rows.append(
                {
                    "tokens": length,
                    "prompt_tokens": [min(i.tokens for i in long_items), max(i.tokens for i in long_items)],
                    "target_does_task": retention_measurable({"target": target, "n_items": items, "chance": 0.0}),
                    "ways": served,
                }
            )
    return out


def pays(row: dict, way: str, tolerance: float = TOLERANCE) -> bool:
    """Whether `way` pays on a long `row`: the target alone does the task there, and `way` answers within `tolerance`
    of its accuracy with its first token sooner."""
    target, served = row["ways"]["target"], row["ways"][way]
    return (
        bool(row["target_does_task"])
        and served["ttft_ms"] < target["ttft_ms"]
        and served["accuracy"] >= target["accuracy"] - tolerance - 1e-9
    )


def break_even(points: Sequence[tuple[int, float, float]]) -> dict:
    """The break-even length of one way from `(tokens, target_ms, way_ms)` points (any order, distinct lengths).

    Returns `{"tokens": L, "between": [t0, t1]}` where the way is sooner at every length from `t1` on and not at `t0`
    (`L` interpolated linearly in the ratio `target_ms / way_ms`, the speedup, to where it is 1), `{"below": t}` when
    it is sooner at every length measured (`t` the shortest), `{"above": t}` when it is not sooner at the longest
    (`t`); always `"points"`: `[tokens, speedup]` sorted by length.

    >>> break_even([(256, 60.0, 80.0), (512, 125.0, 100.0)])["tokens"]
    384
    """
    if not points:
        raise ValueError("break_even needs at least one measured (tokens, target_ms, way_ms) point.")
    measured = sorted((int(tokens), target / way) for tokens, target, way in points)
    entry: dict = {"points": [[tokens, round(speedup, 3)] for tokens, speedup in measured]}
    if measured[-1][1] <= 1.0:
        entry["above"] = measured[-1][0]
        return entry
    first = len(measured) - 1
    while first > 0 and measured[first - 1][1] > 1.0:
        first -= 1
    if first == 0:
        entry["below"] = measured[0][0]
        return entry
    (t0, s0), (t1, s1) = measured[first - 1], measured[first]
    entry["tokens"] = round(t0 + (1.0 - s0) * (t1 - t0) / (s1 - s0))
    entry["between"] = [t0, t1]
    return entry


def break_evens(long_rows: dict) -> dict:
    """`{task: {way: break_even entry}}` of the long rows (every row, whether or not the target does the task there:
    the time to the first token does not depend on the answer)."""
    return {
        task: {
            way: break_even([(r["tokens"], r["ways"]["target"]["ttft_ms"], r["ways"][way]["ttft_ms"]) for r in rows])
            for way in HANDOFF_WAYS
        }
        for task, rows in long_rows.items()
        if rows
    }


def latency_break_evens(latency: Sequence[dict]) -> dict:
    """`{way: break_even entry}` of the latency rows (random tokens; the mapped and the repaired cache)."""
    if not latency:
        return {}
    return {
        way: break_even([(r["tokens"], r["ttft_target_ms"], r[f"ttft_{way}_ms"]) for r in latency])
        for way in ("mapped", "repaired")
    }


def break_even_text(entry: dict) -> str:
    """`about 392 tokens (between the measured 384 and 512)`, or which side of every length measured it lies on."""
    if "tokens" in entry:
        low, high = entry["between"]
        return f"about {entry['tokens']:,} tokens (between the measured {low:,} and {high:,})"
    if "below" in entry:
        return f"below {entry['below']:,} tokens (sooner at every length measured)"
    return f"above {entry['above']:,} tokens (not sooner at the longest measured)"


#: how the break-even is obtained, as printed and in the docs
BREAK_EVEN_RULE = (
    "the length from which a way's first token comes sooner than the target alone's at every longer length measured, "
    "interpolated linearly in target/way first-token time between the two measured lengths around it"
)


def _cell(row: dict, way: str) -> str:
    served = row["ways"][way]
    mark = " +" if way != "target" and pays(row, way) else "  "
    return f"{served['accuracy']:.3f} / {served['ttft_ms']:6.1f}{mark}"


def kept_counts(long_rows: dict, tolerance: float = TOLERANCE) -> dict[str, tuple[int, int]]:
    """`{way: (rows where it answers within tolerance of the target alone, rows where the target alone does the
    task)}`, whatever the times."""
    rows = [row for task_rows in long_rows.values() for row in task_rows if row["target_does_task"]]
    target = [row["ways"]["target"]["accuracy"] - tolerance - 1e-9 for row in rows]
    return {
        way: (sum(row["ways"][way]["accuracy"] >= floor for row, floor in zip(rows, target)), len(rows))
        for way in HANDOFF_WAYS
    }


def kept_text(long_rows: dict, tolerance: float = TOLERANCE) -> str:
    """`Within 0.05 of the target alone's accuracy, on the 5 rows where it beats chance: mapped on 1, ...`."""
    counts = kept_counts(long_rows, tolerance)
    rows = next(iter(counts.values()))[1]
    kept = ", ".join(f"{way} on {count}" for way, (count, _) in counts.items())
    return f"Within {tolerance:.2f} of the target alone's accuracy, on the {rows} rows where it beats chance: {kept}."


def paying_rows(long_rows: dict) -> list[tuple[str, dict, list[str]]]:
    """`(task, row, ways that pay there)` of every long row where at least one way pays, in the order measured."""
    out = []
    for task, rows in long_rows.items():
        for row in rows:
            paying = [way for way in HANDOFF_WAYS if pays(row, way)]
            if paying:
                out.append((task, row, paying))
    return out


def _wrapped(text: str, indent: str = "") -> list[str]:
    import textwrap

    return textwrap.wrap(text, width=116, initial_indent=indent, subsequent_indent=indent + "  ")


def first_screen(results: dict) -> str:
    """What `hf-kvmap demo` prints first: the long rows, where the switch pays, and the break-even lengths."""
    long = results.get("long") or {}
    run = results["run"]
    lines = [f"hf-kvmap demo: {run['source']} -> {run['target']} (mapper {run['mapper']}): where the switch pays"]
    rows_by_task = long.get("tasks") or {}
    if not rows_by_task:
        return lines[0] + "\n(no long rows: --long-lengths was empty)"
    reach = long["reach"]
    where = "stated first" if reach is None else f"stated {reach} tokens before the prompt's end"
    why = (
        " (the tiny target, trained on 256-token windows, does not recall a fact stated first much past them: "
        "--reach first measures it)"
        if reach is not None
        else ""
    )
    lines += _wrapped(
        f"Long prompts of the family's own text, one fact {where}{why} and the question about it last, "
        f"{long['items']} items per task and length; accuracy / median ms to the first token from the source's "
        "prefill, each length warmed up first:"
    )
    header = "".join(f"{label:<19}" for label in ("target alone", *HANDOFF_WAYS)).rstrip()
    lines += ["", f"{'task':<8}{'tokens':>7}   {header}"]
    for task, rows in rows_by_task.items():
        for row in rows:
            cells = "".join(f"{_cell(row, way):<19}" for way in ("target", *HANDOFF_WAYS)).rstrip()
            note = "" if row["target_does_task"] else "  (the target alone does not beat chance here)"
            lines.append(f"{task:<8}{row['tokens']:>7}   {cells}{note}")
    tolerance = long.get("tolerance", TOLERANCE)
    lines += [f"+ pays: the first token sooner than the target alone's, the accuracy within {tolerance:.2f} of it", ""]
    paying = paying_rows(rows_by_task)
    for task, row, ways in paying:
        target = row["ways"]["target"]
        served = ", ".join(
            f"{way} {row['ways'][way]['accuracy']:.3f} in {row['ways'][way]['ttft_ms']:.1f} ms "
            f"({target['ttft_ms'] / row['ways'][way]['ttft_ms']:.2f}x sooner)"
            for way in ways
        )
        lines += _wrapped(
            f"The switch pays: {task} at {row['tokens']} tokens, {served}; the target alone {target['accuracy']:.3f} "
            f"in {target['ttft_ms']:.1f} ms."
        )
    if not paying:
        lines += _wrapped(
            f"The switch pays on no row measured: no handoff answers within {tolerance:.2f} of the target alone's "
            "accuracy with its first token sooner."
        )
    lines += _wrapped(kept_text(rows_by_task, tolerance))
    lines += _wrapped(f"Where it does not pay: below the break-even length, {BREAK_EVEN_RULE}:")
    for task, entries in long.get("break_even", {}).items():
        text = "; ".join(f"{way} {break_even_text(e)}" for way, e in entries.items())
        lines += _wrapped(f"{task}: {text}", indent="  ")
    latency = results.get("latency_break_even") or {}
    if latency:
        text = "; ".join(f"{way} {break_even_text(e)}" for way, e in latency.items())
        lines += _wrapped(f"random tokens (the latency rows below): {text}", indent="  ")
    lines += _wrapped("Below it the target alone's first token comes sooner, as on the short prompts below.")
    return "\n".join(lines)


def measure_long(ways, kept: Sequence[str], args, progress: Callable[[], None] | None = None) -> dict:
    """The `long` block of the demo's results: the rows of the long forms of the kept tasks, their break-even lengths
    and the settings they were measured with."""
    from ..zoo.long_items import LONG_TASKS

    tasks = [task for task in LONG_TASKS if task in kept]
    rows = serve_long(ways, tasks, args.long_lengths, args.long_items, args.seed, args.reach, progress)
    return {
        "lengths": list(args.long_lengths),
        "reach": args.reach,
        "items": args.long_items,
        "seed": args.seed,
        "tolerance": TOLERANCE,
        "tasks": rows,
        "break_even": break_evens(rows),
        "break_even_rule": BREAK_EVEN_RULE,
    }
