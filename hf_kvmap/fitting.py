"""Closed-form fitting from `CalibrationStatistics`: source-layer selection (single-source probe) and ridge solve.

Everything here is a sub-block solve of the statistics, so selection and the ridge for any `k` cost no further pass
over the data. With `N` positions, sums `s_x`, `s_y`, Gram `G = X^T X` and cross moments `C = X^T Y`:

- centered moments: `Xc^T Xc = G - s_x s_x^T / N`, `Xc^T Yc = C - s_x s_y^T / N`, `SS_tot = sum(y^2) - s_y^2 / N`;
- ridge: `W = (Xc^T Xc + lambda I)^-1 Xc^T Yc`, `b = mean(y) - mean(x) W` (`lambda` absolute, or `N * lambda` with
  `lambda_convention="per_token"`), solved in float64 by Cholesky;
- probe R^2 of one regression: `1 - SS_res / SS_tot` with `SS_res = SS_tot - trace(Sxy^T Sxx^-1 Sxy)`, summed over a
  target head's dims. The probe's OLS carries a ridge of `PROBE_EPS * trace(Sxx) / dim` for numerical safety only.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.utils import logging

from .configuration_mapper import LAMBDA_CONVENTIONS, MapperConfig
from .modeling_mapper import MapperModel
from .statistics import CalibrationStatistics

logger = logging.get_logger(__name__)

# Relative ridge of the selection probe: eps * mean eigenvalue of the centered source Gram.
PROBE_EPS = 1e-6


# ------------------------------------------------------------------------------------------------ linear algebra
def _spd_solve(matrix: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve `matrix @ x = rhs` for a (batch of) symmetric positive (semi)definite matrix in float64."""
    factor, info = torch.linalg.cholesky_ex(matrix)
    if not bool((info == 0).all()):
        # Singular (e.g. lambda = 0 with fewer positions than features): fall back to the minimum-norm solution.
        return torch.linalg.lstsq(matrix, rhs, driver="gelsd" if matrix.device.type == "cpu" else None).solution
    return torch.cholesky_solve(rhs, factor)


def _centered(stats: CalibrationStatistics, kind: str, rows: torch.Tensor | slice, cols: torch.Tensor | slice | None):
    """Float64 centered `(Sxx, Sxy, mean_x, mean_y, ss_tot)` on the sub-block `rows` x target `cols`."""
    s = stats[kind]
    n = float(s.count)
    if n < 2:
        raise ValueError(f"The {kind} statistics hold {int(n)} positions; at least 2 are needed to fit anything.")
    sx = s.source_sum[rows].double()
    if isinstance(rows, torch.Tensor):  # gather the sub-block directly, without copying whole rows first
        gram = s.gram[rows[:, None], rows[None, :]].double()
    else:
        gram = s.gram[rows, rows].double()
    sxx = gram - torch.outer(sx, sx) / n
    if cols is None:
        return sxx, None, sx / n, None, None
    sy = s.target_sum[cols].double()
    sxy = s.cross[rows, cols].double() - torch.outer(sx, sy) / n
    ss_tot = s.target_sumsq[cols].double() - sy.square() / n
    return sxx, sxy, sx / n, sy / n, ss_tot


def _r2(explained: torch.Tensor, ss_tot: torch.Tensor) -> torch.Tensor:
    """`1 - SS_res / SS_tot = explained / SS_tot`; a target with no variance is perfectly predicted by the bias."""
    ss_tot = ss_tot.clamp_min(0)
    r2 = torch.where(ss_tot > 0, explained / ss_tot.clamp_min(torch.finfo(ss_tot.dtype).tiny), torch.ones_like(ss_tot))
    return r2.clamp(max=1.0)


def probe_kind(stats: CalibrationStatistics) -> str:
    """`"per_head"` when both sides have the same KV head count (head h -> head h), else `"whole_layer"`."""
    same = stats.source_geometry.num_kv_heads == stats.target_geometry.num_kv_heads
    return "per_head" if same else "whole_layer"


