"""Three-way evaluation: with an identity mapper of a model onto itself, handoff == target alone, exactly."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from hf_kvmap.cli import main as cli_main
from hf_kvmap.evaluation import HandoffEvaluation, TaskSpec, evaluate_tasks
from hf_kvmap.metrics import RETENTION_PATH, load_retention
from hf_kvmap.zoo import corpus


@pytest.fixture(scope="module")
def handoff(identity_handoff):
    return identity_handoff


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


def test_identity_handoff_scores_what_the_target_scores_and_a_zeroed_mapper_does_not(handoff):
    """Accuracies can agree by accident (a random model recalls nothing in any mode): compare the scores
    themselves, and check that a mapper that destroys the cache is seen."""
    item = corpus.make_eval_set("choice", 1, seed=4)[0]
    target = handoff.choice_logprobs("target", item.context, item.choices)
    assert handoff.choice_logprobs("mapped", item.context, item.choices) == pytest.approx(target, abs=1e-4)
    zeroed = copy.deepcopy(handoff.mapper)
    with torch.no_grad():
        for param in zeroed.parameters():
            param.zero_()
    broken = HandoffEvaluation(
        source=handoff.source, target=handoff.target, mapper=zeroed, tokenizer=handoff.tokenizer
    )
    assert max(abs(a - b) for a, b in zip(broken.choice_logprobs("mapped", item.context, item.choices), target)) > 1e-2


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


def _write_jsonl(path, rows):

    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")


def test_jsonl_tasks_and_eval_command(tmp_path, handoff):

    model_dir, mapper_dir = tmp_path / "model", tmp_path / "mapper"
    handoff.target.save_pretrained(model_dir)
    handoff.tokenizer.save_pretrained(model_dir)
    handoff.mapper.save_pretrained(mapper_dir)
    tasks = tmp_path / "tasks.jsonl"
    _write_jsonl(
        tasks,
        [
            {"task": "qa", "prompt": "ab=123\n?ab=", "answer": "123", "stop": "\n"},
            {"task": "qa", "prompt": "cd=456\n?cd=", "answer": "456", "stop": "\n"},
            {"task": "mc", "type": "choice", "context": "sam has a red", "choices": [" cup.", " pen."], "label": 0},
            {"task": "ppl", "type": "perplexity", "text": "the cat sat on the mat and the dog sat on the log."},
        ],
    )
    out = tmp_path / "results.json"
    args = [
        "eval",
        "--source",
        str(model_dir),
        "--target",
        str(model_dir),
        "--mapper",
        str(mapper_dir),
        "--tasks",
        str(tasks),
        "--json",
        str(out),
    ]
    assert cli_main(args) == 0
    results = json.loads(out.read_text())
    assert set(results["tasks"]) == {"qa", "mc"} and set(results["perplexity"]) == {"ppl"}
    assert results["tasks"]["mc"]["chance"] == 0.5
    for row in results["tasks"].values():
        assert row["mapped"] == row["target"]
    assert results["run"]["mapper_content_hash"].startswith("sha256:")
    assert results["environment"]["transformers"]


@pytest.mark.parametrize(
    "row,fragment",
    [
        ({"task": "x", "type": "bleu", "prompt": "a", "answer": "b"}, "type='bleu'"),
        ({"task": "x", "type": "choice", "context": "a", "choices": ["b", "c"], "label": 3}, "out of range"),
        ({"task": "x", "prompt": "a"}, "needs \\['answer'\\]"),
        ({"prompt": "a", "answer": "b"}, "needs a `task` name"),
    ],
)
def test_jsonl_task_errors(tmp_path, row, fragment):
    from hf_kvmap.evaluation import load_jsonl_tasks

    path = tmp_path / "tasks.jsonl"
    _write_jsonl(path, [row])
    with pytest.raises(ValueError, match=fragment):
        load_jsonl_tasks(path)


def test_a_target_that_does_not_beat_chance_makes_retention_not_measurable():
    from hf_kvmap.metrics.retention.retention import binomial_tail, target_beats_chance

    assert binomial_tail(0, 10, 0.3) == 1.0
    assert binomial_tail(3, 3, 0.5) == pytest.approx(0.125)
    assert binomial_tail(2, 4, 0.5) == pytest.approx(11 / 16)
    # free generation (chance 0): one lucky item of 200 is the null, so 1/200 is noise and 5/200 is not
    assert target_beats_chance(1 / 200, 200, 0.0)[0] is False
    assert target_beats_chance(5 / 200, 200, 0.0)[0] is True
    assert target_beats_chance(0.3, 40, 0.25)[0] is False and target_beats_chance(0.6, 40, 0.25)[0] is True
    assert target_beats_chance(0.9, None, 0.0) == (False, None)  # no item count: nothing to test
    result = load_retention().compute(
        predictions=[0.005, 0.5],
        references=[0.005, 0.75],
        chance=[0.0, 0.25],
        task_names=["arithmetic", "choice"],
        n_items=[200, 40],
    )
    arithmetic = result["per_task"]["arithmetic"]
    assert arithmetic["retention_measurable"] is False and math.isnan(arithmetic["retention"])
    assert math.isnan(arithmetic["floor_normalized_retention"]) and arithmetic["target_vs_chance_p"] > 0.5
    assert result["per_task"]["choice"]["retention_measurable"] is True
    assert result["retention"] == pytest.approx(2 / 3)  # the average leaves the unmeasurable task out


def test_floor_retention_reads_only_where_the_target_beats_guessing():
    """`reporting.floor_retention`: `(score - chance) / (target - chance)` where the target beats chance by the exact
    binomial test over the items (or, without a count, is above it), else None; the same numbers as the metric's."""
    from hf_kvmap.reporting import floor_retention

    assert floor_retention(0.5, 0.75, 0.25, 40) == pytest.approx(0.5)  # the metric's "choice" task above
    assert floor_retention(0.3, 0.3, 0.25, 40) is None  # 0.3 of 40 does not beat one in four
    assert floor_retention(0.6, 0.8, 0.0, 10) == pytest.approx(0.75)  # chance 0: score over target
    assert floor_retention(0.1, 0.2, 0.25) is None and floor_retention(0.1, 0.5, 0.25) == pytest.approx(-0.6)
    assert floor_retention(0.0, 0.0) is None


