"""`HeadwiseMLP`: the batched forward, the seeded init, the exact ridge start and affine fold."""

from __future__ import annotations

import pytest
import torch

from hf_kvmap import (
    MapperConfig,
    MapperModel,
)
from hf_kvmap.configuration_mapper import summarize_model_config
from hf_kvmap.modeling_mlp import HeadwiseMLP

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference(mlp: HeadwiseMLP, x: torch.Tensor) -> torch.Tensor:
    """One head at a time, with plain matmuls: the definition the batched forward must reproduce."""
    outs = []
    for h in range(mlp.num_heads):
        a = torch.relu(x @ mlp.weight_in[h] + mlp.bias_in[h])
        a = torch.relu(a @ mlp.weight_hidden[h] + mlp.bias_hidden[h])
        outs.append(a @ mlp.weight_out[h] + mlp.bias_out[h])
    return torch.cat(outs, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batched_forward_equals_per_head_loop(dtype):
    torch.manual_seed(0)
    mlp = HeadwiseMLP(24, 16, 3, 8, dtype=dtype)
    with torch.no_grad():
        for bias in (mlp.bias_in, mlp.bias_hidden, mlp.bias_out):  # non-zero biases so they are exercised
            bias.normal_()
    x = torch.randn(2, 5, 24, dtype=dtype)
    out = mlp(x)
    assert out.shape == (2, 5, 3 * 8)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, _reference(mlp, x), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="expects 24 input features"):
        mlp(torch.randn(3, 23, dtype=dtype))


def test_parameters_are_headwise_and_init_is_seeded():
    mlp = HeadwiseMLP(12, 10, 3, 4)
    shapes = {name: tuple(p.shape) for name, p in mlp.named_parameters()}
    assert shapes == {
        "weight_in": (3, 12, 10),
        "bias_in": (3, 10),
        "weight_hidden": (3, 10, 10),
        "bias_hidden": (3, 10),
        "weight_out": (3, 10, 4),
        "bias_out": (3, 4),
    }
    torch.manual_seed(7)
    first = HeadwiseMLP(12, 10, 3, 4).state_dict()
    torch.manual_seed(7)
    second = HeadwiseMLP(12, 10, 3, 4).state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)


def _mlp_mapper(source_config, target_config, hidden: int = 32, top_k: int = 2, seed: int = 0) -> MapperModel:
    source, target = summarize_model_config(source_config), summarize_model_config(target_config)
    layers = [list(range(min(top_k, source_config.num_hidden_layers)))] * target_config.num_hidden_layers
    config = MapperConfig(
        source_summary=source, target_summary=target, source_layers=layers, kind="mlp", mlp_hidden_size=hidden
    )
    torch.manual_seed(seed)
    return MapperModel(config)


def test_mapper_model_init_survives_post_init_and_is_seeded(tiny):
    source, target = tiny.config(vocab=64, layers=2), tiny.config(vocab=64, layers=3)
    first, second = _mlp_mapper(source, target, hidden=64), _mlp_mapper(source, target, hidden=64)
    for a, b in zip(first.state_dict().values(), second.state_dict().values()):
        assert torch.equal(a, b)
    proj = first.layers[0].key_proj
    assert isinstance(proj, HeadwiseMLP)
    # post_init would have drawn normal(0, 0.02) for an nn.Linear; the He-uniform init of the MLP must survive it
    fan_in = proj.in_features
    assert proj.weight_in.std().item() == pytest.approx((2.0 / fan_in) ** 0.5, rel=0.1)
    assert not proj.bias_in.any()


def test_init_from_ridge_is_the_exact_affine_map_and_fold_is_exact():
    torch.manual_seed(0)
    mlp = HeadwiseMLP(10, 20, 2, 6, dtype=torch.float64)
    weight, bias = torch.randn(12, 10, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
    mlp.init_from_ridge(weight, bias)
    x = torch.randn(50, 10, dtype=torch.float64)
    torch.testing.assert_close(mlp(x), x @ weight.T + bias, rtol=1e-12, atol=1e-12)

    in_mean, in_scale = torch.randn(10, dtype=torch.float64), torch.rand(10, dtype=torch.float64) + 0.5
    out_mean, out_scale = torch.randn(12, dtype=torch.float64), 3.0
    with torch.no_grad():
        mlp.weight_out.normal_()  # a genuinely nonlinear map to fold
        expected = mlp((x - in_mean) / in_scale) * out_scale + out_mean
        mlp.fold_affine(in_mean, in_scale, out_mean, out_scale)
        torch.testing.assert_close(mlp(x), expected, rtol=1e-10, atol=1e-10)

    with pytest.raises(ValueError, match="hidden_size >= 2 \\* head_dim = 12"):
        HeadwiseMLP(10, 11, 2, 6).init_from_ridge(weight.float(), bias.float())
