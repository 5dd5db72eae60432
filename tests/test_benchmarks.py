"""FLOP arithmetic (`hf_kvmap.flops`) against the published numbers (docs/method.md), and the benchmark scripts' CPU paths (fast, no GPU)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_kvmap import MapperConfig, MapperModel
from hf_kvmap.configuration_mapper import summarize_model_config
from hf_kvmap.flops import (
    attention_flops,
    body_parameters,
    flop_bound,
    mapper_parameters,
    prefill_flops,
    ridge_mapper_parameters,
)

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# Public config.json of Qwen/Qwen3-14B and Qwen/Qwen3-32B (the fields that shape compute).
QWEN3_14B = dict(
    model_type="qwen3",
    hidden_size=5120,
    num_hidden_layers=40,
    num_attention_heads=40,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=17408,
    vocab_size=151936,
)
QWEN3_32B = dict(
    model_type="qwen3",
    hidden_size=5120,
    num_hidden_layers=64,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=25600,
    vocab_size=151936,
)


def test_qwen3_body_parameters_match_published_non_embedding_counts():
    # Qwen3 model cards: "Number of Parameters (Non-Embedding)": 13.2B (14B) and 31.2B (32B)
    assert round(body_parameters(QWEN3_14B) / 1e9, 1) == 13.2
    assert round(body_parameters(QWEN3_32B) / 1e9, 1) == 31.2


def test_qwen3_14b_to_32b_mapper_size_matches_paper():
    # docs/method.md ("Size, calibration and fit time"): parameters = 2 * L_t * n_kv_t * (k * n_kv_s * d_s) * d_t; Qwen3 14B->32B at k=8: 1.07 B
    params = ridge_mapper_parameters((40, 8, 128), (64, 8, 128), k=8, bias=False)
    assert params == 2 * 64 * 8 * (8 * 8 * 128) * 128
    assert round(params / 1e9, 2) == 1.07
    assert ridge_mapper_parameters((40, 8, 128), (64, 8, 128), k=8) == params + 2 * 64 * 8 * 128


def test_qwen3_14b_to_32b_bound_is_about_45x_at_32k():
    bound = flop_bound(ridge_mapper_parameters((40, 8, 128), (64, 8, 128), k=8), QWEN3_32B, 32768)
    assert 40 < bound.ratio < 50  # docs/method.md ("The FLOP bound"): "about 45x"
    assert bound.ratio == pytest.approx(45.06, abs=0.05)
    # and the published 25x is then about 55 % of the bound
    assert 25 / bound.ratio == pytest.approx(0.55, abs=0.01)
    # the bound grows with context because attention is quadratic and the mapper linear
    assert flop_bound(bound.mapper_parameters, QWEN3_32B, 8192).ratio < bound.ratio


def test_attention_convention_is_causal_half_of_qk_plus_av():
    # QK^T and AV each cost 2 * T^2 * heads * head_dim unmasked (4 together); causal halves: 2 * T^2 * h * d per layer
    tokens = 1000
    assert attention_flops(QWEN3_32B, tokens) == 64 * 2 * tokens**2 * 64 * 128
    assert prefill_flops(QWEN3_32B, tokens) == 2 * tokens * body_parameters(QWEN3_32B) + attention_flops(
        QWEN3_32B, tokens
    )


def test_body_parameters_match_built_models(arch, tiny):
    from transformers import AutoModelForCausalLM

    config = tiny.SUPPORTED[arch]()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert body_parameters(config) == sum(p.numel() for p in model.get_decoder().layers.parameters())
    assert body_parameters(config.to_dict()) == body_parameters(config)


@pytest.mark.parametrize("kind", ["ridge", "mlp"])
@pytest.mark.parametrize("window,inputs", [(0, "same"), (2, "both")])
def test_mapper_parameters_match_mapper_model(kind, window, inputs, tiny):
    source = tiny.SUPPORTED["qwen3"]()
    from transformers import Qwen3Config

    target = Qwen3Config(**{**source.to_dict(), "num_hidden_layers": 3, "layer_types": None})
    config = MapperConfig(
        source_summary=summarize_model_config(source),
        target_summary=summarize_model_config(target),
        source_layers=[[0], [0, 1], [1]],
        kind=kind,
        mlp_hidden_size=24,
        context_window=window,
        input_kinds=inputs,
    )
    model = MapperModel(config)
    if kind == "ridge" and window == 0:
        assert mapper_parameters(config) == ridge_mapper_parameters((2, 2, 16), (3, 2, 16), config.source_layers)
    assert mapper_parameters(config) == sum(p.numel() for p in model.parameters())
    assert flop_bound(model, target, 10).mapper_flops == 2 * 10 * mapper_parameters(config)


def _load_script(name: str):
    """The benchmark module `benchmarks.<name>` (the repository root is on `sys.path`: `pythonpath` in pyproject)."""
    return importlib.import_module(f"benchmarks.{name}")


def test_live_tensor_bytes_counts_peak_of_new_storages():
    apply = _load_script("speed.apply")
    existing = torch.ones(1000, 1000)  # allocated before: never counted
    with apply.LiveTensorBytes() as mode:
        a = existing * 2  # 4 MB
        view = a.view(-1)  # no allocation
        b = a + 1  # 8 MB live
        del a, view
        a = b.add_(1)  # in place: no allocation
        del b, a
    assert mode.peak == 8_000_000
    assert mode.live == 0


def test_interleaved_medians_rotates_and_stops_on_budget():
    apply = _load_script("speed.apply")
    calls = []
    tasks = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    result = apply.interleaved_medians(tasks, "cpu", repeats=4, warmup=1)
    assert calls[:6] == ["a", "b", "c", "b", "c", "a"]
    assert all(len(result[name]["times_ms"]) == 4 for name in tasks)
    calls.clear()
    result = apply.interleaved_medians(tasks, "cpu", repeats=10, warmup=0, budget_s=0.0, min_repeats=3)
    assert len(result["a"]["times_ms"]) == 3


def test_apply_benchmark_quick_run_writes_json(tmp_path):
    apply = _load_script("speed.apply")
    torch.set_num_threads(1)
    out = tmp_path / "apply.json"
    result = apply.main(
        ["--quick", "--tokens", "16,24", "--random-weights", "--threads", "1", "--out", str(out), "--no-plot"]
    )
    written = json.loads(out.read_text())
    assert written["rows"] and [row["tokens"] for row in written["rows"]] == [16, 24]
    for row in result["rows"]:
        assert row["mapper_ms"] > 0 and row["prefill_ms"] > 0 and row["bound"] > 1
        assert row["fraction_of_bound"] == pytest.approx(row["speedup"] / row["bound"])
        assert row["mapped_cache_bytes"] > 0 and row["mapper_peak_bytes"] >= row["mapped_cache_bytes"]
    assert written["environment"]["torch"] == torch.__version__
    assert written["run"]["target"]["weights"] == "random"


def _run_script(name: str, *args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name.removesuffix('.py')}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=BENCHMARKS.parent,
    )


def test_gpu_shapes_dry_run(tmp_path):
    out = tmp_path / "gpu_shapes.json"
    proc = _run_script("gpu.gpu_shapes", "--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["run"]["dry_run"] is True
    assert {row["direction"] for row in result["rows"]} == {"14b-32b", "32b-14b"}
    assert all(row["mapper_ms"] > 0 and row["bound"] > 1 for row in result["rows"])
    assert "mapper / re-prefill (ms)" in proc.stdout
    # the real shapes written in the script are the public Qwen3 configs used above
    gpu_shapes = _load_script("gpu.gpu_shapes")
    for name, expected in (("14B", QWEN3_14B), ("32B", QWEN3_32B)):
        assert {key: gpu_shapes.QWEN3[name][key] for key in expected} == expected


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = _run_script("gpu.gpu_check", "--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]  # 1 would mean a check failed
    result = json.loads(out.read_text())
    checks = {check["check"]: check["ok"] for check in result["checks"]}
    assert checks["all cpu identity: identity mapper generates the same tokens"]
    assert all(checks.values()), [name for name, ok in checks.items() if not ok]
    assert any(name.startswith("cpu+meta") for name in checks)


def test_mapper_variants_reports_what_the_evaluations_say(tmp_path):
    """The variant comparison copies numbers from each evaluation.json; nothing is computed or typed in."""
    from hf_kvmap import zoo

    shipped = zoo.MAPPERS_DIR / "tiny-s-to-tiny-l" / "evaluation.json"
    evaluation = json.loads(shipped.read_text())
    evaluation["tasks"]["recall"]["mapped"] = 0.1
    other = json.loads(shipped.read_text())
    other["tasks"]["recall"]["mapped"] = 0.5
    other["perplexity"]["text"]["mapped"] = 1.7
    for name, data in (("a", evaluation), ("b", other)):
        shutil.copytree(shipped.parent, tmp_path / name / "tiny-s-to-tiny-l")
        (tmp_path / name / "tiny-s-to-tiny-l" / "evaluation.json").write_text(json.dumps(data))
    script = importlib.import_module("benchmarks.variants.mapper_variants")
    out = tmp_path / "variants.json"
    args = ["--json", str(out), "--keep", str(tmp_path / "k"), "--markdown", str(tmp_path / "table.md")]
    script.main([*args, "--variant", f"a={tmp_path / 'a'}", "--variant", f"b={tmp_path / 'b'}"])
    result = json.loads(out.read_text())
    rows = result["directions"]["tiny-s-to-tiny-l"]
    assert rows["a"]["tasks"]["recall"]["mapped"] == evaluation["tasks"]["recall"]["mapped"]
    assert rows["b"]["tasks"]["recall"]["mapped"] == 0.5 and rows["b"]["perplexity"]["text"]["mapped"] == 1.7
    assert rows["a"]["attention_cosine"] == evaluation["diagnostics_summary"]["mean_attention_cosine"]
    # recall and chat are the tasks the target does; b retains more recall at the same chat score
    choice = result["choice"]["tiny-s-to-tiny-l"]
    assert choice["tasks"] == ["recall", "chat"] and choice["variant"] == "b"
    recall, chat = evaluation["tasks"]["recall"], evaluation["tasks"]["chat"]
    expected = (
        (0.5 - recall["chance"]) / (recall["target"] - recall["chance"]) + chat["floor_normalized_retention"]
    ) / 2
    assert choice["scores"]["b"]["mean_floor_normalized_retention"] == pytest.approx(expected)
    # the mapper beside each evaluation is timed against the target's re-prefill (values depend on the machine)
    timed = script.measure(rows, {"a": tmp_path / "a", "b": tmp_path / "b"}, "tiny-s-to-tiny-l", [24], repeats=1)
    for name in ("a", "b"):
        (latency,), parameters = timed[name]
        assert latency["tokens"] == 24 and latency["speedup"] == latency["prefill_ms"] / latency["mapper_ms"]
        mapper = MapperModel.from_pretrained(tmp_path / name / "tiny-s-to-tiny-l")
        assert parameters == sum(t.numel() for t in mapper.state_dict().values())  # key-norm buffers included
    # a variant slower than re-prefill is never chosen
    slow = {"b": {**rows["b"], "latency": [{"tokens": 24, "speedup": 0.5}]}, "a": rows["a"]}
    assert script.choose(slow)["variant"] == "a" and script.choose(slow)["excluded"] == ["b"]
    table = (tmp_path / "table.md").read_text()
    assert "| **b** (chosen) | 0.500 |" in table
    assert json.loads((tmp_path / "k" / "b" / "tiny-s-to-tiny-l.json").read_text()) == other
    with pytest.raises(SystemExit, match="no <source>-to-<target>/evaluation.json"):
        script.main(["--variant", f"c={tmp_path / 'none'}"])
    # --reuse: the variants of an earlier run join as they were measured (their folders may be gone)
    again = tmp_path / "again.json"
    shutil.rmtree(tmp_path / "a")
    script.main(["--json", str(again), "--variant", f"b={tmp_path / 'b'}", "--reuse", str(out)])
    reused = json.loads(again.read_text())
    assert reused["directions"]["tiny-s-to-tiny-l"]["a"] == rows["a"]
    assert reused["run"]["reused"] == {"tiny-s-to-tiny-l": ["a"]} and reused["choice"] == result["choice"]


def test_cli_benchmark_times_the_shipped_mapper_beside_its_bound(tmp_path):
    from hf_kvmap import zoo
    from hf_kvmap.cli import main
    from hf_kvmap.flops import flop_bound

    out = tmp_path / "bench.json"
    args = ["benchmark", "--source", "tiny-s", "--target", "tiny-l", "--tokens", "16,32", "--repeats", "1"]
    assert main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    mapper = MapperModel.from_pretrained(zoo.mapper_path("tiny-s", "tiny-l"))
    assert result["run"]["mapper_parameters"] == sum(p.numel() for p in mapper.parameters())
    assert [row["tokens"] for row in result["rows"]] == [16, 32]
    for row in result["rows"]:
        assert row["speedup"] == pytest.approx(row["prefill_ms"] / row["mapper_ms"])
        bound = flop_bound(mapper, zoo.load_model("tiny-l").config, row["tokens"] - 1).ratio
        assert row["flop_bound"] == pytest.approx(bound)
        assert row["fraction_of_bound"] == pytest.approx(row["speedup"] / bound)
    with pytest.raises(SystemExit, match="exceeds the models' max_position_embeddings"):
        main(["benchmark", "--source", "tiny-s", "--target", "tiny-l", "--tokens", "4096"])
    with pytest.raises(SystemExit, match="comma-separated integers"):
        main(["benchmark", "--source", "tiny-s", "--target", "tiny-l", "--tokens", "a,b"])


def test_mapper_variants_chooses_on_the_tasks_the_target_beats_chance_on(tmp_path):
    script = importlib.import_module("benchmarks.variants.mapper_variants")

    def row(recall, choice):
        return {
            "tasks": {
                "recall": {"source": 0.9, "target": 0.07, "mapped": recall, "chance": 0.0, "n_items": 200},  # 14/200
                "choice": {"source": 0.5, "target": 0.29, "mapped": choice, "chance": 0.25, "n_items": 200},  # noise
            },
            "perplexity": {"text": {"target": 1.7, "mapped": 1.7}},
            "attention_cosine": 0.9,
        }

    choice = script.choose({"a": row(0.0, 0.29), "b": row(0.035, 0.25)})
    assert choice["tasks"] == ["recall"] and choice["variant"] == "b"
    out = tmp_path / "variants.json"
    out.write_text(json.dumps({"directions": {"x-to-y": {"a": row(0.0, 0.29), "b": row(0.035, 0.25)}}, "choice": {}}))
    assert script.main(["--rechoose", "--json", str(out)])["choice"]["x-to-y"]["variant"] == "b"
    assert json.loads(out.read_text())["choice"]["x-to-y"]["tasks"] == ["recall"]


def test_variant_parameters_at_paper_scale(tmp_path):
    """The parameter counts at Qwen3 14B -> 32B, k=8: the ridge is the paper's, a window on one key map adds exactly
    that map's extra inputs (7 more blocks of 8 x 1024 source features), the target's key norm one head_dim per layer."""
    from hf_kvmap.flops import ridge_mapper_parameters

    script = importlib.import_module("benchmarks.variants.variant_parameters")
    rows = script.main(["--json", str(tmp_path / "p.json")])["variants"]
    ridge = ridge_mapper_parameters((40, 8, 128), (64, 8, 128), k=8)
    assert rows["ridge"]["parameters"] == ridge
    extra_per_map = 7 * (8 * 1024) * 1024
    for count in (1, 4, 8, 16):
        expected = ridge + count * extra_per_map + 64 * 128
        assert rows[f"ridge-l3w3-kn ({count} windowed key maps)"]["parameters"] == expected
    assert rows["ridge-w3"]["parameters"] == ridge + 128 * extra_per_map
    assert json.loads((tmp_path / "p.json").read_text())["variants"]["ridge"]["vs_ridge"] == 1.0


def test_finetune_step_cost_counts_each_objective_from_its_parts(tmp_path):
    """One fine-tune step at Qwen3 14B -> 32B: both objectives pay the same reference forwards and mapper update;
    the attention objective adds per layer four suffix attentions and three output projections, the KL objective a
    suffix forward (LM head included) and its activation-only backward; with cached references only those remain."""
    from hf_kvmap.flops import finetune_step_cost

    params, batch, tokens, prefix = 10**9, 8, 1024, 512
    cost = {o: finetune_step_cost(o, QWEN3_14B, QWEN3_32B, params, batch=batch, tokens=tokens, prefix=prefix)
            for o in ("attention", "kl")}  # fmt: skip
    shared = (
        batch * prefill_flops(QWEN3_14B, prefix) + batch * prefill_flops(QWEN3_32B, tokens) + batch * 6 * 512 * params
    )
    lm_head = 2 * 512 * 5120 * 151936 * batch
    suffix_attention = batch * 64 * 4 * 64 * 128 * (512 * 512 + 512 * 512 // 2)
    projection = batch * 64 * 2 * 512 * 8192 * 5120
    assert cost["attention"]["total_flops"] == shared + 4 * suffix_attention + 3 * projection
    linear = batch * 2 * 512 * body_parameters(QWEN3_32B)
    kl_extra = (linear + suffix_attention + lm_head) + (linear + 2 * suffix_attention + lm_head)
    assert cost["kl"]["total_flops"] == shared + lm_head + kl_extra
    for row in cost.values():
        assert row["total_flops_cached_references"] == row["total_flops"] - (
            batch * prefill_flops(QWEN3_14B, prefix) + row["flops"]["target reference forward"]
        )
        assert row["memory_bytes"]["mapper and Adam state"] == 16 * params
    # the attention objective back-propagates one layer at a time: one layer's suffix queries, outputs, gradients
    # and the sequence's keys and values (float32), where KL keeps every layer's activations
    one_layer = 4 * batch * (3 * 512 * 8192 + 2 * 5120 * 512 + 2 * 1024 * 1024)
    assert cost["attention"]["total_memory_bytes"] == 16 * params + one_layer
    assert cost["kl"]["total_memory_bytes"] - 16 * params > 64 * one_layer
    assert cost["kl"]["total_flops"] > cost["attention"]["total_flops"]
    with pytest.raises(ValueError, match="objective"):
        finetune_step_cost("mse", QWEN3_14B, QWEN3_32B, params, batch=1, tokens=8, prefix=4)
    with pytest.raises(ValueError, match="prefix"):
        finetune_step_cost("kl", QWEN3_14B, QWEN3_32B, params, batch=1, tokens=8, prefix=8)
    script = importlib.import_module("benchmarks.speed.objective_costs")
    result = script.main(["--json", str(tmp_path / "c.json")])
    assert json.loads((tmp_path / "c.json").read_text())["counted"] == json.loads(json.dumps(result["counted"]))


def test_retention_curve_counts_each_design_and_keeps_the_frontier(tmp_path):
    """The curve: a variant's design comes from its name (a fine-tune changes no shape), its parameters are counted
    from that design and must agree with what the comparison recorded, and the frontier keeps exactly the variants
    no other one beats on both retention and size (speed)."""
    script = importlib.import_module("benchmarks.variants.retention_curve")
    assert script.design_of("ridge-l3w3-kn-attn-kl") == ("ridge-lNw3-kn", 3)
    assert script.design_of("ridge-l1w3-kn") == ("ridge-lNw3-kn", 1)
    assert script.design_of("mlp-w3-e40") == ("mlp-w3", None)
    with pytest.raises(SystemExit, match="no design known"):
        script.design_of("lowrank-r16")
    points = [("a", 1.0, 0.2), ("b", 1.0, 0.5), ("c", 2.0, 0.9), ("d", 3.0, 0.8)]
    assert script.frontier(points, larger_is_better=False) == ["b", "c"]
    assert script.frontier(points, larger_is_better=True) == ["c", "d"]

    def row(mapped, parameters=None):
        tasks = {"recall": {"source": 0.1, "target": 0.9, "mapped": mapped, "chance": 0.0, "n_items": 200}}
        return {"tasks": tasks, "perplexity": {}, "run": {"parameters": parameters}, "latency": []}

    source, target = script.tiny_summary("tiny-m"), script.tiny_summary("tiny-l")
    windowed = script.count("ridge-lNw3-kn", 3, source, target, None)
    comparison = {"directions": {"tiny-m-to-tiny-l": {"ridge": row(0.0), "ridge-l3w3-kn-kl": row(0.45, windowed)}}}
    path = tmp_path / "comparison.json"
    path.write_text(json.dumps(comparison))
    result = script.main(["--comparison", str(path), "--json", str(tmp_path / "curve.json")])
    rows = result["directions"]["tiny-m-to-tiny-l"]["variants"]
    assert rows["ridge-l3w3-kn-kl"]["choice_items"] == {"tasks": {"recall": 0.5}, "mean": 0.5}
    # one windowed key map reads the source keys and values at t..t-3: 8x the inputs of that one map
    ridge = rows["ridge"]["parameters_tiny"]
    per_map = (ridge // (2 * target["num_hidden_layers"])) - target["num_key_value_heads"] * target["head_dim"]
    key_norm = target["num_hidden_layers"] * target["head_dim"]
    assert windowed == ridge + 7 * per_map + key_norm
    comparison["directions"]["tiny-m-to-tiny-l"]["ridge-l3w3-kn-kl"] = row(0.45, windowed + 1)
    path.write_text(json.dumps(comparison))
    with pytest.raises(SystemExit, match="recorded"):
        script.main(["--comparison", str(path), "--json", str(tmp_path / "curve.json")])


def test_every_benchmarks_readme_command_parses(monkeypatch):
    """Every `python -m benchmarks.<module> ...` line in benchmarks/README.md is one its module's parser accepts (the
    docs match the entry points); parsing stops before anything runs."""
    import argparse
    import re
    import shlex

    text = (BENCHMARKS / "README.md").read_text().replace("\\\n", " ")
    commands = re.findall(r"^(?:OMP_NUM_THREADS=\d+ )?python -m (benchmarks[.\w]*)(.*)$", text, re.MULTILINE)
    assert {module for module, _ in commands} >= {"benchmarks.speed.apply", "benchmarks.docs", "benchmarks.real"}

    class Parsed(Exception):
        pass

    parse_args = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        parse_args(self, args, namespace)  # SystemExit(2) on a command the parser does not accept
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    for module, args in commands:
        main = importlib.import_module("benchmarks.real.cli" if module == "benchmarks.real" else module).main
        with pytest.raises(Parsed):
            main(shlex.split(args, comments=True))


def test_benchmarks_and_the_lab_are_packages_of_small_modules_on_the_public_api():
    """benchmarks/ and lab/ are packages (every folder has an `__init__.py`), no module edits `sys.path` or exceeds 600
    lines, and none imports a private library module or name (`hf_kvmap._compat`, `_name`), the command line's
    modules (`hf_kvmap.commands`, `hf_kvmap.cli`) or passes a private keyword (`_allocate=`...): they call what a user
    of the library calls (the cache argument's name is `hf_kvmap.cache_kwargs` and `hf_kvmap.output_cache`)."""
    import ast

    lab = BENCHMARKS.parent / "lab"
    paths = sorted(path for root in (BENCHMARKS, lab) for path in root.rglob("*.py") if "results" not in path.parts)
    folders = {path.parent for path in paths}
    assert lab in folders and all((folder / "__init__.py").is_file() for folder in folders), folders
    for path in paths:
        text = path.read_text()
        assert len(text.splitlines()) < 600, path
        assert "sys.path" not in text, path
        for node in ast.walk(ast.parse(text)):
            modules = []
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("hf_kvmap"):
                modules = [node.module]
                assert not any(alias.name.startswith("_") for alias in node.names), (path, node.module)
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names if alias.name.startswith("hf_kvmap")]
            for module in modules:
                parts = module.split(".")
                assert not any(part.startswith("_") for part in parts), (path, module)
                assert not {"commands", "cli"} & set(parts), (path, module)
            if isinstance(node, ast.keyword) and node.arg:
                assert not node.arg.startswith("_"), (path, node.arg)


