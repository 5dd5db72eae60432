"""A model's greedy continuation of a prompt, decoded on demand from its cache of the prompt and kept, so that the
readers of one request decode it once: a probe that verifies the source's draft (`draft_agreement`,
`confident_draft`), a probe that reads the target's first answer tokens (`lookahead_margin`), and the repair strategy
that reads the source's attention while it drafts (`draft_attention`).

```python
draft = Draft(source, source_cache, input_ids, attention_mask, position_ids)
draft.tokens(4)            # the probe's four tokens
draft.tokens(8, eos=[2])   # the repair's: four more, or fewer once every row has ended its answer
```
"""

from __future__ import annotations

import time

import torch
from transformers.cache_utils import Cache

from ._compat import cache_kwargs
from .cache_views import as_layer, prefix_view


class Draft:
    r"""
    The tokens `model` decodes greedily after a prompt, decoded as far as a reader asks and kept for the next reader.
    The given cache is read, never changed: decoding appends to views of its first `T - 1` positions.

    Args:
        model (`PreTrainedModel`): a causal LM.
        cache (`Cache`): its cache of at least the first `T - 1` prompt tokens (the rest is not read).
        input_ids (`torch.Tensor`): `(batch, T)` prompt, left padding allowed.
        attention_mask (`torch.Tensor`): `(batch, T)` 0/1.
        position_ids (`torch.Tensor`): `(batch, T)` positions the cache was built at.
    """

    def __init__(self, model, cache: Cache, input_ids: torch.Tensor, attention_mask, position_ids):
        length = input_ids.shape[1]
        if cache.get_seq_length() < length - 1:
            raise ValueError(
                f"Drafting from a {length}-token prompt needs a cache of its first {length - 1} tokens; this one "
                f"covers {cache.get_seq_length()}."
            )
        self.model = model
        self.input_ids = input_ids
        self.position_ids = position_ids
        self._work = prefix_view(cache, length - 1)
        self._next = input_ids[:, -1:]
        self._mask = attention_mask
        self._position = position_ids[:, -1:]
        self._tokens: list[torch.Tensor] = []  # (batch, 1) each
        self._top2: list[torch.Tensor] = []  # (batch, 2) each: the step's two largest probabilities
        #: wall-clock seconds of each decoding step (what a reader that continues this draft does not spend)
        self.step_seconds: list[float] = []

    @property
    def steps(self) -> int:
        """Tokens decoded so far."""
        return len(self._tokens)

    def reads(self, model, input_ids: torch.Tensor, position_ids: torch.Tensor) -> bool:
        """Whether this is the draft of `model` after `input_ids` at `position_ids` (so a reader may share it)."""
        return (
            model is self.model
            and input_ids.shape == self.input_ids.shape
            and torch.equal(input_ids, self.input_ids)
            and torch.equal(position_ids.to(self.position_ids.device), self.position_ids)
        )

    def _ended_at(self, eos: list[int] | None) -> int | None:
        """The first step after which every row has drafted one of `eos` (`None`: not yet, or no `eos`)."""
        if not eos or not self._tokens:
            return None
        tokens = torch.cat(self._tokens, dim=1)
        ended = torch.isin(tokens, torch.tensor(eos, device=tokens.device)).long().cummax(-1).values.all(0)
        hits = ended.nonzero()
        return int(hits[0]) + 1 if len(hits) else None

    @torch.no_grad()
    def _extend(self, steps: int, eos: list[int] | None) -> None:
        while self.steps < steps and self._ended_at(eos) is None:
            start = time.perf_counter()
            logits = self.model(
                input_ids=self._next,
                attention_mask=self._mask,
                position_ids=self._position,
                use_cache=True,
                **cache_kwargs(self._work),
            ).logits[:, -1]
            self._next = logits.argmax(-1, keepdim=True)
            self._tokens.append(self._next)
            self._top2.append(logits.float().softmax(-1).topk(2, dim=-1).values)
            self._mask = torch.cat([self._mask, self._mask.new_ones(self._mask.shape[0], 1)], dim=1)
            self._position = self._position + 1
            self.step_seconds.append(time.perf_counter() - start)

    def tokens(self, steps: int, eos: list[int] | None = None) -> torch.Tensor:
        """`(batch, n)` greedy tokens, `n = steps`, or fewer with `eos` (end-of-sequence ids): up to the first step
        after which every row has drafted one, as `generate(do_sample=False)` would give after the prompt."""
        self._extend(steps, eos)
        end = self._ended_at(eos)
        return torch.cat(self._tokens[: min(steps, end or steps)], dim=1)

    def top2(self, steps: int) -> torch.Tensor:
        """`(batch, steps, 2)` float: the two largest next-token probabilities at each of the first `steps` steps (the
        first is the drafted token's)."""
        self._extend(steps, None)
        return torch.stack(self._top2[:steps], dim=1)

    def rows(self, index: torch.Tensor) -> Draft:
        """The draft of rows `index` only: this draft itself when they are all its rows in order, else a new object
        (decoding it further leaves this one as it is)."""
        if torch.equal(index.cpu(), torch.arange(self.input_ids.shape[0])):
            return self
        part = Draft.__new__(Draft)
        part.model = self.model
        part.input_ids = self.input_ids[index]
        part.position_ids = self.position_ids[index]
        part._work = Cache(
            layers=[
                as_layer(layer.keys[index.to(layer.keys.device)], layer.values[index.to(layer.values.device)])
                for layer in self._work.layers
            ]
        )
        part._next = self._next[index]
        part._mask = self._mask[index]
        part._position = self._position[index]
        part._tokens = [tokens[index] for tokens in self._tokens]
        part._top2 = [top[index.to(top.device)] for top in self._top2]
        part.step_seconds = list(self.step_seconds)
        return part


@torch.no_grad()
def greedy_draft(
    model,
    cache: Cache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    steps: int,
    eos: list[int] | None = None,
) -> torch.Tensor:
    r"""
    The `steps` tokens `model` decodes greedily after the prompt, from its cache of the prompt (left unchanged): a
    one-reader [`Draft`], whose arguments the first five are.

    Args:
        steps (`int`): tokens to decode.
        eos (`list[int]`, *optional*): end-of-sequence ids; decoding stops early once every row has drafted one.

    Returns:
        `(batch, n)` token ids, `n <= steps`, as `generate(do_sample=False)` would give after the prompt.
    """
    return Draft(model, cache, input_ids, attention_mask, position_ids).tokens(steps, eos)


__all__ = ["Draft", "greedy_draft"]
