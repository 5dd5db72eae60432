"""The guard ladder's check after the rung: the target's margin on its first answer token over the served cache
(`answer_margin`), the rows it sends back (`check_rows`, `handoff(ladder=)` with `min_margin`), its calibration
(`calibrate_ladder(min_margin=)`, `ladder_from_records(check=)`) and the margins measured for records of before."""

from __future__ import annotations

import copy
import itertools
import json
import random

import pytest
import torch

from hf_kvmap import MapperModel, handoff
from hf_kvmap._compat import cache_kwargs, output_cache
from hf_kvmap.calibration.ladder import calibrate_ladder, ladder_outcome, refused_by_check
from hf_kvmap.calibration.ladder_items import (
    ladder_from_records,
    measure_ladder_items,
    parse_probe,
    record_costs,
    replay_ladder,
    strategy_key,
)
from hf_kvmap.input_checks import eos_token_ids
from hf_kvmap.rope import positions_from_attention_mask
from hf_kvmap.serving import HandoffRefusedError
from hf_kvmap.serving.forwards import answer_margins
from hf_kvmap.serving.ladder import FALLBACK, GuardLadder, LadderRung
from hf_kvmap.serving.pipeline import answer_margin, prepare_context, serve_rows, target_prefill
from lab.ladder_migration import (
    measure_margins,
    with_margins,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
PROBE = {"name": "prefix_audit", "tokens": 8}


def _own_margins(target, ids, mask):
    """The margin from the target's own full forward: top-1 minus top-2 probability after the last prompt token."""
    positions = positions_from_attention_mask(mask, *ids.shape, ids.device)
    logits = target(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
    top = torch.softmax(logits, -1).topk(2, -1).values
    return top[:, 0] - top[:, 1]


# ------------------------------------------------------------------------------------------------ the margin


def test_answer_margin_is_the_targets_own_and_leaves_the_cache_as_it_was(ladder_pair, tiny):
    target = ladder_pair[1]
    ids, mask = tiny.left_padded_batch((20, 26, 23), seed=5)
    cache = target_prefill(target, ids, mask)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    margins, tokens = answer_margin(target, cache, ids, mask, return_tokens=True)
    assert torch.allclose(margins, _own_margins(target, ids, mask), atol=TOL)
    assert ((margins >= 0) & (margins <= 1)).all()
    assert cache.get_seq_length() == ids.shape[1] - 1
    for (keys, values), layer in zip(before, cache.layers):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
    greedy = tiny.greedy(target, ids, mask, cache=cache)
    assert torch.equal(greedy, tiny.greedy(target, ids, mask))  # the cache still generates the target's own tokens
    assert torch.equal(greedy[:, ids.shape[1]], tokens)  # the top-1 token is the first greedy one
    with pytest.raises(ValueError, match="every prompt token but the last"):
        answer_margin(target, cache, ids[:, :-1], mask[:, :-1])


def test_answer_margins_read_each_greedy_token_as_generate_scores_it_and_stop_at_the_end(ladder_pair, tiny):
    target = ladder_pair[1]
    ids, mask = tiny.left_padded_batch((20, 26, 23), seed=5)
    cache = target_prefill(target, ids, mask)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    seconds = []
    margins, tokens, answered = answer_margins(target, cache, ids, mask, tokens=4, step_seconds=seconds)
    # each step's margin is the one generate's own scores give at that step, and its token generate's
    probabilities = tiny.greedy_probabilities(target, ids, mask, new=4)
    top = probabilities.topk(2, dim=-1).values
    assert torch.allclose(margins, top[..., 0] - top[..., 1], atol=TOL)
    greedy = tiny.greedy(target, ids, mask, new=4)[:, ids.shape[1] :]
    assert torch.equal(tokens, greedy) and answered.all() and len(seconds) == 4
    assert cache.get_seq_length() == ids.shape[1] - 1  # cropped back by every step it ran
    for (keys, values), layer in zip(before, cache.layers):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
    # the check of k tokens reads the smallest margin; tokens=1 is the first token's alone
    assert torch.allclose(answer_margin(target, cache, ids, mask, tokens=4), margins.min(dim=1).values)
    assert torch.allclose(answer_margin(target, cache, ids, mask), margins[:, 0])
    # a row's answer ends at its first end token: its later steps are not read, and once every row has ended the
    # check stops decoding
    row, step = 1, 1
    stop = [int(tokens[row, step])]
    ended_margins, ended_tokens, ended = answer_margins(target, cache, ids, mask, tokens=4, eos_token_ids=stop)
    first_stop = [next((j for j in range(4) if int(tokens[r, j]) == stop[0]), 4) for r in range(3)]
    assert ended.tolist() == [[j <= first_stop[r] for j in range(ended.shape[1])] for r in range(3)]
    assert torch.allclose(ended_margins, margins[:, : ended.shape[1]], atol=TOL)
    expected = torch.stack([margins[r, : first_stop[r] + 1].min() for r in range(3)])
    assert torch.allclose(answer_margin(target, cache, ids, mask, tokens=4, eos_token_ids=stop), expected, atol=TOL)
    everyone = [int(t) for t in tokens[:, 0]]  # every row's first token ends it: one step, as tokens=1
    one = answer_margins(target, cache, ids, mask, tokens=4, eos_token_ids=everyone)[0]
    assert one.shape == (3, 1) and torch.allclose(one[:, 0], margins[:, 0], atol=TOL)
    assert cache.get_seq_length() == ids.shape[1] - 1
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="tokens"):
            answer_margins(target, cache, ids, mask, tokens=bad)


# ------------------------------------------------------------------------------------------------ serving


def _scores(ladder_pair, ids, mask):
    _, report = handoff(*ladder_pair, ids, attention_mask=mask, probe=PROBE, threshold=1e9, audit_tokens=0)
    return report.scores


def _checked(rungs, min_margin):
    return GuardLadder(PROBE, "tail", rungs, min_margin=min_margin)


def test_the_check_sends_back_exactly_the_rows_below_the_margin(ladder_pair, tiny):
    source, target, mapper = ladder_pair
    ids, mask = tiny.left_padded_batch((20, 26, 23), seed=5)
    rungs = [LadderRung(max_risk=max(_scores(ladder_pair, ids, mask)) + 1.0, fraction=0.3)]  # every row repaired
    unchecked, plain = handoff(
        source, target, mapper, ids, attention_mask=mask, ladder=_checked(rungs, None), audit_tokens=0
    )
    # the margins of the served caches, as the check computes them
    context = prepare_context(source, target, mapper, ids, mask, None, 1)
    serve_rows(context, [0.3] * 3, "tail")
    margins = answer_margin(target, context.cache, ids, mask).tolist()
    assert len(set(margins)) == 3
    low, mid, high = sorted(range(3), key=lambda i: margins[i])
    # min_margin 0 keeps every row: the same cache as no check
    cache, report = handoff(
        source, target, mapper, ids, attention_mask=mask, ladder=_checked(rungs, 0.0), audit_tokens=0
    )
    assert [row["rung"] for row in report.ladder["rows"]] == ["repair:0.3"] * 3 and "check" in report.timings
    assert [row["margin"] for row in report.ladder["rows"]] == pytest.approx(margins, abs=TOL)
    for a, b in zip(cache.layers, unchecked.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # a min_margin between two rows' margins sends back the rows below it, and only those
    between = (margins[low] + margins[mid]) / 2
    cache, report = handoff(
        source, target, mapper, ids, attention_mask=mask, ladder=_checked(rungs, between), audit_tokens=0
    )
    rows = report.ladder["rows"]
    assert report.accepted and report.ladder["min_margin"] == between
    assert rows[low]["rung"] == FALLBACK and rows[low]["checked"] == "repair:0.3" and rows[low]["fraction"] is None
    assert rows[low]["recomputed"] == int(mask[low].sum()) - 1
    assert [rows[i]["rung"] for i in (mid, high)] == ["repair:0.3"] * 2 and "checked" not in rows[mid]
    own = target_prefill(target, ids, mask)
    width, pad = ids.shape[1], ids.shape[1] - int(mask[low].sum())
    for mine, theirs, served in zip(cache.layers, own.layers, unchecked.layers):
        assert (mine.keys[low, :, pad:] - theirs.keys[low, :, pad:]).abs().max() <= TOL
        assert (mine.values[low, :, pad:] - theirs.values[low, :, pad:]).abs().max() <= TOL
        assert torch.equal(mine.keys[[mid, high]], served.keys[[mid, high]])
    assert cache.get_seq_length() == width - 1
    # the row sent back generates the target's own tokens
    assert torch.equal(
        tiny.greedy(target, ids[low : low + 1], mask[low : low + 1], cache=_rows(cache, [low])),
        tiny.greedy(target, ids[low : low + 1], mask[low : low + 1]),
    )
    # policy="fail": a row the check would send back refuses the batch
    with pytest.raises(HandoffRefusedError, match="ladder check: row"):
        handoff(
            source,
            target,
            mapper,
            ids,
            attention_mask=mask,
            ladder=_checked(rungs, between),
            policy="fail",
            audit_tokens=0,
        )
    # a margin above every row's sends the whole batch back: the target's own generation
    cache, report = handoff(
        source, target, mapper, ids, attention_mask=mask, ladder=_checked(rungs, 1.0), audit_tokens=0
    )
    assert [row["rung"] for row in report.ladder["rows"]] == [FALLBACK] * 3
    assert torch.equal(tiny.greedy(target, ids, mask, cache=cache), tiny.greedy(target, ids, mask))
    assert plain.ladder["rows"][0].get("margin") is None  # no check, no margin


def _rows(cache, rows):
    from hf_kvmap.cache_views import row_cache

    return row_cache(cache, torch.tensor(rows))


def test_a_ladder_keeps_its_check_through_its_settings():
    ladder = GuardLadder(PROBE, "tail", [LadderRung(0.5, 0.2)], min_margin=0.25)
    assert GuardLadder.from_dict(ladder.to_dict()) == ladder
    plain = GuardLadder(PROBE, "tail", [LadderRung(0.5, 0.2)])
    assert "min_margin" not in plain.to_dict()  # the settings (and hashes) of ladders without a check are as before
    for bad in (-0.1, 1.5, True, "0.2", float("nan")):
        with pytest.raises(ValueError, match="min_margin"):
            GuardLadder(PROBE, "tail", [], min_margin=bad)


def test_a_check_over_more_tokens_keeps_its_count_and_needs_a_margin():
    ladder = GuardLadder(PROBE, "tail", [LadderRung(0.5, 0.2)], min_margin=0.25, check_tokens=4)
    assert ladder.to_dict()["check_tokens"] == 4 and GuardLadder.from_dict(ladder.to_dict()) == ladder
    one = GuardLadder(PROBE, "tail", [LadderRung(0.5, 0.2)], min_margin=0.25)
    assert "check_tokens" not in one.to_dict()  # a first-token check's settings (and hash) are as they were
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="check_tokens"):
            GuardLadder(PROBE, "tail", [], min_margin=0.25, check_tokens=bad)
    with pytest.raises(ValueError, match="min_margin is None"):
        GuardLadder(PROBE, "tail", [], check_tokens=4)


def test_the_card_says_how_many_answer_tokens_the_check_reads(ladder_pair):
    from hf_kvmap.card import render_card

    mapper = copy.deepcopy(ladder_pair[2])
    for tokens, phrase in ((1, "a row whose first answer token it takes"), (4, "decodes its first 4 greedy answer")):
        ladder = GuardLadder(PROBE, "tail", [LadderRung(0.5, 0.2)], min_margin=0.3, check_tokens=tokens)
        mapper.config.handoff_ladder = ladder.to_dict()
        card = str(render_card(mapper))
        assert "After its rung each row is checked" in card and phrase in card


def test_the_check_over_k_tokens_sends_back_the_rows_whose_answer_wavers(ladder_pair, tiny):
    source, target, mapper = ladder_pair
    ids, mask = tiny.left_padded_batch((20, 26, 23), seed=5)
    rungs = [LadderRung(max_risk=max(_scores(ladder_pair, ids, mask)) + 1.0, fraction=0.3)]
    context = prepare_context(source, target, mapper, ids, mask, None, 1)
    serve_rows(context, [0.3] * 3, "tail")
    first = answer_margin(target, context.cache, ids, mask).tolist()
    over = answer_margin(target, context.cache, ids, mask, tokens=4, eos_token_ids=eos_token_ids(target)).tolist()
    assert all(o <= f + TOL for o, f in zip(over, first))  # the smallest over four tokens, the first among them
    low = min(range(3), key=lambda i: over[i])
    between = (over[low] + min(over[i] for i in range(3) if i != low)) / 2
    ladder = GuardLadder(PROBE, "tail", rungs, min_margin=between, check_tokens=4)
    cache, report = handoff(source, target, mapper, ids, attention_mask=mask, ladder=ladder, audit_tokens=0)
    rows = report.ladder["rows"]
    assert report.ladder["check_tokens"] == 4
    assert [row["margin"] for row in rows] == pytest.approx(over, abs=TOL)
    assert [row["rung"] == FALLBACK for row in rows] == [i == low for i in range(3)]
    assert torch.equal(
        tiny.greedy(target, ids[low : low + 1], mask[low : low + 1], cache=_rows(cache, [low])),
        tiny.greedy(target, ids[low : low + 1], mask[low : low + 1]),
    )
    # here the row whose answer wavers latest takes its first token the most surely: a check of the first token at
    # the same margin serves every row
    assert first[low] == max(first) and min(first) > between
    _, report = handoff(
        source, target, mapper, ids, attention_mask=mask, ladder=_checked(rungs, between), audit_tokens=0
    )
    assert [row["rung"] for row in report.ladder["rows"]] == ["repair:0.3"] * 3


# ------------------------------------------------------------------------------------------------ calibration


def _brute_force(risks, changed, costs, groups, max_changed, refused):
    options = [*sorted(changed), None]
    order = sorted(range(len(risks)), key=lambda i: risks[i])
    best = None
    for picks in itertools.combinations_with_replacement(range(len(options)), len(order)):
        if any(risks[i] == risks[j] and a != b for (i, a), (j, b) in itertools.pairwise(zip(order, picks))):
            continue
        plan = [None] * len(risks)
        for i, k in zip(order, picks):
            plan[i] = options[k]
        outcome = ladder_outcome(plan, changed, costs, groups, refused)
        if all(
            row["changed_served"] * row["items"] <= max_changed * row["items"] + 1e-9
            for row in outcome["per_group"].values()
        ) and (best is None or outcome["mean_cost"] < best - 1e-12):
            best = outcome["mean_cost"]
    return best


@pytest.mark.parametrize("seed", range(6))
def test_a_checked_calibration_is_the_cheapest_monotone_assignment(seed):
    rng = random.Random(seed)
    n = 7
    risks = [round(rng.random(), 1) for _ in range(n)]
    changed = {f: [rng.random() < p for _ in range(n)] for f, p in ((0.0, 0.6), (0.3, 0.3))}
    margins = {f: [round(rng.random(), 2) for _ in range(n)] for f in changed}
    costs = {0.0: 0.1, 0.3: 0.4, FALLBACK: 1.1}
    groups = [rng.choice("ab") for _ in range(n)]
    ladder = calibrate_ladder(
        risks,
        changed,
        costs,
        probe=PROBE,
        strategy="tail",
        groups=groups,
        max_changed=0.34,
        margins=margins,
        min_margin=0.4,
    )
    refused = refused_by_check(margins, 0.4)
    outcome = ladder.calibration["outcome"]
    assert ladder.min_margin == 0.4 and ladder.calibration["min_margin"] == 0.4
    assert outcome["mean_cost"] == pytest.approx(_brute_force(risks, changed, costs, groups, 0.34, refused))
    replayed = ladder_outcome(ladder.plan(risks), changed, costs, groups, refused)
    assert replayed["mean_cost"] == pytest.approx(outcome["mean_cost"])
    assert replayed["changed_served"] == outcome["changed_served"]


def test_the_check_serves_what_a_probe_could_not_tell_apart():
    """Planted: the probe's risk says nothing, the answer changes exactly where the margin is low. Without a check
    the budget leaves only the fallback; with it the repair serves every item and sends back just the changed ones."""
    n = 40
    risks = [0.5] * n
    changed = {0.0: [True] * n, 0.2: [i % 4 == 0 for i in range(n)]}
    margins = {0.0: [0.1] * n, 0.2: [0.2 if i % 4 == 0 else 0.8 for i in range(n)]}
    costs = {0.0: 0.05, 0.2: 0.3, FALLBACK: 1.05}
    plain = calibrate_ladder(risks, changed, costs, probe=PROBE, strategy="tail", max_changed=0.0)
    assert plain.rungs == [] and plain.calibration["outcome"]["mean_cost"] == pytest.approx(1.05)
    checked = calibrate_ladder(
        risks, changed, costs, probe=PROBE, strategy="tail", max_changed=0.0, margins=margins, min_margin=0.5
    )
    outcome = checked.calibration["outcome"]
    assert [rung.fraction for rung in checked.rungs] == [0.2]
    assert outcome["changed_served"] == 0.0 and outcome["checked_fallback"] == 0.25
    assert outcome["mean_cost"] == pytest.approx(0.3 + 0.25 * 1.0)  # the rung for all, a prefill for a quarter
    with pytest.raises(ValueError, match="measure_margins"):
        calibrate_ladder(risks, changed, costs, probe=PROBE, strategy="tail", min_margin=0.5)


# ------------------------------------------------------------------------------------------------ records


def _measure(family, strategies, fractions):
    source, target, mapper, tokenizer, items = family
    return measure_ladder_items(
        source,
        target,
        mapper,
        tokenizer,
        items,
        probes=["draft_agreement:2"],
        strategies=strategies,
        fractions=fractions,
        progress=False,
    )


def test_records_hold_the_margins_the_check_reads_and_old_records_get_the_same(ladder_family):
    source, target, mapper, tokenizer, items = ladder_family
    strategies = ["tail", {"name": "draft_attention", "draft_tokens": 3, "stop_at_eos": False}]
    records = _measure(ladder_family, strategies, [0.2, 0.5])
    for item, record in zip(items, records):
        # the margin a record holds is the check's on that rung's served cache
        ids = torch.tensor([tokenizer(item.prompt)["input_ids"]])
        source_cache = output_cache(source(input_ids=ids, use_cache=True))
        context = prepare_context(
            source, target, mapper, ids, None, source_cache, parse_probe("draft_agreement:2").hold_back
        )
        serve_rows(context, [0.5], "tail")
        assert record["answers"]["tail"]["0.5"]["margin"] == pytest.approx(
            float(answer_margin(target, context.cache, ids)[0]), abs=TOL
        )
        assert set(record["seconds"]["verify"]["tail"]) == {"0", "0.2", "0.5"}
    # records measured before margins were recorded get the same margins served again
    old = copy.deepcopy(records)
    for record in old:
        for rungs in record["answers"].values():
            for outcome in rungs.values():
                outcome.pop("margin", None)  # the mapped rung is one dict the strategies share
        del record["seconds"]["verify"]
    with pytest.raises(ValueError, match="measure_margins"):
        ladder_from_records(old, check=True)
    measured = [measure_margins(source, target, mapper, tokenizer, i, r) for i, r in zip(items, old)]
    assert all(all(rungs.values()) for m in measured for rungs in m["first_agrees"].values())
    restored = with_margins(old, measured)
    for mine, theirs in zip(restored, records):
        assert {k: {f: o["margin"] for f, o in v.items()} for k, v in mine["answers"].items()} == {
            k: {f: o["margin"] for f, o in v.items()} for k, v in theirs["answers"].items()
        }
    with pytest.raises(ValueError, match="another prompt"):
        measure_margins(source, target, mapper, tokenizer, items[1], old[0])
    # a checked calibration is never dearer than the plain one (no check is a candidate) and replays as it scored
    plain = ladder_from_records(records, max_changed=0.0)
    checked = ladder_from_records(records, max_changed=0.0, check=[0.2, 0.6])
    assert set(checked.calibration["candidates"]) >= {"draft_agreement:2 tail check>=0.2", "draft_agreement:2 tail"}
    assert checked.calibration["outcome"]["mean_cost"] <= plain.calibration["outcome"]["mean_cost"] + 1e-12
    assert replay_ladder(checked, records) == checked.calibration["outcome"]
    key = strategy_key(strategies[1])
    check_costs, costs = (
        record_costs(records, "draft_agreement:2", key, check=True),
        record_costs(records, "draft_agreement:2", key),
    )
    assert all(check_costs[f] > costs[f] for f in (0.0, 0.2, 0.5)) and check_costs[FALLBACK] == costs[FALLBACK]


def test_a_checked_ladder_replayed_on_records_is_what_the_handoff_serves(ladder_family):
    source, target, mapper, tokenizer, items = ladder_family
    records = _measure(ladder_family, ["tail"], [0.5])
    margins = sorted({r["answers"]["tail"][f]["margin"] for r in records for f in ("0", "0.5")})
    min_margin = margins[len(margins) // 2]
    ladder = GuardLadder(
        {"name": "draft_agreement", "tokens": 2},
        "tail",
        [LadderRung(max_risk=0.5, fraction=0.0), LadderRung(max_risk=1.5, fraction=0.5)],
        min_margin=min_margin,
    )
    replayed = replay_ladder(ladder, records)
    sent_back = 0
    for item, record in zip(items, records):
        ids = torch.tensor([tokenizer(item.prompt)["input_ids"]])
        cache, report = handoff(source, target, mapper, ids, ladder=ladder, audit_tokens=0)
        row = report.ladder["rows"][0]
        planned = ladder.fraction_for(record["risks"]["draft_agreement:2"])
        if planned is not None:
            measured = record["answers"]["tail"][f"{planned:g}"]["margin"]
            assert row["margin"] == pytest.approx(measured, abs=TOL)
            assert (row["rung"] == FALLBACK) == (measured < min_margin)
            sent_back += row["rung"] == FALLBACK
            if row["rung"] == FALLBACK:
                own = target.generate(ids, **cache_kwargs(target_prefill(target, ids)), max_new_tokens=3)
                assert torch.equal(target.generate(ids, **cache_kwargs(cache), max_new_tokens=3), own)
    assert replayed["checked_fallback"] == pytest.approx(sent_back / len(records))


def test_records_hold_every_answer_tokens_margin_and_a_check_over_k_tokens_replays_as_served(ladder_family):
    source, target, mapper, tokenizer, items = ladder_family
    records = _measure(ladder_family, ["tail"], [0.5])
    for item, record in zip(items, records):
        expected = tokenizer(item.answer + item.stop, add_special_tokens=False)["input_ids"]
        for f, outcome in record["answers"]["tail"].items():
            assert outcome["margins"][0] == outcome["margin"] and 1 <= len(outcome["margins"]) <= len(expected)
            assert len(record["seconds"]["check_steps"]["tail"][f]) == len(outcome["margins"])
    # records of before get every token's margin served again, the same as measured now
    old = copy.deepcopy(records)
    for record in old:
        for outcome in record["answers"]["tail"].values():
            outcome.pop("margins", None)
        del record["seconds"]["check_steps"]
    with pytest.raises(ValueError, match="--token-margins"):
        ladder_from_records(old, check=[0.5], check_tokens=[2])
    assert "over 2 tokens" not in " ".join(ladder_from_records(old, check=[0.5]).calibration["candidates"])
    measured = [measure_margins(source, target, mapper, tokenizer, i, r, tokens=True) for i, r in zip(items, old)]
    for mine, theirs in zip(with_margins(old, measured), records):
        for f, outcome in theirs["answers"]["tail"].items():
            assert mine["answers"]["tail"][f]["margins"] == pytest.approx(outcome["margins"], abs=TOL)
    # the calibration tries every check length; a ladder checking two tokens replays as the handoff serves it
    checked = ladder_from_records(records, max_changed=0.0, check=[0.2, 0.6])
    assert "draft_agreement:2 tail check>=0.2 over 2 tokens" in checked.calibration["candidates"]
    assert replay_ladder(checked, records) == checked.calibration["outcome"]
    two = [min(o["margins"][:2]) for r in records for o in r["answers"]["tail"].values()]
    min_margin = sorted(two)[len(two) // 2]
    ladder = GuardLadder(
        {"name": "draft_agreement", "tokens": 2},
        "tail",
        [LadderRung(max_risk=0.5, fraction=0.0), LadderRung(max_risk=1.5, fraction=0.5)],
        min_margin=min_margin,
        check_tokens=2,
    )
    sent_back = 0
    for item, record in zip(items, records):
        ids = torch.tensor([tokenizer(item.prompt)["input_ids"]])
        _, report = handoff(source, target, mapper, ids, ladder=ladder, audit_tokens=0)
        planned = ladder.fraction_for(record["risks"]["draft_agreement:2"])
        if planned is not None:
            measured_margin = min(record["answers"]["tail"][f"{planned:g}"]["margins"][:2])
            row = report.ladder["rows"][0]
            assert row["margin"] == pytest.approx(measured_margin, abs=TOL)
            assert (row["rung"] == FALLBACK) == (measured_margin < min_margin)
            sent_back += row["rung"] == FALLBACK
    assert replay_ladder(ladder, records)["checked_fallback"] == pytest.approx(sent_back / len(records))
    assert 0 < sent_back < len(records)


def test_the_cli_calibrates_a_check_with_the_ladder(ladder_cli, capsys):
    from hf_kvmap.cli import main as cli

    args, out, records = ladder_cli
    assert cli(args) == 0
    plain = MapperModel.from_pretrained(out).config.handoff_ladder
    assert cli([*args, "--check", "--max-changed", "0.0"]) == 0
    checked = MapperModel.from_pretrained(out).config.handoff_ladder
    candidates = checked["calibration"]["candidates"]
    assert {f"draft_agreement:2 tail check>={m:g}" for m in (0.05, 0.5, 0.95)} <= set(candidates)
    assert checked["calibration"]["outcome"]["mean_cost"] == min(c["mean_cost"] for c in candidates.values())
    card = (out / "README.md").read_text()
    assert ("After its rung each row is checked" in card) == ("min_margin" in checked)
    assert "min_margin" not in plain
    # records of before margins were recorded cannot calibrate a check
    lines = []
    for line in records.read_text().splitlines():
        record = json.loads(line)
        for rungs in record["answers"].values():
            for outcome in rungs.values():
                outcome.pop("margin", None)
        lines.append(json.dumps(record))
    records.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    with pytest.raises(SystemExit, match="measure_margins"):
        cli([*args, "--check"])


def test_a_batch_served_row_by_row_records_what_the_target_recomputed_of_each_row(ladder_pair, tiny):
    """`serve_rows` on a left-padded batch (a mapped row, a row repaired at 0.3 by `tail`, a fallback row): the served
    `MappedCache.recomputed` is exactly each row's recomputed positions (none; the last real tokens the tail selects,
    as many as the row's record says; the whole row), so a later `DecodeRefresh` skips them."""
    source, target, mapper = ladder_pair
    ids, mask = tiny.left_padded_batch((20, 26, 23), seed=5)
    context = prepare_context(source, target, mapper, ids, mask, None, 1)
    rows = serve_rows(context, [0.0, 0.3, None], "tail")
    assert [row["rung"] for row in rows] == ["mapped", "repair:0.3", "fallback"]
    mapped = ids.shape[1] - 1
    done = context.cache.recomputed
    assert done.shape == (3, mapped)
    assert not done[0].any() and done[2].all()
    repaired = rows[1]["recomputed"]
    assert 0 < repaired < int(mask[1, :mapped].sum())
    assert done[1].tolist() == [False] * (mapped - repaired) + [True] * repaired
