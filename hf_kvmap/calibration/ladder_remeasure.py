"""What ladder records measured before a field existed get measured after them: the answer margins a check after the
rung reads (`measure_margins`: the first token's, or with `tokens=True` every answer token's and each check step's
seconds) and the source's own answer (`measure_source_answer`: what not switching serves). Each returns one small
dict per record, kept beside the records (`benchmarks.guard_ladder --margins --token-margins --source-answers`), and
`with_margins` / `with_source_answers` put them where [`~hf_kvmap.calibration.ladder_items.measure_item`] now writes
them, so a ladder calibrated on old records with them equals one calibrated on records measured anew.

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
from ..serving.pipeline import prepare_context
from .ladder_items import LadderItem, check_margins, parse_probe, serve_rung, source_greedy_answer


def _prompt(tokenizer, item: LadderItem, record: dict[str, Any]) -> tuple[str, torch.Tensor, list[int]]:
    sha = hashlib.sha256(item.prompt.encode()).hexdigest()
    if record.get("prompt_sha256") != sha:
        raise ValueError("The record is of another prompt than this item; pass the records in the items' order.")
    ids = torch.tensor([tokenizer(item.prompt)["input_ids"]])
    return sha, ids, tokenizer(item.answer + item.stop, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def measure_margins(
    source, target, mapper, tokenizer, item: LadderItem, record: dict[str, Any], tokens: bool = False
) -> dict[str, Any]:
    """The answer margins of a record measured before records held them: `item`'s rungs served again as
    [`measure_item`] served them (its probes' hold-back, every strategy and fraction of `record`), and on each the
    margins the check after the rung reads ([`check_margins`]). Returns `{"prompt_sha256", "margins": {strategy:
    {fraction: margin}}, "verify": {strategy: {fraction: seconds}}, "first_agrees": {...}}` for [`with_margins`];
    with `tokens`, also `"token_margins"` (every greedy answer token's margin, to its end) and `"check_steps"` (each
    step's seconds). `first_agrees` says whether the served cache's first greedy token is the one the record implies
    (the reference's first token where the record's answer is unchanged), a check that the rung was served again as
    measured."""
    sha, ids, expected = _prompt(tokenizer, item, record)
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
    out = {"prompt_sha256": sha, "margins": margins, "verify": verify, "first_agrees": agrees}
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
                for f, outcome in rungs.items()
            }
            for key, rungs in record["answers"].items()
        }
        seconds = {**record["seconds"], "verify": found["verify"]}
        if every is not None:
            seconds["check_steps"] = found["check_steps"]
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


__all__ = ["has_source_answers", "measure_margins", "measure_source_answer", "with_margins", "with_source_answers"]
