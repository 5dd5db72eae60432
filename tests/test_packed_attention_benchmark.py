"""`benchmarks.speed.packed_attention`'s summary: means per length under each implementation, their ratio, and the
rung's first token against the re-prefill's, from planted items."""

from __future__ import annotations

import pytest

from benchmarks.speed import packed_attention

RUNG = "query_overlap:fill=draft_branches@0.1"
ARMS = ("target", "mapped", RUNG, "sparse:" + RUNG)


def _item(length: int, sdpa: dict, packed: dict, alike: bool = True) -> dict:
    def side(seconds: dict, tokens: list) -> dict:
        return {arm: {"ttft_s": seconds[arm], "prepare_s": 0.0, "tokens": tokens} for arm in ARMS}

    return {
        "length": length,
        "sdpa": side(sdpa, [1, 2]),
        "packed": side(packed, [1, 2] if alike else [1, 3]),
        "same_answers": dict.fromkeys(ARMS, alike),
    }


def test_the_summary_reads_each_arm_under_both_implementations():
    sdpa = {"target": 20.0, "mapped": 1.0, RUNG: 5.0, "sparse:" + RUNG: 4.0}
    packed = {"target": 19.0, "mapped": 0.5, RUNG: 2.5, "sparse:" + RUNG: 2.0}
    items = [_item(2048, sdpa, packed), _item(2048, sdpa, packed, alike=False)]
    (row,) = packed_attention.summarize(items, RUNG)
    assert row["length"] == 2048 and row["items"] == 2
    assert row["arms"][RUNG] == {"sdpa_s": 5.0, "packed_s": 2.5, "saved": 0.5, "same_answers": 1}
    assert row["arms"]["target"]["saved"] == pytest.approx(0.05)
    assert row["sdpa_speedup"][RUNG] == 4.0 and row["packed_speedup"][RUNG] == pytest.approx(7.6)
    result = {"rung": RUNG, "environment": {"cpu": "a cpu"}, "dtype": "bfloat16", "threads": 2, "tasks": "ruler_vt",
              "rows": [row]}  # fmt: skip
    line = packed_attention.markdown(result).splitlines()[-1]
    assert line == (
        "| 2048 | 2 | 20.00 s / 19.00 s | 5.00 s / 2.50 s | 4.00 s / 2.00 s | 4.00x / 7.60x | 5.00x / 9.50x | 4 of 8 |"
    )
