"""Multi-turn sessions of the shipped tiny family, against a recording.

Several conversations (two models mapping both ways with a windowed mapper, a fixed repair that reads the source,
three models with the donor chosen by coverage, a ladder spreading its switches over its rungs, a ladder's check
after the rung, a ladder's `min_tokens`, a refresh while decoding) are served turn by turn, and what every turn
decided and answered is compared with `tests/data/session_recorded.json`: the generated token ids, the model mapped
from, the mapped, window, prefilled and repaired token counts, the rung, whether the check sent it back or it was too
short, what a refresh recomputed, and after every turn each model's covered tokens, mapped spans, the mappers they
came from, whether its cache is approximate and which positions it recomputed, all exactly; probe risks and check
margins within `RISK_TOLERANCE` (float bytes differ between CPU kernels; `MARGIN` keeps every decision off a knife
edge). A change to how sessions are served that changes none of these passes; one that changes any fails here.

Re-record (only when a change of serving is meant): `python tests/test_session_recorded.py`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from test_serving_recorded import MARGIN, _compare, _risk

from hf_kvmap import HandoffSession, MapperModel, zoo
from hf_kvmap.repair.repair import recomputed_mask
from hf_kvmap.serving.ladder import GuardLadder, LadderRung
from hf_kvmap.zoo import corpus

RECORDING = Path(__file__).parent / "data" / "session_recorded.json"
NEW_TOKENS = 6
LOOKAHEAD = {"name": "lookahead_margin", "tokens": 2}


def _family():
    torch.set_num_threads(1)
    models = {name[-1]: zoo.load_model(name) for name in ("tiny-s", "tiny-m", "tiny-l")}
    mappers = {
        (source[-1], target[-1]): MapperModel.from_pretrained(zoo.mapper_path(source, target))
        for source, target in (("tiny-s", "tiny-l"), ("tiny-l", "tiny-s"), ("tiny-m", "tiny-l"))
    }
    tokenizer = zoo.load_tokenizer()
    conversation = corpus.make_conversation(6, seed=7)
    users = [
        tokenizer(corpus.format_chat([conversation[2 * i]], add_generation_prompt=True), add_special_tokens=i == 0)[
            "input_ids"
        ]
        for i in range(6)
    ]
    return models, mappers, users


#: name -> (models, mapper directions, session settings, the turns: a model answering, `+k` appending user turn k)
SCENARIOS = {
    "two-way": ("sl", ["sl", "ls"], {}, ["+0", "s", "+1", "l", "+2", "s", "l", "+3", "s", "+4", "l"]),
    "two-way-repair": (
        "sl",
        ["sl", "ls"],
        {"repair": {"strategy": {"name": "source_attention", "last_tokens": 8}, "fraction": 0.3}},
        ["+0", "s", "+1", "l", "+2", "s", "l", "+3", "s"],
    ),
    "three": ("sml", ["sl", "ls", "ml"], {}, ["+0", "m", "+1", "s", "+2", "l", "+3", "s", "m", "+4", "l"]),
    "ladder": (
        "sl",
        ["sl", "ls"],
        {"ladder": ([(0.15, 0.0), (0.6, 0.25)], {})},
        ["+0", "s", "+1", "l", "+2", "s", "+3", "l", "+4", "s", "+5", "l"],
    ),
    "ladder-check": (
        "sl",
        ["sl", "ls"],
        {"ladder": ([(2.0, 0.25)], {"min_margin": 0.5, "check_tokens": 2})},
        ["+0", "s", "+1", "l", "+2", "s", "+3", "l", "+4", "s"],
    ),
    "ladder-short": (
        "sl",
        ["sl", "ls"],
        {"ladder": ([(2.0, 0.0)], {"min_tokens": 11})},
        ["+0", "s", "+1", "l", "s", "+2", "l", "+3", "s"],
    ),
    "refresh": (
        "sl",
        ["sl", "ls"],
        {"refresh": {"every": 2, "tokens": 3}},
        ["+0", "s", "+1", "l", "+2", "s", "+3", "l"],
    ),
}


def _caches(session: HandoffSession) -> dict:
    out = {}
    for name, cache in session.caches.items():
        if cache is None:
            out[name] = None
            continue
        info = getattr(cache, "mapping_info", None) or {}
        length = cache.get_seq_length()
        done = recomputed_mask(cache, 1, length)[0]
        out[name] = {
            "covered": session.covered(name),
            "approximate": bool(getattr(cache, "approximate", False)),
            "mapped_positions": [list(span) for span in info.get("mapped_positions", [])],
            "mapped_from": [m["from"] for m in info.get("mappers", [])],
            "recomputed": [i for i in range(length) if done[i]],
        }
    return out


def _turn(turn) -> dict:
    refresh = None
    if turn.refresh is not None:
        refresh = {k: v for k, v in turn.refresh.items() if k not in ("seconds", "recomputed_fraction")}
    return {
        "model": turn.model,
        "tokens": turn.tokens,
        "mapped_from": turn.mapped_from,
        "mapped_tokens": turn.mapped_tokens,
        "window_tokens": turn.window_tokens,
        "prefilled_tokens": turn.prefilled_tokens,
        "repaired_tokens": turn.repaired_tokens,
        "rung": turn.rung,
        "risk": None if turn.risk is None else _risk(turn.risk),
        "margin": None if turn.margin is None else _risk(turn.margin),
        "checked": turn.checked,
        "short": turn.short,
        "refresh": refresh,
    }


def _scenario(models, mappers, users, name: str) -> dict:
    names, directions, settings, steps = SCENARIOS[name]
    settings = dict(settings)
    refresh = settings.pop("refresh", None)
    bounds = []
    if "ladder" in settings:
        rungs, options = settings["ladder"]
        settings["ladder"] = GuardLadder(LOOKAHEAD, "tail", [LadderRung(*rung) for rung in rungs], **options)
        bounds = [bound for bound, _ in rungs]
        if options.get("min_margin") is not None:
            bounds.append(options["min_margin"])
    session = HandoffSession(
        {n: models[n] for n in names}, {(d[0], d[1]): mappers[(d[0], d[1])] for d in directions}, **settings
    )
    turns = []
    for step in steps:
        if step.startswith("+"):
            session.append(users[int(step[1:])])
            continue
        turn = session.respond(step, NEW_TOKENS, pad_token_id=0, refresh=refresh)
        turns.append({**_turn(turn), "caches": _caches(session)})
    return {"bounds": bounds, "transcript": len(session.input_ids[0]), "turns": turns}


def observe() -> dict:
    models, mappers, users = _family()
    return {name: _scenario(models, mappers, users, name) for name in SCENARIOS}


def _knife_edges(recording: dict) -> list[str]:
    """Risks and margins closer than `MARGIN` to a bound they were compared with."""
    close = []
    for name, case in recording.items():
        for i, turn in enumerate(case["turns"]):
            for what in ("risk", "margin"):
                value = turn[what]
                if value is not None and any(abs(value - b) < MARGIN for b in case["bounds"] if math.isfinite(b)):
                    close.append(f"{name} turn {i}: {what} {value} near {case['bounds']}")
    return close


def test_the_session_recording_spreads_its_decisions_off_knife_edges():
    recording = json.loads(RECORDING.read_text())
    assert _knife_edges(recording) == []
    rungs = {turn["rung"] for case in recording.values() for turn in case["turns"]}
    assert {"mapped", "fallback", "repair:0.25"} <= rungs
    turns = [turn for case in recording.values() for turn in case["turns"]]
    assert any(turn["checked"] for turn in turns) and any(turn["short"] for turn in turns)
    assert any(turn["window_tokens"] for turn in turns) and any(turn["repaired_tokens"] for turn in turns)
    assert any(turn["refresh"] and turn["refresh"]["refreshes"] for turn in turns)
    ladder = [turn["rung"] for turn in recording["ladder"]["turns"] if turn["mapped_from"]]
    assert len(set(ladder)) == 3, ladder


def test_sessions_serve_as_recorded(one_thread):
    recording = json.loads(RECORDING.read_text())
    _compare(observe(), recording, "session")


if __name__ == "__main__":
    observed = observe()
    RECORDING.write_text(json.dumps(observed, indent=1, sort_keys=True) + "\n")
    print(json.dumps(_knife_edges(observed), indent=1))
