"""What makes a mapper artifact trustworthy: content hashes, the tokenizer fingerprint, the compatibility check.

- [`content_hash`]: sha256 over the weights as stored, recorded in the config by `save_pretrained` and checked by
  `from_pretrained` ([`stored_content_hash`] reads a saved folder one tensor at a time).
- [`tokenizer_fingerprint`]: the hash of a tokenizer's vocabulary that a config records.
- [`side_mismatches`] / [`tokenizer_mismatch`]: how models and a tokenizer in hand differ from what a config
  records (`MapperModel.check_compatible`).
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import ExitStack
from pathlib import Path

import torch

from ._compat import model_id, model_revision
from .configuration_mapper import MapperConfig, summarize_model_config
from .geometry import KVGeometry, text_config

EVALUATION_FILE = "evaluation.json"


def content_hash(tensors) -> str:
    """sha256 over every tensor, sorted by name: name, dtype, shape, raw bytes as stored.

    `tensors` is a mapping (e.g. a state dict) or anything with `keys()` and `__getitem__` that loads lazily, so
    a large artifact is hashed one tensor at a time.
    """
    digest = hashlib.sha256()
    for name in sorted(tensors.keys()):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + digest.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of a tokenizer's vocabulary (sorted `(token, id)` pairs, JSON-encoded)."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()


def side_mismatches(config: MapperConfig, side: str, model_config) -> list[str]:
    """How a model config in hand differs from what `config` records for its `side` (`"source"`/`"target"`): model
    type, KV geometry, rope parameters, and the revision and id when both are known."""
    recorded = getattr(config, f"{side}_summary")
    found = summarize_model_config(model_config)
    problems = []
    if found["model_type"] != recorded["model_type"]:
        problems.append(f"{side} model_type: mapper expects {recorded['model_type']}, model is {found['model_type']}")
    expected_geometry, found_geometry = KVGeometry.from_config(recorded), KVGeometry.from_config(found)
    if expected_geometry != found_geometry:
        problems.append(f"{side} geometry: mapper expects {expected_geometry}, model has {found_geometry}")
    if recorded.get("rope_parameters") != found.get("rope_parameters"):
        problems.append(
            f"{side} rope_parameters: mapper expects {recorded.get('rope_parameters')}, "
            f"model has {found.get('rope_parameters')}"
        )
    text = text_config(model_config)
    for what, expected, actual in (
        ("revision", getattr(config, f"{side}_revision"), model_revision(text) or model_revision(model_config)),
        ("id", getattr(config, f"{side}_model_id"), model_id(model_config)),
    ):
        if expected and actual and expected != actual:
            problems.append(f"{side} {what}: mapper expects {expected}, model has {actual}")
    return problems


def _weight_files(pretrained_model_name_or_path, **kwargs) -> list[Path]:
    path = Path(pretrained_model_name_or_path)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(
            snapshot_download(
                str(pretrained_model_name_or_path),
                revision=kwargs.get("revision"),
                cache_dir=kwargs.get("cache_dir"),
                local_files_only=kwargs.get("local_files_only", False),
                token=kwargs.get("token"),
                allow_patterns=["*.safetensors", "*.json"],
            )
        )
    subfolder = kwargs.get("subfolder") or ""
    return sorted((path / subfolder).glob("*.safetensors"))


def stored_content_hash(pretrained_model_name_or_path, **kwargs) -> str:
    """The content hash of the safetensors weights of a saved mapper, read one tensor at a time as stored."""
    from safetensors import safe_open

    with ExitStack() as stack:
        handles = {}
        for file in _weight_files(pretrained_model_name_or_path, **kwargs):
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            handles.update(dict.fromkeys(handle.keys(), handle))

        class _Lazy(dict):
            def __getitem__(self, name):
                return handles[name].get_tensor(name)

        return content_hash(_Lazy(handles))


def tokenizer_mismatch(config: MapperConfig, tokenizer) -> list[str]:
    """A one-line problem when `tokenizer`'s fingerprint differs from the one `config` records (none if unknown)."""
    if tokenizer is None or not config.tokenizer_fingerprint:
        return []
    found = tokenizer_fingerprint(tokenizer)
    if found == config.tokenizer_fingerprint:
        return []
    return [
        f"tokenizer: the mapper was fitted with fingerprint {config.tokenizer_fingerprint}, the tokenizer in hand "
        f"has {found}"
    ]


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes (hex), read in 16 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()
