"""The sealed protocol: committed protocol files load and say what they must; a run under one takes every choice from
it and stamps its sha256; the report refuses records made under other choices, gives every figure an interval, says
"no gap to recover" below the protocol's count of wins, and reads its verdicts on lower bounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.sealed import decisions, report
from benchmarks.sealed.protocol import SPARSE, ProtocolError, load_protocol
from benchmarks.switch import long_switch

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = sorted((ROOT / "benchmarks" / "protocols").glob("*.json"))
CHAT_DOC = ROOT / "benchmarks" / "protocols" / "switch-chat-doc.json"


def _protocol(tmp_path, **changes) -> Path:
    settings = json.loads(CHAT_DOC.read_text())
    settings.update(changes)
    path = tmp_path / "protocol.json"
    path.write_text(json.dumps(settings))
    return path


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_every_committed_protocol_loads_with_report_seeds_never_used_while_choosing(path):
    protocol = load_protocol(path)
    settings = protocol.settings
    assert len(protocol.sha256) == 64
    for cell in settings["cells"]:
        assert cell["seed"] not in settings["selection_seeds"]
        assert cell["items"] >= (32 if cell["tokens"] >= 8192 else 64)
    assert protocol.arms[0] == "target" and protocol.arms[-1] == "source"
    assert [arm for arm in protocol.arms if arm.startswith("sparse:")] == [f"sparse:{r}" for r in protocol.rungs]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"cells": [{"tasks": ["long_chat"], "tokens": 2048, "items": 64, "seed": 4321}]}, "used while choosing"),
        ({"cells": [{"tasks": ["long_chat"], "tokens": 4096, "items": 48, "seed": 7}]}, "at least 64"),
        ({"cells": [{"tasks": ["long_chat"], "tokens": 8192, "items": 31, "seed": 7}]}, "at least 32"),
        ({"chosen": {"default": "tail@0.5"}}, "not one of the rungs"),
        ({"rungs": ["tail@0.1", "tail@0.1"]}, "distinct"),
        ({"rungs": ["tail@0.1+refresh:every=4"], "chosen": {"default": "tail@0.1+refresh:every=4"}}, "name@fraction"),
        ({"extra": 1}, "unknown keys"),
    ],
)
def test_a_protocol_that_does_not_say_what_it_must_is_refused(tmp_path, changes, message):
    with pytest.raises(ProtocolError, match=message):
        load_protocol(_protocol(tmp_path, **changes))


CONV4K = ROOT / "benchmarks" / "protocols" / "whole-context-conv4k.json"


def _ladder(**changes) -> dict:
    """The conv4k protocol's ladder, calibrated on items of `CHAT_DOC`'s tasks (what the tests load it into)."""
    ladder = json.loads(CONV4K.read_text())["ladder"]
    fitting = {"tasks": ["long_chat", "long_doc"], "tokens": 4096, "items": 50, "seed": 5}
    return {**ladder, "calibration": fitting, **changes}


@pytest.mark.parametrize(
    "ladder, message",
    [
        ({"probe": "lookahead_margin:1"}, "ladder: exactly"),
        (_ladder(calibration={"tasks": ["long_chat"], "tokens": 2048, "items": 99, "seed": 5}), "100 or more"),
        (_ladder(calibration={"tasks": ["long_chat"], "tokens": 2048, "items": 100, "seed": 4321}), "selection or"),
        (_ladder(calibration={"tasks": ["long_chat"], "tokens": 2048, "items": 100, "seed": 20261207}), "report seed"),
        (_ladder(calibration={"tasks": ["long_chat"], "tokens": 512, "items": 100, "seed": 5}), "no report cell"),
        (_ladder(calibration={"tasks": ["ruler_vt"], "tokens": 4096, "items": 100, "seed": 5}), "no report cell"),
        (_ladder(probe="draft_agreement:2"), "the probe a long_switch record holds"),
        (_ladder(max_changed=5), "a share"),
        (_ladder(check_tokens=4), "first token"),
        (_ladder(verdicts={"max_cost": 0.35}), "max_cost and max_changed"),
    ],
)
def test_a_ladder_the_protocol_cannot_calibrate_apart_from_its_report_items_is_refused(tmp_path, ladder, message):
    settings = json.loads(CHAT_DOC.read_text())
    assert 20261207 in {c["seed"] for c in settings["cells"]} and 512 not in {c["tokens"] for c in settings["cells"]}
    with pytest.raises(ProtocolError, match=message):
        load_protocol(_protocol(tmp_path, ladder=ladder))
    assert load_protocol(_protocol(tmp_path, ladder=_ladder())).settings["ladder"] == _ladder()


def test_the_sha256_is_of_the_files_bytes(tmp_path):
    first = load_protocol(_protocol(tmp_path))
    path = tmp_path / "protocol.json"
    path.write_text(path.read_text() + " ")
    assert load_protocol(path).sha256 != first.sha256


def _args(*extra: str):
    argv = ["--protocol", str(CHAT_DOC), "--tasks", "long_chat", "--tokens", "4096", *extra]
    args = long_switch.build_parser().parse_args(argv)
    return args


def test_a_run_under_a_protocol_takes_every_choice_from_it():
    args = _args()
    protocol = long_switch.apply_protocol(args)
    cell = protocol.cell("long_chat", 4096)
    assert (args.seed, args.items, args.direction, args.dtype) == (
        cell["seed"],
        cell["items"],
        "0.5b:1.5b",
        "bfloat16",
    )
    assert long_switch.split_rungs(args.rungs) == protocol.arms[2:-1]
    args = _args("--items", "8", "--threads", "1")  # a part of the cell, on one thread: allowed
    long_switch.apply_protocol(args)
    assert (args.items, args.threads) == (8, 1)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rungs", "tail@0.1"], "fixes the rungs"),
        (["--seed", "4321"], "use seed"),
        (["--dtype", "float32"], "fixes dtype"),
        (["--items", "65"], "holds 64 items"),
        (["--map", "other"], "maps are"),
    ],
)
def test_a_run_that_would_change_a_sealed_choice_is_refused(extra, message):
    with pytest.raises(SystemExit, match=message):
        long_switch.apply_protocol(_args(*extra))


def test_a_task_the_protocol_has_no_cell_for_is_refused():
    args = long_switch.build_parser().parse_args(["--protocol", str(CHAT_DOC), "--tokens", "1024"])
    with pytest.raises(SystemExit, match="no cell for long_chat at 1024"):
        long_switch.apply_protocol(args)


def _records(path: Path, protocol, task: str, outcomes: list[tuple], stamp: str | None = None, mapper="m") -> Path:
    """Rows of `outcomes`: per item (target, source, mapped, repaired, sparse) right (1) or wrong (0); every
    repair rung gets the `repaired` outcome and every sparse peer the `sparse` one; times 10 s target, 1 s the rest."""
    cell = protocol.cell(task, 4096)
    lines = []
    for index, (target, source, mapped, repaired, sparse) in enumerate(outcomes):
        arms = {}
        for arm in protocol.arms:
            right = {"target": target, "source": source, "mapped": mapped}.get(
                arm, sparse if arm.startswith("sparse:") else repaired
            )
            text = "Rex" if right else f"wrong{index}"
            load = 9.0 if index % 8 == 7 else 2.0  # every eighth item measured on a busy machine: not timed
            ttft = (10.0 if arm == "target" else 1.0) * (5.0 if load > 3 else 1.0)
            arms[arm] = {"score": float(right), "text": text, "ttft_s": ttft, "load": load}
        setup = {"mapper": mapper, "protocol": stamp or protocol.sha256, "map": "ridge-k8-5k"}
        key = f"0.5b:1.5b/{task}/4096/{cell['seed']}/{index}"
        lines.append(
            json.dumps({"key": key, "setup": setup, "task": task, "tokens": 4000, "length": 4096, "arms": arms})
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_report_refuses_records_made_under_other_choices(tmp_path):
    protocol = load_protocol(CHAT_DOC)
    path = _records(tmp_path / "r.jsonl", protocol, "long_chat", [(1, 0, 0, 1, 0)], stamp="f" * 64)
    with pytest.raises(SystemExit, match="made under protocol ffffffffffff"):
        report.read_records(protocol, [str(path)])


def test_the_report_gives_each_figure_an_interval_and_reads_verdicts_on_lower_bounds(tmp_path):
    protocol = load_protocol(CHAT_DOC)
    # 64 items: the 1.5B right on 48, the 0.5B on 16 (32 wins); the repair keeps every right answer, the sparse
    # prefill of the same positions half of the wins
    outcomes = [(1, 1, 0, 1, 1)] * 16 + [(1, 0, 0, 1, 1)] * 16 + [(1, 0, 0, 1, 0)] * 16 + [(0, 0, 0, 0, 0)] * 16
    path = _records(tmp_path / "r.jsonl", protocol, "long_chat", outcomes)
    results = report.assemble(protocol, [str(path)])
    cell = next(c for c in results["cells"] if (c["task"], c["length"]) == ("long_chat", 4096))
    rung = protocol.chosen("long_chat")
    figures = cell["figures"]
    assert cell["items"] == 64 and cell["target_wins"] == 32 and cell["gap_to_recover"] and cell["timed_items"] == 56
    assert figures[f"{rung}/gap"]["value"] == 1.0 and figures[f"{rung}/map_adds"]["value"] == 0.25
    low, high = figures[f"{rung}/map_adds"]["interval"]
    assert 0.1 < low < 0.25 < high < 0.4  # 16 of 64 items separate the two: bounded away from 0
    assert figures[f"{rung}/speedup"]["value"] == 10.0 and figures[f"{rung}/changed"]["value"] == 0.0
    assert figures[f"{rung}/retention"]["value"] == 1.0
    assert figures["mapped/gap"]["value"] == pytest.approx(-0.5)
    assert cell["verdict"] == {"rung": rung, "gap": "met", "retention": "met", "speedup": "met", "map_adds": "met"}
    # a cell left unmeasured is listed with no figures
    assert next(c for c in results["cells"] if c["length"] == 2048)["items"] == 0
    assert "no gap to recover" not in report.markdown(results)


def test_fewer_wins_than_the_protocol_asks_is_no_gap_to_recover(tmp_path):
    protocol = load_protocol(CHAT_DOC)
    outcomes = [(1, 1, 0, 1, 1)] * 50 + [(1, 0, 0, 1, 0)] * 14  # 14 wins: below min_gap_items (15)
    path = _records(tmp_path / "r.jsonl", protocol, "long_doc", outcomes)
    cell = next(c for c in report.assemble(protocol, [str(path)])["cells"] if c["task"] == "long_doc")
    rung = protocol.chosen("long_doc")
    assert not cell["gap_to_recover"] and cell["figures"][f"{rung}/gap"]["value"] is None
    assert cell["verdict"]["gap"].startswith("no gap to recover (the target beats the source on 14")
    assert "no gap to recover" in report.markdown({"cells": [cell], "arms": protocol.arms})


def test_the_report_refuses_an_item_measured_on_two_fits_of_the_map(tmp_path):
    protocol = load_protocol(CHAT_DOC)
    first = _records(tmp_path / "a.jsonl", protocol, "long_chat", [(1, 0, 0, 1, 0)])
    second = _records(tmp_path / "b.jsonl", protocol, "long_chat", [(1, 0, 0, 1, 0)], mapper="other")
    assert report.read_records(protocol, [str(first)])[("long_chat", 4096)][0]["setup"]["mapper"] == "m"
    with pytest.raises(SystemExit, match="two fits of the map"):
        report.read_records(protocol, [str(first), str(second)])


def test_a_cell_measured_in_part_gives_no_verdict_and_no_interval_on_a_few_items(tmp_path):
    protocol = load_protocol(CHAT_DOC)
    path = _records(tmp_path / "r.jsonl", protocol, "long_chat", [(1, 0, 0, 1, 0)] * 10)
    cell = next(c for c in report.assemble(protocol, [str(path)])["cells"] if c["task"] == "long_chat")
    rung = protocol.chosen("long_chat")
    assert cell["items"] == 10 and cell["verdict"] == {"rung": rung, "pending": "10 of 64 items measured"}
    assert cell["figures"][f"{rung}/map_adds"] == {"value": 1.0, "interval": None}


def test_follow_up_questions_and_the_tasks_floor_are_reported_as_cells_of_their_own(tmp_path):
    cells = [{"tasks": ["followups"], "tokens": 4096, "items": 64, "seed": 7}]
    protocol = load_protocol(_protocol(tmp_path, cells=cells))
    path = _records(tmp_path / "r.jsonl", protocol, "followups", [(1, 0, 0, 1, 1)] * 32 + [(1, 1, 0, 1, 1)] * 32)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:  # question 2: the repair keeps it, the sparse prefill (which never read its turn) does not
        for arm, record in row["arms"].items():
            right = arm in ("target",) or not (arm.startswith("sparse:") or arm in ("mapped", "source"))
            record["followups"] = [{"text": "x", "tokens": [1], "ttft_s": 0.5, "score": float(right)}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    results = report.assemble(protocol, [str(path)])
    first, second = results["cells"]
    rung = protocol.chosen("followups")
    assert (first["task"], second["task"]) == ("followups", "followups:q2") and second["items"] == 64
    assert first["chance"] == second["chance"] == 0.25  # a question picks one of four candidates
    assert (
        first["figures"][f"{rung}/map_adds"]["value"] == 0.0 and second["figures"][f"{rung}/map_adds"]["value"] == 1.0
    )
    assert second["figures"]["target/score"]["value"] == 1.0 and second["target_wins"] == 64


def test_a_humaneval_cell_draws_one_code_context_a_problem():
    path = ROOT / "benchmarks" / "protocols" / "humaneval-code.json"
    args = long_switch.parse_args(["--protocol", str(path), "--tasks", "humaneval", "--tokens", "2048"])
    assert (args.contexts, args.items, args.seed) == ("distinct", 164, 20261209)
    assert long_switch.key_of(args, {"task": "humaneval", "index": 3}).endswith("/3/distinct")
    with pytest.raises(SystemExit, match="one code context a problem"):
        long_switch.parse_args(["--protocol", str(path), "--tasks", "humaneval", "--contexts", "sequential"])
    assert long_switch.parse_args(["--tasks", "humaneval"]).contexts == "sequential"  # without a protocol


def test_the_readme_headline_names_each_complete_cell_with_its_decision_and_intervals(tmp_path):
    protocol = load_protocol(CHAT_DOC)
    outcomes = [(1, 1, 0, 1, 1)] * 16 + [(1, 0, 0, 1, 1)] * 16 + [(1, 0, 0, 1, 0)] * 16 + [(0, 0, 0, 0, 0)] * 16
    results = report.assemble(protocol, [str(_records(tmp_path / "r.jsonl", protocol, "long_chat", outcomes))])
    text = decisions.headline([results])
    rung = protocol.chosen("long_chat")
    assert text.count("\n- ") == 1  # one complete cell; the cells measured in part or not at all are left out
    cell = next(c for c in results["cells"] if c["items"] == 64)
    assert f"- long_chat at 4096 tokens (64 items, protocol `switch-chat-doc`): **{decisions.decide(protocol, cell)}**. " \
        f"`{rung}`: share of the gap 1.00 [" in text  # fmt: skip
    assert "first token 10.00x [" in text and "the map adds 0.25 [" in text and "no gap" not in text
    few = [(1, 0, 0, 1, 1)] * 14 + [(1, 1, 0, 1, 1)] * 50  # the 1.5B right where the 0.5B is wrong on 14 items
    results = report.assemble(protocol, [str(_records(tmp_path / "f.jsonl", protocol, "long_chat", few))])
    assert "**stay on the 0.5B: the 1.5B is right where it is wrong on only 14 items**. " \
        f"`{rung}`: share of the gap no gap to recover" in decisions.headline([results])  # fmt: skip
    empty = report.assemble(protocol, [str(_records(tmp_path / "s.jsonl", protocol, "long_chat", outcomes[:10]))])
    assert decisions.headline([empty]).endswith("no sealed cell is complete yet.")


@pytest.mark.parametrize(
    "outcomes, decision",
    [
        # the repair keeps every win, the sparse prefill half of them: the map earns its place
        ([(1, 1, 0, 1, 1)] * 16 + [(1, 0, 0, 1, 1)] * 16 + [(1, 0, 0, 1, 0)] * 16 + [(0, 0, 0, 0, 0)] * 16, "repair"),
        # both keep every win: the map adds nothing, the sparse prefill serves
        ([(1, 1, 0, 1, 1)] * 16 + [(1, 0, 0, 1, 1)] * 32 + [(0, 0, 0, 0, 0)] * 16, "sparse prefill"),
        # only the sparse prefill keeps them (a map that hurts)
        ([(1, 1, 0, 1, 1)] * 16 + [(1, 0, 0, 0, 1)] * 32 + [(0, 0, 0, 0, 0)] * 16, "sparse prefill"),
        # neither keeps enough of the gap: re-prefill
        (
            [(1, 1, 0, 1, 1)] * 16 + [(1, 0, 0, 1, 0)] * 16 + [(1, 0, 0, 0, 0)] * 16 + [(0, 0, 0, 0, 0)] * 16,
            "re-prefill",
        ),
        # 14 wins: nothing to recover
        ([(1, 1, 0, 1, 1)] * 50 + [(1, 0, 0, 1, 0)] * 14, "stay on the 0.5B"),
    ],
)
def test_the_switch_decision_reads_the_verdicts_of_the_repair_and_its_sparse_peer(tmp_path, outcomes, decision):
    from benchmarks.sealed import decisions

    protocol = load_protocol(CHAT_DOC)
    path = _records(tmp_path / "r.jsonl", protocol, "long_chat", outcomes)
    results = report.assemble(protocol, [str(path)])
    results["protocol"]["path"] = str(CHAT_DOC)
    cell = next(c for c in results["cells"] if (c["task"], c["length"]) == ("long_chat", 4096))
    assert decision in decisions.decide(protocol, cell)
    table = decisions.markdown([results])
    maps = ", ".join(protocol.settings["maps"])
    assert f"| long_chat | 4096 | {maps} | 64/64 | {decisions.decide(protocol, cell)} |" in table
    assert f"| long_chat | 2048 | {maps} | 0/64 | measuring (0 of 64 items) |" in table
    half = report.assemble(protocol, [str(_records(tmp_path / "h.jsonl", protocol, "long_chat", outcomes[:40]))])
    assert decisions.decide(protocol, next(c for c in half["cells"] if c["length"] == 4096)) == (
        "measuring (40 of 64 items)"
    )


def test_maps_compared_under_protocols_are_theirs_and_take_their_choices(tmp_path, monkeypatch):
    """`benchmarks.switch.map_compare --protocol A,B`: every label of --maps is a map of exactly one protocol; the run takes
    their rungs, items and seed (they must agree on them) and stamps each map's records with its protocol's sha256."""
    from benchmarks.switch import map_compare

    one = _protocol(tmp_path, maps={"ridge-k8-5k": "the 5k recipe"})
    (tmp_path / "one.json").write_text(one.read_text())
    two = _protocol(tmp_path, name="carry", maps={"ridge-k8-conv4k": "the long-conversation recipe"})
    for label in ("a", "b", "c"):
        (tmp_path / label).mkdir()
    taken = {}
    monkeypatch.setattr(map_compare, "run", lambda args: taken.update(vars(args)))
    maps = f"ridge-k8-5k={tmp_path / 'a'},ridge-k8-conv4k={tmp_path / 'b'}"
    base = ["--tasks", "long_chat", "--tokens", "4096", "--records-dir", str(tmp_path / "r"), "--maps"]
    map_compare.main(["--protocol", f"{tmp_path / 'one.json'},{two}", *base, maps])
    first, second = load_protocol(tmp_path / "one.json"), load_protocol(two)
    assert long_switch.split_rungs(taken["rungs"]) == first.arms[2:-1]
    assert (taken["seed"], taken["items"]) == (first.cell("long_chat", 4096)["seed"], 64)
    assert taken["stamps"] == {"ridge-k8-5k": first.sha256, "ridge-k8-conv4k": second.sha256}
    with pytest.raises(SystemExit, match="other: a map of exactly one protocol is needed"):
        map_compare.main(["--protocol", str(two), *base, f"ridge-k8-conv4k={tmp_path / 'a'},other={tmp_path / 'c'}"])
    with pytest.raises(SystemExit, match="fixes the rungs"):
        map_compare.main(["--protocol", f"{tmp_path / 'one.json'},{two}", "--rungs", "tail@0.1", *base, maps])
    other = _protocol(tmp_path, maps={"ridge-k8-conv4k": "x"}, rungs=["tail@0.1"], chosen={"default": "tail@0.1"})
    with pytest.raises(SystemExit, match="differ in rungs"):
        map_compare.main(["--protocol", f"{tmp_path / 'one.json'},{other}", *base, maps])


def test_the_sealed_queue_script_measures_what_the_protocols_seal():
    """`benchmarks/sealed/whole_context.sh` (what is left of the whole-context measurements, in order) runs the
    protocols' maps, rungs, cells and the ladder's calibration cell, not a copy of them that could drift: every
    command is checked flag by flag against the protocol files."""
    import re
    import shlex

    from benchmarks.switch.long_switch_args import split_rungs

    root = Path(__file__).resolve().parents[1]
    script = (root / "benchmarks" / "sealed" / "whole_context.sh").read_text()
    variables = {k: shlex.split(v)[0] for k, v in re.findall(r"^([A-Z]+)=(\S+)$", script, flags=re.MULTILINE)}
    protocols = [load_protocol(root / path) for path in variables["PROTOCOLS"].split(",")]
    chosen = protocols[-1]
    assert [p.settings["name"] for p in protocols] == ["whole-context", "whole-context-conv4k"]
    ladder = chosen.settings["ladder"]["calibration"]
    assert split_rungs(variables["RUNGS"]) == chosen.arms[2:-1] == protocols[0].arms[2:-1]
    folders = dict(entry.split("=", 1) for entry in variables["MAPS"].split(","))
    assert folders == {"ridge-k8-5k": "$WORK/w5k/$M", "ridge-k8-conv4k": "$WORK/wconv/$M"}
    assert [next(iter(p.settings["maps"])) for p in protocols] == list(folders)  # each protocol's map, in order
    tasks = variables["TASKS"].split(",")
    assert tasks == ladder["tasks"]
    for protocol in protocols:
        assert [(c["tasks"], c["tokens"]) for c in protocol.settings["cells"] if c["tokens"] > 2048] == [
            (tasks, 4096),
            (tasks, 8192),
        ]
    commands = [shlex.split(c) for c in script.replace("\\\n", " ").splitlines() if c.startswith("python -m")]
    flags = [dict(zip(c[3::2], c[4::2])) for c in commands]  # python -m MODULE --flag value ...
    assert [(c[2], f.get("--tokens")) for c, f in zip(commands, flags)] == [
        ("benchmarks.switch.map_compare", "4096"),
        ("benchmarks.switch.long_switch", "4096"),
        ("benchmarks.switch.map_compare", "8192"),
    ]
    for compare in (flags[0], flags[2]):
        assert compare == {
            "--protocol": "$PROTOCOLS",
            "--maps": "$MAPS",
            "--tasks": "$TASKS",
            "--tokens": compare["--tokens"],
            "--records-dir": f"$RESULTS/{compare['--tokens']}",
        }
    assert flags[1] == {
        "--mapper": folders[next(iter(chosen.settings["maps"]))],
        "--tasks": "$TASKS",
        "--tokens": str(ladder["tokens"]),
        "--items": str(ladder["items"]),
        "--seed": str(ladder["seed"]),
        "--dtype": chosen.settings["dtype"],
        "--threads": str(chosen.settings["threads"]),
        "--rungs": "$RUNGS",
        "--records": "$RESULTS/ladder-calibration-4096.jsonl",
    }


def test_an_answer_that_changes_without_scoring_lower_is_changed_and_not_worse(tmp_path):
    protocol = load_protocol(CHAT_DOC)
    # the sparse peers miss 16 of the target's 48 right answers (changed, worse), are right on 8 items the target
    # misses (changed, better) and, on the last 8 both miss, say it otherwise (changed, the same score)
    outcomes = [(1, 0, 0, 1, 1)] * 32 + [(1, 0, 0, 1, 0)] * 16 + [(0, 0, 0, 0, 1)] * 8 + [(0, 0, 0, 0, 0)] * 8
    path = _records(tmp_path / "r.jsonl", protocol, "long_chat", outcomes)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows[56:]:
        for arm in row["arms"]:
            if arm.startswith("sparse:"):
                row["arms"][arm]["text"] = "another wrong answer"
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")
    results = report.assemble(protocol, [str(path)])
    figures = next(c for c in results["cells"] if (c["task"], c["length"]) == ("long_chat", 4096))["figures"]
    rung = protocol.chosen("long_chat")
    assert figures[f"{SPARSE}{rung}/changed"]["value"] == 0.5 and figures[f"{SPARSE}{rung}/worse"]["value"] == 0.25
    assert figures[f"{rung}/changed"]["value"] == figures[f"{rung}/worse"]["value"] == 0.0
    text = report.markdown(results).split("**long_chat at 4096 tokens**")[1]
    header = next(line for line in text.splitlines() if line.startswith("| arm |")).split(" | ")
    row = next(line for line in text.splitlines() if line.startswith(f"| {SPARSE}{rung} |")).split(" | ")
    assert len(row) == len(header) and header[4:6] == ["changed answers", "worse than the 1.5B"]
    assert row[4].startswith("0.50 [") and row[5].startswith("0.25 [")
