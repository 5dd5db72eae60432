"""The lm-evaluation-harness model (`hf_kvmap.lm_eval_model`) and the rung texts it serves (`serving.rungs`), on the
tiny family with the local tasks of `tests/data/lm_eval` (the family's own eval items). The tests that run lm-eval skip
when the `lm-eval` extra is not installed."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_kvmap.serving.rungs import RUNG_KINDS, parse_rung
from hf_kvmap.zoo import corpus

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "data" / "lm_eval"
TASK_NAMES = ["tiny_recall", "tiny_choice", "tiny_text"]


# ------------------------------------------------------------------------------------------------ rungs (no lm-eval)


def test_rung_texts_parse_to_the_handoff_they_name():
    assert parse_rung("target").handoff_kwargs is None
    mapped = parse_rung("mapped").handoff_kwargs
    assert (mapped["threshold"], mapped["ladder"], mapped["policy"], mapped["probe"].hold_back) == (
        math.inf,
        False,
        "fail",
        1,
    )
    assert "repair" not in mapped
    repaired = parse_rung("repaired:draft_attention@0.2").handoff_kwargs["repair"].to_dict()
    assert repaired["strategy"]["name"] == "draft_attention" and repaired["fraction"] == 0.2
    assert parse_rung("repaired@1").handoff_kwargs["repair"].to_dict()["strategy"] == {"name": "tail"}
    assert parse_rung("guarded").handoff_kwargs == {}
    assert parse_rung("ladder").handoff_kwargs == {"ladder": True}
    assert list(RUNG_KINDS) == ["target", "mapped", "repaired", "guarded", "ladder", "sparse"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("mirror", "Unknown rung 'mirror'"),
        ("repaired:tail", "names no fraction"),
        ("repaired:tail@lots", "is not a number"),
        ("repaired:tail@1.5", "must be in [0, 1]"),
        ("repaired:nearest@0.2", "Unknown repair strategy 'nearest'"),
        ("target:0.2", "takes no argument"),
        ("sparse", "names no fraction"),
        ("sparse:tail@1.0", "must be in (0, 1)"),
    ],
)
def test_a_bad_rung_text_is_refused_naming_what_to_pass(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_rung(text)


def test_a_ladder_file_is_read_for_the_ladder_rung(tmp_path):
    from hf_kvmap.serving.ladder import GuardLadder, LadderRung

    ladder = GuardLadder({"name": "confident_draft", "tokens": 2}, "tail", [LadderRung(0.5, 0.0)])
    path = tmp_path / "ladder.json"
    path.write_text(json.dumps(ladder.to_dict()))
    assert parse_rung("ladder", ladder=str(path)).handoff_kwargs["ladder"].to_dict() == ladder.to_dict()
    path.write_text("{")
    with pytest.raises(ValueError, match="ladder=.*JSON file of `GuardLadder.to_dict"):
        parse_rung("ladder", ladder=str(path))


def test_the_task_data_are_the_familys_eval_items():
    def rows(name):
        return [json.loads(line) for line in (TASKS / name).read_text().splitlines()]

    recall = corpus.make_eval_set("recall", 8, 0)
    assert rows("tiny_recall.jsonl") == [{"context": it.context, "answer": it.answer} for it in recall]
    choice = corpus.make_eval_set("choice", 8, 0)
    assert rows("tiny_choice.jsonl") == [
        {"context": it.context, "choices": it.choices, "label": it.label} for it in choice
    ]
    assert rows("tiny_text.jsonl") == [{"text": it.text} for it in corpus.make_eval_set("text", 4, 0)]


def test_importing_the_package_never_imports_lm_eval():
    code = "import sys, hf_kvmap, hf_kvmap.serving.rungs, hf_kvmap.cli; print('lm_eval' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------------ lm-eval


@pytest.fixture(scope="module")
def lm_eval(tmp_path_factory):
    lm_eval = pytest.importorskip("lm_eval")
    import hf_kvmap.lm_eval_model  # noqa: F401  (registers `hf-kvmap`)

    return lm_eval


@pytest.fixture(scope="module")
def task_manager(lm_eval):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS))


def _evaluate(lm_eval, task_manager, model, model_args, tasks=TASK_NAMES):
    import os

    cwd = os.getcwd()
    os.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    try:
        return lm_eval.simple_evaluate(
            model=model, model_args=model_args, tasks=tasks, task_manager=task_manager, log_samples=True
        )
    finally:
        os.chdir(cwd)


def _metrics(results):
    return {
        task: {k: v for k, v in values.items() if "stderr" not in k and k not in ("alias", "name")}
        for task, values in results["results"].items()
    }


def _responses(results):
    """Per task, every request's answer in order (a generation, a `(log-likelihood, is greedy)` pair, a rolling sum)."""
    return {
        task: [answer for sample in samples for request in sample["resps"] for answer in request]
        for task, samples in results["samples"].items()
    }


