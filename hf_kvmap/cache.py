"""`MappedCache`: a `DynamicCache` whose layers are built by a `MapperModel` from another model's cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from ._compat import model_id, model_revision
from .configuration_mapper import MapperConfig
from .modeling_mapper import mapper_inputs
from .placement import execution_devices
from .rope import RotaryTable, positions_from_attention_mask

SourceCache = Cache | Sequence[tuple[torch.Tensor, torch.Tensor]]


def source_tensors(source_cache: SourceCache, config: MapperConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-layer `(keys, values)` of a source cache, checked against the mapper config.

    Raises `ValueError` naming the mismatch (layer count, KV heads, head dim, sequence lengths, dtype), and
    `ValueError` for sliding-window layers.
    """
    geometry = config.source_geometry
    if isinstance(source_cache, Cache):
        for idx, layer in enumerate(source_cache.layers):
            if getattr(layer, "is_sliding", False):
                raise ValueError(
                    f"Source cache layer {idx} is a sliding-window layer ({type(layer).__name__}); "
                    "only full-attention caches can be mapped."
                )
        pairs = [(layer.keys, layer.values) for layer in source_cache.layers]
    else:
        pairs = [tuple(pair) for pair in source_cache]
    if len(pairs) != geometry.num_layers:
        raise ValueError(
            f"The source cache has {len(pairs)} layers but the mapper expects {geometry.num_layers} "
            f"(source model {config.source_model_id or config.source_config.get('model_type')}). "
            "Pass the cache of the source model the mapper was fitted for."
        )
    expected = None
    for idx, pair in enumerate(pairs):
        if len(pair) != 2 or pair[0] is None or pair[1] is None:
            raise ValueError(f"Source cache layer {idx} is empty: prefill the source model before mapping its cache.")
        keys, values = pair
        for name, tensor, dim in (("keys", keys, geometry.head_dim), ("values", values, geometry.head_dim)):
            if tensor.dim() != 4:
                raise ValueError(
                    f"Source cache layer {idx} {name} have shape {tuple(tensor.shape)}; expected 4 dims "
                    "(batch, num_kv_heads, seq, head_dim)."
                )
            if tensor.shape[1] != geometry.num_kv_heads:
                raise ValueError(
                    f"Source cache layer {idx} {name} have {tensor.shape[1]} KV heads but the mapper expects "
                    f"{geometry.num_kv_heads}."
                )
            if tensor.shape[3] != dim:
                raise ValueError(
                    f"Source cache layer {idx} {name} have head_dim {tensor.shape[3]} but the mapper expects {dim}."
                )
            if not tensor.is_floating_point():
                raise ValueError(f"Source cache layer {idx} {name} have dtype {tensor.dtype}; expected a float dtype.")
        if keys.shape != values.shape:
            raise ValueError(
                f"Source cache layer {idx} keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape."
            )
        if expected is None:
            expected = keys.shape
        elif keys.shape[0] != expected[0] or keys.shape[2] != expected[2]:
            raise ValueError(
                f"Source cache layer {idx} has batch x seq {tuple(keys.shape[::2][:2])}, layer 0 has "
                f"{(expected[0], expected[2])}: all layers must cover the same tokens."
            )
    return pairs


def _check_finite(tensor: torch.Tensor, what: str) -> None:
    if tensor.device.type != "meta" and not torch.isfinite(tensor).all():
        raise ValueError(f"{what} contains NaN or inf values; refusing to map a corrupted cache.")


