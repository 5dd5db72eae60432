"""The migration of ladder records measured before a field existed, kept beside them (`<set>.<kind>.jsonl`, as the
library keeps the strategies added later, `hf_kvmap.calibration.ladder_side`): the answer margins a check after the
rung reads (`measure_margins`: the first token's, or with `tokens=True` every answer token's and each check step's
seconds) and the source's own answer (`measure_source_answer`: what not switching serves). Each returns one small
dict per record (`benchmarks.ladder.guard_ladder --margins --token-margins --source-answers`), and `with_margins` /
`with_source_answers` put them where [`~hf_kvmap.calibration.ladder_items.measure_item`] writes them, so a ladder
calibrated on old records with them equals one calibrated on records measured anew. `with_side_measurements` here
reads and measures every kind, the library's and the migration's.

```python
found = [measure_margins(source, target, mapper, tokenizer, item, record, tokens=True) for ...]
records = with_margins(records, found)
ladder = ladder_from_records(records, check=True)      # now over checks of 1, 2, 4 and 8 answer tokens too
```
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hf_kvmap import output_cache
from hf_kvmap.calibration import ladder_side
from hf_kvmap.calibration.ladder_items import (
    LadderItem,
    check_margins,
    has_margins,
    parse_probe,
    serve_rung,
    source_greedy_answer,
)
from hf_kvmap.calibration.ladder_side import prompt_of_record, record_mapper
from hf_kvmap.serving.pipeline import prepare_context

logger = logging.getLogger(__name__)


@torch.no_grad()
def measure_margins(
    source, target, mapper, tokenizer, item: LadderItem, record: dict[str, Any], tokens: bool = False
) -> dict[str, Any]:
    """The answer margins of a record measured before records held them: `item`'s rungs served again as
    [`measure_item`] served them (its probes' hold-back, every strategy and fraction of `record`), and on each the
    margins the check after the rung reads ([`check_margins`]). Returns `{"prompt_sha256", "mapper", "margins": {strategy:
    {fraction: margin}}, "verify": {strategy: {fraction: seconds}}, "first_agrees": {...}}` for [`with_margins`];
    with `tokens`, also `"token_margins"` (every greedy answer token's margin, to its end) and `"check_steps"` (each
    step's seconds). `first_agrees` says whether the served cache's first greedy token is the one the record implies
    (the reference's first token where the record's answer is unchanged), a check that the rung was served again as
    measured."""
    sha, ids, expected = prompt_of_record(tokenizer, item, record)
    mapper_hash = record_mapper(record, mapper)
    hold_back = parse_probe(next(iter(record["risks"]))).hold_back
    source_cache = output_cache(source(input_ids=ids, use_cache=True))
    context = prepare_context(source, target, mapper, ids, None, source_cache, hold_back)
    steps = len(expected) if tokens else 1
    margins, verify, agrees, token_margins, check_steps = {}, {}, {}, {}, {}
    for key, answers in record["answers"].items():
        margins[key], verify[key], agrees[key], token_margins[key], check_steps[key] = {}, {}, {}, {}, {}
        for f in answers:
            served, _, _ = serve_rung(context, record["strategies"][key], float(f))
            found, timed, answer = check_margins(target, served.cache, ids, steps)
            margins[key][f], verify[key][f] = found[0], timed[0]
            token_margins[key][f], check_steps[key][f] = found, timed
            agrees[key][f] = answers[f]["changed"] or answer[0] == record["reference"][0]
    out = {"prompt_sha256": sha, "mapper": mapper_hash, "margins": margins, "verify": verify, "first_agrees": agrees}
    if tokens:
        out.update(token_margins=token_margins, check_steps=check_steps)
    return out


def with_margins(records: Sequence[dict], measured: Sequence[dict]) -> list[dict]:
    """`records` with the margins of [`measure_margins`] put where [`measure_item`] now writes them (`margin` in every
    rung's answer, `seconds["verify"]`; and where measured, `margins` in every rung's answer and
    `seconds["check_steps"]`); records without a measurement are returned as they are."""
    by_sha = {m["prompt_sha256"]: m for m in measured}
    out = []
    for record in records:
        found = by_sha.get(record.get("prompt_sha256"))
        if found is None:
            out.append(record)
            continue
        every = found.get("token_margins")
        answers = {
            key: {
                f: {
                    **outcome,
                    "margin": found["margins"][key][f],
                    **({"margins": every[key][f]} if every is not None else {}),
                }
                if key in found["margins"]  # a strategy added after the margins were measured holds its own
                else outcome
                for f, outcome in rungs.items()
            }
            for key, rungs in record["answers"].items()
        }
        seconds = {**record["seconds"], "verify": {**record["seconds"].get("verify", {}), **found["verify"]}}
        if every is not None:
            seconds["check_steps"] = {**record["seconds"].get("check_steps", {}), **found["check_steps"]}
        out.append({**record, "answers": answers, "seconds": seconds})
    return out


@torch.no_grad()
def measure_source_answer(source, tokenizer, item: LadderItem, record: dict[str, Any]) -> dict[str, Any]:
    """The source's own answer for a record measured before records held it, as [`measure_item`] now measures it
    (the same prefill, cut back by one token, and greedy steps). Returns `{"prompt_sha256", "source_answer",
    "correct_source"}` for [`with_source_answers`]."""
    sha, ids, expected = prompt_of_record(tokenizer, item, record)
    source_cache = output_cache(source(input_ids=ids, use_cache=True))
    answer = source_greedy_answer(source, ids, source_cache, len(expected), tokenizer.pad_token_id)
    return {"prompt_sha256": sha, "source_answer": answer, "correct_source": answer == expected}


def with_source_answers(records: Sequence[dict], measured: Sequence[dict]) -> list[dict]:
    """`records` with the source's answers of [`measure_source_answer`] put where [`measure_item`] now writes them;
    records without a measurement are returned as they are."""
    by_sha = {m["prompt_sha256"]: m for m in measured}
    return [
        {**record, "source_answer": found["source_answer"], "correct_source": found["correct_source"]}
        if (found := by_sha.get(record.get("prompt_sha256"))) is not None
        else record
        for record in records
    ]


def has_source_answers(records: Sequence[dict]) -> bool:
    """Whether every record holds the source's own answer (`correct_source`), so the gap a rung recovers can be told."""
    return bool(records) and all("correct_source" in record for record in records)


def _measure_margins(pair, item, record, tokens: bool = False) -> dict:
    found = measure_margins(*pair[:4], item, record, tokens=tokens)
    disagree = [f"{k} {f}" for k, rungs in found["first_agrees"].items() for f, ok in rungs.items() if not ok]
    if disagree:
        logger.warning("%s: served again, the first token differs at %s", record["prompt_sha256"][:12], disagree)
    return found


#: the side measurements of the migration, then the library's (strategies, merged last)
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
    **ladder_side.SIDE_MEASUREMENTS,
}


def with_side_measurements(
    path: Path, pair, items, records: list[dict], measure: Sequence[str] = (), strategies: Sequence = ()
) -> list[dict]:
    """[`~hf_kvmap.calibration.ladder_side.with_side_measurements`] over every kind of `SIDE_MEASUREMENTS`: the
    migration's (margins, token margins, the source's answers) and the library's (strategies added later)."""
    return ladder_side.with_side_measurements(path, pair, items, records, measure, strategies, SIDE_MEASUREMENTS)


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


__all__ = [
    "SIDE_MEASUREMENTS",
    "has_source_answers",
    "machines",
    "measure_margins",
    "measure_source_answer",
    "with_margins",
    "with_side_measurements",
    "with_source_answers",
]
