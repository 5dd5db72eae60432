"""The guard ladder: calibration recovers a planted ladder and is the optimum of every monotone assignment, each row of a
batch gets exactly its rung (mapped rows untouched, repaired rows equal to repairing them alone, fallback rows the
target's own prefill), replaying a calibrated ladder on measured items gives what the live handoff serves, the ladder
is covered by the serving hash, shown on the card, and bad ladders are refused by name."""

from __future__ import annotations

import itertools
import json
import math
import random
from fractions import Fraction

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_kvmap import MappedCache, MapperModel, handoff, zoo
from hf_kvmap._compat import cache_kwargs, output_cache
from hf_kvmap.artifacts import serving_hash
from hf_kvmap.calibration.ladder import (
    calibrate_ladder,
    changed_budget,
    changed_upper_bound,
    items_to_vouch,
    ladder_outcome,
)
from hf_kvmap.calibration.ladder_items import (
    cheapest_keeping,
    held_strategies,
    ladder_from_records,
    mapper_key,
    measure_ladder_items,
    perfect_probe_outcome,
    record_costs,
    replay_ladder,
    strategy_key,
)
from hf_kvmap.calibration.ladder_side import measure_strategies, with_strategies
from hf_kvmap.cli import main as cli
from hf_kvmap.reporting import machine_info
from hf_kvmap.rope import positions_from_attention_mask
from hf_kvmap.serving.ladder import FALLBACK, GuardLadder, LadderRung
from hf_kvmap.serving.pipeline import prepare_context, serve_rows
from hf_kvmap.serving.probes import probe_from_dict
from lab.ladder_migration import (
    has_source_answers,
    machines,
    measure_margins,
    measure_source_answer,
    with_source_answers,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
PROBE = {"name": "draft_agreement", "tokens": 2}


# ------------------------------------------------------------------------------------------------ calibration


def _planted(n=40, seed=0):
    """Items whose answer changes at fraction f exactly when the risk is above the planted bound of f."""
    rng = random.Random(seed)
    risks = [rng.random() for _ in range(n)]
    bounds = {0.0: 0.3, 0.2: 0.6, 0.5: 0.9}
    changed = {f: [r > b for r in risks] for f, b in bounds.items()}
    costs = {0.0: 0.05, 0.2: 0.3, 0.5: 0.6, FALLBACK: 1.05}
    return risks, changed, costs, bounds


def test_calibration_recovers_a_planted_ladder():
    risks, changed, costs, bounds = _planted()
    ladder = calibrate_ladder(risks, changed, costs, probe=PROBE, strategy="tail", max_changed=0.0)
    assert [rung.fraction for rung in ladder.rungs] == [0.0, 0.2, 0.5]
    for rung in ladder.rungs:  # each bound sits at the highest risk that rung can take without a changed answer
        assert rung.max_risk == max(r for r in risks if r <= bounds[rung.fraction])
    outcome = ladder.calibration["outcome"]
    assert outcome["changed_served"] == 0.0
    assert outcome["rungs"]["fallback"] == pytest.approx(sum(r > 0.9 for r in risks) / len(risks))
    assert outcome["net_saving"] == pytest.approx(1.0 - outcome["mean_cost"])
    # replaying it on the same items is what the calibration recorded
    assert ladder_outcome(ladder.plan(risks), changed, costs) == {**outcome, "per_group": outcome["per_group"]}


def _brute_force(risks, changed, costs, groups, max_changed):
    options = [*sorted(changed), None]
    order = sorted(range(len(risks)), key=lambda i: risks[i])
    best = None
    for picks in itertools.combinations_with_replacement(range(len(options)), len(order)):
        if any(risks[i] == risks[j] and a != b for (i, a), (j, b) in itertools.pairwise(zip(order, picks))):
            continue  # a threshold cannot split items of equal risk
        plan = [None] * len(risks)
        for i, k in zip(order, picks):
            plan[i] = options[k]
        outcome = ladder_outcome(plan, changed, costs, groups)
        budget_ok = all(
            row["changed_served"] * row["items"] <= max_changed * row["items"] + 1e-9
            for row in outcome["per_group"].values()
        )
        if budget_ok and (best is None or outcome["mean_cost"] < best - 1e-12):
            best = outcome["mean_cost"]
    return best


@pytest.mark.parametrize("seed", range(6))
def test_calibration_is_the_cheapest_monotone_assignment(seed):
    rng = random.Random(seed)
    n = 7
    risks = [round(rng.random(), 1) for _ in range(n)]  # ties included
    changed = {f: [rng.random() < p for _ in range(n)] for f, p in ((0.0, 0.6), (0.3, 0.3))}
    costs = {0.0: 0.1, 0.3: 0.4, FALLBACK: 1.1}
    groups = [rng.choice("ab") for _ in range(n)]
    ladder = calibrate_ladder(risks, changed, costs, probe=PROBE, strategy="tail", groups=groups, max_changed=0.34)
    outcome = ladder.calibration["outcome"]
    assert outcome["mean_cost"] == pytest.approx(_brute_force(risks, changed, costs, groups, 0.34))
    # the thresholds serve exactly the assignment the calibration scored
    assert ladder_outcome(ladder.plan(risks), changed, costs, groups)["mean_cost"] == pytest.approx(
        outcome["mean_cost"]
    )


def test_the_budget_holds_in_every_group():
    risks = [0.1 * i for i in range(20)]
    groups = ["a"] * 10 + ["b"] * 10
    changed = {0.0: [g == "b" for g in groups]}  # serving group b unrepaired changes every answer
    costs = {0.0: 0.1, FALLBACK: 1.1}
    ladder = calibrate_ladder(risks, changed, costs, probe=PROBE, strategy="tail", groups=groups, max_changed=0.1)
    per_group = ladder.calibration["outcome"]["per_group"]
    assert per_group["b"]["changed_served"] <= 0.1 and per_group["a"]["changed_served"] == 0.0
    assert ladder.rungs == [LadderRung(max_risk=1.0, fraction=0.0)]  # a's items, then one of b's: 1 of 10


def _binomial_tail(changed, items, p):
    """P(X <= changed), X ~ Binomial(items, p), in exact rational arithmetic."""
    p = Fraction(p)
    return sum(math.comb(items, k) * p**k * (1 - p) ** (items - k) for k in range(changed + 1))


@pytest.mark.parametrize("changed,items,confidence", [(0, 24, 0.95), (0, 59, 0.95), (1, 93, 0.95), (3, 10, 0.9)])
def test_the_upper_bound_leaves_exactly_the_confidence_above_it(changed, items, confidence):
    bound = changed_upper_bound(changed, items, confidence)
    assert float(_binomial_tail(changed, items, bound)) == pytest.approx(1 - confidence, abs=1e-9)
    assert float(_binomial_tail(changed, items, bound * 0.999)) > 1 - confidence  # the highest such rate
    if changed == 0:  # the closed form: 1 - (1 - confidence) ** (1 / items)
        assert bound == pytest.approx(1 - (1 - confidence) ** (1 / items), abs=1e-12)


def test_the_confident_budget_is_the_most_changed_answers_the_bound_allows():
    assert [changed_budget(n, 0.05) for n in (19, 20, 100)] == [0, 1, 5]  # without confidence: floor(0.05 n)
    for n in (24, 58, 59, 93, 124, 200):
        budget = changed_budget(n, 0.05, 0.95)
        assert budget == -1 or changed_upper_bound(budget, n, 0.95) <= 0.05
        assert budget == n or changed_upper_bound(budget + 1, n, 0.95) > 0.05
    assert [changed_budget(n, 0.05, 0.95) for n in (58, 59, 93, 124)] == [-1, 0, 1, 2]
    assert items_to_vouch(0.05, 0.95) == 59 and items_to_vouch(0.05, 0.9) == 45


def test_a_task_too_small_to_vouch_for_the_budget_is_served_only_the_fallback():
    # task a: 60 items, nothing ever changes; task b: 10 items, nothing changes either, but 10 cannot vouch for 5 %
    risks = [i / 100 for i in range(60)] + [0.3 + i / 100 for i in range(10)]
    groups = ["a"] * 60 + ["b"] * 10
    changed = {0.0: [False] * 70}
    costs = {0.0: 0.1, FALLBACK: 1.1}
    point = calibrate_ladder(risks, changed, costs, probe=PROBE, strategy="tail", groups=groups)
    assert point.rungs == [LadderRung(max_risk=0.59, fraction=0.0)]  # on the items alone everything is served
    sure = calibrate_ladder(risks, changed, costs, probe=PROBE, strategy="tail", groups=groups, confidence=0.95)
    assert sure.calibration["budget_per_group"] == {"a": 0, "b": -1} and sure.calibration["confidence"] == 0.95
    # a's items below b's lowest risk (0.3) are served; b's, and a's at or above 0.3, fall back
    assert sure.rungs == [LadderRung(max_risk=0.29, fraction=0.0)]
    plan = sure.plan(risks)
    assert [f is None for f in plan] == [r >= 0.3 for r in risks]
    with pytest.raises(ValueError, match="confidence=1.0 must be in"):
        calibrate_ladder(risks, changed, costs, probe=PROBE, strategy="tail", groups=groups, confidence=1.0)


@pytest.mark.parametrize(
    "settings,error,fragment",
    [
        (
            {"probe": PROBE, "strategy": "tail", "rungs": [{"max_risk": 1.0, "fraction": 1.0}]},
            ValueError,
            "in \\[0, 1\\)",
        ),
        (
            {"probe": PROBE, "strategy": "tail", "rungs": [{"max_risk": float("nan"), "fraction": 0.1}]},
            ValueError,
            "finite",
        ),
        (
            {
                "probe": PROBE,
                "strategy": "tail",
                "rungs": [{"max_risk": 1.0, "fraction": 0.2}, {"max_risk": 2.0, "fraction": 0.1}],
            },
            ValueError,
            "rise in both",
        ),
        ({"probe": {"name": "nope"}, "strategy": "tail", "rungs": []}, ValueError, "Unknown probe"),
        ({"probe": PROBE, "strategy": "nope", "rungs": []}, ValueError, "Unknown repair strategy"),
        ({"probe": PROBE, "strategy": "tail", "rungs": [], "extra": 1}, ValueError, "Unknown ladder settings"),
        ({"probe": PROBE, "rungs": []}, ValueError, "lack \\['strategy'\\]"),
        ("tail", TypeError, "GuardLadder or a dict"),
        ({"probe": [PROBE], "strategy": "tail", "rungs": []}, TypeError, "A probe is a name, a settings dict"),
        (
            {"probe": {**PROBE, "window": 3}, "strategy": "tail", "rungs": []},
            TypeError,
            "Probe 'draft_agreement' does not take these options .*'window'.*its options are \\['tokens'\\]",
        ),
        ({"probe": PROBE, "strategy": "tail", "rungs": [[0.5, 0.2]]}, TypeError, "Write \\[0.5, 0.2\\] as"),
        ({"probe": PROBE, "strategy": "tail", "rungs": {"max_risk": 1.0}}, TypeError, "rungs are a list of rungs"),
        ({"probe": PROBE, "strategy": "tail", "rungs": [{"max_risk": 1.0}]}, ValueError, "missing \\['fraction'\\]"),
    ],
)
def test_bad_ladders_are_refused_by_name(settings, error, fragment):
    with pytest.raises(error, match=fragment):
        GuardLadder.from_dict(settings)


def test_bad_calibration_inputs_are_refused():
    risks, changed, costs, _ = _planted(6)
    with pytest.raises(ValueError, match="NaN or infinite"):
        calibrate_ladder([float("nan")] * 6, changed, costs, probe=PROBE, strategy="tail")
    with pytest.raises(ValueError, match="'fallback' entry"):
        calibrate_ladder(risks, changed, {0.0: 0.1, 0.2: 0.2, 0.5: 0.5}, probe=PROBE, strategy="tail")
    with pytest.raises(ValueError, match="No cost for fraction 0.2"):
        calibrate_ladder(risks, changed, {0.0: 0.1, 0.5: 0.5, FALLBACK: 1.0}, probe=PROBE, strategy="tail")
    with pytest.raises(ValueError, match="max_changed"):
        calibrate_ladder(risks, changed, costs, probe=PROBE, strategy="tail", max_changed=1.5)


# ---------------------------------------------------------------------------------------------------- serving


def _model(config, seed):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    return model


@pytest.fixture(scope="module")
def pair(tiny):
    config = tiny.config(layers=3)
    return _model(config, 1), _model(config, 0), MapperModel.identity(config)


def _batch(tiny, lengths=(20, 26, 23)):
    return tiny.left_padded_batch(lengths, seed=5)


def _context(pair, ids, mask, hold_back=1):
    source, target, mapper = pair
    return prepare_context(source, target, mapper, ids, mask, None, hold_back)


def _diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _row(cache, row, start=0):
    return [t[row, :, start:] for layer in cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("hold_back", [1, 4])
def test_each_row_gets_its_rung(pair, tiny, hold_back):
    source, target, mapper = pair
    ids, mask = _batch(tiny)
    mapped = _context(pair, ids, mask, hold_back).cache
    context = _context(pair, ids, mask, hold_back)
    rows = serve_rows(context, [0.0, 0.5, None], "tail")
    assert [row["rung"] for row in rows] == ["mapped", "repair:0.5", "fallback"]
    width = ids.shape[1]
    pad = [width - int(n) for n in mask.sum(-1)]
    # row 0: the mapped cache, untouched (the held-back tokens re-run on the same cache)
    assert _diff(_row(context.cache, 0, pad[0]), _row(mapped, 0, pad[0])) <= TOL
    # row 2: the target's own prefill of its tokens
    positions = positions_from_attention_mask(mask, *ids.shape, ids.device)
    own = output_cache(
        target(input_ids=ids[2:, :-1], attention_mask=mask[2:, :-1], position_ids=positions[2:, :-1], use_cache=True)
    )
    assert _diff(_row(context.cache, 2, pad[2]), _row(own, 0, pad[2])) <= TOL
    # row 1: what repairing it alone gives
    alone = _context(pair, ids[1:2], mask[1:2], hold_back)
    serve_rows(alone, [0.5], "tail")
    assert _diff(_row(context.cache, 1, pad[1]), _row(alone.cache, 0, pad[1])) <= TOL
    assert rows[1]["recomputed"] == int(0.5 * (int(mask[1].sum()) - hold_back))
    assert context.cache.get_seq_length() == width - 1
    assert context.cache.mapping_info["ladder"]["rows"] == rows


def test_a_drafting_repair_continues_the_probes_draft(pair, tiny):
    """Rows repaired by `draft_attention` after a draft probe continue the probe's source draft: the same cache as
    drafting afresh, with the probe's steps not decoded again."""
    source = pair[0]
    ids, mask = _batch(tiny)
    strategy = {"name": "draft_attention", "draft_tokens": 4, "stop_at_eos": False}
    plan = [0.3, 0.0, 0.3]
    shared = _context(pair, ids, mask)
    probe_from_dict({"name": "confident_draft", "tokens": 2}).score(shared)
    alone = _context(pair, ids, mask)
    calls = []
    handle = source.register_forward_hook(lambda *args: calls.append(1))
    try:
        serve_rows(shared, plan, strategy)
        continued = len(calls)
        serve_rows(alone, plan, strategy)
    finally:
        handle.remove()
    assert (continued, len(calls) - continued) == (2, 4)  # the source decodes the two steps the probe did not
    for mine, theirs in zip(shared.cache.layers, alone.cache.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_serve_rows_refuses_a_plan_of_another_batch(pair, tiny):
    ids, mask = _batch(tiny)
    with pytest.raises(ValueError, match="2 rung fractions for a batch of 3"):
        serve_rows(_context(pair, ids, mask), [0.0, None], "tail")


def _ladder_for(scores, fractions):
    """Rungs whose bounds fall between the given rows' risks, so that row i takes fractions[i]."""
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    rungs = [LadderRung(max_risk=scores[i] + 1e-6, fraction=fractions[i]) for i in order if fractions[i] is not None]
    return GuardLadder({"name": "prefix_audit", "tokens": 8}, "tail", rungs)


def test_handoff_climbs_the_ladder_per_row(pair, tiny):
    source, target, mapper = pair
    ids, mask = _batch(tiny)
    _, report = handoff(
        source,
        target,
        mapper,
        ids,
        attention_mask=mask,
        probe={"name": "prefix_audit", "tokens": 8},
        threshold=1e9,
        audit_tokens=0,
    )
    scores = report.scores
    assert len(set(scores)) == 3
    order = sorted(range(3), key=lambda i: scores[i])
    wanted = [None] * 3
    wanted[order[0]], wanted[order[1]] = 0.0, 0.3  # the least risky row mapped, the next repaired, the last prefilled
    ladder = _ladder_for(scores, wanted)
    cache, report = handoff(source, target, mapper, ids, attention_mask=mask, ladder=ladder, audit_tokens=0)
    assert report.accepted and isinstance(cache, MappedCache)
    assert [row["fraction"] for row in report.ladder["rows"]] == wanted
    assert "repair" in report.timings
    context = _context(pair, ids, mask)
    serve_rows(context, wanted, "tail")
    for row in range(3):
        assert _diff(_row(cache, row), _row(context.cache, row)) <= TOL
    # a ladder with no rung falls back for the whole batch: the target's own generation, token for token
    cache, report = handoff(
        source, target, mapper, ids, attention_mask=mask, ladder=_ladder_for(scores, [None] * 3), audit_tokens=0
    )
    assert not report.accepted and report.reason.startswith("ladder: every row")
    assert torch.equal(tiny.greedy(target, ids, mask, cache=cache), tiny.greedy(target, ids, mask))
    # policy="fail" refuses a batch in which some row would fall back
    with pytest.raises(Exception, match="would fall back"):
        handoff(source, target, mapper, ids, attention_mask=mask, ladder=ladder, audit_tokens=0, policy="fail")


def test_the_stored_ladder_is_the_default_and_is_hashed(pair, tiny, tmp_path):
    source, target, mapper = pair
    ids, mask = _batch(tiny)
    mapper = MapperModel.identity(target.config)
    ladder = GuardLadder({"name": "prefix_audit", "tokens": 8}, "tail", [LadderRung(1e9, 0.2)])
    before = serving_hash(mapper.config)
    mapper.config.handoff_ladder = ladder.to_dict()
    assert serving_hash(mapper.config) != before
    _, report = handoff(source, target, mapper, ids, attention_mask=mask, audit_tokens=0)
    assert [row["rung"] for row in report.ladder["rows"]] == ["repair:0.2"] * 3
    _, report = handoff(
        source,
        target,
        mapper,
        ids,
        attention_mask=mask,
        audit_tokens=0,
        ladder=False,
        probe="prefix_audit",
        threshold=1e9,
    )
    assert report.ladder is None and report.reason.startswith("probe passed")
    with pytest.raises(ValueError, match="holds its own probe"):
        handoff(source, target, mapper, ids, attention_mask=mask, ladder=ladder, threshold=1.0)
    mapper.save_pretrained(tmp_path / "m")
    card = (tmp_path / "m" / "README.md").read_text()
    assert "## Guard ladder" in card and "| repair | 1e+09 | 20% |" in card
    assert MapperModel.from_pretrained(tmp_path / "m").config.handoff_ladder == ladder.to_dict()
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["handoff_ladder"]["rungs"][0]["fraction"] = 0.0  # an edited ladder no longer matches the serving hash
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="serving"):
        MapperModel.from_pretrained(tmp_path / "m")


# ----------------------------------------------------------------------------------------- measured on items


def test_a_repair_that_continues_the_probes_draft_is_charged_only_its_own_steps(ladder_family):
    """The records time the repair's draft step by step; a probe that drafted the source's first steps spares the
    repair those steps in the ladder's costs, and a probe that drafts nothing spares none."""
    source, target, mapper, tokenizer, items = ladder_family
    strategy = {"name": "draft_attention", "draft_tokens": 3, "stop_at_eos": False}
    records = measure_ladder_items(
        source,
        target,
        mapper,
        tokenizer,
        items[:2],
        probes=["draft_agreement:2", "lookahead_margin:1"],
        strategies=[strategy],
        fractions=[0.2],
        progress=False,
    )
    key = strategy_key(strategy)
    for record in records:
        seconds = record["seconds"]
        assert seconds["probe_source_steps"] == {"draft_agreement:2": 2, "lookahead_margin:1": 0}
        assert len(seconds["repair_draft_steps"][key]["0.2"]) == 3 and seconds["repair_draft_steps"][key]["0"] == []
    record = {
        "answers": {"s": {"0": {}, "0.5": {}}},
        "seconds": {
            "prefill": 2.0,
            "map": 0.2,
            "probe": {"drafts": 0.4, "reads": 0.4},
            "repair": {"s": {"0": 0.0, "0.5": 1.0}},
            "probe_source_steps": {"drafts": 2, "reads": 0},
            "repair_draft_steps": {"s": {"0": [], "0.5": [0.1, 0.2, 0.3]}},
        },
    }
    assert record_costs([record], "drafts", "s")[0.5] == pytest.approx(0.3 + (1.0 - 0.3) / 2)
    assert record_costs([record], "reads", "s")[0.5] == pytest.approx(0.3 + 1.0 / 2)
    del record["seconds"]["probe_source_steps"], record["seconds"]["repair_draft_steps"]  # a record of before
    assert record_costs([record], "drafts", "s")[0.5] == pytest.approx(0.3 + 1.0 / 2)


def test_a_perfect_probe_serves_each_request_its_cheapest_rung_that_keeps_the_answer():
    """`perfect_probe_outcome`: kept on the mapped cache -> mapped, changed there but kept by half a repair -> the
    repair, changed by both -> the fallback; costed as a ladder's rungs (mapping and probe on every rung), with the
    drafted steps a drafting probe spares the repair taken off when it pays that probe's cost."""

    def record(task, mapped, half):
        return {
            "task": task,
            "answers": {"s": {"0": {"changed": mapped}, "0.5": {"changed": half}}},
            "seconds": {
                "prefill": 1.0,
                "map": 0.1,
                "probe": {"drafts": 0.2},
                "repair": {"s": {"0": 0.0, "0.5": 0.4}},
                "probe_source_steps": {"drafts": 1},
                "repair_draft_steps": {"s": {"0": [], "0.5": [0.05, 0.05]}},
            },
        }

    records = [record("a", False, True), record("a", True, False), record("b", True, True), record("b", False, False)]
    costs = {0.0: 0.1, 0.5: 0.5, "fallback": 1.1}
    assert [cheapest_keeping(r, "s", costs) for r in records] == [0.0, 0.5, None, 0.0]
    dear = {0.0: 0.1, 0.5: 1.2, "fallback": 1.1}  # a repair dearer than the prefill is never the cheapest safe rung
    assert [cheapest_keeping(r, "s", dear) for r in records] == [0.0, None, None, 0.0]
    free = perfect_probe_outcome(records, "s")
    assert free["rungs"] == {"mapped": 0.5, "repair:0.5": 0.25, "fallback": 0.25}
    assert free["changed_served"] == 0.0 and free["per_group"]["a"]["changed_served"] == 0.0
    # every rung pays the mapping (0.1); half a repair 0.4 more; the fallback the prefill
    assert free["mean_cost"] == pytest.approx((0.1 + 0.5 + 1.1 + 0.1) / 4)
    paid = perfect_probe_outcome(records, "s", cost_of="drafts")  # 0.2 on every rung, one repair step spared
    assert paid["mean_cost"] == pytest.approx((0.3 + (0.7 - 0.05) + 1.3 + 0.3) / 4)
    assert records[0]["seconds"]["probe"] == {"drafts": 0.2}  # the records are not touched


def _measured(family, strategies, fractions):
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


def test_replaying_records_is_what_the_handoff_serves(ladder_family):
    source, target, mapper, tokenizer, items = ladder_family
    records = _measured(ladder_family, ["tail", "source_attention"], [0.2, 0.5])
    assert [r["task"] for r in records] == [i.task for i in items]
    for record in records:  # the mapped cache is measured once and shared by both strategies
        assert set(record["answers"]) == {"tail", "source_attention:last_tokens=16"}
        assert record["answers"]["tail"]["0"] == record["answers"]["source_attention:last_tokens=16"]["0"]
    ladder = ladder_from_records(records, max_changed=0.0)
    candidates = ladder.calibration["candidates"]
    assert set(candidates) == {"draft_agreement:2 tail", "draft_agreement:2 source_attention:last_tokens=16"}
    assert ladder.calibration["outcome"]["mean_cost"] == min(c["mean_cost"] for c in candidates.values())
    assert ladder.calibration["outcome"]["changed_served"] == 0.0
    assert replay_ladder(ladder, records) == ladder.calibration["outcome"]
    only_tail = ladder_from_records(records, strategy="tail", max_changed=0.0)
    assert only_tail.strategy == {"name": "tail"} and list(only_tail.calibration["candidates"]) == [
        "draft_agreement:2 tail"
    ]
    with pytest.raises(ValueError, match="strategies"):
        ladder_from_records(records, strategy="early_deviation")
    with pytest.raises(ValueError, match="other prompts"):
        measure_ladder_items(
            source,
            target,
            mapper,
            tokenizer,
            items[::-1],
            probes=["draft_agreement:2"],
            strategies=["tail", "source_attention"],
            fractions=[0.2, 0.5],
            done=records[:1],
            progress=False,
        )
    with pytest.raises(ValueError, match="other strategies or fractions"):
        measure_ladder_items(
            source,
            target,
            mapper,
            tokenizer,
            items,
            probes=["draft_agreement:2"],
            strategies=["tail"],
            fractions=[0.3],
            done=records[:1],
            progress=False,
        )
    for item, record in zip(items, records):
        ids = torch.tensor([tokenizer(item.prompt)["input_ids"]])
        cache, report = handoff(source, target, mapper, ids, ladder=ladder, audit_tokens=0)
        fraction = ladder.fraction_for(record["risks"]["draft_agreement:2"])
        assert report.scores == [pytest.approx(record["risks"]["draft_agreement:2"])]
        steps = len(record["reference"])
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            **cache_kwargs(cache),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
        )[0, ids.shape[1] :].tolist()
        if fraction is None:
            assert not report.accepted and out == record["reference"]
        else:
            assert report.ladder["rows"][0]["fraction"] == fraction
            key = strategy_key(ladder.strategy)
            assert (out != record["reference"]) == record["answers"][key][f"{fraction:g}"]["changed"]


def test_records_hold_the_sources_own_answer_and_old_records_get_the_same(ladder_family):
    source, target, mapper, tokenizer, items = ladder_family
    records = _measured(ladder_family, ["tail"], [0.5])
    assert has_source_answers(records)
    for item, record in zip(items, records):
        # what not switching serves: the source's own greedy answer from the prompt alone, no cache handed in
        ids = torch.tensor([tokenizer(item.prompt)["input_ids"]])
        expected = tokenizer(item.answer + item.stop, add_special_tokens=False)["input_ids"]
        own = source.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=len(expected),
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
        )[0, ids.shape[1] :].tolist()
        assert record["source_answer"] == own and record["correct_source"] == (own == expected)
    # the pair differs on these items, or the source's answer would tell nothing the target's does not
    assert any(r["source_answer"] != r["reference"] for r in records)
    old = [{k: v for k, v in r.items() if k not in ("source_answer", "correct_source")} for r in records]
    assert not has_source_answers(old) and not has_source_answers([])
    measured = [measure_source_answer(source, tokenizer, i, r) for i, r in zip(items, old)]
    assert with_source_answers(old, measured) == records
    assert with_source_answers(old, measured[1:])[0] == old[0]  # a record not measured is left as it was
    with pytest.raises(ValueError, match="another prompt"):
        measure_source_answer(source, tokenizer, items[1], old[0])


