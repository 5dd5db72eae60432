"""The guard ladder's `min_tokens`: a prompt (or a session's unseen span) shorter than it is not mapped but prefilled
by the target, in `handoff`, in `HandoffSession`, in the replay of measured records and on the card."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_kvmap import HandoffSession, MapperModel, handoff
from hf_kvmap.calibration.ladder import SHORT, ladder_outcome
from hf_kvmap.calibration.ladder_items import replay_ladder, with_min_tokens
from hf_kvmap.serving import HandoffRefusedError
from hf_kvmap.serving.ladder import FALLBACK, GuardLadder, LadderRung
from hf_kvmap.serving.pipeline import target_prefill

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
PROBE = {"name": "prefix_audit", "tokens": 8}
LOOKAHEAD = {"name": "lookahead_margin", "tokens": 2}


def _ladder(min_tokens=None, **kwargs):
    return GuardLadder(PROBE, "tail", [LadderRung(max_risk=1e9, fraction=0.3)], min_tokens=min_tokens, **kwargs)


def test_min_tokens_is_kept_by_the_settings_and_checked():
    ladder = _ladder(64)
    assert ladder.to_dict()["min_tokens"] == 64 and GuardLadder.from_dict(ladder.to_dict()) == ladder
    assert "min_tokens" not in _ladder().to_dict()  # ladders that map every length keep their settings (and hashes)
    assert [ladder.too_short(n) for n in (63, 64, 65)] == [True, False, False]
    assert not _ladder().too_short(1)
    assert ladder.plan([0.1, 0.1, 2e9], [63, 64, 64]) == [None, 0.3, None] and ladder.plan([0.1]) == [0.3]
    with pytest.raises(ValueError):  # one length per row
        ladder.plan([0.1, 0.1], [64])
    for bad in (0, 1, -5, 2.5, True, "64"):
        with pytest.raises(ValueError, match="min_tokens"):
            _ladder(bad)


def test_a_batch_below_min_tokens_is_not_mapped_but_prefilled(ladder_pair, tiny):
    source, target, mapper = ladder_pair
    ids, mask = tiny.left_padded_batch((20, 26, 23), seed=5)
    cache, report = handoff(source, target, mapper, ids, attention_mask=mask, ladder=_ladder(27), audit_tokens=0)
    assert not report.accepted and "min_tokens=27 (longest 26 tokens)" in report.reason
    assert {"source_prefill", "map", "probe", "repair"}.isdisjoint(report.timings)
    assert "fallback_prefill" in report.timings and report.mapped_tokens == 0
    assert report.ladder["min_tokens"] == 27
    assert report.ladder["rows"] == [{"rung": FALLBACK, "fraction": None, "short": True}] * 3
    own = target_prefill(target, ids, mask)
    for mine, theirs in zip(cache.layers, own.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    with pytest.raises(HandoffRefusedError, match="min_tokens"):
        handoff(source, target, mapper, ids, attention_mask=mask, ladder=_ladder(27), policy="fail", audit_tokens=0)


def test_rows_below_min_tokens_get_the_targets_prefill_and_the_others_their_rung(ladder_pair, tiny):
    source, target, mapper = ladder_pair
    ids, mask = tiny.left_padded_batch((20, 26, 23), seed=5)
    plain, reference = handoff(source, target, mapper, ids, attention_mask=mask, ladder=_ladder(), audit_tokens=0)
    cache, report = handoff(source, target, mapper, ids, attention_mask=mask, ladder=_ladder(24), audit_tokens=0)
    rows = report.ladder["rows"]
    assert report.accepted and [row["rung"] for row in rows] == [FALLBACK, "repair:0.3", FALLBACK]
    assert [row.get("short", False) for row in rows] == [True, False, True]
    assert rows[1] == reference.ladder["rows"][1] and [row["recomputed"] for row in rows[::2]] == [19, 22]
    own = target_prefill(target, ids, mask)
    for mine, theirs, served in zip(cache.layers, own.layers, plain.layers):
        for row in (0, 2):
            pad = ids.shape[1] - int(mask[row].sum())
            assert (mine.keys[row, :, pad:] - theirs.keys[row, :, pad:]).abs().max() <= TOL
            assert (mine.values[row, :, pad:] - theirs.values[row, :, pad:]).abs().max() <= TOL
        assert torch.equal(mine.keys[1], served.keys[1]) and torch.equal(mine.values[1], served.values[1])
    assert torch.equal(tiny.greedy(target, ids[:1], mask[:1]), tiny.greedy(target, ids, mask, cache=cache)[:1])


def _session(tiny, min_tokens):
    """small answers a first turn (its cache: 17 tokens), a user turn follows, and large takes over."""
    config = tiny.config()
    small, large = tiny.model(config, seed=0), tiny.model(config, seed=1)
    ladder = GuardLadder(LOOKAHEAD, "tail", [LadderRung(2.0, 0.0)], min_tokens=min_tokens)
    session = HandoffSession(
        {"small": small, "large": large}, {("small", "large"): MapperModel.identity(config)}, ladder=ladder
    )
    session.append(torch.randint(3, 128, (14,), generator=torch.Generator().manual_seed(0)))
    session.respond("small", 4, pad_token_id=0)
    session.append([5, 6, 7])
    return session, large


def test_a_session_prefills_a_span_below_min_tokens_and_maps_one_at_it(tiny, one_thread):
    session, large = _session(tiny, 18)
    before = session.input_ids.clone()
    turn = session.respond("large", 4, pad_token_id=0)
    own = large.generate(before, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert turn.short and turn.rung == FALLBACK and turn.risk is None and turn.mapped_from is None
    assert turn.mapped_tokens == 0 and turn.prefilled_tokens == before.shape[1] - 1 and "map" not in turn.timings
    assert turn.tokens == own[0, before.shape[1] :].tolist()
    assert getattr(session.caches["large"], "approximate", False) is False
    session, _ = _session(tiny, 17)  # the 17 tokens small processed are not fewer than 17: mapped
    turn = session.respond("large", 4, pad_token_id=0)
    assert not turn.short and turn.rung == "mapped" and turn.mapped_tokens == 17
    assert session.caches["large"].approximate is True


def test_the_outcome_prices_short_items_as_a_bare_prefill_that_changes_nothing():
    fractions = [0.0, 0.2, None, 0.2]
    changed = {0.0: [True, True, False, False], 0.2: [False, True, True, False]}
    costs = {0.0: 0.1, 0.2: 0.4, FALLBACK: 1.2}
    plain = ladder_outcome(fractions, changed, costs)
    assert plain["mean_cost"] == pytest.approx((0.1 + 0.4 + 1.2 + 0.4) / 4) and plain["changed_served"] == 0.5
    gated = ladder_outcome(fractions, changed, costs, short=[True, False, True, False])
    assert gated["mean_cost"] == pytest.approx((1.0 + 0.4 + 1.0 + 0.4) / 4)
    assert gated["changed_served"] == 0.25 and gated["rungs"] == {SHORT: 0.5, "repair:0.2": 0.5}
    with pytest.raises(ValueError, match="short flags"):
        ladder_outcome(fractions, changed, costs, short=[True])


def _record(task, tokens, risk, changed):
    seconds = {
        "prefill": 2.0,
        "map": 0.2,
        "probe": {"prefix_audit:8": 0.2},
        "repair": {"tail": {"0": 0.0, "0.3": 0.4}},
    }
    return {
        "task": task,
        "tokens": tokens,
        "risks": {"prefix_audit:8": risk},
        "answers": {"tail": {"0": {"changed": changed[0]}, "0.3": {"changed": changed[1]}}},
        "seconds": seconds,
    }


def test_a_replayed_ladder_prefills_the_records_below_min_tokens():
    records = [
        _record("a", 100, 0.1, (True, False)),
        _record("a", 300, 0.1, (True, False)),
        _record("b", 120, 5.0, (True, True)),
        _record("b", 500, 5.0, (False, False)),
    ]
    ladder = GuardLadder(PROBE, "tail", [LadderRung(0.5, 0.0), LadderRung(10.0, 0.3)])
    plain = replay_ladder(ladder, records)
    assert plain["changed_served"] == 0.75 and plain["mean_cost"] == pytest.approx((0.2 + 0.2 + 0.4 + 0.4) / 4)
    gated = with_min_tokens(ladder, 200, records)
    outcome = gated.calibration["outcome"]
    assert gated.min_tokens == 200 and outcome == replay_ladder(gated, records)
    assert outcome["changed_served"] == 0.25 and outcome["rungs"] == {SHORT: 0.5, "mapped": 0.25, "repair:0.3": 0.25}
    assert outcome["mean_cost"] == pytest.approx((1.0 + 0.2 + 1.0 + 0.4) / 4)
    assert outcome["per_group"]["b"]["changed_served"] == 0.0
    assert ladder.min_tokens is None  # the calibrated ladder is left as it was


def test_the_card_says_which_prompts_the_ladder_does_not_map(ladder_pair):
    from hf_kvmap.card import render_card

    mapper = copy.deepcopy(ladder_pair[2])
    mapper.config.handoff_ladder = _ladder(512).to_dict()
    assert "A prompt of fewer than 512 tokens is not mapped" in str(render_card(mapper))
    mapper.config.handoff_ladder = _ladder().to_dict()
    assert "is not mapped" not in str(render_card(mapper))


def test_the_cli_stores_min_tokens_with_the_calibrated_ladder(ladder_cli, capsys):
    from hf_kvmap.cli import main as cli

    args, out, records = ladder_cli
    assert cli(args) == 0
    plain = MapperModel.from_pretrained(out).config.handoff_ladder
    capsys.readouterr()
    assert cli([*args, "--min-tokens", "100000"]) == 0  # every item is shorter: all prefilled unmapped
    gated = MapperModel.from_pretrained(out).config.handoff_ladder
    assert "min_tokens" not in plain and gated["min_tokens"] == 100000
    assert gated["rungs"] == plain["rungs"]  # the rungs are calibrated on every item as before
    assert gated["calibration"]["outcome"]["rungs"] == {SHORT: 1.0}
    assert gated["calibration"]["outcome"]["mean_cost"] == 1.0
    assert "a prompt of fewer than 100000 tokens: the target's own prefill, unmapped (100% of the items)" in (
        capsys.readouterr().out
    )
    assert "A prompt of fewer than 100000 tokens is not mapped" in (out / "README.md").read_text()
    with pytest.raises(SystemExit, match="--min-tokens 1 maps every prompt"):
        cli([*args, "--min-tokens", "1"])
