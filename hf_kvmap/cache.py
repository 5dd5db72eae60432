"""`MappedCache`: a `DynamicCache` holding the layers a `MapperModel` computed from another model's cache.

The cache stores; the model computes. `MappedCache.from_source` checks the source cache (layout, geometry, hold-back,
finiteness, positions), calls the mapper's `forward`, and wraps each mapped layer in a `MappedLayer`, which only
follows the dtype and device of the model that reads it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer
from transformers.utils import logging

from ._compat import cache_argument, init_cache_with_layers, model_id, model_revision, unhooked_forward
from .first_layer import target_first_layer
from .input_checks import CACHE_DTYPES, check_mapping_request, check_source_cache
from .modeling_mapper import MapperModel, check_finite_pairs, check_source_tensors
from .rope import positions_from_attention_mask

logger = logging.get_logger(__name__)

SourceCache = Cache | Sequence[tuple[torch.Tensor, torch.Tensor]]


def source_pairs(source_cache: SourceCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-layer `(keys, values)` of a source `Cache` (or of a sequence of pairs); refuses sliding-window layers."""
    if isinstance(source_cache, Cache):
        for idx, layer in enumerate(source_cache.layers):
            if getattr(layer, "is_sliding", False):
                raise ValueError(
                    f"Source cache layer {idx} is a sliding-window layer ({type(layer).__name__}); "
                    "only full-attention caches can be mapped."
                )
        return [(layer.keys, layer.values) for layer in source_cache.layers]
    if source_cache is None:
        raise ValueError(
            "source_cache is None: pass the cache the source model returned, "
            f"`source(ids, use_cache=True).{cache_argument()}`."
        )
    if isinstance(source_cache, (str, bytes, torch.Tensor)) or not isinstance(source_cache, Sequence):
        raise ValueError(
            f"source_cache is a {type(source_cache).__name__}; expected a transformers `Cache` or a sequence of "
            "per-layer `(keys, values)` pairs."
        )
    pairs = []
    for idx, pair in enumerate(source_cache):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            what = (
                f"a {type(pair).__name__} of {len(pair)}"
                if isinstance(pair, (tuple, list))
                else "a " + (type(pair).__name__)
            )
            raise ValueError(f"Source cache layer {idx} is {what}; expected a `(keys, values)` pair.")
        pairs.append(tuple(pair))
    return pairs


def _warn_beyond_positions(config, seq: int) -> None:
    limits = [
        summary.get("max_position_embeddings")
        for summary in (config.source_summary, config.target_summary)
        if summary.get("max_position_embeddings")
    ]
    if limits and seq > min(limits):
        logger.warning_once(
            f"The source cache holds {seq} tokens, more than the models' max_position_embeddings ({min(limits)}): "
            "positions beyond it were not trained and the mapping (and the target) may degrade there."
        )


class MappedLayer(DynamicLayer):
    """A `DynamicLayer` whose initial keys/values were produced by a mapper; it then grows like any dynamic layer.

    The model that reads the layer decides its dtype and device: if the first states it appends differ (e.g. a
    float32 source mapped for a bfloat16 target), the mapped tensors are converted to them before concatenation.
    """

    @classmethod
    def from_tensors(cls, keys: torch.Tensor, values: torch.Tensor) -> MappedLayer:
        """A layer holding `keys` and `values` `(batch, n_kv, seq, head_dim)` as they are (no copy)."""
        layer = cls()
        layer.lazy_initialization(keys, values)  # records dtype/device the way DynamicLayer does
        layer.keys, layer.values = keys, values
        return layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.is_initialized and key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(
                f"The mapped cache holds {self.keys.shape[0]} row(s) but the model runs {key_states.shape[0]}: for "
                "beam search (or num_return_sequences) expand it first, `cache.batch_repeat_interleave(num_beams)`."
            )
        if self.is_initialized and (self.keys.dtype, self.keys.device) != (key_states.dtype, key_states.device):
            self.keys = self.keys.to(device=key_states.device, dtype=key_states.dtype)
            self.values = self.values.to(device=value_states.device, dtype=value_states.dtype)
            self.dtype, self.device = key_states.dtype, key_states.device
        return super().update(key_states, value_states, *args, **kwargs)


