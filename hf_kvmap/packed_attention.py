"""One-token attention over grouped key/value heads without torch's slow CPU path: an attention implementation
registered with transformers' `AttentionInterface`, opt-in per model.

```python
from hf_kvmap.packed_attention import use_packed_attention

use_packed_attention(source)   # a model loaded with attn_implementation="sdpa" (the default)
use_packed_attention(target)
```

Why: a decoding step (and the first token after a cache: the held-back prompt token) runs one query token. With no
attention mask, transformers' `sdpa` implementation (5.16 to 5.25) passes `enable_gqa=True` to
`torch.nn.functional.scaled_dot_product_attention`, which on CPU computes it with the unfused math kernel, in bfloat16
several times slower than the same attention with the query heads that share a key/value head stacked as queries of
that head (what transformers 5.24+ does itself where a mask is given). Every step of a draft (`draft_attention`,
`draft_branches`, the probes that draft), every decoded token and every first token pays it, on both models, so on a
CPU it slows a switch's rungs more than the target's own prefill (`benchmarks/speed/packed_attention.py` measures both
side by side). `packed_sdpa_forward` computes a one-token, mask-free query that way and hands every other call to
transformers' own `sdpa` (prefill, masks, padding); the outputs agree with `sdpa`'s to float rounding.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ._compat import attention_implementation

#: the attention implementation's name (`model.config._attn_implementation` once set)
PACKED_SDPA = "hf_kvmap_packed_sdpa"


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    r"""
    transformers' `sdpa` attention, with a one-token query over grouped key/value heads and no mask computed packed.

    Args:
        module (`torch.nn.Module`): the attention layer (its `num_key_value_groups` query heads share a key/value head).
        query (`torch.Tensor`): `(batch, heads, q_len, head_dim)`.
        key, value (`torch.Tensor`): `(batch, kv_heads, kv_len, head_dim)`.
        attention_mask (`torch.Tensor`, *optional*): the mask transformers built (`None` where none is needed).
        Others: as transformers' `sdpa_attention_forward`.

    Returns:
        `(attn_output, None)`, `attn_output` `(batch, q_len, heads, head_dim)`, as every attention implementation.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, length, dim = query.shape
    plain = (
        torch.compiler.is_compiling()  # traced code keeps sdpa's own path (its shapes and guards)
        or length != 1
        or attention_mask is not None
        or groups == 1
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or key.shape[1] * groups != heads
    )
    if plain:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    packed = query.reshape(batch, heads // groups, groups, dim)  # query head h reads key/value head h // groups
    output = torch.nn.functional.scaled_dot_product_attention(packed, key, value, scale=scaling)
    return output.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def register_packed_attention() -> None:
    """Register [`PACKED_SDPA`] with transformers (its attention function and `sdpa`'s mask); idempotent."""
    AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
    AttentionMaskInterface.register(PACKED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_packed_attention(model) -> None:
    """Switch a model that runs transformers' `sdpa` attention to [`packed_sdpa_forward`] (in place; its weights and
    every output but float rounding unchanged). A model on another implementation (eager, flash) is refused: its
    one-token steps do not take the slow path."""
    current = attention_implementation(model)
    if current not in ("sdpa", PACKED_SDPA):
        raise ValueError(
            f"use_packed_attention replaces attn_implementation='sdpa'; this model runs {current!r}. Load it with "
            "attn_implementation='sdpa' (transformers' default), or keep its own implementation."
        )
    register_packed_attention()
    model.set_attn_implementation(PACKED_SDPA)
    if attention_implementation(model) != PACKED_SDPA:  # transformers only warns where a model cannot switch
        raise ValueError(
            f"{type(model).__name__} did not take attn_implementation={PACKED_SDPA!r} (it runs "
            f"{attention_implementation(model)!r}): its attention does not go through transformers' AttentionInterface."
        )


__all__ = ["PACKED_SDPA", "packed_sdpa_forward", "register_packed_attention", "use_packed_attention"]
