"""Cache layouts hf-kvmap maps exactly, and the KV geometry (layers, KV heads, head dim) of a model config."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import AutoConfig, PretrainedConfig

# Model types whose attention caches `rope(k)` over the full head dim with the `rotate_half` pairing, one rope for
# every layer. Anything else is refused until it is handled exactly.
SUPPORTED_MODEL_TYPES = ("llama", "ministral", "ministral3", "mistral", "qwen2", "qwen3")


class UnsupportedArchitectureError(ValueError):
    """A model whose cache layout hf-kvmap cannot map exactly."""


def text_config(config: PretrainedConfig | dict) -> PretrainedConfig:
    """The decoder text config of a model config (or of its `to_dict()`)."""
    if isinstance(config, dict):
        config = dict(config)
        model_type = config.pop("model_type", None)
        if model_type is None:
            raise ValueError("A model config dict needs its `model_type` to rebuild the config.")
        config = AutoConfig.for_model(model_type, **config)
    return config.get_text_config(decoder=True)


def check_supported_layout(config: PretrainedConfig | dict) -> PretrainedConfig:
    """Raise `UnsupportedArchitectureError` unless the model's KV cache can be mapped exactly; return its text config.

    Refused: architectures outside `SUPPORTED_MODEL_TYPES` (partial or interleaved rotary, NoPE or per-layer rope),
    sliding-window or hybrid attention, and partial rotary factors.
    """
    config = text_config(config)
    model_type = config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"model_type={model_type!r} is not supported: hf-kvmap maps caches exactly only for full-dim "
            f"`rotate_half` rope with one rope per layer and full attention, i.e. {', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    partial = getattr(config, "partial_rotary_factor", None)
    if partial is None and isinstance(getattr(config, "rope_parameters", None), dict):
        partial = config.rope_parameters.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        raise UnsupportedArchitectureError(
            f"partial_rotary_factor={partial} is not supported: only full-dim rotary embeddings map exactly."
        )
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        other = sorted(set(layer_types) - {"full_attention"})
        if other:
            raise UnsupportedArchitectureError(
                f"{model_type} has layer_types {other}: sliding-window or hybrid attention keeps a different cache "
                "per layer type and is not supported; only models whose layers are all 'full_attention' are."
            )
    sliding_window = getattr(config, "sliding_window", None)
    uses_sliding = getattr(config, "use_sliding_window", True)  # qwen2/qwen3 only honour it with this flag
    if sliding_window is not None and uses_sliding:
        raise UnsupportedArchitectureError(
            f"{model_type} uses sliding_window={sliding_window}: sliding-window attention is not supported. "
            "Use a model configured with full attention (sliding_window=None)."
        )
    return config


_GEOMETRY_KEYS = ("num_hidden_layers", "num_key_value_heads", "head_dim")


@dataclass(frozen=True)
class KVGeometry:
    """Shape of a model's KV cache: layers, KV heads, head dim."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def layer_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_config(cls, config: PretrainedConfig | dict) -> KVGeometry:
        if isinstance(config, dict) and all(config.get(key) for key in _GEOMETRY_KEYS):
            # a recorded summary (`summarize_model_config`) holds every field: rebuilding the config class costs
            # ~0.5 ms, and `from_source` asks for the geometry of both sides for every target layer
            return cls(int(config["num_hidden_layers"]), int(config["num_key_value_heads"]), int(config["head_dim"]))
        config = text_config(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(int(config.num_hidden_layers), int(num_kv), int(head_dim))