def test_a_strategy_measured_after_the_records_is_the_one_measured_with_them(ladder_family):
    source, target, mapper, tokenizer, items = ladder_family
    both = _measured(ladder_family, ["tail", "source_attention"], [0.2, 0.5])
    old = _measured(ladder_family, ["tail"], [0.2, 0.5])
    measured = [
        measure_strategies(source, target, mapper, tokenizer, i, r, ["source_attention"]) for i, r in zip(items, old)
    ]
    added = with_strategies(old, measured)
    key = "source_attention:last_tokens=16"
    for mine, theirs in zip(added, both):
        assert mine["strategies"] == theirs["strategies"]
        # against the target's answer the record holds: every rung's outcome as if measured with the records
        assert mine["answers"] == theirs["answers"]
        assert set(mine["seconds"]["repair"][key]) == set(mine["seconds"]["check_steps"][key]) == {"0", "0.2", "0.5"}
        assert mine["seconds"]["repair"][key]["0"] == mine["seconds"]["repair"]["tail"]["0"]  # the shared mapped rung
    # each measurement timed the record's first strategy at its smallest fraction beside the new rungs
    for found, record, mine in zip(measured, old, added):
        yardstick = found["yardstick"]
        assert (yardstick["strategy"], yardstick["fraction"]) == ("tail", "0.2") and yardstick["seconds"] > 0
        scale = record["seconds"]["repair"]["tail"]["0.2"] / yardstick["seconds"]
        assert mine["clock"] == {key: scale}
        assert mine["seconds"]["repair"][key]["0.5"] == found["seconds"]["repair"][key]["0.5"] * scale
    assert ladder_from_records(added, max_changed=0.0).calibration["candidates"].keys() == (
        ladder_from_records(both, max_changed=0.0).calibration["candidates"].keys()
    )
    assert with_strategies(old, measured[1:])[0] == old[0]  # a record not measured is left as it was
    # a side pass stopped part-way: the strategy is no candidate until every record holds it
    partial = with_strategies(old, measured[:1])
    assert held_strategies(partial) == ["tail"] and held_strategies(added) == sorted(["tail", key])
    assert ladder_from_records(partial, max_changed=0.0).calibration["candidates"].keys() == (
        ladder_from_records(old, max_changed=0.0).calibration["candidates"].keys()
    )
    with pytest.raises(ValueError, match="measured with"):
        measure_strategies(source, target, mapper, tokenizer, items[0], old[0], ["tail"])
    # the records name their mapper; a rung measured for them later is served on the same mapped cache or refused
    assert {r["mapper"] for r in old} == {m["mapper"] for m in measured} == {mapper_key(mapper)}
    assert added[0]["mapper_beside"] == {key: mapper_key(mapper)}
    # and the machine that measured them (a study recomputed from records says where its seconds come from)
    here = machine_info()
    assert {json.dumps(r["machine"]) for r in old} == {json.dumps(here)} and added[0]["machine_beside"] == {key: here}
    legacy = [{k: v for k, v in r.items() if k != "machine"} for r in old]
    assert machines(added) == {here["cpu"]: len(old)}
    assert machines(legacy[:1] + with_strategies(legacy[1:], measured[1:])) == {
        here["cpu"]: len(old) - 1,
        "not recorded": len(old),
    }
    other = {**old[0], "mapper": "sha256:" + "0" * 64}
    with pytest.raises(ValueError, match="measured with mapper sha256:0+, this one is"):
        measure_strategies(source, target, mapper, tokenizer, items[0], other, ["source_attention"])
    with pytest.raises(ValueError, match="Pass the mapper the records were measured with"):
        measure_margins(source, target, mapper, tokenizer, items[0], other)
    with pytest.raises(ValueError, match="another prompt"):
        measure_strategies(source, target, mapper, tokenizer, items[1], old[0], ["source_attention"])