def _check_finite_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`_check_finite` for every layer at once: one `aminmax` pass per tensor (NaN propagates, +-inf shows in the
    max/min) and a single host sync for the whole cache instead of one per tensor."""
    extremes, home = [], None
    for keys, values in pairs:
        for tensor in (keys, values):
            if tensor.device.type == "meta":
                continue
            home = tensor.device if home is None else home
            extremes.append(torch.stack(torch.aminmax(tensor)).float().to(home, non_blocking=True))
    if extremes and not torch.isfinite(torch.cat(extremes)).all():
        for idx, (keys, values) in enumerate(pairs):  # slow path, only to name the layer
            _check_finite(keys, f"Source cache layer {idx} keys")
            _check_finite(values, f"Source cache layer {idx} values")


class MappedLayer(DynamicLayer):
    """A `DynamicLayer` whose initial keys/values were produced by a mapper; it then grows like any dynamic layer.

    The model that reads the layer decides its dtype and device: if the first states it appends differ (e.g. a
    float32 source mapped for a bfloat16 target), the mapped tensors are converted to them before concatenation.
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.is_initialized and (self.keys.dtype, self.keys.device) != (key_states.dtype, key_states.device):
            self.keys = self.keys.to(device=key_states.device, dtype=key_states.dtype)
            self.values = self.values.to(device=value_states.device, dtype=value_states.dtype)
            self.dtype, self.device = key_states.dtype, key_states.device
        return super().update(key_states, value_states, *args, **kwargs)

    @classmethod
    def from_source(
        cls,
        mapper,
        layer_idx: int,
        source_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        source_rope: RotaryTable,
        target_rope: RotaryTable,
        length: int,
        dtype: torch.dtype,
        work_device: torch.device,
        device: torch.device | None = None,
        content_keys: dict | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> MappedLayer:
        """Map the first `length` source tokens into target layer `layer_idx`.

        Features of the selected source layers are written into one buffer (keys RoPE-stripped), multiplied by the
        layer's key and value maps at once for all target heads, reshaped to `(batch, n_kv, seq, head_dim)`, and
        the keys re-rotated with the target's rope, written straight into contiguous cache tensors. Peak extra memory:
        one layer's features (plus `content_keys`). The work happens on `work_device` (where the mapper layer
        executes); the result is moved to `device` if given. `content_keys` (a dict shared by the layers of one
        mapping, see `MappedCache.map_tensors`) keeps each source layer's RoPE-stripped keys, keyed by
        `(source_layer, device)`, so that a source layer selected by several target layers is stripped once.
        `position_ids` `(batch, length)` locate each sequence's first token for a mapper with a `context_window`.
        """
        mapper_layer = mapper.layers[layer_idx]
        work_dtype = next(mapper_layer.parameters()).dtype
        selected = mapper.config.source_layers[layer_idx]
        src, tgt = mapper.config.source_geometry, mapper.config.target_geometry
        batch = source_kv[0][0].shape[0]

        content_keys = {} if content_keys is None else content_keys
        key_features = torch.empty(
            batch, length, len(selected), src.num_kv_heads, src.head_dim, dtype=work_dtype, device=work_device
        )
        value_features = torch.empty_like(key_features)
        for slot, source_layer in enumerate(selected):
            keys, values = source_kv[source_layer]
            content = content_keys.get((source_layer, work_device))
            if content is None:
                keys = keys[:, :, :length].to(work_device, non_blocking=True)
                content = source_rope.strip(keys).transpose(1, 2).to(work_dtype)
                content_keys[(source_layer, work_device)] = content
            key_features[:, :, slot] = content
            value_features[:, :, slot] = values[:, :, :length].to(work_device, non_blocking=True).transpose(1, 2)
        key_features, value_features = mapper_inputs(
            mapper.config, key_features.view(batch, length, -1), value_features.view(batch, length, -1), position_ids
        )
        keys, values = mapper_layer(key_features, value_features)
        del key_features, value_features
        shape = (batch, tgt.num_kv_heads, length, tgt.head_dim)
        keys = keys.view(batch, length, tgt.num_kv_heads, tgt.head_dim).transpose(1, 2)
        values = values.view(batch, length, tgt.num_kv_heads, tgt.head_dim).transpose(1, 2)
        mapped_keys = torch.empty(shape, dtype=dtype, device=keys.device)
        mapped_values = torch.empty(shape, dtype=dtype, device=values.device)
        if dtype == torch.float32:  # rotate straight into the contiguous cache tensor
            target_rope.apply(keys.float(), out=mapped_keys)
        else:  # rotate in float32, round once
            mapped_keys.copy_(target_rope.apply(keys.float()))
        mapped_values.copy_(values)
        device = work_device if device is None else torch.device(device)
        mapped_keys, mapped_values = mapped_keys.to(device), mapped_values.to(device)
        layer = cls()
        layer.lazy_initialization(mapped_keys, mapped_values)  # records dtype/device the way DynamicLayer does
        layer.keys, layer.values = mapped_keys, mapped_values
        return layer


class MappedCache(DynamicCache):
    r"""
    A [`~transformers.DynamicCache`] built from another model's cache by a [`MapperModel`].

    Build it with [`MappedCache.from_source`] and hand it to the target model as `past_key_values`; it then grows
    like a `DynamicCache`. `mapping_info` records the mapper, its revision and the number of mapped tokens.

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
    >>> source_cache = model(ids, use_cache=True).past_key_values
    >>> cache = MappedCache.from_source(source_cache, MapperModel.identity(config))
    >>> cache.get_seq_length(), cache.mapping_info["mapped_tokens"]
    (11, 11)
    >>> out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    ```
    """

    def __init__(self, layers: list[MappedLayer] | None = None, mapping_info: dict[str, Any] | None = None):
        if layers is None:
            super().__init__()
        else:
            # DynamicCache.__init__ only builds layers from data or a config; with layers in hand we go to `Cache`.
            Cache.__init__(self, layers=layers)
        self.mapping_info = dict(mapping_info or {})

    @classmethod
    @torch.no_grad()
    def from_source(
        cls,
        source_cache: SourceCache,
        mapper,
        *,
        hold_back: int = 1,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        devices: Sequence[torch.device | str] | None = None,
        check_finite: bool = True,
    ) -> MappedCache:
        r"""
        Map a prefilled source cache into the cache the target model expects.

        The last `hold_back` source tokens are not mapped: the target must run at least the final prompt token
        itself to produce its first logits, and `target.generate(full_input_ids, past_key_values=cache)` then runs
        exactly those tokens. (A cache that covers every prompt token makes `generate` silently re-process the
        prompt, so `hold_back` must be at least 1.)

        Args:
            source_cache (`Cache` or sequence of `(keys, values)`):
                The source model's cache after prefilling the prompt; tensors `(batch, n_kv_src, seq, head_dim_src)`.
            mapper ([`MapperModel`]): the fitted mapper for this (source, target) pair.
            hold_back (`int`, *optional*, defaults to 1): number of final tokens left for the target to run.
            attention_mask (`torch.Tensor`, *optional*): `(batch, seq)` mask of the source prompt (left padding);
                positions are derived from it as `generate` does.
            position_ids (`torch.Tensor`, *optional*): explicit `(batch, seq)` positions of the source tokens
                (mutually exclusive with `attention_mask`).
            dtype (`torch.dtype`, *optional*): dtype of the mapped cache; defaults to the source cache's.
            devices (sequence of devices, *optional*): the device of each target layer. Defaults to the device of the
                mapper layer that produces it (place the mapper with `mapper_device_map(target)` to match).
            check_finite (`bool`, *optional*, defaults to `True`): refuse a source cache holding NaN or inf.

        Returns:
            `MappedCache` with `seq - hold_back` tokens in every layer. Like any prefilled `DynamicCache`, it is not
            expanded by `generate` for beam search: call `cache.batch_repeat_interleave(num_beams)` first.
        """
        config = mapper.config
        source_kv = source_tensors(source_cache, config)
        batch, _, seq, _ = source_kv[0][0].shape
        if not isinstance(hold_back, int) or hold_back < 1:
            raise ValueError(
                f"hold_back={hold_back!r}: at least the final prompt token must be held back for the target to run "
                "(a cache covering the whole prompt makes `generate` re-process it and return wrong tokens)."
            )
        if hold_back >= seq:
            raise ValueError(
                f"hold_back={hold_back} leaves nothing to map: the source cache holds only {seq} tokens. "
                "Use a smaller hold_back or prefill more context."
            )
        if attention_mask is not None and position_ids is not None:
            raise ValueError("Pass either `attention_mask` or `position_ids`, not both.")
        for name, tensor in (("attention_mask", attention_mask), ("position_ids", position_ids)):
            if tensor is not None and tuple(tensor.shape) != (batch, seq):
                raise ValueError(
                    f"{name} has shape {tuple(tensor.shape)} but the source cache covers (batch, seq) = {(batch, seq)}."
                )
        if check_finite:
            _check_finite_pairs(source_kv)
        if position_ids is None:
            device = source_kv[0][0].device
            mask = attention_mask.to(device) if attention_mask is not None else None
            position_ids = positions_from_attention_mask(mask, batch, seq, device)
        cache = cls.map_tensors(source_kv, mapper, position_ids[:, : seq - hold_back], dtype=dtype, devices=devices)
        cache.mapping_info["hold_back"] = hold_back
        return cache

    @classmethod
    @torch.no_grad()
    def map_tensors(
        cls,
        source_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        mapper,
        position_ids: torch.Tensor,
        dtype: torch.dtype | None = None,
        devices: Sequence[torch.device | str] | None = None,
    ) -> MappedCache:
        """Map the first `position_ids.shape[1]` tokens of already validated source tensors (no hold-back logic)."""
        config = mapper.config
        length = position_ids.shape[1]
        num_target = len(config.source_layers)
        if devices is not None and len(devices) != num_target:
            raise ValueError(f"devices has {len(devices)} entries; the target has {num_target} layers.")
        dtype = dtype or source_kv[0][0].dtype
        source_rope = mapper.rotary("source").table(position_ids)
        target_rope = mapper.rotary("target").table(position_ids)
        work_devices = execution_devices(mapper, mapper.layers)
        # strip each source layer once per device; drop it after the last target layer that reads it there
        last_use = {}
        for idx, selected in enumerate(config.source_layers):
            for source_layer in selected:
                last_use[(source_layer, work_devices[idx])] = idx
        content_keys: dict = {}
        layers = []
        for idx in range(num_target):
            layers.append(
                MappedLayer.from_source(
                    mapper,
                    idx,
                    source_kv,
                    source_rope,
                    target_rope,
                    length,
                    dtype,
                    work_devices[idx],
                    None if devices is None else devices[idx],
                    content_keys=content_keys,
                    position_ids=position_ids if config.context_window else None,
                )
            )
            for key in [key for key, last in last_use.items() if last == idx]:
                content_keys.pop(key, None)
        info = {
            "mapper": model_id(config),
            "mapper_revision": model_revision(config),
            "kind": config.kind,
            "source_model_id": config.source_model_id,
            "target_model_id": config.target_model_id,
            "mapped_tokens": length,
        }
        return cls(layers=layers, mapping_info=info)