class MappedCache(DynamicCache):
    r"""
    A [`~transformers.DynamicCache`] built from another model's cache by a [`MapperModel`].

    Build it with [`MappedCache.from_source`] and hand it to the target model as `cache=` (`past_key_values=` on
    transformers 5.23); it then grows like a `DynamicCache`. The cache stores and records; it computes nothing.
    What was done to it is its own state, read through properties: `mapping_info` (the record saved with it: the
    mapper, its revision, the mapped tokens or spans, and what a repair, a refresh or a ladder recomputed),
    `approximate` (whether it is not the target's own prefill) and `recomputed` (the positions the target has
    recomputed). The steps that change it record themselves through its methods: [`record_repair`],
    [`record_recomputed`] and [`record_step`] (`hf_kvmap.repair.apply_repair`, `DecodeRefresh`, the serving ladder).

    Args:
        layers (`list[MappedLayer]`, *optional*):
            The mapped layers, one per target layer. Without them the cache is an empty `DynamicCache`.
        mapping_info (`dict`, *optional*):
            Provenance of the mapping.

    Example:

    ```python
    >>> import torch
    >>> from transformers import Qwen3Config, Qwen3ForCausalLM
    >>> from hf_kvmap import MappedCache, MapperModel
    >>> config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    >>> model = Qwen3ForCausalLM(config).eval()
    >>> ids = torch.randint(0, 64, (1, 12))
    >>> source_cache = model(ids, use_cache=True).cache
    >>> cache = MappedCache.from_source(source_cache, MapperModel.identity(config))
    >>> cache.get_seq_length(), cache.mapping_info["mapped_tokens"]
    (11, 11)
    >>> out = model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
    ```
    """

    def __init__(self, layers: list[MappedLayer] | None = None, mapping_info: dict[str, Any] | None = None):
        if layers is None:
            super().__init__()
        else:
            init_cache_with_layers(self, layers)
        self._info = dict(mapping_info or {})
        self._approximate = bool(self._info.get("approximate", True))
        self._recomputed: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------------ the record
    @property
    def mapping_info(self) -> dict[str, Any]:
        """What was mapped into the cache and done to it since (`save_cache` writes it beside the tensors)."""
        return self._info

    @property
    def approximate(self) -> bool:
        """Whether the cache is not the target's own prefill: `True` until every mapped position was recomputed (a
        repair of all of them) or dropped (a session's fallback); `save_cache` records it, and an approximate cache
        never loads as an exact one."""
        return self._approximate

    @property
    def recomputed(self) -> torch.Tensor | None:
        """`(batch, length)` bool: the positions the target recomputed (a repair, a refresh, or a session's own
        positions around its mapped spans); what a later refresh skips. `None` before any."""
        return self._recomputed

    def record_repair(self, record: dict[str, Any]) -> None:
        """Record a repair (`hf_kvmap.repair.apply_repair`): `mapping_info["repair"]`; the cache is exact once
        `record["exact"]` (every position recomputed), and says so in the object and its record alike."""
        self._info["repair"] = record
        self._set_approximate(not record["exact"])

    def record_recomputed(self, done: torch.Tensor) -> None:
        """The positions the target has recomputed so far, `(batch, length)` bool (it replaces the earlier mask:
        pass their union)."""
        if not isinstance(done, torch.Tensor) or done.dim() != 2 or done.dtype != torch.bool:
            raise TypeError("recomputed positions are a (batch, length) bool tensor.")
        self._recomputed = done

    def record_step(self, name: str, record: dict[str, Any]) -> None:
        """Record what a step that recomputes no mapped position for good did (`"refresh"`: a `DecodeRefresh`'s
        counts and time, `"ladder"`: the rung of every row) as `mapping_info[name]`."""
        if name in ("repair", "approximate", "mapped_positions", "mappers", "mapped_tokens"):
            raise ValueError(f"mapping_info[{name!r}] is kept by the cache itself; record_step records other steps.")
        self._info[name] = record

    def _set_approximate(self, approximate: bool) -> None:
        self._info["approximate"] = self._approximate = bool(approximate)

    @classmethod
    @torch.no_grad()
    def from_source(
        cls,
        source_cache: SourceCache,
        mapper: MapperModel,
        *,
        hold_back: int = 1,
        attention_mask: torch.Tensor | None = None,
        source_position_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        devices: Sequence[torch.device | str] | None = None,
        check_finite: bool = True,
        first_layer: str | None = None,
        target_model=None,
        input_ids: torch.Tensor | None = None,
        repair=None,
        source_model=None,
    ) -> MappedCache:
        r"""
        Map a prefilled source cache into the cache the target model expects.

        The last `hold_back` source tokens are not mapped: the target runs at least the final prompt token itself
        (a cache that covers every prompt token makes `generate` silently re-process the prompt).

        Args:
            source_cache (`Cache` or sequence of `(keys, values)`): the source's cache of the prompt, tensors
                `(batch, n_kv_src, seq, head_dim_src)`; mapper ([`MapperModel`]): fitted for this (source, target).
            hold_back (`int`, *optional*, defaults to 1): final tokens left for the target to run.
            attention_mask (`torch.Tensor`, *optional*): `(batch, seq)` 0/1 mask of a left-padded batch; the target
                reads the cache at the positions `generate` derives from it.
            source_position_ids (`torch.Tensor`, *optional*): `(batch, seq)` positions the source *built* the cache at;
                defaults to a plain forward's `0 .. seq - 1` in every row (pass a generate-style prefill's positions).
            position_ids (`torch.Tensor`, *optional*): `(batch, seq)` positions the target reads at (instead of a
                mask); also the source's unless `source_position_ids` is given.
            dtype (`torch.dtype`, *optional*), devices (sequence, *optional*): of the cache and of each target layer;
                default the source cache's dtype and the device of the mapper layer that produces it.
            check_finite (`bool`, *optional*, defaults to `True`): refuse a source cache holding NaN or inf.
            first_layer (`str`, *optional*, defaults to `"mapped"`): `"mapped"`, every layer the mapper's; or
                `"target"`, the target computes its first layer from the `(batch, seq)` ids instead (exact), which
                needs `target_model` and `input_ids`. (Left out with `target_model` given, it is `"target"`, as before
                it was an option: deprecated, pass it explicitly; the implication goes in 0.2.)
            target_model (`PreTrainedModel`, *optional*), input_ids (`torch.Tensor`, *optional*): the target and the
                prompt's ids, read by `first_layer="target"` and `repair`.
            source_model (`PreTrainedModel`, *optional*): with `input_ids`, the cache's first layer is checked against
                the source's own for those ids (a cache of other tokens or positions raises); repair reads it too.
            repair (`RepairConfig` or `dict`, *optional*): deprecated (goes in 0.2): the cache stores, the target
                recomputes. It is one call, `hf_kvmap.repair.apply_repair(target_model, cache, input_ids, repair,
                attention_mask=, position_ids=, source=source_model, source_cache=, source_position_ids=)` on the
                returned cache: make that call instead (the serving pipeline's `map_and_repair` does).

        Returns:
            `MappedCache` with `seq - hold_back` tokens in every layer. Like any prefilled `DynamicCache`, it is not
            expanded by `generate` for beam search: call `cache.batch_repeat_interleave(num_beams)` first.
        """
        if repair is not None:
            warnings.warn(
                "MappedCache.from_source(repair=) is deprecated and goes in hf-kvmap 0.2: the cache stores, the target "
                "recomputes. Call `hf_kvmap.repair.apply_repair(target, cache, input_ids, repair, source=..., "
                "source_cache=...)` on the cache from_source returns (as the serving pipeline does).",
                DeprecationWarning,
                stacklevel=3,  # the caller of from_source (through torch.no_grad's wrapper)
            )
        first_layer = _first_layer(first_layer, target_model, repair)
        source_kv, position_ids, source_position_ids, repair = _checked_request(
            source_cache,
            mapper,
            dict(hold_back=hold_back, dtype=dtype, attention_mask=attention_mask, position_ids=position_ids),
            dict(source_position_ids=source_position_ids, target_model=target_model, input_ids=input_ids),
            dict(source_model=source_model, repair=repair, check_finite=check_finite),
        )
        length = source_kv[0][0].shape[2] - hold_back
        first = target_model if first_layer == "target" else None
        mapped = _map(mapper, source_kv, length, position_ids, source_position_ids, dtype, devices, first, input_ids)
        info = _provenance(mapper.config, length, hold_back, first_layer)
        cache = cls(layers=[MappedLayer.from_tensors(keys, values) for keys, values in mapped], mapping_info=info)
        if repair is not None:  # deprecated (above): one call of the one door to the recompute
            from .repair import apply_repair  # the upward import tests/test_architecture.py allows until 0.2

            apply_repair(
                target_model,
                cache,
                input_ids,
                repair,
                attention_mask=attention_mask,
                position_ids=position_ids,
                source=source_model,
                source_cache=source_cache,
                source_position_ids=source_position_ids,
            )
        return cache

    @classmethod
    @torch.no_grad()
    def from_source_span(
        cls,
        source_cache: SourceCache,
        mapper: MapperModel,
        start: int,
        end: int,
        *,
        onto: Cache | None = None,
        dtype: torch.dtype | None = None,
        check_finite: bool = True,
        label: str | None = None,
    ) -> MappedCache:
        r"""
        Map positions `[start, end)` of a source cache onto the end of a target cache that holds positions
        `[0, start)` (a conversation's new tokens at a switch of models, `HandoffSession`).

        The mapper reads its widest context window (`config.max_context_window`) of source positions before `start`
        along, so a windowed map sees the same inputs as when it maps the whole prompt; the positions are the source
        cache's own (`0 .. end - 1`, one row). The source positions read are checked as in [`from_source`] (layout,
        geometry, finiteness).

        Args:
            source_cache (`Cache` or sequence of `(keys, values)`): the source's cache, `(1, n_kv_src, seq, head_dim)`
                per layer with `seq >= end`; mapper ([`MapperModel`]): fitted for this (source, target).
            start (`int`), end (`int`): the positions to map, `0 <= start < end <= seq`.
            onto (`Cache`, *optional*): the target's cache of positions `[0, start)` (none for `start = 0`); its
                layers are kept (no copy) and the mapped ones appended, in its dtype and on its devices.
            dtype (`torch.dtype`, *optional*): of the mapped layers where `onto` has none (default the source's).
            check_finite (`bool`, *optional*, defaults to `True`): refuse source positions holding NaN or inf.
            label (`str`, *optional*): what the span is mapped from (a model's name), recorded.

        Returns:
            `MappedCache` of `end` positions. Its `mapping_info` records every span mapped into it so far
            (`mapped_positions`: `[start, end]` pairs, `mappers`: per span `from`, the mapper's `content_hash`, id,
            revision and kind, and the `window` read along), `mapped_tokens` and `approximate` (`False` once no span
            is left, `HandoffSession`'s fallback removes its span with [`drop_last_span`]).
        """
        if not isinstance(mapper, MapperModel):
            raise TypeError(f"mapper is a {type(mapper).__name__}; pass the `MapperModel` fitted for this pair.")
        pairs = check_source_tensors(source_pairs(source_cache), mapper.config)
        batch, _, seq, _ = pairs[0][0].shape
        for name, value in (("start", start), ("end", end)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}={value!r} must be an int (a position of the source cache).")
        if not 0 <= start < end <= seq:
            raise ValueError(
                f"Span [{start}, {end}) must satisfy 0 <= start < end <= {seq} (the positions the source cache holds)."
            )
        if batch != 1:
            raise ValueError(f"A span is mapped for one conversation (batch 1); the source cache holds {batch} rows.")
        covered = 0 if onto is None else onto.get_seq_length()
        if covered != start:
            raise ValueError(
                f"The target cache holds {covered} positions but the span starts at {start}: a span is appended at the "
                f"end of the cache it continues; pass start={covered} (or crop the cache to {start})."
            )
        begin = max(0, start - mapper.config.max_context_window)
        window = [(keys[:, :, begin:end], values[:, :, begin:end]) for keys, values in pairs]
        _warn_beyond_positions(mapper.config, end)
        if check_finite:
            check_finite_pairs(window)
        positions = torch.arange(begin, end, device=window[0][0].device).unsqueeze(0)
        mapped = _map(mapper, window, end - begin, positions, None, None, None, None, None)
        if isinstance(onto, MappedCache):
            cache = onto
        else:  # the model's own cache so far (or none): its tensors, and any record it carries
            cache = cls(layers=_mapped_layers(onto, len(mapped)), mapping_info=getattr(onto, "mapping_info", None))
        for idx, (keys, values) in enumerate(mapped):
            keys, values = keys[:, :, start - begin :], values[:, :, start - begin :]
            layer = cache.layers[idx]
            if layer.is_initialized:
                out_dtype, device = layer.keys.dtype, layer.keys.device
            else:
                out_dtype, device = dtype or keys.dtype, keys.device
            cache.update(keys.to(device, out_dtype), values.to(device, out_dtype), idx)
        info = cache.mapping_info
        info.setdefault("mapped_positions", []).append([start, end])
        config = mapper.config
        span = {"from": label, "content_hash": config.content_hash, "mapper": model_id(config)}
        span.update(mapper_revision=model_revision(config), kind=config.kind, window=start - begin)
        info.setdefault("mappers", []).append(span)
        cache._record_spans()
        return cache

    def drop_last_span(self) -> None:
        """Forget the last span [`from_source_span`] recorded (the caller cropped its positions away and computes
        them itself); the cache is exact again once no span is left."""
        self.mapping_info["mapped_positions"].pop()
        self.mapping_info["mappers"].pop()
        self._record_spans()

    def _record_spans(self) -> None:
        info = self.mapping_info
        info["mapped_tokens"] = sum(b - a for a, b in info["mapped_positions"])
        self._set_approximate(bool(info["mapped_positions"]))


