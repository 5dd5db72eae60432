"""Cache delivery: a mapped (or any dynamic) KV cache saved as one safetensors file with its provenance, and loaded
back with every check that keeps a wrong cache from being served.

The file holds `layers.{i}.keys` / `layers.{i}.values` `(batch, n_kv, seq, head_dim)`, the covered token ids (and
the attention mask, when there is padding), and, in the safetensors metadata, a JSON record: format version, library
version, cache class, the model the cache is meant for (id, revision, geometry), the mapping's provenance
(`MappedCache.mapping_info`), whether the cache is `approximate` (mapped: it is not the model's own prefill), a sha256
of the covered tokens and a content hash over every tensor and the record itself. No pickle is involved.

An approximate cache loads as a `MappedCache` (`approximate = True`) whatever the record says about its class, and
`load_cache(..., exact=True)` (an exact-prefix lookup) refuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from ._compat import model_id, model_revision
from .artifacts import weights_hash
from .atomic import write_file_atomically
from .cache import MappedCache, MappedLayer

FORMAT = "hf-kvmap-cache"
#: 2: the content hash covers the record, and the record says whether the cache is approximate
FORMAT_VERSION = 2
_METADATA_KEY = "hf_kvmap"
#: the record's fields `load_cache` relies on
REQUIRED_FIELDS = ("format", "format_version", "cache_class", "geometry", "approximate", "content_sha256")


def record_hash(tensors, record: dict[str, Any]) -> str:
    """sha256 over the tensors ([`weights_hash`]) and the record without its `content_sha256` (canonical JSON)."""
    fields = {key: value for key, value in record.items() if key != "content_sha256"}
    digest = hashlib.sha256(weights_hash(tensors).encode())
    digest.update(b"|record|" + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    return "sha256:" + digest.hexdigest()


def is_approximate(cache: Cache) -> bool:
    """Whether `cache` is not the model's own prefill: its `approximate` flag, or its `mapping_info`'s (a cache with a
    `mapping_info` and no flag is approximate). Either saying so makes it approximate."""
    info = getattr(cache, "mapping_info", None) or {}
    flag = getattr(cache, "approximate", None)
    recorded = info.get("approximate", True) if info else False
    return bool(recorded or (flag if flag is not None else bool(info)))


def tokens_hash(input_ids: torch.Tensor) -> str:
    """sha256 of `(batch, seq)` token ids (shape and int64 values)."""
    ids = input_ids.detach().to("cpu", torch.int64).contiguous()
    digest = hashlib.sha256(f"{tuple(ids.shape)}|".encode())
    digest.update(ids.numpy().tobytes())
    return "sha256:" + digest.hexdigest()


def _geometry(cache: Cache) -> dict[str, Any]:
    keys = cache.layers[0].keys
    return {
        "num_layers": len(cache.layers),
        "batch": keys.shape[0],
        "num_kv_heads": keys.shape[1],
        "seq_length": keys.shape[2],
        "head_dim": keys.shape[3],
        "dtype": str(keys.dtype).removeprefix("torch."),
    }


def save_cache(
    cache: Cache,
    path: str | os.PathLike,
    *,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    model=None,
    provenance: dict[str, Any] | None = None,
) -> dict[str, Any]:
    r"""
    Save a prefilled cache (a `MappedCache` or any `DynamicCache`) to one safetensors file, atomically (a temporary
    file in the same folder replaces `path` only once it is complete; those a killed save left are removed).
    A mapped cache (`MappedCache`, or a `HandoffSession` cache holding mapped positions) is recorded as
    `approximate`, with its `mapping_info`.

    Args:
        cache (`Cache`): the cache; every layer must be initialized and full-attention.
        path (`str` or `os.PathLike`): the file to write.
        input_ids (`torch.Tensor`, *optional*): the prompt the cache belongs to, `(batch, T)` with `T >= seq`; its first
            `seq` tokens are stored and hashed so `load_cache` can refuse the cache for another prompt. Recommended.
        attention_mask (`torch.Tensor`, *optional*): `(batch, T)` mask of a left-padded prompt.
        model (`PreTrainedModel`, *optional*): the model that reads the cache; its id and revision are recorded. A
            `MappedCache` records its target from `mapping_info` without it.
        provenance (`dict`, *optional*): extra JSON-serializable fields recorded as they are.

    Returns:
        The provenance record written to the file's metadata.
    """
    from safetensors.torch import save_file

    from ._version import __version__

    if not isinstance(cache, Cache) or not cache.layers or not all(layer.is_initialized for layer in cache.layers):
        raise ValueError("save_cache needs a prefilled cache whose every layer holds keys and values.")
    for idx, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            raise ValueError(f"Cache layer {idx} is a sliding-window layer; only full-attention caches are saved.")
    geometry = _geometry(cache)
    seq = geometry["seq_length"]
    tensors: dict[str, torch.Tensor] = {}
    for idx, layer in enumerate(cache.layers):
        tensors[f"layers.{idx}.keys"] = layer.keys.detach().to("cpu").contiguous()
        tensors[f"layers.{idx}.values"] = layer.values.detach().to("cpu").contiguous()
    record: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "cache_class": "MappedCache" if is_approximate(cache) else "DynamicCache",
        "approximate": is_approximate(cache),
        "geometry": geometry,
    }
    mapping_info = dict(getattr(cache, "mapping_info", {}) or {})
    if mapping_info:
        record["mapping_info"] = mapping_info
    if model is not None:
        record["model_id"], record["model_revision"] = model_id(model.config), model_revision(model.config)
    elif mapping_info:
        record["model_id"] = mapping_info.get("target_model_id")
    if input_ids is not None:
        if input_ids.dim() != 2 or input_ids.shape[0] != geometry["batch"] or input_ids.shape[1] < seq:
            raise ValueError(
                f"input_ids has shape {tuple(input_ids.shape)} but the cache covers (batch, seq) = "
                f"{(geometry['batch'], seq)}: pass the prompt the cache was built from."
            )
        tensors["input_ids"] = input_ids[:, :seq].detach().to("cpu", torch.int64).contiguous()
        record["tokens_sha256"] = tokens_hash(tensors["input_ids"])
    if attention_mask is not None:
        tensors["attention_mask"] = attention_mask[:, :seq].detach().to("cpu", torch.int64).contiguous()
    if provenance:
        record["provenance"] = json.loads(json.dumps(provenance))
    record = json.loads(json.dumps(record))  # what the file will hold (tuples as lists)
    record["content_sha256"] = record_hash(tensors, record)
    metadata = {"format": "pt", _METADATA_KEY: json.dumps(record, sort_keys=True)}
    write_file_atomically(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    return record


def read_provenance(path: str | os.PathLike) -> dict[str, Any]:
    """The provenance record of a cache file, without loading its tensors. `ValueError` if it is not one."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (OSError, SafetensorError) as err:
        raise ValueError(f"{path} is not a readable safetensors file ({err}).") from None
    if _METADATA_KEY not in metadata:
        raise ValueError(f"{path} is a safetensors file but not an hf-kvmap cache (no `{_METADATA_KEY}` metadata).")
    try:
        record = json.loads(metadata[_METADATA_KEY])
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise ValueError(
            f"{path}: its `{_METADATA_KEY}` metadata record is not valid JSON: the file was modified or damaged. "
            "Re-create the cache."
        ) from None
    if record.get("format") != FORMAT or not isinstance(record.get("format_version"), int):
        raise ValueError(f"{path} records format {record.get('format')!r}, not {FORMAT!r}: the file was modified.")
    if record["format_version"] > FORMAT_VERSION:
        raise ValueError(
            f"{path} holds format {record.get('format')!r} version {record.get('format_version')}; this hf-kvmap "
            f"reads {FORMAT!r} up to version {FORMAT_VERSION}. Upgrade hf-kvmap."
        )
    if record["format_version"] < FORMAT_VERSION:
        raise ValueError(
            f"{path} was written by an older hf-kvmap (format version {record['format_version']}), whose hash does "
            "not cover its record (the cache class, the model it is for, whether it is approximate). Re-create it "
            "with this version's `save_cache`."
        )
    missing = [name for name in REQUIRED_FIELDS if name not in record]
    if missing:
        raise ValueError(f"{path}: its record lacks {missing}: the file was modified. Re-create the cache.")
    return record


