"""The measurements kept beside a ladder records file, made after its records were: the repair strategies added after
the records were measured (`<set>.strategies.jsonl`, [`measure_strategies`]), resumable and merged into the records
whenever they are read. `hf-kvmap calibrate-ladder --records` keeps them so; the migration of records measured before
a field existed (the answer margins, the source's own answers) is the lab's (`lab.ladder_migration`), which passes its
kinds to [`with_side_measurements`].

```python
records = with_side_measurements(path, (source, target, mapper, tokenizer), items, records,
                                 measure=["strategies"], strategies=["tail", "query_overlap"])
```
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .._compat import output_cache
from ..repair import strategy_from_dict
from ..reporting import machine_info
from ..serving.pipeline import prepare_context
from .ladder_items import (
    LadderItem,
    check_mapper,
    mapper_key,
    measure_rung,
    parse_probe,
    serve_rung,
    strategy_key,
)

logger = logging.getLogger(__name__)


def prompt_of_record(tokenizer, item: LadderItem, record: dict[str, Any]) -> tuple[str, torch.Tensor, list[int]]:
    """`item`'s prompt sha256, token ids `(1, seq)` and expected answer ids, refused (`ValueError`) where `record` is
    of another prompt."""
    sha = hashlib.sha256(item.prompt.encode()).hexdigest()
    if record.get("prompt_sha256") != sha:
        raise ValueError("The record is of another prompt than this item; pass the records in the items' order.")
    ids = torch.tensor([tokenizer(item.prompt)["input_ids"]])
    return sha, ids, tokenizer(item.answer + item.stop, add_special_tokens=False)["input_ids"]


def record_mapper(record: dict[str, Any], mapper) -> str:
    """The mapper's content hash, refused where the record names another: its rungs would be served on another mapped
    cache than the record's (records of before they named theirs are taken as measured with this one)."""
    key = mapper_key(mapper)
    check_mapper(record, key)
    return key


@torch.no_grad()
def measure_strategies(
    source, target, mapper, tokenizer, item: LadderItem, record: dict[str, Any], strategies: Sequence[dict | str]
) -> dict[str, Any]:
    """The rungs of `strategies` (ones `record` was not measured with) on `item`, as [`measure_item`] measures a
    strategy: at every fraction the record holds (the mapped cache's rung, fraction 0, is the record's own), each
    answer compared with the target's own answer the record holds. Returns `{"prompt_sha256", "mapper", "strategies": {key:
    settings}, "answers": {key: {fraction: outcome}}, "seconds": {"repair", "repair_draft_steps", "verify",
    "check_steps"}, "yardstick"}` (each of `seconds` `{key: {fraction: ...}}`) for [`with_strategies`].

    The records timed their stages beside the item's own prefill; this pass runs apart from it, maybe on another
    machine. So it also times a yardstick beside the new rungs: the record's first strategy served again at its
    smallest repairing fraction (`{"strategy", "fraction", "seconds"}`), which [`with_strategies`] uses to put the new
    seconds on the records' clock. `mapper` is the mapper's content hash; a record naming another is refused."""
    sha, ids, expected = prompt_of_record(tokenizer, item, record)
    mapper_hash = record_mapper(record, mapper)
    keys = {strategy_key(s): strategy_from_dict(s).settings() for s in strategies}
    held = [key for key in keys if key in record["answers"]]
    if held:
        raise ValueError(f"The record was measured with {held} already.")
    hold_back = parse_probe(next(iter(record["risks"]))).hold_back
    source_cache = output_cache(source(input_ids=ids, use_cache=True))
    context = prepare_context(source, target, mapper, ids, None, source_cache, hold_back)
    fractions = [f for f in next(iter(record["answers"].values())) if float(f)]
    answers, repair, drafts, verify, steps = {}, {}, {}, {}, {}
    for key, settings in keys.items():
        answers[key], repair[key], drafts[key], verify[key], steps[key] = {}, {}, {}, {}, {}
        for f in fractions:
            outcome, seconds, draft_steps, timed = measure_rung(
                context, target, ids, settings, float(f), record["reference"], expected, tokenizer.pad_token_id
            )
            answers[key][f], repair[key][f], drafts[key][f], verify[key][f], steps[key][f] = (
                outcome,
                seconds,
                draft_steps,
                timed[0],
                timed,
            )
    own = next(iter(record["answers"]))
    _, timed_own, _ = serve_rung(context, record["strategies"][own], float(fractions[0]))
    yardstick = {"strategy": own, "fraction": fractions[0], "seconds": timed_own}
    seconds = {"repair": repair, "repair_draft_steps": drafts, "verify": verify, "check_steps": steps}
    return {
        "prompt_sha256": sha,
        "mapper": mapper_hash,
        "machine": machine_info(),
        "strategies": keys,
        "answers": answers,
        "seconds": seconds,
        "yardstick": yardstick,
    }


def _on_records_clock(record: dict[str, Any], found: dict[str, Any]) -> float:
    """The factor that puts the seconds of a [`measure_strategies`] measurement on `record`'s clock: the seconds the
    record timed its yardstick rung in, over the seconds the measurement timed it in (1 for measurements of before
    yardsticks, whose seconds are taken as they are)."""
    yardstick = found.get("yardstick")
    if yardstick is None:
        return 1.0
    return record["seconds"]["repair"][yardstick["strategy"]][yardstick["fraction"]] / yardstick["seconds"]