def _mapped_layers(onto: Cache | None, count: int) -> list[MappedLayer]:
    """`count` layers to append mapped positions to: `onto`'s tensors as they are (no copy), or empty ones."""
    if onto is None:
        return [MappedLayer() for _ in range(count)]
    if len(onto.layers) != count:
        raise ValueError(
            f"The target cache has {len(onto.layers)} layers but the mapper produces {count}: it is another model's."
        )
    return [MappedLayer.from_tensors(layer.keys, layer.values) for layer in onto.layers]


def _checked_request(source_cache, mapper, *settings: dict):
    """`from_source`'s arguments checked (`input_checks.check_mapping_request`): the source's per-layer `(keys,
    values)`, the positions the target reads at and the source built at, and the repair as a `RepairConfig`."""
    args = {key: value for part in settings for key, value in part.items()}
    if not isinstance(mapper, MapperModel):
        raise TypeError(
            f"mapper is {'None' if mapper is None else 'a ' + type(mapper).__name__}; pass the `MapperModel` fitted "
            "for this source and target (`MapperModel.from_pretrained(...)`)."
        )
    repair = args.pop("repair")
    if repair is not None:
        from .repair import RepairConfig

        repair = RepairConfig.from_dict(repair)  # bad settings raise before any work
    check_finite = args.pop("check_finite")
    source_kv = check_source_tensors(source_pairs(source_cache), mapper.config)
    batch, _, seq, _ = source_kv[0][0].shape
    _warn_beyond_positions(mapper.config, seq)
    check_mapping_request(batch, seq, repair=repair, **args)
    if check_finite:
        check_finite_pairs(source_kv)
    positions = _positions(
        source_kv,
        args["attention_mask"],
        args["position_ids"],
        args["source_position_ids"],
        args["source_model"],
        args["input_ids"],
    )
    return source_kv, *positions, repair


