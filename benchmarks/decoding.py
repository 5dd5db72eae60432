"""Greedy decoding as a benchmark times it: the first token apart from the rest, several caches of one length decoded
as one batch (a CPU's decoding reads the weights once a step for every row), and the NLL of a real continuation.
`benchmarks.switch.long_switch_runner` decodes every arm with these. Each decoder can also keep every step's answer margin
(`margins=`: the top-1 minus top-2 probability of the token it chose, what a guard ladder's check after the rung reads,
`hf_kvmap.serving.forwards.answer_margins`); the first token's is taken after its seconds are read."""

from __future__ import annotations

import time

import torch


def _forward(model, ids: torch.Tensor, cache):
    from hf_kvmap import cache_kwargs

    return model(input_ids=ids, use_cache=True, **cache_kwargs(cache))


def step_margins(logits: torch.Tensor) -> list[float]:
    """Each row's top-1 minus top-2 probability of `logits` (`(batch, vocab)`), computed in float32."""
    top = logits.float().softmax(-1).topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def rounded(margins: list[float]) -> list[float]:
    """Answer margins as a record keeps them: to 5 decimals."""
    return [round(m, 5) for m in margins]


def _ended(tokens: list[int], max_new: int, stop, eos: set[int]) -> bool:
    return tokens[-1] in eos or len(tokens) >= max_new or stop(tokens)


@torch.no_grad()
def greedy(model, cache, last: torch.Tensor, max_new: int, stop, eos: set[int], step=None, margins=None):
    """Greedy tokens after `cache` + `last` (`(1, n)` held-back ids) until an end token, `stop(tokens)` or
    `max_new`; returns them, the seconds to the first token and the seconds of the rest. `step(tokens)`, when given,
    is called before each token is chosen, once the cache holds the `tokens` generated before it (where `generate`
    calls a logits processor). With `margins` (a list), each token's margin is appended to it (`step_margins`; the
    rest's seconds include them). The cache is cropped back to its length after."""
    length = cache.get_seq_length()
    start = time.perf_counter()
    logits = _forward(model, last, cache).logits[:, -1]
    if step is not None:
        step([])
    token = int(logits.argmax(-1))
    first = time.perf_counter() - start
    if margins is not None:
        margins.extend(step_margins(logits))
    tokens = [token]
    start = time.perf_counter()
    while not _ended(tokens, max_new, stop, eos):
        logits = _forward(model, torch.tensor([[token]]), cache).logits[:, -1]
        if step is not None:
            step(tokens)
        token = int(logits.argmax(-1))
        tokens.append(token)
        if margins is not None:
            margins.extend(step_margins(logits))
    rest = time.perf_counter() - start
    cache.crop(length - cache.get_seq_length())  # negative: drop what decoding appended
    return tokens, first, rest


@torch.no_grad()
def first_token(model, cache, last: torch.Tensor, margins=None) -> tuple[int, float]:
    """The greedy first token after `cache` + `last` and its seconds; the cache then holds `last` too. With `margins`
    (a list), the token's margin is appended to it after the seconds are read."""
    start = time.perf_counter()
    logits = _forward(model, last, cache).logits[:, -1]
    token = int(logits.argmax(-1))
    seconds = time.perf_counter() - start
    if margins is not None:
        margins.extend(step_margins(logits))
    return token, seconds


@torch.no_grad()
def continue_batch(model, caches: list, firsts: list[int], max_new: int, stop, eos: set[int], margins=None):
    """`greedy`'s tokens of several caches of one length, each after its first token (`first_token`), decoded as one
    batch: a CPU's decoding is bound by reading the weights, which a batch reads once per step for every row. A row
    ends as `greedy` ends it and leaves the batch; the caches are not changed (the batch decodes a copy). Returns
    every row's tokens and the seconds of the batch. With `margins` (one list a row), each row's margins of the tokens
    it decodes here are appended to its list."""
    from transformers.cache_utils import Cache

    from hf_kvmap.cache_views import as_layer

    start = time.perf_counter()
    tokens = [[token] for token in firsts]
    rows = [row for row, row_tokens in enumerate(tokens) if not _ended(row_tokens, max_new, stop, eos)]
    layers = [
        (torch.cat([c.layers[i].keys for c in caches])[rows], torch.cat([c.layers[i].values for c in caches])[rows])
        for i in range(len(caches[0].layers))
    ]
    batch = Cache(layers=[as_layer(keys, values) for keys, values in layers])
    while rows:
        ids = torch.tensor([[tokens[row][-1]] for row in rows])
        logits = _forward(model, ids, batch).logits[:, -1]
        chosen = logits.argmax(-1).tolist()
        taken = step_margins(logits) if margins is not None else None
        keep = []
        for place, (row, token) in enumerate(zip(rows, chosen)):
            tokens[row].append(token)
            if taken is not None:
                margins[row].append(taken[place])
            if not _ended(tokens[row], max_new, stop, eos):
                keep.append(place)
        if len(keep) < len(rows):
            index = torch.tensor(keep, dtype=torch.long)
            for layer in batch.layers:
                layer.keys, layer.values = layer.keys[index], layer.values[index]
            rows = [rows[place] for place in keep]
    return tokens, time.perf_counter() - start


@torch.no_grad()
def text_nll(model, cache, last: torch.Tensor, continuation: list[int]) -> float:
    """Mean NLL (nats per token) of `continuation` read after `cache` + `last`; the cache is cropped back after."""
    length = cache.get_seq_length()
    ids = torch.cat([last, torch.tensor([continuation[:-1]])], dim=1)
    logits = _forward(model, ids, cache).logits[0, last.shape[1] - 1 :].float()
    cache.crop(length - cache.get_seq_length())
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(continuation)))


@torch.no_grad()
def follow_ups(model, tokenizer, cache, last: torch.Tensor, questions: list[dict], max_new: int, stop, eos: set[int]):
    """The replies to a conversation's follow-up questions, asked on `cache` as the switch left it (no new prefill of
    the conversation): each `questions[i]` (`i >= 1`) is asked after the previous one's reference answer and its
    `append` text (the end of that turn and the new question), read on top of `last` (the held-back tokens) and what
    came before; the cache is cropped back after each. Returns one `{"tokens", "text", "ttft_s"}` per follow-up."""
    feed, replies = last, []
    for previous, question in zip(questions, questions[1:]):
        new = tokenizer(previous["answer"] + question["append"], add_special_tokens=False)["input_ids"]
        feed = torch.cat([feed, torch.tensor([new], dtype=feed.dtype)], dim=1)
        tokens, first, _ = greedy(model, cache, feed, max_new, stop, eos)
        text = tokenizer.decode([t for t in tokens if t not in eos])
        replies.append({"tokens": tokens, "text": text, "ttft_s": first})
    return replies


__all__ = ["continue_batch", "first_token", "follow_ups", "greedy", "rounded", "step_margins", "text_nll"]
