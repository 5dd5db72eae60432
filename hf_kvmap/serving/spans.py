"""A span request: a conversation's switch of models served through the pipeline's stages. The positions `[start,
upto)` another model already processed are mapped from its cache onto the target's cache of `[0, start)`
(`MappedCache.from_source_span`: its checks, the mapper's context window read along, the span recorded); a fixed repair
recomputes a share of them (`hf_kvmap.repair.apply_repair`, the one door to the recompute); the target runs the tokens
`[upto, end)` nobody processed yet; then, with a guard ladder, its probe scores the switch and the ladder climbs
(`hf_kvmap.serving.rows.climb`: mapped, repaired within the span, or the target's own computation of the span, with
the check after the rung). `HandoffSession` serves every switch through [`serve_span`].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from ..cache import MappedCache
from ..repair import RepairConfig, apply_repair
from .forwards import run_tokens
from .ladder import GuardLadder
from .probes import Probe, RequestContext
from .report import Clock, HandoffReport
from .rows import Refused, climb, own_rows


@dataclass
class SpanRequest:
    r"""
    One switch of a conversation (batch 1) from the model that processed `[start, upto)` to the one that takes over.

    Args:
        source, target (`PreTrainedModel`): the model whose cache is mapped and the one taking over; mapper
            ([`MapperModel`]): fitted for them (checked when the session was built).
        input_ids (`torch.Tensor`): `(1, end + 1)` the transcript; its last token is left for `generate`.
        source_cache (`Cache`): the source's cache, covering at least `upto` positions.
        cache (`Cache`, *optional*): the target's cache of `[0, start)` (`None` for `start = 0`).
        start (`int`), upto (`int`): the span to map.
        label (`str`, *optional*): the source's name, recorded with the span.
    """

    source: Any
    target: Any
    mapper: Any
    input_ids: torch.Tensor
    source_cache: Cache
    cache: Cache | None
    start: int
    upto: int
    label: str | None = None


@torch.no_grad()
def serve_span(
    request: SpanRequest,
    *,
    repair: RepairConfig | None = None,
    ladder: GuardLadder | None = None,
    probe: Probe | None = None,
) -> tuple[MappedCache, HandoffReport]:
    """Serve one switch: the map, the fixed `repair` (or, with a `ladder` and its `probe`, the probe and a rung), the
    target's own run of the tokens after the span. Returns the target's cache of every transcript token but the last
    (a [`MappedCache`] recording its spans) and the [`HandoffReport`] (stages `map`, `repair`, `held_back`, `probe`,
    `check`, `fallback`; `accepted` is `False` when the ladder sent the switch back: the target computed the span
    itself)."""
    clock = Clock()
    ids, start, upto = request.input_ids, request.start, request.upto
    end = ids.shape[1] - 1
    target, source = request.target, request.source
    report = HandoffReport(False, "", probe=None if probe is None else probe.settings(), hold_back=end + 1 - upto)
    with clock.stage("map"):
        dtype = next(target.parameters()).dtype
        cache = MappedCache.from_source_span(
            request.source_cache, request.mapper, start, upto, onto=request.cache, dtype=dtype, label=request.label
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


__all__ = ["SpanRequest", "serve_span"]