def _ladder_record(task, risk, changed, seconds):
    """A synthetic record of `hf_kvmap.calibration.ladder_items` with one strategy (`tail`) at fractions 0 and 0.5."""
    return {
        "task": task,
        "tokens": 100,
        "reference": [1],
        "correct_target": True,
        "risks": {"draft_agreement:2": risk},
        "strategies": {"tail": {"name": "tail"}},
        "answers": {"tail": {f: {"changed": c, "correct": not c} for f, c in changed.items()}},
        "seconds": {"prefill": 1.0, "map": 0.1, "probe": {"draft_agreement:2": 0.1}, "repair": {"tail": seconds}},
    }


def _tail_run(tasks: list[str], items: int) -> dict:
    """The `run` block of a guard-ladder result calibrated on `tail` at half the prompt, as the report reads it."""
    return {
        "tasks": tasks,
        "selection": {"items_per_task": items, "seed": 1},
        "report": {"items_per_task": items, "seed": 2},
        "command": "python -m benchmarks.ladder.guard_ladder",
        "family": "tiny",
        "dtype": "float32",
        "probes": ["draft_agreement:2"],
        "strategies": ["tail"],
        "fractions": [0.5],
        "max_changed": 0.0,
    }


def test_guard_ladder_study_replays_the_ladder_and_the_binary_guard_on_the_report_set():
    from benchmarks.ladder.guard_ladder import study

    def records(n):  # risk < 0.3: the mapped cache keeps the answer; < 0.6: half a repair does; above: only prefill
        out = []
        for i in range(n):
            risk = (i + 0.5) / n
            changed = {"0": risk >= 0.3, "0.5": risk >= 0.6}
            out.append(_ladder_record("recall" if i % 2 else "chat", risk, changed, {"0": 0.0, "0.5": 0.4}))
        return out

    result = study(records(20), records(40), max_changed=0.0)
    ladder, binary = result["ladder"], result["binary_guard"]
    assert [r["fraction"] for r in ladder["ladder"]["rungs"]] == [0.0, 0.5]
    assert [r["fraction"] for r in binary["ladder"]["rungs"]] == [0.0]
    for outcome in (ladder["report"], binary["report"]):
        assert outcome["changed_served"] == 0.0  # the planted bounds are recovered exactly
    # the rungs end at the highest selection risks that kept the answer (0.275, 0.575): of the report's 40 risks
    # (i + 0.5) / 40, 11 are served mapped (0.2 of a prefill each), 12 repaired (0.6) and 17 fall back (1.2)
    assert [r["max_risk"] for r in ladder["ladder"]["rungs"]] == [0.275, 0.575]
    assert ladder["report"]["mean_cost"] == pytest.approx((11 * 0.2 + 12 * 0.6 + 17 * 1.2) / 40)
    assert binary["report"]["mean_cost"] == pytest.approx((11 * 0.2 + 29 * 1.2) / 40)
    assert ladder["report_accuracy"]["chat"]["served"] == 1.0
    sweep = {row["max_changed"]: row for row in result["budget_sweep"]}
    assert sweep[0.0]["ladder"]["mean_cost"] == ladder["report"]["mean_cost"]
    assert sweep[0.0]["binary_guard"]["mean_cost"] == binary["report"]["mean_cost"]
    assert (
        sweep[0.1]["ladder"]["mean_cost"] <= sweep[0.0]["ladder"]["mean_cost"]
    )  # here the looser budget serves cheaper
    fixed = {row["fraction"]: row for row in result["fixed_report"]["tail"]}
    assert fixed[0.5]["mean_cost"] == pytest.approx(0.5) and fixed[0.0]["tasks"]["chat"]["changed"] == pytest.approx(
        0.7
    )


