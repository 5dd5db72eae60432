"""MLP training: a planted nonlinear relation recovered, reproducibility, the held-out split."""

from __future__ import annotations

import pytest
import torch

from hf_kvmap.kinds.mlp import split_rows, train_headwise_mlp
from hf_kvmap.regression import regression_metrics, ridge_solve

pytestmark = pytest.mark.usefixtures("one_thread")


def _planted(n: int, seed: int):
    """Targets that are an even (|.|) plus a ReLU function of the inputs: no linear map explains the even part."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=generator)
    mix = torch.randn(8, 8, generator=torch.Generator().manual_seed(100))
    z = x @ mix
    y = torch.cat([z[:, :4].abs(), torch.relu(z[:, 4:]) - 0.5 * z[:, 4:]], dim=1)  # 2 heads x 4 dims
    return x, y + 0.01 * torch.randn(y.shape, generator=generator)


def test_mlp_recovers_a_nonlinear_relation_that_ridge_cannot():
    x, y = _planted(3000, seed=1)
    x_val, y_val = _planted(600, seed=2)
    mlp, result = train_headwise_mlp(
        x,
        y,
        x_val,
        y_val,
        num_heads=2,
        head_dim=4,
        hidden_size=64,
        epochs=40,
        batch_tokens=128,
        lr=3e-3,
        patience=5,
        seed=0,
        init="ridge",
    )
    weight, bias = ridge_solve(x, y, 0.01)
    ridge_mse, ridge_r2 = regression_metrics(lambda v: v.double() @ weight.T + bias, x_val, y_val, 2)
    mlp_mse, mlp_r2 = regression_metrics(mlp, x_val, y_val, 2)
    assert result.ridge_val_mse == pytest.approx(ridge_mse, rel=1e-6)
    assert result.val_mse == pytest.approx(mlp_mse, rel=1e-4)
    assert mlp_mse < 0.15 * ridge_mse, (mlp_mse, ridge_mse)
    assert mlp_r2 > 0.9 > ridge_r2 + 0.3
    assert result.best_epoch > 0 and result.history[0]["val_mse"] > result.val_mse


def test_training_is_reproducible_and_keeps_best_weights():
    x, y = _planted(800, seed=3)
    x_val, y_val = _planted(200, seed=4)
    kwargs = dict(num_heads=2, head_dim=4, hidden_size=16, epochs=4, batch_tokens=64, seed=5, init="random")
    first, r1 = train_headwise_mlp(x, y, x_val, y_val, **kwargs)
    second, r2 = train_headwise_mlp(x, y, x_val, y_val, **kwargs)
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name
    assert r1.history == r2.history
    best = min(r1.history, key=lambda row: row["val_mse"])
    assert r1.val_mse == pytest.approx(best["val_mse"], rel=1e-4)
    third, _ = train_headwise_mlp(x, y, x_val, y_val, **{**kwargs, "seed": 6})
    assert not torch.equal(first.weight_hidden, third.weight_hidden)


def test_split_rows_holds_out_whole_sequences():
    groups = torch.arange(10).repeat_interleave(7)
    train, val = split_rows(70, 0.2, seed=0, groups=groups)
    assert len(train) + len(val) == 70 and len(val) == 14
    assert not set(groups[train].tolist()) & set(groups[val].tolist())
    assert torch.equal(split_rows(70, 0.2, seed=0, groups=groups)[1], val)
    assert len(split_rows(70, 0.0)[1]) == 0
