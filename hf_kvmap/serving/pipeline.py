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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache
from transformers.utils import logging

from .._compat import output_cache
from ..cache import CACHE_DTYPES, MappedCache, source_pairs
from ..cache_views import row_cache, write_rows
from ..drafting import Draft
from ..input_checks import check_source_cache
from ..repair import RepairConfig, SparseCache, apply_repair, selector_from_dict
from ..rope import positions_from_attention_mask
from .audit import exactness_error, first_layer_audit
from .forwards import answer_margin, run_tokens, target_prefill
from .ladder import GuardLadder, below_margin, rung_name
from .probes import Probe, ProbeContext
from .probes.prefix_audit import PrefixAuditProbe
from .report import Clock, HandoffRefusedError, HandoffReport
from .sparse_rows import can_serve_sparse, serve_sparse

logger = logging.get_logger(__name__)

#: relative key/value error below which the audit certifies a mapping as the target's own cache
EXACT_TOLERANCE = 1e-3
#: relative key/value error at which the audit refuses a mapping outright: all-zero keys and values score exactly 1
GROSS_ERROR = 1.0


@dataclass
class Request:
    r"""
    One batch of requests, as `handoff` checked it.

    Args:
        source, target (`PreTrainedModel`): the two causal LMs; mapper ([`MapperModel`]): fitted for them.
        input_ids (`torch.Tensor`): `(batch, T)` prompt; attention_mask (`torch.Tensor`, *optional*): its mask.
        source_cache (`Cache`, *optional*): the source's cache of the prompt; source_position_ids
            (`torch.Tensor`, *optional*): the positions it was built at.
        tokenizer (*optional*): checked against the mapper's fingerprint by the gate.
        target_first_layer (`bool`): the target computes its first layer from the ids.
        same_weights (`bool`): the gate does not compare model ids.
    """

    source: Any
    target: Any
    mapper: Any
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    source_cache: Any = None
    source_position_ids: torch.Tensor | None = None
    tokenizer: Any = None
    target_first_layer: bool = False
    same_weights: bool = False


class _Refused(Exception):
    """A stage refused the mapped cache; `serve` hands the batch to the policy."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def uncalibrated_error(missing: str, extra: str = "") -> ValueError:
    return ValueError(
        f"The mapper has no calibrated handoff probe (`config.handoff_probe` is empty) and no {missing} was passed"
        f"{extra}. Calibrate one with `hf_kvmap.calibrate_probe(...)` (benchmarks/handoff.py does it for the shipped "
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
            if repair.selector.needs_source and source is not None:
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
) -> ProbeContext:
    """Stages 2 to 5: the source prefill (unless `source_cache` is given), the mapping of all prompt tokens but the
    last `hold_back`, the fixed `repair`, and the target's run of the held-back tokens but the last. Returns the
    [`ProbeContext`] whose `cache` covers `T - 1` tokens. Raises `ValueError` when the mapping refuses the source
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
def serve_rows(
    context: ProbeContext,
    fractions: Sequence[float | None],
    strategy: dict[str, Any] | str,
    sparse: Sequence[bool] | None = None,
) -> list[dict[str, Any]]:
    r"""
    Give every row of `context.cache` its rung, in place: rows with fraction 0 keep the mapped cache, rows with a
    fraction have the target recompute that share of their mapped tokens (rows of one fraction in one batch), and
    `None` rows get the target's own prefill. Then, when the probe held back more than the last token, the target
    re-runs the held-back tokens on the result, so they attend to what is served.

    Args:
        context ([`~hf_kvmap.serving.probes.ProbeContext`]): what [`prepare_context`] built (`T - 1` tokens).
        fractions (sequence of `float` or `None`): one per row.
        strategy (`dict` or `str`): the repair strategy.
        sparse (sequence of `bool`, *optional*): rows whose rung is a sparse one (`LadderRung.sparse`): a one-row
            request is served the target's prefill of the selected positions alone (`context.cache` is replaced);
            in a batch such rows are repaired at their fraction (`sparse_as_repair`).

    Returns:
        One dict per row: `rung` (`"mapped"`, `"repair:<f>"`, `"sparse:<f>"`, `"fallback"`), `fraction`, and
        `recomputed` tokens.
    """
    ids, mask, positions, cache = context.input_ids, context.attention_mask, context.position_ids, context.cache
    source_position_ids = context.source_position_ids
    batch, length = ids.shape
    if len(fractions) != batch:
        raise ValueError(f"{len(fractions)} rung fractions for a batch of {batch} rows.")
    mapped = length - context.hold_back
    rows = [{"rung": rung_name(f), "fraction": f, "recomputed": 0} for f in fractions]
    sparse = [bool(s) and f is not None for s, f in zip(sparse or [], fractions)]
    if any(sparse):
        if can_serve_sparse(context) and fractions[0] is not None:
            context.cache, recomputed = serve_sparse(context, fractions[0], strategy)
            rows[0].update(rung=rung_name(fractions[0], True), recomputed=recomputed)
            return rows
        for row, planned in zip(rows, sparse):
            row.update({"sparse_as_repair": True} if planned else {})
    if all(f == 0.0 for f in fractions):
        return rows
    held = cache.get_seq_length() - mapped
    if held:
        cache.crop(-held)
    selector = selector_from_dict(strategy)
    for fraction in sorted({f for f in fractions if f not in (None, 0.0)}):
        index = torch.tensor([i for i, f in enumerate(fractions) if f == fraction], device=ids.device)
        part = row_cache(cache, index)
        source_part = source_draft = None
        if selector.needs_source:
            source_part = row_cache(context.source_cache, index)
            if "source" in context.drafts:  # the probe's draft: a strategy that drafts continues it
                source_draft = context.drafts["source"].rows(index)
        counts = apply_repair(
            context.target,
            part,
            ids[index],
            RepairConfig(selector, fraction=fraction),
            attention_mask=mask[index],
            position_ids=positions[index],
            source=context.source,
            source_cache=source_part,
            source_position_ids=None if source_position_ids is None else source_position_ids[index],
            source_draft=source_draft,
        )
        write_rows(cache, index, part)
        for i, n in zip(index.tolist(), counts):
            rows[i]["recomputed"] = n
    fallback = [i for i, f in enumerate(fractions) if f is None]
    if fallback:
        for i, n in zip(fallback, own_rows(context, fallback, mapped)):
            rows[i]["recomputed"] = n
    if held:
        run_tokens(context.target, cache, ids, mapped, length - 1, mask, positions)
    info = getattr(cache, "mapping_info", None)
    if isinstance(info, dict):
        info["ladder"] = {"rows": rows, "strategy": selector.settings()}
    return rows