#: where the first layer of a mapped cache comes from: the mapper, or the target's own computation from the ids
FIRST_LAYERS = ("mapped", "target")


def _first_layer(first_layer: str | None, target_model, repair) -> str:
    """`from_source`'s `first_layer`, checked; left out, `"target"` where a `target_model` is given (deprecated)."""
    if first_layer is None:
        if target_model is None:
            return "mapped"
        warnings.warn(
            "MappedCache.from_source: `target_model` without `first_layer` switches on the target's exact first layer; "
            "this implication is deprecated and goes in hf-kvmap 0.2. Pass `first_layer='target'` to keep it (or "
            "`first_layer='mapped'` to map every layer).",
            DeprecationWarning,
            stacklevel=4,  # the caller of from_source (through torch.no_grad's wrapper)
        )
        return "target"
    if first_layer not in FIRST_LAYERS:
        raise ValueError(f"first_layer={first_layer!r} must be one of {FIRST_LAYERS}.")
    if first_layer == "target" and target_model is None:
        raise ValueError(
            "first_layer='target' has the target compute its first layer: pass `target_model` and `input_ids`."
        )
    if first_layer == "mapped" and target_model is not None and repair is None:
        raise ValueError(
            "first_layer='mapped' maps every layer, so `target_model` is not read: leave it out, or pass "
            "first_layer='target' for the target's exact first layer."
        )
    return first_layer


