"""The `"mlp"` mapper kind: HeadwiseMLP exactness, training (nonlinear recovery, reproducibility), packaging."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import build_model
from transformers import AutoModel, Qwen3Config

from hf_kvmap import MappedCache, MapperConfig, MapperModel
from hf_kvmap.configuration_mapper import summarize_model_config
from hf_kvmap.mlp import (
    HeadwiseMLP,
    feature_bytes_per_position,
    fit_mlp_mapper,
    gather_features,
    plot_training_curves,
    regression_metrics,
    ridge_solve,
    split_rows,
    train_headwise_mlp,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(layers: int, kv_heads: int = 2, head_dim: int = 16, hidden: int = 64) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _reference(mlp: HeadwiseMLP, x: torch.Tensor) -> torch.Tensor:
    """One head at a time, with plain matmuls: the definition the batched forward must reproduce."""
    outs = []
    for h in range(mlp.num_heads):
        a = torch.relu(x @ mlp.weight_in[h] + mlp.bias_in[h])
        a = torch.relu(a @ mlp.weight_hidden[h] + mlp.bias_hidden[h])
        outs.append(a @ mlp.weight_out[h] + mlp.bias_out[h])
    return torch.cat(outs, dim=-1)


def _mlp_mapper(source_config, target_config, hidden: int = 32, top_k: int = 2, seed: int = 0) -> MapperModel:
    source, target = summarize_model_config(source_config), summarize_model_config(target_config)
    layers = [list(range(min(top_k, source_config.num_hidden_layers)))] * target_config.num_hidden_layers
    config = MapperConfig(
        source_config=source, target_config=target, source_layers=layers, kind="mlp", mlp_hidden_size=hidden
    )
    torch.manual_seed(seed)
    return MapperModel(config)


@pytest.fixture(scope="module")
def pair():
    """A 2-layer source and a 3-layer target with mismatched KV geometry (4 heads x 8 vs 2 heads x 16)."""
    return build_model(_config(2)), build_model(_config(3, kv_heads=4, head_dim=8), seed=1)


@pytest.fixture(scope="module")
def calibration():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 64, (4, 48), generator=generator) for _ in range(2)]


# ------------------------------------------------------------------------------------------------ module
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


def test_mapper_model_init_survives_post_init_and_is_seeded():
    source, target = _config(2), _config(3)
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


# ------------------------------------------------------------------------------------------------ training
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
    weight, bias = ridge_solve(x, y)
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


# ------------------------------------------------------------------------------------------------ fitting
@pytest.fixture(scope="module")
def fitted(pair, calibration):
    source, target = pair
    kwargs = dict(top_k=2, hidden_size=32, epochs=2, batch_tokens=64, val_fraction=0.25, seed=3, progress=False)
    return fit_mlp_mapper(source, target, calibration, **kwargs), kwargs


def test_fit_mlp_mapper_records_training_and_is_reproducible(pair, calibration, fitted):
    mapper, kwargs = fitted
    config = mapper.config
    assert config.kind == "mlp" and config.mlp_hidden_size == 32
    assert config.source_layers == [[0, 1]] * 3 and len(config.selection_scores) == 3
    assert isinstance(mapper.layers[0].key_proj, HeadwiseMLP)
    training = config.calibration["mlp_training"]
    assert training["epochs"] == 2 and training["lr"] == 1e-3 and training["init"] == "ridge"
    assert training["split"] == "sequences" and training["positions_val"] == 2 * 48
    assert config.calibration["positions"] == 8 * 48 and config.calibration["fingerprint"]
    assert [entry["layer"] for entry in training["layers"]] == [0, 1, 2]
    for entry in training["layers"]:
        for kind in ("key", "value"):
            row = entry[kind]
            assert row["train_mse"] > 0 and row["val_mse"] > 0
            assert row["val_mse"] <= row["ridge_val_mse"] * (1 + 1e-4)  # starts at the ridge, keeps the best
    json.dumps(config.to_dict())  # the config stays JSON-serializable

    again = fit_mlp_mapper(*pair, calibration, **kwargs)
    for name, tensor in mapper.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name


def test_feature_memory_bound_is_enforced(pair, calibration):
    source, target = pair
    per_position = feature_bytes_per_position(source.config, target.config, 2)
    assert per_position == 4 * 2 * (2 * 32 + 3 * 32)
    with pytest.raises(MemoryError, match="needs .* GiB .*384 positions"):
        gather_features(source, target, calibration, max_memory_bytes=per_position * 383, progress=False)
    features = gather_features(source, target, calibration, max_memory_bytes=per_position * 384, progress=False)
    assert features.source["key"].shape == (384, 64) and features.target["value"].shape == (384, 96)
    assert features.groups.unique().tolist() == list(range(8))


def test_gather_features_drops_padding(pair):
    source, target = pair
    ids = torch.randint(3, 64, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    features = gather_features(source, target, [{"input_ids": ids, "attention_mask": mask}], progress=False)
    assert features.num_positions == 16
    assert features.groups.tolist() == [0] * 6 + [1] * 10


def test_save_and_load_round_trip_is_exact(tmp_path, fitted):
    mapper, _ = fitted
    mapper.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, MapperModel) and loaded.config.kind == "mlp"
    assert loaded.config.calibration["mlp_training"] == json.loads(
        json.dumps(mapper.config.calibration["mlp_training"])
    )
    assert loaded.state_dict().keys() == mapper.state_dict().keys()
    for name, tensor in mapper.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    half = MapperModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert half.layers[0].value_proj.weight_hidden.dtype == torch.bfloat16


def test_mapped_cache_from_mlp_mapper_shapes_and_devices(pair, fitted):
    source, target = pair
    mapper, _ = fitted
    ids = torch.randint(3, 64, (2, 12))
    source_cache = source(ids, use_cache=True).past_key_values
    cache = MappedCache.from_source(source_cache, mapper)
    assert cache.mapping_info["kind"] == "mlp"
    assert len(cache.layers) == 3
    for layer in cache.layers:
        assert layer.keys.shape == layer.values.shape == (2, 4, 11, 8)
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
    # the target reads it (a forward with the held-back token)
    out = target(ids[:, -1:], past_key_values=cache)
    assert torch.isfinite(out.logits).all()

    placed = copy.deepcopy(mapper)  # the module-scoped fitted mapper stays on the CPU
    placed.layers[1].to("meta")
    cache = MappedCache.from_source(source_cache, placed)
    assert [layer.keys.device.type for layer in cache.layers] == ["cpu", "meta", "cpu"]
    assert [layer.values.device.type for layer in cache.layers] == ["cpu", "meta", "cpu"]
    assert cache.layers[1].keys.shape == (2, 4, 11, 8)


def test_random_init_and_bad_arguments_are_refused(pair, calibration):
    source, target = pair
    with pytest.raises(ValueError, match="init='ridge' needs hidden_size >= 2 \\* head_dim = 16"):
        fit_mlp_mapper(source, target, calibration, hidden_size=8, progress=False)
    with pytest.raises(ValueError, match="init="):
        fit_mlp_mapper(source, target, calibration, init="zeros", progress=False)


def test_fit_with_given_statistics_and_features_without_validation(pair, calibration):
    from hf_kvmap.statistics import CalibrationStatistics

    source, target = pair
    stats = CalibrationStatistics.collect(source, target, calibration, progress=False)
    features = gather_features(source, target, calibration, source_layers=[1], progress=False)
    mapper = fit_mlp_mapper(
        source,
        target,
        calibration,
        source_layers=[[1]] * 3,
        statistics=stats,
        features=features,
        hidden_size=8,
        epochs=1,
        batch_tokens=128,
        val_fraction=0.0,
        init="random",
        progress=False,
    )
    training = mapper.config.calibration["mlp_training"]
    assert mapper.config.source_layers == [[1]] * 3 and training["positions_val"] == 0
    row = training["layers"][0]["key"]
    assert row["val_mse"] is None and row["best_epoch"] == 1 and row["ridge_val_mse"] is None
    assert row["train_mse"] > 0 and len(row["train_mse_history"]) == 1
    with pytest.raises(ValueError, match="Source layers \\[0\\] were not gathered"):
        fit_mlp_mapper(
            source,
            target,
            calibration,
            source_layers=[[0]] * 3,
            statistics=stats,
            features=features,
            epochs=1,
            progress=False,
        )


def test_card_reports_mlp_training_and_curves_are_plotted(tmp_path, fitted):
    mapper, _ = fitted
    mapper.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "tags:\n- hf-kvmap\n- kv-cache\n- mapper-mlp" in card
    assert "| kind | `mlp` (hidden size 32) |" in card
    assert "| ridge lambda (of the ridge the MLP starts from) | 0.01 (absolute) |" in card
    section = card.split("## MLP training", 1)[1].split("\n## ", 1)[0]
    assert "| epochs | 2 |" in section and "| init | ridge |" in section and "| batch_tokens | 64 |" in section
    rows = [line for line in section.splitlines() if line.startswith(("| 0 |", "| 1 |", "| 2 |"))]
    training = mapper.config.calibration["mlp_training"]
    assert len(rows) == 6  # 3 target layers x (key, value)
    for line, (entry, kind) in zip(rows, [(e, k) for e in training["layers"] for k in ("key", "value")]):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        record = entry[kind]
        assert cells[:2] == [str(entry["layer"]), kind]
        assert cells[2] == f"{record['ridge_val_mse']:.3g}" and cells[3] == f"{record['val_mse']:.3g}"
        assert cells[6] == f"{record['best_epoch']} / {record['epochs_run']}"

    pytest.importorskip("matplotlib")
    assert plot_training_curves(mapper.config, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ridge_config = copy.deepcopy(mapper.config)
    ridge_config.calibration = {k: v for k, v in ridge_config.calibration.items() if k != "mlp_training"}
    assert not plot_training_curves(ridge_config, tmp_path / "none.png") and not (tmp_path / "none.png").exists()
