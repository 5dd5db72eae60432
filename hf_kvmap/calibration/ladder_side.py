"""The measurements kept beside a ladder records file, made after its records were: the answer margins of the first
token (`<set>.margins.jsonl`), of every answer token (`<set>.token_margins.jsonl`), the source's own answers
(`<set>.source.jsonl`) and the repair strategies added after the records were measured (`<set>.strategies.jsonl`),
each resumable and merged into the records whenever they are read ([`ladder_remeasure`] measures them).
`hf-kvmap calibrate-ladder --records` and `benchmarks.guard_ladder` keep them so.

```python
records = with_side_measurements(path, (source, target, mapper, tokenizer), items, records,
                                 measure=["strategies"], strategies=["tail", "query_overlap"])
```
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from .ladder_items import has_margins, strategy_key
from .ladder_remeasure import (
    measure_margins,
    measure_source_answer,
    measure_strategies,
    with_margins,
    with_source_answers,
    with_strategies,
)

logger = logging.getLogger(__name__)


def _missing(record: dict, strategies: Sequence) -> list:
    return [s for s in strategies if strategy_key(s) not in record["answers"]]


def _measure_margins(pair, item, record, tokens: bool = False) -> dict:
    found = measure_margins(*pair[:4], item, record, tokens=tokens)
    disagree = [f"{k} {f}" for k, rungs in found["first_agrees"].items() for f, ok in rungs.items() if not ok]
    if disagree:
        logger.warning("%s: served again, the first token differs at %s", record["prompt_sha256"][:12], disagree)
    return found


#: what can be measured for records after they were recorded, kept beside them as `<set>.<kind>.jsonl`:
#: kind -> (whether a record already holds it, the measurement of one item, the merge into the records); the first
#: two read the strategies asked for (what the "strategies" kind adds where a record lacks them)
SIDE_MEASUREMENTS = {
    "margins": (
        lambda record, strategies: has_margins(record),
        lambda pair, item, record, strategies: _measure_margins(pair, item, record),
        with_margins,
    ),
    "token_margins": (
        lambda record, strategies: has_margins(record, tokens=2),
        lambda pair, item, record, strategies: _measure_margins(pair, item, record, tokens=True),
        with_margins,
    ),
    "source": (
        lambda record, strategies: "correct_source" in record,
        lambda pair, item, record, strategies: measure_source_answer(pair[0], pair[3], item, record),
        with_source_answers,
    ),
    "strategies": (
        lambda record, strategies: not _missing(record, strategies),
        lambda pair, item, record, strategies: measure_strategies(
            *pair[:4], item, record, _missing(record, strategies)
        ),
        with_strategies,
    ),
}


def side_path(path: Path, kind: str) -> Path:
    """Where the `kind` measured for the records at `path` after them is kept: `<name>.<kind>.jsonl`."""
    return path.with_name(path.name.removesuffix(".jsonl") + f".{kind}.jsonl")


def read_side(path: Path, kind: str) -> list[dict]:
    """The `kind` measurements kept beside the records at `path`, or none."""
    side = side_path(Path(path), kind)
    return [json.loads(line) for line in side.read_text().splitlines() if line.strip()] if side.is_file() else []


def with_side_measurements(
    path: Path, pair, items, records: list[dict], measure: Sequence[str] = (), strategies: Sequence = ()
) -> list[dict]:
    """`records` with every measurement kept beside them (`SIDE_MEASUREMENTS`: the answer margins, the source's own
    answer, strategies added later) merged in; for each kind in `measure`, the records that lack it are measured
    first (`pair` and `items`, the records' items in order; appended to the side file one item at a time, so a
    stopped run resumes). "strategies" measures those of `strategies` (names or settings) a record lacks, and is
    merged last: a strategy measured later holds its own margins and shares the mapped rung (fraction 0) as the
    records hold it by then, margins included. Without `measure`, `pair` and `items` are not used.

    Args:
        path (`Path`): the records file; each kind is kept beside it as `<name>.<kind>.jsonl` ([`side_path`]).
        pair (`tuple`): `(source, target, mapper, tokenizer)`, as the records were measured with.
        items (sequence of [`LadderItem`]): the records' items, in the records' order.
        records (`list[dict]`): the records read from `path`.
        measure (sequence of `str`, *optional*): kinds of `SIDE_MEASUREMENTS` to measure where a record lacks them.
        strategies (sequence, *optional*): the strategies (names or settings) every record should hold.
    """
    order = [*(kind for kind in SIDE_MEASUREMENTS if kind != "strategies"), "strategies"]
    for kind in order:
        holds, measure_one, merge = SIDE_MEASUREMENTS[kind]
        measured = read_side(path, kind)
        if kind in measure:
            merged = merge(records, measured)
            todo = [(i, r) for i, r in zip(items, merged) if not holds(r, strategies)]
            for item, record in tqdm(todo, desc=f"{kind} ({path.name})"):
                found = measure_one(pair, item, record, strategies)
                measured.append(found)
                with side_path(path, kind).open("a") as handle:
                    handle.write(json.dumps(found) + "\n")
        records = merge(records, measured)
    return records


def machines(records: Sequence[dict]) -> dict[str, int]:
    """How many of `records` were measured, wholly or in part, on each CPU (the records' own `machine`, and each
    measurement merged beside them, `machine_beside`), `"not recorded"` for parts measured before records named it: a
    study recomputed from records says where its seconds come from. A record measured on two CPUs counts for both, so
    the counts may sum to more than the records."""
    counts: dict[str, int] = {}
    for record in records:
        found = [record.get("machine"), *record.get("machine_beside", {}).values()]
        for cpu in sorted({(machine or {}).get("cpu", "not recorded") for machine in found}):
            counts[cpu] = counts.get(cpu, 0) + 1
    return dict(sorted(counts.items()))


__all__ = ["SIDE_MEASUREMENTS", "machines", "read_side", "side_path", "with_side_measurements"]
