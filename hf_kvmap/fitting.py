"""Fitting a mapper: the one orchestrator from calibration data (or statistics, or features) to fitted weights.

[`fit`] decides every path:

1. **Statistics**: the given `CalibrationStatistics` (or several covering disjoint target layers), else collected
   now in one pass of the calibration through both models.
2. **Selection**: the given `LayerSelection`, the given `source_layers`, or the top `k` by the single-source probe
   (`hf_kvmap.selection`).
3. **Weights**: the per-position ridge is a sub-block solve of the statistics ([`solve_layer`], no further pass).
   Every other mapper (the MLP kind, `input_kinds="both"`, a `context_window`) is fitted on features kept in memory
   (`hf_kvmap.features.gather_features`, a second pass) by its kind's `fit_on_features` (`hf_kvmap.kinds`): one
   ridge solve per set of maps reading the same inputs, or MLP training (`hf_kvmap.kinds.mlp`). Features passed in
   are always fitted on, whatever the kind (a per-position ridge then takes only its selection from the statistics).
4. **Config**: [`fitted_config`] records both models, the selection, the options and the calibration provenance.

It returns a [`FittedMapper`] (config, weights, selection); [`mapper_from_fitted`] packages it (fine-tuning it first
when the objective says so). The public front doors are [`fit_mapper`] and [`mapper_from_statistics`] (exported as
`hf_kvmap.fit_mapper` and `hf_kvmap.mapper_from_statistics`), which both come here. The model (`modeling_mapper`)
sits below this module and never imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging

from .artifacts import tokenizer_fingerprint as fingerprint_of
from .configuration_mapper import MapperConfig
from .features import PARTS, CalibrationFeatures, gather_features, input_device
from .fit_options import FitOptions
from .geometry import KVGeometry
from .key_norm import target_key_norm
from .kinds import KIND_REGISTRY, map_inputs
from .modeling_mapper import MapperModel
from .objectives import finetune_fitted
from .regression import head_r2, regression_metrics, ridge_from_moments
from .reporting import joined_settings, kernel_settings
from .selection import LayerSelection
from .statistics import CalibrationStatistics

logger = logging.get_logger(__name__)


@dataclass
class FittedMapper:
    """What [`fit`] returns: the mapper's config, its weights (a `MapperModel` state dict, float64/float32 as
    solved), the layer selection it was fitted with (scores for `selection.json` and its heat map) and the dtype the
    model is packaged in (`FitOptions.dtype`)."""

    config: MapperConfig
    state_dict: dict[str, torch.Tensor]
    selection: LayerSelection
    dtype: torch.dtype = torch.float32
    options: FitOptions | None = None


# ------------------------------------------------------------------------------------------------ from statistics
@torch.no_grad()
def solve_layer(
    stats: CalibrationStatistics,
    part: str,
    target_layer: int,
    source_layers: Sequence[int],
    *,
    ridge_lambda: float = FitOptions.ridge_lambda,
    lambda_convention: str = FitOptions.lambda_convention,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The centered ridge with bias of one target layer and part (`"key"`/`"value"`), all target heads at once,
    solved in float64 from the statistics alone.

    Returns `(weight, bias)` in `nn.Linear` layout: weight `(n_kv_t * d_t, k * n_kv_s * d_s)` with input features
    ordered as `source_layers`, bias `(n_kv_t * d_t,)`.
    """
    FitOptions(ridge_lambda=ridge_lambda, lambda_convention=lambda_convention)  # validates both
    rows = stats.source_columns(source_layers).to(stats.device)
    sxx, sxy, mean_x, mean_y, _ = stats.centered(part, rows, stats.target_columns(target_layer))
    penalty = ridge_lambda * (stats.count(part) if lambda_convention == "per_token" else 1.0)
    return ridge_from_moments(sxx, sxy, mean_x, mean_y, penalty)


