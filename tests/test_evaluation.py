"""Three-way evaluation: with an identity mapper of a model onto itself, handoff == target alone, exactly."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_model
from transformers import Qwen3Config

from hf_kvmap import MapperModel
from hf_kvmap.evaluation import Handoff, TaskSpec, evaluate_tasks
from hf_kvmap.metrics import RETENTION_PATH, load_retention
from hf_kvmap.zoo import corpus, load_tokenizer


def test_retention_metric_hand_computed():
    result = load_retention().compute(
        predictions=[0.5, 0.25, 0.3, 0.45],
        references=[0.75, 0.75, 0.25, 0.9],
        chance=[0.25, 0.25, 0.25, 0.0],
        task_names=["a", "b", "at-chance", "gsm"],
        generation_tasks=["gsm"],
    )
    assert result["per_task"]["a"] == {"retention": pytest.approx(2 / 3), "floor_normalized_retention": 0.5}
    assert result["per_task"]["b"]["floor_normalized_retention"] == 0.0
    assert math.isnan(result["per_task"]["at-chance"]["floor_normalized_retention"])  # target at chance
    assert result["per_task"]["at-chance"]["retention"] == pytest.approx(1.2)
    assert result["generation"] == {"gsm": {"retention": 0.5, "floor_normalized_retention": 0.5}}
    # averages exclude the generation task and skip undefined values
    assert result["retention"] == pytest.approx((2 / 3 + 1 / 3 + 1.2) / 3)
    assert result["floor_normalized_retention"] == pytest.approx(0.25)


def test_retention_metric_loads_offline_with_evaluate(monkeypatch):
    import evaluate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    metric = evaluate.load(RETENTION_PATH)
    assert metric.compute(predictions=[0.4], references=[0.8])["retention"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="not among task_names"):
        metric.compute(predictions=[0.4], references=[0.8], task_names=["x"], generation_tasks=["y"])


@pytest.fixture(scope="module")
def handoff():
    tokenizer = load_tokenizer()
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = build_model(config, seed=2)
    return Handoff(source=model, target=model, mapper=MapperModel.identity(config), tokenizer=tokenizer)


def test_identity_handoff_equals_target_alone(handoff):
    tasks = [
        TaskSpec("recall", "exact_match", corpus.make_eval_set("recall", 6, seed=1, n_chars=96), stop="\n"),
        TaskSpec("choice", "choice", corpus.make_eval_set("choice", 6, seed=1), chance=0.25),
        TaskSpec("text", "perplexity", corpus.make_eval_set("text", 3, seed=1, n_chars=96)),
    ]
    results = evaluate_tasks(handoff, tasks, progress=False)
    for name in ("recall", "choice"):
        row = results["tasks"][name]
        assert row["mapped"] == row["target"] == row["source"], row
    ppl = results["perplexity"]["text"]
    assert ppl["mapped"] == pytest.approx(ppl["target"], rel=1e-5)
    assert math.isfinite(ppl["target"]) and ppl["target"] > 1


def test_choice_scores_match_a_full_forward(handoff):
    item = corpus.make_eval_set("choice", 1, seed=3)[0]
    scores = handoff.choice_logprobs("mapped", item.context, item.choices)
    tok = handoff.tokenizer
    for choice, score in zip(item.choices, scores):
        ctx = tok(item.context)["input_ids"]
        full = torch.tensor([ctx + tok(choice, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            logprobs = torch.log_softmax(handoff.target(full).logits[0, :-1].float(), -1)
        expected = logprobs[len(ctx) - 1 :].gather(-1, full[0, len(ctx) :, None]).sum().item()
        assert score == pytest.approx(expected, abs=1e-4)
