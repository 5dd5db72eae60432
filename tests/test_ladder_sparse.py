"""The ladder's sparse rungs from measured records: a record's sparse rung prefills exactly the positions the repair of
its fraction recomputes, the calibration places one only where it keeps the answers within the budget and costs less
than that repair, a replay of it is what `handoff` serves, and records without sparse rungs calibrate as before."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from hf_kvmap import MapperModel, handoff, zoo
from hf_kvmap._compat import cache_kwargs, output_cache
from hf_kvmap.calibration.ladder import calibrate_ladder, ladder_outcome, sparse_key
from hf_kvmap.calibration.ladder_items import (
    has_sparse,
    ladder_from_records,
    measure_ladder_items,
    replay_ladder,
    serve_rung,
    strategy_key,
)
from hf_kvmap.cli import main as cli
from hf_kvmap.serving.ladder import FALLBACK, GuardLadder, LadderRung
from hf_kvmap.serving.pipeline import prepare_context
from hf_kvmap.serving.probes import probe_from_dict

pytestmark = pytest.mark.usefixtures("one_thread")

PROBE = {"name": "draft_agreement", "tokens": 2}
STRATEGIES = ["tail", "source_attention"]
FRACTIONS = [0.2, 0.5]


def _measure(source, target, mapper, tokenizer, items, sparse=True):
    return measure_ladder_items(
        source,
        target,
        mapper,
        tokenizer,
        items,
        probes=["draft_agreement:2"],
        strategies=STRATEGIES,
        fractions=FRACTIONS,
        progress=False,
        sparse=sparse,
    )


@pytest.fixture(scope="module")
def sparse_records(ladder_family):
    source, target, mapper, tokenizer, items = ladder_family
    return _measure(source, target, mapper, tokenizer, items)


def _without_sparse(records):
    """The records as measured before sparse rungs were: no `sparse` outcomes, no sparse seconds."""
    old = []
    for record in copy.deepcopy(records):
        record.pop("sparse")
        for name in ("sparse", "sparse_draft_steps", "sparse_check_steps"):
            record["seconds"].pop(name)
        old.append(record)
    return old


# ------------------------------------------------------------------------------------------------ calibration


def test_a_sparse_rung_is_placed_only_where_it_is_cheaper_than_the_repair_of_its_fraction():
    """Four items of rising risk: the mapped cache changes every answer, half a repair keeps all, the sparse prefill of
    the same selection keeps the two of lowest risk. Cheaper, it takes those two below the repair; dearer, never."""
    risks = [0.1, 0.2, 0.3, 0.4]
    changed = {0.0: [True] * 4, 0.5: [False] * 4, sparse_key(0.5): [False, False, True, True]}
    cheap = {0.0: 0.1, 0.5: 0.6, sparse_key(0.5): 0.4, FALLBACK: 1.1}
    ladder = calibrate_ladder(risks, changed, cheap, probe=PROBE, strategy="tail", max_changed=0.0)
    assert ladder.rungs == [LadderRung(0.2, 0.5, sparse=True), LadderRung(0.4, 0.5)]
    outcome = ladder.calibration["outcome"]
    assert outcome["rungs"] == {"repair:0.5": 0.5, "sparse:0.5": 0.5} and outcome["changed_served"] == 0.0
    assert outcome["mean_cost"] == pytest.approx((0.4 * 2 + 0.6 * 2) / 4)
    again = GuardLadder.from_dict(json.loads(json.dumps(ladder.to_dict())))
    assert again.rungs == ladder.rungs and again.sparse_plan(risks) == [True, True, False, False]
    plan = [sparse_key(f) if s else f for f, s in zip(again.plan(risks), again.sparse_plan(risks))]
    assert ladder_outcome(plan, changed, cheap) == {**outcome, "per_group": outcome["per_group"]}
    dear = {**cheap, sparse_key(0.5): 0.6}  # as dear as the repair: the repair is kept
    assert calibrate_ladder(risks, changed, dear, probe=PROBE, strategy="tail", max_changed=0.0).rungs == [
        LadderRung(0.4, 0.5)
    ]
    # a sparse rung that changes answers the budget does not allow is not placed, however cheap
    worse = {**changed, sparse_key(0.5): [True] * 4}
    assert calibrate_ladder(risks, worse, cheap, probe=PROBE, strategy="tail", max_changed=0.0).rungs == [
        LadderRung(0.4, 0.5)
    ]
    with pytest.raises(ValueError, match="Unknown measured rung 'sparse:nope'"):
        calibrate_ladder(risks, {**changed, "sparse:nope": [False] * 4}, cheap, probe=PROBE, strategy="tail")


# ----------------------------------------------------------------------------------------- measured on items


def test_a_records_sparse_rung_prefills_the_selection_its_repair_recomputes(ladder_family, sparse_records):
    source, target, mapper, tokenizer, items = ladder_family
    for record in sparse_records:
        mapped = record["tokens"] - 1  # the probe holds back the last token
        for strategy in STRATEGIES:
            key = strategy_key(strategy)
            assert set(record["sparse"][key]) == set(record["seconds"]["sparse"][key]) == {"0.2", "0.5"}
            for f, outcome in record["sparse"][key].items():
                assert outcome["selected"] == int(float(f) * mapped)  # the repair's budget, rounded down
                assert set(outcome) == {"changed", "correct", "margin", "margins", "selected"}
    assert has_sparse(sparse_records, "tail") and not has_sparse(_without_sparse(sparse_records), "tail")
    # position by position: what the sparse rung prefills is what the repair changed in the mapped cache
    ids = torch.tensor([tokenizer(items[0].prompt)["input_ids"]])
    source_cache = output_cache(source(input_ids=ids, use_cache=True))
    context = prepare_context(source, target, mapper, ids, None, source_cache, 1)
    for strategy in STRATEGIES:
        repaired, _, _ = serve_rung(context, strategy, 0.5)
        sparse, _, _ = serve_rung(context, strategy, 0.5, sparse=True)
        moved = (repaired.cache.layers[0].keys != context.cache.layers[0].keys).any(-1).any(1)[0]
        assert moved.nonzero()[:, 0].tolist() == sparse.cache.sparse_info["positions"]
        assert context.cache is not repaired.cache and context.cache is not sparse.cache  # served on copies


def test_records_without_sparse_rungs_calibrate_as_before(ladder_family, sparse_records):
    source, target, mapper, tokenizer, items = ladder_family
    old = _without_sparse(sparse_records)
    for check in (False, [0.5]):
        before = ladder_from_records(old, max_changed=0.0, check=check)
        assert (
            before.to_dict()
            == ladder_from_records(sparse_records, max_changed=0.0, check=check, sparse=False).to_dict()
        )
        assert not any(rung.sparse for rung in before.rungs)
        assert all("sparse" not in k for k in before.calibration["costs"])
        assert replay_ladder(before, old) == before.calibration["outcome"]
        # with the sparse rungs: never dearer (each is only a candidate where it is cheaper than its repair)
        spared = ladder_from_records(sparse_records, max_changed=0.0, check=check)
        assert spared.calibration["outcome"]["mean_cost"] <= before.calibration["outcome"]["mean_cost"] + 1e-12
        assert {"sparse:0.2", "sparse:0.5"} <= set(spared.calibration["costs"])
        assert replay_ladder(spared, sparse_records) == spared.calibration["outcome"]
    with pytest.raises(ValueError, match="calibrate-ladder --sparse"):
        ladder_from_records(old, sparse=True)
    sparse_ladder = GuardLadder(PROBE, "tail", [LadderRung(1.0, 0.5, sparse=True)])
    with pytest.raises(ValueError, match="sparse=True"):
        replay_ladder(sparse_ladder, old)
    with pytest.raises(ValueError, match="no sparse rungs"):
        measure_ladder_items(
            source,
            target,
            mapper,
            tokenizer,
            items,
            probes=["draft_agreement:2"],
            strategies=STRATEGIES,
            fractions=FRACTIONS,
            done=old[:1],
            progress=False,
            sparse=True,
        )


def test_with_every_rung_keeping_every_answer_the_sparse_rungs_change_nothing(ladder_family):
    """An identity mapper from the target to itself: the mapped cache keeps every answer and is the cheapest rung, so
    the ladder calibrated with the sparse rungs measured is the one calibrated without them."""
    _, _, _, tokenizer, items = ladder_family
    target = zoo.load_model("tiny-l")
    identity = MapperModel.identity(target.config)
    records = _measure(target, target, identity, tokenizer, items[::3])
    for record in records:  # every repairing rung keeps every answer
        assert not any(o["changed"] for rungs in record["answers"].values() for o in rungs.values())
    spared = ladder_from_records(records, max_changed=0.0)
    before = ladder_from_records(_without_sparse(records), max_changed=0.0)
    assert spared.rungs == before.rungs == [LadderRung(max(r["risks"]["draft_agreement:2"] for r in records), 0.0)]
    assert spared.calibration["outcome"] == before.calibration["outcome"]
    assert spared.probe == before.probe and spared.strategy == before.strategy


def test_a_planted_sparse_rung_is_chosen_and_its_replay_is_what_the_handoff_serves(ladder_family, sparse_records):
    """The items whose sparse rung keeps the target's answer, with every mapped and repaired answer planted changed
    and the sparse rung made cheaper than its repair: the ladder serves them the sparse rung, and `handoff` serves
    exactly that, with the answers the records say."""
    source, target, mapper, tokenizer, items = ladder_family
    kept = [
        (key, f)
        for key in map(strategy_key, STRATEGIES)
        for f in ("0.5", "0.2")
        if any(not r["sparse"][key][f]["changed"] for r in sparse_records)
    ]
    assert kept, "no sparse rung of the tiny family keeps an answer: plant on another item set"
    key, f = kept[0]
    chosen = [(i, r) for i, r in zip(items, sparse_records) if not r["sparse"][key][f]["changed"]]
    planted = []
    for _, record in chosen:
        record = copy.deepcopy(record)
        for outcome in record["answers"][key].values():
            outcome["changed"] = True
        for g, seconds in record["seconds"]["sparse"][key].items():
            record["seconds"]["sparse"][key][g] = min(seconds, record["seconds"]["repair"][key][g] / 2)
        planted.append(record)
    ladder = ladder_from_records(planted, strategy=key, max_changed=0.0)
    risk = max(r["risks"]["draft_agreement:2"] for r in planted)
    assert ladder.rungs == [LadderRung(risk, float(f), sparse=True)]
    assert ladder.calibration["outcome"]["rungs"] == {f"sparse:{f}": 1.0}
    assert ladder_from_records(planted, strategy=key, max_changed=0.0, sparse=False).rungs == []  # no sparse: none
    stored = GuardLadder.from_dict(json.loads(json.dumps(ladder.to_dict())))
    assert stored.to_dict() == ladder.to_dict()
    assert replay_ladder(stored, planted) == ladder.calibration["outcome"]
    for (item, record), real in zip(chosen, planted):
        ids = torch.tensor([tokenizer(item.prompt)["input_ids"]])
        cache, report = handoff(source, target, mapper, ids, ladder=stored, audit_tokens=0)
        assert report.ladder["rows"][0]["rung"] == f"sparse:{f}"
        assert report.ladder["rows"][0]["recomputed"] == real["sparse"][key][f]["selected"]
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            **cache_kwargs(cache),
            max_new_tokens=len(record["reference"]),
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
        )[0, ids.shape[1] :].tolist()
        assert out == record["reference"]  # the replay's changed answers served: none
    assert probe_from_dict(stored.probe).settings() == PROBE


def test_the_cli_measures_and_places_sparse_rungs_with_sparse(tmp_path, capsys):
    def calibrate(records, out, *extra):
        args = ["calibrate-ladder", "--source", "tiny-m", "--target", "tiny-l", "--items", "2"]
        args += ["--probes", "draft_agreement:2", "--fractions", "0.5", "--strategies", "tail", *extra]
        return cli([*args, "--records", str(records), "--out", str(tmp_path / out), "--json", str(tmp_path / "s")])

    plain = tmp_path / "plain.jsonl"
    assert calibrate(plain, "one") == 0
    assert all("sparse" not in json.loads(line) for line in plain.read_text().splitlines())
    with pytest.raises(SystemExit, match="no sparse rungs"):
        calibrate(plain, "two", "--sparse")
    spared = tmp_path / "sparse.jsonl"
    assert calibrate(spared, "three", "--sparse") == 0
    records = [json.loads(line) for line in spared.read_text().splitlines()]
    assert len(records) == len(plain.read_text().splitlines()) and has_sparse(records, "tail")
    stored = MapperModel.from_pretrained(tmp_path / "three").config.handoff_ladder
    assert stored == json.loads((tmp_path / "s").read_text())["ladder"]
    assert "sparse:0.5" in stored["calibration"]["costs"]
    ladder = GuardLadder.from_dict(stored)
    assert replay_ladder(ladder, records) == stored["calibration"]["outcome"]
    printed = capsys.readouterr().out
    assert ("alone (sparse, no map)" in printed) == any(rung.sparse for rung in ladder.rungs)


def test_the_benchmark_tables_name_a_sparse_rung_as_such():
    from benchmarks.formatting import rung_label, rung_order
    from benchmarks.repair.repair_report import _rungs

    names = ["fallback", "repair:0.5", "sparse:0.5", "mapped", "repair:0.2", "short"]
    assert sorted(names, key=rung_order) == ["mapped", "repair:0.2", "sparse:0.5", "repair:0.5", "fallback", "short"]
    assert rung_label("sparse:0.5") == "sparse prefill 50 %" and rung_label("repair:0.5") == "recompute 50 %"
    ladder = GuardLadder(
        PROBE, "tail", [LadderRung(0.1, 0.0), LadderRung(0.3, 0.5, sparse=True), LadderRung(0.5, 0.5)]
    )
    assert _rungs(ladder.to_dict()) == (
        "risk <= 0.1: recompute 0 % (mapped); risk <= 0.3: sparse prefill 50 %; risk <= 0.5: recompute 50 %; "
        "above: prefill"
    )


def test_the_perfect_probe_serves_a_sparse_rung_where_it_keeps_the_answer_and_costs_least():
    """`cheapest_keeping(..., sparse=True)`: a record whose answer a sparse rung keeps, cheaper than the repair of its
    fraction, is served that sparse rung; one whose sparse rung changed the answer gets the repair; without `sparse`
    the sparse rungs are never chosen."""
    from hf_kvmap.calibration.ladder import sparse_key
    from hf_kvmap.calibration.ladder_records import cheapest_keeping

    costs = {0.0: 0.1, 0.5: 0.6, sparse_key(0.5): 0.4, "fallback": 1.1}

    def record(mapped: bool, repair: bool, sparse: bool) -> dict:
        answers = {"0": {"changed": mapped}, "0.5": {"changed": repair}}
        return {"answers": {"s": answers}, "sparse": {"s": {"0.5": {"changed": sparse}}}}

    assert cheapest_keeping(record(True, False, False), "s", costs, sparse=True) == sparse_key(0.5)
    assert cheapest_keeping(record(True, False, True), "s", costs, sparse=True) == 0.5
    assert cheapest_keeping(record(False, False, False), "s", costs, sparse=True) == 0.0
    assert cheapest_keeping(record(True, True, True), "s", costs, sparse=True) is None
    assert cheapest_keeping(record(True, False, False), "s", costs) == 0.5