@torch.no_grad()
def r2_matrix(stats: CalibrationStatistics, *, eps: float = PROBE_EPS) -> dict[str, torch.Tensor]:
    """Single-source probe R^2 of every (target layer, source layer), per kind.

    For each source layer `l'` and target layer `l`: the OLS from source KV head `h` of `l'` to target head `h` of
    `l` (all heads, same index), R^2 per target head summed over its dims, averaged over heads. When the two sides
    have different KV head counts, the probe maps all heads of `l'` to all heads of `l` (`probe_kind`).

    Returns:
        `dict` kind -> float64 `Tensor[L_t, L_s]`; rows of target layers the statistics do not cover are NaN.
    """
    src, tgt = stats.source_geometry, stats.target_geometry
    covered = stats.covered_target_layers
    per_head = probe_kind(stats) == "per_head"
    out = {}
    for kind in stats.kinds:
        scores = torch.full((tgt.num_layers, src.num_layers), float("nan"), dtype=torch.float64)
        all_cols = slice(0, stats.target_width)
        for source_layer in range(src.num_layers):
            rows = slice(source_layer * src.layer_width, (source_layer + 1) * src.layer_width)
            sxx, sxy, _, _, ss_tot = _centered(stats, kind, rows, all_cols)
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
            solution = _spd_solve(blocks + ridge[:, None, None] * eye, rhs)
            explained = (rhs * solution).sum(1)  # per target column
            if per_head:
                explained = explained.view(heads_s, layers_t, d_t).sum(-1).T  # (L_t', heads)
            else:
                explained = explained.view(layers_t, heads_t, d_t).sum(-1)
            scores[covered, source_layer] = _r2(explained, ss_tot).mean(-1).cpu()
        out[kind] = scores
    return out


def combined_scores(r2: dict[str, torch.Tensor]) -> torch.Tensor:
    """The selection score: the probe R^2 averaged over kinds (K and V)."""
    return torch.stack(list(r2.values())).mean(0)


