"""What makes a mapper artifact trustworthy: content hashes, the tokenizer fingerprint, the compatibility check.

- [`content_hash`]: sha256 over the weights as stored and the config fields that decide the mapping
  (`MAPPING_FIELDS`), recorded in the config by `save_pretrained` and checked by `from_pretrained`
  ([`verify_artifact`]; [`stored_content_hash`] reads a saved folder one tensor at a time, only the files its
  weights index names).
- [`tokenizer_fingerprint`]: the hash of a tokenizer's vocabulary that a config records.
- [`side_mismatches`] / [`tokenizer_mismatch`]: how models and a tokenizer in hand differ from what a config
  records (`MapperModel.check_compatible`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from ._compat import model_id, model_revision
from .configuration_mapper import MapperConfig, summarize_model_config
from .geometry import KVGeometry, text_config

EVALUATION_FILE = "evaluation.json"
#: The files a saved mapper folder consists of (weights, config, card, results, the fit's selection and curves).
MAPPER_FILES = (
    "config.json",
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    "README.md",
    EVALUATION_FILE,
    "selection.json",
    "selection.png",
    "training_curves.png",
)
_SHARD = re.compile(r"^model-\d+-of-\d+\.safetensors$")


#: The config fields that decide what a mapper computes from a cache; the content hash covers them beside the weights.
MAPPING_FIELDS = (
    "kind",
    "source_layers",
    "input_kinds",
    "context_window",
    "mlp_hidden_size",
    "source_summary",
    "target_summary",
)
#: Fields added later, covered only where they differ from these defaults (so the hash of a mapper without them is
#: the one it was saved with). `objective` is `None` in configs written before it and `"mse"` for a fit without a
#: fine-tune: neither is hashed.
OPTIONAL_MAPPING_FIELDS = {
    "layer_inputs": ({},),
    "key_norm": (False,),
    "key_norm_eps": (1e-6,),
    "objective": (None, "mse"),
    "objective_settings": ({},),
}


def _hash_tensors(digest, tensors) -> None:
    for name in sorted(tensors.keys()):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


def weights_hash(tensors) -> str:
    """sha256 over every tensor, sorted by name: name, dtype, shape, raw bytes as stored (what hf-kvmap recorded as
    the content hash before it covered the config; kept to recognize such artifacts)."""
    digest = hashlib.sha256()
    _hash_tensors(digest, tensors)
    return "sha256:" + digest.hexdigest()


def content_hash(tensors, config: MapperConfig) -> str:
    """sha256 over the weights (as [`weights_hash`]) and the config fields that decide the mapping
    (`MAPPING_FIELDS`, canonical JSON): editing either makes a saved mapper fail verification.

    `tensors` is a mapping (e.g. a state dict) or anything with `keys()` and `__getitem__` that loads lazily, so
    a large artifact is hashed one tensor at a time.
    """
    digest = hashlib.sha256()
    _hash_tensors(digest, tensors)
    fields = {name: getattr(config, name) for name in MAPPING_FIELDS}
    for name, defaults in OPTIONAL_MAPPING_FIELDS.items():
        value = getattr(config, name, defaults[0])
        if all(value != default for default in defaults):
            fields[name] = value
    digest.update(b"config|" + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    return "sha256:" + digest.hexdigest()


#: The config fields that decide what is served (the gate and the guard), covered by the serving hash beside the
#: content hash: the calibrated probe and its threshold, the tokenizer fingerprint, the models' ids and revisions.
SERVING_FIELDS = (
    "handoff_probe",
    "handoff_ladder",
    "tokenizer_fingerprint",
    "source_model_id",
    "target_model_id",
    "source_revision",
    "target_revision",
)


def serving_hash(config: MapperConfig) -> str:
    """sha256 over the content hash and the `SERVING_FIELDS` (canonical JSON): editing the probe, its threshold, the
    tokenizer fingerprint or a model id/revision makes a saved mapper fail verification. Kept apart from the content
    hash so that calibrating a probe leaves the results measured on the mapping (which record the content hash)
    its own."""
    fields = {name: getattr(config, name, None) for name in SERVING_FIELDS}
    if fields["handoff_ladder"] is None:  # hashes written before ladders existed stay valid
        del fields["handoff_ladder"]
    digest = hashlib.sha256(f"{config.content_hash}|serving|".encode())
    digest.update(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    return "sha256:" + digest.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of a tokenizer's vocabulary (sorted `(token, id)` pairs, JSON-encoded)."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()


def side_mismatches(config: MapperConfig, side: str, model_config, *, same_weights: bool = False) -> list[str]:
    """How a model config in hand differs from what `config` records for its `side` (`"source"`/`"target"`): model
    type, KV geometry, rope parameters, and the revision and id when both are known (not the id with
    `same_weights=True`: the caller says the model is a copy of those weights loaded from elsewhere)."""
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
    different = bool(problems)  # the type, geometry or rope already show another model
    for what, expected, actual in (
        ("revision", getattr(config, f"{side}_revision"), model_revision(text) or model_revision(model_config)),
        ("id", getattr(config, f"{side}_model_id"), model_id(model_config)),
    ):
        if what == "id" and same_weights:
            continue
        if expected and actual and expected != actual:
            hint = ""
            if what == "id" and not different:  # a model of the same type, geometry and rope may be a copy
                hint = " (a local copy of the same weights: pass same_weights=True)"
            problems.append(f"{side} {what}: mapper expects {expected}, model has {actual}{hint}")
    return problems


def _weight_files(pretrained_model_name_or_path, **kwargs) -> list[Path]:
    """The weight files a saved mapper consists of: those its `model.safetensors.index.json` names, or its
    `model.safetensors` (other `.safetensors` files in the folder are not part of it)."""
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
    folder = path / (kwargs.get("subfolder") or "")
    index = folder / SAFE_WEIGHTS_INDEX_NAME
    if index.exists():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if not (folder / SAFE_WEIGHTS_NAME).exists():
        raise ValueError(
            f"{folder} holds no {SAFE_WEIGHTS_NAME} (nor a {SAFE_WEIGHTS_INDEX_NAME}): not a saved mapper."
        )
    return [folder / SAFE_WEIGHTS_NAME]


class _StoredTensors(dict):
    """The tensors of a saved mapper by name, each read from its file when asked for."""

    def __init__(self, handles):
        super().__init__(handles)

    def __getitem__(self, name):
        return dict.__getitem__(self, name).get_tensor(name)


def stored_content_hash(pretrained_model_name_or_path, config: MapperConfig | None = None, **kwargs) -> str:
    """The content hash of a saved mapper (its weights read one tensor at a time as stored, and `config`'s mapping
    fields); with `config=None`, the [`weights_hash`] of the weights alone."""
    from safetensors import safe_open

    with ExitStack() as stack:
        handles = {}
        for file in _weight_files(pretrained_model_name_or_path, **kwargs):
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            handles.update(dict.fromkeys(handle.keys(), handle))
        tensors = _StoredTensors(handles)
        return weights_hash(tensors) if config is None else content_hash(tensors, config)


def verify_artifact(pretrained_model_name_or_path, config: MapperConfig, **kwargs) -> None:
    """Raise `ValueError` unless the saved weights and `config` hash to the content hash `config` records."""
    where = pretrained_model_name_or_path
    expected = config.content_hash
    if not expected:
        raise ValueError(
            f"{where} records no content hash: its weights and config cannot be checked. Re-save it with "
            "`save_pretrained` (which records one), or pass verify=False to load it unverified."
        )
    actual = stored_content_hash(where, config, **kwargs)
    if actual == expected:
        _verify_serving(where, config)
        return
    if stored_content_hash(where, None, **kwargs) == expected:
        raise ValueError(
            f"{where} records a hash of its weights only (written by an older hf-kvmap), which does not cover the "
            "config fields that decide the mapping. Load it with verify=False and re-save it with "
            "`save_pretrained` to record the full content hash."
        )
    raise ValueError(
        f"The weights and mapping config at {where} hash to {actual}, but the config records {expected}: the "
        "artifact was modified or mixed with another one. Re-download or re-save it (or pass verify=False to load "
        "it anyway for debugging)."
    )


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


def foreign_files(folder: str | os.PathLike) -> list[str]:
    """The names in `folder` that are not part of a saved mapper (`MAPPER_FILES` and weight shards)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name not in MAPPER_FILES and not _SHARD.match(p.name))


