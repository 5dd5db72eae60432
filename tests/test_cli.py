"""The command line: `fit` (ridge, MLP, windows, from statistics), `card`, `demo`."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from hf_kvmap import (
    CalibrationStatistics,
    MapperModel,
)
from hf_kvmap.artifacts import tokenizer_fingerprint
from hf_kvmap.cli import main as cli_main
from hf_kvmap.modeling_mlp import HeadwiseMLP


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(30)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def _cli_pair(tiny, tmp_path):
    """A 2-layer source and a 3-layer target saved with one tokenizer, and 20 lines of calibration text
    (`data.txt`); returns `(tokenizer, lines)`."""
    tokenizer = _tiny_tokenizer()
    for name, seed, layers in (("src", 0, 2), ("tgt", 1, 3)):
        tiny.model(sharpen=False, seed=seed, layers=layers, vocab=32).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    generator = torch.Generator().manual_seed(0)
    lines = [" ".join(f"w{i}" for i in torch.randint(0, 30, (40,), generator=generator).tolist()) for _ in range(20)]
    (tmp_path / "data.txt").write_text("\n".join(lines))
    return tokenizer, lines


def test_cli_fit_writes_loadable_mapper(tiny, tmp_path):
    from hf_kvmap.cli import main

    tokenizer, lines = _cli_pair(tiny, tmp_path)
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps({"text": line}) for line in lines))
    for data in ("data.txt", "data.jsonl"):
        out = tmp_path / f"mapper-{data}"
        code = main(
            [
                "fit",
                "--source",
                str(tmp_path / "src"),
                "--target",
                str(tmp_path / "tgt"),
                "--data",
                str(tmp_path / data),
                "--top-k",
                "1",
                "--ridge-lambda",
                "0.1",
                "--seq-len",
                "32",
                "--stride",
                "2",
                "--max-sequences",
                "12",
                "--batch-size",
                "4",
                "--out",
                str(out),
                "--stats",
                str(tmp_path / f"stats-{data}"),
                "--no-progress",
            ]
        )
        assert code == 0
        mapper = MapperModel.from_pretrained(out)
        assert len(mapper.config.source_layers) == 3 and all(len(s) == 1 for s in mapper.config.source_layers)
        assert mapper.config.source_model_id == str(tmp_path / "src")
        assert mapper.config.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)
        assert mapper.config.calibration["sequences"] == 12 and mapper.config.calibration["stride"] == 2
        assert (out / "selection.json").exists()
        stats = CalibrationStatistics.load(tmp_path / f"stats-{data}")
        assert stats.count() == 12 * 16
        assert stats.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)

    # Re-solve from the saved statistics with another k, without the models.
    out = tmp_path / "mapper-k2"
    assert main(["fit", "--from-stats", str(tmp_path / "stats-data.txt"), "--top-k", "all", "--out", str(out)]) == 0
    mapper = MapperModel.from_pretrained(out)
    assert all(layers == [0, 1] for layers in mapper.config.source_layers)
    assert mapper.config.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)
    assert (
        mapper.config.calibration["fingerprint"] == CalibrationStatistics.load(tmp_path / "stats-data.txt").fingerprint
    )
    with pytest.raises(SystemExit, match="--data"):
        main(["fit", "--source", str(tmp_path / "src"), "--target", str(tmp_path / "tgt"), "--out", str(out)])


def test_cli_fit_kind_mlp(tiny, tmp_path):
    from hf_kvmap.cli import main

    tokenizer, _ = _cli_pair(tiny, tmp_path)
    models = [
        "--source",
        str(tmp_path / "src"),
        "--target",
        str(tmp_path / "tgt"),
        "--data",
        str(tmp_path / "data.txt"),
    ]
    options = ["--kind", "mlp", "--top-k", "2", "--hidden-size", "48", "--epochs", "2", "--batch-tokens", "32"]
    options += ["--seq-len", "16", "--max-sequences", "8", "--batch-size", "4", "--stride", "1", "--seed", "5"]
    out = tmp_path / "mlp"
    assert main(["fit", *models, *options, "--out", str(out), "--no-progress"]) == 0
    mapper = MapperModel.from_pretrained(out)
    assert mapper.config.kind == "mlp" and mapper.config.mlp_hidden_size == 48
    assert isinstance(mapper.layers[0].key_proj, HeadwiseMLP)
    assert mapper.config.source_layers == [[0, 1]] * 3
    assert mapper.config.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)
    training = mapper.config.calibration["mlp_training"]
    assert (training["epochs"], training["batch_tokens"], training["seed"]) == (2, 32, 5)
    assert training["positions_train"] + training["positions_val"] == 8 * 16
    assert (out / "selection.json").exists() and "## MLP training" in (out / "README.md").read_text()
    pytest.importorskip("matplotlib")
    assert (out / "training_curves.png").exists()

    with pytest.raises(SystemExit, match="drop --from-stats"):
        main(["fit", "--kind", "mlp", "--from-stats", str(tmp_path), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="drop --from-stats"):
        main(["fit", "--context-window", "2", "--from-stats", str(tmp_path), "--out", str(tmp_path / "x")])

    # a windowed ridge reading keys and values
    out = tmp_path / "windowed"
    window = ["--top-k", "1", "--context-window", "2", "--input-kinds", "both", "--seq-len", "16"]
    window += ["--max-sequences", "8", "--batch-size", "4", "--stride", "2"]
    assert main(["fit", *models, *window, "--out", str(out), "--no-progress"]) == 0
    mapper = MapperModel.from_pretrained(out)
    assert (mapper.config.kind, mapper.config.context_window, mapper.config.input_kinds) == ("ridge", 2, "both")
    assert mapper.layers[0].key_proj.weight.shape[1] == 3 * 2 * mapper.config.source_geometry.layer_width
    assert "| context window (earlier positions read) | 2 |" in (out / "README.md").read_text()


def test_cli_refuses_different_tokenizers(tiny, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_kvmap.cli import main

    other = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "a": 1}, unk_token="<unk>"))
    other.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    for name, tokenizer in (("src", _tiny_tokenizer()), ("tgt", PreTrainedTokenizerFast(tokenizer_object=other))):
        tiny.model(sharpen=False, layers=1, vocab=32).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    (tmp_path / "data.txt").write_text("w1 w2 w3 " * 50)
    with pytest.raises(SystemExit, match="tokenizer"):
        main(
            [
                "fit",
                "--source",
                str(tmp_path / "src"),
                "--target",
                str(tmp_path / "tgt"),
                "--data",
                str(tmp_path / "data.txt"),
                "--out",
                str(tmp_path / "out"),
                "--no-progress",
            ]
        )


def test_short_demo_reports_the_tasks_the_target_does_and_names_the_others(tmp_path, capsys):
    out, plot = tmp_path / "demo.json", tmp_path / "demo.png"
    args = ["demo", "--items", "6", "--lengths", "32,64", "--repeats", "1", "--long-lengths", "64,96", "--long-items",
            "3", "--reach", "40", "--json", str(out), "--plot", str(plot)]  # fmt: skip
    threads = torch.get_num_threads()
    assert cli_main(args) == 0
    assert torch.get_num_threads() == threads  # the demo ran on 1 thread (its default) and gave the count back
    results = json.loads(out.read_text())
    assert set(results["tasks"]) | set(results["dropped_tasks"]) == {"recall", "arithmetic", "choice", "chat"}
    assert not set(results["tasks"]) & set(results["dropped_tasks"])
    for row in results["tasks"].values():
        for key in ("source", "target", "mapped", "chance", "retention", "floor_normalized_retention"):
            assert math.isfinite(row[key])
        assert row["retention_measurable"] is True
    printed = capsys.readouterr().out
    for name, row in results["dropped_tasks"].items():
        assert row["retention_measurable"] is False and row["retention"] is None
        assert f"dropped {name}: the target alone scores" in printed
    assert math.isfinite(results["perplexity"]["text"]["mapped"])
    assert [row["tokens"] for row in results["latency"]] == [32, 64]
    assert all(row["mapper_ms"] > 0 and row["prefill_ms"] > 0 for row in results["latency"])
    assert all(row[f"ttft_{way}_ms"] > 0 for row in results["latency"] for way in ("target", "mapped", "repaired"))
    # every kept exact-match task served four ways, each with its accuracy and time to first token
    assert set(results["serving"]) == {n for n, row in results["tasks"].items() if row["task_type"] == "exact_match"}
    for name, ways in results["serving"].items():
        assert list(ways) == ["target", "mapped", "repaired", "guarded"]
        for row in ways.values():
            assert 0 <= row["accuracy"] <= 1 and row["ttft_ms"] > 0
            assert math.isclose(sum(row["rungs"].values()), 1.0)
        assert set(ways["guarded"]["rungs"]) <= {"mapped", "fallback"} or "ladder" in results["run"]["guard"]
        for way in ("target alone", "mapped", "repaired", "guarded"):
            assert re.search(rf"^{name} +{way} +[0-9.]+ +[0-9.]+", printed, re.MULTILINE), (name, way)
    assert results["environment"]["threads"] == 1
    assert all(len(results["environment"][key]) == 3 for key in ("loadavg_start", "loadavg_end"))
    # the long forms of the kept tasks that have one, served four ways at each length, and the first screen printed
    long = results["long"]
    assert long["lengths"] == [64, 96] and long["reach"] == 40 and long["items"] == 3
    assert set(long["tasks"]) == {"recall", "chat"} & set(results["tasks"]) == set(long["break_even"])
    for rows in long["tasks"].values():
        assert [row["tokens"] for row in rows] == [64, 96]
        for row in rows:
            assert list(row["ways"]) == ["target", "mapped", "repaired", "guarded"]
            assert all(row["ways"][way]["n_items"] == 3 for way in row["ways"])
            assert row["prompt_tokens"][1] <= row["tokens"]
    assert set(results["latency_break_even"]) == {"mapped", "repaired"}
    assert printed.startswith("hf-kvmap demo: tiny-s -> tiny-l (mapper zoo:tiny-s-to-tiny-l): where the switch pays")
    assert "Where it does not pay: below the break-even length" in printed
    assert results["run"]["repair"]["fraction"] == 0.2 and results["run"]["guard"]["probe"]["name"]
    assert plot.stat().st_size > 10_000


def _fit_args(tmp_path, out, *extra):
    return ["fit", "--source", str(tmp_path / "src"), "--target", str(tmp_path / "tgt"), "--data",
            str(tmp_path / "data.txt"), "--top-k", "1", "--seq-len", "16", "--max-sequences", "4",
            "--batch-size", "4", "--stride", "2", "--out", str(out), "--no-progress", *extra]  # fmt: skip


def test_cli_fit_refuses_a_folder_that_is_not_a_mapper_of_the_same_pair(tiny, tmp_path):
    import hashlib

    _cli_pair(tiny, tmp_path)
    weights = tmp_path / "src" / "model.safetensors"
    before = hashlib.sha256(weights.read_bytes()).hexdigest()
    with pytest.raises(SystemExit, match="not a mapper of .*--overwrite"):
        cli_main(_fit_args(tmp_path, tmp_path / "src"))
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == before  # the source model is untouched
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == sorted(p.name for p in (tmp_path / "tgt").iterdir())

    # a mapper of the same pair is refitted in place; one of another pair only with --overwrite
    out = tmp_path / "mapper"
    assert cli_main(_fit_args(tmp_path, out)) == 0
    assert cli_main(_fit_args(tmp_path, out, "--ridge-lambda", "0.5")) == 0
    assert MapperModel.from_pretrained(out).config.ridge_lambda == 0.5
    other = MapperModel.from_pretrained(out)
    other.config.source_model_id = "org/another-source"
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(SystemExit, match="mapper of org/another-source"):
        cli_main(_fit_args(tmp_path, tmp_path / "other"))
    assert cli_main(_fit_args(tmp_path, tmp_path / "other", "--overwrite")) == 0
    assert MapperModel.from_pretrained(tmp_path / "other").config.source_model_id == str(tmp_path / "src")


def test_cli_fit_never_carries_results_of_another_artifact_into_its_card(tiny, tmp_path):
    _cli_pair(tiny, tmp_path)
    out = tmp_path / "mapper"
    assert cli_main(_fit_args(tmp_path, out)) == 0
    stale = {"tasks": {"recall": {"source": 0.1, "target": 0.9, "mapped": 0.8, "chance": 0.0, "n_items": 50}},
             "run": {"mapper_content_hash": "sha256:" + "0" * 64}}  # fmt: skip
    (out / "evaluation.json").write_text(json.dumps(stale))
    assert cli_main(_fit_args(tmp_path, out, "--ridge-lambda", "0.3")) == 0
    assert not (out / "evaluation.json").exists()
    assert "## Retention" not in (out / "README.md").read_text()


def test_cli_fit_reports_every_bad_data_line_and_missing_model_files_before_any_model_runs(tiny, tmp_path):
    _cli_pair(tiny, tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join([json.dumps({"text": "w1 w2"}), "[1, 2]", "{oops", json.dumps({"text": 3}),
                               json.dumps({"txt": "w1"}), json.dumps({"text": ""})]) + "\n")  # fmt: skip
    args = ["fit", "--source", str(tmp_path / "src"), "--target", str(tmp_path / "tgt"), "--data", str(data),
            "--out", str(tmp_path / "out"), "--no-progress"]  # fmt: skip
    with pytest.raises(SystemExit) as err:
        cli_main(args)
    message = str(err.value)
    for number, fragment in ((2, "a list, expected an object"), (3, "not valid JSON"), (4, "text must be a string"),
                             (5, "has no 'text' field"), (6, "text is empty")):  # fmt: skip
        assert f"{data}:{number}: {fragment}" in message, message
    assert not (tmp_path / "out").exists()

    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    with pytest.raises(SystemExit, match="no tokenizer files"):
        cli_main(["fit", "--source", str(tmp_path / "bare"), *_fit_args(tmp_path, tmp_path / "out")[3:]])
    (tmp_path / "noconfig").mkdir()
    with pytest.raises(SystemExit, match="no config.json"):
        cli_main(["fit", "--source", str(tmp_path / "src"), "--target", str(tmp_path / "noconfig"),
                  *_fit_args(tmp_path, tmp_path / "out")[5:]])  # fmt: skip


def test_cli_fit_records_the_top_k_it_used(tiny, tmp_path):
    _cli_pair(tiny, tmp_path)
    out = tmp_path / "mapper"
    args = _fit_args(tmp_path, out)
    args[args.index("--top-k") + 1] = "8"  # the source has 2 layers
    assert cli_main(args) == 0
    mapper = MapperModel.from_pretrained(out)
    assert mapper.config.calibration["top_k"] == 2 and all(len(s) == 2 for s in mapper.config.source_layers)
    card = (out / "README.md").read_text()
    assert "| source layers per target layer (k) | 2 |" in card and "| calibration top_k | 2 |" in card


def test_demo_drops_the_tasks_the_target_does_not_do_and_says_why():
    """No dead rows: a task the target alone does not do better than chance leaves the table (its scores and the
    reason kept under `dropped_tasks`, one printed line naming it); a task it does keeps its retention."""
    from hf_kvmap.commands.demo import drop_unmeasurable_tasks, format_table

    row = {"source": 0.005, "target": 0.005, "mapped": 0.005, "chance": 0.0, "n_items": 200}
    results = {
        "tasks": {
            "arithmetic": {**row, "retention": None, "retention_measurable": False, "target_vs_chance_p": 0.633},
            "recall": {
                **row,
                "target": 0.99,
                "mapped": 0.845,
                "retention": 0.854,
                "floor_normalized_retention": 0.854,
                "retention_measurable": True,
            },
        }
    }
    drop_unmeasurable_tasks(results)
    assert list(results["tasks"]) == ["recall"] and list(results["dropped_tasks"]) == ["arithmetic"]
    lines = format_table(results).splitlines()
    assert not any(line.startswith("arithmetic") for line in lines)
    recall = next(line for line in lines if line.startswith("recall"))
    assert recall.split()[-2:] == ["0.854", "0.854"]
    assert lines[-1] == (
        "dropped arithmetic: the target alone scores 0.005 against chance 0.00 over 200 items, p = 0.63: not better "
        "than chance, so there is nothing for a handoff to retain"
    )