def test_strategies_measured_apart_are_put_on_the_records_clock_by_their_yardstick():
    record = {
        "prompt_sha256": "a",
        "strategies": {"tail": {"name": "tail"}},
        "answers": {"tail": {"0": {"changed": False}, "0.1": {"changed": False}}},
        "seconds": {"repair": {"tail": {"0": 0.0, "0.1": 2.0}}, "check_steps": {"tail": {"0": [1.0], "0.1": [1.0]}}},
    }
    new = {"0.1": {"changed": True}}
    found = {
        "prompt_sha256": "a",
        "strategies": {"other": {"name": "other"}},
        "answers": {"other": new},
        "seconds": {"repair": {"other": {"0.1": 1.5}}, "check_steps": {"other": {"0.1": [0.25, 0.5]}}},
    }
    # the yardstick (tail at 0.1) took 0.5 s beside the new rung and 2.0 s in the record: this pass ran 4x faster
    (timed,) = with_strategies(
        [record], [{**found, "yardstick": {"strategy": "tail", "fraction": "0.1", "seconds": 0.5}}]
    )
    assert timed["clock"] == {"other": 4.0}
    assert timed["seconds"]["repair"]["other"] == {"0": 0.0, "0.1": 6.0}
    assert timed["seconds"]["check_steps"]["other"] == {"0": [1.0], "0.1": [1.0, 2.0]}
    assert timed["answers"]["other"] == {"0": {"changed": False}, **new}
    # a measurement of before yardsticks keeps its seconds as timed, and says no factor
    (untimed,) = with_strategies([record], [found])
    assert "clock" not in untimed and untimed["seconds"]["repair"]["other"] == {"0": 0.0, "0.1": 1.5}
    assert record["seconds"]["repair"] == {"tail": {"0": 0.0, "0.1": 2.0}}  # the record itself is left as it was