def results_hash(results: dict | None) -> str | None:
    """The mapper content hash a results JSON (`hf-kvmap eval`/`demo`) records, if any."""
    return ((results or {}).get("run") or {}).get("mapper_content_hash")


def results_belong_to(results: dict | None, config: MapperConfig, tensors) -> bool | None:
    """Whether `results` were measured on this artifact: `True`/`False` from the content hash they record (the
    weights-only hash older versions recorded counts when the weights match), `None` when they record none."""
    recorded = results_hash(results)
    if recorded is None:
        return None
    return recorded in (config.content_hash, weights_hash(tensors))


def write_folder_atomically(destination: str | os.PathLike, write, *, overwrite: bool = False) -> Path:
    """Call `write(folder)` on a new temporary folder beside `destination`, then swap it in
    (`hf_kvmap.atomic.write_folder_atomically`): a kill at any instant leaves the previous mapper or the complete new
    one at `destination`, and an error in `write` leaves whatever was there as it was.

    A `destination` holding files that are not a mapper's (`foreign_files`) is refused with `ValueError` unless
    `overwrite=True`, which replaces the whole folder. What a killed save left beside `destination` is cleaned
    first (a previous folder it moved aside is put back).
    """
    from .atomic import clean_stale_saves
    from .atomic import write_folder_atomically as swap_in

    destination = Path(destination).resolve()  # "." or a link: swap the folder itself, beside it
    clean_stale_saves(destination)
    if destination.exists() and not destination.is_dir():
        raise ValueError(f"{destination} exists and is not a folder: save the mapper into a folder.")
    foreign = foreign_files(destination)
    if foreign and not overwrite:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise ValueError(
            f"{destination} holds files that are not part of a mapper ({shown}): refusing to replace them. Save "
            "into a new or empty folder (or a mapper's own), or pass overwrite=True to replace the whole folder."
        )
    return swap_in(destination, write)


def _verify_serving(where, config: MapperConfig) -> None:
    recorded = getattr(config, "serving_hash", None)
    if not recorded:
        raise ValueError(
            f"{where} records no serving hash, so the config fields that decide what is served ({', '.join(SERVING_FIELDS)}) "
            "cannot be checked. Load it with verify=False and re-save it with `save_pretrained` (which records one)."
        )
    if serving_hash(config) != recorded:
        raise ValueError(
            f"The serving fields of {where}'s config ({', '.join(SERVING_FIELDS)}) do not hash to the serving hash it "
            "records: they were modified after it was saved (a threshold, the probe, the tokenizer fingerprint or a "
            "model id/revision). Re-download it, or re-save it with `save_pretrained` if the change is yours (or pass "
            "verify=False to load it for debugging)."
        )