@pytest.fixture(scope="module")
def stock(lm_eval, task_manager):
    from hf_kvmap import zoo

    args = f"pretrained={zoo.model_path('tiny-l')},tokenizer={zoo.tokenizer_path()},device=cpu,dtype=float32"
    return _evaluate(lm_eval, task_manager, "hf", args)


def _kvmap(lm_eval, task_manager, rung, tmp_path, extra=""):
    reports = tmp_path / "handoffs.jsonl"
    args = f"source=tiny-m,target=tiny-l,rung={rung},device=cpu,dtype=float32,reports={reports}{extra}"
    results = _evaluate(lm_eval, task_manager, "hf-kvmap", args)
    return results, [json.loads(line) for line in reports.read_text().splitlines()]


def test_rung_target_gives_exactly_lm_evals_own_hf_model(lm_eval, task_manager, stock, tmp_path):
    results, reports = _kvmap(lm_eval, task_manager, "target", tmp_path)
    assert _metrics(results) == _metrics(stock)
    assert _responses(results) == _responses(stock)  # every log-likelihood and generation, bit for bit
    assert {line["rung"] for line in reports} == {"target"}
    assert len(reports) == 8 + 8 * 4 + 4  # one per generation, per choice and per rolling window


def test_a_repair_of_every_position_gives_the_targets_results(lm_eval, task_manager, stock, tmp_path):
    results, reports = _kvmap(lm_eval, task_manager, "repaired:tail@1.0", tmp_path)
    assert _metrics(results)["tiny_text"] == pytest.approx(_metrics(stock)["tiny_text"], rel=1e-5)
    assert _metrics(results)["tiny_recall"] == _metrics(stock)["tiny_recall"]
    assert _metrics(results)["tiny_choice"] == _metrics(stock)["tiny_choice"]
    mine, own = _responses(results), _responses(stock)
    assert mine["tiny_recall"] == own["tiny_recall"]  # the same generations
    assert len(mine["tiny_choice"]) == 8 * 4 and len(mine["tiny_text"]) == 4
    for got, want in zip(mine["tiny_choice"], own["tiny_choice"], strict=True):  # (log-likelihood, is greedy)
        assert got[1] == want[1] and got[0] == pytest.approx(want[0], abs=1e-4)
    assert mine["tiny_text"] == pytest.approx(own["tiny_text"], abs=1e-4)
    handed = [line for line in reports if line["rung"] != "target"]
    assert len(handed) == 8 + 8 * 4  # every generation and choice; a rolling window's one-token context is not
    for line in handed:
        assert line["accepted"] and line["rung"] == "repaired:tail@1.0"
        assert line["repair"]["fraction"] == 1.0
        assert line["repair"]["recomputed"] == [line["prompt_tokens"] - 1]  # every mapped position
        assert line["repair"]["exact"] is True
    assert {(line["task"], line["request_type"]) for line in handed} == {
        ("tiny_recall", "generate_until"),
        ("tiny_choice", "loglikelihood"),
    }


