"""Content space: cached keys with the model's own rotary embedding removed, and re-applied.

A cached key is ``a * R(p) k`` where ``R(p)`` is the rotation at position ``p`` and ``a`` the attention scaling of
the rope type (1 for most, >1 for YaRN/longrope). The rotary module that transformers builds from the model config
returns ``cos = a cos(theta)`` and ``sin = a sin(theta)``, so ``R(p)^T`` applied with those values and divided by
``cos^2 + sin^2 = a^2`` recovers ``k`` exactly, for every rope type, without knowing which one it is.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from ._compat import rotary_embedding_class
from .geometry import check_supported_layout


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