def test_guard_ladder_study_adds_the_checked_ladder_where_the_records_hold_margins():
    from benchmarks.ladder.guard_ladder import served_plan, study
    from benchmarks.repair.repair_report import ladder_markdown

    def records(n, margins=True):  # the risk says nothing; half a repair changes every fourth answer, of low margin
        out = []
        for i in range(n):
            changed = {"0": True, "0.5": i % 4 == 0}
            record = _ladder_record("recall" if i % 2 else "chat", 0.5, changed, {"0": 0.0, "0.5": 0.4})
            if margins:
                for outcome in record["answers"]["tail"].values():
                    outcome["margin"] = 0.1 if outcome["changed"] else 0.9
                record["seconds"]["verify"] = {"tail": {"0": 0.01, "0.5": 0.01}}
            out.append(record)
        return out

    result = study(records(40), records(40), max_changed=0.0)
    assert result["ladder"]["ladder"]["rungs"] == []  # no threshold on the risk keeps every answer
    checked = result["ladder_checked"]
    margin = checked["ladder"]["min_margin"]
    assert 0.1 < margin <= 0.9 and [r["fraction"] for r in checked["ladder"]["rungs"]] == [0.5]
    report = checked["report"]
    assert report["changed_served"] == 0.0 and report["checked_fallback"] == 0.25
    # each request: the mapping and the probe (0.2), half a repair (0.4), the check (0.01); a quarter a prefill more
    assert report["mean_cost"] == pytest.approx(0.61 + 0.25)
    assert checked["report_accuracy"]["chat"]["served"] == 1.0  # the requests sent back answer as the target
    from hf_kvmap.serving.ladder import GuardLadder

    plan = served_plan(GuardLadder.from_dict(checked["ladder"]), records(8))
    assert plan == [None, 0.5, 0.5, 0.5, None, 0.5, 0.5, 0.5]
    text = ladder_markdown(
        {"run": _tail_run(["chat", "recall"], 20), "directions": {"a-to-b": {"mapper": "m", **result}}}
    )
    assert "Rows marked *+ check*" in text
    assert f"then the check: answer margin < {margin:g}: prefill" in text
    assert "| ladder + check (the check sent back 25 %) |" in text
    assert "ladder_checked" not in study(records(40, False), records(40, False), max_changed=0.0)


