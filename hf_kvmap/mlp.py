"""The `"mlp"` mapper kind: one small MLP per (target layer, KV head, K/V), batched over heads, and its training.

PAPER.md ("MLP variant"): on the same inputs as the ridge (content-space keys or values of the selected source layers,
all KV heads concatenated), each target KV head gets `Linear(d_in -> h), ReLU, Linear(h -> h), ReLU,
Linear(h -> d_head)`, trained with MSE, Adam (lr 1e-3), 20 epochs of 4,096-token batches on the calibration data.

- [`HeadwiseMLP`] holds the MLPs of every head of one target layer and K or V as `(heads, in, out)` parameters and
  applies them with one GEMM plus two batched GEMMs (no loop over heads).
- [`train_headwise_mlp`] trains one `HeadwiseMLP` from feature tensors (the low-level entry, no models needed).
- [`gather_features`] streams the calibration once through both models (reusing `CalibrationStatistics.model_features`, the
  same feature extraction as the ridge statistics) and keeps the content-space features in memory.
- [`fit_mlp_mapper`] ties it together: statistics -> layer selection (`hf_kvmap.fitting`) -> features -> training of
  every target layer and K/V -> a `MapperModel` of kind `"mlp"`.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)

#: Default bound on the features `gather_features` keeps in memory (bytes).
DEFAULT_MAX_MEMORY_BYTES = 16 * 2**30
INITS = ("ridge", "random")
_EVAL_CHUNK = 16384


# ------------------------------------------------------------------------------------------------ module
class HeadwiseMLP(nn.Module):
    r"""
    One MLP per target KV head, `Linear(d_in -> h), ReLU, Linear(h -> h), ReLU, Linear(h -> d_head)`, heads batched.

    Every head reads the same input features (the selected source layers, all their KV heads); head `i` writes output
    columns `i * head_dim : (i + 1) * head_dim`, i.e. the output is flattened over `(head, dim)` like the ridge map's.
    Parameters are stored per head, `weight_*` `(heads, in, out)` and `bias_*` `(heads, out)`; the forward is one GEMM
    for the first layer (all heads share the input) and two `torch.baddbmm` for the others.

    Args:
        in_features (`int`): `d_in`, the width of the input features.
        hidden_size (`int`): `h`, the width of both hidden layers.
        num_heads (`int`): target KV heads.
        head_dim (`int`): target head dim.
        device, dtype (*optional*): where and in which dtype to allocate the parameters.

    Initialization (`reset_parameters`, called by `__init__`, draws from torch's global RNG so `torch.manual_seed`
    makes it deterministic): He-uniform weights for the two ReLU layers, `U(+-1/sqrt(h))` for the output layer, zero
    biases. `PreTrainedModel._init_weights` (transformers 5.23) leaves modules with plain `nn.Parameter`s alone, so
    this init survives `MapperModel.post_init`.

    Example:

    ```python
    >>> import torch
    >>> from hf_kvmap.mlp import HeadwiseMLP
    >>> _ = torch.manual_seed(0)
    >>> mlp = HeadwiseMLP(in_features=64, hidden_size=32, num_heads=2, head_dim=16)
    >>> mlp(torch.randn(3, 5, 64)).shape
    torch.Size([3, 5, 32])
    ```
    """

    def __init__(
        self,
        in_features: int,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        for name, value in (
            ("in_features", in_features),
            ("hidden_size", hidden_size),
            ("num_heads", num_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        self.in_features, self.hidden_size = in_features, hidden_size
        self.num_heads, self.head_dim = num_heads, head_dim
        factory = {"device": device, "dtype": dtype}
        self.weight_in = nn.Parameter(torch.empty(num_heads, in_features, hidden_size, **factory))
        self.bias_in = nn.Parameter(torch.empty(num_heads, hidden_size, **factory))
        self.weight_hidden = nn.Parameter(torch.empty(num_heads, hidden_size, hidden_size, **factory))
        self.bias_hidden = nn.Parameter(torch.empty(num_heads, hidden_size, **factory))
        self.weight_out = nn.Parameter(torch.empty(num_heads, hidden_size, head_dim, **factory))
        self.bias_out = nn.Parameter(torch.empty(num_heads, head_dim, **factory))
        self.reset_parameters()

    @property
    def out_features(self) -> int:
        return self.num_heads * self.head_dim

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"head_dim={self.head_dim}"
        )

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Random init (see the class docstring); `generator` defaults to torch's global RNG."""
        if self.weight_in.device.type == "meta":
            return
        for weight, fan_in, gain in (
            (self.weight_in, self.in_features, math.sqrt(2.0)),
            (self.weight_hidden, self.hidden_size, math.sqrt(2.0)),
            (self.weight_out, self.hidden_size, 1.0),
        ):
            bound = gain * math.sqrt(3.0 / fan_in)
            weight.uniform_(-bound, bound, generator=generator)
        for bias in (self.bias_in, self.bias_hidden, self.bias_out):
            bias.zero_()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """`(..., in_features)` -> `(..., num_heads * head_dim)` (head-major, like the ridge map)."""
        if features.shape[-1] != self.in_features:
            raise ValueError(f"HeadwiseMLP expects {self.in_features} input features, got {features.shape[-1]}.")
        lead = features.shape[:-1]
        x = features.reshape(-1, self.in_features)
        heads, hidden = self.num_heads, self.hidden_size
        # Layer 1: every head reads the same input, so all heads are one GEMM against (in, heads * hidden).
        weight_in = self.weight_in.permute(1, 0, 2).reshape(self.in_features, heads * hidden)
        h = torch.addmm(self.bias_in.reshape(-1), x, weight_in).relu_()
        h = h.view(-1, heads, hidden).transpose(0, 1)  # (heads, n, hidden)
        h = torch.baddbmm(self.bias_hidden.unsqueeze(1), h, self.weight_hidden).relu_()
        out = torch.baddbmm(self.bias_out.unsqueeze(1), h, self.weight_out)  # (heads, n, head_dim)
        return out.transpose(0, 1).reshape(*lead, self.out_features)

    @torch.no_grad()
    def init_from_ridge(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> HeadwiseMLP:
        r"""
        Make the MLP compute exactly the affine map `x @ weight.T + bias` (a ridge solution); other units stay random.

        Per head, hidden units `0..d-1` of layer 1 compute `relu(y)` and units `d..2d-1` compute `relu(-y)` of the
        head's affine output `y`; layer 2 passes these `2 d` units through unchanged (an identity block; inputs are
        already non-negative) and the output layer returns `relu(y) - relu(-y) = y`. The other `h - 2 d` units keep
        their random init but enter the output with zero weight, so training starts exactly at the ridge solution and
        can only add to it. Needs `hidden_size >= 2 * head_dim`.

        Args:
            weight (`torch.Tensor`): `(num_heads * head_dim, in_features)`, `nn.Linear` layout.
            bias (`torch.Tensor`, *optional*): `(num_heads * head_dim,)`; zeros when omitted.

        Returns:
            `self`.
        """
        heads, dim, hidden = self.num_heads, self.head_dim, self.hidden_size
        if hidden < 2 * dim:
            raise ValueError(
                f"init_from_ridge needs hidden_size >= 2 * head_dim = {2 * dim} to pass the linear map through the "
                f"ReLUs exactly, but hidden_size={hidden}; use a larger hidden size or a random init."
            )
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"Ridge weight has shape {tuple(weight.shape)}; expected {(self.out_features, self.in_features)}."
            )
        if bias is None:
            bias = torch.zeros(self.out_features)
        if tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"Ridge bias has shape {tuple(bias.shape)}; expected {(self.out_features,)}.")
        like = {"device": self.weight_in.device, "dtype": self.weight_in.dtype}
        per_head = weight.to(**like).view(heads, dim, self.in_features).transpose(1, 2)  # (heads, in, dim)
        bias = bias.to(**like).view(heads, dim)
        self.weight_in[:, :, :dim] = per_head
        self.weight_in[:, :, dim : 2 * dim] = -per_head
        self.bias_in[:, :dim] = bias
        self.bias_in[:, dim : 2 * dim] = -bias
        self.weight_hidden[:, :, : 2 * dim] = 0
        self.weight_hidden[:, : 2 * dim, : 2 * dim] = torch.eye(2 * dim, **like)
        self.bias_hidden[:, : 2 * dim] = 0
        eye = torch.eye(dim, **like)
        self.weight_out.zero_()
        self.weight_out[:, :dim] = eye
        self.weight_out[:, dim : 2 * dim] = -eye
        self.bias_out.zero_()
        return self

    @torch.no_grad()
    def fold_affine(
        self,
        in_mean: torch.Tensor,
        in_scale: torch.Tensor,
        out_mean: torch.Tensor,
        out_scale: torch.Tensor | float,
    ) -> HeadwiseMLP:
        r"""
        Fold input standardization and output de-standardization into the weights (exact up to float rounding).

        If the MLP maps standardized inputs `(x - in_mean) / in_scale` to standardized outputs `(y - out_mean) /
        out_scale`, afterwards it maps raw `x` to raw `y`. Computed in float64.

        Args:
            in_mean, in_scale (`torch.Tensor`): `(in_features,)`.
            out_mean (`torch.Tensor`): `(num_heads * head_dim,)`.
            out_scale (`torch.Tensor` or `float`): a scalar, or `(num_heads * head_dim,)`.
        """
        dtype = self.weight_in.dtype
        f64 = {"device": self.weight_in.device, "dtype": torch.float64}
        in_mean, in_scale = in_mean.to(**f64), in_scale.to(**f64)
        out_mean = out_mean.to(**f64).view(self.num_heads, self.head_dim)
        out_scale = torch.as_tensor(out_scale, **f64).expand(self.out_features).reshape(self.num_heads, self.head_dim)
        weight_in = self.weight_in.to(torch.float64) / in_scale[None, :, None]
        bias_in = self.bias_in.to(torch.float64) - torch.einsum("i,hio->ho", in_mean, weight_in)
        self.weight_in.copy_(weight_in.to(dtype))
        self.bias_in.copy_(bias_in.to(dtype))
        self.weight_out.copy_((self.weight_out.to(torch.float64) * out_scale[:, None, :]).to(dtype))
        self.bias_out.copy_((self.bias_out.to(torch.float64) * out_scale + out_mean).to(dtype))
        return self


