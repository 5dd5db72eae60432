"""`repair_cache`: the target recomputes the keys/values of the positions a strategy selects, attending to the cache of
the rest; the rung of the ladder between serving a mapped cache and the target's full prefill."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from ..cache_views import as_layer
from ..drafting import Draft
from ..input_checks import check_left_padding_mask
from ..rope import positions_from_attention_mask
from ..validation import check_int
from .base import RequestContext, Strategy, budget_counts, strategy_from_dict
from .recompute import recompute_positions


@dataclass
class RepairConfig:
    r"""
    How much of a mapped cache the target recomputes, and which positions.

    Args:
        strategy (`str`, `dict` or [`Strategy`], *optional*, defaults to `"tail"`): a registered strategy's name
            (`hf_kvmap.repair.STRATEGIES`), or its settings `{"name": ..., **options}`, or a [`Strategy`]; built
            once, `strategy` is then the registered [`Strategy`] (two are equal when their settings are).
        fraction (`float`, *optional*): share of each row's cached tokens to recompute, in `[0, 1]` (rounded down).
        tokens (`int`, *optional*): number of cached tokens per row to recompute instead (at most the row's tokens).

    Exactly one of `fraction` and `tokens` is given. `fraction=1.0` recomputes everything (the target's own prefill),
    `fraction=0.0` nothing.

    Example:

    ```python
    >>> from hf_kvmap.repair import RepairConfig
    >>> RepairConfig(strategy={"name": "source_attention", "last_tokens": 8}, fraction=0.2).to_dict()
    {'strategy': {'name': 'source_attention', 'last_tokens': 8}, 'fraction': 0.2, 'tokens': None}
    ```
    """

    strategy: str | dict | Strategy = "tail"
    fraction: float | None = None
    tokens: int | None = None

    def __post_init__(self):
        if (self.fraction is None) == (self.tokens is None):
            raise ValueError(
                "RepairConfig needs exactly one budget: `fraction=` (share of the cached tokens, in [0, 1]) or "
                f"`tokens=` (a count); got fraction={self.fraction!r}, tokens={self.tokens!r}."
            )
        if self.fraction is not None:
            if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)):
                raise TypeError(f"fraction={self.fraction!r} must be a number in [0, 1].")
            if not math.isfinite(self.fraction) or not 0.0 <= self.fraction <= 1.0:
                raise ValueError(f"fraction={self.fraction!r} must be in [0, 1] (0 recomputes nothing, 1 everything).")
            self.fraction = float(self.fraction)
        check_int("tokens", self.tokens, 0, allow_none=True)
        self.strategy = strategy_from_dict(self.strategy)  # the registered strategy, built once

    @property
    def selector(self) -> Strategy:
        """Deprecated (goes in 0.2): the strategy is `strategy`."""
        warnings.warn(
            "RepairConfig.selector is deprecated and goes in hf-kvmap 0.2: read RepairConfig.strategy (the built "
            "strategy).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.strategy

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy.settings(), "fraction": self.fraction, "tokens": self.tokens}

    @classmethod
    def from_dict(cls, settings: RepairConfig | dict[str, Any]) -> RepairConfig:
        """A `RepairConfig` from `to_dict()`'s output (a `RepairConfig` is returned as is)."""
        if isinstance(settings, RepairConfig):
            return settings
        if not isinstance(settings, dict):
            raise TypeError(f"repair must be a RepairConfig or a dict of its fields; got {type(settings).__name__}.")
        unknown = set(settings) - {"strategy", "fraction", "tokens"}
        if unknown:
            raise ValueError(
                f"Unknown repair settings {sorted(unknown)}; RepairConfig takes strategy, fraction, tokens."
            )
        return cls(**settings)


def _check(target, cache, input_ids, attention_mask, position_ids) -> int:
    if target is None or not hasattr(target, "get_decoder"):
        raise ValueError(
            "Repair needs the target model (`target=`), which recomputes the selected positions; got "
            f"{type(target).__name__}."
        )
    if not isinstance(cache, Cache) or not cache.layers or not all(layer.is_initialized for layer in cache.layers):
        raise ValueError("Repair needs a prefilled cache whose every layer holds keys and values.")
    layers = target.config.get_text_config(decoder=True).num_hidden_layers
    if len(cache.layers) != layers:
        raise ValueError(
            f"The cache has {len(cache.layers)} layers but the target has {layers}: it is another model's."
        )
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a (batch, T) integer tensor of the prompt; got {got}.")
    batch, length = cache.layers[0].keys.shape[0], cache.get_seq_length()
    if input_ids.shape[0] != batch or input_ids.shape[1] < length:
        raise ValueError(
            f"input_ids has shape {tuple(input_ids.shape)} but the cache covers (batch, seq) = {(batch, length)}: "
            "pass the prompt the cache was built from."
        )
    for name, tensor in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if tensor is not None and tuple(tensor.shape) != tuple(input_ids.shape):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but input_ids has {tuple(input_ids.shape)}.")
    if attention_mask is not None:
        check_left_padding_mask(attention_mask)
    return length


def candidate_positions(input_ids, attention_mask, length: int, start: int = 0) -> torch.Tensor:
    """`(batch, length)` bool: the cached positions a strategy may select (the real tokens, from `start` on)."""
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    candidates = mask.to(input_ids.device)[:, :length].bool().clone()
    candidates[:, :start] = False
    return candidates


@torch.no_grad()
def select_repair(
    target,
    input_ids: torch.Tensor,
    repair: RepairConfig | dict[str, Any],
    *,
    length: int,
    cache: Cache | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    source=None,
    source_cache: Cache | None = None,
    source_position_ids: torch.Tensor | None = None,
    source_draft: Draft | None = None,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""
    The positions `repair`'s strategy selects among the first `length` prompt positions, without recomputing them:
    what [`repair_cache`] recomputes given the same arguments, and what [`sparse_prefill`] prefills alone. A strategy
    that reads the target-side cache (`target_attention`, `early_deviation`, `oracle`) needs `cache=`; the drafting
    and query strategies read the prompt and the source only, so the selection costs no map.

    Args:
        length (`int`): cached prompt positions (the held-back tokens follow).
        Others: as [`repair_cache`].

    Returns:
        `(positions, valid)`: `(batch, n)` long, each row's selections ascending then filler slots, and their mask
        (`repair_cache(..., selection=)` takes the pair).
    """
    repair = RepairConfig.from_dict(repair)
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= input_ids.shape[1]:
        raise ValueError(f"length={length!r} must be an int in [1, {input_ids.shape[1]}] (the cached positions).")
    strategy = repair.strategy
    if strategy.needs_source and (source is None or source_cache is None):
        raise ValueError(
            f"Repair strategy {strategy.name!r} reads the source model and its cache: pass `source=` and "
            "`source_cache=` (or choose a strategy that does not, e.g. 'tail' or 'early_deviation')."
        )
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= length:
        raise ValueError(f"start={start!r} must be an integer in [0, {length}].")
    if source_cache is not None and not isinstance(source_cache, Cache):  # a sequence of (keys, values) pairs
        source_cache = Cache(layers=[as_layer(keys, values) for keys, values in source_cache])
    batch, width = input_ids.shape
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    mask = mask.to(input_ids.device).long()
    if position_ids is None:
        position_ids = positions_from_attention_mask(attention_mask, batch, width, input_ids.device)
    candidates = candidate_positions(input_ids, attention_mask, length, start)
    context = RequestContext(
        target=target,
        cache=cache,
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids,
        candidates=candidates,
        source=source,
        source_cache=source_cache,
        source_position_ids=source_position_ids,
        drafts={} if source_draft is None else {"source": source_draft},
    )
    return strategy.select(context, budget_counts(candidates, repair.fraction, repair.tokens))


@torch.no_grad()
def apply_repair(
    target,
    cache: Cache,
    input_ids: torch.Tensor,
    repair: RepairConfig | dict[str, Any] | None,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    source=None,
    source_cache: Cache | None = None,
    source_position_ids: torch.Tensor | None = None,
    source_draft: Draft | None = None,
    start: int = 0,
    selection: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[int]:
    r"""
    The one door to the recompute: every change of a cache's keys/values by the target goes through here (the serving
    pipeline's fixed repair and repairing rungs, a session's switch, [`repair_cache`], [`DecodeRefresh`] and the
    deprecated `MappedCache.from_source(repair=)`). The target recomputes the selected positions of `cache` in place
    ([`recompute_positions`]) and they are marked recomputed (`cache.recomputed`, what a later refresh skips).

    Args:
        repair ([`RepairConfig`], `dict` or `None`): strategy and budget; the recompute is then recorded in the
            cache's `mapping_info["repair"]` (see [`repair_cache`]). `None` with `selection`: recompute those
            positions and record nothing (a refresh keeps its own record).
        selection (`tuple`, *optional*): `(positions, valid)`, `(batch, n)`, as [`select_repair`] returns them:
            recompute those instead of selecting.
        Others: as [`repair_cache`].

    Returns:
        `list[int]`: per row, the positions recomputed: the budget of `repair` over the row's candidates, or the
        valid slots of `selection` without `repair`.
    """
    if repair is None and selection is None:
        raise ValueError(
            "apply_repair needs what to recompute: `repair=` (a RepairConfig: strategy and budget) or `selection=` "
            "(the `(positions, valid)` select_repair returned)."
        )
    repair = None if repair is None else RepairConfig.from_dict(repair)
    length = _check(target, cache, input_ids, attention_mask, position_ids)
    if selection is None:
        selection = select_repair(
            target,
            input_ids,
            repair,
            length=length,
            cache=cache,
            attention_mask=attention_mask,
            position_ids=position_ids,
            source=source,
            source_cache=source_cache,
            source_position_ids=source_position_ids,
            source_draft=source_draft,
            start=start,
        )
    positions, valid = selection
    counts = valid.sum(-1).tolist()
    mask = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).to(input_ids.device).long()
    if position_ids is None:
        position_ids = positions_from_attention_mask(attention_mask, *input_ids.shape, input_ids.device)
    recompute_positions(
        target,
        cache,
        input_ids,
        positions,
        valid,
        token_mask=mask[:, :length],
        position_ids=position_ids[:, :length],
    )
    mark_recomputed(cache, positions, valid, length)
    if repair is None:
        return counts
    candidates = candidate_positions(input_ids, attention_mask, length, start)
    available = candidates.sum(-1).tolist()
    exact = start == 0 and counts == available
    record = {
        **repair.to_dict(),
        "recomputed": counts,
        "candidates": available,
        "recomputed_fraction": sum(counts) / max(sum(available), 1),
        "exact": exact,
    }
    if keeps_record(cache):  # a MappedCache: the object and its record say the same
        cache.record_repair(record)
    return budget_counts(candidates, repair.fraction, repair.tokens)


@torch.no_grad()
def repair_cache(
    target,
    cache: Cache,
    input_ids: torch.Tensor,
    repair: RepairConfig | dict[str, Any],
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    source=None,
    source_cache: Cache | None = None,
    source_position_ids: torch.Tensor | None = None,
    source_draft: Draft | None = None,
    start: int = 0,
    selection: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Cache:
    r"""
    Have the target recompute the keys/values of the cached positions `repair`'s strategy selects, through every
    target layer in one forward, each attending to the cache of the positions before it; the recomputed keys/values
    replace the cached ones.

    Args:
        target (`PreTrainedModel`): the model that reads the cache (`sdpa` or `eager` attention).
        cache (`Cache`): its cache of the first `length` prompt tokens (a `MappedCache`, typically); changed in place.
        input_ids (`torch.Tensor`): `(batch, T)` prompt, `T >= length` (the held-back tokens may follow).
        repair ([`RepairConfig`] or `dict`): strategy and budget.
        attention_mask (`torch.Tensor`, *optional*): `(batch, T)` 0/1 mask of a left-padded batch.
        position_ids (`torch.Tensor`, *optional*): `(batch, T)` positions the target reads the prompt at; defaults to
            the mask's (`cumsum - 1`), or `0 .. T-1`.
        source (`PreTrainedModel`, *optional*), source_cache (`Cache`, *optional*): the source model and its cache of
            the `T` prompt tokens, for the strategies that read them (`Strategy.needs_source`).
        source_position_ids (`torch.Tensor`, *optional*): `(batch, T)` positions the source cache was built at;
            defaults to a plain forward's `0 .. T-1`.
        source_draft ([`Draft`], *optional*): the source's greedy draft after this prompt as far as the request
            decoded it (a guard probe's); a strategy that drafts (`draft_attention`) continues it instead of decoding
            it again. Ignored unless it drafts after these `input_ids` at the source's positions.
        start (`int`, *optional*, defaults to 0): the first position a strategy may select (the ones before it are,
            e.g., the target's own already).
        selection (`tuple`, *optional*): `(positions, valid)` as [`select_repair`] returned them for these
            arguments: recompute those instead of selecting again (a sparse prefill and a repair served side by
            side share one selection).

    Returns:
        `cache`. Where it has a `mapping_info` (a `MappedCache`), `mapping_info["repair"]` records the strategy, the
        budget, how many positions were recomputed per row (`recomputed`, of `candidates`) and whether that was all
        of them (`exact`: every position from 0 recomputed, so the cache is the target's own prefill up to float
        rounding); the cache's `approximate` and `mapping_info["approximate"]` are `False` only then.
    """
    apply_repair(
        target,
        cache,
        input_ids,
        RepairConfig.from_dict(repair),
        attention_mask=attention_mask,
        position_ids=position_ids,
        source=source,
        source_cache=source_cache,
        source_position_ids=source_position_ids,
        source_draft=source_draft,
        start=start,
        selection=selection,
    )
    return cache


def keeps_record(cache: Cache) -> bool:
    """Whether `cache` records what is done to it (a `MappedCache`: `record_repair`, `record_recomputed`,
    `record_step`); another cache is recomputed in place and records nothing. (Asked of the object, not with
    `isinstance`, while the cache's deprecated `from_source(repair=)` imports this package: goes in 0.2.)"""
    return callable(getattr(cache, "record_repair", None))


def recomputed_mask(cache: Cache, batch: int, length: int) -> torch.Tensor:
    """`(batch, length)` bool: the positions of `cache` the target recomputed so far (a `MappedCache`'s
    `recomputed`), all `False` where the cache has no such record."""
    done = torch.zeros(batch, length, dtype=torch.bool)
    before = getattr(cache, "recomputed", None)
    if isinstance(before, torch.Tensor) and before.dim() == 2 and before.shape[0] == batch:
        width = min(before.shape[1], length)
        done[:, :width] = before[:, :width].cpu()
    return done


def selected_mask(selection: tuple[torch.Tensor, torch.Tensor], length: int) -> torch.Tensor:
    """`(batch, length)` bool: the valid positions of a repair's `selection` (`(positions, valid)`, `(batch, n)`, as
    [`select_repair`] returns it)."""
    positions, valid = selection
    mask = torch.zeros(positions.shape[0], length, dtype=torch.bool)
    for row in range(positions.shape[0]):
        mask[row, positions[row][valid[row]].cpu()] = True
    return mask


def mark_recomputed(cache: Cache, positions: torch.Tensor, valid: torch.Tensor, length: int) -> torch.Tensor:
    """The positions recomputed so far and the `valid` `positions` (`(batch, n)`, a recompute's selection),
    `(batch, length)` bool, recorded on a cache that keeps a record (`MappedCache.record_recomputed`): what a later
    refresh while decoding (`DecodeRefresh`) skips."""
    done = recomputed_mask(cache, positions.shape[0], length) | selected_mask((positions, valid), length)
    if keeps_record(cache):
        cache.record_recomputed(done)
    return done


__all__ = ["RepairConfig", "apply_repair", "repair_cache", "select_repair"]
