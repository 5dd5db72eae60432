"""Content space: cached keys with the model's own rotary embedding removed, and re-applied.

A cached key is ``a * R(p) k`` where ``R(p)`` is the rotation at position ``p`` and ``a`` the attention scaling of
the rope type (1 for most, >1 for YaRN/longrope). The rotary module that transformers builds from the model config
returns ``cos = a cos(theta)`` and ``sin = a sin(theta)``, so ``R(p)^T`` applied with those values and divided by
``cos^2 + sin^2 = a^2`` recovers ``k`` exactly, for every rope type, without knowing which one it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, PretrainedConfig

from ._compat import rotary_embedding_class

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


class RotaryTable:
    """cos/sin of one model's rotary embedding at fixed positions, float32, `(batch, 1, seq, head_dim)`.

    Computed once and copied lazily to every device that asks for it, so all layers of a cache share it. Both
    directions are one multiply and one fused multiply-add on the half-swapped input (`x.roll(half, -1)`), with the
    signs of `rotate_half` and the division by the squared attention scaling folded into the tables once.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        half = cos.shape[-1] // 2
        scale2 = cos.square() + sin.square()
        # apply: x cos + rotate_half(x) sin = x cos + roll(x) [-sin_1, sin_2]
        apply_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        # strip: (x cos - rotate_half(x) sin) / a^2 = x cos / a^2 + roll(x) [sin_1, -sin_2] / a^2
        strip_cos = cos / scale2
        strip_sin = torch.cat((sin[..., :half], -sin[..., half:]), dim=-1) / scale2
        self._by_device = {cos.device: (cos, sin, scale2, apply_sin, strip_cos, strip_sin)}

    def _tables(self, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        device = torch.device(device)
        if device not in self._by_device:
            self._by_device[device] = tuple(t.to(device) for t in next(iter(self._by_device.values())))
        return self._by_device[device]

    def on(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(cos, sin, scale2)` on `device`, where `scale2 = cos^2 + sin^2` is the squared attention scaling."""
        return self._tables(device)[:3]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        swapped = x.roll(x.shape[-1] // 2, dims=-1)
        out = torch.mul(x, cos, out=out) if out is not None else x * cos
        return out.addcmul_(swapped, sin)

    def strip(self, keys: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Cached (rotated) keys `(batch, heads, seq, head_dim)` -> content-space keys in float32 (or into `out`)."""
        _, _, _, _, cos, sin = self._tables(keys.device)
        return self._rotate(keys.float(), cos, sin, out)

    def apply(self, keys: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Content-space keys -> rotated keys as the model caches them (same dtype as `keys`, or written to `out`).

        `keys` and `out` may be any views of `(batch, heads, seq, head_dim)` (e.g. transposed), so the result can be
        written straight into a contiguous cache tensor.
        """
        cos, _, _, sin, _, _ = self._tables(keys.device)
        if out is None:
            cos, sin = cos.to(keys.dtype), sin.to(keys.dtype)
        return self._rotate(keys, cos, sin, out)


class RotaryCodec:
    """One model's rotary embedding, rebuilt from its config through the model's own rotary-embedding class.

    Args:
        config (`PretrainedConfig` or `dict`): the model config (or its `to_dict()`); refused with
            `UnsupportedArchitectureError` unless `check_supported_layout` accepts it.

    Example:

    ```python
    >>> import torch
    >>> from transformers import Qwen3Config
    >>> from hf_kvmap.rope import RotaryCodec
    >>> codec = RotaryCodec(Qwen3Config(head_dim=16, num_attention_heads=2, num_key_value_heads=1))
    >>> table = codec.table(torch.arange(5)[None])
    >>> k = torch.randn(1, 1, 5, 16)
    >>> torch.allclose(table.strip(table.apply(k)), k, atol=1e-5)
    True
    ```
    """

    def __init__(self, config: PretrainedConfig | dict):
        self.config = check_supported_layout(config)
        self._rotary = rotary_embedding_class(self.config)(config=self.config)

    @torch.no_grad()
    def table(self, position_ids: torch.Tensor) -> RotaryTable:
        """The `RotaryTable` for `position_ids` `(batch, seq)`, computed on their device (CPU for `meta`)."""
        device = position_ids.device if position_ids.device.type != "meta" else torch.device("cpu")
        rotary = self._rotary.to(device)
        cos, sin = rotary(torch.empty(0, dtype=torch.float32, device=device), position_ids.to(device))
        return RotaryTable(cos.float().unsqueeze(1), sin.float().unsqueeze(1))


def positions_from_attention_mask(
    attention_mask: torch.Tensor | None, batch: int, length: int, device
) -> torch.Tensor:
    """Position ids as `generate()` derives them: `cumsum(mask) - 1`, pads set to 1; `arange` without a mask."""
    if attention_mask is None:
        return torch.arange(length, device=device).unsqueeze(0).expand(batch, length)
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    return position_ids