# ------------------------------------------------------------------------------------------------ training
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


def ridge_solve(
    x: torch.Tensor, y: torch.Tensor, ridge_lambda: float = 0.01, chunk: int = 65536
) -> tuple[torch.Tensor, torch.Tensor]:
    """Centered ridge with bias on feature tensors, as `hf_kvmap.fitting.solve_layer` solves it from statistics.

    `W = (Xc^T Xc + lambda I)^-1 Xc^T Yc`, `b = mean(y) - mean(x) W`, accumulated and solved in float64 on `x`'s
    device. Returns `(weight, bias)` in `nn.Linear` layout: `(F_y, F_x)` and `(F_y,)`, float64.
    """
    if ridge_lambda < 0:
        raise ValueError(f"ridge_lambda={ridge_lambda} must be >= 0.")
    n = x.shape[0]
    if n < 2:
        raise ValueError(f"ridge_solve needs at least 2 positions, got {n}.")
    mean_x = x.double().mean(0)
    mean_y = y.double().mean(0)
    gram = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64, device=x.device)
    cross = torch.zeros(x.shape[1], y.shape[1], dtype=torch.float64, device=x.device)
    for start in range(0, n, chunk):
        xc = x[start : start + chunk].double() - mean_x
        gram.addmm_(xc.T, xc)
        cross.addmm_(xc.T, y[start : start + chunk].double() - mean_y)
    gram.diagonal().add_(ridge_lambda)
    factor, info = torch.linalg.cholesky_ex(gram)
    if int(info) == 0:
        weight = torch.cholesky_solve(cross, factor)
    else:  # singular with lambda = 0: minimum-norm solution
        weight = torch.linalg.lstsq(gram.cpu(), cross.cpu(), driver="gelsd").solution.to(x.device)
    bias = mean_y - mean_x @ weight
    return weight.T.contiguous(), bias