def test_evaluate_tasks_reports_unmeasurable_retention_as_null(handoff):
    tasks = [TaskSpec("recall", "exact_match", corpus.make_eval_set("recall", 6, seed=1, n_chars=96), stop="\n")]
    row = evaluate_tasks(handoff, tasks, progress=False)["tasks"]["recall"]
    assert row["target"] < 0.5  # a random model recalls nothing: nothing to retain
    assert row["retention_measurable"] is False and math.isnan(row["retention"])


def test_each_item_is_scored_with_its_own_stop(tmp_path, handoff):
    """Two items of one task whose stops differ: the answer plus each item's own stop is what the target generates,
    so both count only if each item's stop is used (the first item's stop used for both fails the second)."""
    from hf_kvmap.evaluation import load_jsonl_tasks

    tokenizer = handoff.tokenizer
    chosen = []
    for item in corpus.make_eval_set("recall", 40, seed=5, n_chars=64):
        ids = torch.tensor([tokenizer(item.context)["input_ids"]])
        new = handoff.target.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)[0, ids.shape[1] :]
        answer, stop = (tokenizer.decode([t], skip_special_tokens=False) for t in new.tolist())
        if tokenizer(answer + stop, add_special_tokens=False)["input_ids"] != new.tolist():
            continue  # a special token: not expressible as text
        if not chosen or stop != chosen[0][2]:
            chosen.append((item.context, answer, stop))
        if len(chosen) == 2:
            break
    assert len(chosen) == 2 and chosen[0][2] != chosen[1][2]
    lines = [json.dumps({"task": "qa", "prompt": p, "answer": a, "stop": s}) for p, a, s in chosen]
    (tmp_path / "tasks.jsonl").write_text("\n".join(lines))
    results = evaluate_tasks(handoff, load_jsonl_tasks(tmp_path / "tasks.jsonl"), progress=False)
    assert results["tasks"]["qa"]["target"] == 1.0 and results["tasks"]["qa"]["mapped"] == 1.0