def test_the_cli_measures_a_strategy_its_records_lack_beside_them(tmp_path, capsys):
    from hf_kvmap.calibration.ladder_side import read_side, side_path, with_side_measurements

    def calibrate(strategies, records, out):
        args = ["calibrate-ladder", "--source", "tiny-m", "--target", "tiny-l", "--items", "3"]
        args += ["--probes", "draft_agreement:2", "--fractions", "0.3", "--strategies", strategies]
        assert (
            cli([*args, "--records", str(records), "--out", str(tmp_path / out), "--json", str(tmp_path / "s")]) == 0
        )
        return json.loads((tmp_path / "s").read_text())["ladder"]["calibration"]["candidates"]

    records = tmp_path / "records.jsonl"
    calibrate("tail", records, "one")
    measured = records.read_text()
    items = len(measured.splitlines())
    capsys.readouterr()
    candidates = calibrate("tail,source_attention", records, "two")
    assert f"measuring source_attention:last_tokens=16 beside the {items} records" in capsys.readouterr().out
    assert records.read_text() == measured  # the records file is only read
    assert len(read_side(records, "strategies")) == items
    # as if measured with both from the start: the answers bit for bit, the same candidates
    both = tmp_path / "both.jsonl"
    assert candidates.keys() == calibrate("tail,source_attention", both, "three").keys()
    merged = with_side_measurements(records, None, [], [json.loads(line) for line in measured.splitlines()])
    fresh = [json.loads(line) for line in both.read_text().splitlines()]
    assert [r["answers"] for r in merged] == [r["answers"] for r in fresh]
    # run again: everything is held, nothing is measured
    calibrate("tail,source_attention", records, "four")
    assert "measuring" not in capsys.readouterr().out and len(read_side(records, "strategies")) == items
    assert side_path(records, "strategies").name == "records.strategies.jsonl"
    # records of another mapper are refused before anything is measured with this one
    lines = [json.loads(line) for line in measured.splitlines()]
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text("".join(json.dumps({**r, "mapper": "sha256:" + "1" * 64}) + "\n" for r in lines))
    with pytest.raises(SystemExit, match="measured with mapper sha256:1+, this one is"):
        calibrate("tail", foreign, "six")
    assert not side_path(foreign, "strategies").exists()
    # records holding a strategy not asked for are refused, not measured beside
    with pytest.raises(SystemExit, match="other strategies or fractions"):
        calibrate("source_attention", records, "five")


