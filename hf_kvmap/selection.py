"""Source-layer selection: the single-source probe R^2 of every (target layer, source layer) pair, and the top k.

Computed from `CalibrationStatistics` alone (sub-block solves of the centered moments, see
`CalibrationStatistics.centered`). The probe of one pair is the OLS from source KV head `h` to target head `h` (or,
with different KV head counts, from all heads to all heads), scored by the per-head R^2 of `hf_kvmap.regression`;
it carries a ridge of `PROBE_EPS * trace(Sxx) / dim` for numerical safety only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .configuration_mapper import check_int
from .fit_options import FitOptions
from .regression import r2_score, spd_solve
from .statistics import CalibrationStatistics

# Relative ridge of the selection probe: eps * mean eigenvalue of the centered source Gram.
PROBE_EPS = 1e-6


def probe_layout(stats: CalibrationStatistics) -> str:
    """`"per_head"` when both sides have the same KV head count (head h -> head h), else `"whole_layer"`."""
    same = stats.source_geometry.num_kv_heads == stats.target_geometry.num_kv_heads
    return "per_head" if same else "whole_layer"


@torch.no_grad()
def r2_matrix(stats: CalibrationStatistics, *, eps: float = PROBE_EPS) -> dict[str, torch.Tensor]:
    """Single-source probe R^2 of every (target layer, source layer), per part (K and V).

    For each source layer `l'` and target layer `l`: the OLS from source KV head `h` of `l'` to target head `h` of
    `l` (all heads, same index), R^2 per target head summed over its dims, averaged over heads. When the two sides
    have different KV head counts, the probe maps all heads of `l'` to all heads of `l` (`probe_layout`).

    Returns:
        `dict` part -> float64 `Tensor[L_t, L_s]`; rows of target layers the statistics do not cover are NaN.
    """
    src, tgt = stats.source_geometry, stats.target_geometry
    covered = stats.covered_target_layers
    per_head = probe_layout(stats) == "per_head"
    out = {}
    for part in stats.parts:
        scores = torch.full((tgt.num_layers, src.num_layers), float("nan"), dtype=torch.float64)
        all_cols = slice(0, stats.target_width)
        for source_layer in range(src.num_layers):
            rows = slice(source_layer * src.layer_width, (source_layer + 1) * src.layer_width)
            sxx, sxy, _, _, ss_tot = stats.centered(part, rows, all_cols)
            layers_t, heads_t, d_t = len(covered), tgt.num_kv_heads, tgt.head_dim
            heads_s, d_s = src.num_kv_heads, src.head_dim
            ss_tot = ss_tot.view(layers_t, heads_t, d_t).sum(-1)  # (L_t', heads)
            if per_head:
                # (heads, d_s, heads, d_s) -> per-head diagonal blocks (heads, d_s, d_s)
                blocks = sxx.view(heads_s, d_s, heads_s, d_s).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
                # (heads, d_s, L_t', heads, d_t) -> rows of head h x columns of head h: (heads, d_s, L_t' * d_t)
                rhs = sxy.view(heads_s, d_s, layers_t, heads_t, d_t).diagonal(
                    dim1=0, dim2=3
                )  # (d_s, L_t', d_t, heads)
                rhs = rhs.permute(3, 0, 1, 2).reshape(heads_s, d_s, layers_t * d_t)
            else:
                blocks, rhs = sxx.unsqueeze(0), sxy.unsqueeze(0)
            dim = blocks.shape[-1]
            ridge = eps * blocks.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(0) / dim  # (batch,)
            eye = torch.eye(dim, dtype=blocks.dtype, device=blocks.device)
            solution = spd_solve(blocks + ridge[:, None, None] * eye, rhs)
            explained = (rhs * solution).sum(1)  # per target column
            if per_head:
                explained = explained.view(heads_s, layers_t, d_t).sum(-1).T  # (L_t', heads)
            else:
                explained = explained.view(layers_t, heads_t, d_t).sum(-1)
            scores[covered, source_layer] = r2_score(ss_tot - explained, ss_tot).mean(-1).cpu()
        out[part] = scores
    return out


def combined_scores(r2: dict[str, torch.Tensor]) -> torch.Tensor:
    """The selection score: the probe R^2 averaged over the parts (K and V)."""
    return torch.stack(list(r2.values())).mean(0)


def k_used(top_k: int | None, num_source: int) -> int | None:
    """The `k` a selection of `top_k` layers among `num_source` uses (`None`: all; larger than the source: all of
    them, recorded as the number it is)."""
    return None if top_k is None else min(top_k, num_source)


def select_top_k(scores: torch.Tensor, top_k: int | None) -> list[list[int]]:
    """The `top_k` best source layers of every row of `scores` `[L_t, L_s]`, each list sorted ascending.

    `top_k=None` or `top_k >= L_s` selects every source layer. Ties go to the lower source layer.
    """
    num_source = scores.shape[1]
    check_int("top_k", top_k, 1, allow_none=True, meaning=", or None for all source layers")
    k = num_source if top_k is None else min(top_k, num_source)
    selected = []
    for row in scores:
        if torch.isnan(row).all():
            raise ValueError("Cannot select source layers for a target layer that the statistics do not cover.")
        order = torch.argsort(-torch.nan_to_num(row, nan=-torch.inf), stable=True)
        selected.append(sorted(order[:k].tolist()))
    return selected


@dataclass
class LayerSelection:
    """The outcome of source-layer selection: probe scores and the chosen source layers of every target layer.

    Attributes:
        scores (`torch.Tensor`): combined probe R^2 `[L_t, L_s]` (mean over K and V).
        r2 (`dict[str, torch.Tensor]`): per-part probe R^2 `[L_t, L_s]`.
        source_layers (`list[list[int]]`): the selected source layers of each target layer, ascending.
        top_k (`int`, *optional*): the k used (`None` = all; a requested k beyond the source's layers is recorded
            as the source's layer count).
        probe (`str`): `"per_head"` or `"whole_layer"` (see `probe_layout`).
    """

    scores: torch.Tensor
    r2: dict[str, torch.Tensor]
    source_layers: list[list[int]]
    top_k: int | None
    probe: str
    calibration: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_statistics(
        cls,
        stats: CalibrationStatistics,
        top_k: int | None = FitOptions.top_k,
        *,
        source_layers: Sequence[Sequence[int]] | None = None,
    ) -> LayerSelection:
        """Probe every layer pair of `stats` and keep the `top_k` best (or record the given `source_layers`)."""
        r2 = r2_matrix(stats)
        scores = combined_scores(r2)
        if source_layers is None:
            chosen = select_top_k(scores[stats.covered_target_layers], top_k)
            selected = [[] for _ in range(scores.shape[0])]
            for layer, layers in zip(stats.covered_target_layers, chosen):
                selected[layer] = layers
        else:
            selected = [list(map(int, layers)) for layers in source_layers]
        return cls(scores, r2, selected, k_used(top_k, scores.shape[1]), probe_layout(stats), stats.provenance())

    def with_top_k(self, top_k: int | None) -> LayerSelection:
        """The same scores with a different `k` (no new probe)."""
        covered = [layer for layer in range(self.scores.shape[0]) if not torch.isnan(self.scores[layer]).all()]
        chosen = select_top_k(self.scores[covered], top_k)
        selected = [[] for _ in range(self.scores.shape[0])]
        for layer, layers in zip(covered, chosen):
            selected[layer] = layers
        k = k_used(top_k, self.scores.shape[1])
        return LayerSelection(self.scores, self.r2, selected, k, self.probe, self.calibration)

    def selected_scores(self) -> list[list[float]]:
        """The combined score of each selected source layer, in the order of `source_layers`."""
        return [[float(self.scores[t, s]) for s in layers] for t, layers in enumerate(self.source_layers)]

    def to_dict(self) -> dict[str, Any]:
        def rows(matrix):
            return [[None if v != v else float(v) for v in row] for row in matrix.tolist()]

        return {
            "top_k": self.top_k,
            "probe": self.probe,
            "source_layers": self.source_layers,
            "selected_scores": self.selected_scores(),
            "scores": rows(self.scores),
            "r2": {part: rows(matrix) for part, matrix in self.r2.items()},
            "calibration": self.calibration,
        }

    def save_selection_json(self, path: str | os.PathLike) -> None:
        """Write `to_dict()` as JSON (`NaN` rows of uncovered target layers become `null`), atomically."""
        from .atomic import write_text_atomically

        write_text_atomically(path, json.dumps(self.to_dict(), indent=2) + "\n")