def _provenance(config, length: int, hold_back: int, first_layer: str) -> dict[str, Any]:
    """The `mapping_info` of a mapped cache: the mapper, the models, what was mapped."""
    return {
        "mapper": model_id(config),
        "mapper_revision": model_revision(config),
        "kind": config.kind,
        "source_model_id": config.source_model_id,
        "target_model_id": config.target_model_id,
        "mapped_tokens": length,
        "hold_back": hold_back,
        "first_layer": first_layer,
        "approximate": True,
    }


def _positions(source_kv, attention_mask, position_ids, source_position_ids, source_model, input_ids):
    """`(position_ids, source_position_ids)`: where the target reads the cache and where the source built it (a
    plain forward's `0 .. seq - 1` unless stated); a given `source_model` checks the cache against the ids there."""
    batch, _, seq, _ = source_kv[0][0].shape
    device = source_kv[0][0].device
    positions_stated = source_position_ids is not None  # (position_ids never come with a mask)
    if position_ids is None:
        mask = attention_mask.to(device) if attention_mask is not None else None
        position_ids = positions_from_attention_mask(mask, batch, seq, device)
        if source_position_ids is None:  # a plain forward: every row at 0 .. seq - 1
            source_position_ids = positions_from_attention_mask(None, batch, seq, device)
    if source_model is not None:  # input_ids come with it (checked before)
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        built = source_position_ids if source_position_ids is not None else position_ids
        check_source_cache(source_model, source_kv[0], input_ids, built, mask.to(input_ids.device))
    elif attention_mask is not None and not positions_stated and not bool(attention_mask.all()):
        logger.warning_once(
            "MappedCache.from_source: the attention mask left-pads the batch and no `source_position_ids` were "
            "given, so the source cache is read as a plain forward built it (every row at 0 .. seq - 1, what "
            "`source(ids, attention_mask=mask)` does). A cache built at the mask's positions (`generate`, or a "
            "forward given `position_ids`) maps wrong that way: pass `source_position_ids`, or `source_model` and "
            "`input_ids` to have the cache checked."
        )
    return position_ids, source_position_ids


def _map(mapper, source_kv, length, position_ids, source_position_ids, dtype, devices, target_model, input_ids):
    """The mapper's forward on the first `length` source positions: one `(keys, values)` per target layer (the first
    computed by `target_model` from the ids when it is given)."""
    mapped = unhooked_forward(mapper)(
        [keys[:, :, :length] for keys, _ in source_kv],
        [values[:, :, :length] for _, values in source_kv],
        position_ids[:, :length],
        source_position_ids=None if source_position_ids is None else source_position_ids[:, :length],
        dtype=dtype,
        devices=devices,
        layers=None if target_model is None else range(1, len(mapper.config.source_layers)),
    )
    if target_model is not None:
        keys, values = target_first_layer(target_model, input_ids[:, :length], position_ids[:, :length])
        device = torch.device(devices[0]) if devices is not None else next(mapper.layers[0].parameters()).device
        device = keys.device if device.type == "meta" else device  # weights offloaded by accelerate
        out_dtype = dtype or source_kv[0][0].dtype
        mapped.insert(0, (keys.to(device, out_dtype), values.to(device, out_dtype)))
    return mapped


__all__ = ["CACHE_DTYPES", "MappedCache", "MappedLayer", "source_pairs"]
