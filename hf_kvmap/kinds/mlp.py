"""`"mlp"`: one MLP per target layer, KV head and K/V (`HeadwiseMLP`), trained on calibration features.

[`train_headwise_mlp`] trains one module from feature tensors (MSE, Adam, shuffled token batches, early stopping on
a held-out split from [`split_rows`]), starting from the ridge solution; [`MLPKind.fit_on_features`] runs it for
every map of a mapper (what `hf_kvmap.fitting.fit` calls).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..early_stopping import train_with_early_stopping
from ..layout import PARTS
from ..modeling_mlp import HeadwiseMLP
from ..regression import regression_metrics, ridge_solve
from ..validation import check_choice, check_int, check_number
from .base import MapperKind, map_inputs, register_mapper_kind
from .ridge import RidgeOptions

MLP_INITS = ("ridge", "random")
EVAL_CHUNK = 16384


@dataclass
class MLPOptions:
    r"""
    The settings of the MLP kind and its training (the penalty of its ridge initialization is `RidgeOptions`').

    Args:
        hidden_size (`int`, *optional*, defaults to 1024): `h`, the MLP's hidden width.
        epochs, batch_tokens, lr, warmup_steps, patience, init: its training (see [`train_headwise_mlp`]).
        val_fraction (`float`, *optional*, defaults to 0.1): share of calibration sequences held out.
    """

    hidden_size: int = 1024
    epochs: int = 20
    batch_tokens: int = 4096
    lr: float = 1e-3
    warmup_steps: int = 50
    val_fraction: float = 0.1
    patience: int | None = 3
    init: str = "ridge"

    def __post_init__(self):
        check_choice("init", self.init, MLP_INITS)
        check_int("hidden_size", self.hidden_size, 1)
        check_int("epochs", self.epochs, 0)
        check_int("batch_tokens", self.batch_tokens, 1)
        check_number("lr", self.lr, 0, strict=True)
        check_int("warmup_steps", self.warmup_steps, 0)
        check_number("val_fraction", self.val_fraction, 0, below=1)
        check_int("patience", self.patience, 0, allow_none=True)


@dataclass
class MLPTrainingResult:
    """What [`train_headwise_mlp`] reports (all MSEs are raw content-space, mean over positions and dims).

    Attributes:
        train_mse, val_mse (`float`): of the returned (best) weights; `val_*` are `nan` without a validation split.
        val_r2 (`float`): per head `1 - SS_res / SS_tot` over its dims, averaged over heads (as the selection probe).
        ridge_train_mse, ridge_val_mse, ridge_val_r2 (`float`): the same for the ridge fitted on the training split
            (`nan` with `init="random"` unless `compare_ridge=True`).
        best_epoch (`int`): epoch of the returned weights (0 = the initialization, e.g. the ridge solution).
        epochs_run (`int`): epochs actually trained (early stopping may end before `epochs`).
        history (`list[dict]`): per epoch `{"epoch", "train_mse", "val_mse"}` (train: mean of batch losses).
        seconds (`float`): wall-clock time of the training.
    """

    train_mse: float
    val_mse: float
    val_r2: float
    ridge_train_mse: float
    ridge_val_mse: float
    ridge_val_r2: float
    best_epoch: int
    epochs_run: int
    history: list[dict[str, float]]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (`nan` -> `None`); the history as per-epoch lists `train_mse_history` and `val_mse_history`."""

        def clean(value):
            return None if isinstance(value, float) and not math.isfinite(value) else value

        out = {key: clean(value) for key, value in self.__dict__.items() if key != "history"}
        out["train_mse_history"] = [clean(row["train_mse"]) for row in self.history]
        out["val_mse_history"] = [clean(row.get("val_mse", float("nan"))) for row in self.history]
        return out


def _standardization(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Per-feature mean/std of `x` (constant features keep scale 1), per-feature mean of `y` and one scalar scale
    for `y` (its RMS around the mean), so that the MSE in standardized outputs is the raw MSE divided by a constant."""
    x64, y64 = x.double(), y.double()
    in_mean = x64.mean(0)
    in_std = x64.var(0, unbiased=False).sqrt()
    floor = 1e-6 * float(in_std.max()) if in_std.numel() else 0.0
    in_scale = torch.where(in_std > max(floor, 1e-12), in_std, torch.ones_like(in_std))
    out_mean = y64.mean(0)
    out_scale = float((y64 - out_mean).square().mean().sqrt())
    return in_mean.float(), in_scale.float(), out_mean.float(), out_scale if out_scale > 1e-12 else 1.0


def train_headwise_mlp(
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_val: torch.Tensor | None = None,
    y_val: torch.Tensor | None = None,
    *,
    num_heads: int,
    head_dim: int,
    hidden_size: int = MLPOptions.hidden_size,
    epochs: int = MLPOptions.epochs,
    batch_tokens: int = MLPOptions.batch_tokens,
    lr: float = MLPOptions.lr,
    patience: int | None = MLPOptions.patience,
    seed: int = 0,
    init: str = MLPOptions.init,
    ridge_lambda: float = RidgeOptions.ridge_lambda,
    lambda_convention: str = RidgeOptions.lambda_convention,
    warmup_steps: int = MLPOptions.warmup_steps,
    compare_ridge: bool = True,
    bar=None,
) -> tuple[HeadwiseMLP, MLPTrainingResult]:
    r"""
    Train one [`HeadwiseMLP`] on content-space feature tensors (MSE, Adam, shuffled token batches, early stopping).

    Training runs in standardized coordinates (per-feature standardized inputs; outputs centered and divided by one
    scalar, so the loss is proportional to the raw MSE); the standardization is folded into the weights at the end,
    so the returned module maps raw features to raw targets. With `init="ridge"` the MLP starts exactly at the ridge
    solution of the training split (`HeadwiseMLP.init_from_ridge`), and the validation MSE of the initialization counts
    as epoch 0, so the best weights kept are never worse on validation than that ridge. Deterministic on CPU for a
    given `seed` (and thread count); runs on the device of `x_train`.

    Args:
        x_train (`torch.Tensor`): `(N, in_features)` float input features.
        y_train (`torch.Tensor`): `(N, num_heads * head_dim)` float targets, head-major.
        x_val, y_val (`torch.Tensor`, *optional*): held-out split for early stopping and metrics.
        num_heads, head_dim (`int`): target geometry.
        hidden_size (`int`, *optional*, defaults to 1024): `h`.
        epochs (`int`, *optional*, defaults to 20): maximum passes over the training split.
        batch_tokens (`int`, *optional*, defaults to 4096): positions per Adam step.
        lr (`float`, *optional*, defaults to 1e-3): Adam learning rate.
        patience (`int`, *optional*, defaults to 3): stop after this many epochs without a new best validation MSE
            among the trained epochs (`None`: never stop early). The weights returned are the best on validation
            including the initialization (epoch 0).
        seed (`int`, *optional*, defaults to 0): seeds the init and the shuffling.
        init (`str`, *optional*, defaults to `"ridge"`): `"ridge"` or `"random"`.
        ridge_lambda (`float`, *optional*, defaults to 0.01): penalty of the ridge for the init and the comparison.
        lambda_convention (`str`, *optional*, defaults to `"absolute"`): `"per_token"` multiplies the penalty by the
            number of training positions (as the ridge kind).
        warmup_steps (`int`, *optional*, defaults to 50): linear learning-rate warmup over this many Adam steps. The
            paper uses none (pass 0); without it, Adam's first full-size steps knock a wide MLP far off the ridge
            solution it starts from (h=1024 on the tiny family: validation MSE 1.8x the ridge's after epoch 1).
        compare_ridge (`bool`, *optional*, defaults to `True`): with `init="random"`, still solve the ridge to report
            it.
        bar (`tqdm`, *optional*): a progress bar advanced by one per epoch (and by the epochs skipped on early stop).

    Returns:
        `(HeadwiseMLP, MLPTrainingResult)`: the best weights (float32, on `x_train`'s device) and the metrics.
    """
    RidgeOptions(ridge_lambda=ridge_lambda, lambda_convention=lambda_convention)  # validates every setting
    MLPOptions(
        hidden_size=hidden_size,
        epochs=epochs,
        batch_tokens=batch_tokens,
        lr=lr,
        patience=patience,
        init=init,
        warmup_steps=warmup_steps,
    )
    if x_train.dim() != 2 or y_train.dim() != 2 or x_train.shape[0] != y_train.shape[0]:
        raise ValueError(
            f"x_train {tuple(x_train.shape)} and y_train {tuple(y_train.shape)} must be (N, F) matrices with equal N."
        )
    if y_train.shape[1] != num_heads * head_dim:
        raise ValueError(f"y_train has {y_train.shape[1]} columns; num_heads * head_dim = {num_heads * head_dim}.")
    if x_train.shape[0] < 2:
        raise ValueError(f"Need at least 2 training positions, got {x_train.shape[0]}.")
    has_val = x_val is not None and y_val is not None and y_val.shape[0] > 0
    started = time.perf_counter()
    device = x_train.device
    in_features = x_train.shape[1]

    in_mean, in_scale, out_mean, out_scale = _standardization(x_train, y_train)

    def standardize_x(x):
        return (x.float() - in_mean) / in_scale

    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    model = HeadwiseMLP(in_features, hidden_size, num_heads, head_dim, device=device, dtype=torch.float32)
    model.reset_parameters(generator=_device_generator(generator, device))

    nan = float("nan")
    ridge_train_mse = ridge_val_mse = ridge_val_r2 = nan
    if init == "ridge" or compare_ridge:
        penalty = ridge_lambda * (x_train.shape[0] if lambda_convention == "per_token" else 1.0)
        weight, bias = ridge_solve(x_train, y_train, penalty)

        def ridge_predict(x):
            return torch.addmm(bias, x.double(), weight.T)

        ridge_train_mse, _ = regression_metrics(ridge_predict, x_train, y_train, num_heads)
        if has_val:
            ridge_val_mse, ridge_val_r2 = regression_metrics(ridge_predict, x_val, y_val, num_heads)
        if init == "ridge":
            # The ridge in standardized coordinates: y_n = (W diag(s_x) x_n + W mu_x + b - mu_y) / s_y.
            weight_n = weight * in_scale.double()[None, :] / out_scale
            bias_n = (weight @ in_mean.double() + bias - out_mean.double()) / out_scale
            model.init_from_ridge(weight_n.float(), bias_n.float())
        del weight, bias

    def standardized_val_mse() -> float:
        total = 0.0
        with torch.no_grad():
            for start in range(0, x_val.shape[0], EVAL_CHUNK):
                pred = model(standardize_x(x_val[start : start + EVAL_CHUNK]))
                target = (y_val[start : start + EVAL_CHUNK].float() - out_mean) / out_scale
                total += float((pred - target).double().square().sum())
        return total / (y_val.shape[0] * y_val.shape[1])

    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = None
    if warmup_steps:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup_steps))
    scale2 = out_scale**2
    n_train = x_train.shape[0]

    def train_epoch(epoch: int) -> dict[str, float]:
        model.train()
        order = torch.randperm(n_train, generator=generator).to(device)
        loss_sum = 0.0
        for start in range(0, n_train, batch_tokens):
            rows = order[start : start + batch_tokens]
            xb = standardize_x(x_train[rows])
            yb = (y_train[rows].float() - out_mean) / out_scale
            loss = F.mse_loss(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            loss_sum += float(loss.detach()) * rows.numel()
        model.eval()
        return {"train_mse": loss_sum / n_train * scale2}

    # The weights kept are the best on validation *including the initialization* (the ridge solution with
    # init="ridge"); patience counts the trained epochs only (`hf_kvmap.early_stopping`).
    stopping = train_with_early_stopping(
        model,
        train_epoch,
        (lambda: standardized_val_mse() * scale2) if has_val else None,
        units=epochs,
        patience=patience,
        unit="epoch",
        metric="val_mse",
        bar=bar,
        clock=False,
    )
    best_epoch, epochs_run, history = stopping.best_unit, stopping.units_run, stopping.history
    model.requires_grad_(False)
    model.fold_affine(in_mean, in_scale, out_mean, out_scale)
    train_mse, _ = regression_metrics(model, x_train.float(), y_train, num_heads)
    val_mse, val_r2 = regression_metrics(model, x_val.float(), y_val, num_heads) if has_val else (nan, nan)
    result = MLPTrainingResult(
        train_mse=train_mse,
        val_mse=val_mse,
        val_r2=val_r2,
        ridge_train_mse=ridge_train_mse,
        ridge_val_mse=ridge_val_mse,
        ridge_val_r2=ridge_val_r2,
        best_epoch=best_epoch,
        epochs_run=epochs_run,
        history=history,
        seconds=time.perf_counter() - started,
    )
    return model, result


def _device_generator(cpu_generator: torch.Generator, device: torch.device) -> torch.Generator:
    """A generator on `device` seeded from `cpu_generator` (the same generator when `device` is the CPU)."""
    if device.type == "cpu":
        return cpu_generator
    seed = int(torch.randint(0, 2**62, (), generator=cpu_generator))
    return torch.Generator(device=device).manual_seed(seed)


def split_rows(
    num_rows: int, val_fraction: float, seed: int = 0, groups: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(train_rows, val_rows)` index tensors: a seeded held-out split, by whole sequences when `groups` has at least
    two of them (so validation positions never share a sequence with training ones), else by positions."""
    check_number("val_fraction", val_fraction, 0, below=1)
    generator = torch.Generator().manual_seed(int(seed))
    everything = torch.arange(num_rows)
    if val_fraction == 0:
        return everything, everything[:0]
    if groups is not None:
        groups = groups.cpu()
        ids = torch.unique(groups)
        if len(ids) >= 2:
            n_val = min(len(ids) - 1, max(1, round(val_fraction * len(ids))))
            val_ids = ids[torch.randperm(len(ids), generator=generator)[:n_val]]
            is_val = torch.isin(groups, val_ids)
            return everything[~is_val], everything[is_val]
    order = torch.randperm(num_rows, generator=generator)
    n_val = min(num_rows - 2, max(1, round(val_fraction * num_rows)))
    return order[n_val:].sort().values, order[:n_val].sort().values


def _mlp_map(config, in_features: int) -> nn.Module:
    """`"mlp"`: one MLP per target KV head, batched (`HeadwiseMLP`)."""
    target = config.target_geometry
    return HeadwiseMLP(in_features, config.mlp_hidden_size, target.num_kv_heads, target.head_dim)


def _mlp_on_features(features, selection, options, target, progress):
    """Every head's MLP of every target layer and part, on a held-out split by whole calibration sequences."""
    train_rows, val_rows = split_rows(features.num_positions, options.val_fraction, options.seed, features.groups)
    train_rows, val_rows = train_rows.to(features.groups.device), val_rows.to(features.groups.device)
    bar = tqdm(
        total=2 * target.num_layers * options.epochs, desc="training MLP mapper", unit="epoch", disable=not progress
    )
    maps, report = {}, []
    for layer_idx in range(target.num_layers):
        chosen = selection.source_layers[layer_idx]
        entry: dict[str, Any] = {"layer": layer_idx}
        for part_idx, part in enumerate(PARTS):
            bar.set_description(f"training MLP mapper (layer {layer_idx} {part})")
            window, input_kinds = map_inputs(options, layer_idx, part)
            x = features.inputs(part, chosen, None, input_kinds, window)
            y = features.outputs(part, layer_idx)
            mlp, result = train_headwise_mlp(
                x[train_rows],
                y[train_rows],
                x[val_rows],
                y[val_rows],
                num_heads=target.num_kv_heads,
                head_dim=target.head_dim,
                seed=options.seed * 1_000_003 + 2 * layer_idx + part_idx,
                bar=bar,
                **options.mlp_settings(),
            )
            maps[layer_idx, part] = mlp.state_dict()
            entry[part] = result.to_dict()
        report.append(entry)
    bar.close()
    training = {
        **options.mlp_settings(),
        "optimizer": "adam",
        "loss": "mse (content space)",
        "val_fraction": options.val_fraction,
        "split": "sequences" if len(torch.unique(features.groups)) >= 2 else "positions",
        "seed": options.seed,
        "positions_train": int(train_rows.numel()),
        "positions_val": int(val_rows.numel()),
        "features": features.provenance,
        "torch_version": torch.__version__,
        "layers": report,
    }
    return maps, {"mlp_training": training}


@register_mapper_kind
class MLPKind(MapperKind):
    """`"mlp"`: see the module docstring."""

    name = "mlp"
    options_class = MLPOptions
    needs_features = True
    build_map = staticmethod(_mlp_map)
    fit_on_features = staticmethod(_mlp_on_features)

    @staticmethod
    def check_options(options, head_dim) -> None:
        if options.init != "ridge":
            return
        dim = head_dim()
        if options.hidden_size < 2 * dim:
            raise ValueError(
                f"init='ridge' needs hidden_size >= 2 * head_dim = {2 * dim} (got {options.hidden_size}); "
                "pass init='random' or a larger hidden_size."
            )


__all__ = ["MLP_INITS", "MLPKind", "MLPOptions", "MLPTrainingResult", "split_rows", "train_headwise_mlp"]
