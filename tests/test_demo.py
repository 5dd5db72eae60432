"""`hf-kvmap demo`: its arguments are checked before any model loads, and its timings never include first-call costs.

The demo's full run (every way, the JSON, the plot) is `tests/test_cli.py`'s short demo."""

from __future__ import annotations

import time

import pytest

from hf_kvmap.cli import build_parser
from hf_kvmap.cli import main as cli_main
from hf_kvmap.commands import demo
from hf_kvmap.commands.demo_ways import DemoWays, timed_medians


@pytest.fixture
def no_models(monkeypatch):
    """Any model or mapper loaded fails the test: the arguments must be refused before work starts."""
    from hf_kvmap import zoo

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(zoo, "load_model", refuse)
    monkeypatch.setattr("hf_kvmap.commands.models.load_mapper", refuse)


def _refused(argv: list[str], capsys) -> str:
    """The refusal of `hf-kvmap demo argv`: an exit naming the problem (argparse's, on stderr with status 2, for a
    flag's own value; the command's, as the exit message, for what needs the other flags), never a traceback."""
    with pytest.raises(SystemExit) as info:
        cli_main(["demo", *argv])
    if info.value.code == 2:
        message = capsys.readouterr().err
        assert "hf-kvmap demo: error: argument" in message
    else:
        message = info.value.code
        assert isinstance(message, str) and message.startswith("hf-kvmap demo: ")
    assert "Traceback" not in message
    return message


def _accepted(argv: list[str]):
    """Control: the same flag with a good value passes every check."""
    return demo.check_arguments(build_parser().parse_args(["demo", *argv]))


def test_demo_refuses_a_json_or_plot_folder_before_any_work(tmp_path, no_models, capsys):
    message = _refused(["--json", str(tmp_path)], capsys)
    assert f"--json: {tmp_path} is a folder" in message
    assert f"--plot: {tmp_path} is a folder" in _refused(["--plot", str(tmp_path)], capsys)
    _accepted(["--json", str(tmp_path / "demo.json"), "--plot", str(tmp_path / "demo.png")])


@pytest.mark.parametrize("lengths", ["abc", "64,x", "1", "64,-3"])
def test_demo_refuses_lengths_that_are_not_token_counts(lengths, no_models, capsys):
    assert f"--lengths {lengths!r}" in _refused(["--lengths", lengths], capsys)


def test_demo_takes_token_counts_or_no_latency_table(no_models):
    assert _accepted(["--lengths", "64, 256"])[0] == [64, 256]
    assert _accepted(["--lengths", ""])[0] == []


@pytest.mark.parametrize("lengths", ["abc", "256,x", "16", "2048"])
def test_demo_refuses_long_lengths_outside_the_family_positions(lengths, no_models, capsys):
    message = _refused(["--long-lengths", lengths], capsys)
    assert f"--long-lengths {lengths!r}" in message and "from 32 to 1024" in message


@pytest.mark.parametrize("reach", ["abc", "8", "-3"])
def test_demo_refuses_a_reach_that_is_not_a_token_count(reach, no_models, capsys):
    message = _refused(["--reach", reach], capsys)
    assert f"--reach {reach!r}" in message and "'first'" in message


def test_demo_refuses_a_reach_the_long_lengths_cannot_hold(no_models, capsys):
    message = _refused(["--long-lengths", "96,256", "--reach", "128"], capsys)
    assert "--reach 128 does not fit in --long-lengths 96" in message and "smaller --reach" in message


def test_demo_takes_long_lengths_and_a_reach_or_the_fact_first(no_models):
    args = build_parser().parse_args(["demo", "--long-lengths", "64, 512", "--reach", "first"])
    demo.check_arguments(args)
    assert args.long_lengths == [64, 512] and args.reach is None
    args = build_parser().parse_args(["demo"])
    demo.check_arguments(args)
    assert args.long_lengths == [256, 384, 512] and args.reach == 96
    args = build_parser().parse_args(["demo", "--long-lengths", ""])
    demo.check_arguments(args)
    assert args.long_lengths == []