def test_the_mapped_rung_serves_the_mapped_cache_and_keeps_each_report(lm_eval, task_manager, stock, tmp_path):
    results, reports = _kvmap(lm_eval, task_manager, "mapped", tmp_path)
    choice = [line for line in reports if line["task"] == "tiny_choice"]
    assert sorted((line["doc_id"], line["idx"]) for line in choice) == [(d, i) for d in range(8) for i in range(4)]
    for line in choice:
        assert line["accepted"] and line["repair"] is None
        assert line["mapped_tokens"] == line["prompt_tokens"] - 1
    # the mapped caches are not the target's own: some continuation's log-likelihood moves
    mine, own = _responses(results)["tiny_choice"], _responses(stock)["tiny_choice"]
    assert max(abs(got[0] - want[0]) for got, want in zip(mine, own, strict=True)) > 1e-3


def test_rolling_windows_with_a_context_are_handed_off(lm_eval, task_manager, tmp_path):
    extra = ",max_length=64,rolling_context=16"
    target, _ = _kvmap(lm_eval, task_manager, "target", tmp_path / "t", extra)
    repaired, reports = _kvmap(lm_eval, task_manager, "repaired:tail@1.0", tmp_path / "r", extra)
    windows = [line for line in reports if line["task"] == "tiny_text"]
    handed = [line for line in windows if line["rung"] != "target"]
    assert len(handed) == len(windows) - 4 > 0  # every window but each text's first
    # lm-eval's windows: `rolling_context` tokens before each, more before a text's last (its window ends the text)
    assert min(line["prompt_tokens"] for line in handed) == 16
    assert all(line["accepted"] and line["repair"]["exact"] for line in handed)
    assert _metrics(repaired)["tiny_text"] == pytest.approx(_metrics(target)["tiny_text"], rel=1e-5)


def test_the_model_refuses_pretrained_and_a_pair_without_a_mapper(lm_eval):
    from hf_kvmap.lm_eval_model import HFKVMapLM

    with pytest.raises(TypeError, match="takes `target=`"):
        HFKVMapLM(source="tiny-m", target="tiny-l", pretrained="tiny-l")
    with pytest.raises(ValueError, match="needs `mapper=`"):
        HFKVMapLM(source="org/small", target="org/large", rung="mapped")


def test_hf_kvmap_eval_runs_lm_evals_command_line_with_the_model_registered(lm_eval, tmp_path, monkeypatch):
    from hf_kvmap.lm_eval_model import cli_evaluate

    monkeypatch.chdir(ROOT)
    argv = ["hf-kvmap-eval", "--model", "hf-kvmap", "--model_args", "source=tiny-m,target=tiny-l,rung=mapped"]
    argv += ["--tasks", "tiny_choice", "--include_path", str(TASKS), "--device", "cpu"]
    argv += ["--output_path", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", argv)
    cli_evaluate()
    written = [json.loads(p.read_text()) for p in (tmp_path / "out").rglob("results_*.json")]
    assert len(written) == 1
    assert set(written[0]["results"]) == {"tiny_choice"}
    assert written[0]["config"]["model"] == "hf-kvmap"


def test_a_ladder_no_risk_fits_serves_every_prompt_the_targets_prefill(lm_eval, task_manager, stock, tmp_path):
    from hf_kvmap.serving.ladder import GuardLadder, LadderRung

    path = tmp_path / "ladder.json"  # one rung for risks below -1: every row climbs past it to the target's prefill
    path.write_text(
        json.dumps(GuardLadder({"name": "confident_draft", "tokens": 2}, "tail", [LadderRung(-1.0, 0.0)]).to_dict())
    )
    reports = tmp_path / "handoffs.jsonl"
    args = f"source=tiny-m,target=tiny-l,rung=ladder,ladder={path},reports={reports}"
    results = _evaluate(lm_eval, task_manager, "hf-kvmap", args, tasks=["tiny_choice"])
    lines = [json.loads(line) for line in reports.read_text().splitlines()]
    assert len(lines) == 8 * 4
    assert all([row["rung"] for row in line["ladder"]["rows"]] == ["fallback"] for line in lines)
    assert _metrics(results)["tiny_choice"] == _metrics(stock)["tiny_choice"]
    for got, want in zip(_responses(results)["tiny_choice"], _responses(stock)["tiny_choice"], strict=True):
        assert got[1] == want[1] and got[0] == pytest.approx(want[0], abs=1e-4)
