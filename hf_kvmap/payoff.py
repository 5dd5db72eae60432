"""Where a switch pays: a way of serving the target (the mapped cache, the repaired one, the guarded handoff) against
the target alone, row by row of measured lengths, read off the accuracy and the median time to the first token of each
(what `hf-kvmap demo` prints first, its plot and the docs generated from its JSON all read).

A way *pays* on a row where its first token comes sooner than the target alone's and its accuracy is within
`TOLERANCE` of the target alone's, on a row where the target alone does the task (it beats chance over the row's
items: `hf_kvmap.reporting.retention_measurable`). The *break-even* of a way is the length from which its first token
comes sooner than the target alone's at every longer length measured, interpolated linearly in the ratio of the two
times between the last measured length where it is not sooner and the first of that run (`break_even`).
"""

from __future__ import annotations

from collections.abc import Sequence

#: how far below the target alone's accuracy a way may answer on a row and still keep it
TOLERANCE = 0.05
#: the ways compared with the target alone
HANDOFF_WAYS = ("mapped", "repaired", "guarded")
#: how each way is named in the demo's printout, the docs and the plot
WAY_LABELS = {"target": "target alone", "mapped": "mapped", "repaired": "repaired", "guarded": "guarded"}


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


def paying_text(long_rows: dict, tolerance: float = TOLERANCE) -> list[str]:
    """One sentence a row where the switch pays (`The switch pays on recall at 512 tokens: repaired 0.750 in 60.2 ms
    (1.52x sooner); the target alone 0.781 in 91.8 ms.`), or the one sentence that says it pays nowhere: what the
    demo prints and the docs generated from its JSON list."""
    sentences = []
    for task, row, ways in paying_rows(long_rows):
        target = row["ways"]["target"]
        served = ", ".join(
            f"{WAY_LABELS[way]} {row['ways'][way]['accuracy']:.3f} in {row['ways'][way]['ttft_ms']:.1f} ms "
            f"({target['ttft_ms'] / row['ways'][way]['ttft_ms']:.2f}x sooner)"
            for way in ways
        )
        sentences.append(
            f"The switch pays on {task} at {row['tokens']} tokens: {served}; the target alone "
            f"{target['accuracy']:.3f} in {target['ttft_ms']:.1f} ms."
        )
    return sentences or [
        f"The switch pays on no row measured: no handoff answers within {tolerance:.2f} of the target alone's "
        "accuracy with its first token sooner."
    ]


__all__ = [
    "BREAK_EVEN_RULE",
    "HANDOFF_WAYS",
    "TOLERANCE",
    "WAY_LABELS",
    "break_even",
    "break_even_text",
    "break_evens",
    "kept_counts",
    "kept_text",
    "latency_break_evens",
    "pays",
    "paying_rows",
    "paying_text",
]