@torch.no_grad()
def mapper_r2(stats: CalibrationStatistics, mapper) -> dict[str, torch.Tensor]:
    """Calibration R^2 of a ridge mapper's affine maps on `stats`, per part: float64 `Tensor[L_t]` (NaN where the
    statistics do not cover a layer), computed from the statistics alone (`SS_res = SS_tot - 2 tr(W^T Sxy) +
    tr(W^T Sxx W)` for the centered residual, plus the bias offset `N |mean_y - mean_x W - b|^2`)."""
    tgt = stats.target_geometry
    out = {}
    for part in stats.parts:
        scores = torch.full((tgt.num_layers,), float("nan"), dtype=torch.float64)
        for layer in stats.covered_target_layers:
            proj = getattr(mapper.layers[layer], "key_proj" if part == "key" else "value_proj")
            rows = stats.source_columns(mapper.config.source_layers[layer]).to(stats.device)
            sxx, sxy, mean_x, mean_y, ss_tot = stats.centered(part, rows, stats.target_columns(layer))
            weight = proj.weight.detach().to(sxx.device, torch.float64).T
            bias = proj.bias.detach().to(sxx.device, torch.float64)
            offset = mean_y - mean_x @ weight - bias
            ss_res = ss_tot - 2 * (weight * sxy).sum(0) + (weight * (sxx @ weight)).sum(0)
            ss_res = ss_res + stats.count(part) * offset.square()
            scores[layer] = head_r2(ss_res, ss_tot, tgt.num_kv_heads).mean().cpu()
        out[part] = scores
    return out


