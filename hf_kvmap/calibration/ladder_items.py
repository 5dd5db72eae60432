"""Measuring the guard ladder on items: per prompt, the target's own answer, every candidate probe's risk on the mapped
cache, and the answer and cost of every rung; then the ladder calibrated on one item set and replayed on another.

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
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from .._compat import cache_kwargs, output_cache
from ..artifacts import content_hash
from ..drafting import Draft
from ..repair import selector_from_dict
from ..reporting import machine_info
from ..serving.forwards import answer_margins
from ..serving.ladder import FALLBACK, GuardLadder
from ..serving.pipeline import prepare_context, serve_rows, target_prefill
from ..serving.probes import Probe, probe_from_dict
from .ladder import calibrate_ladder, ladder_outcome, refused_by_check


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


def probe_key(probe: Probe | dict | str) -> str:
    """`"name:tokens"` of a probe (how records name its risk)."""
    probe = probe if isinstance(probe, Probe) else probe_from_dict(probe)
    return f"{probe.name}:{probe.tokens}"


def option_text(value: Any) -> str:
    """A strategy option as its record key writes it: a number or text as it is, anything else as sorted JSON."""
    return str(value) if isinstance(value, (int, float, str)) else json.dumps(value, sort_keys=True)


def strategy_key(strategy: dict | str) -> str:
    """How records name a repair strategy: its name, then its options as `:key=value` (JSON for nested ones)."""
    settings = selector_from_dict(strategy).settings()
    options = {k: v for k, v in sorted(settings.items()) if k != "name"}
    parts = [f"{k}={option_text(v)}" for k, v in options.items()]
    return ":".join([settings["name"], *parts])


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


def parse_probe(text: str) -> Probe:
    """A probe from `"name"` or `"name:tokens"`."""
    name, _, tokens = text.partition(":")
    return probe_from_dict({"name": name, **({"tokens": int(tokens)} if tokens else {})})


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
) -> dict[str, Any]:
    """One prompt's record: `reference` (the target's own greedy answer), `correct_target`, `source_answer` and
    `correct_source` (the source's own, what not switching serves), `risks` per probe key,
    `mapper` (its content hash, [`mapper_key`]), `answers[strategy][f]` (`changed` from the reference, `correct`, `margin`, the target's
    [`~hf_kvmap.serving.forwards.answer_margin`] on the served cache, what a ladder's check after the rung reads, and
    `margins`, each greedy answer token's, what a check of more tokens reads: [`check_margins`]) per
    strategy key and fraction (fraction 0, the mapped cache, is measured once and shared), `strategies` (key ->
    settings), and `seconds` of each stage (`repair[strategy][f]`, `verify[strategy][f]`, the check's first token,
    and `check_steps[strategy][f]`, each of its tokens)."""
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
        risks[probe_key(probe)] = float(probe.score(scored).float()[0])
        probe_seconds[probe_key(probe)] = time.perf_counter() - start
        probe_steps[probe_key(probe)] = scored.drafts["source"].steps if "source" in scored.drafts else 0

    def serve(strategy, fraction):
        return measure_rung(context, target, ids, strategy, fraction, reference, expected, pad)

    mapped, mapped_seconds, _, mapped_checked = serve(strategies[0], 0.0)
    answers, repair_seconds, draft_steps, check_steps, settings = {}, {}, {}, {}, {}
    for strategy in strategies:
        key = strategy_key(strategy)
        settings[key] = selector_from_dict(strategy).settings()
        answers[key], repair_seconds[key], draft_steps[key] = {"0": mapped}, {"0": mapped_seconds}, {"0": []}
        check_steps[key] = {"0": mapped_checked}
        for fraction in fractions:
            if fraction:
                f = f"{fraction:g}"
                answers[key][f], repair_seconds[key][f], draft_steps[key][f], check_steps[key][f] = serve(
                    strategy, fraction
                )
    return {
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


def measure_rung(
    context, target, ids, strategy, fraction: float, reference: list[int], expected: list[int], pad: int | None
):
    """One rung of a record (prompt `ids`), served on a copy of `context`'s mapped cache ([`serve_rung`]): its
    outcome (`changed` from the target's own `reference` answer, `correct` against `expected`, the check's `margin`
    and every answer token's `margins`), the seconds it took, the source draft's step seconds and the check's."""
    served, seconds, steps = serve_rung(context, strategy, fraction)
    margins, timed, _ = check_margins(target, served.cache, ids, len(expected))
    answer = _greedy(target, ids, served.cache, len(expected), pad)
    outcome = {"changed": answer != reference, "correct": answer == expected, "margin": margins[0]}
    return {**outcome, "margins": margins}, seconds, steps, timed


def check_margins(target, cache, ids, steps: int) -> tuple[list[float], list[float], list[int]]:
    """The margins a check after the rung reads on a served cache (one row), token by token over the greedy answer
    (at most `steps`, to the target's first end token), each step's seconds and the greedy tokens: what a check of any
    number of tokens would read and pay ([`~hf_kvmap.serving.forwards.answer_margins`], as serving runs it)."""
    timed: list[float] = []
    margins, tokens, answered = answer_margins(target, cache, ids, tokens=steps, step_seconds=timed)
    return [float(m) for m in margins[0][answered[0]]], timed, tokens[0][answered[0]].tolist()


def serve_rung(context, strategy, fraction: float):
    """One rung served on a copy of `context`'s mapped cache, as `serve_rows` serves it: the served context, the
    seconds it took, and the seconds of each step of the source draft the strategy decoded (a fresh draft, so that a
    strategy that drafts decodes it here and its steps are timed one by one)."""
    draft = Draft(
        context.source, context.source_cache, context.input_ids, context.attention_mask, context.source_position_ids
    )
    served = dataclasses.replace(context, cache=copy.deepcopy(context.cache), drafts={"source": draft})
    start = time.perf_counter()
    serve_rows(served, [fraction], strategy)
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
    strategies = [selector_from_dict(s).settings() for s in strategies]  # unknown strategies raise before any work
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
    records = list(done)
    for item in tqdm(items[len(records) :], desc="ladder items", disable=not progress):
        record = measure_item(
            source, target, mapper, tokenizer, item, probes=probes, strategies=strategies, fractions=fractions
        )
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records


#: the answer margins a ladder's check after the rung is calibrated over (`ladder_from_records(check=True)`)
CHECK_MARGINS = tuple(round(0.05 * i, 2) for i in range(1, 20))


#: the numbers of answer tokens a check is calibrated over where the records hold every answer token's margin
CHECK_TOKENS = (1, 2, 4, 8)


def has_margins(record: dict, tokens: int = 1) -> bool:
    """Whether a record holds the answer margin of every rung it measured (what a check after the rung reads): of the
    first answer token, or with `tokens` > 1 of every answer token (`margins`) and each check step's seconds."""
    key = "margin" if tokens == 1 else "margins"
    held = all(key in outcome for rungs in record["answers"].values() for outcome in rungs.values())
    return held and (tokens == 1 or "check_steps" in record["seconds"])


def _need_margins(records: Sequence[dict], tokens: int = 1) -> None:
    if not all(has_margins(record, tokens) for record in records):
        what = "answer margins" if tokens == 1 else "margins of every answer token"
        raise ValueError(
            f"A ladder that checks {tokens} answer token(s) after each rung needs the {what} in every record; these "
            "records were measured before they were recorded: measure them with `ladder_remeasure.measure_margins` "
            f"(`python -m benchmarks.guard_ladder ... {'--margins' if tokens == 1 else '--token-margins'}`)."
        )


def record_margin(outcome: dict, tokens: int = 1) -> float:
    """The margin a check of `tokens` answer tokens reads in one rung's outcome: its smallest over them (an answer
    that ended sooner, over all of it)."""
    return float(outcome["margin"]) if tokens == 1 else min(float(m) for m in outcome["margins"][:tokens])


def record_costs(
    records: Sequence[dict], key: str, strategy: str, check: bool = False, check_tokens: int = 1
) -> dict[float | str, float]:
    """Mean cost of every rung relative to each record's own prefill, with the mapping (and the held-back tokens) and
    probe `key` counted in every rung, strategy `strategy`'s repair in the repairing ones, and the prefill in the
    fallback. A repair that continues the probe's source draft does not pay again for the steps the probe decoded:
    the seconds the repair's own first steps took are taken off (records that timed them; older ones pay in full).
    With `check`, every rung but the fallback also pays the check after it (the answer margin's token, or the steps
    of a check of `check_tokens` tokens)."""
    fractions = sorted(float(f) for f in records[0]["answers"][strategy])
    if check:
        _need_margins(records, check_tokens)
    sums: dict[float | str, float] = dict.fromkeys([*fractions, FALLBACK], 0.0)
    for record in records:
        seconds = record["seconds"]
        base = (seconds["map"] + seconds["probe"][key]) / seconds["prefill"]
        shared = seconds.get("probe_source_steps", {}).get(key, 0)
        for f in fractions:
            steps = seconds.get("repair_draft_steps", {}).get(strategy, {}).get(f"{f:g}", [])
            repair = seconds["repair"][strategy][f"{f:g}"] - sum(steps[:shared])
            if check and check_tokens == 1:
                repair += seconds["verify"][strategy][f"{f:g}"]
            elif check:
                repair += sum(seconds["check_steps"][strategy][f"{f:g}"][:check_tokens])
            sums[f] += base + repair / seconds["prefill"]
        sums[FALLBACK] += base + 1.0
    return {k: v / len(records) for k, v in sums.items()}


def record_margins(records: Sequence[dict], strategy: str, tokens: int = 1) -> dict[float, list[float]]:
    """Per measured fraction of `strategy`, every record's answer margin on its served cache ([`record_margin`] over
    `tokens` answer tokens)."""
    _need_margins(records, tokens)
    fractions = sorted(float(f) for f in records[0]["answers"][strategy])
    return {f: [record_margin(r["answers"][strategy][f"{f:g}"], tokens) for r in records] for f in fractions}


def _changed(records: Sequence[dict], strategy: str) -> dict[float, list[bool]]:
    fractions = sorted(float(f) for f in records[0]["answers"][strategy])
    return {f: [bool(r["answers"][strategy][f"{f:g}"]["changed"]) for r in records] for f in fractions}


def held_strategies(records: Sequence[dict]) -> list[str]:
    """The strategies every record holds answers of (sorted keys): a strategy measured beside records after them is
    a candidate only once every record has it (a side pass stopped part-way leaves it out)."""
    return sorted(set.intersection(*(set(r["answers"]) for r in records))) if records else []


def _pick(keys: Sequence[str] | None, held: Sequence[str], what: str) -> list[str]:
    keys = list(held) if keys is None else list(keys)
    missing = [k for k in keys if k not in held]
    if missing:
        raise ValueError(f"The records hold no {what} {missing}; they have {sorted(held)}.")
    return keys


def ladder_from_records(
    records: Sequence[dict],
    *,
    strategy: dict | str | None = None,
    probe: str | None = None,
    max_changed: float = 0.05,
    confidence: float | None = None,
    provenance: dict[str, Any] | None = None,
    check: bool | Sequence[float] = False,
    check_tokens: Sequence[int] | None = None,
) -> GuardLadder:
    """The calibrated ladder of `records` ([`calibrate_ladder`], budget per task): of `probe` (a key of the records'
    risks) and `strategy`, or else of the candidate probe and strategy whose ladder costs least there; `max_changed`
    and `confidence` as in [`calibrate_ladder`]. With `check` (`True`: the margins of `CHECK_MARGINS`, or a sequence
    of them), the ladder may also check each rung's answer margin: every candidate is calibrated without a check and
    with each `min_margin`, and the cheapest kept (the records need margins), over checks of each number of answer
    tokens of `check_tokens` (default: `CHECK_TOKENS` where every record holds every answer token's margin, else the
    first token alone). The costs, changed answers and ladders of every candidate are kept in
    `calibration["candidates"]`."""
    if not records:
        raise ValueError("No records: measure items first (measure_ladder_items).")
    probes = _pick([probe] if probe else None, sorted(records[0]["risks"]), "risk of the probes")
    strategies = _pick(
        [strategy_key(strategy)] if strategy is not None else None, held_strategies(records), "strategies"
    )
    margins_checked = [] if check is False else list(CHECK_MARGINS if check is True else check)
    if check_tokens is None:
        check_tokens = CHECK_TOKENS if margins_checked and all(has_margins(r, 2) for r in records) else (1,)
    if not margins_checked:
        check_tokens = ()
    best, candidates = None, {}
    groups = [r["task"] for r in records]
    for key in probes:
        risks = [r["risks"][key] for r in records]
        for name in strategies:
            changed = _changed(records, name)
            costs, margins = {None: record_costs(records, key, name)}, {}
            for tokens in check_tokens:  # the same for every margin tried
                costs[tokens] = record_costs(records, key, name, check=True, check_tokens=tokens)
                margins[tokens] = record_margins(records, name, tokens)
            tries = [(None, None)] + [(m, k) for k in check_tokens for m in margins_checked]
            for min_margin, tokens in tries:
                ladder = calibrate_ladder(
                    risks,
                    changed,
                    costs[tokens],
                    probe=parse_probe(key).settings(),
                    strategy=records[0]["strategies"][name],
                    groups=groups,
                    max_changed=max_changed,
                    confidence=confidence,
                    provenance=provenance,
                    margins=margins.get(tokens),
                    min_margin=min_margin,
                    check_tokens=tokens or 1,
                )
                outcome = ladder.calibration["outcome"]
                label = f"{key} {name}"
                if min_margin is not None:
                    label += f" check>={min_margin:g}" + (f" over {tokens} tokens" if tokens > 1 else "")
                candidates[label] = {
                    "mean_cost": outcome["mean_cost"],
                    "changed_served": outcome["changed_served"],
                    "rungs": ladder.to_dict()["rungs"],
                    **({"min_margin": min_margin} if min_margin is not None else {}),
                    **({"check_tokens": tokens} if tokens and tokens > 1 else {}),
                }
                if best is None or outcome["mean_cost"] < best.calibration["outcome"]["mean_cost"]:
                    best = ladder
    best.calibration["candidates"] = candidates
    return best


def replay_ladder(ladder: GuardLadder | dict, records: Sequence[dict]) -> dict[str, Any]:
    """`ladder_outcome` of serving `records` with `ladder` (calibrated elsewhere): its probe, its strategy and every
    rung it uses must have been measured there. With the ladder's `min_tokens`, a record of fewer prompt tokens is
    served the target's prefill unmapped (rung `"short"`)."""
    ladder = GuardLadder.from_dict(ladder)
    key, name = probe_key(ladder.probe), strategy_key(ladder.strategy)
    if key not in records[0]["risks"]:
        raise ValueError(f"The records hold no risk of the ladder's probe {key}.")
    if name not in held_strategies(records):
        raise ValueError(
            f"The records hold no answers of the ladder's strategy {name} on every record; every record holds "
            f"{held_strategies(records)}."
        )
    measured = {float(f) for f in records[0]["answers"][name]}
    unmeasured = [rung.fraction for rung in ladder.rungs if rung.fraction not in measured]
    if unmeasured:
        raise ValueError(
            f"The records do not measure the ladder's fractions {unmeasured}; they hold {sorted(measured)}."
        )
    plan = ladder.plan([r["risks"][key] for r in records])
    checked, tokens = ladder.min_margin is not None, ladder.check_tokens
    return ladder_outcome(
        plan,
        _changed(records, name),
        record_costs(records, key, name, check=checked, check_tokens=tokens),
        [r["task"] for r in records],
        refused_by_check(record_margins(records, name, tokens), ladder.min_margin) if checked else None,
        [ladder.too_short(r["tokens"]) for r in records] if ladder.min_tokens is not None else None,
    )


def with_min_tokens(ladder: GuardLadder, min_tokens: int, records: Sequence[dict]) -> GuardLadder:
    """`ladder` (calibrated on `records`) with `min_tokens` set, its calibration outcome replayed on the records with
    the records below it prefilled unmapped ([`replay_ladder`]). Serving fewer items the mapped cache only lowers the
    changed answers served, so a budget the ladder held on the records still holds."""
    gated = GuardLadder.from_dict({**ladder.to_dict(), "min_tokens": min_tokens})
    gated.calibration = {**(ladder.calibration or {}), "outcome": replay_ladder(gated, records)}
    return gated


def cheapest_keeping(record: dict, strategy: str, costs: dict[float | str, float]) -> float | None:
    """The rung of one record that keeps the target's answer at the least cost: the measured fraction of `strategy`
    (0: the mapped cache) whose answer is unchanged and whose `costs` entry is least, or `None` (the fallback) where no
    such rung costs less than `costs["fallback"]`."""
    answers = record["answers"][strategy]
    kept = [f for f in sorted(float(k) for k in answers) if not answers[f"{f:g}"]["changed"]]
    best = min(kept, key=lambda f: costs[f], default=None)
    return best if best is not None and costs[best] < costs[FALLBACK] else None


def perfect_probe_outcome(records: Sequence[dict], strategy: str, cost_of: str | None = None) -> dict[str, Any]:
    """What a perfect probe would serve on measured records: every request the cheapest rung that keeps the target's
    answer ([`cheapest_keeping`]; the fallback always does), as [`ladder_outcome`] with the rungs costed as a
    calibrated ladder's ([`record_costs`]). The probe costs nothing, or what probe `cost_of` (a key of the records'
    risks) cost on each record. It serves no changed answer and costs no more than any ladder of these rungs that
    serves none; the gap to a calibrated ladder's cost is what a better probe could save with these rungs."""
    perfect = "perfect"  # a probe key no record holds
    priced = []
    for record in records:
        seconds = record["seconds"]
        steps = seconds.get("probe_source_steps", {})
        priced.append(
            {
                **record,
                "seconds": {
                    **seconds,
                    "probe": {**seconds["probe"], perfect: 0.0 if cost_of is None else seconds["probe"][cost_of]},
                    "probe_source_steps": {**steps, perfect: 0 if cost_of is None else steps.get(cost_of, 0)},
                },
            }
        )
    costs = record_costs(priced, perfect, strategy)
    plan = [cheapest_keeping(record, strategy, costs) for record in records]
    return ladder_outcome(plan, _changed(records, strategy), costs, [r["task"] for r in records])


__all__ = [
    "CHECK_MARGINS",
    "CHECK_TOKENS",
    "LadderItem",
    "cheapest_keeping",
    "check_mapper",
    "check_margins",
    "has_margins",
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