def test_guard_ladder_merges_a_strategy_measured_beside_the_records(tmp_path):
    from benchmarks.ladder.guard_ladder import build_parser, study
    from benchmarks.repair.repair_report import ladder_markdown
    from benchmarks.switch.long_switch_args import parse_strategy, split_rungs
    from lab.ladder_migration import with_side_measurements

    text = "tail,query_overlap:fill=draft_branches,after=24,source_attention"
    assert [parse_strategy(t) for t in split_rungs(build_parser().parse_args(["--strategies", text]).strategies)] == [
        {"name": "tail"},
        {"name": "query_overlap", "fill": "draft_branches", "after": 24},
        {"name": "source_attention"},
    ]
    records = []
    for i in range(8):
        record = _ladder_record("chat", i / 8, {"0": True, "0.5": i % 2 == 0}, {"0": 0.1, "0.5": 0.5})
        record["prompt_sha256"] = f"{i:064x}"
        records.append(record)
    key = "target_attention:last_tokens=16"
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    # the side file of `measure_strategies`: `target_attention` keeps every answer at half the prompt, costing a little more
    side = [
        {
            "prompt_sha256": f"{i:064x}",
            "strategies": {key: {"name": "target_attention", "last_tokens": 16}},
            "answers": {key: {"0.5": {"changed": False, "correct": True}}},
            "seconds": {"repair": {key: {"0.5": 0.6}}, "verify": {key: {"0.5": 0.02}}},
        }
        for i in range(8)
    ]
    (tmp_path / "set.strategies.jsonl").write_text("\n".join(json.dumps(m) for m in side))
    # margins measured beside the records for their own strategy: the added one shares the mapped rung's
    margins = [
        {"prompt_sha256": f"{i:064x}", "margins": {"tail": {"0": 0.25, "0.5": 0.75}}, "verify": {"tail": {"0": 0.01}}}
        for i in range(8)
    ]
    (tmp_path / "set.margins.jsonl").write_text("\n".join(json.dumps(m) for m in margins))
    merged = with_side_measurements(path, None, [], records)
    assert all(set(r["answers"]) == {"tail", key} for r in merged)
    assert merged[0]["answers"][key]["0"] == merged[0]["answers"]["tail"]["0"]  # the shared mapped rung
    assert merged[0]["answers"][key]["0"]["margin"] == 0.25 and merged[0]["seconds"]["verify"][key] == {
        "0": 0.01,
        "0.5": 0.02,
    }
    assert merged[0]["seconds"]["repair"][key] == {"0": 0.1, "0.5": 0.6}
    fixed = study(merged, merged, max_changed=0.0)["fixed_report"]
    assert {row["fraction"]: row["tasks"]["chat"]["changed"] for row in fixed[key]} == {0.0: 1.0, 0.5: 0.0}
    assert {row["fraction"]: row["tasks"]["chat"]["changed"] for row in fixed["tail"]} == {0.0: 1.0, 0.5: 0.5}
    # the last four measured with a yardstick (tail at half: 0.25 s there, 0.5 s in the records): seconds doubled
    for found in side[4:]:
        found["yardstick"] = {"strategy": "tail", "fraction": "0.5", "seconds": 0.25}
        found["mapper"] = "sha256:" + "ab" * 32  # the records of before they named their mapper cannot check it
    (tmp_path / "set.strategies.jsonl").write_text("\n".join(json.dumps(m) for m in side))
    timed = with_side_measurements(path, None, [], records)
    assert [r["seconds"]["repair"][key]["0.5"] for r in timed] == [0.6] * 4 + [1.2] * 4
    result = study(timed[4:], timed[:4], max_changed=0.0)
    assert result["measured_beside"] == {
        key: {
            "selection": {"records": 4, "clock": 2.0, "mappers_unchecked": ["sha256:" + "ab" * 32]},
            "report": {"records": 4, "clock": None, "mappers_unchecked": []},
        }
    }
    text = ladder_markdown({"run": _tail_run(["chat"], 4), "directions": {"a-to-b": {"mapper": "m", **result}}})
    assert "repair strategies `tail`, `target_attention`;" in text
    assert (
        "`target_attention` was measured beside the records later, timed apart from their prefills: 4 selection "
        "records, its seconds put on the records' clock by a yardstick (median factor 2.00), with mapper "
        "`abababababab` (the records do not name theirs); 4 report records of "
        "a-to-b, its seconds taken as timed (measured before yardsticks)."
    ) in text