@pytest.mark.parametrize("flag", ["--repeats", "--items", "--threads", "--long-items"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_demo_refuses_counts_below_one(flag, value, no_models, capsys):
    assert f"{flag}: {value} must be a positive integer" in _refused([flag, value], capsys)
    _accepted([flag, "1"])


def test_demo_without_a_mapper_names_the_shipped_pairs(no_models, capsys):
    message = _refused(["--source", "tiny-l", "--target", "tiny-l"], capsys)
    assert "no shipped mapper from tiny-l to tiny-l" in message
    for pair in ("tiny-s -> tiny-l", "tiny-m -> tiny-l", "tiny-x -> tiny-l", "tiny-l -> tiny-s"):
        assert pair in message
    assert "--mapper" in message
    assert _accepted(["--source", "tiny-m", "--target", "tiny-l"])[2].endswith("tiny-m-to-tiny-l")


@pytest.mark.parametrize("repair", ["nothing:0.2", "draft_attention:abc", "draft_attention:1.5", "draft_attention"])
def test_demo_refuses_a_bad_repair(repair, no_models, capsys):
    assert f"--repair {repair!r}" in _refused(["--repair", repair], capsys)


def test_demo_repair_control():
    repair = _accepted(["--repair", "tail:0.1"])[1]
    assert repair.to_dict()["strategy"] == {"name": "tail"} and repair.fraction == 0.1


class _FirstCallSlow:
    """A call whose first run costs `first` seconds (a first call's costs) and every later one nothing."""

    def __init__(self, first: float = 0.2):
        self.first, self.calls = first, 0

    def __call__(self):
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.first)


def test_timed_medians_never_time_a_first_call():
    calls = {"a": _FirstCallSlow(), "b": _FirstCallSlow()}
    medians = timed_medians(calls, repeats=1)
    assert all(ms < 100 for ms in medians.values()), medians
    assert [call.calls for call in calls.values()] == [2, 2]
    with pytest.raises(ValueError, match="repeats=0"):
        timed_medians(calls, repeats=0)


def test_latency_rows_are_warmed_up_at_every_length_before_any_is_timed(monkeypatch):
    """A shape's first run (allocations, kernel choice) can cost more than a longer prompt's prefill; every length
    runs once, untimed, before any timing, and again before its own timed runs."""
    plans = {}

    def calls(self, ids, source_cache, body):
        keys = ("mapper_ms", "prefill_ms", "ttft_target_ms", "ttft_mapped_ms", "ttft_repaired_ms")
        plans[ids.shape[1]] = {key: _FirstCallSlow() for key in keys}
        return plans[ids.shape[1]]

    monkeypatch.setattr(DemoWays, "_calls", calls)
    monkeypatch.setattr(DemoWays, "source_cache", lambda self, ids: None)
    target = type("Target", (), {"config": type("Config", (), {"vocab_size": 50})(), "get_decoder": lambda self: None})
    rows = DemoWays(None, target(), None, None, None).latency([64, 256], repeats=1)
    assert [row["tokens"] for row in rows] == [64, 256]
    for row in rows:
        assert all(row[key] < 100 for key in plans[row["tokens"]]), row
    assert all(call.calls == 3 for plan in plans.values() for call in plan.values())


LADDER = {
    "probe": {"name": "lookahead_margin", "tokens": 1},
    "strategy": {"name": "tail"},
    "rungs": [{"max_risk": 0.03, "fraction": 0.0}, {"max_risk": 0.13, "fraction": 0.2}],
}


@pytest.mark.parametrize(
    "content, message",
    [
        ("{oops", "Expecting"),
        ("[1, 2]", "got list"),
        ('{"probe": {"name": "no-such-probe"}, "strategy": "tail", "rungs": []}', "no-such-probe"),
        ('{"probe": {"name": "lookahead_margin"}, "strategy": "tail"}', "lack ['rungs']"),
    ],
)
def test_demo_refuses_a_bad_ladder_file_before_any_work(tmp_path, no_models, capsys, content, message):
    path = tmp_path / "ladder.json"
    path.write_text(content)
    refusal = _refused(["--ladder", str(path)], capsys)
    assert f"--ladder {path}: " in refusal and message in refusal and "GuardLadder" in refusal
    assert "no such file" in _refused(["--ladder", str(tmp_path / "none.json")], capsys)


def test_demo_serves_the_guarded_way_with_a_given_ladder(tmp_path, capsys):
    """Control and use: a ladder file is read into a `GuardLadder`, and the guarded way climbs it per request."""
    import json

    from hf_kvmap import GuardLadder

    path, out = tmp_path / "ladder.json", tmp_path / "demo.json"
    path.write_text(json.dumps(LADDER))
    args = build_parser().parse_args(["demo", "--ladder", str(path)])
    demo.check_arguments(args)
    assert isinstance(args.ladder, GuardLadder) and args.ladder.to_dict()["rungs"] == LADDER["rungs"]
    argv = ["demo", "--items", "4", "--lengths", "", "--long-lengths", "", "--ladder", str(path), "--json", str(out)]
    assert cli_main(argv) == 0
    results = json.loads(out.read_text())
    assert results["run"]["guard"]["ladder"]["rungs"] == LADDER["rungs"]
    for ways in results["serving"].values():
        assert set(ways["guarded"]["rungs"]) <= {"mapped", "repair:0.2", "fallback"}
        assert ways["guarded"]["n_items"] == 4
