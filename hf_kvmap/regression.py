"""The linear-regression arithmetic every fit shares: the one ridge solver and the one R^2.

The ridge is centered with a bias: `W = (Xc^T Xc + penalty I)^-1 Xc^T Yc`, `b = mean(y) - mean(x) W`, solved in
float64 by Cholesky (minimum-norm least squares when the system is singular, e.g. `lambda = 0` with fewer positions
than features). It is solved from centered moments, which come either from sufficient statistics
(`hf_kvmap.fitting.solve_layer`) or from feature tensors kept in memory ([`ridge_solve`]).

The solve runs on one CPU thread (on the CPU): LAPACK's Cholesky splits its blocks by the thread count, so two
threads round otherwise than one, and a refit from the same statistics on a machine with another thread count would
be another mapper (another content hash, refused by records measured with the first). Its cost is small beside the
pass through the models that gathers the statistics.

R^2 is `1 - SS_res / SS_tot` (1 for a target without variance, which the bias predicts exactly), summed over the
dims of a head and averaged over heads wherever a score is reported (selection probe, calibration R^2, held-out
metrics, diagnostics).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Torch's CPU work (and MKL's, which it sets with it) on one thread inside the block; the thread count as it was
    after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def spd_solve(matrix: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve `matrix @ x = rhs` for a (batch of) symmetric positive (semi)definite matrix in its dtype; on the CPU on
    one thread, so the bytes do not depend on the thread count."""
    with one_cpu_thread():
        factor, info = torch.linalg.cholesky_ex(matrix)
        if not bool((info == 0).all()):
            # singular: the minimum-norm solution (the `gelsd` driver runs on the CPU)
            return torch.linalg.lstsq(matrix.cpu(), rhs.cpu(), driver="gelsd").solution.to(matrix.device)
        return torch.cholesky_solve(rhs, factor)


def ridge_from_moments(
    sxx: torch.Tensor, sxy: torch.Tensor, mean_x: torch.Tensor, mean_y: torch.Tensor, penalty: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The centered ridge from centered moments `Xc^T Xc` `(F_x, F_x)` (its diagonal is modified in place) and
    `Xc^T Yc` `(F_x, F_y)` and the means; returns `(weight, bias)` in `nn.Linear` layout, `(F_y, F_x)` and `(F_y,)`."""
    with one_cpu_thread():  # the bias's product too: every byte of the mapper whatever the thread count
        sxx.diagonal().add_(penalty)
        weight = spd_solve(sxx, sxy)  # (in, out)
        bias = mean_y - mean_x @ weight
        return weight.T.contiguous(), bias


def ridge_solve(
    x: torch.Tensor, y: torch.Tensor, ridge_lambda: float, chunk: int = 65536
) -> tuple[torch.Tensor, torch.Tensor]:
    """The centered ridge on feature tensors `x` `(N, F_x)` and `y` `(N, F_y)`, accumulated in float64 on `x`'s
    device; returns float64 `(weight, bias)` in `nn.Linear` layout (see [`ridge_from_moments`])."""
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
    return ridge_from_moments(gram, cross, mean_x, mean_y, ridge_lambda)


def r2_score(ss_res: torch.Tensor, ss_tot: torch.Tensor) -> torch.Tensor:
    """`1 - SS_res / SS_tot` elementwise, at most 1; a target with no variance (`SS_tot = 0`) scores 1."""
    ss_tot = ss_tot.clamp_min(0)
    ratio = ss_res / ss_tot.clamp_min(torch.finfo(ss_tot.dtype).tiny)
    return torch.where(ss_tot > 0, 1 - ratio, torch.ones_like(ss_tot)).clamp(max=1.0)


def head_r2(ss_res: torch.Tensor, ss_tot: torch.Tensor, num_heads: int) -> torch.Tensor:
    """R^2 per head from per-column sums `(..., num_heads * head_dim)`: summed over each head's dims."""
    shape = (*ss_res.shape[:-1], num_heads, -1)
    return r2_score(ss_res.reshape(shape).sum(-1), ss_tot.reshape(shape).sum(-1))


@torch.no_grad()
def regression_metrics(predict, x: torch.Tensor, y: torch.Tensor, num_heads: int, chunk: int = 16384):
    """`(mse, r2)` of `predict(x)` against `y` `(N, heads * head_dim)`: raw MSE over positions and dims, and the
    per-head R^2 (`SS_tot` centered on `y`'s own mean) averaged over heads. Accumulated in float64; `(nan, nan)` for
    an empty `y`."""
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
    return mse, float(head_r2(ss_res, ss_tot, num_heads).mean())


__all__ = [
    "head_r2",
    "one_cpu_thread",
    "r2_score",
    "regression_metrics",
    "ridge_from_moments",
    "ridge_solve",
    "spd_solve",
]
