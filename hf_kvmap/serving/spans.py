"""A span request: a conversation's switch of models served through the pipeline's stages. The positions `[start,
upto)` another model already processed are mapped from its cache onto the target's cache of `[0, start)`
(`MappedCache.from_source_span`: its checks, the mapper's context window read along, the span recorded); a fixed repair
recomputes a share of them (`hf_kvmap.repair.apply_repair`, the one door to the recompute); the target runs the tokens
`[upto, end)` nobody processed yet; then, with a guard ladder, its probe scores the switch and the ladder climbs
(`hf_kvmap.serving.rows.climb`: mapped, repaired within the span, or the target's own computation of the span, with
the check after the rung). `HandoffSession` serves every switch through [`serve_span`].
"""

from __future__ import annotations

import torch

from ..cache import MappedCache
from ..repair import RepairConfig, apply_repair
from .forwards import run_tokens
from .ladder import GuardLadder
from .probes import Probe, RequestContext
from .report import Clock, HandoffReport
from .rows import Refused, climb, own_rows


@torch.no_grad()
def serve_span(
    request: RequestContext,
    *,
    repair: RepairConfig | None = None,
    ladder: GuardLadder | None = None,
    probe: Probe | None = None,
    label: str | None = None,
) -> tuple[MappedCache, HandoffReport]:
    r"""
    Serve one switch: the map, the fixed `repair` (or, with a `ladder` and its `probe`, the probe and a rung), the
    target's own run of the tokens after the span.

    Args:
        request ([`RequestContext`]): the switch, one row: `source`, `target`, `mapper`, `input_ids` `(1, end + 1)`
            (the transcript; its last token is left for `generate`), `source_cache` (covering at least the span),
            `cache` (the target's own cache of `[0, span_start)`, `None` for `span_start = 0`), `span_start` and
            `hold_back` (the span is `[span_start, end + 1 - hold_back)`). Not changed: the served context is a copy.
        repair ([`RepairConfig`], *optional*): a fixed repair of the span.
        ladder ([`GuardLadder`], *optional*) and probe ([`Probe`], *optional*): a rung per switch from the probe's risk.
        label (`str`, *optional*): the source's name, recorded with the span.

    Returns:
        The target's cache of every transcript token but the last (a [`MappedCache`] recording its spans) and the
        [`HandoffReport`] (stages `map`, `repair`, `held_back`, `probe`, `check`, `fallback`; `accepted` is `False` when
        the ladder sent the switch back: the target computed the span itself).
    """
    if request.span_start is None or request.input_ids is None or request.input_ids.shape[0] != 1:
        raise ValueError("serve_span serves one switch: a RequestContext of one row with its span_start set.")
    clock = Clock()
    ids, start = request.input_ids, request.span_start
    end = ids.shape[1] - 1
    upto = end + 1 - request.hold_back
    target, source = request.target, request.source
    report = HandoffReport(False, "", probe=None if probe is None else probe.settings(), hold_back=end + 1 - upto)
    with clock.stage("map"):
        dtype = next(target.parameters()).dtype
        cache = MappedCache.from_source_span(
            request.source_cache, request.mapper, start, upto, onto=request.cache, dtype=dtype, label=label
        )
    report.mapped_tokens, report.window_tokens = upto - start, cache.mapping_info["mappers"][-1]["window"]
    if repair is not None:
        with clock.stage("repair"):
            apply_repair(
                target, cache, ids[:, :upto], repair, source=source, source_cache=request.source_cache, start=start
            )
        report.repair = dict(cache.mapping_info["repair"])
    if end > upto:
        with clock.stage("held_back"):
            run_tokens(target, cache, ids, upto, end)
    if ladder is None:
        report.accepted, report.reason = True, "span mapped" + ("" if repair is None else " and repaired")
        report.timings = clock.done()
        return cache, report
    context = RequestContext(
        source=source,
        target=target,
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=torch.arange(end + 1, device=ids.device).unsqueeze(0),
        cache=cache,
        source_cache=request.source_cache,
        hold_back=end + 1 - upto,
        span_start=start,
    )
    with clock.stage("probe"):
        report.scores = [float(s) for s in probe.risks(context)]
    report.score = max(report.scores)
    try:
        climb(ladder, context, report, clock)
    except Refused as refusal:  # the risk is above every rung: the target computes the span itself
        report.accepted, report.reason = False, refusal.reason
        with clock.stage("fallback"):
            own_rows(context, [0], end)
    report.timings = clock.done()
    return context.cache, report


__all__ = ["serve_span"]
