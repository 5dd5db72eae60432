"""`hf-kvmap demo`'s long rows: the long items are what they say (length, the fact's position and reach, the question
about it, nothing else naming its key), the break-even is the interpolation stated on planted rows, and the first
screen names where the switch pays and the break-even. No timing is asserted: every time here is planted."""

from __future__ import annotations

import re

import pytest

from hf_kvmap import payoff, zoo
from hf_kvmap.commands.demo_long import first_screen
from hf_kvmap.payoff import break_even, break_even_text, pays
from hf_kvmap.zoo import corpus
from hf_kvmap.zoo.long_items import LONG_TASKS, MAX_SHORTFALL, make_long_set, token_count


@pytest.fixture(scope="module")
def tokenizer():
    return zoo.load_tokenizer()


def _pieces(item) -> list[str]:
    """The prompt's recall lines, or its user turns."""
    if item.stop == "\n":
        return item.context.split("\n")
    return [turn.split(corpus.ASSISTANT)[0] for turn in item.context.split(corpus.USER)[1:]]


@pytest.mark.parametrize("task", LONG_TASKS)
@pytest.mark.parametrize("length, reach", [(64, None), (256, None), (256, 96), (1000, 96), (512, 500), (96, 32)])
def test_long_items_have_the_length_and_the_fact_where_asked(tokenizer, task, length, reach):
    items = make_long_set(task, 12, length, seed=7, reach=reach)
    assert items == make_long_set(task, 12, length, seed=7, reach=reach)  # deterministic
    assert len({item.context for item in items}) == 12
    short = MAX_SHORTFALL[task]
    for item in items:
        ids = tokenizer(item.context)["input_ids"]
        assert len(ids) == item.tokens == token_count(item.context) and item.length == length
        assert length - short < item.tokens <= length
        # the fact's tokens stand at the position stated, and the answer is its value
        fact_ids = tokenizer(item.fact, add_special_tokens=False)["input_ids"]
        assert ids[item.fact_position : item.fact_position + len(fact_ids)] == fact_ids
        assert item.fact == item.key + item.answer and re.fullmatch(r"[a-z]{2}[0-9]{3}", item.fact)
        if reach is None:
            assert item.fact_position == (1 if task == "recall" else 2)  # after BOS (and `<|user|>`)
        else:  # from the fact's piece (its `<|user|>` for chat) to the end: at most `reach`, fewer than `short` less
            start = item.fact_position - (task == "chat")
            assert reach - short < item.tokens - start <= reach
        # the question asks for the fact last, and no other piece states or asks its key
        pieces = _pieces(item)
        assert pieces[-1] == f"?{item.key}"
        stated = [p for p in pieces if p.lstrip("?")[:2] == item.key and re.fullmatch(r"\??[a-z]{2}[0-9]*", p)]
        assert stated == [item.fact, f"?{item.key}"]
        assert item.stop == ("\n" if task == "recall" else corpus.END)