def test_guard_ladder_reports_the_sources_score_and_the_gap_a_repair_recovers(tmp_path):
    from benchmarks.ladder.guard_ladder import study
    from benchmarks.repair.repair_report import ladder_markdown
    from lab.ladder_migration import with_side_measurements

    def records(n):  # the target right on every item, the source on a quarter; half a repair right on three quarters
        out = []
        for i in range(n):
            record = _ladder_record("chat", 0.5, {"0": True, "0.5": i % 4 == 0}, {"0": 0.0, "0.5": 0.4})
            record["prompt_sha256"] = f"{i:064x}"
            record["answers"]["tail"]["0"]["correct"] = False
            out.append(record)
        return out

    plain = study(records(8), records(8), max_changed=0.0)
    assert "source" not in plain["fixed_report"]["tail"][0]["tasks"]["chat"]  # no source answers, no gap
    # the source's answers, measured after the records, kept beside them and merged when read
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records(8)))
    side = [
        {"prompt_sha256": f"{i:064x}", "source_answer": [1 if i % 4 == 1 else 2], "correct_source": i % 4 == 1}
        for i in range(8)
    ]
    (tmp_path / "set.source.jsonl").write_text("\n".join(json.dumps(m) for m in side))
    merged = with_side_measurements(path, None, [], records(8))
    assert [r["correct_source"] for r in merged] == [i % 4 == 1 for i in range(8)]
    result = study(merged, merged, max_changed=0.0)
    fixed = {row["fraction"]: row["tasks"]["chat"] for row in result["fixed_report"]["tail"]}
    assert fixed[0.5] == {
        "mean_cost": pytest.approx(0.5),
        "changed": 0.25,
        "accuracy": 0.75,
        "target": 1.0,
        "source": 0.25,
    }
    assert result["ladder"]["report_accuracy"]["chat"]["source"] == 0.25
    text = ladder_markdown({"run": _tail_run(["chat"], 8), "directions": {"a-to-b": {"mapper": "m", **result}}})
    assert "right, served / target / source: chat" in text
    # retention 0.75; gap (0.75 - 0.25) / (1 - 0.25); the mapped cache (0 right) is worse than not switching
    assert "| `tail` | chat | 0.00 · -0.33 | 0.75 · 0.67 |" in text
    assert "retention · gap recovered of every fixed repair" in text


