"""The target's forwards the serving stages run on a cache: its own prefill of a prompt ([`target_prefill`]), a span
of tokens on a cache ([`run_tokens`]), and its confidence in its first answer token on a served cache
([`answer_margin`], what a ladder's check after the rung reads). `hf_kvmap.serving.pipeline` and `HandoffSession`
both call them."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .._compat import cache_kwargs, output_cache
from ..rope import positions_from_attention_mask


@torch.no_grad()
def target_prefill(target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Cache:
    """The target's own cache of every prompt token but the last (what `generate` expects next to the full prompt)."""
    kwargs = {}
    if attention_mask is not None:
        kwargs = {
            "attention_mask": attention_mask[:, :-1],
            "position_ids": positions_from_attention_mask(attention_mask, *input_ids.shape, input_ids.device)[:, :-1],
        }
    return output_cache(target(input_ids=input_ids[:, :-1], use_cache=True, **kwargs))


@torch.no_grad()
def run_tokens(
    model,
    cache: Cache,
    input_ids: torch.Tensor,
    start: int,
    end: int,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """`model` runs tokens `[start, end)` of `input_ids` on `cache` (its cache of the tokens before them, which grows
    by them): the held-back tokens after a mapping, a session's unseen tokens. `attention_mask` `(batch, >= end)` and
    `position_ids` `(batch, >= end)` are the whole prompt's, when it has them. Returns the logits `(batch, n, vocab)`.
    """
    kwargs = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask[:, :end]
    if position_ids is not None:
        kwargs["position_ids"] = position_ids[:, start:end]
    return model(input_ids=input_ids[:, start:end], use_cache=True, **kwargs, **cache_kwargs(cache)).logits


@torch.no_grad()
def answer_margin(
    target,
    cache: Cache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    return_tokens: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The target's confidence in its first answer token on `cache` (its served cache of every prompt token but the
    last): the last token runs on the cache, and each row's top-1 minus top-2 probability of the next token is
    returned `(batch,)`, in `[0, 1]` (with `return_tokens`, also each row's top-1 token: the first token greedy
    decoding gives). The cache is cropped back to the prompt but the last token, as it was; the run is the one
    `generate` would start with, so the check costs a single token."""
    length = input_ids.shape[1]
    if cache.get_seq_length() != length - 1:
        raise ValueError(
            f"answer_margin reads a cache of every prompt token but the last ({length - 1}); this one holds "
            f"{cache.get_seq_length()}."
        )
    if attention_mask is not None and position_ids is None:
        position_ids = positions_from_attention_mask(attention_mask, *input_ids.shape, input_ids.device)
    logits = run_tokens(target, cache, input_ids, length - 1, length, attention_mask, position_ids)
    cache.crop(-1)
    top = torch.softmax(logits[:, -1].float(), dim=-1).topk(2, dim=-1)
    margin = top.values[:, 0] - top.values[:, 1]
    return (margin, top.indices[:, 0]) if return_tokens else margin


__all__ = ["answer_margin", "run_tokens", "target_prefill"]