def test_every_malformed_task_line_is_reported_with_its_line_before_any_model_runs(tmp_path, monkeypatch):
    from hf_kvmap.evaluation import load_jsonl_tasks

    lines = [
        json.dumps({"task": "qa", "prompt": "2+2=", "answer": "4"}),  # 1: fine
        "{not json",  # 2
        json.dumps(["task", "qa"]),  # 3: a list
        json.dumps({"task": "qa", "prompt": 5, "answer": "4"}),  # 4: wrong type
        json.dumps({"task": "qa", "prompt": "", "answer": "4"}),  # 5: empty prompt
        json.dumps({"task": "qa", "prompt": "1+1=", "answer": ""}),  # 6: empty answer
        json.dumps({"task": "ppl", "type": "perplexity", "text": "a"}),  # 7: one character
        json.dumps({"task": "ppl", "type": "perplexity", "text": ""}),  # 8: empty
        json.dumps({"task": "mc", "type": "choice", "context": "c", "choices": "ab", "label": 0}),  # 9
        json.dumps({"task": "mc", "type": "choice", "context": "c", "choices": ["a", "b"], "label": "0"}),  # 10
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as err:
        load_jsonl_tasks(path)
    message = str(err.value)
    for number, fragment in (
        (2, "not valid JSON"),
        (3, "a list, expected an object"),
        (4, "prompt must be a string"),
        (5, "prompt is empty"),
        (6, "answer is empty"),
        (7, "text needs at least 2 characters"),
        (8, "text needs at least 2 characters"),
        (9, "choices must be a list of strings"),
        (10, "label must be an integer"),
    ):
        assert f"{path}:{number}: {fragment}" in message, (number, message)
    assert f"{path}:1:" not in message

    import hf_kvmap.commands.models as models

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the task file was checked")

    monkeypatch.setattr(models, "load_causal_lm", no_model)
    with pytest.raises(SystemExit, match=f"{path}:2: not valid JSON"):
        cli_main(["eval", "--source", "tiny-s", "--target", "tiny-l", "--tasks", str(path)])


def test_measure_latency_times_the_handoff_to_first_token_beside_the_prefill(identity_handoff):
    from hf_kvmap.evaluation import measure_latency

    rows = measure_latency(identity_handoff, [12, 20], repeats=1, warmup=0, first_token=True)
    assert [row["tokens"] for row in rows] == [12, 20]
    for row in rows:
        assert all(row[name] > 0 for name in ("mapper_ms", "prefill_ms", "first_token_handoff_ms"))
        assert row["speedup"] == row["prefill_ms"] / row["mapper_ms"]
        assert row["first_token_speedup"] == row["first_token_prefill_ms"] / row["first_token_handoff_ms"]
    plain = measure_latency(identity_handoff, [12], repeats=1, warmup=0)
    assert set(plain[0]) == {"tokens", "mapper_ms", "prefill_ms", "speedup"}  # the first-token timing is opt-in


def test_handoff_with_the_targets_first_layer_ignores_a_broken_layer_zero_map(handoff):
    """`target_first_layer=True`: the target computes its layer 0 from the ids, so an identity mapper whose layer-0
    maps are wrecked hands off exactly as the target alone; without it the wreck shows."""
    from hf_kvmap import MapperModel
    from hf_kvmap.evaluation import evaluate_items

    wrecked = MapperModel.identity(handoff.target.config)
    with torch.no_grad():
        wrecked.layers[0].key_proj.weight.mul_(-3.0)
        wrecked.layers[0].value_proj.weight.mul_(-3.0)
    items = corpus.make_eval_set("text", 3, seed=4, n_chars=96)
    alone = evaluate_items(handoff, "perplexity", items, "target")
    fixed = HandoffEvaluation(handoff.source, handoff.target, wrecked, handoff.tokenizer, target_first_layer=True)
    broken = HandoffEvaluation(handoff.source, handoff.target, wrecked, handoff.tokenizer)
    assert evaluate_items(fixed, "perplexity", items, "mapped") == pytest.approx(alone, rel=1e-5)
    assert evaluate_items(broken, "perplexity", items, "mapped") != pytest.approx(alone, rel=1e-2)


@pytest.mark.parametrize("task_type", ["exact_match", "choice", "perplexity"])
def test_evaluate_items_progress_counts_every_item_and_changes_no_score(handoff, task_type, monkeypatch):
    from tqdm.auto import tqdm

    from hf_kvmap import evaluation

    shown = []

    class Recording(tqdm):  # what every bar that was shown had counted when it closed
        def close(self):
            if not self.disable:
                shown.append((self.desc, self.n, self.total))
            super().close()

    monkeypatch.setattr(evaluation, "tqdm", Recording)
    kind = {"exact_match": "recall", "choice": "choice", "perplexity": "text"}[task_type]
    items = corpus.make_eval_set(kind, 5, seed=3, **({} if kind == "choice" else {"n_chars": 96}))
    kwargs = {"stop": "\n"} if task_type == "exact_match" else {}
    quiet = evaluation.evaluate_items(handoff, task_type, items, "mapped", **kwargs)
    assert shown == []  # no bar unless asked
    loud = evaluation.evaluate_items(handoff, task_type, items, "mapped", progress="set/task/mapped", **kwargs)
    assert loud == quiet and shown == [("set/task/mapped", 5, 5)]
    with pytest.raises(ValueError, match="task_type='ranking'"):
        evaluation.evaluate_items(handoff, "ranking", items, "mapped", progress="x")
