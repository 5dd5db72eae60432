"""`family fit`: the paper's ridge (k = 8, k = all, one Cholesky for every layer) and ridge self-maps from the
statistics."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from hf_kvmap.real.calibrating import checkpoint_dir

from .common import DIRECTIONS, VARIANTS, direction_name, mapper_dir, save_atomically, stats_dir, write_json


def self_statistics(stats, side: str):
    """Statistics of a model mapped onto itself, from either direction's statistics (its Gram is in both ways of
    holding it: as the source Gram, or, for the target side, not at all, so only `side="source"` is possible)."""
    from hf_kvmap import CalibrationStatistics
    from hf_kvmap.moments import PartStatistics

    if side != "source":
        raise ValueError("Only the source side of a statistics object carries its full Gram.")
    config = stats.source_summary
    self_stats = CalibrationStatistics(
        config,
        config,
        parts=stats.parts,
        stride=stats.stride,
        dtype=stats.dtype,
        source_model_id=stats.source_model_id,
        target_model_id=stats.source_model_id,
        tokenizer_fingerprint=stats.tokenizer_fingerprint,
        allocate=False,
    )
    for part in stats.parts:
        own = stats[part]
        self_stats.stats[part] = PartStatistics(
            count=own.count.clone(),
            source_sum=own.source_sum.clone(),
            target_sum=own.source_sum.clone(),
            target_sumsq=own.gram.diagonal().clone(),
            gram=own.gram,
            cross=own.gram,
        )
    self_stats.tokens, self_stats.sequences = stats.tokens.clone(), stats.sequences.clone()
    self_stats.fingerprint_limbs = stats.fingerprint_limbs.clone()
    return self_stats


@torch.no_grad()
def ridge_all_mapper(stats, selection, ridge_lambda: float):
    """The k = all ridge mapper, solved with one Cholesky factorization per part for every target layer at once.

    `mapper_from_statistics` factors the same source Gram once per target layer and part; with k = all every
    target layer reads the same inputs, so one factorization serves all of them (2 instead of 2 L_t for a
    7,168-wide Gram). Same centered ridge with bias and absolute lambda; a test ties it to the library's solve.
    """
    from hf_kvmap import FitOptions, FittedMapper, MapperModel, fitted_config

    selection = selection.with_top_k(None)
    options = FitOptions(kind="ridge", top_k=None, ridge_lambda=ridge_lambda, lambda_convention="absolute")
    config = fitted_config(stats, selection, options)
    state = {}
    for part in ("key", "value"):
        moments = stats[part]
        n = float(moments.count)
        sx, sy = moments.source_sum.double(), moments.target_sum.double()
        sxx = moments.gram.double() - torch.outer(sx, sx) / n
        sxx.diagonal().add_(ridge_lambda)
        sxy = moments.cross.double() - torch.outer(sx, sy) / n
        weight = torch.cholesky_solve(sxy, torch.linalg.cholesky(sxx))  # (F_s, F_t)
        bias = sy / n - (sx / n) @ weight
        del sxx, sxy
        for layer_idx in range(stats.target_geometry.num_layers):
            rows = stats.source_columns(config.source_layers[layer_idx])
            cols = stats.target_columns(layer_idx)
            state[f"layers.{layer_idx}.{part}_proj.weight"] = weight[:, cols][rows].T.contiguous()
            state[f"layers.{layer_idx}.{part}_proj.bias"] = bias[cols].clone()
    return MapperModel.from_fitted(FittedMapper(config, state, selection, torch.float32))


def cmd_fit(args) -> int:
    from hf_kvmap import CalibrationStatistics, LayerSelection, mapper_from_statistics

    work = Path(args.work)
    calibration = Path(args.calibration) if args.calibration else work / "calib"
    checkpoint = checkpoint_dir(calibration)
    if checkpoint is None:
        raise SystemExit(f"No calibration checkpoint under {calibration}; run the calibrate command first.")
    progress = json.loads((checkpoint / "progress.json").read_text())
    fitted = {}
    for source, target in DIRECTIONS:
        stats = CalibrationStatistics.load(stats_dir(checkpoint, source, target))
        start = time.perf_counter()
        selection = LayerSelection.from_statistics(stats)
        for variant, top_k in VARIANTS.items():
            if top_k is None:
                mapper = ridge_all_mapper(stats, selection, args.ridge_lambda)
            else:
                mapper = mapper_from_statistics(
                    stats, ridge_lambda=args.ridge_lambda, selection=selection.with_top_k(top_k)
                )
            folder = mapper_dir(work, source, target, variant)
            save_atomically(mapper, folder)
            fitted[f"{direction_name(source, target)}/{variant}"] = {
                "seconds": time.perf_counter() - start,
                "positions": stats.count(),
                "sequences": int(stats.sequences),
                "folder": str(folder),
            }
            start = time.perf_counter()
        # the source model onto itself: a sanity bound on what a ridge of these features can do at all
        self_stats = self_statistics(stats, "source")
        mapper = ridge_all_mapper(self_stats, LayerSelection.from_statistics(self_stats), args.ridge_lambda)
        folder = mapper_dir(work, source, source, "ridge-all")
        save_atomically(mapper, folder)
        fitted[f"{direction_name(source, source)}/ridge-all"] = {
            "seconds": time.perf_counter() - start,
            "positions": stats.count(),
            "sequences": int(stats.sequences),
            "folder": str(folder),
        }
        del stats, self_stats
    write_json(work / "fit.json", {"ridge_lambda": args.ridge_lambda, "calibration": progress, "mappers": fitted})
    print(json.dumps(fitted, indent=1))
    return 0