@torch.no_grad()
def regression_metrics(
    predict, x: torch.Tensor, y: torch.Tensor, num_heads: int, chunk: int = _EVAL_CHUNK
) -> tuple[float, float]:
    """`(mse, r2)` of `predict(x)` against `y` `(N, heads * head_dim)`: raw MSE over positions and dims, and per-head
    R^2 (`1 - SS_res / SS_tot` summed over the head's dims, `SS_tot` centered on `y`'s own mean) averaged over heads.
    Accumulated in float64. Returns `(nan, nan)` for an empty `y`."""
    n = y.shape[0]
    if n == 0:
        return float("nan"), float("nan")
    mean_y = y.double().mean(0)
    ss_res = torch.zeros(y.shape[1], dtype=torch.float64, device=y.device)
    ss_tot = torch.zeros_like(ss_res)
    for start in range(0, n, chunk):
        target = y[start : start + chunk].double()
        pred = predict(x[start : start + chunk]).double().to(y.device)
        ss_res += (pred - target).square().sum(0)
        ss_tot += (target - mean_y).square().sum(0)
    mse = float(ss_res.sum() / (n * y.shape[1]))
    heads_res = ss_res.view(num_heads, -1).sum(-1)
    heads_tot = ss_tot.view(num_heads, -1).sum(-1)
    r2 = torch.where(heads_tot > 0, 1 - heads_res / heads_tot.clamp_min(1e-300), torch.ones_like(heads_tot))
    return mse, float(r2.mean())


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
    hidden_size: int = 1024,
    epochs: int = 20,
    batch_tokens: int = 4096,
    lr: float = 1e-3,
    patience: int | None = 3,
    seed: int = 0,
    init: str = "ridge",
    ridge_lambda: float = 0.01,
    lambda_convention: str = "absolute",
    warmup_steps: int = 50,
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
            number of training positions (as `hf_kvmap.fitting.solve_layer`).
        warmup_steps (`int`, *optional*, defaults to 50): linear learning-rate warmup over this many Adam steps. The
            paper uses none (pass 0); without it, Adam's first full-size steps knock a wide MLP far off the ridge
            solution it starts from (h=1024 on the tiny family: validation MSE 1.8x the ridge's after epoch 1).
        compare_ridge (`bool`, *optional*, defaults to `True`): with `init="random"`, still solve the ridge to report
            it.
        bar (`tqdm`, *optional*): a progress bar advanced by one per epoch (and by the epochs skipped on early stop).

    Returns:
        `(HeadwiseMLP, MLPTrainingResult)`: the best weights (float32, on `x_train`'s device) and the metrics.
    """
    if init not in INITS:
        raise ValueError(f"init={init!r}; expected one of {INITS}.")
    for name, value in (("epochs", epochs), ("batch_tokens", batch_tokens)):
        if not isinstance(value, int) or value < (0 if name == "epochs" else 1):
            raise ValueError(
                f"{name}={value!r} must be a {'non-negative' if name == 'epochs' else 'positive'} integer."
            )
    if lr <= 0:
        raise ValueError(f"lr={lr} must be > 0.")
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps!r} must be a non-negative integer.")
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
        if lambda_convention not in ("absolute", "per_token"):
            raise ValueError(f"lambda_convention={lambda_convention!r} is not 'absolute' or 'per_token'.")
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
            for start in range(0, x_val.shape[0], _EVAL_CHUNK):
                pred = model(standardize_x(x_val[start : start + _EVAL_CHUNK]))
                target = (y_val[start : start + _EVAL_CHUNK].float() - out_mean) / out_scale
                total += float((pred - target).double().square().sum())
        return total / (y_val.shape[0] * y_val.shape[1])

    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = None
    if warmup_steps:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup_steps))
    history: list[dict[str, float]] = []
    scale2 = out_scale**2
    # The weights kept are the best on validation *including the initialization* (the ridge solution with
    # init="ridge"); early stopping watches the best *trained* epoch only, so a first Adam step that knocks the MLP off
    # the ridge solution does not end training before it recovers.
    best_val = standardized_val_mse() if has_val else nan
    best_state = copy.deepcopy(model.state_dict()) if has_val else None
    best_trained = float("inf")
    best_epoch, stale, epochs_run = 0, 0, 0
    n_train = x_train.shape[0]
    for epoch in range(1, epochs + 1):
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
        epochs_run = epoch
        record = {"epoch": epoch, "train_mse": loss_sum / n_train * scale2}
        if has_val:
            val = standardized_val_mse()
            record["val_mse"] = val * scale2
            if val < best_val:
                best_val, best_epoch = val, epoch
                best_state = copy.deepcopy(model.state_dict())
            if val < best_trained:
                best_trained, stale = val, 0
            else:
                stale += 1
        history.append(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(val_mse=f"{record.get('val_mse', nan):.4g}", refresh=False)
        if has_val and patience is not None and stale >= patience:
            break
    if bar is not None and epochs_run < epochs:
        bar.update(epochs - epochs_run)
    if best_state is not None:
        model.load_state_dict(best_state)
    else:
        best_epoch = epochs_run
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


# ------------------------------------------------------------------------------------------------ features
@dataclass
class CalibrationFeatures:
    r"""
    Content-space features of a calibration set kept in memory, as [`gather_features`] returns them.

    Attributes:
        source (`dict[str, torch.Tensor]`): kind -> `(N, (1 + context_window) * len(source_layers) * n_kv_s * d_s)`
            float32: for position `t`, then `t - 1`, ... (see `hf_kvmap.modeling_mapper.window_features`), the source
            layers in `source_layers` order, each flattened over `(kv_head, dim)` (keys RoPE-stripped).
        target (`dict[str, torch.Tensor]`): kind -> `(N, L_t * n_kv_t * d_t)` float32, every target layer.
        source_layers (`list[int]`): the source layers held, in column order.
        groups (`torch.Tensor`): `(N,)` int64, the calibration sequence each position comes from.
        source_width, target_width (`int`): `n_kv * head_dim` of one layer of each side.
        provenance (`dict`): tokens, sequences, positions, stride and bytes held.
        context_window (`int`): earlier positions held beside each position (0: none).
    """

    source: dict[str, torch.Tensor]
    target: dict[str, torch.Tensor]
    source_layers: list[int]
    groups: torch.Tensor
    source_width: int
    target_width: int
    provenance: dict[str, Any]
    context_window: int = 0

    @property
    def num_positions(self) -> int:
        return int(self.groups.shape[0])

    def inputs(
        self,
        kind: str,
        layers: Sequence[int],
        rows: torch.Tensor | None = None,
        input_kinds: str = "same",
        context_window: int | None = None,
    ) -> torch.Tensor:
        """The inputs of a `kind` map reading source `layers` (in that order), laid out as
        `hf_kvmap.modeling_mapper.mapper_inputs` lays them out: for each position `t, t - 1, ..., t - context_window`
        (default: all held), the layers' features of `kind`, or of keys then values with `input_kinds="both"`."""
        missing = [layer for layer in layers if layer not in self.source_layers]
        if missing:
            raise ValueError(f"Source layers {missing} were not gathered (held: {self.source_layers}).")
        window = self.context_window if context_window is None else context_window
        if window > self.context_window:
            raise ValueError(
                f"context_window={window}, but the features hold {self.context_window} earlier positions."
            )
        parts = ("key", "value") if input_kinds == "both" else (kind,)
        missing = [part for part in parts if part not in self.source]
        if missing:
            raise ValueError(f"The {missing} features were not gathered (held: {list(self.source)}).")
        width, held = self.source_width, len(self.source_layers)
        data = {part: self.source[part] if rows is None else self.source[part][rows] for part in parts}
        pieces = []
        for shift in range(window + 1):
            cols = torch.cat(
                [
                    torch.arange(start, start + width)
                    for start in ((shift * held + self.source_layers.index(layer)) * width for layer in layers)
                ]
            )
            for part in parts:
                pieces.append(data[part].index_select(1, cols.to(data[part].device)))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def outputs(self, kind: str, layer: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`(N, target_width)` content-space targets of target `layer` for `kind`."""
        data = self.target[kind] if rows is None else self.target[kind][rows]
        return data[:, layer * self.target_width : (layer + 1) * self.target_width]


def feature_bytes_per_position(
    source_config, target_config, num_source_layers: int, kinds=("key", "value"), context_window: int = 0
) -> int:
    """Bytes per calibration position that [`gather_features`] keeps: float32 source features of
    `num_source_layers` layers (at `1 + context_window` positions) and of every target layer, per kind."""
    from .rope import KVGeometry

    source, target = KVGeometry.from_config(source_config), KVGeometry.from_config(target_config)
    source_width = (1 + context_window) * num_source_layers * source.layer_width
    return 4 * len(kinds) * (source_width + target.num_layers * target.layer_width)


def _count_positions(batches: Sequence, stride: int) -> int:
    from .statistics import CalibrationStatistics

    total = 0
    for batch in batches:
        input_ids, attention_mask = CalibrationStatistics.unpack_batch(batch)
        if attention_mask is None:
            total += input_ids.shape[0] * len(range(0, input_ids.shape[1], stride))
        else:
            total += int(attention_mask[:, ::stride].bool().sum())
    return total


@torch.no_grad()
def gather_features(
    source_model,
    target_model,
    calibration: Iterable,
    *,
    source_layers: Sequence[int] | None = None,
    stride: int = 1,
    kinds: Sequence[str] = ("key", "value"),
    context_window: int = 0,
    device: torch.device | str = "cpu",
    max_memory_bytes: int | None = DEFAULT_MAX_MEMORY_BYTES,
    progress: bool = True,
) -> CalibrationFeatures:
    r"""
    One streaming pass of `calibration` through both models, keeping the content-space features in memory.

    The features are exactly those `CalibrationStatistics` accumulates (its `_run`: keys RoPE-stripped with each
    model's rotary embedding, every `stride`-th position, padded positions dropped), stored as float32 matrices.
    Memory: `feature_bytes_per_position(...) * positions` =
    `4 * len(kinds) * (len(source_layers) * n_kv_s * d_s + L_t * n_kv_t * d_t)` bytes per kept position; the pass is
    refused with `MemoryError` *before any forward* when that exceeds `max_memory_bytes`.

    Args:
        source_model, target_model (`PreTrainedModel`): the pair.
        calibration (iterable): `(batch, seq)` LongTensors of token ids or dicts with `input_ids`/`attention_mask`
            (materialized into a list: the positions are counted before the pass).
        source_layers (`list[int]`, *optional*): the source layers to keep (all when `None`), in column order.
        stride (`int`, *optional*, defaults to 1): keep every `stride`-th position.
        kinds (`tuple[str, ...]`, *optional*, defaults to `("key", "value")`).
        context_window (`int`, *optional*, defaults to 0): also keep, beside each kept position, the source features
            of the `context_window` positions before it (computed before striding, zeros before the first token),
            as a mapper with that `context_window` reads them.
        device (*optional*, defaults to `"cpu"`): where the features live.
        max_memory_bytes (`int`, *optional*, defaults to 16 GiB): refuse larger feature sets; `None`: no bound.
        progress (`bool`, *optional*, defaults to `True`): tqdm progress bar.
    """
    from tqdm.auto import tqdm

    from .modeling_mapper import window_features
    from .rope import KVGeometry, RotaryCodec, positions_from_attention_mask
    from .statistics import CalibrationStatistics

    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride={stride!r} must be a positive integer.")
    if isinstance(context_window, bool) or not isinstance(context_window, int) or context_window < 0:
        raise ValueError(f"context_window={context_window!r} must be a non-negative integer.")
    kinds = tuple(kind for kind in ("key", "value") if kind in tuple(kinds))
    if not kinds:
        raise ValueError("kinds must include 'key' and/or 'value'.")
    source_geometry = KVGeometry.from_config(source_model.config)
    target_geometry = KVGeometry.from_config(target_model.config)
    if source_layers is None:
        source_layers = list(range(source_geometry.num_layers))
    source_layers = [int(layer) for layer in source_layers]
    bad = [layer for layer in source_layers if not 0 <= layer < source_geometry.num_layers]
    if bad or not source_layers or len(set(source_layers)) != len(source_layers):
        raise ValueError(
            f"source_layers={source_layers} must be distinct layers of the source "
            f"({source_geometry.num_layers} layers)."
        )
    batches = list(calibration)
    positions = _count_positions(batches, stride)
    per_position = feature_bytes_per_position(
        source_model.config, target_model.config, len(source_layers), kinds, context_window
    )
    needed = per_position * positions
    if max_memory_bytes is not None and needed > max_memory_bytes:
        raise MemoryError(
            f"Keeping the calibration features for MLP training needs {needed / 2**30:.2f} GiB ({positions} positions "
            f"x {per_position} bytes: float32 K/V of {len(source_layers)} source layers and all "
            f"{target_geometry.num_layers} target layers), over max_memory_bytes={max_memory_bytes / 2**30:.2f} GiB. "
            "Use a larger stride, fewer calibration sequences, a smaller top_k, or raise max_memory_bytes."
        )
    if positions == 0:
        raise ValueError("The calibration holds no positions to train on.")
    logger.info(
        f"Gathering {positions} positions x {per_position} bytes = {needed / 2**20:.1f} MiB of float32 features "
        f"({len(source_layers)} source layers, {target_geometry.num_layers} target layers, kinds {kinds})."
    )
    device = torch.device(device)
    src_width, tgt_width = source_geometry.layer_width, target_geometry.layer_width
    source_columns = (1 + context_window) * len(source_layers) * src_width
    source = {kind: torch.empty(positions, source_columns, device=device) for kind in kinds}
    target = {kind: torch.empty(positions, target_geometry.num_layers * tgt_width, device=device) for kind in kinds}
    groups = torch.empty(positions, dtype=torch.int64, device=device)
    source_codec, target_codec = RotaryCodec(source_model.config), RotaryCodec(target_model.config)

    def flatten(tensors, layers, width):
        # (B, n_kv, T, d) per layer -> (B * T, len(layers) * width), rows in (batch, seq) order
        return torch.cat([tensors[layer].transpose(1, 2).reshape(-1, width).float() for layer in layers], dim=1)

    row, sequence, tokens = 0, 0, 0
    for batch_index, batch in enumerate(tqdm(batches, desc="gathering features", unit="batch", disable=not progress)):
        input_ids, attention_mask = CalibrationStatistics.unpack_batch(batch)
        size, length = input_ids.shape
        position_ids = positions_from_attention_mask(attention_mask, size, length, input_ids.device)
        # a context window reaches the positions between the kept ones: take every position, stride afterwards
        source_kv = CalibrationStatistics.model_features(
            source_model, source_codec, input_ids, attention_mask, position_ids, 1 if context_window else stride, kinds
        )
        target_kv = CalibrationStatistics.model_features(
            target_model, target_codec, input_ids, attention_mask, position_ids, stride, kinds
        )
        kept = len(range(0, length, stride))
        if attention_mask is None:
            keep = torch.ones(size * kept, dtype=torch.bool)
        else:
            keep = attention_mask[:, ::stride].bool().reshape(-1).cpu()
        n = int(keep.sum())
        keep = keep.to(device)
        batch_groups = (sequence + torch.arange(size).repeat_interleave(kept)).to(device)
        groups[row : row + n] = batch_groups[keep]
        for index, kind in enumerate(("key", "value")):
            if kind not in kinds:
                continue
            if context_window:
                src = torch.cat([source_kv[index][layer].transpose(1, 2).float() for layer in source_layers], dim=2)
                src = window_features(src.reshape(size, length, -1), context_window, position_ids)
                src = src[:, ::stride].reshape(size * kept, -1).to(device)
            else:
                src = flatten(source_kv[index], source_layers, src_width).to(device)
            tgt = flatten(target_kv[index], range(target_geometry.num_layers), tgt_width).to(device)
            for side, values in (("source", src), ("target", tgt)):
                if not bool(torch.isfinite(values[keep]).all()):
                    raise ValueError(
                        f"The {side} {kind}s of calibration batch {batch_index} contain NaN or inf; "
                        "refusing to train on them. Check the model's dtype (fp16 overflow?) and the batch."
                    )
            source[kind][row : row + n] = src[keep]
            target[kind][row : row + n] = tgt[keep]
        row += n
        sequence += size
        tokens += int(input_ids.numel() if attention_mask is None else attention_mask.sum())
    provenance = {
        "tokens": tokens,
        "sequences": sequence,
        "positions": positions,
        "stride": stride,
        "feature_bytes": needed,
    }
    return CalibrationFeatures(
        source, target, source_layers, groups, src_width, tgt_width, provenance, context_window=context_window
    )


def split_rows(
    num_rows: int, val_fraction: float, seed: int = 0, groups: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(train_rows, val_rows)` index tensors: a seeded held-out split, by whole sequences when `groups` has at least
    two of them (so validation positions never share a sequence with training ones), else by positions."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1).")
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


@torch.no_grad()
def content_space_metrics(mapper, features: CalibrationFeatures, rows: torch.Tensor | None = None) -> dict[str, Any]:
    r"""
    Held-out content-space quality of any `MapperModel` (ridge or MLP) on gathered features.

    Returns `{"key": {"mse", "r2", "per_layer_mse", "per_layer_r2"}, "value": {...}, "mse", "r2"}`: raw MSE over
    positions and dims, and per-head R^2 averaged over heads, per target layer and averaged over layers (then kinds).
    """
    tgt = mapper.config.target_geometry
    out: dict[str, Any] = {}
    for kind in features.source:
        mses, r2s = [], []
        for layer_idx, layer in enumerate(mapper.layers):
            proj = layer.key_proj if kind == "key" else layer.value_proj
            param = next(proj.parameters())

            def predict(x, proj=proj, param=param):
                return proj(x.to(param.device, param.dtype)).float()

            x = features.inputs(kind, mapper.config.source_layers[layer_idx], rows)
            y = features.outputs(kind, layer_idx, rows)
            mse, r2 = regression_metrics(predict, x, y, tgt.num_kv_heads)
            mses.append(mse)
            r2s.append(r2)
        out[kind] = {
            "mse": sum(mses) / len(mses),
            "r2": sum(r2s) / len(r2s),
            "per_layer_mse": mses,
            "per_layer_r2": r2s,
        }
    kinds = list(features.source)
    out["mse"] = sum(out[k]["mse"] for k in kinds) / len(kinds)
    out["r2"] = sum(out[k]["r2"] for k in kinds) / len(kinds)
    return out


# ------------------------------------------------------------------------------------------------ mapper
def fit_mlp_mapper(source_model, target_model, calibration: Iterable, **kwargs):
    """Fit a `MapperModel` of kind `"mlp"`: [`fit_feature_mapper`] with `kind="mlp"` (see it for the arguments)."""
    return fit_feature_mapper(source_model, target_model, calibration, kind="mlp", **kwargs)


def fit_feature_mapper(
    source_model,
    target_model,
    calibration: Iterable,
    *,
    kind: str = "mlp",
    top_k: int | None = 8,
    source_layers: Sequence[Sequence[int]] | None = None,
    input_kinds: str = "same",
    context_window: int = 0,
    hidden_size: int = 1024,
    epochs: int = 20,
    batch_tokens: int = 4096,
    lr: float = 1e-3,
    val_fraction: float = 0.1,
    patience: int | None = 3,
    stride: int = 1,
    seed: int = 0,
    init: str = "ridge",
    ridge_lambda: float = 0.01,
    lambda_convention: str = "absolute",
    warmup_steps: int = 50,
    statistics=None,
    statistics_dtype: torch.dtype = torch.float64,
    features: CalibrationFeatures | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    max_memory_bytes: int | None = DEFAULT_MAX_MEMORY_BYTES,
    tokenizer=None,
    progress: bool = True,
):
    r"""
    Fit a `MapperModel` on calibration features kept in memory: layer selection as the ridge does, then per target
    layer and K/V a ridge solve (`kind="ridge"`) or MSE training of every head's MLP (`kind="mlp"`).

    This is the path of the MLP kind and of any mapper whose inputs the sufficient statistics do not cover
    (`input_kinds="both"`, `context_window > 0`); a plain ridge is fitted from statistics alone by
    `hf_kvmap.fitting.mapper_from_statistics`, which gives the same weights without keeping features.

    1. Statistics: `statistics` (a `CalibrationStatistics` covering every target layer), or collected now with
       `CalibrationStatistics.collect(..., stride=stride)` (one pass).
    2. Selection: `LayerSelection.from_statistics(statistics, top_k, source_layers=...)` (the single-source probe).
    3. Features: one more streaming pass ([`gather_features`]) keeps the content-space K/V of the selected source
       layers (their union, with `context_window` earlier positions) and of all target layers in memory as float32,
       i.e. `feature_bytes_per_position` x positions bytes (refused with `MemoryError` over `max_memory_bytes`);
       pass `features` to reuse a gathered set.
    4. Per target layer and K/V, on the inputs `hf_kvmap.modeling_mapper.mapper_inputs` defines: with
       `kind="ridge"`, the centered ridge on every position ([`ridge_solve`], float64); with `kind="mlp"`,
       [`train_headwise_mlp`] (all heads batched) on a held-out split by whole calibration sequences
       (`val_fraction`), early stopping on the validation MSE, best weights kept.

    Args:
        source_model, target_model (`PreTrainedModel`): causal LMs of one family.
        calibration (iterable): `(batch, seq)` LongTensors of token ids (or dicts with `input_ids`/`attention_mask`);
            it is iterated twice when `statistics` is `None`, so it is materialized into a list.
        kind (`str`, *optional*, defaults to `"mlp"`): `"mlp"` or `"ridge"`.
        top_k (`int`, *optional*, defaults to 8), source_layers (`list[list[int]]`, *optional*): as for the ridge.
        input_kinds (`str`, *optional*, defaults to `"same"`), context_window (`int`, *optional*, defaults to 0):
            what each map reads (`MapperConfig`).
        hidden_size (`int`, *optional*, defaults to 1024): `h` (`config.mlp_hidden_size`).
        epochs, batch_tokens, lr, patience, seed, init, ridge_lambda, lambda_convention, warmup_steps: see
            [`train_headwise_mlp`]; the seed of target layer `l` and kind `K/V` is derived from `seed`, so every MLP
            is reproducible alone. `ridge_lambda` and `lambda_convention` are the ridge's penalty with
            `kind="ridge"`.
        val_fraction (`float`, *optional*, defaults to 0.1): share of calibration sequences held out (MLP only).
        stride (`int`, *optional*, defaults to 1): keep every `stride`-th position (statistics and features).
        statistics (`CalibrationStatistics`, *optional*): precomputed statistics for the selection.
        statistics_dtype (`torch.dtype`, *optional*, defaults to `torch.float64`): accumulation dtype when the
            statistics are collected here.
        features (`CalibrationFeatures`, *optional*): precomputed features (must hold the selected source layers
            and at least `context_window` earlier positions).
        device (*optional*): where the statistics and features live and training runs; defaults to the source
            model's input device.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): dtype of the returned mapper.
        max_memory_bytes (`int`, *optional*, defaults to 16 GiB): bound on the gathered features.
        tokenizer (*optional*): the shared tokenizer, whose fingerprint the config records.
        progress (`bool`, *optional*, defaults to `True`): tqdm progress bars.

    Returns:
        [`MapperModel`] of `config.kind == kind`; `config.calibration` holds the calibration provenance, and for
        the MLP `config.calibration["mlp_training"]` the hyper-parameters and the final train/val MSE (and the
        ridge's, on the same split) of every target layer and kind. `model.selection` is the `LayerSelection`.
    """
    from tqdm.auto import tqdm

    from .configuration_mapper import INPUT_KINDS
    from .fitting import LayerSelection, selection_config
    from .fitting import tokenizer_fingerprint as _tokenizer_fingerprint
    from .modeling_mapper import MapperModel
    from .rope import KVGeometry
    from .statistics import CalibrationStatistics

    if kind not in ("ridge", "mlp"):
        raise ValueError(f"kind={kind!r}; expected 'ridge' or 'mlp'.")
    if init not in INITS:
        raise ValueError(f"init={init!r}; expected one of {INITS}.")
    if input_kinds not in INPUT_KINDS:
        raise ValueError(f"input_kinds={input_kinds!r}; expected one of {INPUT_KINDS}.")
    if lambda_convention not in ("absolute", "per_token"):
        raise ValueError(f"lambda_convention={lambda_convention!r} is not 'absolute' or 'per_token'.")
    target_geometry = KVGeometry.from_config(target_model.config)
    if kind == "mlp" and init == "ridge" and hidden_size < 2 * target_geometry.head_dim:
        raise ValueError(
            f"init='ridge' needs hidden_size >= 2 * head_dim = {2 * target_geometry.head_dim} (got {hidden_size}); "
            "pass init='random' or a larger hidden_size."
        )
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1).")
    calibration = list(calibration)
    if device is None:
        embeddings = source_model.get_input_embeddings()
        device = embeddings.weight.device if embeddings is not None else next(source_model.parameters()).device
    fingerprint = _tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    if statistics is None:
        collect_kwargs = {"tokenizer_fingerprint": fingerprint} if fingerprint is not None else {}
        statistics = CalibrationStatistics.collect(
            source_model,
            target_model,
            calibration,
            stride=stride,
            dtype=statistics_dtype,
            device=device,
            progress=progress,
            **collect_kwargs,
        )
    if statistics.target_layers is not None:
        raise ValueError(
            f"The statistics cover target layers {statistics.target_layers} only; fitting on features needs the "
            "selection of every target layer. Collect statistics with target_layers=None."
        )
    selection = LayerSelection.from_statistics(statistics, top_k, source_layers=source_layers)
    needed = sorted({layer for layers in selection.source_layers for layer in layers})
    if features is None:
        features = gather_features(
            source_model,
            target_model,
            calibration,
            source_layers=needed,
            stride=stride,
            context_window=context_window,
            device=device,
            max_memory_bytes=max_memory_bytes,
            progress=progress,
        )
    num_target = target_geometry.num_layers
    maps: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    extra: dict[str, Any] = {}
    if kind == "ridge":
        penalty = ridge_lambda * (features.num_positions if lambda_convention == "per_token" else 1.0)
        # Maps that read the same inputs (same selected layers; with input_kinds="both" keys and values alike) share
        # one Gram: solve them together, their targets side by side.
        groups: dict[tuple, list[tuple[int, str]]] = {}
        for layer_idx in range(num_target):
            for map_kind in ("key", "value"):
                reads = "both" if input_kinds == "both" else map_kind
                groups.setdefault((reads, tuple(selection.source_layers[layer_idx])), []).append((layer_idx, map_kind))
        width = target_geometry.layer_width
        for (_, chosen), members in tqdm(
            groups.items(), desc="solving ridge maps", unit="input set", disable=not progress
        ):
            x = features.inputs(members[0][1], list(chosen), None, input_kinds, context_window)
            y = torch.cat([features.outputs(map_kind, layer_idx) for layer_idx, map_kind in members], dim=1)
            weight, bias = ridge_solve(x, y, penalty)
            for slot, member in enumerate(members):
                columns = slice(slot * width, (slot + 1) * width)
                maps[member] = {"weight": weight[columns].contiguous(), "bias": bias[columns].contiguous()}
        extra["features"] = features.provenance
    else:
        train_rows, val_rows = split_rows(features.num_positions, val_fraction, seed, features.groups)
        train_rows, val_rows = train_rows.to(features.groups.device), val_rows.to(features.groups.device)
        bar = tqdm(total=2 * num_target * epochs, desc="training MLP mapper", unit="epoch", disable=not progress)
        report: list[dict[str, Any]] = []
        for layer_idx in range(num_target):
            chosen = selection.source_layers[layer_idx]
            entry: dict[str, Any] = {"layer": layer_idx}
            for kind_idx, map_kind in enumerate(("key", "value")):
                bar.set_description(f"training MLP mapper (layer {layer_idx} {map_kind})")
                x = features.inputs(map_kind, chosen, None, input_kinds, context_window)
                y = features.outputs(map_kind, layer_idx)
                mlp, result = train_headwise_mlp(
                    x[train_rows],
                    y[train_rows],
                    x[val_rows],
                    y[val_rows],
                    num_heads=target_geometry.num_kv_heads,
                    head_dim=target_geometry.head_dim,
                    hidden_size=hidden_size,
                    epochs=epochs,
                    batch_tokens=batch_tokens,
                    lr=lr,
                    patience=patience,
                    seed=seed * 1_000_003 + 2 * layer_idx + kind_idx,
                    init=init,
                    ridge_lambda=ridge_lambda,
                    lambda_convention=lambda_convention,
                    warmup_steps=warmup_steps,
                    bar=bar,
                )
                maps[layer_idx, map_kind] = mlp.state_dict()
                entry[map_kind] = result.to_dict()
            report.append(entry)
        bar.close()
        extra["mlp_training"] = {
            "hidden_size": hidden_size,
            "epochs": epochs,
            "batch_tokens": batch_tokens,
            "optimizer": "adam",
            "lr": lr,
            "loss": "mse (content space)",
            "val_fraction": val_fraction,
            "split": "sequences" if len(torch.unique(features.groups)) >= 2 else "positions",
            "patience": patience,
            "seed": seed,
            "init": init,
            "ridge_lambda": ridge_lambda,
            "lambda_convention": lambda_convention,
            "warmup_steps": warmup_steps,
            "positions_train": int(train_rows.numel()),
            "positions_val": int(val_rows.numel()),
            "features": features.provenance,
            "torch_version": torch.__version__,
            "layers": report,
        }
    config = selection_config(
        statistics,
        selection,
        tokenizer_fingerprint=fingerprint,
        calibration=extra,
        kind=kind,
        mlp_hidden_size=hidden_size,
        input_kinds=input_kinds,
        context_window=context_window,
        ridge_lambda=ridge_lambda,
        lambda_convention=lambda_convention,
    )
    with torch.device("meta"):  # the weights are all copied in below; skip the random init
        model = MapperModel(config)
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for layer_idx, layer in enumerate(model.layers):
            for map_kind, proj in (("key", layer.key_proj), ("value", layer.value_proj)):
                proj.load_state_dict({k: v.to("cpu", dtype) for k, v in maps[layer_idx, map_kind].items()})
    model.eval()
    model.selection = selection
    return model


def plot_training_curves(config, path) -> bool:
    """Learning curves of an MLP mapper: validation MSE per epoch relative to the ridge on the same split, one line
    per target layer, keys and values side by side (read from `config.calibration["mlp_training"]`).

    Epoch 0 is the ridge itself (1.0 with `init="ridge"`); a line below 1 is an MLP that beats the ridge, and the dot
    marks the epoch whose weights were kept. Returns `False` without writing anything when matplotlib is not installed
    (`pip install hf-kvmap[plot]`) or the config holds no MLP training record with a validation split.
    """
    training = (config.calibration or {}).get("mlp_training")
    if not training or not training.get("layers"):
        return False
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed; skipping the MLP training curves.")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    drawn = False
    for ax, kind in zip(axes, ("key", "value")):
        for entry in training["layers"]:
            row = entry[kind]
            ridge = row.get("ridge_val_mse")
            history = [v for v in row.get("val_mse_history", []) if v is not None]
            if not ridge or not history:
                continue
            curve = [1.0] + [value / ridge for value in history]
            (line,) = ax.plot(range(len(curve)), curve, label=f"layer {entry['layer']}", linewidth=1.2)
            best = row.get("best_epoch", 0)
            if best < len(curve):
                ax.plot([best], [curve[best]], "o", color=line.get_color(), markersize=4)
            drawn = True
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{kind}s")
        ax.set_xlabel("epoch (0 = ridge)")
    if not drawn:
        plt.close(fig)
        return False
    axes[0].set_ylabel("validation MSE / ridge's")
    axes[1].legend(fontsize="small", ncol=2)
    fig.suptitle(f"MLP mapper training (hidden {training.get('hidden_size')}, dot = weights kept)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


__all__ = [
    "CalibrationFeatures",
    "HeadwiseMLP",
    "MLPTrainingResult",
    "content_space_metrics",
    "feature_bytes_per_position",
    "fit_feature_mapper",
    "fit_mlp_mapper",
    "gather_features",
    "plot_training_curves",
    "regression_metrics",
    "ridge_solve",
    "split_rows",
    "train_headwise_mlp",
]
