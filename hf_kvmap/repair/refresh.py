"""Repair while the target decodes: every `every` generated tokens, the target recomputes the cached prompt positions
its own latest queries read most, in place of their mapped keys/values.

A repair before the first token (`repair_cache`) chooses positions from what the answer's first tokens read: the
source's short draft, or the prompt's last tokens. An answer that runs long (a function body, a continuation) reads
other spans as it goes, and a mapped key/value that none of the first tokens read is never repaired. `DecodeRefresh`
is a `transformers` logits processor: at every `every`-th step it scores the prompt positions with a registered
strategy that reads the target (by default `target_attention` over the last `every` generated tokens' queries,
`reduce="max"`), recomputes the best `tokens` of those not recomputed yet (through `apply_repair`, the one door to
the recompute: each attends to the cache before it), and leaves the step's scores alone. The first token is as fast
as without it; the cost is paid during decoding and recorded:

```python
from hf_kvmap.repair import DecodeRefresh

cache = MappedCache.from_source(source_cache, mapper)
repair_cache(target, cache, ids, RepairConfig("draft_attention", fraction=0.1), source=source, source_cache=...)
refresh = DecodeRefresh(target, cache, every=16, tokens=64)
target.generate(ids, past_key_values=cache, logits_processor=[refresh], max_new_tokens=256)
cache.mapping_info["refresh"]  # {"refreshes": ..., "recomputed": [...], "seconds": ...}
```

The tokens already generated keep the keys/values they were computed with (as any selective recompute leaves the
positions after a repaired one); only the prompt's positions are recomputed, each at most once (the ones a repair
before the first token recomputed are skipped, `cache.recomputed`).
"""

from __future__ import annotations

import time
import warnings

import torch
from transformers import LogitsProcessor

from ..rope import positions_from_attention_mask
from ..validation import check_int
from .base import RequestContext, strategy_from_dict
from .repair import apply_repair, keeps_record, recomputed_mask

#: what the refresh reads by default: the most any of the latest generated tokens' queries pays a position
DEFAULT_STRATEGY = {"name": "target_attention", "reduce": "max"}