def test_guard_ladder_study_with_a_confidence_bound_falls_back_where_the_items_cannot_vouch(tmp_path):
    from benchmarks.ladder.guard_ladder import study
    from benchmarks.repair.repair_report import ladder_markdown

    def records(n):  # as above, but each task's mapped answer changes for every tenth item of low risk too
        out = []
        for i in range(n):
            risk = (i + 0.5) / n
            changed = {"0": risk >= 0.3 or i % 20 in (0, 1), "0.5": risk >= 0.6}
            out.append(_ladder_record("recall" if i % 2 else "chat", risk, changed, {"0": 0.0, "0.5": 0.4}))
        return out

    few = study(records(20), records(40), max_changed=0.05, confidence=0.9)  # 10 items a task vouch for nothing
    assert few["ladder_confident"]["ladder"]["rungs"] == [] and few["binary_guard_confident"]["ladder"]["rungs"] == []
    assert few["ladder_confident"]["report"]["rungs"] == {"fallback": 1.0}
    assert few["ladder_confident"]["ladder"]["calibration"]["budget_per_group"] == {"chat": -1, "recall": -1}
    assert few["ladder"]["ladder"]["rungs"] != []  # on the items alone the same budget serves
    sweep = {row["max_changed"]: row for row in few["budget_sweep"]}
    assert "ladder_confident" not in sweep[0.0] and "ladder_confident" in sweep[0.1]

    many = study(records(200), records(200), max_changed=0.05, confidence=0.9)  # 100 a task: 1 changed, not 5
    point, bound = many["ladder"], many["ladder_confident"]
    assert bound["ladder"]["calibration"]["budget_per_group"] == {"chat": 1, "recall": 1}
    assert point["ladder"]["calibration"]["budget_per_group"] == {"chat": 5, "recall": 5}
    worst = {
        name: max(g["changed_served"] for g in way["selection"]["per_group"].values())
        for name, way in many.items()
        if name in ("ladder", "ladder_confident")
    }
    assert worst["ladder_confident"] <= 0.01 < worst["ladder"] <= 0.05
    assert bound["selection"]["mean_cost"] > point["selection"]["mean_cost"]  # the bound costs

    run = {
        "command": "python -m benchmarks.ladder.guard_ladder --confidence 0.9",
        "family": "tiny",
        "dtype": "float32",
        "probes": ["draft_agreement:2"],
        "strategies": ["tail"],
        "fractions": [0.5],
        "tasks": ["chat", "recall"],
        "selection": {"seed": 1, "items_per_task": 100},
        "report": {"seed": 2, "items_per_task": 100},
        "max_changed": 0.05,
        "confidence": 0.9,
    }
    text = ladder_markdown({"run": run, "directions": {"a-to-b": {"mapper": "m", **many}}})
    assert "| ladder, bound at 0.9 |" in text and "Clopper-Pearson upper bound at 0.9" in text

    # one run's report sets at two lengths (`--report-tokens`): one row per length and calibration
    from benchmarks.ladder.ladder_lengths import markdown as ladder_lengths_markdown

    longer = study(records(200), records(40), max_changed=0.05, confidence=0.9)
    directions = {"a-to-b": {"mapper": "m", **many}, "a-to-b at 4096 tokens": {"mapper": "m", **longer}}
    rows = ladder_lengths_markdown({"run": run, "directions": directions}).splitlines()[2:]
    assert (
        len(rows) == 16
        and rows[12] == rows[14] == ""
        and [row.split(" | ")[4] for row in rows[:6]]
        == [
            "ladder, bound",
            "ladder, bound, maps from its calibration length",
            "binary guard, bound",
            "ladder",
            "binary guard",
            "ladder, bound, budget on lost answers",
        ]
    )
    bound = longer["ladder_confident"]["report"]
    worst = max(g["changed_served"] for g in bound["per_group"].values())
    assert rows[-3].startswith("**a-to-b**: break-even length of the ladder held to the bound: ")
    # the bound's ladder mapping no prompt shorter than its calibration set's shortest (every record here is 100
    # tokens): the same ladder on these report sets; on a shorter report set, the target's prefill at cost 1
    assert many["ladder_confident_gated"]["ladder"]["min_tokens"] == 100
    assert many["ladder_confident_gated"]["report"] == many["ladder_confident"]["report"]
    assert rows[-1] == (
        "**a-to-b**, the same ladder mapping no prompt shorter than its calibration set's shortest (100 tokens; a "
        f"shorter one gets the target's prefill at cost 1): 100: cost {many['ladder_confident']['report']['mean_cost']:.2f}, "
        f"worst task {100 * _worst(many['ladder_confident']['report']):.1f} % changed, 100: cost {bound['mean_cost']:.2f}, "
        f"worst task {100 * worst:.1f} % changed."
    )
    from benchmarks.ladder.ladder_lengths import gated_way
    from hf_kvmap.serving.ladder import GuardLadder

    shorter = [{**record, "tokens": 99} for record in records(40)]
    calibrated = many["ladder_confident"]["ladder"]
    gated = gated_way(GuardLadder.from_dict(calibrated), records(200), shorter)
    assert gated["ladder"]["rungs"] == calibrated["rungs"] and gated["ladder"]["min_tokens"] == 100
    assert gated["report"]["mean_cost"] == 1.0 and gated["report"]["rungs"] == {"short": 1.0}
    assert _worst(gated["report"]) == 0.0

    # the break-even length: interpolated on 1 / mean cost between the lengths on either side of the prefill's cost
    from benchmarks.ladder.ladder_lengths import break_even_lines as ladder_break_even_lines

    def entry(tokens, cost):
        return {
            "tokens": tokens,
            "ladder": {"report": {"mean_cost": cost, "per_group": {"x": {"changed_served": 0.0}}}},
        }

    lines = ladder_break_even_lines(
        {"directions": {"a-to-b at 512 tokens": entry(512, 1.25), "a-to-b": entry(2048, 0.5)}}
    )
    assert lines == [  # 1 / 1.25 = 0.8x at 512, 2x at 2,048: 1x at 512 + 0.2 * 1,536 / 1.2 = 768
        "**a-to-b**: break-even length of the ladder: about 768 tokens; mean cost per length (1 = the prefill): 512: "
        "1.25, 2,048: 0.50."
    ]
    # a length where the ladder serves more changed answers than its budget is named: its saving is not vouched for
    short = {"tokens": 512, "ladder": {"report": {"mean_cost": 0.8, "per_group": {"x": {"changed_served": 0.25}}}}}
    lines = ladder_break_even_lines(
        {"run": {"max_changed": 0.05}, "directions": {"a-to-b at 512 tokens": short, "a-to-b": entry(2048, 0.5)}}
    )
    assert lines[0].endswith(
        "It serves more changed answers than its 5 % budget (worst task) at 512 tokens (25.0 %): no saving is "
        "vouched for there."
    )
    shares = {"mapped": "mapped", "repair:0.5": "recompute 50 %", "fallback": "prefill"}
    rungs = ", ".join(
        f"{label} {100 * bound['rungs'][r]:.0f} %" for r, label in shares.items() if bound["rungs"].get(r)
    )
    assert rows[6] == (
        f"| a-to-b | 100 | 100 | 1.0 | ladder, bound | {rungs} | {100 * worst:.1f} % | - | {bound['mean_cost']:.2f} | "
        f"{100 * bound['net_saving']:.0f} % |"
    )

    # the plot's data: per way, (tokens, mean cost, worst changed) by length; the lost-budget way counts changed ones
    from benchmarks.ladder import guard_ladder, ladder_lengths

    directions["a-to-b at 4096 tokens"]["tokens"] = 4096  # the records' own lengths are all 100
    found = ladder_lengths.per_length({"run": run, "directions": directions})["a-to-b"]
    # records without answer margins: every way but the checked ladders
    assert [name for name, _ in ladder_lengths.WAYS if not name.startswith("ladder_checked")] == list(found)
    assert found["ladder_confident"] == [
        (100, many["ladder_confident"]["report"]["mean_cost"], _worst(many["ladder_confident"]["report"])),
        (4096, bound["mean_cost"], worst),
    ]
    assert found["ladder_lost"][1][2] == _worst(longer["ladder_lost"]["report_changed"])
    ladder_lengths.plot({"run": {**run, "tokens": 2048}, "directions": directions}, str(tmp_path / "lengths.png"))
    assert (tmp_path / "lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labels = guard_ladder.plot({"run": run, "directions": directions}, str(tmp_path / "ladder.png"))
    assert labels[1][-5:] == [
        "binary_guard",
        "ladder",
        "binary_guard (bound at 0.9)",
        "ladder (bound at 0.9)",
        "ladder, budget on lost answers (bound at 0.9)",
    ]


def _worst(outcome: dict) -> float:
    return max(g["changed_served"] for g in outcome["per_group"].values())


def test_a_ladder_with_its_budget_on_lost_answers_serves_a_changed_answer_that_is_right():
    """`lost_only`: an answer counts against the budget only where the target's own is right and the served one is
    wrong. Here the mapped cache changes every answer of risk 0.3-0.6 but keeps it right (the target is wrong there),
    so the lost-answer ladder serves the mapped cache up to risk 0.6 where the changed-answer ladder repairs from 0.3."""
    from benchmarks.ladder.guard_ladder import lost_only, study

    def records(n):
        out = []
        for i in range(n):
            risk = (i + 0.5) / n
            record = _ladder_record("chat" if i % 2 else "recall", risk, {"0": risk >= 0.3, "0.5": risk >= 0.8}, {})
            record["seconds"]["repair"]["tail"] = {"0": 0.0, "0.5": 0.4}
            if 0.3 <= risk < 0.6:  # the target is wrong there, and the mapped cache's other answer is right
                record["correct_target"] = False
                record["answers"]["tail"]["0"]["correct"] = True
            out.append(record)
        return out

    view = lost_only(records(20))
    assert [r["answers"]["tail"]["0"]["changed"] for r in view] == [(i + 0.5) / 20 >= 0.6 for i in range(20)]
    result = study(records(40), records(40), max_changed=0.0)
    changed, lost = result["ladder"], result["ladder_lost"]
    assert [r["max_risk"] for r in changed["ladder"]["rungs"]] == [0.2875, 0.7875]
    assert [r["max_risk"] for r in lost["ladder"]["rungs"]] == [0.5875, 0.7875]
    assert lost["report"]["changed_served"] == 0.0  # no lost answer served
    assert lost["report_changed"]["changed_served"] == pytest.approx(12 / 40)  # risks 0.3-0.6 served changed
    assert lost["report"]["mean_cost"] < changed["report"]["mean_cost"]
    assert lost["report_accuracy"] == {  # every answer served is right: the mapped one where the target is wrong
        "chat": {"served": 1.0, "target": 0.7},
        "recall": {"served": 1.0, "target": 0.7},
    }


def test_ladder_calibration_size_replays_every_draw_and_holds_the_bound(tmp_path):
    from benchmarks.ladder import ladder_calibration_size as size

    def records(n, offset):  # the mapped answer changes above risk 0.5; half a repair never changes one
        out = []
        for i in range(n):
            risk = (i + 0.5) / n
            record = _ladder_record(
                "recall" if i % 2 else "chat", risk, {"0": risk > 0.5, "0.5": False}, {"0": 0.0, "0.5": 0.4}
            )
            out.append({**record, "prompt_sha256": f"{offset}-{i}"})
        return out

    selection, report = records(160, "s"), records(80, "r")
    result = size.study(selection, report, sizes=[10, 80], resamples=5, max_changed=0.05, confidence=0.95)
    few, full = result["sizes"]
    assert (few["calibrations"], full["calibrations"]) == (5, 1)  # the full set is calibrated once
    assert few["budget_per_task_bound"] == -1 and full["budget_per_task_bound"] == 0
    # 10 items a task cannot vouch for 5 %: every request falls back, so nothing changed is served, at the full cost
    assert few["ladder_bound"]["fallback_mean"] == 1.0 and few["ladder_bound"]["over_budget"] == 0.0
    assert few["ladder_bound"]["mean_cost"] == pytest.approx(0.1 + 0.1 + 1.0)
    # 80 items vouch for none changed: the ladder serves the mapped cache below 0.5 and repairs above, never changed
    assert full["ladder_bound"]["fallback_mean"] == 0.0 and full["ladder_bound"]["over_budget"] == 0.0
    assert full["ladder_bound"]["mean_cost"] == pytest.approx(0.2 + 0.5 * 0.4)
    text = size.markdown(
        {
            "run": {
                **dict.fromkeys(("command", "resamples", "max_changed", "confidence"), 0.05),
                "selection_items": {"chat": 80},
                "report_items": 80,
                "report_items_per_task": {"chat": 40},
            },
            **result,
        }
    )
    assert "| 10 (5x) | 0 / none served |" in text and "| 80 (1x) | 4 / 0 |" in text
    shared = tmp_path / "s.jsonl"
    shared.write_text("\n".join(json.dumps(r) for r in selection))
    with pytest.raises(SystemExit, match="also in the selection set"):
        size.main(["--selection", str(shared), "--report", str(shared), "--out", str(tmp_path / "o.json")])


def test_ladder_headroom_sets_a_perfect_probe_beside_the_calibrated_ladders_and_measures_separation(tmp_path):
    from benchmarks.ladder import ladder_headroom as headroom

    # changed answers at the mapped cache (0) and at half a repair (0.5), with the probe's risk
    planted = [({"0": False, "0.5": False}, 0.1), ({"0": True, "0.5": False}, 0.9), ({"0": True, "0.5": True}, 0.8)]
    planted.append(({"0": False, "0.5": True}, 0.2))
    records = [
        {**_ladder_record("chat", risk, changed, {"0": 0.0, "0.5": 0.4}), "prompt_sha256": str(i)}
        for i, (changed, risk) in enumerate(planted)
    ]
    assert headroom.auroc([1.0, 0.5], [0.5, 0.0]) == pytest.approx(0.875)  # a tie counts half
    assert headroom.auroc([1.0], []) is None
    assert headroom.separation(records)["chat"]["draft_agreement:2"] == {"auroc": 1.0, "changed": 2, "kept": 2}
    # which requests half a repair changes: risks 0.8 and 0.2 changed, 0.1 and 0.9 kept: no better than chance
    assert headroom.separation(records, "0.5")["chat"]["draft_agreement:2"] == {"auroc": 0.5, "changed": 2, "kept": 2}

    def many(n, prefix):  # the mapped answer changes above risk 0.5, half a repair never changes one
        return [
            {
                **_ladder_record(
                    "chat" if i % 2 else "recall",
                    (i + 0.5) / n,
                    {"0": (i + 0.5) / n > 0.5, "0.5": False},
                    {"0": 0.0, "0.5": 0.4},
                ),
                "prompt_sha256": f"{prefix}{i}",
            }
            for i in range(n)
        ]

    result = headroom.study(many(200, "s"), {"a": many(80, "r")}, max_changed=0.0, confidence=0.95)
    ways = result["reports"]["a"]
    assert ways["perfect tail"]["worst_changed"] == 0.0
    assert ways["perfect tail"]["mean_cost"] == pytest.approx(0.1 + 0.5 * 0.4)
    # a probe that separates perfectly calibrates to the perfect ladder, at the probe's cost
    assert ways["ladder"]["mean_cost"] == pytest.approx(ways["perfect tail at draft_agreement:2"]["mean_cost"])
    assert ways["ladder"]["worst_changed"] == 0.0
    assert ways["ladder_bound"]["rungs"] == {"fallback": 1.0}  # no number of items vouches for a zero rate
    selection_file, report_file = tmp_path / "s.jsonl", tmp_path / "r.jsonl"
    selection_file.write_text("\n".join(json.dumps(r) for r in many(200, "s")))
    report_file.write_text("\n".join(json.dumps(r) for r in many(80, "s")))
    with pytest.raises(SystemExit, match="shares prompts with the selection set"):
        headroom.main(
            ["--selection", str(selection_file), "--report", f"x={report_file}", "--out", str(tmp_path / "o")]
        )
    report_file.write_text("\n".join(json.dumps(r) for r in many(80, "r")))
    out = tmp_path / "o.json"
    headroom.main(["--selection", str(selection_file), "--report", f"held={report_file}", "--out", str(out)])
    text = headroom.markdown(json.loads(out.read_text()))
    assert "| perfect probe, `tail` repairs, free | 0.300 · 0.0% · 0% |" in text
    assert "| chat | held (20 / 20) | 1.00 |" in text
    held = json.loads(out.read_text())["repair_separation"]
    assert list(held) == ["0.5"] and held["0.5"]["held"]["chat"]["draft_agreement:2"] == {
        "auroc": None,
        "changed": 0,
        "kept": 40,
    }
    assert "whose repair of 50 % changes the answer" in text and "| chat | held (0 / 40) | - |" in text
    # with the answer margins kept beside the records (`guard_ladder --margins`), the check's column: here the margin
    # after half a repair is low exactly where that repair changes the answer
    margins = []
    for record in records:
        answers = record["answers"]["tail"]
        margins.append(
            {
                "prompt_sha256": record["prompt_sha256"],
                "margins": {"tail": {f: 0.1 if a["changed"] else 0.9 for f, a in answers.items()}},
                "verify": {"tail": {"0": 0.01, "0.5": 0.01}},
                "first_agrees": {"tail": {"0": True, "0.5": True}},
            }
        )
    planted_file = tmp_path / "planted.jsonl"
    planted_file.write_text("\n".join(json.dumps(r) for r in records))
    (tmp_path / "planted.margins.jsonl").write_text("\n".join(json.dumps(m) for m in margins))
    from benchmarks.ladder.ladder_calibration_size import read_records

    merged = read_records([str(planted_file)])
    check = headroom.separation(merged, "0.5")["chat"][headroom.CHECK]
    assert check == {"auroc": 1.0, "changed": 2, "kept": 2}  # the probe's was chance (0.5) on these records
    assert headroom.CHECK not in headroom.separation(records, "0.5")["chat"]  # no margins, no column
    assert headroom.CHECK_ANSWER not in headroom.separation(merged, "0.5")["chat"]  # first tokens' margins only
    for record in merged:  # every answer token's margin: a later token tells the changed answers apart
        for outcome in record["answers"]["tail"].values():
            outcome["margins"] = [0.9, 0.05 if outcome["changed"] else 0.8]
    answer = headroom.separation(merged, "0.5")["chat"][headroom.CHECK_ANSWER]
    assert answer == {"auroc": 1.0, "changed": 2, "kept": 2}


def test_switch_targets_reads_each_verdict_off_the_results():
    from benchmarks.switch import switch_targets

    def arm(retention, gap, speedup, fraction):
        return {"retention": retention, "gap_recovered": gap, "speedup": speedup, "fraction": fraction}

    def group(tokens, items, beats, **arms):
        fixed = {"target": arm(1.0, 1.0, 1.0, 1.0), "source": arm(0.5, 0.0, None, None)}
        return {"items": items, "tokens": tokens, "target_beats_source": beats, "arms": {**fixed, **arms}}

    long_switch = {
        "results": {
            "0.5b:1.5b": {
                # met only by the repair that is also fast enough; the better-keeping 40 % rung is over the cap
                "long_chat@2048#1234": group(
                    2000,
                    10,
                    True,
                    **{
                        "a@0.1": arm(0.95, 0.92, 2.0, 0.1),
                        "a@0.2": arm(0.9, 0.9, 3.0, 0.2),
                        "a@0.4": arm(1, 1, 2.6, 0.4),
                    },
                ),
                "long_doc@4096#1234": group(
                    4000, 8, True, **{"a@0.2": {**arm(0.9, 0.5, 4.0, 0.2), "gap_interval": [0.25, 0.75]}}
                ),  # the gap missed (an interval, where the results hold one, beside it)
                "long_doc@2048#4321": group(2000, 6, True, **{"a@0.2": arm(1, 1, 9.0, 0.2)}),  # a selection set
                # a length no target names: in the tables, not in the targets (nor missing from the other direction)
                "long_chat@512#1234": group(500, 24, True, **{"a@0.1": arm(1, 1, 2.0, 0.1)}),
                # HumanEval is judged on the rung the continuations' selection set chose (b@0.3), not its own best
                "continuation@2048#4321": group(
                    2000, 6, True, **{"a@0.2": arm(0.3, 0.2, 3.0, 0.2), "b@0.3": arm(0.4, 0.35, None, 0.3)}
                ),
                "humaneval@0#1234": group(
                    100,
                    19,
                    False,
                    **{"a@0.2": arm(1.0, None, 0.5, 0.2), "b@0.3": {**arm(0.95, None, 0.5, 0.3), "wins_kept": [2, 3]}},
                ),
                "humaneval@2048#1234": group(2100, 164, True, **{"a@0.2": arm(0.95, 0.95, 3.0, 0.2)}),
            }
        }
    }
    assert switch_targets.code_rung(long_switch["results"]["0.5b:1.5b"]) == "b@0.3"
    rows = {row[1].split(",")[0]: row for row in switch_targets.answer_rows(long_switch)}
    assert set(rows) == {
        "long_chat @ 2000 tokens",
        "long_doc @ 4000 tokens",
        "HumanEval bare",
        "HumanEval behind 2048 tokens of code",
    }
    assert rows["long_chat @ 2000 tokens"][2].startswith("`a@0.2`") and rows["long_chat @ 2000 tokens"][3] == "met"
    assert (
        rows["long_doc @ 4000 tokens"][3] == "missed" and "gap 0.50 [0.25, 0.75]," in rows["long_doc @ 4000 tokens"][2]
    )
    assert "retention 0.90, gap" in rows["long_doc @ 4000 tokens"][2]  # no retention interval held: none shown
    assert rows["HumanEval bare"][3] == "not yet: 19 of 164 problems"
    assert rows["HumanEval bare"][2].startswith("`b@0.3` (chosen on the continuations): retention 0.95")
    assert (
        "gap none to recover (target <= source), the target's wins kept 2/3, first token" in rows["HumanEval bare"][2]
    )
    behind = rows["HumanEval behind 2048 tokens of code"]
    assert behind[2:] == ("`b@0.3` (chosen on the continuations) not measured", "not measured")
    long_switch["results"]["1.5b:0.5b"] = {"long_chat@2048#1234": group(2000, 6, False)}
    (reverse,) = switch_targets.reverse_rows(long_switch)
    assert reverse[1] == "long_chat@2048 (6)"
    assert reverse[3] == (
        "reported in part; not measured: continuation@2048, humaneval@0, humaneval@2048, long_doc@2048, long_doc@4096"
    )
    # every group there, but HumanEval behind 2K stopped short of the 164 problems: named, with its count
    long_switch["results"]["1.5b:0.5b"] = {
        name: group(2000, 164 if name.startswith("humaneval@0") else 40 if name.startswith("humaneval") else 6, False)
        for name in long_switch["results"]["0.5b:1.5b"]
    }
    (reverse,) = switch_targets.reverse_rows(long_switch)
    assert reverse[3] == "reported in part; humaneval@2048 on 40 of 164 problems"
    long_switch["results"]["1.5b:0.5b"]["humaneval@2048#1234"]["items"] = 164
    (reverse,) = switch_targets.reverse_rows(long_switch)
    assert reverse[3] == "reported"

    def way(chat, doc, cost):
        groups = {"long_chat": {"changed_served": chat}, "long_doc": {"changed_served": doc}}
        return {"report": {"mean_cost": cost, "per_group": groups}}

    def fixed(cost, accuracy, target, source):
        task = {"mean_cost": cost, "accuracy": accuracy, "target": target, "source": source, "changed": 0.0}
        return {"tail": [{"fraction": 0.2, "tasks": {"long_chat": task}}]}

    ladder = {
        "run": {"tokens": 2048},
        "directions": {
            "a-to-b": {
                "report_items_per_task": 48,
                "ladder_confident": way(0.0, 0.04, 0.69),
                "ladder_checked_confident": way(0.02, 0.08, 0.48),
                "fixed_report": fixed(0.3, 0.95, 1.0, 0.5),
            },
            "a-to-b at 4096 tokens": {
                "report_tokens": 4096,
                "report_items_per_task": 24,
                "ladder_confident": way(0.0, 0.0, 0.64),
            },
        },
    }
    first, at_4k = switch_targets.ladder_rows(ladder)
    assert first[3] == "cost met; changed answers over the budget on the report set"
    assert "with the check: cost 0.48, worst task 8.0 % changed" in first[2]
    assert at_4k[1:] == (
        "24 items a task at 4096 tokens",
        "probe only: cost 0.64, worst task 0.0 % changed",
        "not yet: 24 of 48 items a task",
    )
    ladder["directions"]["a-to-b at 4096 tokens"]["report_items_per_task"] = 48
    assert switch_targets.ladder_rows(ladder)[1][3] == "met"
    del ladder["directions"]["a-to-b at 4096 tokens"]
    assert switch_targets.ladder_rows(ladder)[1][1:] == ("no 4K report set", "-", "not yet measured")
    ladder["directions"]["a-to-b"]["ladder_checked_confident"] = way(0.02, 0.05, 0.48)
    assert switch_targets.ladder_rows(ladder)[0][3] == "met"
    (row,) = switch_targets.fixed_rows(ladder)
    # retention floor-normalized at guessing one of four dogs: (0.95 - 0.25) / (1 - 0.25); gap (0.95 - 0.5) / 0.5
    assert row[2] == "`tail@0.2`: retention 0.93, gap 0.90, cost 0.30" and row[3] == "met"
    ladder["directions"]["a-to-b"]["fixed_report"] = fixed(0.3, 0.3, 0.3, 0.2)  # the target no better than guessing
    (row,) = switch_targets.fixed_rows(ladder)
    assert row[2] == "`tail@0.2`: retention not measurable, gap 1.00, cost 0.30" and row[3] == "missed"


def test_recorded_commands_name_mappers_and_models_where_the_readme_puts_them():
    from benchmarks.repair.repair_report import portable_command, portable_path

    command = (
        "python -m benchmarks.ladder.guard_ladder --mapper /work/runs/real/mappers/0.5b-to-1.5b/ridge-k8 --source "
        "/root/.cache/hf-kvmap/models/qwen2.5-coder-0.5b-instruct --work /tmp/records --tokens 2048"
    )
    assert portable_command(command) == (
        "python -m benchmarks.ladder.guard_ladder --mapper $WORK/mappers/0.5b-to-1.5b/ridge-k8 --source "
        "~/.cache/hf-kvmap/models/qwen2.5-coder-0.5b-instruct --tokens 2048"
    )
    shipped = "/x/hf_kvmap/zoo/mappers/tiny-m-to-tiny-l"
    assert portable_path(shipped) == shipped and portable_path("relative/mappers/a") == "relative/mappers/a"


def test_a_strategy_reads_by_the_options_it_sets_otherwise_than_its_defaults():
    from benchmarks.formatting import strategy_text
    from hf_kvmap.calibration.ladder_items import strategy_key

    assert strategy_text(strategy_key("draft_branches")) == "draft_branches"
    assert (
        strategy_text(strategy_key({"name": "draft_attention", "draft_tokens": 64}))
        == "draft_attention:draft_tokens=64"
    )
    assert strategy_text(strategy_key({"name": "query_overlap", "fill": "draft_branches"})) == (
        "query_overlap:fill=draft_branches"
    )
    nested = {"name": "query_overlap", "fill": {"name": "draft_attention", "draft_tokens": 3}}
    assert strategy_text(strategy_key(nested)) == strategy_text(
        {
            "name": "query_overlap",
            "fill": {"draft_tokens": 3, "last_tokens": 0, "name": "draft_attention", "stop_at_eos": True},
        }
    )
    assert "fill=" in strategy_text(strategy_key(nested))
    skipping = {"name": "query_overlap", "fill": "draft_branches", "skip": [151644, 151645, 151643]}
    assert strategy_text(strategy_key(skipping)) == "query_overlap:fill=draft_branches:skip=3 ids"
    assert strategy_text({"name": "mix"}) == "mix" and strategy_text("unknown:x=1") == "unknown:x=1"


def test_results_name_the_cpu_and_the_kernels_that_computed_them():
    from hf_kvmap.reporting import environment_info

    info = environment_info()
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and info["cpu"]


def test_portable_fit_says_which_settings_refit_one_mapper_and_which_step_differs():
    from benchmarks.speed import portable_fit

    def fit(digest, env, statistics=None, solve=None):
        out = {"env": env, "hash": "sha256:" + digest * 16, "seconds": 12.4}
        out.update({"statistics": statistics} if statistics else {})
        return {**out, **({"solve": solve} if solve else {})}

    fits = {name: fit("ab12", env, "s1", "m1") for name, env in portable_fit.SETTINGS.items()}
    fits["native, AVX2 only"] = fit("cd34", portable_fit.AVX2_ONLY, "s2", "m1")
    fits["portable, one thread"] = fit("ef56", portable_fit.SETTINGS["portable, one thread"], "s1", "m2")
    results = {"run": {"positions": "2 sequences of 256 tokens, top-k 8", "solved": "native"}, "fits": fits}
    assert portable_fit.verdict(fits) == {
        "native": {"mappers": 2, "statistics": 2, "solves": 1},
        "portable": {"mappers": 2, "statistics": 1, "solves": 2},
    }
    page = portable_fit.markdown(results)
    assert "| native | as the machine runs | `s1` | `ab12ab12ab12` | `m1` | 12 |" in page
    assert (
        "| portable | `ATEN_CPU_CAPABILITY=default` `MKL_CBWR=COMPATIBLE` | `s1` | `ab12ab12ab12` | `m1` | 12 |"
        in page
    )
    assert "the statistics of `native` solved again" in page
    assert page.endswith(
        "Native settings: 2 mappers from 2 statistics digests; the shared statistics solved to one mapper. "
        "Portable settings: 2 mappers from one statistics digest; the shared statistics solved to 2 mappers."
    )
    # results of before the statistics were hashed: their parts read "-" and are not counted
    old = {"native": fit("ab12", {}), "portable": fit("cd34", portable_fit.PORTABLE)}
    page = portable_fit.markdown({"run": {"positions": "x"}, "fits": old})
    assert "| native | as the machine runs | - | `ab12ab12ab12` | - | 12 |" in page
    assert page.endswith("Native settings: one mapper. Portable settings: one mapper.")


def test_pair_timing_sums_its_stages_and_refuses_a_used_folder(tmp_path):
    """`benchmarks.speed.pair_timing`: minutes are the stages' seconds summed, a failed stage fails the run and its target,
    and a `--work` folder that holds anything is refused (a resumed calibration would time less than a run from
    nothing)."""
    from benchmarks.speed import pair_timing

    stages = [
        {"stage": "pair", "seconds": 600.0, "returncode": 0, "load_before": 1.0, "load_after": 2.5},
        {"stage": "serve", "seconds": 60.0, "returncode": 0, "load_before": 2.0, "load_after": 1.5},
    ]
    assert pair_timing.summarize(stages) == {
        "minutes": 11.0,
        "succeeded": True,
        "target_minutes": 25.0,
        "within_target": True,
        "max_load": 2.5,
    }
    assert pair_timing.summarize(stages, target_minutes=10.0)["within_target"] is False
    stages[1]["returncode"] = 1
    assert pair_timing.summarize(stages)["within_target"] is False
    (tmp_path / "left-over").write_text("x")
    with pytest.raises(SystemExit, match="not empty"):
        pair_timing.main(["--work", str(tmp_path), "--json", str(tmp_path / "pair.json")])