def own_rows(context: ProbeContext, rows: Sequence[int], end: int) -> list[int]:
    """Rows `rows` of `context.cache` (which holds `end` tokens) replaced by the target's own prefill of their first
    `end` tokens; returns the real tokens each row recomputed."""
    ids, mask, positions = context.input_ids, context.attention_mask, context.position_ids
    index = torch.tensor(list(rows), device=ids.device)
    own = output_cache(
        context.target(
            input_ids=ids[index, :end],
            attention_mask=mask[index, :end],
            position_ids=positions[index, :end],
            use_cache=True,
        )
    )
    if isinstance(context.cache, SparseCache):  # a one-row sparse rung's cache: replaced whole
        context.cache = own
    else:
        write_rows(context.cache, index, own)
    return mask[index, :end].sum(-1).tolist()


@torch.no_grad()
def check_rows(
    context: ProbeContext, rows: list[dict[str, Any]], margins: torch.Tensor, refused: Sequence[int]
) -> None:
    """The check after the rungs, applied to [`serve_rows`]'s `rows` (in place): every served row records its `margin`
    (the target's [`answer_margin`] on its served cache, `margins`), and each row of `refused` gets the target's own
    prefill after all (its rung becomes the fallback; the one it had is kept as `checked`)."""
    for row, margin in zip(rows, margins.tolist()):
        if row["fraction"] is not None:
            row["margin"] = margin
    if refused:
        for i, n in zip(refused, own_rows(context, refused, context.input_ids.shape[1] - 1)):
            rows[i].update(checked=rows[i]["rung"], rung=rung_name(None), fraction=None, recomputed=n)


# ------------------------------------------------------------------------------------------------ the audit


def _audit(target, context: ProbeContext, audit_tokens: int, report: HandoffReport, clock: Clock) -> bool:
    """Stage 6: whether the mapping is exact (then it is served as it is); raises `_Refused` for a gross one."""
    with clock.stage("audit"):
        error = PrefixAuditProbe(audit_tokens).score(context).max().item()
        report.audit_error = error
        if error <= EXACT_TOLERANCE:  # the prefix is exact: the first layer at every position too?
            report.audit_error = max(error, first_layer_audit(target, context))
    if not error < GROSS_ERROR:  # NaN included
        raise _Refused(
            f"gross mapping error: the mapped keys/values of the first {audit_tokens} tokens are {error:.3g} "
            "(relative) from the target's own, no closer than zeros"
        )
    return report.audit_error <= EXACT_TOLERANCE


# ------------------------------------------------------------------------------------------------ the decision


