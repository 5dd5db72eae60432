"""What ladder records measured before a field existed get measured after them: the answer margins a check after the
rung reads (`measure_margins`: the first token's, or with `tokens=True` every answer token's and each check step's
seconds), the source's own answer (`measure_source_answer`: what not switching serves), and repair strategies the
records were not measured with (`measure_strategies`: every rung of each, against the target's answer the record
holds, so the target's prefill is not run again). Each returns one small dict per record, kept beside the records
(`benchmarks.guard_ladder --margins --token-margins --source-answers`, and `--strategies` naming a strategy the
records lack), and `with_margins` / `with_source_answers` / `with_strategies` put them where
[`~hf_kvmap.calibration.ladder_items.measure_item`] writes them, so a ladder calibrated on old records with them
equals one calibrated on records measured anew.

```python
found = [measure_margins(source, target, mapper, tokenizer, item, record, tokens=True) for ...]
records = with_margins(records, found)
ladder = ladder_from_records(records, check=True)      # now over checks of 1, 2, 4 and 8 answer tokens too
```
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from .._compat import output_cache
from ..repair import strategy_from_dict
from ..reporting import machine_info
from ..serving.pipeline import prepare_context
from .ladder_items import (
    LadderItem,
    check_mapper,
    check_margins,
    mapper_key,
    measure_rung,
    parse_probe,
    serve_rung,
    source_greedy_answer,
    strategy_key,
)


def _prompt(tokenizer, item: LadderItem, record: dict[str, Any]) -> tuple[str, torch.Tensor, list[int]]:
    sha = hashlib.sha256(item.prompt.encode()).hexdigest()
    if record.get("prompt_sha256") != sha:
        raise ValueError("The record is of another prompt than this item; pass the records in the items' order.")
    ids = torch.tensor([tokenizer(item.prompt)["input_ids"]])
    return sha, ids, tokenizer(item.answer + item.stop, add_special_tokens=False)["input_ids"]


def _same_mapper(record: dict[str, Any], mapper) -> str:
    """The mapper's content hash, refused where the record names another: its rungs would be served on another mapped
    cache than the record's (records of before they named theirs are taken as measured with this one)."""
    key = mapper_key(mapper)
    check_mapper(record, key)
    return key


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
    sha, ids, expected = _prompt(tokenizer, item, record)
    mapper_hash = _same_mapper(record, mapper)
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
    sha, ids, expected = _prompt(tokenizer, item, record)
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
    sha, ids, expected = _prompt(tokenizer, item, record)
    mapper_hash = _same_mapper(record, mapper)
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


__all__ = [
    "has_source_answers",
    "measure_margins",
    "measure_source_answer",
    "measure_strategies",
    "with_margins",
    "with_source_answers",
    "with_strategies",
]
