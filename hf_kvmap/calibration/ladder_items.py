"""Measuring the guard ladder on items: per prompt, the target's own answer, every candidate probe's risk on the mapped
cache, and the answer and cost of every rung (the records `hf_kvmap.calibration.ladder_records` chooses and replays
ladders from; its names are importable from here too).

```python
records = measure_ladder_items(source, target, mapper, tokenizer, items, probes=["draft_agreement:2"],
                               strategies=["tail", "source_attention"], fractions=[0.1, 0.3])
ladder = ladder_from_records(records, max_changed=0.05)      # the cheapest (probe, strategy) ladder
checked = ladder_from_records(records, max_changed=0.05, check=True)  # ... with a check after the rung, if cheaper
mapper.config.handoff_ladder = ladder.to_dict()
```

Every record is measured through the code the handoff serves with (`hf_kvmap.serving.pipeline`: `prepare_context`, the probes, `serve_rows`), one
prompt at a time, so replaying a ladder on records gives what `handoff(..., ladder=)` serves on those prompts.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from .._compat import cache_kwargs, output_cache
from ..artifacts import content_hash
from ..drafting import Draft
from ..repair import strategy_from_dict
from ..reporting import machine_info
from ..serving.forwards import answer_margins
from ..serving.pipeline import prepare_context, serve_rows, target_prefill
from ..serving.probes import Probe, probe_from_dict
from .ladder_records import (
    CHECK_MARGINS,
    CHECK_TOKENS,
    cheapest_keeping,
    has_margins,
    has_sparse,
    held_strategies,
    ladder_from_records,
    option_text,
    parse_probe,
    perfect_probe_outcome,
    probe_key,
    record_costs,
    record_margin,
    record_margins,
    replay_ladder,
    strategy_key,
    with_min_tokens,
)


@dataclass(frozen=True)
class LadderItem:
    """One prompt whose greedy answer is compared: `prompt`, the expected `answer` (+ `stop`), and its `task`."""

    prompt: str
    answer: str
    stop: str = ""
    task: str = "task"


def items_from_tasks(tasks: Sequence) -> tuple[list[LadderItem], list[str]]:
    """The exact-match items of `tasks` (`hf_kvmap.evaluation.TaskSpec`s) as [`LadderItem`]s, and the names of the
    tasks skipped because their items are not answers to compare (choice, perplexity)."""
    items, skipped = [], []
    for task in tasks:
        if task.task_type != "exact_match":
            skipped.append(task.name)
            continue
        for item in task.items:
            prompt = getattr(item, "prompt", "") or item.context
            items.append(LadderItem(prompt, item.answer, getattr(item, "stop", "") or task.stop, task.name))
    return items, skipped


def mapper_key(mapper) -> str:
    """The mapper's content hash (`hf_kvmap.artifacts.content_hash`, computed where it was never saved): a record keeps
    it, so that what is measured for the record later is served on the same mapped cache."""
    return mapper.config.content_hash or content_hash(mapper.state_dict(), mapper.config)


def check_mapper(record: dict, key: str) -> None:
    """Refuse a record measured with another mapper than the one of content hash `key` (records of before they named
    theirs are taken as measured with it): its rungs would be served on another mapped cache."""
    if record.get("mapper", key) != key:
        raise ValueError(
            f"The record was measured with mapper {record['mapper']}, this one is {key}: its rungs would be served on "
            "another mapped cache. Pass the mapper the records were measured with (or measure into a new records "
            "file)."
        )


def _greedy(target, ids, cache, steps: int, pad: int | None) -> list[int]:
    out = target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        **cache_kwargs(cache),
        max_new_tokens=steps,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=None,
    )
    return out[0, ids.shape[1] :].tolist()


def source_greedy_answer(source, ids, source_cache, steps: int, pad: int | None) -> list[int]:
    """The source's own greedy answer, as if no switch happened: its cache of the whole prompt (the one the mapping
    reads, left as it is) copied and cut back by the last token, which runs as the first step of its generation."""
    cache = copy.deepcopy(source_cache)
    cache.crop(-1)  # negative: the number of tokens dropped, which every cache layer type takes
    return _greedy(source, ids, cache, steps, pad)


@torch.no_grad()
def measure_item(
    source,
    target,
    mapper,
    tokenizer,
    item: LadderItem,
    *,
    probes: Sequence[Probe],
    strategies: Sequence[dict | str],
    fractions: Sequence[float],
    sparse: bool = False,
) -> dict[str, Any]:
    """One prompt's record: `reference` (the target's own greedy answer), `correct_target`, `source_answer` and
    `correct_source` (the source's own, what not switching serves), `risks` per probe key,
    `mapper` (its content hash, [`mapper_key`]), `answers[strategy][f]` (`changed` from the reference, `correct`, `margin`, the target's
    [`~hf_kvmap.serving.forwards.answer_margin`] on the served cache, what a ladder's check after the rung reads, and
    `margins`, each greedy answer token's, what a check of more tokens reads: [`check_margins`]) per
    strategy key and fraction (fraction 0, the mapped cache, is measured once and shared), `strategies` (key ->
    settings), and `seconds` of each stage (`repair[strategy][f]`, `verify[strategy][f]`, the check's first token,
    and `check_steps[strategy][f]`, each of its tokens). With `sparse`, also `sparse[strategy][f]` at every fraction
    but 0: the sparse rung (`LadderRung.sparse`), served as a one-row handoff serves it, the target's prefill of the
    positions the repair of that fraction selects, alone (the same outcome fields, and `selected`, the positions it
    prefilled), with its seconds in `seconds["sparse"]`, `sparse_draft_steps` and `sparse_check_steps`."""
    ids = torch.tensor([tokenizer(item.prompt)["input_ids"]])
    expected = tokenizer(item.answer + item.stop, add_special_tokens=False)["input_ids"]
    pad = tokenizer.pad_token_id
    start = time.perf_counter()
    own = target_prefill(target, ids)
    prefill = time.perf_counter() - start
    reference = _greedy(target, ids, own, len(expected), pad)
    source_cache = output_cache(source(input_ids=ids, use_cache=True))
    source_answer = source_greedy_answer(source, ids, source_cache, len(expected), pad)
    start = time.perf_counter()
    context = prepare_context(source, target, mapper, ids, None, source_cache, probes[0].hold_back)
    mapping = time.perf_counter() - start
    risks, probe_seconds, probe_steps = {}, {}, {}
    for probe in probes:
        start = time.perf_counter()
        # each probe on drafts of its own: its seconds are what it costs when it is the ladder's only probe
        scored = dataclasses.replace(context, drafts={})
        risks[probe_key(probe)] = float(probe.risks(scored)[0])
        probe_seconds[probe_key(probe)] = time.perf_counter() - start
        probe_steps[probe_key(probe)] = scored.drafts["source"].steps if "source" in scored.drafts else 0

    def serve(strategy, fraction, sparse=False):
        return measure_rung(context, target, ids, strategy, fraction, reference, expected, pad, sparse=sparse)

    mapped, mapped_seconds, _, mapped_checked = serve(strategies[0], 0.0)
    answers, repair_seconds, draft_steps, check_steps, settings = {}, {}, {}, {}, {}
    for strategy in strategies:
        key = strategy_key(strategy)
        settings[key] = strategy_from_dict(strategy).settings()
        answers[key], repair_seconds[key], draft_steps[key] = {"0": mapped}, {"0": mapped_seconds}, {"0": []}
        check_steps[key] = {"0": mapped_checked}
        for fraction in fractions:
            if fraction:
                f = f"{fraction:g}"
                answers[key][f], repair_seconds[key][f], draft_steps[key][f], check_steps[key][f] = serve(
                    strategy, fraction
                )
    spared = {"answers": {}, "seconds": {}, "draft_steps": {}, "check_steps": {}}
    for strategy in strategies if sparse else ():  # the repair's selection prefilled alone, as a handoff serves it
        rungs = [serve(strategy, fraction, sparse=True) for fraction in fractions if fraction]
        for part, values in zip(spared.values(), zip(*rungs)):
            part[strategy_key(strategy)] = {f"{f:g}": value for f, value in zip([f for f in fractions if f], values)}
    record = {
        "task": item.task,
        "prompt_sha256": hashlib.sha256(item.prompt.encode()).hexdigest(),
        "tokens": ids.shape[1],
        "mapper": mapper_key(mapper),
        "machine": machine_info(),
        "reference": reference,
        "correct_target": reference == expected,
        "source_answer": source_answer,
        "correct_source": source_answer == expected,
        "risks": risks,
        "strategies": settings,
        "answers": answers,
        "seconds": {
            "prefill": prefill,
            "map": mapping,
            "probe": probe_seconds,
            "repair": repair_seconds,
            "probe_source_steps": probe_steps,
            "repair_draft_steps": draft_steps,
            "verify": {key: {f: steps[0] for f, steps in rungs.items()} for key, rungs in check_steps.items()},
            "check_steps": check_steps,
        },
    }
    if sparse:  # absent otherwise: records without sparse rungs keep the fields they had
        record["sparse"] = spared["answers"]
        record["seconds"].update(
            sparse=spared["seconds"],
            sparse_draft_steps=spared["draft_steps"],
            sparse_check_steps=spared["check_steps"],
        )
    return record


def measure_rung(
    context,
    target,
    ids,
    strategy,
    fraction: float,
    reference: list[int],
    expected: list[int],
    pad: int | None,
    *,
    sparse: bool = False,
):
    """One rung of a record (prompt `ids`), served on a copy of `context`'s mapped cache ([`serve_rung`]; with
    `sparse`, its sparse rung): its outcome (`changed` from the target's own `reference` answer, `correct` against
    `expected`, the check's `margin` and every answer token's `margins`; a sparse rung's `selected` positions), the
    seconds it took, the source draft's step seconds and the check's."""
    served, seconds, steps = serve_rung(context, strategy, fraction, sparse)
    margins, timed, _ = check_margins(target, served.cache, ids, len(expected))
    answer = _greedy(target, ids, served.cache, len(expected), pad)
    outcome = {"changed": answer != reference, "correct": answer == expected, "margin": margins[0]}
    if sparse:
        outcome["selected"] = int(served.cache.sparse_info["selected"])
    return {**outcome, "margins": margins}, seconds, steps, timed


def check_margins(target, cache, ids, steps: int) -> tuple[list[float], list[float], list[int]]:
    """The margins a check after the rung reads on a served cache (one row), token by token over the greedy answer
    (at most `steps`, to the target's first end token), each step's seconds and the greedy tokens: what a check of any
    number of tokens would read and pay ([`~hf_kvmap.serving.forwards.answer_margins`], as serving runs it)."""
    timed: list[float] = []
    margins, tokens, answered = answer_margins(target, cache, ids, tokens=steps, step_seconds=timed)
    return [float(m) for m in margins[0][answered[0]]], timed, tokens[0][answered[0]].tolist()


def serve_rung(context, strategy, fraction: float, sparse: bool = False):
    """One rung served on a copy of `context`'s mapped cache, as `serve_rows` serves it (with `sparse`, the sparse rung
    of `fraction`, as it serves a one-row request: `hf_kvmap.serving.sparse_rows`): the served context, the seconds it
    took, and the seconds of each step of the source draft the strategy decoded (a fresh draft, so that a strategy
    that drafts decodes it here and its steps are timed one by one)."""
    draft = Draft(
        context.source, context.source_cache, context.input_ids, context.attention_mask, context.source_position_ids
    )
    served = dataclasses.replace(context, cache=copy.deepcopy(context.cache), drafts={"source": draft})
    start = time.perf_counter()
    serve_rows(served, [fraction], strategy, [sparse])
    return served, time.perf_counter() - start, draft.step_seconds


def measure_ladder_items(
    source,
    target,
    mapper,
    tokenizer,
    items: Sequence[LadderItem],
    *,
    probes: Sequence[Probe | dict | str],
    strategies: Sequence[dict | str],
    fractions: Sequence[float],
    done: Sequence[dict] = (),
    on_record: Callable[[dict], None] | None = None,
    progress: bool = True,
    sparse: bool = False,
) -> list[dict[str, Any]]:
    r"""
    Records of `items` for [`ladder_from_records`]: see [`measure_item`].

    Args:
        source, target, mapper, tokenizer: the handoff's models, its mapper and their shared tokenizer.
        items (sequence of [`LadderItem`]): the prompts.
        probes (sequence): candidate probes (`Probe`, settings, or `"name:tokens"`), all with one `hold_back` (they
            read the same mapped cache).
        strategies (sequence of `dict` or `str`): the candidate repair strategies of the repairing rungs (each is
            measured at every fraction; the calibration keeps the cheapest).
        fractions (sequence of `float`): the rungs measured, in `[0, 1)`; 0 (the mapped cache) is always measured.
        done (sequence of `dict`, *optional*): records measured before (a resumed run): the first `len(done)` items
            are not measured again.
        on_record (callable, *optional*): called with each new record (e.g. to append it to a file).
        progress (`bool`, *optional*, defaults to `True`): a tqdm bar.
        sparse (`bool`, *optional*, defaults to `False`): also measure every strategy's sparse rung at every fraction
            but 0 (the target's prefill of the positions that repair selects, alone, served as `handoff` serves a
            one-row request; `record["sparse"]`), so that [`ladder_from_records`] may place one where it is cheaper
            than the repair of its fraction and keeps the answers as well. Records measured before (`done`) must then
            hold them too.
    """
    probes = [
        parse_probe(p) if isinstance(p, str) else p if isinstance(p, Probe) else probe_from_dict(p) for p in probes
    ]
    if not probes:
        raise ValueError("Pass at least one probe (e.g. probes=['draft_agreement:2']).")
    holds = {p.hold_back for p in probes}
    if len(holds) > 1:
        raise ValueError(
            f"The probes hold back different numbers of tokens ({sorted(holds)}), so they read different mapped "
            "caches; measure them in separate runs."
        )
    fractions = sorted({0.0, *(float(f) for f in fractions)})
    if not all(0.0 <= f < 1.0 for f in fractions):
        raise ValueError(f"fractions={fractions} must lie in [0, 1): the fallback is the full prefill.")
    if isinstance(strategies, (str, dict)) or not strategies:
        raise ValueError("Pass a list of repair strategies (e.g. strategies=['tail']).")
    strategies = [strategy_from_dict(s).settings() for s in strategies]  # unknown strategies raise before any work
    keys = [strategy_key(s) for s in strategies]
    if len(set(keys)) != len(keys):
        raise ValueError(f"The strategies {keys} repeat one; give each once.")
    if len(done) > len(items):
        raise ValueError(
            f"{len(done)} records measured before, for {len(items)} items; pass the records of these items."
        )
    mapped_by = mapper_key(mapper) if done else None
    for item, record in zip(items, done):
        check_mapper(record, mapped_by)
        sha = hashlib.sha256(item.prompt.encode()).hexdigest()
        if record.get("task") != item.task or record.get("prompt_sha256", sha) != sha:
            raise ValueError(
                "The records measured before are of other prompts than these items (in this order); measure into a "
                "new records file."
            )
        if set(keys) != set(record.get("answers", {})) or set(record["answers"][keys[0]]) != {
            f"{f:g}" for f in fractions
        }:
            raise ValueError(
                "The records measured before hold other strategies or fractions than asked for now; measure into a "
                "new records file (or ask for what they hold)."
            )
        rungs = {f"{f:g}" for f in fractions if f}
        if sparse and (
            set(record.get("sparse", {})) != set(keys) or any(set(record["sparse"][key]) != rungs for key in keys)
        ):
            raise ValueError(
                "The records measured before hold no sparse rungs of every strategy and fraction asked for (measured "
                "without sparse=True, or a strategy measured beside them later); measure into a new records file "
                "with sparse=True (`--sparse`), or leave it off."
            )
    records = list(done)
    for item in tqdm(items[len(records) :], desc="ladder items", disable=not progress):
        record = measure_item(
            source,
            target,
            mapper,
            tokenizer,
            item,
            probes=probes,
            strategies=strategies,
            fractions=fractions,
            sparse=sparse,
        )
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records


__all__ = [
    "CHECK_MARGINS",
    "CHECK_TOKENS",
    "LadderItem",
    "cheapest_keeping",
    "check_mapper",
    "check_margins",
    "has_margins",
    "has_sparse",
    "held_strategies",
    "items_from_tasks",
    "ladder_from_records",
    "measure_item",
    "measure_ladder_items",
    "measure_rung",
    "option_text",
    "parse_probe",
    "perfect_probe_outcome",
    "probe_key",
    "record_costs",
    "record_margin",
    "record_margins",
    "replay_ladder",
    "strategy_key",
    "with_min_tokens",
]