def test_long_items_differ_by_seed_reach_and_length():
    base = make_long_set("recall", 4, 256, seed=1, reach=96)
    assert base != make_long_set("recall", 4, 256, seed=2, reach=96)
    assert base != make_long_set("recall", 4, 256, seed=1, reach=128)
    assert [i.context for i in base] != [i.context for i in make_long_set("recall", 4, 255, seed=1, reach=96)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"task": "arithmetic", "length": 256}, "has no long form"),
        ({"task": "recall", "length": 16}, "at least 32"),
        ({"task": "recall", "length": True}, "at least 32"),
        ({"task": "chat", "length": 256, "reach": 256}, "length - 1 (255)"),
        ({"task": "chat", "length": 256, "reach": 8}, "from 32"),
    ],
)
def test_long_items_refuse_what_they_cannot_build(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_long_set(n=1, **kwargs)


# ---------------------------------------------------------------------------------------------- break-even


def test_break_even_interpolates_the_speedup_between_the_measured_lengths():
    # speedups 0.5, 0.75, 1.25, 2.0: sooner from 512 on; 1 lies halfway between 0.75 at 384 and 1.25 at 512
    points = [(512, 125.0, 100.0), (256, 50.0, 100.0), (384, 75.0, 100.0), (1000, 200.0, 100.0)]
    entry = break_even(points)
    assert entry["tokens"] == 448 and entry["between"] == [384, 512]
    assert entry["points"] == [[256, 0.5], [384, 0.75], [512, 1.25], [1000, 2.0]]
    assert break_even_text(entry) == "about 448 tokens (between the measured 384 and 512)"


def test_break_even_is_past_the_last_length_that_is_not_sooner():
    """Noise can make a way sooner at one short length and slower at the next: the break-even is where it becomes
    sooner at every longer length measured (here between 384 and 512), not the first crossing."""
    points = [(128, 30.0, 20.0), (256, 50.0, 100.0), (384, 90.0, 100.0), (512, 150.0, 100.0)]
    entry = break_even(points)
    assert entry["between"] == [384, 512] and entry["tokens"] == round(384 + 0.1 * 128 / 0.6)
    assert break_even(points[:1]) == {"points": [[128, 1.5]], "below": 128}


def test_break_even_below_or_above_every_length_measured():
    sooner = break_even([(256, 60.0, 20.0), (512, 120.0, 25.0)])
    assert sooner["below"] == 256 and "tokens" not in sooner
    assert break_even_text(sooner) == "below 256 tokens (sooner at every length measured)"
    slower = break_even([(256, 60.0, 80.0), (512, 120.0, 150.0), (384, 90.0, 50.0)])
    assert slower["above"] == 512  # sooner at 384 but not at the longest: no break-even within the lengths
    assert break_even_text(slower) == "above 512 tokens (not sooner at the longest measured)"
    equal = break_even([(256, 60.0, 60.0)])
    assert equal["above"] == 256  # as soon is not sooner
    with pytest.raises(ValueError, match="at least one"):
        break_even([])


# ---------------------------------------------------------------------------------------------- pays, first screen


def _way(accuracy: float, ttft: float) -> dict:
    return {"accuracy": accuracy, "ttft_ms": ttft, "rungs": {}, "n_items": 32}


def _row(tokens: int, target, mapped, repaired, guarded, does: bool = True) -> dict:
    ways = {"target": _way(*target), "mapped": _way(*mapped), "repaired": _way(*repaired), "guarded": _way(*guarded)}
    return {"tokens": tokens, "prompt_tokens": [tokens - 3, tokens], "target_does_task": does, "ways": ways}


def test_a_way_pays_only_sooner_within_the_tolerance_where_the_target_does_the_task():
    row = _row(512, (0.80, 100.0), (0.74, 20.0), (0.75, 90.0), (0.90, 100.0))
    assert [way for way in payoff.HANDOFF_WAYS if pays(row, way)] == ["repaired"]  # 0.05 below: kept
    assert not pays({**row, "target_does_task": False}, "repaired")
    assert pays(row, "mapped", tolerance=0.06)


def _results(rows: dict, latency=None) -> dict:
    long = {"reach": 96, "items": 32, "tolerance": 0.05, "tasks": rows, "break_even": payoff.break_evens(rows)}
    run = {"source": "tiny-s", "target": "tiny-l", "mapper": "zoo:tiny-s-to-tiny-l"}
    return {"run": run, "long": long, "latency_break_even": payoff.latency_break_evens(latency or [])}


def test_the_first_screen_names_where_the_switch_pays_and_the_break_even():
    rows = {
        "recall": [
            _row(256, (0.94, 60.0), (0.80, 20.0), (0.94, 80.0), (0.90, 90.0)),
            _row(512, (0.80, 120.0), (0.60, 25.0), (0.78, 100.0), (0.80, 80.0)),
        ],
        "chat": [
            _row(256, (0.50, 60.0), (0.30, 20.0), (0.50, 70.0), (0.50, 90.0)),
            _row(512, (0.03, 120.0), (0.03, 25.0), (0.03, 100.0), (0.03, 80.0), does=False),
        ],
    }
    latency = [
        {"tokens": 256, "ttft_target_ms": 80.0, "ttft_mapped_ms": 20.0, "ttft_repaired_ms": 100.0},
        {"tokens": 512, "ttft_target_ms": 160.0, "ttft_mapped_ms": 25.0, "ttft_repaired_ms": 120.0},
    ]
    screen = first_screen(_results(rows, latency))
    lines = screen.splitlines()
    assert lines[0] == "hf-kvmap demo: tiny-s -> tiny-l (mapper zoo:tiny-s-to-tiny-l): where the switch pays"
    assert "one fact stated 96 tokens before the prompt's end" in screen.replace("\n  ", " ")
    row = next(line for line in lines if line.startswith("recall") and " 512 " in line)
    assert row.split() == "recall 512 0.800 / 120.0 0.600 / 25.0 0.780 / 100.0 + 0.800 / 80.0 +".split()
    assert "chat        512" in screen and "(the target alone does not beat chance here)" in screen
    flat = " ".join(line.strip() for line in lines)
    assert (
        "The switch pays on recall at 512 tokens: repaired 0.780 in 100.0 ms (1.20x sooner), guarded 0.800 in 80.0 ms "
        "(1.50x sooner); the target alone 0.800 in 120.0 ms." in flat
    )
    # recall's repaired: speedups 0.75 at 256, 1.2 at 512 -> 256 + 0.25 * 256 / 0.45
    assert f"recall: mapped below 256 tokens (sooner at every length measured); repaired about {round(256 + 0.25 * 256 / 0.45)} tokens (between the measured 256 and 512)" in flat  # fmt: skip
    assert "random tokens (the latency rows below): mapped below 256 tokens" in flat
    assert "repaired about 352 tokens (between the measured 256 and 512)" in flat.split("random tokens")[1]
    assert payoff.BREAK_EVEN_RULE in flat
    # accuracy kept on the rows where the target alone beats chance (chat at 512 is not one), whatever the times
    assert "on the 3 rows where it beats chance: mapped on 0, repaired on 3, guarded on 3." in flat


def test_the_first_screen_says_when_the_switch_pays_nowhere():
    rows = {"recall": [_row(256, (0.94, 60.0), (0.50, 20.0), (0.94, 80.0), (0.94, 90.0))]}
    flat = " ".join(line.strip() for line in first_screen(_results(rows)).splitlines())
    assert "The switch pays on no row measured" in flat and "The switch pays on recall" not in flat
    assert "repaired above 256 tokens (not sooner at the longest measured)" in flat


def test_the_docs_block_renders_the_first_screen_from_the_results():
    """`benchmarks.sections.long_markdown` (the docs page's first demo table) says what the first screen says."""
    from benchmarks.sections import long_markdown

    rows = {
        "recall": [
            _row(256, (0.94, 60.0), (0.80, 20.0), (0.94, 80.0), (0.90, 90.0)),
            _row(512, (0.80, 120.0), (0.60, 25.0), (0.78, 100.0), (0.80, 80.0)),
        ]
    }
    block = long_markdown(_results(rows))
    assert "| recall | 512 | 0.800 / 120.0 | 0.600 / 25.0 | **0.780 / 100.0** | **0.800 / 80.0** |" in block
    assert "| recall | 256 | 0.940 / 60.0 | 0.800 / 20.0 | 0.940 / 80.0 | 0.900 / 90.0 |" in block
    assert "- The switch pays on recall at 512 tokens: repaired 0.780 in 100.0 ms (1.20x sooner)" in block
    assert "on the 2 rows where it beats chance: mapped on 0, repaired on 2, guarded on 2." in block
    assert "  - recall: mapped below 256 tokens (sooner at every length measured); repaired about 398 tokens" in block
    assert payoff.BREAK_EVEN_RULE in block
