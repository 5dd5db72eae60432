"""`MapperModel`: a fitted map from a source model's KV cache to a target model's, packaged as a `PreTrainedModel`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from .configuration_mapper import MapperConfig, summarize_model_config
from .rope import KVGeometry, RotaryCodec, check_supported_layout


def _build_map(config: MapperConfig, in_features: int) -> nn.Module:
    target = config.target_geometry
    if config.kind == "ridge":
        return nn.Linear(in_features, target.layer_width, bias=True)
    from .mlp import HeadwiseMLP

    return HeadwiseMLP(in_features, config.mlp_hidden_size, target.num_kv_heads, target.head_dim)


class MapperLayer(nn.Module):
    """The maps that produce one target layer: keys and values, all target KV heads at once.

    `key_proj` takes the content-space keys of the selected source layers, concatenated in the order of
    `config.source_layers[layer_idx]`, each flattened over `(kv_head, head_dim)`; it returns the content-space keys
    of every target KV head, flattened the same way. `value_proj` does the same for values. For `kind="ridge"` each
    is one `nn.Linear`; for `kind="mlp"` a `HeadwiseMLP` (one MLP per target head, batched).
    """

    def __init__(self, config: MapperConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        in_features = config.input_width(layer_idx)
        self.key_proj = _build_map(config, in_features)
        self.value_proj = _build_map(config, in_features)

    def forward(self, key_features: torch.Tensor, value_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(..., in_features)` features -> `(..., n_kv_target * head_dim_target)` keys and values."""
        return self.key_proj(key_features), self.value_proj(value_features)


class MapperPreTrainedModel(PreTrainedModel):
    config_class = MapperConfig
    base_model_prefix = "mapper"
    main_input_name = "source_keys"
    _no_split_modules = ["MapperLayer"]
    supports_gradient_checkpointing = False


class MapperModel(MapperPreTrainedModel):
    r"""
    Maps a source model's KV cache to the cache a target model expects, one target layer at a time.

    Use it through [`MappedCache.from_source`]; `forward` maps a whole cache given as per-layer tensors.

    Example:

    ```python
    >>> from transformers import Qwen3Config
    >>> from hf_kvmap import MapperModel
    >>> config = Qwen3Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    >>> mapper = MapperModel.identity(config)
    >>> [tuple(layer.key_proj.weight.shape) for layer in mapper.layers]
    [(16, 16), (16, 16)]
    ```
    """

    def __init__(self, config: MapperConfig):
        super().__init__(config)
        if config.source_config is None or config.target_config is None:
            raise ValueError("MapperConfig needs `source_config` and `target_config` to build a MapperModel.")
        check_supported_layout(config.source_config)
        check_supported_layout(config.target_config)
        self.layers = nn.ModuleList(MapperLayer(config, layer) for layer in range(len(config.source_layers)))
        self._codecs: dict[str, RotaryCodec] = {}
        self.post_init()

    def rotary(self, side: str) -> RotaryCodec:
        """The `RotaryCodec` of the `"source"` or `"target"` model, rebuilt from the recorded config."""
        if side not in self._codecs:
            summary = self.config.source_config if side == "source" else self.config.target_config
            self._codecs[side] = RotaryCodec(summary)
        return self._codecs[side]

    @classmethod
    def identity(
        cls,
        source_config: PretrainedConfig,
        target_config: PretrainedConfig | None = None,
        dtype: torch.dtype = torch.float32,
        **config_kwargs,
    ) -> MapperModel:
        """The exact content-space identity between two rope configurations of the same weights.

        Keys are un-rotated with the source's rotary embedding and re-rotated with the target's; values pass
        through. With `target_config=None` the map is a model onto itself (the cache comes back unchanged up to
        float rounding). Useful to move a cache between rope scalings of one model, and as the exactness baseline.

        Args:
            source_config (`PretrainedConfig`): config of the model that produced the cache.
            target_config (`PretrainedConfig`, *optional*): config of the model that reads it; must have the same
                layer count, KV heads and head dim.
            dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): dtype of the mapper weights.
        """
        target_config = source_config if target_config is None else target_config
        source, target = summarize_model_config(source_config), summarize_model_config(target_config)
        source_geometry, target_geometry = KVGeometry.from_config(source), KVGeometry.from_config(target)
        if source_geometry != target_geometry:
            raise ValueError(
                f"An identity mapper needs the same KV geometry on both sides; source has {source_geometry}, "
                f"target has {target_geometry}."
            )
        config = MapperConfig(source_config=source, target_config=target, ridge_lambda=0.0, **config_kwargs)
        model = cls(config)
        with torch.no_grad():
            for layer in model.layers:
                for proj in (layer.key_proj, layer.value_proj):
                    proj.weight.copy_(torch.eye(proj.out_features, proj.in_features))
                    proj.bias.zero_()
        return model.to(dtype)

    @torch.no_grad()
    def forward(
        self,
        source_keys: Sequence[torch.Tensor],
        source_values: Sequence[torch.Tensor],
        position_ids: torch.Tensor | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Map per-layer source keys/values `(batch, n_kv_src, seq, head_dim_src)` to target ones.

        Returns one `(keys, values)` pair per target layer, `(batch, n_kv_tgt, seq, head_dim_tgt)`, on the device of
        the mapper layer that produced it. `position_ids` `(batch, seq)` default to `arange(seq)`.
        """
        from .cache import MappedCache, source_tensors

        source_kv = source_tensors(list(zip(source_keys, source_values)), self.config)
        batch, _, length, _ = source_kv[0][0].shape
        if position_ids is None:
            position_ids = torch.arange(length, device=source_kv[0][0].device).expand(batch, length)
        cache = MappedCache.map_tensors(source_kv, self, position_ids)
        return [(layer.keys, layer.values) for layer in cache.layers]

    @classmethod
    def from_statistics(
        cls, statistics, *, top_k: int | None = 8, ridge_lambda: float = 0.01, **kwargs
    ) -> MapperModel:
        """Closed-form ridge mapper from `CalibrationStatistics` (selection + solve); see `hf_kvmap.fitting`."""
        from .fitting import mapper_from_statistics

        return mapper_from_statistics(statistics, top_k=top_k, ridge_lambda=ridge_lambda, **kwargs)

    @classmethod
    def fit(
        cls, source_model, target_model, calibration, *, top_k: int | None = 8, ridge_lambda: float = 0.01, **kwargs
    ) -> MapperModel:
        """Collect calibration statistics in one pass through both models, then solve; see `hf_kvmap.fitting`."""
        from .fitting import fit_mapper

        return fit_mapper(source_model, target_model, calibration, top_k=top_k, ridge_lambda=ridge_lambda, **kwargs)
