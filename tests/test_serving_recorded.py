"""Serving decisions and answers on a fixed item set of the shipped tiny family, against a recording.

Every way a request is served (the guarded handoff with its probe, with a fixed repair, with a ladder of rungs per
row, a multi-turn session, and the ladder's item measurement) runs on the same prompts, and what it decided and
answered is compared with `tests/data/serving_recorded.json`: decisions (accepted or not, the rung of every row, the
positions the target recomputed, token counts) and generated token ids exactly, probe risks within `RISK_TOLERANCE`
(float bytes differ between CPU kernels). A change to how requests are served that changes none of these passes; one
that changes any of them fails here.

Re-record (only when a change of serving is meant): `python tests/test_serving_recorded.py`.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from hf_kvmap import (
    GuardLadder,
    HandoffSession,
    LadderItem,
    LadderRung,
    MappedCache,
    MapperModel,
    handoff,
    measure_ladder_items,
    zoo,
)
from hf_kvmap._compat import cache_kwargs, output_cache

RECORDING = Path(__file__).parent / "data" / "serving_recorded.json"
#: absolute tolerance of a recorded risk (risks are NLLs in nats, shares and probabilities)
RISK_TOLERANCE = 2e-3
#: a recorded risk must lie at least this far from every threshold it was compared with, so the decision is stable
MARGIN = 0.005
NEW_TOKENS = 6


def _family():
    torch.set_num_threads(1)
    source, target = zoo.load_model("tiny-m"), zoo.load_model("tiny-l")
    mapper = MapperModel.from_pretrained(zoo.mapper_path("tiny-m", "tiny-l"))
    tokenizer = zoo.load_tokenizer()
    items = []
    for task in zoo.tiny_family_tasks(4, seed=91):
        if task.name in ("recall", "chat"):
            for item in task.items[:3]:
                prompt = getattr(item, "prompt", "") or item.context
                items.append(LadderItem(prompt, item.answer, getattr(item, "stop", "") or task.stop, task.name))
    return source, target, mapper, tokenizer, items


def _risk(value: float) -> float:
    return round(float(value), 4)


def _greedy(target, ids, mask, cache) -> list[list[int]]:
    out = target.generate(
        ids,
        attention_mask=mask,
        **cache_kwargs(cache),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[:, ids.shape[1] :].tolist()


def _batch(tokenizer, items):
    rows = [tokenizer(item.prompt)["input_ids"] for item in items]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


def _changed_positions(served, mapped, mask) -> list[list[int]]:
    """Per row, the cached positions (real tokens) whose layer-0 keys the serving replaced."""
    keys, before = served.layers[0].keys, mapped.layers[0].keys
    width = before.shape[2]
    differs = (keys[:, :, :width].float() - before.float()).abs().amax((1, 3)) > 0
    return [[col for col in range(width) if differs[row, col] and mask[row, col]] for row in range(differs.shape[0])]


def _handoff_cases(source, target, mapper, tokenizer, items) -> dict:
    out = {}
    # the calibrated probe of the shipped mapper, one prompt at a time
    for i, item in enumerate(items):
        ids = torch.tensor([tokenizer(item.prompt)["input_ids"]])
        cache, report = handoff(source, target, mapper, ids)
        out[f"default/{i}"] = {
            "accepted": report.accepted,
            "reason": report.reason.split(":")[0],
            "risks": [_risk(s) for s in report.scores],
            "threshold": report.threshold,
            "mapped_tokens": report.mapped_tokens,
            "tokens": _greedy(target, ids, None, cache),
        }
    ids, mask = _batch(tokenizer, items)
    # a fixed repair on a left-padded batch, served whatever the probe says
    for strategy in ("tail", {"name": "source_attention", "last_tokens": 8}):
        source_cache = output_cache(source(input_ids=ids, attention_mask=mask, use_cache=True))
        cache, report = handoff(
            source,
            target,
            mapper,
            ids,
            attention_mask=mask,
            repair={"strategy": strategy, "fraction": 0.3},
            probe={"name": "draft_agreement", "tokens": 2},
            threshold=1.0,
            source_cache=source_cache,
        )
        mapped = MappedCache.from_source(source_cache, mapper, attention_mask=mask)
        name = strategy if isinstance(strategy, str) else strategy["name"]
        out[f"repair/{name}"] = {
            "accepted": report.accepted,
            "risks": [_risk(s) for s in report.scores],
            "recomputed": report.repair["recomputed"],
            "positions": _changed_positions(cache, mapped, mask),
            "tokens": _greedy(target, ids, mask, cache),
        }
    return out


def _rungs_between(risks: list[float], fractions: list[float | None]) -> list[LadderRung]:
    """Rungs whose bounds fall midway between the sorted distinct risks, so the i-th lowest risk class takes
    `fractions[i]` (`None`: above the last rung)."""
    levels = sorted(set(risks))
    rungs = []
    for k, fraction in enumerate(fractions[: len(levels)]):
        if fraction is None:
            break
        bound = (levels[k] + levels[k + 1]) / 2 if k + 1 < len(levels) else levels[k] + 1.0
        if rungs and rungs[-1].fraction == fraction:
            rungs[-1] = LadderRung(bound, fraction)
        else:
            rungs.append(LadderRung(bound, fraction))
    return rungs


def _ladder_cases(source, target, mapper, tokenizer, items, recorded=None) -> dict:
    out = {}
    ids, mask = _batch(tokenizer, items)
    for probe, strategy in (
        ({"name": "draft_agreement", "tokens": 4}, "tail"),
        ({"name": "tail_nll", "tokens": 4}, {"name": "source_attention", "last_tokens": 8}),
        ({"name": "confident_draft", "tokens": 4}, {"name": "draft_attention", "draft_tokens": 3}),
    ):
        name = f"ladder/{probe['name']}"
        if recorded is not None:
            rungs = [LadderRung(**rung) for rung in recorded[name]["rungs"]]
        else:  # record: the rungs spread the rows over mapped, repair and fallback
            _, report = handoff(
                source, target, mapper, ids, attention_mask=mask, probe=probe, threshold=1e9, audit_tokens=0
            )
            rungs = _rungs_between([_risk(s) for s in report.scores], [0.0, 0.2, 0.5, None])
        ladder = GuardLadder(probe, strategy, rungs)
        cache, report = handoff(source, target, mapper, ids, attention_mask=mask, ladder=ladder, audit_tokens=0)
        out[name] = {
            "rungs": [{"max_risk": r.max_risk, "fraction": r.fraction} for r in rungs],
            "accepted": report.accepted,
            "rows": [row["rung"] for row in report.ladder["rows"]],
            "recomputed": [row["recomputed"] for row in report.ladder["rows"]],
            "risks": [_risk(row["risk"]) for row in report.ladder["rows"]],
            "tokens": _greedy(target, ids, mask, cache),
        }
    return out


def _session_cases(source, target, mapper, tokenizer, items, recorded=None) -> dict:
    out = {}
    lookahead = {"name": "lookahead_margin", "tokens": 2}
    first, second = tokenizer(items[-1].prompt)["input_ids"], tokenizer(items[-2].prompt, add_special_tokens=False)
    for name, kwargs in (
        ("plain", {}),
        ("repair", {"repair": {"strategy": "tail", "fraction": 0.3}}),
        ("ladder", {"ladder": "rungs"}),
        ("ladder-fallback", {"ladder": GuardLadder(lookahead, "tail", [])}),
    ):
        if kwargs.get("ladder") == "rungs":
            if recorded is not None:
                rungs = [LadderRung(**rung) for rung in recorded[f"session/{name}"]["rungs"]]
            else:  # the switch's risk decides between mapped (below) and repair (above)
                risk = out["session/plain-risk"]
                rungs = [LadderRung(risk - 0.1, 0.0), LadderRung(risk + 0.1, 0.25)]
            kwargs = {"ladder": GuardLadder(lookahead, "tail", rungs)}
        session = HandoffSession({"m": source, "l": target}, {("m", "l"): mapper}, first, **kwargs)
        turns = [session.respond("m", NEW_TOKENS, pad_token_id=0)]
        session.append(second["input_ids"])
        turns.append(session.respond("l", NEW_TOKENS, pad_token_id=0))
        session.append(first[-3:])
        turns.append(session.respond("l", NEW_TOKENS, pad_token_id=0))
        turns.append(session.respond("m", NEW_TOKENS, pad_token_id=0))
        record = {
            "turns": [
                {
                    "model": t.model,
                    "tokens": t.tokens,
                    "mapped_from": t.mapped_from,
                    "mapped_tokens": t.mapped_tokens,
                    "prefilled_tokens": t.prefilled_tokens,
                    "repaired_tokens": t.repaired_tokens,
                    "rung": t.rung,
                }
                for t in turns
            ],
            "risks": [None if t.risk is None else _risk(t.risk) for t in turns],
            "approximate": {
                k: None if c is None else bool(getattr(c, "approximate", False)) for k, c in session.caches.items()
            },
        }
        if kwargs.get("ladder"):
            record["rungs"] = [{"max_risk": r.max_risk, "fraction": r.fraction} for r in kwargs["ladder"].rungs]
        out[f"session/{name}"] = record
        if name == "plain":  # what the ladder's probe reads at the switch, to place its rungs around
            scored = HandoffSession(
                {"m": source, "l": target}, {("m", "l"): mapper}, first, ladder=GuardLadder(lookahead, "tail", [])
            )
            scored.respond("m", NEW_TOKENS, pad_token_id=0)
            scored.append(second["input_ids"])
            out["session/plain-risk"] = _risk(scored.sync("l").risk)
    return out


def _measure_cases(source, target, mapper, tokenizer, items) -> dict:
    records = measure_ladder_items(
        source,
        target,
        mapper,
        tokenizer,
        items,
        probes=["draft_agreement:2", "confident_draft:2", "lookahead_margin:2"],
        strategies=["tail", {"name": "source_attention", "last_tokens": 8}],
        fractions=[0.3],
        progress=False,
    )
    return {
        f"measure/{i}": {
            "task": r["task"],
            "tokens": r["tokens"],
            "reference": r["reference"],
            "correct_target": r["correct_target"],
            "risks": {k: _risk(v) for k, v in sorted(r["risks"].items())},
            "answers": {
                s: {f: [a["changed"], a["correct"]] for f, a in sorted(by.items())}
                for s, by in sorted(r["answers"].items())
            },
        }
        for i, r in enumerate(records)
    }


def observe(recorded: dict | None = None) -> dict:
    source, target, mapper, tokenizer, items = _family()
    out = {}
    out.update(_handoff_cases(source, target, mapper, tokenizer, items))
    out.update(_ladder_cases(source, target, mapper, tokenizer, items, recorded))
    out.update(_session_cases(source, target, mapper, tokenizer, items, recorded))
    out.update(_measure_cases(source, target, mapper, tokenizer, items))
    return out


def _compare(got, want, where: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            _compare(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got} != {want}"
        for i, (a, b) in enumerate(zip(got, want)):
            _compare(a, b, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(want, bool):
        assert got == pytest.approx(want, abs=RISK_TOLERANCE), f"{where}: {got} != {want}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _margins(recording: dict) -> list[str]:
    """Risks closer than `MARGIN` to a threshold they were compared with (a decision a kernel could flip)."""
    close = []
    for name, case in recording.items():
        bounds = [r["max_risk"] for r in case.get("rungs", [])] if isinstance(case, dict) else []
        if isinstance(case, dict) and isinstance(case.get("threshold"), float):
            bounds.append(case["threshold"])
        for risk in case.get("risks", []) if isinstance(case, dict) and isinstance(case.get("risks"), list) else []:
            if risk is not None and any(abs(risk - b) < MARGIN for b in bounds if math.isfinite(b)):
                close.append(f"{name}: risk {risk} near {bounds}")
    return close


def test_the_recording_holds_no_decision_on_a_knife_edge():
    recording = json.loads(RECORDING.read_text())
    assert _margins(recording) == []
    rungs = {row for name, case in recording.items() if name.startswith("ladder/") for row in case["rows"]}
    assert {"mapped", "fallback"} <= rungs and any(r.startswith("repair:") for r in rungs)
    assert {case["accepted"] for name, case in recording.items() if name.startswith("default/")} == {True, False}


def test_serving_decides_and_answers_as_recorded(one_thread):
    recording = json.loads(RECORDING.read_text())
    _compare(observe(recording), recording, "serving")


if __name__ == "__main__":
    observed = observe(json.loads(RECORDING.read_text()) if "--keep-rungs" in sys.argv else None)
    RECORDING.write_text(json.dumps(observed, indent=1, sort_keys=True) + "\n")
    print(json.dumps(_margins(observed), indent=1))
