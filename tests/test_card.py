"""Model cards: the approval tuple in the YAML, unknowns left out, idempotent saves, MLP training rows."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml
from huggingface_hub import ModelCard

from hf_kvmap import (
    MapperModel,
)
from hf_kvmap.cli import main as cli_main
from hf_kvmap.plotting import plot_training_curves

pytestmark = pytest.mark.usefixtures("one_thread")


RESULTS = {
    "tasks": {
        "recall": {
            "source": 0.1,
            "target": 0.9,
            "mapped": 0.8,
            "chance": 0.0,
            "retention": 0.8 / 0.9,
            "floor_normalized_retention": 0.8 / 0.9,
            "task_type": "exact_match",
            "n_items": 50,
        },
        "choice": {
            "source": 0.3,
            "target": 0.75,
            "mapped": 0.5,
            "chance": 0.25,
            "retention": 2 / 3,
            "floor_normalized_retention": 0.5,
            "task_type": "choice",
            "n_items": 40,
        },
        "arithmetic": {  # nobody can do it: 1 of 200 items in every mode
            "source": 0.005,
            "target": 0.005,
            "mapped": 0.005,
            "chance": 0.0,
            "retention": 1.0,
            "floor_normalized_retention": 1.0,
            "task_type": "exact_match",
            "n_items": 200,
        },
    },
    "perplexity": {"text": {"source": 2.0, "target": 1.5, "mapped": 1.6}},
    "latency": [{"tokens": 256, "mapper_ms": 1.0, "prefill_ms": 5.0, "speedup": 5.0}],
    "run": {"task_set": "tiny-family", "items_per_task": 10, "seed": 3},
    "environment": {"device": "cpu", "threads": 2, "torch": torch.__version__},
}


def _front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


@pytest.fixture
def mapper(provenance_mapper):
    return provenance_mapper


def test_card_yaml_holds_the_approval_tuple(tmp_path, mapper):
    mapper.save_pretrained(tmp_path, evaluation=RESULTS)
    text = (tmp_path / "README.md").read_text()
    meta = _front_matter(text)
    assert meta["library_name"] == "hf-kvmap"
    assert meta["base_model"] == ["org/small", "org/large"]
    assert "mapper-ridge" in meta["tags"]
    metrics = {
        (r["dataset"]["name"], m["type"]): m["value"] for r in meta["model-index"][0]["results"] for m in r["metrics"]
    }
    assert metrics[("choice", "floor_normalized_retention")] == 0.5
    assert metrics[("recall", "retention")] == pytest.approx(0.8889, abs=1e-4)
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.library_name == "hf-kvmap"
    body = card.text
    for needle in (
        "`org/small` @ `" + "a" * 40,
        "`org/large` @ `" + "b" * 40,
        mapper.config.tokenizer_fingerprint,
        mapper.config.content_hash,
        "| calibration tokens | 1234 |",
        "| choice | choice | 0.300 | 0.750 |",
        "| 256 | 1.00 | 5.00 | 5.00x |",
    ):
        assert needle in body, needle
    assert "More Information Needed" not in text and "None" not in body


def test_card_without_evaluation_omits_unknowns(tiny, tmp_path):
    MapperModel.identity(tiny.SUPPORTED["llama"]()).save_pretrained(tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert "## Retention" not in text and "## Latency" not in text and "revision" not in text.split("## How")[0]
    assert "More Information Needed" not in text and "None" not in text
    assert "model-index" not in _front_matter(text)


def test_save_is_idempotent_and_keeps_its_own_evaluation_only(tmp_path, mapper):
    from hf_kvmap.artifacts import content_hash

    own = {
        **RESULTS,
        "run": {**RESULTS["run"], "mapper_content_hash": content_hash(mapper.state_dict(), mapper.config)},
    }
    mapper.save_pretrained(tmp_path, evaluation=own)
    first = (tmp_path / "README.md").read_text()
    mapper.save_pretrained(tmp_path)  # evaluation.json already there, measured on this mapper: reused
    assert (tmp_path / "README.md").read_text() == first and "## Retention" in first
    assert json.loads((tmp_path / "evaluation.json").read_text())["run"]["seed"] == 3
    # results that record no hash are rendered when given, but not carried into a later save
    mapper.save_pretrained(tmp_path, evaluation=RESULTS)
    assert "## Retention" in (tmp_path / "README.md").read_text()
    mapper.save_pretrained(tmp_path)
    assert "## Retention" not in (tmp_path / "README.md").read_text()
    assert not (tmp_path / "evaluation.json").exists()
    with pytest.raises(ValueError, match="measured on the mapper with content hash sha256:0+"):
        mapper.save_pretrained(tmp_path, evaluation={**RESULTS, "run": {"mapper_content_hash": "sha256:" + "0" * 64}})


def test_push_to_hub_uploads_weights_config_and_generated_card(tmp_path, monkeypatch, mapper):
    uploaded = {}

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            return type("Url", (), {"repo_id": repo_id})()

        def upload_folder(self, repo_id, folder_path, **kwargs):
            for file in sorted(__import__("pathlib").Path(folder_path).iterdir()):
                uploaded[file.name] = file.read_bytes()
            return "ok"

    monkeypatch.setattr("huggingface_hub.HfApi", FakeApi)
    assert mapper.push_to_hub("org/small-to-large", evaluation=RESULTS) == "ok"
    assert sorted(uploaded) == ["README.md", "config.json", "evaluation.json", "model.safetensors"]
    card = uploaded["README.md"].decode()
    assert 'MapperModel.from_pretrained("org/small-to-large"' in card and "## Retention" in card


def test_card_reports_mlp_training_and_curves_are_plotted(tmp_path, fitted):
    mapper, _ = fitted
    mapper.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "tags:\n- hf-kvmap\n- kv-cache\n- mapper-mlp" in card
    assert "| kind | `mlp` (hidden size 32) |" in card
    assert "| ridge lambda (of the ridge the MLP starts from) | 0.01 (absolute) |" in card
    section = card.split("## MLP training", 1)[1].split("\n## ", 1)[0]
    assert "| epochs | 2 |" in section and "| init | ridge |" in section and "| batch_tokens | 64 |" in section
    rows = [line for line in section.splitlines() if line.startswith(("| 0 |", "| 1 |", "| 2 |"))]
    training = mapper.config.calibration["mlp_training"]
    assert len(rows) == 6  # 3 target layers x (key, value)
    for line, (entry, kind) in zip(rows, [(e, k) for e in training["layers"] for k in ("key", "value")]):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        record = entry[kind]
        assert cells[:2] == [str(entry["layer"]), kind]
        assert cells[2] == f"{record['ridge_val_mse']:.3g}" and cells[3] == f"{record['val_mse']:.3g}"
        assert cells[6] == f"{record['best_epoch']} / {record['epochs_run']}"

    pytest.importorskip("matplotlib")
    assert plot_training_curves(mapper.config, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ridge_config = copy.deepcopy(mapper.config)
    ridge_config.calibration = {k: v for k, v in ridge_config.calibration.items() if k != "mlp_training"}
    assert not plot_training_curves(ridge_config, tmp_path / "none.png") and not (tmp_path / "none.png").exists()


def test_card_command_renders_only_results_of_this_mapper(tmp_path, mapper):
    mapper.save_pretrained(tmp_path / "mapper")
    own = {**RESULTS, "run": {**RESULTS["run"], "mapper_content_hash": mapper.config.content_hash}}
    results = tmp_path / "results.json"
    results.write_text(json.dumps(own))
    folder = str(tmp_path / "mapper")
    assert cli_main(["card", folder, "--results", str(results), "--name", "org/small-to-large"]) == 0
    text = (tmp_path / "mapper" / "README.md").read_text()
    assert "## Retention" in text and 'MapperModel.from_pretrained("org/small-to-large"' in text

    for run, fragment in (
        ({"mapper_content_hash": "sha256:" + "1" * 64}, "measured on the mapper with content hash sha256:1+"),
        ({}, "records no mapper content hash"),
    ):
        results.write_text(json.dumps({**RESULTS, "run": run}))
        with pytest.raises(SystemExit, match=fragment):
            cli_main(["card", folder, "--results", str(results)])
        assert (tmp_path / "mapper" / "README.md").read_text() == text


def test_retention_where_the_target_does_not_beat_chance_is_not_measurable(tmp_path, mapper):
    mapper.save_pretrained(tmp_path, evaluation=RESULTS)
    text = (tmp_path / "README.md").read_text()
    assert "| arithmetic | exact_match | 0.005 | 0.005 | 0.005 | 0.00 | not measurable | not measurable |" in text
    results = _front_matter(text)["model-index"][0]["results"]
    assert {r["dataset"]["name"] for r in results} == {"choice", "recall"}  # no arithmetic figure published


def test_card_parameter_count_is_what_the_mapper_holds_key_norm_weights_included():
    from hf_kvmap import zoo
    from hf_kvmap.card import render_card

    mapper = MapperModel.from_pretrained(zoo.mapper_path("tiny-m", "tiny-l"))
    assert mapper.config.key_norm  # the shipped tiny-m -> tiny-l mapper copies the target's key norm
    held = sum(p.numel() for p in mapper.parameters()) + sum(b.numel() for b in mapper.buffers())
    row = f"| parameters (with the target's key-norm weights it copies) | {held:,} |"
    assert row in str(render_card(mapper))
    assert row in str(render_card(mapper.config))  # the same count from the config alone


def test_card_says_whether_a_refit_reproduces_the_mapper(tiny, random_pair, monkeypatch, tmp_path):
    """The fit records the kernels its statistics were gathered and solved with, and the card reads them: portable
    kernels on both vouch for the bytes, native ones say another CPU refits other bytes, unrecorded ones say so."""
    from hf_kvmap import CalibrationStatistics, mapper_from_statistics
    from hf_kvmap.card import refit_reproducibility
    from hf_kvmap.reporting import PORTABLE_KERNELS

    source, target = random_pair
    native = CalibrationStatistics.collect(source, target, tiny.batches(seed=2), stride=2, progress=False)
    capability = torch.backends.cpu.get_cpu_capability()
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    portable = CalibrationStatistics.collect(source, target, tiny.batches(seed=2), stride=2, progress=False)
    fitted = mapper_from_statistics(portable, top_k=2)
    assert fitted.config.calibration["kernel_settings"] == PORTABLE_KERNELS
    assert fitted.config.calibration["solve_kernel_settings"] == PORTABLE_KERNELS
    fitted.save_pretrained(tmp_path / "portable")
    text = (tmp_path / "portable" / "README.md").read_text()
    assert "| a refit on another CPU | the same bytes on other x86 CPUs under the same settings" in text
    assert f"| calibration kernel_settings | {PORTABLE_KERNELS} |" in text

    monkeypatch.delenv("MKL_CBWR")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    solved_natively = mapper_from_statistics(portable, top_k=2)
    assert refit_reproducibility(solved_natively.config) == (
        f"other bytes on another CPU (gathered with {PORTABLE_KERNELS}, solved with cpu {capability}); set "
        "`ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE` for a reproducible refit"
    )
    assert refit_reproducibility(mapper_from_statistics(native, top_k=2).config).startswith(
        f"other bytes on another CPU (gathered with cpu {capability}, solved with cpu {capability})"
    )
    # maps fitted before the fields, and trained maps the benchmark never measured
    assert refit_reproducibility(MapperModel.identity(tiny.SUPPORTED["qwen3"]()).config) == (
        "unknown (the kernel settings were not recorded)"
    )
    trained = copy.deepcopy(fitted.config)
    trained.calibration["kl_finetune"] = {"steps": 1}
    assert refit_reproducibility(trained).startswith("the statistics and ridge are portable; not measured")
