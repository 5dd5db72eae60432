"""A rung per row: the guard ladder's decision on a served batch ([`climb`]) and serving each row its rung
([`serve_rows`]: mapped, repaired, sparse, or the target's own prefill, [`own_rows`]), with the check after the rung
([`check_rows`]). A session's switch is a one-row request whose positions before its span are the target's own
(`RequestContext.span_start`): its repair selects within the span and its fallback recomputes the span alone.
`hf_kvmap.serving.pipeline` (which re-exports these names) and `hf_kvmap.serving.spans` call them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache

from .._compat import output_cache
from ..cache import MappedCache
from ..cache_views import row_cache, write_rows
from ..repair import RepairConfig, SparseCache, apply_repair, select_repair, strategy_from_dict
from ..repair.repair import recomputed_mask, selected_mask
from .forwards import answer_margin, run_tokens
from .ladder import GuardLadder, below_margin, rung_name
from .probes import RequestContext
from .report import Clock, HandoffReport
from .sparse_rows import can_serve_sparse, serve_sparse


class Refused(Exception):
    """A stage refused the mapped cache; `serve` hands the batch to the policy (a span request, to its fallback)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@torch.no_grad()
def serve_rows(
    context: RequestContext,
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
        context ([`~hf_kvmap.serving.probes.RequestContext`]): what [`prepare_context`] built (`T - 1` tokens).
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
    strategy = strategy_from_dict(strategy)
    done = recomputed_mask(cache, batch, mapped)  # what the target recomputed before, and below, of each row
    for fraction in sorted({f for f in fractions if f not in (None, 0.0)}):
        index = torch.tensor([i for i, f in enumerate(fractions) if f == fraction], device=ids.device)
        if context.span_start is not None:  # a session's switch: its one row, repaired within its span in place
            counts = apply_repair(
                context.target,
                cache,
                ids[:, :mapped],
                RepairConfig(strategy, fraction=fraction),
                source=context.source,
                source_cache=context.source_cache,
                start=context.span_start,
            )
            rows[0]["recomputed"] = counts[0]
            continue
        part = row_cache(cache, index)
        source_part = source_draft = None
        if strategy.needs_source:
            source_part = row_cache(context.source_cache, index)
            if "source" in context.drafts:  # the probe's draft: a strategy that drafts continues it
                source_draft = context.drafts["source"].rows(index)
        repair = RepairConfig(strategy, fraction=fraction)
        inputs = {
            "attention_mask": mask[index],
            "position_ids": positions[index],
            "source": context.source,
            "source_cache": source_part,
            "source_position_ids": None if source_position_ids is None else source_position_ids[index],
            "source_draft": source_draft,
        }
        # selected here so that the rows' copy records what was recomputed in the served cache too
        selection = select_repair(context.target, ids[index], repair, length=mapped, cache=part, **inputs)
        counts = apply_repair(context.target, part, ids[index], repair, selection=selection, **inputs)
        write_rows(cache, index, part)
        done[index] |= selected_mask(selection, mapped)
        for i, n in zip(index.tolist(), counts):
            rows[i]["recomputed"] = n
    fallback = [i for i, f in enumerate(fractions) if f is None]
    if fallback:
        for i, n in zip(fallback, own_rows(context, fallback, mapped)):
            rows[i]["recomputed"] = n
        done[fallback] = True
    if held:
        run_tokens(context.target, cache, ids, mapped, length - 1, mask, positions)
    if isinstance(cache, MappedCache):
        if context.span_start is None:  # a session's switch records itself (its repair, its span dropped)
            cache.record_recomputed(done)
        cache.record_step("ladder", {"rows": rows, "strategy": strategy.settings()})
    return rows


def own_rows(context: RequestContext, rows: Sequence[int], end: int) -> list[int]:
    """Rows `rows` of `context.cache` (which holds `end` tokens) replaced by the target's own prefill of their first
    `end` tokens; returns the real tokens each row recomputed. A session's switch (`context.span_start`) recomputes
    its span and what follows it up to `end` on its own positions before it, and its cache forgets the span."""
    ids, mask, positions = context.input_ids, context.attention_mask, context.position_ids
    if context.span_start is not None:
        start, cache = context.span_start, context.cache
        if cache.get_seq_length() > start:
            cache.crop(-(cache.get_seq_length() - start))
        cache.drop_last_span()
        if end > start:
            run_tokens(context.target, cache, ids, start, end)
        return [end - start]
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
    context: RequestContext, rows: list[dict[str, Any]], margins: torch.Tensor, refused: Sequence[int]
) -> None:
    """The check after the rungs, applied to [`serve_rows`]'s `rows` (in place): every served row records its `margin`
    (the target's [`answer_margin`] on its served cache, `margins`), and each row of `refused` gets the target's own
    prefill after all (its rung becomes the fallback; the one it had is kept as `checked`, and what that rung had
    recomputed as `checked_recomputed`)."""
    for row, margin in zip(rows, margins.tolist()):
        if row["fraction"] is not None:
            row["margin"] = margin
    if refused:
        for i, n in zip(refused, own_rows(context, refused, context.input_ids.shape[1] - 1)):
            rows[i].update(
                checked=rows[i]["rung"],
                checked_recomputed=rows[i]["recomputed"],
                rung=rung_name(None),
                fraction=None,
                recomputed=n,
            )


def climb(ladder: GuardLadder, context: RequestContext, report: HandoffReport, clock: Clock) -> Cache:
    """Stage 8 under a ladder: each row's rung from its risk (`report.scores`), then [`serve_rows`]."""
    lengths = real_lengths(context.input_ids, context.attention_mask)
    if context.span_start is not None:  # a session's switch: the tokens it maps
        lengths = [context.input_ids.shape[1] - context.hold_back - context.span_start]
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
        raise Refused(
            f"ladder: every row's risk is above the last rung or its prompt below min_tokens (risks "
            f"{[f'{r:.4g}' for r in report.scores]})"
        )
    if report.policy == "fail" and any(fraction is None for fraction in plan):
        raise Refused(f"ladder: row(s) {[i for i, f in enumerate(plan) if f is None]} would fall back")
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
                raise Refused(f"ladder check: row(s) {low} answer with a margin below {ladder.min_margin:.4g}")
        with clock.stage("fallback" if low else "check"):  # the rows the check sent back: the target's own
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


__all__ = ["Refused", "check_rows", "climb", "ladder_settings", "own_rows", "real_lengths", "serve_rows"]