def load_cache(
    path: str | os.PathLike,
    *,
    input_ids: torch.Tensor | None = None,
    model=None,
    device: torch.device | str | None = None,
    verify: bool = True,
    exact: bool = False,
    same_weights: bool = False,
) -> tuple[Cache, dict[str, Any]]:
    r"""
    Load a cache written by [`save_cache`] and check it before it is served.

    Args:
        path (`str` or `os.PathLike`): the file.
        input_ids (`torch.Tensor`, *optional*): the prompt about to be generated from, `(batch, T)`. Its first `seq`
            tokens must be the stored ones, and `T > seq` (a cache covering the whole prompt makes `generate` re-process
            it and return wrong tokens).
        model (`PreTrainedModel`, *optional*): the model about to read the cache: its layer count, KV heads and head
            dim must match, and its id/revision the recorded ones when both are known.
        device (`torch.device` or `str`, *optional*): where to put the tensors (defaults to CPU).
        verify (`bool`, *optional*, defaults to `True`): check the content hash over the tensors and the record
            (refuses a truncated or edited file).
        exact (`bool`, *optional*, defaults to `False`): an exact-prefix lookup: refuse an approximate (mapped) cache.
        same_weights (`bool`, *optional*, defaults to `False`): `model` holds the weights the cache was built for,
            loaded from another location (a local copy: its model id is its path); its id is then not compared.

    Returns:
        `(cache, provenance)`: a `MappedCache` (`approximate = True`, its `mapping_info` restored) for an approximate
        cache, else a `DynamicCache` (`approximate = False`); and the record.
    """
    from safetensors.torch import load_file

    record = read_provenance(path)
    tensors = load_file(str(path), device="cpu")
    if verify:
        found = record_hash(tensors, record)
        if found != record.get("content_sha256"):
            raise ValueError(
                f"{path}: the tensors and record hash to {found} but the file records {record.get('content_sha256')}: "
                "the cache was modified or truncated. Re-create it (or pass verify=False to inspect it)."
            )
    approximate = bool(record["approximate"]) or record["cache_class"] == "MappedCache"
    if exact and approximate:
        raise ValueError(
            f"{path} holds an approximate (mapped) cache, not the model's own prefill: it cannot serve an exact-prefix "
            "lookup. Load it without exact=True to serve it as a mapped cache, or prefill the prompt."
        )
    geometry = record["geometry"]
    seq = geometry["seq_length"]
    if input_ids is not None:
        if "tokens_sha256" not in record:
            raise ValueError(
                f"{path} records no prompt tokens, so it cannot be checked against input_ids; save it with "
                "`save_cache(..., input_ids=...)`."
            )
        if input_ids.dim() != 2 or input_ids.shape[0] != geometry["batch"] or input_ids.shape[1] <= seq:
            raise ValueError(
                f"input_ids has shape {tuple(input_ids.shape)}; the cache covers (batch, seq) = "
                f"{(geometry['batch'], seq)} and needs a prompt of at least seq + 1 tokens (the target must run the "
                "last one itself)."
            )
        if tokens_hash(input_ids[:, :seq]) != record["tokens_sha256"]:
            raise ValueError(
                f"{path} was built for other prompt tokens than the first {seq} of input_ids: serving it would answer "
                "another prompt. Build the cache for this prompt."
            )
    if model is not None:
        from .geometry import KVGeometry

        found = KVGeometry.from_config(model.config)
        expected = (geometry["num_layers"], geometry["num_kv_heads"], geometry["head_dim"])
        if (found.num_layers, found.num_kv_heads, found.head_dim) != expected:
            raise ValueError(
                f"{path} holds a cache of (layers, KV heads, head dim) = {expected}, but the model has "
                f"{(found.num_layers, found.num_kv_heads, found.head_dim)}: it was built for another model."
            )
        for what, recorded, actual in (
            ("id", record.get("model_id"), model_id(model.config)),
            ("revision", record.get("model_revision"), model_revision(model.config)),
        ):
            if what == "id" and same_weights:
                continue
            if recorded and actual and recorded != actual:
                hint = " (a local copy of the same weights: pass same_weights=True)" if what == "id" else ""
                raise ValueError(f"{path} was built for model {what} {recorded}, but the model has {actual}{hint}.")
    device = torch.device(device) if device is not None else torch.device("cpu")
    pairs = [
        (tensors[f"layers.{idx}.keys"].to(device), tensors[f"layers.{idx}.values"].to(device))
        for idx in range(geometry["num_layers"])
    ]
    if approximate:
        layers = [MappedLayer.from_tensors(keys, values) for keys, values in pairs]
        cache: Cache = MappedCache(layers=layers, mapping_info=record.get("mapping_info"))
    else:
        cache = DynamicCache()
        for idx, (keys, values) in enumerate(pairs):
            cache.update(keys, values, idx)
        cache.approximate = False
    return cache, record