def _scaled(seconds: float | list[float], scale: float) -> float | list[float]:
    return [step * scale for step in seconds] if isinstance(seconds, list) else seconds * scale


def with_strategies(records: Sequence[dict], measured: Sequence[dict]) -> list[dict]:
    """`records` with the strategies of [`measure_strategies`] put where [`measure_item`] writes them: each rung's
    answer and seconds, the mapped cache's rung (fraction 0) shared with the record's own strategies. The added
    seconds are scaled by the measurement's yardstick onto the record's clock (the new rung's seconds over the
    yardstick's, side by side, times the yardstick's seconds in the record), and the factor is kept in
    `record["clock"][key]` (absent for a measurement without a yardstick: its seconds are as timed); the keys
    merged so are listed in `record["measured_beside"]`, and the content hash of the mapper each was measured with in
    `record["mapper_beside"]` and the machine in `record["machine_beside"]` (where the measurement names them). Several
    measurements of one record (strategies added at different times) are all merged; records without one are
    returned as they are."""
    by_sha: dict[str, list[dict]] = {}
    for found in measured:
        by_sha.setdefault(found["prompt_sha256"], []).append(found)
    out = []
    for record in records:
        record = {**record, "answers": dict(record["answers"]), "strategies": dict(record["strategies"])}
        record["seconds"] = {k: dict(v) if isinstance(v, dict) else v for k, v in record["seconds"].items()}
        own = next(iter(record["answers"]))  # the mapped cache's rung is every strategy's
        for found in by_sha.get(record.get("prompt_sha256"), []):
            scale = _on_records_clock(record, found)
            for key, rungs in found["answers"].items():
                record["strategies"][key] = found["strategies"][key]
                record["answers"][key] = {"0": record["answers"][own]["0"], **rungs}
                for part, values in found["seconds"].items():
                    if part in record["seconds"] and own in record["seconds"][part]:
                        scaled = {f: _scaled(seconds, scale) for f, seconds in values[key].items()}
                        record["seconds"][part][key] = {"0": record["seconds"][part][own]["0"], **scaled}
                record["measured_beside"] = sorted({*record.get("measured_beside", []), key})
                if "mapper" in found:
                    record["mapper_beside"] = {**record.get("mapper_beside", {}), key: found["mapper"]}
                if "machine" in found:
                    record["machine_beside"] = {**record.get("machine_beside", {}), key: found["machine"]}
                if "yardstick" in found:
                    record["clock"] = {**record.get("clock", {}), key: scale}
        out.append(record)
    return out


def _missing(record: dict, strategies: Sequence) -> list:
    return [s for s in strategies if strategy_key(s) not in record["answers"]]


#: what can be measured for records after they were recorded, kept beside them as `<set>.<kind>.jsonl`:
#: kind -> (whether a record already holds it, the measurement of one item, the merge into the records); the first
#: two read the strategies asked for (what the "strategies" kind adds where a record lacks them). The lab adds the
#: kinds of its migration of old records (`lab.ladder_migration.SIDE_MEASUREMENTS`).
SIDE_MEASUREMENTS = {
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
    path: Path,
    pair,
    items,
    records: list[dict],
    measure: Sequence[str] = (),
    strategies: Sequence = (),
    kinds: Mapping[str, tuple] | None = None,
) -> list[dict]:
    """`records` with every measurement kept beside them (the kinds of `kinds`, by default `SIDE_MEASUREMENTS`: the
    strategies added later) merged in; for each kind in `measure`, the records that lack it are measured
    first (`pair` and `items`, the records' items in order; appended to the side file one item at a time, so a
    stopped run resumes). "strategies" measures those of `strategies` (names or settings) a record lacks, and is
    merged last: a strategy measured later holds its own margins and shares the mapped rung (fraction 0) as the
    records hold it by then, margins included. Without `measure`, `pair` and `items` are not used.

    Args:
        path (`Path`): the records file; each kind is kept beside it as `<name>.<kind>.jsonl` ([`side_path`]).
        pair (`tuple`): `(source, target, mapper, tokenizer)`, as the records were measured with.
        items (sequence of [`LadderItem`]): the records' items, in the records' order.
        records (`list[dict]`): the records read from `path`.
        measure (sequence of `str`, *optional*): kinds of `kinds` to measure where a record lacks them.
        strategies (sequence, *optional*): the strategies (names or settings) every record should hold.
        kinds (`Mapping`, *optional*, defaults to `SIDE_MEASUREMENTS`): kind -> (whether a record holds it, the
            measurement of one item, the merge), read and merged in their order, "strategies" last.
    """
    kinds = SIDE_MEASUREMENTS if kinds is None else kinds
    order = [*(kind for kind in kinds if kind != "strategies"), "strategies"]
    for kind in order:
        holds, measure_one, merge = kinds[kind]
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


__all__ = [
    "SIDE_MEASUREMENTS",
    "measure_strategies",
    "prompt_of_record",
    "read_side",
    "record_mapper",
    "side_path",
    "with_side_measurements",
    "with_strategies",
]
