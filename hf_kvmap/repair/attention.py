"""The attention a model's last prompt tokens pay to every earlier position, summed over heads, queries and layers:
what `source_attention` and `target_attention` select by.

The model runs its last `n` prompt tokens over its cache of the tokens before them (`n` tokens of a forward; the
cache given is not changed). A pre-hook on each layer's attention module reads the layer's input and the rotary
`(cos, sin)` the model hands it, and recomputes the queries with the module's own `q_proj` (and `q_norm` where the
architecture has one) and the standard rotation; the keys are the ones the forward leaves in its working cache. A
query scaling that some architectures apply after the rotation (Ministral 3's long-context `llama_4_scaling_beta`)
is not reproduced: it sharpens or flattens each row's softmax without reordering it much.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .._compat import cache_kwargs
from ..cache_views import as_layer


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _window_attention(
    model, pairs, input_ids, attention_mask, position_ids, last: int, query_mask, per_query: bool = False
) -> torch.Tensor:
    """`last_tokens_attention` of rows that all read `last` final tokens; `pairs` are the cache's `(keys, values)`."""
    batch, length = input_ids.shape
    start = length - last
    counted = None if query_mask is None else query_mask[:, start:].float()[:, None, None, :, None]
    work = Cache(layers=[as_layer(keys[:, :, :start], values[:, :, :start]) for keys, values in pairs])
    decoder = model.get_decoder()
    queries: list[torch.Tensor] = []

    def capture(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
        query = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim)
        if getattr(module, "q_norm", None) is not None:
            query = module.q_norm(query)
        query = query.transpose(1, 2).float()
        cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
        queries.append((query * cos + _rotate_half(query) * sin) * module.scaling)

    hooks = [layer.self_attn.register_forward_pre_hook(capture, with_kwargs=True) for layer in decoder.layers]
    try:
        decoder(
            input_ids=input_ids[:, start:],
            attention_mask=attention_mask,
            position_ids=position_ids[:, start:],
            use_cache=True,
            **cache_kwargs(work),
        )
    finally:
        for hook in hooks:
            hook.remove()
    slots = torch.arange(length)
    total = torch.zeros(batch, last, length, dtype=torch.float32) if per_query else torch.zeros(batch, length)
    for query, layer in zip(queries, work.layers):
        keys = layer.keys.float()
        grouped = query.view(batch, keys.shape[1], -1, last, query.shape[-1])
        logits = torch.einsum("bkgnd,bktd->bkgnt", grouped, keys.to(query.device))
        allowed = (slots[None, :] <= (start + torch.arange(last))[:, None]).to(logits.device)
        allowed = allowed[None] & attention_mask.bool().to(logits.device)[:, None, :]
        logits = logits.masked_fill(~allowed[:, None, None], float("-inf"))
        weights = logits.softmax(-1).nan_to_num(0.0)
        if counted is not None:
            weights = weights * counted.to(weights.device)
        total += weights.sum((1, 2) if per_query else (1, 2, 3)).cpu()
    return total * (attention_mask.cpu()[:, None] if per_query else attention_mask.cpu())


@torch.no_grad()
def last_tokens_attention(
    model,
    cache: Cache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    last: int,
    query_mask: torch.Tensor | None = None,
    per_query: bool = False,
) -> torch.Tensor:
    r"""
    Attention mass of the last `last` prompt tokens on every prompt position, summed over heads, queries and layers
    (with `per_query`, over heads and layers only).

    Each row reads at most its tokens but the first (rows shorter than that run apart, so a left-padded row scores
    as it does alone).

    Args:
        model (`PreTrainedModel`): the model whose attention is read.
        cache (`Cache`): its cache of at least the first `T - last` prompt tokens (only those are read; unchanged).
        input_ids (`torch.Tensor`): `(batch, T)` prompt.
        attention_mask (`torch.Tensor`): `(batch, T)` 0/1.
        position_ids (`torch.Tensor`): `(batch, T)` positions the cache was built at (and the last tokens run at).
        last (`int`): how many final tokens' queries to read.
        query_mask (`torch.Tensor`, *optional*): `(batch, T)` bool; of the last tokens, only those marked `True` have
            their queries counted (all of them by default).

    Returns:
        `(batch, T)` float32 attention mass (0 on padding).
    """
    batch, length = input_ids.shape
    own = (attention_mask.long().sum(-1).cpu() - 1).clamp(min=1, max=int(last))
    if cache.get_seq_length() < length - int(own.max()):
        raise ValueError(
            f"The cache covers {cache.get_seq_length()} tokens; reading the last {int(own.max())} of {length} needs "
            f"{length - int(own.max())}."
        )
    total = torch.zeros(batch, length, dtype=torch.float32)
    windows = own.unique().tolist()
    if len(windows) == 1:  # every row reads the same window: no copy of the cache
        pairs = [(layer.keys, layer.values) for layer in cache.layers]
        window = int(windows[0])
        return _window_attention(model, pairs, input_ids, attention_mask, position_ids, window, query_mask, per_query)
    if per_query:
        raise ValueError(
            f"per_query=True needs every row to read the same {last} final tokens; rows of this batch read "
            f"{sorted(windows)} (rows with fewer tokens): repair such rows one at a time."
        )
    for window in windows:
        rows = (own == window).nonzero().squeeze(-1)
        index = rows.to(input_ids.device)
        pairs = [
            (layer.keys[index.to(layer.keys.device)], layer.values[index.to(layer.keys.device)])
            for layer in cache.layers
        ]
        total[rows] = _window_attention(
            model,
            pairs,
            input_ids[index],
            attention_mask[index],
            position_ids[index],
            int(window),
            None if query_mask is None else query_mask[index],
        )
    return total


__all__ = ["last_tokens_attention"]
