"""Artifact integrity: content hashes, truncation, the compatibility check, Hub ids offline."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_kvmap import (
    MapperModel,
)
from hf_kvmap.zoo import load_tokenizer


@pytest.fixture
def mapper(provenance_mapper):
    return provenance_mapper


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


def test_check_compatible(tiny, mapper):
    config = tiny.SUPPORTED["qwen3"]()
    model = tiny.model(config)
    assert mapper.check_compatible(model, model, load_tokenizer()) == []
    other = type(config)(**{**config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 5.0}})
    with pytest.raises(ValueError, match="target rope_parameters: mapper expects .*10000.* model has .*5.0"):
        mapper.check_compatible(model, tiny.model(other))
    from transformers import PreTrainedTokenizerFast

    wrong = PreTrainedTokenizerFast(tokenizer_object=load_tokenizer().backend_tokenizer)
    wrong.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="tokenizer: the mapper was fitted with fingerprint"):
        mapper.check_compatible(tokenizer=wrong)
    revised = tiny.model(config)
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


def _edit_config(folder, edit) -> None:
    import json

    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2))


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c.update(source_layers=[[1], [0]]),  # same shapes, another mapping
        lambda c: c["target_summary"]["rope_parameters"].update(rope_theta=500.0),  # another geometry / rope
        lambda c: c["target_summary"].update(num_key_value_heads=4, head_dim=8),  # same width, other heads
    ],
    ids=["source_layers", "target_rope", "target_geometry"],
)
def test_the_content_hash_covers_the_config_fields_that_decide_the_mapping(tmp_path, mapper, edit):
    mapper.save_pretrained(tmp_path)
    _edit_config(tmp_path, edit)
    with pytest.raises(ValueError, match="was modified or mixed"):
        MapperModel.from_pretrained(tmp_path)


def test_a_missing_content_hash_is_refused_unless_verify_is_false(tmp_path, mapper):
    mapper.save_pretrained(tmp_path)
    _edit_config(tmp_path, lambda c: c.update(content_hash=None))
    with pytest.raises(ValueError, match="records no content hash"):
        MapperModel.from_pretrained(tmp_path)
    assert MapperModel.from_pretrained(tmp_path, verify=False).config.content_hash is None


def test_only_the_files_the_weights_index_names_are_verified(tmp_path, mapper):
    mapper.save_pretrained(tmp_path)
    save_file({"unrelated": torch.zeros(3)}, tmp_path / "notes.safetensors")
    assert MapperModel.from_pretrained(tmp_path).config.content_hash == mapper.config.content_hash
    sharded = tmp_path / "sharded"
    mapper.save_pretrained(sharded, max_shard_size="5KB")
    assert (sharded / "model.safetensors.index.json").exists()
    save_file({"unrelated": torch.zeros(3)}, sharded / "model-extra.safetensors")
    assert MapperModel.from_pretrained(sharded) is not None


def test_a_weights_only_hash_of_an_older_artifact_names_the_fix(tmp_path, mapper):
    from hf_kvmap.artifacts import weights_hash

    mapper.save_pretrained(tmp_path)
    _edit_config(tmp_path, lambda c: c.update(content_hash=weights_hash(mapper.state_dict())))
    with pytest.raises(ValueError, match="hash of its weights only.*save_pretrained"):
        MapperModel.from_pretrained(tmp_path)