def _owners(parts: list[CalibrationStatistics]) -> dict[int, CalibrationStatistics]:
    """Which of several statistics covers each target layer (refusing overlaps, gaps and mixed calibrations)."""
    first = parts[0]
    num_target = first.target_geometry.num_layers
    owner: dict[int, CalibrationStatistics] = {}
    for part in parts:
        if part is not first:
            part_key, first_key = part._compatibility(), first._compatibility()
            part_key.pop("target_layers"), first_key.pop("target_layers")
            if part_key != first_key or part.fingerprint != first.fingerprint:
                raise ValueError(
                    "Statistics passed together must come from the same model pair, parts, stride, dtype and "
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
    for name in PARTS:
        if name not in first.parts:
            raise ValueError(f"A MapperModel maps keys and values; these statistics hold only {first.parts}.")
    return owner


def _select(parts: list[CalibrationStatistics], options: FitOptions) -> LayerSelection:
    first = parts[0]
    if len(parts) == 1:
        return LayerSelection.from_statistics(first, options.top_k, source_layers=options.source_layers)
    pieces = [LayerSelection.from_statistics(p, options.top_k, source_layers=options.source_layers) for p in parts]
    num_target = first.target_geometry.num_layers
    scores = torch.stack([p.scores for p in pieces]).nan_to_num(0).sum(0)  # each row is set by one piece
    r2 = {k: torch.stack([p.r2[k] for p in pieces]).nan_to_num(0).sum(0) for k in pieces[0].r2}
    chosen = [next(p.source_layers[t] for p in pieces if p.source_layers[t]) for t in range(num_target)]
    return LayerSelection(scores, r2, chosen, options.top_k, pieces[0].probe, first.provenance())


def _solve_from_statistics(owner, selection: LayerSelection, options: FitOptions) -> dict[str, torch.Tensor]:
    state = {}
    for layer_idx, chosen in enumerate(selection.source_layers):
        for part, proj in (("key", "key_proj"), ("value", "value_proj")):
            weight, bias = solve_layer(
                owner[layer_idx],
                part,
                layer_idx,
                chosen,
                ridge_lambda=options.ridge_lambda,
                lambda_convention=options.lambda_convention,
            )
            state[f"layers.{layer_idx}.{proj}.weight"] = weight
            state[f"layers.{layer_idx}.{proj}.bias"] = bias
    return state


# ------------------------------------------------------------------------------------------------ on features
def _max_context_window(options: FitOptions, num_layers: int) -> int:
    return max(map_inputs(options, layer, part)[0] for layer in range(num_layers) for part in PARTS)


#: How each mapper kind is fitted on features kept in memory: `(features, selection, options, target geometry,
#: progress) -> ({(target_layer, part): state dict of the map}, calibration record)`; a view of
#: `hf_kvmap.kinds.KIND_REGISTRY` (each kind's `fit_on_features`; a new kind is one file there).
FEATURE_FITTERS: dict[str, Callable] = {name: kind.fit_on_features for name, kind in KIND_REGISTRY.items()}


# ------------------------------------------------------------------------------------------------ orchestrator
def collect_statistics(
    source_model,
    target_model,
    calibration: Iterable,
    options: FitOptions,
    *,
    device: torch.device | str | None = None,
    progress: bool = True,
    fingerprint: str | None = None,
) -> CalibrationStatistics:
    """The statistics [`fit`] collects (one pass, `options.stride` and `options.statistics_dtype`), for a caller that
    keeps them (e.g. saves them) before fitting."""
    return CalibrationStatistics.collect(
        source_model,
        target_model,
        calibration,
        stride=options.stride,
        dtype=options.statistics_dtype,
        device=device,
        progress=progress,
        tokenizer_fingerprint=fingerprint,
    )


def fitted_config(
    statistics: CalibrationStatistics,
    selection: LayerSelection,
    options: FitOptions,
    *,
    tokenizer_fingerprint: str | None = None,
    calibration: dict[str, Any] | None = None,
    **fields,
) -> MapperConfig:
    """The `MapperConfig` of a mapper fitted on `statistics` with `selection` and `options`: both models' configs,
    ids and revisions, the tokenizer fingerprint, the selected layers and their scores, the calibration provenance
    (plus `calibration`, e.g. the MLP training record). `fields` override recorded `MapperConfig` fields."""
    provenance = statistics.provenance()
    provenance["target_layers"] = None
    provenance.update(probe=selection.probe, top_k=selection.top_k, **(calibration or {}))
    fields = {
        "source_model_id": statistics.source_model_id,
        "source_revision": statistics.source_revision,
        "target_model_id": statistics.target_model_id,
        "target_revision": statistics.target_revision,
        "tokenizer_fingerprint": tokenizer_fingerprint or statistics.tokenizer_fingerprint,
        "kind": options.kind,
        "ridge_lambda": options.ridge_lambda,
        "lambda_convention": options.lambda_convention,
        "mlp_hidden_size": options.hidden_size,
        "input_kinds": options.input_kinds,
        "context_window": options.context_window,
        "layer_inputs": options.layer_inputs,
        "key_norm": options.key_norm,
        "objective": options.objective,
        "objective_settings": options.objective_settings(),
        **fields,
    }
    return MapperConfig(
        source_summary=statistics.source_summary,
        target_summary=statistics.target_summary,
        source_layers=selection.source_layers,
        calibration=provenance,
        selection_scores=selection.selected_scores(),
        **fields,
    )


def fit(
    source_model=None,
    target_model=None,
    calibration: Iterable | None = None,
    *,
    options: FitOptions | None = None,
    statistics: CalibrationStatistics | Sequence[CalibrationStatistics] | None = None,
    selection: LayerSelection | None = None,
    features: CalibrationFeatures | None = None,
    tokenizer=None,
    tokenizer_fingerprint: str | None = None,
    device: torch.device | str | None = None,
    progress: bool = True,
    config_fields: dict[str, Any] | None = None,
    **option_changes,
) -> FittedMapper:
    r"""
    Fit a mapper: statistics, selection and weights (see the module docstring for the paths).

    Args:
        source_model, target_model (`PreTrainedModel`, *optional*): causal LMs of one family (same tokenizer). Not
            needed when `statistics` are given and the mapper is solved from them alone.
        calibration (iterable, *optional*): `(batch, seq)` LongTensors of token ids, or dicts with `input_ids` and
            `attention_mask` (materialized into a list when it is read twice).
        options (`FitOptions`, *optional*): every fitting setting; `option_changes` (e.g. `top_k=2`,
            `kind="mlp"`) replace single fields of it (or of the defaults).
        statistics (`CalibrationStatistics` or a sequence of them, *optional*): precomputed statistics; several
            collected with disjoint `target_layers` may be passed together for a statistics-only ridge.
        selection (`LayerSelection`, *optional*): a precomputed selection (e.g. `LayerSelection.with_top_k`), to
            sweep `k` without re-probing.
        features (`CalibrationFeatures`, *optional*): precomputed features; when given, the maps are fitted on them
            whatever the kind (a per-position ridge too: solved on these positions, the statistics then give only
            the selection and the geometry).
        tokenizer (*optional*): the shared tokenizer; its fingerprint is recorded (or pass `tokenizer_fingerprint`).
        device (*optional*): where statistics and features live and training runs (default: the source model's
            input device).
        progress (`bool`, *optional*, defaults to `True`): tqdm progress bars.
        config_fields (`dict`, *optional*): `MapperConfig` fields to record instead of the derived ones (e.g.
            `source_model_id`).

    Returns:
        [`FittedMapper`].
    """
    options = (options or FitOptions()).replace(**option_changes)
    fingerprint = tokenizer_fingerprint or (fingerprint_of(tokenizer) if tokenizer is not None else None)
    on_features = options.fits_on_features or features is not None
    if (on_features and features is None) or statistics is None:
        if source_model is None or target_model is None or calibration is None:
            raise ValueError(
                "Pass the source and target models and the calibration data (only a per-position ridge can be "
                "solved from `statistics` alone)."
            )
        calibration = list(calibration)
        if device is None:
            device = input_device(source_model)

    def target_head_dim() -> int:
        if target_model is not None:
            return KVGeometry.from_config(target_model.config).head_dim
        # statistics and features were given (checked above)
        first = statistics if isinstance(statistics, CalibrationStatistics) else next(iter(statistics), None)
        return first.target_geometry.head_dim if first is not None else 0

    if on_features:  # the kind's own checks, before any pass
        KIND_REGISTRY[options.kind].check_options(options, target_head_dim)
    if statistics is None:
        statistics = collect_statistics(
            source_model, target_model, calibration, options, device=device, progress=progress, fingerprint=fingerprint
        )
    parts = [statistics] if isinstance(statistics, CalibrationStatistics) else list(statistics)
    if not parts or not all(isinstance(p, CalibrationStatistics) for p in parts):
        raise ValueError("Pass a CalibrationStatistics (or a sequence of them covering disjoint target layers).")
    if on_features and (len(parts) > 1 or parts[0].target_layers is not None):
        raise ValueError(
            f"The statistics cover target layers {parts[0].target_layers} only; fitting on features needs the "
            "selection of every target layer. Collect statistics with target_layers=None."
        )
    owner = _owners(parts)
    if selection is not None and options.source_layers is not None:
        raise ValueError("Pass either `source_layers` or `selection`, not both.")
    selection = selection or _select(parts, options)
    first = parts[0]
    if not on_features:
        state, record = _solve_from_statistics(owner, selection, options), {}
    else:
        if features is None:
            features = gather_features(
                source_model,
                target_model,
                calibration,
                source_layers=sorted({layer for layers in selection.source_layers for layer in layers}),
                stride=options.stride,
                context_window=_max_context_window(options, first.target_geometry.num_layers),
                device=device,
                max_memory_bytes=options.max_memory_bytes,
                progress=progress,
            )
        kind = KIND_REGISTRY[options.kind]
        maps, record = kind.fit_on_features(features, selection, options, first.target_geometry, progress)
        state = {
            f"layers.{layer_idx}.{part}_proj.{name}": tensor
            for (layer_idx, part), module_state in maps.items()
            for name, tensor in module_state.items()
        }
    key_norm_fields = {}
    if options.key_norm:
        weights, key_norm_fields = target_key_norm(target_model)
        state.update({f"layers.{layer_idx}.key_norm_weight": weight for layer_idx, weight in enumerate(weights)})
    settings = joined_settings(*(part.kernel_settings for part in parts))  # of the sums; of the solve, this process's
    solved_on = device if on_features and device is not None else first.device
    record = {"kernel_settings": settings, "solve_kernel_settings": kernel_settings(solved_on), **record}
    config = fitted_config(
        first,
        selection,
        options,
        tokenizer_fingerprint=fingerprint,
        calibration=record,
        **key_norm_fields,
        **(config_fields or {}),
    )
    return FittedMapper(config, state, selection, options.dtype, options)


@torch.no_grad()
def content_space_metrics(mapper, features: CalibrationFeatures, rows: torch.Tensor | None = None) -> dict[str, Any]:
    r"""
    Held-out content-space quality of any `MapperModel` (ridge or MLP) on gathered features.

    Returns `{"key": {"mse", "r2", "per_layer_mse", "per_layer_r2"}, "value": {...}, "mse", "r2"}`: raw MSE over
    positions and dims, and per-head R^2 averaged over heads, per target layer and averaged over layers (then parts).
    """
    tgt = mapper.config.target_geometry
    out: dict[str, Any] = {}
    for part in features.source:
        mses, r2s = [], []
        for layer_idx, layer in enumerate(mapper.layers):
            param = next(layer.parameters())

            def predict(x, layer=layer, param=param, part=part):
                return layer.map_part(part, x.to(param.device, param.dtype)).float()

            window, input_kinds = mapper.config.part_inputs(layer_idx, part)
            x = features.inputs(part, mapper.config.source_layers[layer_idx], rows, input_kinds, window)
            y = features.outputs(part, layer_idx, rows)
            mse, r2 = regression_metrics(predict, x, y, tgt.num_kv_heads)
            mses.append(mse)
            r2s.append(r2)
        out[part] = {
            "mse": sum(mses) / len(mses),
            "r2": sum(r2s) / len(r2s),
            "per_layer_mse": mses,
            "per_layer_r2": r2s,
        }
    parts = list(features.source)
    out["mse"] = sum(out[k]["mse"] for k in parts) / len(parts)
    out["r2"] = sum(out[k]["r2"] for k in parts) / len(parts)
    return out


# ------------------------------------------------------------------------------------------------ front doors
def mapper_from_fitted(fitted: FittedMapper, **objective_inputs) -> MapperModel:
    """Package a [`FittedMapper`] as a `MapperModel` in the dtype it was fitted for (`MapperModel.from_fitted`); one
    fitted with a fine-tuning objective (`"kl"`, `"attention"`, ...) is first fine-tuned with both models
    (`objective_inputs`: `source_model`, `target_model`, `calibration`, `progress`; see
    `hf_kvmap.objectives.finetune_fitted`)."""
    if fitted.options is not None and fitted.options.objective_stages:
        return finetune_fitted(fitted, **objective_inputs)
    return MapperModel.from_fitted(fitted)


def fit_mapper(source_model, target_model, calibration, **kwargs) -> MapperModel:
    r"""
    Fit a mapper on calibration data through both models ([`fit`], then [`mapper_from_fitted`]).

    The per-position ridge is solved from sufficient statistics collected in one pass; the MLP kind and wider
    inputs are fitted on features kept in memory (a second pass).

    Args:
        source_model, target_model (`PreTrainedModel`): causal LMs of one family (same tokenizer).
        calibration (iterable): `(batch, seq)` LongTensors of token ids (or dicts with `input_ids` and
            `attention_mask`).
        kwargs: the `FitOptions` fields (`kind`, `top_k`, `context_window`, `layer_inputs`, `key_norm`,
            `objective`, `kl_steps`, `hidden_size`, `stride`, `dtype`, ...) or `options=FitOptions(...)`, the other
            arguments of [`fit`] (`tokenizer`, `statistics`, `features`, `device`, `progress`), and
            `kl_calibration`: the sequences of the fine-tunes (`objective="kl"`, `"attention"`, ...).

    Example:

    ```python
    >>> import torch
    >>> from transformers import Qwen3Config, Qwen3ForCausalLM
    >>> from hf_kvmap import fit_mapper
    >>> config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    >>> model = Qwen3ForCausalLM(config)
    >>> batches = [torch.randint(0, 64, (4, 32)) for _ in range(4)]
    >>> mapper = fit_mapper(model, model, batches, top_k=1, ridge_lambda=1e-6, progress=False)
    >>> mapper.config.source_layers
    [[0], [1]]
    ```
    """
    kl_calibration = kwargs.pop("kl_calibration", None)
    calibration = list(calibration)
    fitted = fit(source_model, target_model, calibration, **kwargs)
    inputs = {"source_model": source_model, "target_model": target_model, "progress": kwargs.get("progress", True)}
    return mapper_from_fitted(fitted, calibration=calibration if kl_calibration is None else kl_calibration, **inputs)


def mapper_from_statistics(statistics, **kwargs) -> MapperModel:
    """The closed-form ridge mapper from `CalibrationStatistics` (or several covering disjoint target layers):
    selection and solve, no pass over data ([`fit`] with `statistics=`; `kwargs` as for [`fit_mapper`], plus
    `selection=` to reuse a `LayerSelection`)."""
    return mapper_from_fitted(fit(statistics=statistics, **kwargs))


__all__ = [
    "FEATURE_FITTERS",
    "FittedMapper",
    "collect_statistics",
    "content_space_metrics",
    "fit",
    "fit_mapper",
    "fitted_config",
    "mapper_from_fitted",
    "mapper_from_statistics",
    "mapper_r2",
    "solve_layer",
]
