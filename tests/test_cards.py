"""Model cards, content hashes, load-time checks and offline Hub ids: the approval tuple a mapper carries."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from conftest import SUPPORTED, build_model
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file

from hf_kvmap import MapperModel
from hf_kvmap.cli import main as cli_main
from hf_kvmap.fitting import tokenizer_fingerprint
from hf_kvmap.zoo import load_tokenizer

RESULTS = {
    "tasks": {
        "recall": {
            "source": 0.1,
            "target": 0.9,
            "mapped": 0.8,
            "chance": 0.0,
            "retention": 0.8 / 0.9,
            "floor_normalized_retention": 0.8 / 0.9,
            "kind": "exact_match",
        },
        "choice": {
            "source": 0.3,
            "target": 0.75,
            "mapped": 0.5,
            "chance": 0.25,
            "retention": 2 / 3,
            "floor_normalized_retention": 0.5,
            "kind": "choice",
        },
    },
    "perplexity": {"text": {"source": 2.0, "target": 1.5, "mapped": 1.6}},
    "latency": [{"tokens": 256, "mapper_ms": 1.0, "prefill_ms": 5.0, "speedup": 5.0}],
    "run": {"task_set": "tiny-family", "items_per_task": 10, "seed": 3},
    "environment": {"device": "cpu", "threads": 2, "torch": torch.__version__},
}


@pytest.fixture
def mapper():
    config = SUPPORTED["qwen3"]()
    return MapperModel.identity(
        config,
        source_model_id="org/small",
        source_revision="a" * 40,
        target_model_id="org/large",
        target_revision="b" * 40,
        tokenizer_fingerprint=tokenizer_fingerprint(load_tokenizer()),
        calibration={"tokens": 1234, "stride": 4, "fingerprint": "sha256:feed"},
    )


def _front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


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


def test_card_without_evaluation_omits_unknowns(tmp_path):
    MapperModel.identity(SUPPORTED["llama"]()).save_pretrained(tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert "## Retention" not in text and "## Latency" not in text and "revision" not in text.split("## How")[0]
    assert "More Information Needed" not in text and "None" not in text
    assert "model-index" not in _front_matter(text)


def test_save_is_idempotent_and_keeps_evaluation(tmp_path, mapper):
    mapper.save_pretrained(tmp_path, evaluation=RESULTS)
    first = (tmp_path / "README.md").read_text()
    mapper.save_pretrained(tmp_path)  # evaluation.json already there is reused
    assert (tmp_path / "README.md").read_text() == first
    assert json.loads((tmp_path / "evaluation.json").read_text())["run"]["seed"] == 3


def test_card_command_rerenders(tmp_path, mapper):
    mapper.save_pretrained(tmp_path)
    results = tmp_path / "results.json"
    results.write_text(json.dumps(RESULTS))
    assert cli_main(["card", str(tmp_path), "--results", str(results), "--name", "org/small-to-large"]) == 0
    text = (tmp_path / "README.md").read_text()
    assert "## Retention" in text and 'MapperModel.from_pretrained("org/small-to-large"' in text


def test_tampered_weights_are_refused(tmp_path, mapper):
    mapper.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["layers.0.key_proj.bias"][0] += 1.0
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="was modified or mixed"):
        MapperModel.from_pretrained(tmp_path)
    assert MapperModel.from_pretrained(tmp_path, verify=False) is not None


def test_truncated_weights_are_refused(tmp_path, mapper):
    mapper.save_pretrained(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(Exception, match="(?i)safetensors|incomplete|invalid|deserializ|header|truncat|size"):
        MapperModel.from_pretrained(tmp_path)


def test_check_compatible(mapper):
    config = SUPPORTED["qwen3"]()
    model = build_model(config)
    assert mapper.check_compatible(model, model, load_tokenizer()) == []
    other = type(config)(**{**config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 5.0}})
    with pytest.raises(ValueError, match="target rope_parameters: mapper expects .*10000.* model has .*5.0"):
        mapper.check_compatible(model, build_model(other))
    from transformers import PreTrainedTokenizerFast

    wrong = PreTrainedTokenizerFast(tokenizer_object=load_tokenizer().backend_tokenizer)
    wrong.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="tokenizer: the mapper was fitted with fingerprint"):
        mapper.check_compatible(tokenizer=wrong)
    revised = build_model(config)
    revised.config._commit_hash = "c" * 40
    with pytest.raises(ValueError, match="source revision: mapper expects a+, model has c+"):
        mapper.check_compatible(source_model=revised)
    problems = mapper.check_compatible(source_model=revised, allow_mismatch=True)
    assert len(problems) == 1


def test_hub_id_resolves_offline_from_cache(tmp_path, monkeypatch, mapper):
    """A Hub id loads from a cache laid out the way huggingface_hub lays it out, with HF_HUB_OFFLINE=1."""
    import huggingface_hub.constants as hub_constants

    saved = tmp_path / "saved"
    mapper.save_pretrained(saved)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--small-to-large"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in saved.iterdir():
        blob = repo / "blobs" / f"{file.name}.blob"
        blob.parent.mkdir(exist_ok=True)
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(blob)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    loaded = MapperModel.from_pretrained("org/small-to-large", cache_dir=str(tmp_path / "hub"))
    assert loaded.config.content_hash == mapper.config.content_hash
    for a, b in zip(mapper.parameters(), loaded.parameters()):
        assert torch.equal(a, b)


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


def test_shipped_model_cards_have_not_drifted():
    """model_cards/ holds the generated cards of the shipped mappers; regenerating them must give the same text."""
    from pathlib import Path

    from hf_kvmap import zoo
    from hf_kvmap.card import render_card

    cards = Path(__file__).resolve().parents[1] / "model_cards"
    folders = sorted(p for p in zoo.MAPPERS_DIR.iterdir() if p.is_dir())
    assert folders, "no shipped mappers"
    assert sorted(p.stem for p in cards.glob("*.md") if p.name != "README.md") == [p.name for p in folders]
    for folder in folders:
        mapper = MapperModel.from_pretrained(folder)
        evaluation = json.loads((folder / "evaluation.json").read_text())
        rendered = str(render_card(mapper, evaluation, model_name=folder.name))
        assert (folder / "README.md").read_text().strip() == rendered.strip(), folder.name
        assert (cards / f"{folder.name}.md").read_text().strip() == rendered.strip(), folder.name