def climb(ladder: GuardLadder, context: ProbeContext, report: HandoffReport, clock: Clock) -> Cache:
    """Stage 8 under a ladder: each row's rung from its risk (`report.scores`), then [`serve_rows`]."""
    lengths = real_lengths(context.input_ids, context.attention_mask)
    plan = ladder.plan(report.scores, lengths)  # a NaN risk takes no rung, nor a row below min_tokens: they fall back
    short = [ladder.too_short(n) for n in lengths]
    settings = ladder_settings(ladder)
    report.threshold = None
    if all(fraction is None for fraction in plan):
        report.ladder = {
            **settings,
            "rows": [
                {"rung": rung_name(None), "fraction": None, "risk": r, **({"short": True} if below else {})}
                for r, below in zip(report.scores, short)
            ],
        }
        raise _Refused(
            f"ladder: every row's risk is above the last rung or its prompt below min_tokens (risks "
            f"{[f'{r:.4g}' for r in report.scores]})"
        )
    if report.policy == "fail" and any(fraction is None for fraction in plan):
        raise _Refused(f"ladder: row(s) {[i for i, f in enumerate(plan) if f is None]} would fall back")
    with clock.stage("repair"):
        rows = serve_rows(context, plan, ladder.strategy, ladder.sparse_plan(report.scores))
    for row, risk, below in zip(rows, report.scores, short):
        row["risk"] = risk
        if below:
            row["short"] = True
    if ladder.min_margin is not None:
        with clock.stage("check"):
            margins = answer_margin(
                context.target,
                context.cache,
                context.input_ids,
                context.attention_mask,
                context.position_ids,
                tokens=ladder.check_tokens,
            )
            low = [i for i, f in enumerate(plan) if f is not None and below_margin(margins[i], ladder.min_margin)]
            if low and report.policy == "fail":  # a row the check refuses refuses the batch, as a fallback does
                report.ladder = {**settings, "rows": rows}
                raise _Refused(f"ladder check: row(s) {low} answer with a margin below {ladder.min_margin:.4g}")
            check_rows(context, rows, margins, low)
    report.ladder = {**settings, "rows": rows}
    report.accepted = True
    report.reason = "ladder: " + ", ".join(f"row {i} {row['rung']}" for i, row in enumerate(rows))
    return context.cache


def ladder_settings(ladder: GuardLadder) -> dict[str, Any]:
    """The ladder's settings a report records: its own (`GuardLadder.to_dict`) but the calibration."""
    return {k: v for k, v in ladder.to_dict().items() if k != "calibration"}


def real_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Each row's real (unpadded) token count."""
    if attention_mask is None:
        return [input_ids.shape[1]] * input_ids.shape[0]
    return [int(n) for n in attention_mask.sum(-1).tolist()]


def _short_batch(ladder: GuardLadder, request: Request, report: HandoffReport) -> None:
    """Before the mapping: a batch whose every prompt is below the ladder's `min_tokens` is refused (raises
    `_Refused`), unmapped: the target's own prefill of it is sooner than any rung."""
    lengths = real_lengths(request.input_ids, request.attention_mask)
    if ladder.min_tokens is None or not all(ladder.too_short(n) for n in lengths):
        return
    report.ladder = {
        **ladder_settings(ladder),
        "rows": [{"rung": rung_name(None), "fraction": None, "short": True} for _ in lengths],
    }
    raise _Refused(
        f"ladder: every prompt is shorter than min_tokens={ladder.min_tokens} (longest {max(lengths)} tokens): the "
        "target's own prefill is sooner there"
    )


def _threshold(probe: Probe, scores: torch.Tensor, threshold: float, report: HandoffReport) -> None:
    """Stage 8 without a ladder: the whole batch is served if every row's risk is within the threshold."""
    if not torch.isfinite(scores).all():
        raise _Refused(f"probe {probe.name} returned a non-finite risk")
    if report.score > threshold:
        raise _Refused(f"probe refused: {probe.name} risk {report.score:.4g} > threshold {threshold:.4g}")
    report.accepted, report.reason = True, f"probe passed: {probe.name} risk {report.score:.4g} <= {threshold:.4g}"


def _serve_mapped(
    request: Request,
    report: HandoffReport,
    clock: Clock,
    *,
    probe,
    threshold,
    ladder,
    repair,
    audit_tokens: int,
) -> Cache:
    """Stages 1 to 8; raises `_Refused` where a stage refuses the mapped cache."""
    source, target, mapper, input_ids = request.source, request.target, request.mapper, request.input_ids
    attention_mask, source_cache = request.attention_mask, request.source_cache
    with clock.stage("gate"):
        try:
            mapper.check_compatible(source, target, request.tokenizer, same_weights=report.same_weights)
        except ValueError as err:
            report.probe = None
            logger.warning_once(f"handoff falls back to the target's own prefill on every such request: {err}")
            raise _Refused(f"incompatible: {err}") from None
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
        raise _Refused(f"mapping failed: {err}") from None
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
        scores = probe.score(context).float()
    report.scores = [float(s) for s in scores]
    report.score = max(report.scores)
    if ladder is not None:
        return climb(ladder, context, report, clock)
    _threshold(probe, scores, threshold, report)
    return context.cache


@torch.no_grad()
def serve(
    request: Request,
    *,
    policy: str,
    probe: Probe | None,
    threshold: float | None,
    ladder: GuardLadder | None,
    repair: RepairConfig | None,
    audit_tokens: int,
    notes: list[str],
) -> tuple[Cache, HandoffReport]:
    """Serve one batch of requests ([`Request`], checked and resolved by `handoff`) with the guard resolved there.
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
    except _Refused as refusal:
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
    "Request",
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
