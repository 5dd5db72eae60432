"""The guarded handoff: gate, map, probe, then serve the mapped cache or the target's own prefill.

```python
cache, report = handoff(source, target, mapper, input_ids)
tokens = target.generate(input_ids, cache=cache, max_new_tokens=64)  # `past_key_values=` on transformers 5.23
```

`cache` covers every prompt token but the last, so `generate` runs exactly the last one. When the probe refuses the
mapped cache (or the gate refuses the models), `policy="fallback"` serves the target's own prefill instead, and the
generation is then token-identical to `target.generate(input_ids)`; `policy="fail"` raises [`HandoffRefusedError`].
The probe and its threshold come from the mapper's config (`MapperConfig.handoff_probe`, written by
[`calibrate_probe`]), or are passed explicitly.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache
from transformers.utils import logging

from ._compat import cache_argument, cache_kwargs, output_cache
from .cache import MappedCache, source_pairs
from .input_checks import (
    check_left_padding_mask,
    check_source_cache,
    check_threshold,
    check_token_ids,
    derive_mask,
    first_layer_error,
)
from .ladder import GuardLadder, rung_name, serve_rows
from .probes import PrefixAuditProbe, Probe, ProbeContext, probe_from_dict
from .repair import Draft, RepairConfig, repair_cache
from .rope import positions_from_attention_mask

logger = logging.get_logger(__name__)

POLICIES = ("fallback", "fail")
#: relative key/value error below which the audit certifies a mapping as the target's own cache
EXACT_TOLERANCE = 1e-3
#: relative key/value error at which the audit refuses a mapping outright: all-zero keys and values score exactly 1
GROSS_ERROR = 1.0


class HandoffRefusedError(RuntimeError):
    """Raised by `handoff(..., policy="fail")` when the gate or the probe refuses the mapped cache.

    Its `report` ([`HandoffReport`]) says why.
    """

    def __init__(self, message: str, report: HandoffReport):
        super().__init__(message)
        self.report = report


@dataclass
class HandoffReport:
    r"""
    What `handoff` decided and what each stage cost.

    Args:
        accepted (`bool`): the mapped cache was served.
        reason (`str`): why (`"probe passed"`, `"probe refused"`, `"incompatible: ..."`, `"mapping failed: ..."`).
        probe (`dict`, *optional*): settings of the probe that ran (`None` when the gate refused first).
        score (`float`, *optional*): the largest risk over the batch rows (the decision is taken on it).
        scores (`list[float]`): the risk of every row.
        threshold (`float`, *optional*): the risk above which the mapped cache is refused.
        policy (`str`): `"fallback"` or `"fail"`.
        hold_back (`int`): final prompt tokens the target ran itself on the mapped cache.
        audit_error (`float`, *optional*): the audit's worst relative key/value error: every layer on the first
            `audit_tokens` tokens and, once that is within `EXACT_TOLERANCE`, the first layer at every position.
        mapped_tokens (`int`): tokens the mapper produced.
        same_weights (`bool`): the caller said the models are the weights the mapper was fitted for, loaded from
            another location (the gate skipped the model-id comparison).
        notes (`list[str]`): what the handoff derived on its own (e.g. the attention mask `generate` infers).
        repair (`dict`, *optional*): what the target recomputed of the mapped cache (`mapping_info["repair"]`:
            strategy, budget, positions per row); `None` without `repair=`.
        ladder (`dict`, *optional*): what the guard ladder served each row (`rows`: `rung`, `fraction`, `risk`,
            `recomputed` tokens) and the ladder's probe and strategy; `None` without a ladder.
        timings (`dict[str, float]`): seconds per stage (`gate`, `source_prefill`, `map`, `repair`, `tail`, `audit`,
            `probe`, `fallback_prefill`, `total`); a stage that did not run is absent.
    """

    accepted: bool
    reason: str
    probe: dict[str, Any] | None = None
    score: float | None = None
    scores: list[float] = field(default_factory=list)
    threshold: float | None = None
    policy: str = "fallback"
    hold_back: int = 1
    audit_error: float | None = None
    mapped_tokens: int = 0
    repair: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    ladder: dict[str, Any] | None = None
    same_weights: bool = False
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Clock:
    def __init__(self):
        self.timings: dict[str, float] = {}
        self._start = time.perf_counter()

    def stage(self, name: str):
        clock = self

        class _Stage:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                clock.timings[name] = clock.timings.get(name, 0.0) + time.perf_counter() - self.start

        return _Stage()

    def done(self) -> dict[str, float]:
        self.timings["total"] = time.perf_counter() - self._start
        return self.timings


def _uncalibrated(missing: str, extra: str = "") -> ValueError:
    return ValueError(
        f"The mapper has no calibrated handoff probe (`config.handoff_probe` is empty) and no {missing} was passed"
        f"{extra}. Calibrate one with `hf_kvmap.calibrate_probe(...)` (benchmarks/handoff.py does it for the shipped "
        "mappers), or pass `probe=` and `threshold=` explicitly."
    )


def resolve_probe(
    mapper, probe: Probe | str | dict | None = None, threshold: float | None = None, *, optional: bool = False
):
    """The probe and threshold a handoff uses: the arguments if given, else the mapper config's `handoff_probe`.

    Raises `ValueError` when neither names a probe or a threshold (a mapper that was never calibrated), unless
    `optional=True` and neither is known (then `(None, None)`: only an exact mapping can be served). A NaN threshold
    is refused.
    """
    stored = getattr(mapper.config, "handoff_probe", None) or {}
    where = "argument" if threshold is not None else "config.handoff_probe"
    if probe is None:
        probe = stored.get("probe")
        if threshold is None:
            threshold = stored.get("threshold")
    if optional and probe is None and threshold is None:
        return None, None
    if probe is None or threshold is None:
        raise _uncalibrated("probe" if probe is None else "threshold")
    threshold = check_threshold(threshold, where)
    if not isinstance(probe, Probe):
        probe = probe_from_dict(probe)
    return probe, threshold


def _check_inputs(input_ids, attention_mask, source_cache) -> None:
    if input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids has {input_ids.shape[1]} token(s): a handoff maps all prompt tokens but the last, so it needs "
            "at least 2. Let the target prefill a 1-token prompt itself."
        )
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has {tuple(input_ids.shape)}."
        )
    if attention_mask is not None:
        check_left_padding_mask(attention_mask)
    if source_cache is not None:
        seq = source_cache.get_seq_length() if isinstance(source_cache, Cache) else source_cache[0][0].shape[2]
        if seq != input_ids.shape[1]:
            raise ValueError(
                f"source_cache covers {seq} tokens but input_ids has {input_ids.shape[1]}: pass the source's cache of "
                f"exactly these prompt tokens (`source(input_ids, use_cache=True).{cache_argument()}`)."
            )


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
def probe_context(
    source,
    target,
    mapper,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    source_cache: Cache | None = None,
    hold_back: int = 1,
    *,
    source_position_ids: torch.Tensor | None = None,
    clock: _Clock | None = None,
    target_first_layer: bool = False,
    repair=None,
) -> ProbeContext:
    """Stages 2 and 3 of `handoff`: source prefill (unless `source_cache` is given), mapping of all prompt tokens but
    the last `hold_back`, and the target's run of the held-back tokens but the last. Returns the [`ProbeContext`]
    whose `cache` covers `T - 1` tokens (with `repair`, a [`~hf_kvmap.repair.RepairConfig`], the target recomputes
    the positions it selects before the held-back tokens run). Raises `ValueError` when the mapping refuses the source
    cache.

    The positions the source cache was built at: the mask-derived ones when this function prefills it, else
    `source_position_ids` (default, as `MappedCache.from_source`: a plain forward's `0 .. T-1`)."""
    clock = clock or _Clock()
    batch, length = input_ids.shape
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    positions = positions_from_attention_mask(mask, batch, length, input_ids.device)
    if source_cache is None:
        with clock.stage("source_prefill"):
            source_cache = output_cache(
                source(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
            )
        source_position_ids = positions
    elif source_position_ids is None:  # a plain forward's
        source_position_ids = positions_from_attention_mask(None, batch, length, input_ids.device)
    with clock.stage("map"):
        cache = MappedCache.from_source(
            source_cache,
            mapper,
            hold_back=hold_back,
            attention_mask=attention_mask,
            source_position_ids=source_position_ids,
            **({"target_model": target, "input_ids": input_ids} if target_first_layer else {}),
        )
    drafts = {}
    if repair is not None:
        with clock.stage("repair"):
            if RepairConfig.from_dict(repair).selector.needs_source and source is not None:
                # the source's draft, should the strategy decode one, is kept for a probe that verifies it
                drafts["source"] = Draft(source, source_cache, input_ids, mask, source_position_ids)
            repair_cache(
                target,
                cache,
                input_ids,
                repair,
                attention_mask=mask,
                position_ids=positions,
                source=source,
                source_cache=source_cache,
                source_position_ids=source_position_ids,
                source_draft=drafts.get("source"),
            )
    tail_logits = None
    if hold_back > 1:
        with clock.stage("tail"):
            tail_logits = target(
                input_ids=input_ids[:, length - hold_back : -1],
                attention_mask=mask[:, :-1],
                position_ids=positions[:, length - hold_back : -1],
                use_cache=True,
                **cache_kwargs(cache),
            ).logits.float()
    return ProbeContext(
        source=source,
        target=target,
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        cache=cache,
        source_cache=source_cache,
        hold_back=hold_back,
        tail_logits=tail_logits,
        drafts=drafts,
        source_position_ids=source_position_ids,
    )


@torch.no_grad()
def handoff(
    source,
    target,
    mapper,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    source_cache: Cache | None = None,
    policy: str = "fallback",
    probe: Probe | str | dict | None = None,
    threshold: float | None = None,
    tokenizer=None,
    audit_tokens: int = 8,
    source_position_ids: torch.Tensor | None = None,
    target_first_layer: bool = False,
    same_weights: bool = False,
    repair: RepairConfig | dict | None = None,
    ladder: GuardLadder | dict | bool | None = None,
) -> tuple[Cache, HandoffReport]:
    r"""
    Hand a prompt from the source model to the target: check, map, probe, then serve the mapped cache or fall back.

    Stages: (1) the gate, `mapper.check_compatible(source, target, tokenizer)` (model types, KV geometry, rope,
    revisions, ids, tokenizer fingerprint); (2) the source prefill, unless `source_cache` is given (a given one is
    checked against `input_ids` at every position: its first layer depends only on each token and its position, so
    the source recomputes it from the ids for the price of an embedding lookup and two projections); (3) the mapping
    (`MappedCache.from_source`, holding back the probe's final tokens) and the target's run of the held-back tokens but
    the last; (4) the audit: the target prefills its first `audit_tokens` tokens and compares its own keys/values with
    the mapped ones (relative error, worst layer), and, when these are within `EXACT_TOLERANCE`, its own first layer with
    the mapped one at every position: within `EXACT_TOLERANCE` the mapping is the target's own cache and is
    served without the probe (so a mapper with no calibrated probe serves an exact mapping, and raises otherwise) (a probe that reads the target's confidence would otherwise refuse an exact cache where
    the target itself is unsure); at `GROSS_ERROR` or more it is no closer to the target's than all-zero tensors and
    is refused (a zeroed or mismatched mapper, which a confident target could otherwise pass); (5) the probe; (6)
    accept if every row's risk is at most the threshold. Otherwise `policy="fallback"`
    returns the target's own prefill (then `target.generate(input_ids, cache=cache, ...)` is token-identical
    to `target.generate(input_ids, ...)`), and `policy="fail"` raises [`HandoffRefusedError`]. A gate or mapping
    failure (an incompatible model, NaN in the source cache) is handled by the same policy.

    Args:
        source, target (`PreTrainedModel`): the two causal LMs.
        mapper ([`MapperModel`]): the mapper fitted for `source -> target`.
        input_ids (`torch.Tensor`): `(batch, T)` integer prompt, `T >= 2`; left padding with `attention_mask`.
        attention_mask (`torch.Tensor`, *optional*): `(batch, T)`. Without it, the mask `target.generate(input_ids)`
            infers (where the target's `generation_config.pad_token_id` occurs and is no eos token) is used, and
            recorded in `report.notes`; a pad token id after a token is refused (pass the mask).
        source_cache (`Cache`, *optional*): the source's cache of exactly these `T` tokens; without it the source
            prefills them (a probe that drafts with the source crops and regrows it, leaving its length unchanged).
        policy (`str`, *optional*, defaults to `"fallback"`): `"fallback"` or `"fail"`.
        probe (`Probe`, `str` or `dict`, *optional*): overrides the mapper's calibrated probe (name or settings).
        threshold (`float`, *optional*): overrides the calibrated threshold.
        tokenizer (*optional*): checked against the mapper's tokenizer fingerprint when given.
        audit_tokens (`int`, *optional*, defaults to 8): size of the audit (0 turns it off).
        source_position_ids (`torch.Tensor`, *optional*): `(batch, T)` positions a given left-padded `source_cache` was
            prefilled at, when they were not a plain forward's `0 .. T-1` (e.g. `generate`-style, from the mask).
        target_first_layer (`bool`, *optional*, defaults to `False`): the target computes its first layer from the
            token ids instead of reading it mapped (`MappedCache.from_source(..., target_model=, input_ids=)`; its
            keys and values depend on nothing else). The probe's calibration was made without it.
        same_weights (`bool`, *optional*, defaults to `False`): the models are the weights the mapper was fitted for,
            loaded from another location (a local copy: their model id is its path), so the gate does not compare
            model ids; every other check stays. Recorded in the report.
        repair ([`~hf_kvmap.repair.RepairConfig`] or `dict`, *optional*): the target recomputes the positions its
            strategy selects of the mapped cache, attending to the mapped rest, before the audit and the probe read it
            ([`~hf_kvmap.repair.repair_cache`]); recorded in `report.repair`. A probe calibrated without repair is
            conservative on a repaired cache.
        ladder ([`~hf_kvmap.ladder.GuardLadder`], `dict` or `bool`, *optional*): per row, serve the mapped cache,
            repair it with the fraction the ladder's probe's risk calls for, or prefill the row with the target
            ([`~hf_kvmap.ladder.serve_rows`]); recorded in `report.ladder`. Defaults to the mapper's calibrated
            `config.handoff_ladder` when it has one and neither `probe=`, `threshold=` nor `repair=` is given;
            `False` turns it off. With `policy="fail"`, a row that would fall back raises.

    Returns:
        `(cache, report)`: a cache of the first `T - 1` tokens for the target (a `MappedCache` when accepted, a
        `DynamicCache` of the target's own prefill otherwise) and a [`HandoffReport`]. The decision is taken for the
        whole batch: one refused row makes every row fall back, except under a ladder, where each row gets its own rung.

    Example:

    ```python
    >>> from hf_kvmap import MapperModel, handoff, zoo
    >>> source, target = zoo.load_model("tiny-m"), zoo.load_model("tiny-l")  # doctest: +SKIP
    >>> mapper = MapperModel.from_pretrained(zoo.mapper_path("tiny-m", "tiny-l"))  # doctest: +SKIP
    >>> cache, report = handoff(source, target, mapper, input_ids)  # doctest: +SKIP
    >>> out = target.generate(input_ids, cache=cache, max_new_tokens=8)  # doctest: +SKIP
    ```
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not one of {POLICIES}.")
    if isinstance(audit_tokens, bool) or not isinstance(audit_tokens, int) or audit_tokens < 0:
        raise ValueError(f"audit_tokens={audit_tokens!r} must be a non-negative integer (0 turns the audit off).")
    from .modeling_mapper import MapperModel

    if not isinstance(mapper, MapperModel):
        raise TypeError(f"mapper is a {type(mapper).__name__}; pass a `MapperModel` (`MapperModel.from_pretrained`).")
    input_ids = check_token_ids(input_ids, (source, target))
    _check_inputs(input_ids, attention_mask, source_cache)
    notes = []
    if attention_mask is None:
        attention_mask = derive_mask(target, input_ids)
        if attention_mask is not None:
            notes.append(
                f"attention_mask derived as generate derives it: input_ids != pad_token_id "
                f"({target.generation_config.pad_token_id}); pass attention_mask to say otherwise"
            )
    ladder = resolve_ladder(mapper, ladder, probe=probe, threshold=threshold, repair=repair)
    if ladder is not None:
        probe, threshold = probe_from_dict(ladder.probe), math.inf
    else:
        probe, threshold = resolve_probe(mapper, probe, threshold, optional=bool(audit_tokens))
    repair = None if repair is None else RepairConfig.from_dict(repair)  # bad settings raise, never fall back
    clock = _Clock()
    batch, length = input_ids.shape
    hold_back = min(probe.hold_back, length - 1) if probe is not None else 1
    settings = probe.settings() if probe is not None else None
    report = HandoffReport(
        False, "", probe=settings, threshold=threshold, policy=policy, hold_back=hold_back, notes=notes
    )
    report.same_weights = bool(same_weights)

    def refuse(reason: str) -> tuple[Cache, HandoffReport]:
        report.accepted, report.reason = False, reason
        if policy == "fail":
            report.timings = clock.done()
            raise HandoffRefusedError(
                f"Handoff refused ({reason}). Use policy='fallback' to serve the target's own prefill instead.", report
            )
        logger.info("handoff falls back to the target's own prefill: %s", reason)
        with clock.stage("fallback_prefill"):
            cache = target_prefill(target, input_ids, attention_mask)
        report.timings = clock.done()
        return cache, report

    with clock.stage("gate"):
        try:
            mapper.check_compatible(source, target, tokenizer, same_weights=same_weights)
        except ValueError as err:
            report.probe = None
            logger.warning_once(f"handoff falls back to the target's own prefill on every such request: {err}")
            return refuse(f"incompatible: {err}")
    if source_cache is not None:
        positions = source_position_ids
        if positions is None:
            positions = torch.arange(length, device=input_ids.device).expand(batch, length)
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        check_source_cache(source, source_pairs(source_cache)[0], input_ids, positions, mask)

    try:
        context = probe_context(
            source,
            target,
            mapper,
            input_ids,
            attention_mask,
            source_cache,
            hold_back,
            source_position_ids=source_position_ids,
            clock=clock,
            target_first_layer=target_first_layer,
            repair=repair,
        )
    except ValueError as err:
        return refuse(f"mapping failed: {err}")
    report.mapped_tokens = length - hold_back
    report.repair = context.cache.mapping_info.get("repair")
    if audit_tokens:
        with clock.stage("audit"):
            error = PrefixAuditProbe(audit_tokens).score(context).max().item()
            report.audit_error = error
            if error <= EXACT_TOLERANCE:  # the prefix is exact: the first layer at every position too?
                report.audit_error = max(error, first_layer_audit(target, context))
        if not error < GROSS_ERROR:  # NaN included
            return refuse(
                f"gross mapping error: the mapped keys/values of the first {audit_tokens} tokens are {error:.3g} "
                "(relative) from the target's own, no closer than zeros"
            )
        if report.audit_error <= EXACT_TOLERANCE:
            report.accepted, report.reason = True, f"exact mapping: audit error {report.audit_error:.2g}"
            report.timings = clock.done()
            return context.cache, report
    if probe is None:
        raise _uncalibrated(
            "probe", f", and the exactness audit finds the mapping inexact (error {report.audit_error:.3g})"
        )
    with clock.stage("probe"):
        scores = probe.score(context).float()
    report.scores = [float(s) for s in scores]
    report.score = max(report.scores)
    if ladder is not None:
        return _climb(ladder, context, report, clock, refuse)
    if not torch.isfinite(scores).all():
        return refuse(f"probe {probe.name} returned a non-finite risk")
    if report.score > threshold:
        return refuse(f"probe refused: {probe.name} risk {report.score:.4g} > threshold {threshold:.4g}")
    report.accepted, report.reason = True, f"probe passed: {probe.name} risk {report.score:.4g} <= {threshold:.4g}"
    report.timings = clock.done()
    return context.cache, report


def resolve_ladder(mapper, ladder=None, *, probe=None, threshold=None, repair=None) -> GuardLadder | None:
    """The ladder a handoff climbs: `ladder` if given (`False`: none), else the mapper config's `handoff_ladder`
    unless the caller chose a binary guard or a fixed repair (`probe=`, `threshold=`, `repair=`). A ladder given
    together with any of these raises: the ladder holds its own probe, thresholds and repair."""
    if ladder is False:
        return None
    if ladder is None or ladder is True:
        stored = getattr(mapper.config, "handoff_ladder", None)
        if ladder is True and not stored:
            raise ValueError(
                "ladder=True but the mapper has no calibrated ladder (`config.handoff_ladder`); calibrate one with "
                "`hf-kvmap calibrate-ladder` or pass a `GuardLadder`."
            )
        if not stored or (ladder is None and (probe is not None or threshold is not None or repair is not None)):
            return None
        ladder = stored
    if probe is not None or threshold is not None or repair is not None:
        raise ValueError(
            "A ladder holds its own probe, thresholds and repair strategy: pass `ladder=` without `probe=`, "
            "`threshold=` or `repair=` (or `ladder=False` to use those)."
        )
    return GuardLadder.from_dict(ladder)


def _climb(ladder: GuardLadder, context: ProbeContext, report: HandoffReport, clock: _Clock, refuse):
    """The ladder's end of `handoff`: each row's rung from its risk (`report.scores`), then `serve_rows`."""
    plan = ladder.plan(report.scores)  # a NaN risk takes no rung: it falls back
    settings = {"probe": ladder.probe, "strategy": ladder.strategy, "rungs": ladder.to_dict()["rungs"]}
    report.threshold = None
    if all(fraction is None for fraction in plan):
        report.ladder = {
            **settings,
            "rows": [{"rung": rung_name(None), "fraction": None, "risk": r} for r in report.scores],
        }
        return refuse(f"ladder: every row's risk is above the last rung (risks {[f'{r:.4g}' for r in report.scores]})")
    if report.policy == "fail" and any(fraction is None for fraction in plan):
        return refuse(f"ladder: row(s) {[i for i, f in enumerate(plan) if f is None]} would fall back")
    with clock.stage("repair"):
        rows = serve_rows(context, plan, ladder.strategy)
    for row, risk in zip(rows, report.scores):
        row["risk"] = risk
    report.ladder = {**settings, "rows": rows}
    report.accepted = True
    report.reason = "ladder: " + ", ".join(f"row {i} {row['rung']}" for i, row in enumerate(rows))
    report.timings = clock.done()
    return context.cache, report


def first_layer_audit(target, context: ProbeContext) -> float:
    """The worst relative error of the cache's first layer against the one `target` computes from the prompt's ids,
    over every cached position (real tokens only)."""
    layer = context.cache.layers[0]
    seq = layer.keys.shape[2]
    ids, positions, mask = context.input_ids[:, :seq], context.position_ids[:, :seq], context.attention_mask[:, :seq]
    return float(first_layer_error(target, ids, positions, mask, layer.keys, layer.values).max())


def exactness_error(target, input_ids, attention_mask, cache: Cache, *, audit_tokens: int = 8) -> float:
    """The audit `handoff` certifies exactness with, for a cache of the first `T - 1` tokens of `input_ids`: every
    layer on the first `audit_tokens` tokens, and the first layer at every position (relative error, worst)."""
    positions = positions_from_attention_mask(attention_mask, *input_ids.shape, input_ids.device)
    context = ProbeContext(None, target, input_ids, attention_mask, positions, cache, None)
    return max(PrefixAuditProbe(audit_tokens).score(context).max().item(), first_layer_audit(target, context))