def test_the_cli_calibrates_a_ladder_into_config_and_card(tmp_path, capsys):
    out = tmp_path / "m2l"
    records = tmp_path / "records.jsonl"
    args = [
        "calibrate-ladder",
        "--source",
        "tiny-m",
        "--target",
        "tiny-l",
        "--items",
        "3",
        "--probes",
        "draft_agreement:2",
        "--fractions",
        "0.3",
        "--records",
        str(records),
        "--out",
        str(out),
        "--json",
        str(tmp_path / "s.json"),
    ]
    assert cli(args) == 0
    stored = MapperModel.from_pretrained(out).config.handoff_ladder
    summary = json.loads((tmp_path / "s.json").read_text())
    assert stored == summary["ladder"] and stored["calibration"]["items"] == len(records.read_text().splitlines())
    assert "## Guard ladder" in (out / "README.md").read_text()
    printed = capsys.readouterr().out
    assert "holds on these items only" in printed and "--confidence 0.95" in printed
    # 3 items a task allow no changed answer, so the ladder serves none either: a perfect probe costs no more than it
    headroom = summary["headroom"]
    assert headroom["perfect_probe_free"] <= headroom["perfect_probe_at_this_probes_cost"] <= headroom["ladder"] + 1e-9
    assert f"would cost {headroom['perfect_probe_at_this_probes_cost']:.3f} of a prefill" in printed
    assert ("serving without a handoff is cheaper" in printed) == (stored["calibration"]["outcome"]["mean_cost"] >= 1)
    assert cli(args) == 0  # resumed: nothing measured again
    assert "resuming: " in capsys.readouterr().out
    assert cli([*args, "--confidence", "0.9"]) == 0  # 3 items a task cannot vouch for 5 %: every item falls back
    sure = MapperModel.from_pretrained(out).config.handoff_ladder
    assert sure["rungs"] == [] and sure["calibration"]["confidence"] == 0.9
    assert "at least 45 items of a task" in capsys.readouterr().out
    assert "as a one-sided 0.90 upper confidence bound" in (out / "README.md").read_text()
    with pytest.raises(SystemExit, match="--confidence 1.5 must be in"):
        cli([*args, "--confidence", "1.5"])
    with pytest.raises(SystemExit, match="--max-changed 2.0"):
        cli([*args, "--max-changed", "2"])
    wrong = [*args[:2], "tiny-s", *args[3:], "--mapper", str(zoo.mapper_path("tiny-m", "tiny-l"))]
    with pytest.raises(SystemExit, match="calibrate-ladder: The mapper does not match"):
        cli(wrong)
    with pytest.raises(SystemExit, match="Unknown probe"):
        cli([*args[:8], "nope:2", *args[9:]])