class DecodeRefresh(LogitsProcessor):
    r"""
    A logits processor that repairs the cached prompt positions the target reads while it decodes.

    Args:
        target (`PreTrainedModel`): the model that decodes (the one `generate` is called on).
        cache (`Cache`): the cache `generate` is given: the target-side cache of the prompt (mapped, maybe repaired).
            Its length when the processor is built is the prompt part that can be recomputed.
        every (`int`, *optional*, defaults to 16): generated tokens between two refreshes.
        tokens (`int`, *optional*): prompt positions recomputed per refresh (per row).
        fraction (`float`, *optional*): that count as a share of the cached prompt tokens (exactly one of `tokens`
            and `fraction`).
        limit (`float`, *optional*, defaults to 1.0): share of the cached prompt tokens the refreshes recompute at
            most, all together.
        strategy (`str` or `dict`, *optional*): the registered strategy that scores the positions; it must read only
            the target (not the source, whose cache holds none of the generated tokens). Defaults to
            `target_attention` over the last `every` tokens' queries with `reduce="max"`.
        attention_mask (`torch.Tensor`, *optional*): `(batch, T)` mask of the left-padded prompt given to `generate`.
    """

    def __init__(
        self,
        target,
        cache,
        *,
        every: int = 16,
        tokens: int | None = None,
        fraction: float | None = None,
        limit: float = 1.0,
        strategy: str | dict | None = None,
        attention_mask: torch.Tensor | None = None,
    ):
        check_int("every", every, 1)
        if (tokens is None) == (fraction is None):
            raise ValueError(
                f"DecodeRefresh needs exactly one budget per refresh: tokens= or fraction=; got tokens={tokens!r}, "
                f"fraction={fraction!r}."
            )
        check_int("tokens", tokens, 1, allow_none=True)
        for name, value in (("fraction", fraction), ("limit", limit)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(f"{name}={value!r} must be a number in (0, 1].")
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"{name}={value!r} must be in (0, 1].")
        if strategy is None:
            strategy = {**DEFAULT_STRATEGY, "last_tokens": every}
        self.strategy = strategy_from_dict(strategy)
        if self.strategy.needs_source:
            raise ValueError(
                f"Repair strategy {self.strategy.name!r} reads the source, whose cache holds none of the generated "
                "tokens; a refresh needs one that reads the target (e.g. 'target_attention')."
            )
        if not cache.layers or not all(layer.is_initialized for layer in cache.layers):
            raise ValueError("DecodeRefresh needs the prefilled cache generate will read.")
        self.target, self.cache = target, cache
        self.every, self.tokens, self.fraction, self.limit = every, tokens, fraction, float(limit)
        self.length = cache.get_seq_length()
        self.prompt_mask = attention_mask
        self.batch = cache.layers[0].keys.shape[0]
        self.steps = 0
        self.refreshes = 0
        self.recomputed = [0] * self.batch
        self.seconds = 0.0
        self._done = recomputed_mask(cache, self.batch, self.length)  # before the first token: the cache's record
        self._record()

    @property
    def selector(self):
        """Deprecated (goes in 0.2): the strategy is `strategy`."""
        warnings.warn(
            "DecodeRefresh.selector is deprecated and goes in hf-kvmap 0.2: read DecodeRefresh.strategy.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.strategy

    @property
    def done(self) -> torch.Tensor:
        """`(batch, length)` bool: the prompt positions recomputed so far, before the first token or by a refresh."""
        return self._done

    def _budget(self, available: torch.Tensor) -> list[int]:
        """Positions per row this refresh: the per-refresh budget (`fraction` a share of the cached prompt, not of
        what is left of it), at most the row's candidates and what `limit` leaves."""
        each = self.tokens if self.tokens is not None else int(self.fraction * self.length + 1e-9)
        cap = int(self.limit * self.length + 1e-9)
        return [max(0, min(each, n, cap - done)) for n, done in zip(available.sum(-1).tolist(), self.recomputed)]

    def _record(self) -> None:
        if keeps_record(self.cache):  # a MappedCache records it as `mapping_info["refresh"]`
            self.cache.record_step(
                "refresh",
                {
                    "strategy": self.strategy.settings(),
                    "every": self.every,
                    "tokens": self.tokens,
                    "fraction": self.fraction,
                    "limit": self.limit,
                    "refreshes": self.refreshes,
                    "recomputed": list(self.recomputed),
                    "recomputed_fraction": sum(self.recomputed) / max(self.length * len(self.recomputed), 1),
                    "seconds": self.seconds,
                },
            )

    @torch.no_grad()
    def refresh(self, input_ids: torch.Tensor) -> list[int]:
        """Recompute the next positions now; `input_ids` is the whole sequence the cache holds (`(batch, T)`).
        Returns how many positions each row recomputed."""
        start = time.perf_counter()
        batch, width = input_ids.shape
        if self.cache.get_seq_length() != width or width <= self.length:
            raise ValueError(
                f"The cache holds {self.cache.get_seq_length()} tokens and the sequence {width}; a refresh runs after "
                f"generated tokens were added to the {self.length}-token prompt cache it was built on."
            )
        mask = torch.ones_like(input_ids)
        if self.prompt_mask is not None:
            mask[:, : self.prompt_mask.shape[1]] = self.prompt_mask.to(mask.device)
        candidates = torch.zeros(batch, width, dtype=torch.bool, device=input_ids.device)
        candidates[:, : self.length] = mask[:, : self.length].bool() & ~self.done.to(input_ids.device)
        counts = self._budget(candidates)
        if not any(counts):
            return counts
        context = RequestContext(
            target=self.target,
            cache=self.cache,
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions_from_attention_mask(
                mask if self.prompt_mask is not None else None, batch, width, input_ids.device
            ),
            candidates=candidates,
        )
        selection = self.strategy.select(context, counts)
        apply_repair(  # the one door to the recompute; the refresh keeps its own record (`_record`)
            self.target,
            self.cache,
            input_ids,
            None,
            attention_mask=mask,
            position_ids=context.position_ids,
            selection=selection,
        )
        positions, valid = selection
        for row in range(positions.shape[0]):
            self._done[row, positions[row][valid[row]].cpu()] = True
        self.recomputed = [done + count for done, count in zip(self.recomputed, counts)]
        self.refreshes += 1
        self.seconds += time.perf_counter() - start
        self._record()
        return counts

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.steps += 1
        if self.steps % self.every == 0:
            self.refresh(input_ids)
        return scores


__all__ = ["DEFAULT_STRATEGY", "DecodeRefresh"]
