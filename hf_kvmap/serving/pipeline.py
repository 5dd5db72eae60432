"""Serving a batch of requests, the one way every front door takes: `handoff`, `HandoffSession`, the ladder's item
measurement (`hf_kvmap.calibration.ladder_items`) and the evaluation harness all call these functions.

Stages, in order, each timed in the [`HandoffReport`]:

1. `gate`: `MapperModel.check_compatible` (model types, KV geometry, rope, revisions, ids, tokenizer fingerprint);
2. `source_prefill`: the source prefills the prompt, unless its cache is given ([`prepare_context`]);
3. `map`: `MappedCache.from_source`, holding back the probe's final tokens ([`map_and_repair`]);
4. `repair`: a fixed [`~hf_kvmap.repair.RepairConfig`] has the target recompute what it selects
   (`hf_kvmap.repair.apply_repair`, the one door to the recompute);
5. `held_back`: the target runs the held-back tokens but the last on the served cache ([`run_tokens`]);
6. `audit`: the target's own keys/values of the first tokens and its own first layer against the mapped ones; an
   exact mapping is served as it is, a gross one refused;
7. `probe`: one risk per row;
8. the decision: with a ladder, a rung per row ([`serve_rows`]: mapped, repaired, or the target's own prefill of
   the row, which a row shorter than the ladder's `min_tokens` always gets; a batch of such rows is refused before
   stage 2), then, where the ladder has a `min_margin`, the `check`: the target's margin on each served row's first
   answer token, or its smallest over the first `check_tokens` ([`answer_margin`]), and the fallback for a row below
   it ([`check_rows`]); without a ladder, the whole batch is served if every risk is within the threshold;
9. `fallback_prefill`: a refused batch gets the target's own prefill (`policy="fallback"`) or raises
   [`HandoffRefusedError`] (`policy="fail"`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache
from transformers.utils import logging

from .._compat import output_cache
from ..cache import CACHE_DTYPES, MappedCache, source_pairs
from ..deprecation import deprecated_names
from ..drafting import Draft
from ..input_checks import check_source_cache
from ..repair import RepairConfig, apply_repair
from ..request_context import RequestContext, legacy_context
from ..rope import positions_from_attention_mask
from .audit import exactness_error, first_layer_audit
from .forwards import answer_margin, run_tokens, target_prefill
from .ladder import GuardLadder, rung_name
from .probes import Probe
from .probes.prefix_audit import PrefixAuditProbe
from .report import Clock, HandoffRefusedError, HandoffReport
from .rows import Refused, check_rows, climb, ladder_settings, own_rows, real_lengths, serve_rows

logger = logging.get_logger(__name__)

#: relative key/value error below which the audit certifies a mapping as the target's own cache
EXACT_TOLERANCE = 1e-3
#: relative key/value error at which the audit refuses a mapping outright: all-zero keys and values score exactly 1
GROSS_ERROR = 1.0


#: the old request, `(source, target, mapper, input_ids, attention_mask, source_cache, ...)` positionally
_Request = legacy_context(
    "RequestContext",
    ("source", "target", "mapper", "input_ids", "attention_mask", "source_cache", "source_position_ids", "tokenizer")
    + ("target_first_layer", "same_weights"),
)


def uncalibrated_error(missing: str, extra: str = "") -> ValueError:
    return ValueError(
        f"The mapper has no calibrated handoff probe (`config.handoff_probe` is empty) and no {missing} was passed"
        f"{extra}. Calibrate one with `hf_kvmap.calibrate_probe(...)` (benchmarks/handoff/handoff.py does it for the shipped "
        "mappers), or pass `probe=` and `threshold=` explicitly."
    )


# ------------------------------------------------------------------------------------------------ the stages


def serving_dtype(model) -> torch.dtype | None:
    """The dtype `model` computes its attention in (its parameters'), that a cache it reads must hold: a source,
    mapper and target may each be float32, bfloat16 or float16."""
    dtype = getattr(model, "dtype", None)
    return dtype if dtype in CACHE_DTYPES else None


@torch.no_grad()
def map_and_repair(
    source,
    target,
    mapper,
    input_ids: torch.Tensor,
    source_cache,
    *,
    attention_mask: torch.Tensor | None = None,
    hold_back: int = 1,
    source_position_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    target_first_layer: bool = False,
    repair: RepairConfig | None = None,
    clock: Clock | None = None,
) -> tuple[MappedCache, dict[str, Draft]]:
    """Stages 3 and 4: the mapped cache of all prompt tokens but the last `hold_back`, then, with `repair` (a
    `RepairConfig`), the positions it selects recomputed by the target. Returns the cache and the drafts decoded on
    the way (the source's, when the strategy reads the source: a probe that verifies it shares it)."""
    clock = clock or Clock()
    with clock.stage("map"):
        cache = MappedCache.from_source(
            source_cache,
            mapper,
            dtype=serving_dtype(target),  # the probes and the rungs read it with the target, in its dtype
            hold_back=hold_back,
            attention_mask=attention_mask,
            source_position_ids=source_position_ids,
            position_ids=position_ids,
            first_layer="target" if target_first_layer else "mapped",
            **({"target_model": target, "input_ids": input_ids} if target_first_layer else {}),
        )
    drafts = {}
    if repair is not None:
        batch, length = input_ids.shape
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        built = source_position_ids if source_position_ids is not None else position_ids
        if built is None:  # a plain forward's
            built = positions_from_attention_mask(None, batch, length, input_ids.device)
        with clock.stage("repair"):
            if repair.strategy.needs_source and source is not None:
                drafts["source"] = Draft(source, source_cache, input_ids, mask, built)
            apply_repair(
                target,
                cache,
                input_ids,
                repair,
                attention_mask=mask,
                position_ids=position_ids,
                source=source,
                source_cache=source_cache,
                source_position_ids=built,
                source_draft=drafts.get("source"),
            )
    return cache, drafts


@torch.no_grad()
def prepare_context(
    source,
    target,
    mapper,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    source_cache: Cache | None = None,
    hold_back: int = 1,
    *,
    source_position_ids: torch.Tensor | None = None,
    clock: Clock | None = None,
    target_first_layer: bool = False,
    repair: RepairConfig | None = None,
) -> RequestContext:
    """Stages 2 to 5: the source prefill (unless `source_cache` is given), the mapping of all prompt tokens but the
    last `hold_back`, the fixed `repair`, and the target's run of the held-back tokens but the last. Returns the
    [`RequestContext`] whose `cache` covers `T - 1` tokens. Raises `ValueError` when the mapping refuses the source
    cache.

    The positions the source cache was built at: the mask-derived ones when this function prefills it, else
    `source_position_ids` (default, as `MappedCache.from_source`: a plain forward's `0 .. T-1`)."""
    clock = clock or Clock()
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
    cache, drafts = map_and_repair(
        source,
        target,
        mapper,
        input_ids,
        source_cache,
        attention_mask=attention_mask,
        hold_back=hold_back,
        source_position_ids=source_position_ids,
        target_first_layer=target_first_layer,
        repair=repair,
        clock=clock,
    )
    tail_logits = None
    if hold_back > 1:
        with clock.stage("held_back"):
            tail_logits = run_tokens(target, cache, input_ids, length - hold_back, length - 1, mask, positions).float()
    return RequestContext(
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


# ------------------------------------------------------------------------------------------------ the audit


def _audit(target, context: RequestContext, audit_tokens: int, report: HandoffReport, clock: Clock) -> bool:
    """Stage 6: whether the mapping is exact (then it is served as it is); raises `Refused` for a gross one."""
    with clock.stage("audit"):
        error = PrefixAuditProbe(audit_tokens).score(context).max().item()
        report.audit_error = error
        if error <= EXACT_TOLERANCE:  # the prefix is exact: the first layer at every position too?
            report.audit_error = max(error, first_layer_audit(target, context))
    if not error < GROSS_ERROR:  # NaN included
        raise Refused(
            f"gross mapping error: the mapped keys/values of the first {audit_tokens} tokens are {error:.3g} "
            "(relative) from the target's own, no closer than zeros"
        )
    return report.audit_error <= EXACT_TOLERANCE


# ------------------------------------------------------------------------------------------------ the decision


def _short_batch(ladder: GuardLadder, request: RequestContext, report: HandoffReport) -> None:
    """Before the mapping: a batch whose every prompt is below the ladder's `min_tokens` is refused (raises
    `Refused`), unmapped: the target's own prefill of it is sooner than any rung."""
    lengths = real_lengths(request.input_ids, request.attention_mask)
    if ladder.min_tokens is None or not all(ladder.too_short(n) for n in lengths):
        return
    report.ladder = {
        **ladder_settings(ladder),
        "rows": [{"rung": rung_name(None), "fraction": None, "short": True} for _ in lengths],
    }
    raise Refused(
        f"ladder: every prompt is shorter than min_tokens={ladder.min_tokens} (longest {max(lengths)} tokens): the "
        "target's own prefill is sooner there"
    )


def _threshold(probe: Probe, scores: torch.Tensor, threshold: float, report: HandoffReport) -> None:
    """Stage 8 without a ladder: the whole batch is served if every row's risk is within the threshold."""
    if not torch.isfinite(scores).all():
        raise Refused(f"probe {probe.name} returned a non-finite risk")
    if report.score > threshold:
        raise Refused(f"probe refused: {probe.name} risk {report.score:.4g} > threshold {threshold:.4g}")
    report.accepted, report.reason = True, f"probe passed: {probe.name} risk {report.score:.4g} <= {threshold:.4g}"


def _serve_mapped(
    request: RequestContext,
    report: HandoffReport,
    clock: Clock,
    *,
    probe,
    threshold,
    ladder,
    repair,
    audit_tokens: int,
) -> Cache:
    """Stages 1 to 8; raises `Refused` where a stage refuses the mapped cache."""
    source, target, mapper, input_ids = request.source, request.target, request.mapper, request.input_ids
    attention_mask, source_cache = request.attention_mask, request.source_cache
    with clock.stage("gate"):
        try:
            mapper.check_compatible(source, target, request.tokenizer, same_weights=report.same_weights)
        except ValueError as err:
            report.probe = None
            logger.warning_once(f"handoff falls back to the target's own prefill on every such request: {err}")
            raise Refused(f"incompatible: {err}") from None
    if ladder is not None:
        _short_batch(ladder, request, report)
    batch, length = input_ids.shape
    if source_cache is not None:
        positions = request.source_position_ids
        if positions is None:
            positions = torch.arange(length, device=input_ids.device).expand(batch, length)
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        check_source_cache(source, source_pairs(source_cache)[0], input_ids, positions, mask)
    try:
        context = prepare_context(
            source,
            target,
            mapper,
            input_ids,
            attention_mask,
            source_cache,
            report.hold_back,
            source_position_ids=request.source_position_ids,
            clock=clock,
            target_first_layer=request.target_first_layer,
            repair=repair,
        )
    except ValueError as err:
        raise Refused(f"mapping failed: {err}") from None
    report.mapped_tokens = length - report.hold_back
    report.repair = context.cache.mapping_info.get("repair")
    if audit_tokens and _audit(target, context, audit_tokens, report, clock):
        report.accepted, report.reason = True, f"exact mapping: audit error {report.audit_error:.2g}"
        return context.cache
    if probe is None:
        raise uncalibrated_error(
            "probe", f", and the exactness audit finds the mapping inexact (error {report.audit_error:.3g})"
        )
    with clock.stage("probe"):
        scores = probe.risks(context)
    report.scores = [float(s) for s in scores]
    report.score = max(report.scores)
    if ladder is not None:
        return climb(ladder, context, report, clock)
    _threshold(probe, scores, threshold, report)
    return context.cache


@torch.no_grad()
def serve(
    request: RequestContext,
    *,
    policy: str,
    probe: Probe | None,
    threshold: float | None,
    ladder: GuardLadder | None,
    repair: RepairConfig | None,
    audit_tokens: int,
    notes: list[str],
) -> tuple[Cache, HandoffReport]:
    """Serve one batch of requests ([`~hf_kvmap.request_context.RequestContext`], checked and resolved by `handoff`) with the guard resolved there.
    Returns the served cache and the [`HandoffReport`]; a refused batch goes to `policy`."""
    clock = Clock()
    input_ids, target = request.input_ids, request.target
    hold_back = min(probe.hold_back, input_ids.shape[1] - 1) if probe is not None else 1
    report = HandoffReport(
        False,
        "",
        probe=probe.settings() if probe is not None else None,
        threshold=threshold,
        policy=policy,
        hold_back=hold_back,
        notes=notes,
        same_weights=bool(request.same_weights),
    )
    try:
        cache = _serve_mapped(
            request,
            report,
            clock,
            probe=probe,
            threshold=threshold,
            ladder=ladder,
            repair=repair,
            audit_tokens=audit_tokens,
        )
    except Refused as refusal:
        report.accepted, report.reason = False, refusal.reason
        if policy == "fail":
            report.timings = clock.done()
            raise HandoffRefusedError(
                f"Handoff refused ({refusal.reason}). Use policy='fallback' to serve the target's own prefill "
                "instead.",
                report,
            ) from None
        logger.info("handoff falls back to the target's own prefill: %s", refusal.reason)
        with clock.stage("fallback_prefill"):
            cache = target_prefill(target, input_ids, request.attention_mask)
    report.timings = clock.done()
    return cache, report


__all__ = [
    "EXACT_TOLERANCE",
    "GROSS_ERROR",
    "RequestContext",
    "answer_margin",
    "check_rows",
    "climb",
    "exactness_error",
    "first_layer_audit",
    "ladder_settings",
    "map_and_repair",
    "own_rows",
    "prepare_context",
    "real_lengths",
    "run_tokens",
    "serve",
    "serve_rows",
    "target_prefill",
    "uncalibrated_error",
]

#: the request before one context carried it through every stage (deprecated, goes in 0.2)
__getattr__ = deprecated_names(__name__, globals(), {"Request": ("hf_kvmap.request_context.RequestContext", _Request)})