def select_top_k(scores: torch.Tensor, top_k: int | None) -> list[list[int]]:
    """The `top_k` best source layers of every row of `scores` `[L_t, L_s]`, each list sorted ascending.

    `top_k=None` or `top_k >= L_s` selects every source layer. Ties go to the lower source layer.
    """
    num_source = scores.shape[1]
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be a positive integer, or None for all source layers.")
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
        scores (`torch.Tensor`): combined probe R^2 `[L_t, L_s]` (mean over kinds).
        r2 (`dict[str, torch.Tensor]`): per-kind probe R^2 `[L_t, L_s]`.
        source_layers (`list[list[int]]`): the selected source layers of each target layer, ascending.
        top_k (`int`, *optional*): the requested k (`None` = all).
        probe (`str`): `"per_head"` or `"whole_layer"` (see `probe_kind`).
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
        top_k: int | None = 8,
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
        return cls(scores, r2, selected, top_k, probe_kind(stats), stats.provenance())

    def with_top_k(self, top_k: int | None) -> LayerSelection:
        """The same scores with a different `k` (no new probe)."""
        covered = [layer for layer in range(self.scores.shape[0]) if not torch.isnan(self.scores[layer]).all()]
        chosen = select_top_k(self.scores[covered], top_k)
        selected = [[] for _ in range(self.scores.shape[0])]
        for layer, layers in zip(covered, chosen):
            selected[layer] = layers
        return LayerSelection(self.scores, self.r2, selected, top_k, self.probe, self.calibration)

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
            "r2": {kind: rows(matrix) for kind, matrix in self.r2.items()},
            "calibration": self.calibration,
        }

    def save_selection_json(self, path: str | os.PathLike) -> None:
        """Write `to_dict()` as JSON (`NaN` rows of uncovered target layers become `null`)."""
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2)
            handle.write("\n")

    def save_heatmap(self, path: str | os.PathLike) -> bool:
        """Plot the combined scores (target layer vs source layer, selected cells marked) as a PNG.

        Returns `False` without writing anything when matplotlib is not installed (`pip install hf-kvmap[plot]`).
        """
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError:
            logger.info("matplotlib is not installed; skipping the selection heat map.")
            return False
        scores = self.scores.numpy()
        height, width = scores.shape
        fig, ax = plt.subplots(figsize=(max(4.0, 0.25 * width + 2), max(3.0, 0.25 * height + 1.5)))
        image = ax.imshow(scores, origin="lower", aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
        for target_layer, layers in enumerate(self.source_layers):
            ax.scatter(layers, [target_layer] * len(layers), marker="s", s=12, facecolors="none", edgecolors="red")
        ax.set_xlabel("source layer")
        ax.set_ylabel("target layer")
        ax.set_title(f"probe R$^2$ (K/V mean, {self.probe}), top_k={self.top_k}")
        fig.colorbar(image, ax=ax)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return True


# ------------------------------------------------------------------------------------------------ ridge
@torch.no_grad()
def solve_layer(
    stats: CalibrationStatistics,
    kind: str,
    target_layer: int,
    source_layers: Sequence[int],
    *,
    ridge_lambda: float = 0.01,
    lambda_convention: str = "absolute",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Centered ridge with bias for one target layer and kind, all target heads at once, in float64.

    Returns `(weight, bias)` in `nn.Linear` layout: weight `(n_kv_t * d_t, k * n_kv_s * d_s)` with input features
    ordered as `source_layers`, bias `(n_kv_t * d_t,)`.
    """
    if lambda_convention not in LAMBDA_CONVENTIONS:
        raise ValueError(f"lambda_convention={lambda_convention!r} is not one of {LAMBDA_CONVENTIONS}.")
    if ridge_lambda < 0:
        raise ValueError(f"ridge_lambda={ridge_lambda} must be >= 0.")
    rows = stats.source_columns(source_layers).to(stats.device)
    sxx, sxy, mean_x, mean_y, _ = _centered(stats, kind, rows, stats.target_columns(target_layer))
    penalty = ridge_lambda * (stats.count(kind) if lambda_convention == "per_token" else 1.0)
    sxx.diagonal().add_(penalty)
    weight = _spd_solve(sxx, sxy)  # (in, out)
    bias = mean_y - mean_x @ weight
    return weight.T.contiguous(), bias


@torch.no_grad()
def mapper_r2(stats: CalibrationStatistics, mapper: MapperModel) -> dict[str, torch.Tensor]:
    """Calibration R^2 of a mapper's affine maps on `stats`, per kind: float64 `Tensor[L_t]` (NaN if not covered).

    Per target head `1 - SS_res / SS_tot` summed over its dims, averaged over heads, as the selection probe; computed
    from the statistics alone (`SS_res = SS_tot - 2 tr(W^T Sxy) + tr(W^T Sxx W)` for the centered residual, plus the
    bias offset `N |mean_y - mean_x W - b|^2`).
    """
    tgt = stats.target_geometry
    out = {}
    for kind in stats.kinds:
        scores = torch.full((tgt.num_layers,), float("nan"), dtype=torch.float64)
        for layer in stats.covered_target_layers:
            proj = getattr(mapper.layers[layer], "key_proj" if kind == "key" else "value_proj")
            rows = stats.source_columns(mapper.config.source_layers[layer]).to(stats.device)
            sxx, sxy, mean_x, mean_y, ss_tot = _centered(stats, kind, rows, stats.target_columns(layer))
            weight = proj.weight.detach().to(sxx.device, torch.float64).T
            bias = proj.bias.detach().to(sxx.device, torch.float64)
            offset = mean_y - mean_x @ weight - bias
            ss_res = ss_tot - 2 * (weight * sxy).sum(0) + (weight * (sxx @ weight)).sum(0)
            ss_res = ss_res + stats.count(kind) * offset.square()
            heads_tot = ss_tot.view(tgt.num_kv_heads, tgt.head_dim).sum(-1)
            heads_res = ss_res.view(tgt.num_kv_heads, tgt.head_dim).sum(-1)
            scores[layer] = _r2(heads_tot - heads_res, heads_tot).mean().cpu()
        out[kind] = scores
    return out


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of a tokenizer's vocabulary (sorted `(token, id)` pairs, JSON-encoded)."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()


def _as_list(statistics) -> list[CalibrationStatistics]:
    if isinstance(statistics, CalibrationStatistics):
        return [statistics]
    parts = list(statistics)
    if not parts or not all(isinstance(p, CalibrationStatistics) for p in parts):
        raise ValueError("Pass a CalibrationStatistics (or a sequence of them covering disjoint target layers).")
    return parts


def selection_config(
    statistics: CalibrationStatistics,
    selection: LayerSelection,
    *,
    tokenizer_fingerprint: str | None = None,
    calibration: dict[str, Any] | None = None,
    **fields,
) -> MapperConfig:
    """The `MapperConfig` of a mapper fitted on `statistics` with `selection`: both models' configs, ids and
    revisions, the tokenizer fingerprint, the selected layers and their scores, and the calibration provenance (plus
    `calibration`, e.g. the MLP training record). `fields` are the remaining `MapperConfig` arguments (kind, ...)."""
    provenance = statistics.provenance()
    provenance["target_layers"] = None
    provenance.update(probe=selection.probe, top_k=selection.top_k, **(calibration or {}))
    fields = {
        "source_model_id": statistics.source_model_id,
        "source_revision": statistics.source_revision,
        "target_model_id": statistics.target_model_id,
        "target_revision": statistics.target_revision,
        "tokenizer_fingerprint": tokenizer_fingerprint or statistics.tokenizer_fingerprint,
        **fields,
    }
    return MapperConfig(
        source_config=statistics.source_config,
        target_config=statistics.target_config,
        source_layers=selection.source_layers,
        calibration=provenance,
        selection_scores=selection.selected_scores(),
        **fields,
    )


@torch.no_grad()
def mapper_from_statistics(
    statistics: CalibrationStatistics | Sequence[CalibrationStatistics],
    *,
    top_k: int | None = 8,
    ridge_lambda: float = 0.01,
    lambda_convention: str = "absolute",
    dtype: torch.dtype = torch.float32,
    source_layers: Sequence[Sequence[int]] | None = None,
    selection: LayerSelection | None = None,
    tokenizer_fingerprint: str | None = None,
    **config_kwargs,
) -> MapperModel:
    r"""
    Build a ridge `MapperModel` from calibration statistics: select source layers, then solve every target layer.

    Args:
        statistics (`CalibrationStatistics` or a sequence of them): statistics covering every target layer. Several
            objects collected with disjoint `target_layers` (same source side and calibration) may be passed together.
        top_k (`int`, *optional*, defaults to 8): source layers per target layer, chosen by the probe R^2 (`None` or
            `>= L_s`: all). Ignored when `source_layers` or `selection` is given.
        ridge_lambda (`float`, *optional*, defaults to 0.01): ridge penalty.
        lambda_convention (`str`, *optional*, defaults to `"absolute"`): `"absolute"` adds `lambda I`, `"per_token"`
            adds `N * lambda I`.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): dtype of the mapper weights (solves are
            float64 regardless).
        source_layers (`list[list[int]]`, *optional*): explicit source layers per target layer (skips selection).
        selection (`LayerSelection`, *optional*): a precomputed selection (e.g. `LayerSelection.with_top_k`), to sweep
            `k` without re-probing.
        tokenizer_fingerprint (`str`, *optional*): recorded in the config (defaults to the one the statistics carry).
        config_kwargs: further `MapperConfig` fields (e.g. `source_model_id` to override the recorded one).

    Returns:
        [`MapperModel`] of kind `"ridge"` with `config.selection_scores` and `config.calibration` filled in.
    """
    parts = _as_list(statistics)
    first = parts[0]
    num_target = first.target_geometry.num_layers
    owner: dict[int, CalibrationStatistics] = {}
    for part in parts:
        if part is not first:
            part_key, first_key = part._compatibility(), first._compatibility()
            part_key.pop("target_layers"), first_key.pop("target_layers")
            if part_key != first_key or part.fingerprint != first.fingerprint:
                raise ValueError(
                    "Statistics passed together must come from the same model pair, kinds, stride, dtype and "
                    "calibration data (same fingerprint); only their target_layers may differ."
                )
        for layer in part.covered_target_layers:
            if layer in owner:
                raise ValueError(f"Target layer {layer} is covered by more than one of the statistics passed.")
            owner[layer] = part
    missing = [layer for layer in range(num_target) if layer not in owner]
    if missing:
        raise ValueError(
            f"The statistics cover target layers {sorted(owner)} only (collected with target_layers=...), but a "
            f"MapperModel needs all {num_target}: target layers {missing} are missing. Collect them too (other "
            "processes/machines with the remaining target_layers) and pass all the statistics together, or use "
            "`hf_kvmap.fitting.solve_layer` for the covered layers."
        )
    for kind in ("key", "value"):
        if kind not in first.kinds:
            raise ValueError(f"A MapperModel maps keys and values; these statistics hold only {first.kinds}.")

    if selection is None:
        if len(parts) == 1:
            selection = LayerSelection.from_statistics(first, top_k, source_layers=source_layers)
        else:
            pieces = [LayerSelection.from_statistics(part, top_k, source_layers=source_layers) for part in parts]
            scores = torch.stack([p.scores for p in pieces]).nan_to_num(0).sum(0)  # each row is set by one piece
            r2 = {k: torch.stack([p.r2[k] for p in pieces]).nan_to_num(0).sum(0) for k in pieces[0].r2}
            chosen = [next(p.source_layers[t] for p in pieces if p.source_layers[t]) for t in range(num_target)]
            selection = LayerSelection(scores, r2, chosen, top_k, pieces[0].probe, first.provenance())
    elif source_layers is not None:
        raise ValueError("Pass either `source_layers` or `selection`, not both.")

    config = selection_config(
        first,
        selection,
        tokenizer_fingerprint=tokenizer_fingerprint,
        kind="ridge",
        ridge_lambda=ridge_lambda,
        lambda_convention=lambda_convention,
        **config_kwargs,
    )
    model = MapperModel(config).to(dtype)
    for layer_idx, layer in enumerate(model.layers):
        chosen = config.source_layers[layer_idx]
        for kind, proj in (("key", layer.key_proj), ("value", layer.value_proj)):
            weight, bias = solve_layer(
                owner[layer_idx],
                kind,
                layer_idx,
                chosen,
                ridge_lambda=ridge_lambda,
                lambda_convention=lambda_convention,
            )
            proj.weight.copy_(weight.to(proj.weight.device, dtype))
            proj.bias.copy_(bias.to(proj.bias.device, dtype))
    model.selection = selection
    return model


def fits_on_features(kind: str, input_kinds: str = "same", context_window: int = 0) -> bool:
    """Whether a mapper of this kind and inputs is fitted on features kept in memory (`hf_kvmap.mlp`): the MLP, and
    any input the sufficient statistics do not cover; only the per-position ridge is solved from statistics."""
    return kind == "mlp" or input_kinds != "same" or context_window > 0


def fit_mapper(
    source_model,
    target_model,
    calibration: Iterable,
    *,
    top_k: int | None = 8,
    ridge_lambda: float = 0.01,
    lambda_convention: str = "absolute",
    dtype: torch.dtype = torch.float32,
    source_layers: Sequence[Sequence[int]] | None = None,
    tokenizer=None,
    kind: str = "ridge",
    input_kinds: str = "same",
    context_window: int = 0,
    **collect_kwargs,
) -> MapperModel:
    r"""
    Fit a ridge mapper in one pass over `calibration`: `CalibrationStatistics.collect` + `mapper_from_statistics`.

    With `kind="mlp"`, or with inputs the statistics do not cover (`input_kinds="both"`, `context_window > 0`, see
    `MapperConfig`), the mapper is fitted on calibration features kept in memory instead
    (`hf_kvmap.mlp.fit_feature_mapper`; its options, e.g. `hidden_size`, `epochs`, `max_memory_bytes`, pass through
    `collect_kwargs`).

    Args:
        source_model, target_model (`PreTrainedModel`): causal LMs of one family (same tokenizer).
        calibration (iterable): `(batch, seq)` LongTensors of token ids (see `CalibrationStatistics.collect`).
        top_k, ridge_lambda, lambda_convention, dtype, source_layers: see `mapper_from_statistics`.
        tokenizer (*optional*): the shared tokenizer; its vocabulary hash is recorded in the config.
        collect_kwargs: `stride`, `dtype` is the mapper's, so pass `statistics_dtype` for the accumulation dtype,
            `device`, `progress` (see `CalibrationStatistics.collect`).

    Example:

    ```python
    >>> import torch
    >>> from transformers import Qwen3Config, Qwen3ForCausalLM
    >>> from hf_kvmap import MapperModel
    >>> config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    >>> model = Qwen3ForCausalLM(config)
    >>> batches = [torch.randint(0, 64, (4, 32)) for _ in range(4)]
    >>> mapper = MapperModel.fit(model, model, batches, top_k=1, ridge_lambda=1e-6, progress=False)
    >>> mapper.config.source_layers
    [[0], [1]]
    ```
    """
    if kind not in ("ridge", "mlp"):
        raise ValueError(f"kind={kind!r}; expected 'ridge' or 'mlp'.")
    if fits_on_features(kind, input_kinds, context_window):
        from .mlp import fit_feature_mapper

        return fit_feature_mapper(
            source_model,
            target_model,
            calibration,
            kind=kind,
            input_kinds=input_kinds,
            context_window=context_window,
            top_k=top_k,
            ridge_lambda=ridge_lambda,
            lambda_convention=lambda_convention,
            dtype=dtype,
            source_layers=source_layers,
            tokenizer=tokenizer,
            **collect_kwargs,
        )
    statistics_dtype = collect_kwargs.pop("statistics_dtype", torch.float64)
    fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    stats = CalibrationStatistics.collect(
        source_model,
        target_model,
        calibration,
        dtype=statistics_dtype,
        tokenizer_fingerprint=fingerprint,
        **collect_kwargs,
    )
    return mapper_from_statistics(
        stats,
        top_k=top_k,
        ridge_lambda=ridge_lambda,
        lambda_convention=lambda_convention,
        dtype=dtype,
        source_layers=source_layers,
    )


__all__ = [
    "LayerSelection",
    "combined_scores",
    "fit_mapper",
    "fits_on_features",
    "mapper_from_statistics",
    "mapper_r2",
    "probe_kind",
    "r2_matrix",
    "select_top_k",
    "selection_config",
    "solve_layer",
    "tokenizer_fingerprint",
]
