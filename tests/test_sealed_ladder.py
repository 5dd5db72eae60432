"""The guard ladder of a sealed protocol, calibrated on long_switch records measured apart and replayed on the report
items (`benchmarks.sealed.ladder`): planted items whose cheapest safe ladder is known."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.sealed import ladder as sealed_ladder
from benchmarks.sealed.protocol import load_protocol

ROOT = Path(__file__).resolve().parents[1]
CONV4K = ROOT / "benchmarks" / "protocols" / "whole-context-conv4k.json"
RUNGS = ["query_overlap:fill=draft_branches@0.1", "draft_branches@0.1"]
TASKS = ["ruler_vt", "ruler_fwe", "chat_split"]


def _arm(right: bool, margin: float, prepare: float, load: float = 1.0, **extra) -> dict:
    """One arm's record as long_switch writes it: its first token 0.1 s after its cache is prepared."""
    text = "the answer" if right else "another"
    return {"tokens": [1, 2], "text": text, "prepare_s": prepare, "ttft_s": prepare + 0.1, "score": float(right),
            "margins": [margin, 0.99], "load": load, **extra}  # fmt: skip


def _row(task: str, seed: int, index: int, sha: str | None, *, wavers=False, sure_wrong=False, busy=False) -> dict:
    """An item where the mapped cache and the query_overlap rung answer wrong, draft_branches' repair and its sparse
    peer right (the repair 3 s, the sparse prefill 1 s): `wavers` makes the sparse peer wrong and unsure (margin 0.2),
    `sure_wrong` wrong and sure (0.95); `busy`: measured at a load of 9 with the sparse prefill's seconds stretched
    to 20."""
    sparse_right = not (wavers or sure_wrong)
    load = 9.0 if busy else 1.0
    sparse = _arm(
        sparse_right, 0.2 if wavers else 0.95 if sure_wrong else 0.9, 20.0 if busy else 1.0, load, selected=1
    )
    arms = {
        "target": _arm(True, 0.99, 9.9, load),
        "mapped": _arm(False, 0.1, 0.5, load),
        RUNGS[0]: _arm(False, 0.3, 1.5, load),
        RUNGS[1]: _arm(True, 0.9, 3.0, load),
        "sparse:" + RUNGS[0]: _arm(False, 0.3, 0.9, load, selected=409),
        "sparse:" + RUNGS[1]: sparse,
        "source": _arm(False, 0.5, 0.0, load),
    }
    setup = {"mapper": "sha256:planted", "dtype": "bfloat16", "direction": "0.5b:1.5b"}
    if sha is not None:
        setup["protocol"] = sha
    key = f"0.5b:1.5b/{task}/4096/{seed}/{index}"
    return {"key": key, "setup": setup, "task": task, "tokens": 4095, "length": 4096, "arms": arms}


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture
def protocol(tmp_path):
    settings = json.loads(CONV4K.read_text())
    settings["interval"]["resamples"] = 200
    settings["ladder"]["calibration"]["items"] = 34  # 102 in all
    path = tmp_path / "protocol.json"
    path.write_text(json.dumps(settings))
    return load_protocol(path)


def test_the_ladder_checks_its_cheapest_rung_and_sends_back_what_wavers(tmp_path, protocol):
    """4 of 34 calibration items a task waver on the sparse rung: the budget (5 %: 1 of 34) allows none of them served,
    every item has the same risk, so the cheapest ladder serves the sparse prefill of draft_branches' selection with
    a check that sends those back (the smallest margin of the grid above 0.2). On the report items it sends back the
    ones that waver and serves the ones that are wrong and sure; costs are the planted seconds over the re-prefill's
    first token (10 s)."""
    calibration = [_row(t, 4322, i, None, wavers=i < 4) for t in TASKS for i in range(34)]
    report = [
        _row(t, 20261208, i, protocol.sha256, wavers=t == "ruler_vt" and i < 4) for t in TASKS for i in range(64)
    ]
    report[64 + 5] = _row("ruler_fwe", 20261208, 5, protocol.sha256, sure_wrong=True)
    results = sealed_ladder.assemble(
        protocol, [_write(tmp_path / "cal.jsonl", calibration)], [_write(tmp_path / "rep.jsonl", report)]
    )
    ladder = results["ladder"]
    assert ladder["strategy"]["name"] == "draft_branches"
    assert ladder["rungs"] == [{"max_risk": pytest.approx(0.9), "fraction": 0.1, "sparse": True}]
    assert ladder["min_margin"] == 0.25
    vt, fwe, chat = (results["served"][t] for t in TASKS)
    assert vt["rungs"] == {"sparse:0.1": 1.0} and vt["checked_fallback"] == pytest.approx(4 / 64)
    assert vt["changed_served"] == 0 and vt["right_kept"] == [64, 64] and vt["score_served"] == 1.0
    # every item, of the re-prefill's 10 s to its first token: mapping 0.5 + the probe's step 0.1 + the sparse prefill
    # 1.0 + its first token 0.1 + the check's forward 0.1 = 1.8 s; sent back: + the re-prefill
    assert vt["mean_cost"] == pytest.approx(0.18 + 4 / 64) and chat["mean_cost"] == pytest.approx(0.18)
    assert chat["mean_cost_interval"] == [pytest.approx(0.18), pytest.approx(0.18)]
    assert fwe["changed_served"] == 1 and fwe["right_kept"] == [63, 64]
    assert fwe["changed_upper"] == pytest.approx(0.0716, abs=1e-3)  # one of 64: above 5 % at 95 %
    assert vt["changed_upper"] == pytest.approx(0.0457, abs=1e-3)  # none of 64: below
    assert vt["verdict"] == {"cost": "met", "changed": "met"}
    assert fwe["verdict"] == {"cost": "met", "changed": "missed"}
    assert results["served"]["all"]["items"] == 192
    text = sealed_ladder.markdown(results)
    assert "sparse 0.1" in text and "first-token margin >= 0.25" in text and "cost met, changed missed" in text


