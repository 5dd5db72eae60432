"""The target's forwards the serving stages run on a cache: its own prefill of a prompt ([`target_prefill`]), a span
of tokens on a cache ([`run_tokens`]), and its confidence in its first answer tokens on a served cache
([`answer_margin`], what a ladder's check after the rung reads; [`answer_margins`], step by step).
`hf_kvmap.serving.pipeline` and `HandoffSession` both call them."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache

from .._compat import cache_kwargs, output_cache
from ..input_checks import eos_token_ids as model_eos_ids
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
def answer_margins(
    target,
    cache: Cache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    tokens: int = 1,
    eos_token_ids: Sequence[int] | None = None,
    step_seconds: list[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's confidence in each of its first `tokens` greedy answer tokens on `cache` (its served cache of
    every prompt token but the last): the last prompt token runs on the cache, then each greedy token in turn, and
    each step's top-1 minus top-2 probability of the next token is kept. Returns `(margins, tokens, answered)`, each
    `(batch, steps)`: the margins in `[0, 1]`, the greedy tokens (what `generate` decodes first), and whether a step
    is part of its row's answer (a row's first token of `eos_token_ids` ends it, by default the end tokens of the
    target's generation config, `()` for none; its later steps are not). Decoding stops after `tokens` steps or once
    every row has ended. The cache is cropped back to the prompt but the last
    token, as it was. With `step_seconds`, each step's seconds are appended to it."""
    length = input_ids.shape[1]
    if cache.get_seq_length() != length - 1:
        raise ValueError(
            f"answer_margin reads a cache of every prompt token but the last ({length - 1}); this one holds "
            f"{cache.get_seq_length()}."
        )
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"answer_margin tokens={tokens!r}: the check reads at least one answer token (an int >= 1).")
    if attention_mask is not None and position_ids is None:
        position_ids = positions_from_attention_mask(attention_mask, *input_ids.shape, input_ids.device)
    if eos_token_ids is None:
        eos_token_ids = model_eos_ids(target)
    eos = torch.tensor(sorted(set(eos_token_ids)), dtype=input_ids.dtype, device=input_ids.device)
    margins, chosen, answered = [], [], []
    ended = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    ids, mask, positions, start = input_ids, attention_mask, position_ids, length - 1
    while True:
        began = time.perf_counter()
        logits = run_tokens(target, cache, ids, start, start + 1, mask, positions)
        top = torch.softmax(logits[:, -1].float(), dim=-1).topk(2, dim=-1)
        margins.append(top.values[:, 0] - top.values[:, 1])
        chosen.append(top.indices[:, 0])
        answered.append(~ended)
        ended = ended | torch.isin(chosen[-1], eos)
        if step_seconds is not None:
            step_seconds.append(time.perf_counter() - began)
        if len(chosen) == tokens or bool(ended.all()):
            break
        ids, start = torch.cat([ids, chosen[-1][:, None].to(ids.dtype)], dim=1), start + 1
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
    cache.crop(-len(chosen))
    return torch.stack(margins, 1), torch.stack(chosen, 1), torch.stack(answered, 1)


@torch.no_grad()
def answer_margin(
    target,
    cache: Cache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    return_tokens: bool = False,
    tokens: int = 1,
    eos_token_ids: Sequence[int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The target's confidence in its answer on `cache` (its served cache of every prompt token but the last), what
    a ladder's check after the rung reads: each row's smallest top-1 minus top-2 probability over its first `tokens`
    greedy answer tokens ([`answer_margins`]; a row's first token of `eos_token_ids`, by default the target's end
    tokens, ends its answer), `(batch,)` in
    `[0, 1]` (with `return_tokens`, also each row's first greedy token). With `tokens=1` the run is the one
    `generate` would start with, so the check costs a single token; each further token costs a decoding step. The
    cache is cropped back as it was."""
    margins, chosen, answered = answer_margins(
        target, cache, input_ids, attention_mask, position_ids, tokens=tokens, eos_token_ids=eos_token_ids
    )
    margin = margins.masked_fill(~answered, float("inf")).min(dim=1).values
    return (margin, chosen[:, 0]) if return_tokens else margin


__all__ = ["answer_margin", "answer_margins", "run_tokens", "target_prefill"]
