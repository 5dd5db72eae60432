"""A source model's saved cache served to a serving engine as a mapped prefix: what a request names, how much of its
prompt the mapped cache may supply, and the mapped K/V of those positions, token-major as a paged engine writes them.

This is the engine-independent half of the vLLM KV connector (`hf_kvmap.vllm_connector`, docs/vllm.md); it imports
no engine. A request names a file written by [`hf_kvmap.delivery.save_cache`] from the **source** model's own prefill
(`save_cache(cache, path, input_ids=ids, model=source)`: exact, batch 1, no padding, its prompt tokens recorded).
The engine's scheduler asks [`plan_prefix`] (metadata only, no tensor read) how many leading prompt tokens the mapped
cache supplies; its worker calls [`map_prefix`], which loads the file with every check of `load_cache` (content hash,
prompt tokens) and maps it with `MappedCache.from_source` (every check of the mapping), holding back the last token.

The mapped prefix is approximate, so it must never enter an engine's exact prefix cache: with prefix caching on, a
request must carry the cache salt [`cache_salt`] derives from the file's content hash, which keeps its blocks (and
every block after them) apart from the blocks of unsalted, exact requests; [`plan_prefix`] refuses a request without
it. A refusal is not an error: the engine computes the whole prompt itself (exact) and the reason is reported.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: the key of hf-kvmap's entry in a request's `kv_transfer_params`
PARAMS_KEY = "hf_kvmap"
#: the prefix of every cache salt `cache_salt` makes
SALT_PREFIX = "hf-kvmap:"
#: source tokens the engine computes itself (`MappedCache.from_source`'s default: at least the final prompt token)
HOLD_BACK = 1


@dataclass(frozen=True)
class PrefixPlan:
    """Positions `[start, end)` of a prompt that a saved source cache supplies, mapped.

    Args:
        source_cache (`str`): the file (resolved inside the connector's `source_cache_dir`).
        content_sha256 (`str`): the file's content hash when it was planned; the worker refuses another.
        start (`int`), end (`int`): the first position to load (the engine's own prefix-cache hits before it) and the
            end of the mapped prefix (`seq - HOLD_BACK` of the source cache, below the prompt's length).
        mapper (`int`, *optional*, defaults to 0): which of the connector's mappers maps it ([`choose_mapper`]).
    """

    source_cache: str
    content_sha256: str
    start: int
    end: int
    mapper: int = 0

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def cache_salt(record: dict[str, Any]) -> str:
    """The cache salt of a request served from the source cache whose `read_provenance` record is `record`:
    `"hf-kvmap:"` and the file's content hash. One engine maps with one mapper, so one salt names one mapped content."""
    return SALT_PREFIX + str(record["content_sha256"]).removeprefix("sha256:")


def prefix_request(
    source_cache_dir: str | os.PathLike, name: str, prompt_token_ids: Sequence[int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    r"""
    What a request served from a saved source cache carries: its prompt (token ids and the cache salt) and its
    `kv_transfer_params`.

    Args:
        source_cache_dir (`str` or `os.PathLike`): the folder the connector reads (`kv_connector_extra_config`'s
            `source_cache_dir`), as this process sees it.
        name (`str`): the file's name inside it, written by `save_cache` from the source's prefill.
        prompt_token_ids (`Sequence[int]`): the whole prompt; its first tokens are the ones the cache was built from.

    Returns:
        `(prompt, kv_transfer_params)`: `prompt` is `{"prompt_token_ids": [...], "cache_salt": ...}` (a vLLM
        `TokensPrompt`), `kv_transfer_params` is `{"hf_kvmap": {"source_cache": name}}`, to pass as
        `SamplingParams(extra_args={"kv_transfer_params": ...})` (or the request body's `kv_transfer_params`).

    Example:

    ```python
    >>> import tempfile, torch
    >>> from transformers import DynamicCache
    >>> from hf_kvmap.delivery import save_cache
    >>> from hf_kvmap.serving.engine_prefix import prefix_request
    >>> folder, ids = tempfile.mkdtemp(), [1, 5, 6, 7]
    >>> cache = DynamicCache()
    >>> _ = cache.update(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), 0)
    >>> _ = save_cache(cache, f"{folder}/chat.safetensors", input_ids=torch.tensor([ids]))
    >>> prompt, params = prefix_request(folder, "chat.safetensors", ids + [9])
    >>> params, prompt["cache_salt"].startswith("hf-kvmap:")
    ({'hf_kvmap': {'source_cache': 'chat.safetensors'}}, True)
    ```
    """
    from ..delivery import read_provenance

    record = read_provenance(resolve_source_cache(source_cache_dir, name))
    prompt = {"prompt_token_ids": [int(token) for token in prompt_token_ids], "cache_salt": cache_salt(record)}
    return prompt, {PARAMS_KEY: {"source_cache": name}}


def resolve_source_cache(source_cache_dir: str | os.PathLike, name: Any) -> Path:
    """The file `name` names inside `source_cache_dir`. `ValueError` for a name that is not a plain relative path
    inside that folder (a request must not make the engine read any other file) or a file that does not exist."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"source_cache={name!r} must be the name of a file in the connector's source_cache_dir.")
    folder = Path(source_cache_dir).expanduser().resolve()
    path = (folder / name).resolve()
    if Path(name).is_absolute() or folder not in path.parents:
        raise ValueError(f"source_cache={name!r} is not a file inside source_cache_dir {folder}: name a file there.")
    if not path.is_file():
        raise ValueError(f"source_cache={name!r}: no such file in source_cache_dir {folder}.")
    return path


def request_source_cache(kv_transfer_params: dict[str, Any] | None) -> str | None:
    """The source cache a request's `kv_transfer_params` names (`{"hf_kvmap": {"source_cache": name}}`), or `None`
    when it names none (the request is not hf-kvmap's). `ValueError` for a malformed entry."""
    if not kv_transfer_params or PARAMS_KEY not in kv_transfer_params:
        return None
    entry = kv_transfer_params[PARAMS_KEY]
    if not isinstance(entry, dict) or set(entry) != {"source_cache"}:
        raise ValueError(
            f"kv_transfer_params[{PARAMS_KEY!r}]={entry!r} must be {{'source_cache': <file name>}} "
            "(hf_kvmap.serving.engine_prefix.prefix_request builds it)."
        )
    return entry["source_cache"]


def choose_mapper(name: str, record: dict[str, Any], mapper_configs: Sequence) -> int:
    """The index of the one mapper in `mapper_configs` that maps the caches of the model that wrote `record`: its
    source's KV geometry, and its model id and revision where both sides record them. `ValueError` for none or
    several."""
    geometry = record["geometry"]
    found = (geometry["num_layers"], geometry["num_kv_heads"], geometry["head_dim"])
    matches = []
    for index, config in enumerate(mapper_configs):
        expected = config.source_geometry
        if found != (expected.num_layers, expected.num_kv_heads, expected.head_dim):
            continue
        pairs = (
            (record.get("model_id"), config.source_model_id),
            (record.get("model_revision"), config.source_revision),
        )
        if all(not recorded or not mapped or recorded == mapped for recorded, mapped in pairs):
            matches.append(index)
    if len(matches) != 1:
        sources = [(config.source_model_id, config.source_revision) for config in mapper_configs]
        what = "no mapper maps" if not matches else f"{len(matches)} mappers map"
        raise ValueError(
            f"{name} was written by model {record.get('model_id')!r} (revision {record.get('model_revision')!r}, "
            f"(layers, KV heads, head dim) = {found}); {what} its caches (the mappers' sources: {sources})."
        )
    return matches[0]


def plan_prefix(
    source_cache_dir: str | os.PathLike,
    name: Any,
    prompt_token_ids: Sequence[int],
    num_computed_tokens: int,
    mapper_configs: Sequence,
    *,
    salt: str | None,
    prefix_caching: bool,
) -> PrefixPlan:
    r"""
    How many leading prompt tokens the saved source cache `name` supplies, mapped, beyond the engine's own
    `num_computed_tokens`. Reads the file's metadata only; raises `ValueError` naming the reason to refuse it.

    Args:
        source_cache_dir (`str` or `os.PathLike`), name (`str`): the folder the connector reads and the file's name.
        prompt_token_ids (`Sequence[int]`): the request's prompt.
        num_computed_tokens (`int`): prompt tokens the engine already holds (its prefix-cache hits).
        mapper_configs (sequence of [`MapperConfig`]): the connector's mappers; exactly one must map the caches of
            the model that wrote the file ([`choose_mapper`]).
        salt (`str`, *optional*): the request's cache salt.
        prefix_caching (`bool`): whether the engine's prefix cache is on (then the salt must be [`cache_salt`]'s).

    Returns:
        [`PrefixPlan`]; `num_tokens` is 0 when the engine already holds the mapped prefix.
    """
    from ..delivery import read_provenance, tokens_hash

    path = resolve_source_cache(source_cache_dir, name)
    record = read_provenance(path)
    if record["approximate"]:
        raise ValueError(
            f"{name} holds an approximate (mapped) cache; the connector maps a source model's own prefill: save the "
            "source's cache (`save_cache(source_cache, path, input_ids=ids, model=source)`)."
        )
    if record["geometry"]["batch"] != 1:
        raise ValueError(f"{name} holds a batch of {record['geometry']['batch']} prompts; a request reads one.")
    mapper = choose_mapper(name, record, mapper_configs)
    seq = record["geometry"]["seq_length"]
    if "tokens_sha256" not in record:
        raise ValueError(f"{name} records no prompt tokens; save it with `save_cache(..., input_ids=...)`.")
    prompt = list(prompt_token_ids)
    if len(prompt) < seq or tokens_hash(torch.tensor([prompt[:seq]])) != record["tokens_sha256"]:
        raise ValueError(f"{name} was built for other tokens than the first {seq} of this prompt.")
    if prefix_caching and salt != cache_salt(record):
        raise ValueError(
            f"the engine's prefix cache is on and the request's cache_salt is {salt!r}, not {cache_salt(record)!r}: "
            "without it the mapped (approximate) blocks would be cached as the exact prefix of these tokens. Build "
            "the request with `prefix_request`, or run the engine with prefix caching off."
        )
    end = seq - HOLD_BACK
    if end < 1:
        raise ValueError(f"{name} covers {seq} token(s); at least {HOLD_BACK + 1} are needed to map one.")
    return PrefixPlan(str(name), record["content_sha256"], min(int(num_computed_tokens), end), end, mapper)


def map_prefix(
    path: str | os.PathLike,
    plan: PrefixPlan,
    prompt_token_ids: Sequence[int],
    mapper,
    dtype: torch.dtype | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    r"""
    The mapped keys and values of positions `[plan.start, plan.end)`, per target layer, token-major.

    The file is loaded with `load_cache` (content hash verified, prompt tokens compared) and must be the content
    `plan` was made for; it is mapped with `MappedCache.from_source(..., hold_back=1)`, so every check of the mapping
    applies.

    Args:
        path (`str` or `os.PathLike`): the resolved file (`resolve_source_cache`).
        plan ([`PrefixPlan`]): what [`plan_prefix`] planned for this request.
        prompt_token_ids (`Sequence[int]`): the request's prompt.
        mapper ([`MapperModel`]): the connector's mapper.
        dtype (`torch.dtype`, *optional*): of the returned tensors (the engine's model dtype); defaults to the mapped
            cache's.

    Returns:
        One `(keys, values)` pair per target layer, each `(plan.end - plan.start, n_kv_heads, head_dim)`.
    """
    from ..cache import MappedCache
    from ..delivery import load_cache, tokens_hash

    source, record = load_cache(path)
    if record["content_sha256"] != plan.content_sha256:
        raise ValueError(
            f"{plan.source_cache} changed after its request was planned (content {record['content_sha256']}, planned "
            f"{plan.content_sha256}): write a new file instead of replacing one that requests may be reading."
        )
    seq = record["geometry"]["seq_length"]
    tokens = torch.tensor([list(prompt_token_ids)[:seq]])
    if record["approximate"] or seq - HOLD_BACK != plan.end or tokens_hash(tokens) != record.get("tokens_sha256"):
        raise ValueError(f"{plan.source_cache} is not the cache its plan {plan} was made for.")
    with torch.no_grad():
        mapped = MappedCache.from_source(source, mapper, hold_back=HOLD_BACK)
    window = slice(plan.start, plan.end)
    return [
        (
            layer.keys[0, :, window].transpose(0, 1).to(dtype or layer.keys.dtype).contiguous(),
            layer.values[0, :, window].transpose(0, 1).to(dtype or layer.values.dtype).contiguous(),
        )
        for layer in mapped.layers
    ]


def slot_mapping(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """The paged-cache slots of positions `[start, end)` for a request holding `block_ids` (its blocks in order):
    `block_ids[p // block_size] * block_size + p % block_size`."""
    if end > len(block_ids) * block_size:
        raise ValueError(
            f"positions up to {end} need {-(-end // block_size)} blocks; the request holds {len(block_ids)}."
        )
    return [int(block_ids[p // block_size]) * block_size + p % block_size for p in range(start, end)]


__all__ = [
    "HOLD_BACK",
    "PARAMS_KEY",
    "PrefixPlan",
    "cache_salt",
    "choose_mapper",
    "map_prefix",
    "plan_prefix",
    "prefix_request",
    "request_source_cache",
    "resolve_source_cache",
    "slot_mapping",
]