def test_a_part_measured_ladder_gives_no_verdict(tmp_path, protocol):
    calibration = [_row(t, 4322, i, None) for t in TASKS for i in range(34)]
    report = [_row(t, 20261208, i, protocol.sha256) for t in TASKS for i in range(10)]
    results = sealed_ladder.assemble(
        protocol, [_write(tmp_path / "cal.jsonl", calibration)], [_write(tmp_path / "rep.jsonl", report)]
    )
    assert results["ladder"]["rungs"] == [{"max_risk": pytest.approx(0.9), "fraction": 0.1, "sparse": True}]
    assert "min_margin" not in results["ladder"]  # nothing wavers: a check would only add its token's cost
    assert "pending" in results["served"]["ruler_vt"]["verdict"] and results["report_items"]["ruler_vt"] == 10
    assert results["served"]["ruler_vt"]["mean_cost"] == pytest.approx(0.17)  # no check: 1.7 s of 10


def test_the_calibration_reads_costs_on_its_quiet_items_only(tmp_path, protocol):
    """Half the calibration items were measured on a busy machine, where the sparse prefill took 20 s: read there,
    it would cost more than the repair and lose; the quiet items alone keep it the cheapest rung (their answers are
    all read: a busy item that wavers still counts against the budget)."""
    calibration = [_row(t, 4322, i, None, busy=i % 2 == 1) for t in TASKS for i in range(34)]
    report = [_row(t, 20261208, i, protocol.sha256) for t in TASKS for i in range(2)]
    results = sealed_ladder.assemble(
        protocol, [_write(tmp_path / "cal.jsonl", calibration)], [_write(tmp_path / "rep.jsonl", report)]
    )
    assert results["calibration"]["timed_items"] == 51
    assert results["ladder"]["rungs"] == [{"max_risk": pytest.approx(0.9), "fraction": 0.1, "sparse": True}]
    everything = [sealed_ladder.ladder_record(row, protocol.rungs) for row in calibration]
    loud = sealed_ladder.ladder_from_records(everything, probe="lookahead_margin:1", sparse=True)
    assert loud.to_dict()["rungs"] == [{"max_risk": pytest.approx(0.9), "fraction": 0.1}]  # the repair, read loud
    busy = [_row(t, 4322, i, None, busy=True) for t in TASKS for i in range(34)]
    with pytest.raises(SystemExit, match="No calibration item was measured at a load of at most 3"):
        sealed_ladder.assemble(
            protocol, [_write(tmp_path / "busy.jsonl", busy)], [_write(tmp_path / "r2.jsonl", report)]
        )


def test_two_rungs_of_one_strategy_are_refused():
    row = _row("ruler_vt", 4322, 0, None)
    row["arms"]["draft_branches@0.2"] = row["arms"]["sparse:draft_branches@0.2"] = row["arms"][RUNGS[1]]
    with pytest.raises(ValueError, match="repeat a strategy"):
        sealed_ladder.ladder_record(row, [RUNGS[1], "draft_branches@0.2"])


def test_calibration_items_must_be_the_ladders_own_and_carry_margins(tmp_path, protocol):
    report = [_row("ruler_vt", 20261208, 0, protocol.sha256)]
    rep = _write(tmp_path / "rep.jsonl", report)
    other_seed = _write(tmp_path / "a.jsonl", [_row("ruler_vt", 20261208, 0, None)])
    with pytest.raises(SystemExit, match="not an item of the ladder's calibration cell"):
        sealed_ladder.assemble(protocol, [other_seed], [rep])
    bare = _row("ruler_vt", 4322, 0, None)
    del bare["arms"]["mapped"]["margins"]
    with pytest.raises(ValueError, match=r"no record \(or no margins\) of \['mapped'\]"):
        sealed_ladder.assemble(protocol, [_write(tmp_path / "b.jsonl", [bare])], [rep])
    refit = _row("ruler_vt", 4322, 0, None)
    refit["setup"]["mapper"] = "sha256:another"
    with pytest.raises(SystemExit, match="2 fits of the map"):
        sealed_ladder.assemble(protocol, [_write(tmp_path / "c.jsonl", [refit])], [rep])
