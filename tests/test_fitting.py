"""Fitting: planted maps recovered, self-maps exact, one statistics object for every k, features vs statistics."""

from __future__ import annotations

import json

import pytest
import torch

from hf_kvmap import (
    CalibrationStatistics,
    LayerSelection,
    MappedCache,
    MapperModel,
    fit_mapper,
    mapper_from_statistics,
)
from hf_kvmap._compat import cache_kwargs
from hf_kvmap.features import gather_features
from hf_kvmap.fitting import mapper_r2
from hf_kvmap.modeling_mlp import HeadwiseMLP
from hf_kvmap.rope import RotaryCodec
from hf_kvmap.selection import r2_matrix

pytestmark = pytest.mark.usefixtures("one_thread")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """max |actual - expected| <= rel * max |expected|."""
    error = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert error <= rel * scale, f"max error {error:.3e} > {rel:g} * {scale:.3e}"


def test_planted_relation_recovered_exactly(tiny):
    source_config = tiny.config(layers=4, kv_heads=2, head_dim=4, heads=2, hidden=8)
    target_config = tiny.config(layers=3, kv_heads=2, head_dim=4, heads=2, hidden=8)
    stats = CalibrationStatistics(source_config, target_config)
    width = 8  # n_kv * head_dim on both sides
    planted = [[0, 2], [1, 3], [2, 3]]
    generator = torch.Generator().manual_seed(0)
    maps = {}
    for kind in ("key", "value"):
        maps[kind] = [
            (
                torch.randn(2 * width, width, generator=generator, dtype=torch.float64),
                torch.randn(width, generator=generator, dtype=torch.float64),
            )
            for _ in planted
        ]
    for _ in range(6):  # several updates: accumulation must equal one big batch
        feats = {}
        for kind in ("key", "value"):
            x = torch.randn(500, 4 * width, generator=generator, dtype=torch.float64) * 2 + 0.5
            ys = [
                torch.cat([x[:, s * width : (s + 1) * width] for s in layers], 1) @ a + b
                for layers, (a, b) in zip(planted, maps[kind])
            ]
            feats[kind] = (x, torch.cat(ys, 1))
        stats.update(feats["key"][0], feats["value"][0], feats["key"][1], feats["value"][1])
    assert stats.count() == 3000

    scores = r2_matrix(stats)
    assert set(scores) == {"key", "value"} and scores["key"].shape == (3, 4)
    mapper = mapper_from_statistics(stats, top_k=2, ridge_lambda=0.0, dtype=torch.float64)
    assert mapper.config.source_layers == planted
    assert mapper.config.calibration["probe"] == "per_head"
    for layer in range(len(planted)):
        for kind, proj in (("key", mapper.layers[layer].key_proj), ("value", mapper.layers[layer].value_proj)):
            a, b = maps[kind][layer]
            assert_close(proj.weight.T, a, 1e-6)
            assert_close(proj.bias, b, 1e-6)
    for kind, r2 in mapper_r2(stats, mapper).items():
        assert torch.all(r2 > 1 - 1e-9), (kind, r2)


def test_self_map_selects_diagonal_and_generates_identically(tiny, self_model, tmp_path):
    model = self_model
    stats = CalibrationStatistics.collect(
        model, model, tiny.batches(seed=3, count=4, size=4, length=64), progress=False
    )
    mapper = mapper_from_statistics(stats, top_k=1, ridge_lambda=1e-8)
    assert mapper.config.source_layers == [[0], [1], [2]]
    for kind, r2 in mapper_r2(stats, mapper).items():
        assert torch.all(r2 > 0.999), (kind, r2)
    probe = r2_matrix(stats)
    for kind in probe:
        assert torch.all(probe[kind].diagonal() > 0.999)

    ids = torch.randint(0, tiny.VOCAB, (2, 24), generator=torch.Generator().manual_seed(9))
    reference = model.generate(ids, max_new_tokens=8, do_sample=False)
    source_cache = model(ids, use_cache=True).past_key_values
    cache = MappedCache.from_source(source_cache, mapper)
    mapped = model.generate(ids, **cache_kwargs(cache), max_new_tokens=8, do_sample=False)
    assert torch.equal(mapped, reference)

    # The fitted mapper round-trips through save_pretrained with its provenance.
    mapper.save_pretrained(tmp_path / "mapper")
    loaded = MapperModel.from_pretrained(tmp_path / "mapper")
    assert loaded.config.source_layers == [[0], [1], [2]]
    assert loaded.config.calibration["fingerprint"] == stats.fingerprint
    assert loaded.config.calibration["positions"] == stats.count() == 4 * 4 * 64
    assert torch.equal(loaded.layers[1].key_proj.weight, mapper.layers[1].key_proj.weight)


def test_self_fit_every_architecture(tiny, model_and_config):
    """Every supported rope type / architecture (conftest registry): collect, probe and a near-exact self-map."""
    model, config = model_and_config
    stats = CalibrationStatistics.collect(
        model, model, tiny.batches(seed=7, count=2, size=4, length=48), progress=False
    )
    mapper = mapper_from_statistics(stats, top_k=1, ridge_lambda=1e-8)
    assert mapper.config.source_layers == [[layer] for layer in range(config.num_hidden_layers)]
    for kind, r2 in mapper_r2(stats, mapper).items():
        assert torch.all(r2 > 0.999), (kind, r2)


def _direct_features(model, data, stride):
    """Per-layer content-space key and value features `(N, n_kv * d)` computed without CalibrationStatistics."""
    codec = RotaryCodec(model.config)
    keys, values = [], []
    with torch.no_grad():
        for ids in data:
            cache = model(ids, use_cache=True).past_key_values
            positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)[:, ::stride]
            table = codec.table(positions)
            keys.append(
                [
                    table.strip(layer.keys[:, :, ::stride]).transpose(1, 2).flatten(0, 1).flatten(1)
                    for layer in cache.layers
                ]
            )
            values.append(
                [layer.values[:, :, ::stride].transpose(1, 2).flatten(0, 1).flatten(1) for layer in cache.layers]
            )
    keys = [torch.cat([batch[i] for batch in keys]).double() for i in range(len(keys[0]))]
    values = [torch.cat([batch[i] for batch in values]).double() for i in range(len(values[0]))]
    return keys, values


def _direct_ridge(x, y, lam):
    mx, my = x.mean(0), y.mean(0)
    xc, yc = x - mx, y - my
    w = torch.linalg.solve(xc.T @ xc + lam * torch.eye(x.shape[1], dtype=x.dtype), xc.T @ yc)
    return w.T, my - mx @ w


def test_one_statistics_object_serves_every_k(tiny, random_pair, random_pair_stats):
    source, target = random_pair
    data = tiny.batches(seed=2)
    src_k, src_v = _direct_features(source, data, stride=2)
    tgt_k, tgt_v = _direct_features(target, data, stride=2)
    selection = LayerSelection.from_statistics(random_pair_stats, None)
    for k in (1, 2, None):
        mapper = mapper_from_statistics(random_pair_stats, top_k=k, ridge_lambda=0.01, dtype=torch.float64)
        # the same k from a pre-computed selection (no re-probe) and from freshly collected statistics
        swept = mapper_from_statistics(
            random_pair_stats, selection=selection.with_top_k(k), ridge_lambda=0.01, dtype=torch.float64
        )
        fresh = fit_mapper(
            source, target, data, top_k=k, ridge_lambda=0.01, dtype=torch.float64, stride=2, progress=False
        )
        assert mapper.config.source_layers == fresh.config.source_layers == swept.config.source_layers
        expected_k = 4 if k is None else k
        assert all(len(layers) == expected_k for layers in mapper.config.source_layers)
        for layer_idx, layer in enumerate(mapper.layers):
            chosen = mapper.config.source_layers[layer_idx]
            for proj, other, swept_proj, src, tgt in (
                (layer.key_proj, fresh.layers[layer_idx].key_proj, swept.layers[layer_idx].key_proj, src_k, tgt_k),
                (
                    layer.value_proj,
                    fresh.layers[layer_idx].value_proj,
                    swept.layers[layer_idx].value_proj,
                    src_v,
                    tgt_v,
                ),
            ):
                assert torch.equal(proj.weight, swept_proj.weight)
                assert_close(other.weight, proj.weight, 1e-8)
                weight, bias = _direct_ridge(torch.cat([src[s] for s in chosen], 1), tgt[layer_idx], 0.01)
                assert_close(proj.weight, weight, 1e-8)
                assert_close(proj.bias, bias, 1e-8)


def test_per_token_lambda_convention(random_pair_stats):
    n = random_pair_stats.count()
    absolute = mapper_from_statistics(random_pair_stats, top_k=2, ridge_lambda=0.5 * n, dtype=torch.float64)
    per_token = mapper_from_statistics(
        random_pair_stats, top_k=2, ridge_lambda=0.5, lambda_convention="per_token", dtype=torch.float64
    )
    assert per_token.config.lambda_convention == "per_token"
    assert torch.allclose(absolute.layers[0].key_proj.weight, per_token.layers[0].key_proj.weight, atol=1e-12)


def test_mismatched_geometry_beats_mean_predictor(tiny):
    source = tiny.model(sharpen=False, seed=0, layers=3, kv_heads=2, head_dim=16, heads=4)
    target = tiny.model(sharpen=False, seed=5, layers=4, kv_heads=4, head_dim=8, heads=8)
    stats = CalibrationStatistics.collect(
        source, target, tiny.batches(seed=4, count=6, size=4, length=64), progress=False
    )
    mapper = mapper_from_statistics(stats, top_k=2, ridge_lambda=1.0)
    assert mapper.config.calibration["probe"] == "whole_layer"
    assert tuple(mapper.layers[0].key_proj.weight.shape) == (32, 64)

    held_out = tiny.batches(seed=99, count=1, size=2, length=40)[0]
    with torch.no_grad():
        source_cache = source(held_out, use_cache=True).past_key_values
        target_cache = target(held_out, use_cache=True).past_key_values
    cache = MappedCache.from_source(source_cache, mapper)
    codec = RotaryCodec(target.config)
    table = codec.table(torch.arange(39).expand(2, -1))
    mapped_err = mean_err = 0.0
    for idx, layer in enumerate(cache.layers):
        assert layer.keys.shape == layer.values.shape == (2, 4, 39, 8)
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
        cols = stats.target_columns(idx)
        for kind, mapped, true in (
            ("key", table.strip(layer.keys), table.strip(target_cache.layers[idx].keys[:, :, :39])),
            ("value", layer.values, target_cache.layers[idx].values[:, :, :39]),
        ):
            mean = (stats[kind].target_sum[cols] / stats.count(kind)).float().view(4, 1, 8)
            mapped_err += (mapped - true).square().mean().item()
            mean_err += (mean - true).square().mean().item()
    assert mapped_err < mean_err


def test_restricted_target_layers(tiny, random_pair, random_pair_stats):
    source, target = random_pair
    data = tiny.batches(seed=2)
    low = CalibrationStatistics.collect(source, target, data, stride=2, target_layers=[0, 1], progress=False)
    high = CalibrationStatistics.collect(source, target, data, stride=2, target_layers=[2], progress=False)
    with pytest.raises(ValueError, match=r"target layers \[2\] are missing"):
        mapper_from_statistics(low, top_k=2)
    scores = r2_matrix(high)["key"]
    assert torch.isnan(scores[:2]).all() and not torch.isnan(scores[2]).any()
    assert torch.allclose(scores[2], r2_matrix(random_pair_stats)["key"][2], atol=1e-12)
    parts = mapper_from_statistics([low, high], top_k=2, dtype=torch.float64)
    whole = mapper_from_statistics(random_pair_stats, top_k=2, dtype=torch.float64)
    assert parts.config.source_layers == whole.config.source_layers
    for a, b in zip(parts.parameters(), whole.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)


def test_feature_ridge_equals_statistics_ridge_without_a_window(tiny):
    source, target = tiny.model(sharpen=False, seed=0, layers=3), tiny.model(sharpen=False, seed=1, layers=2)
    calibration = tiny.batches(seed=5, count=3, size=4, length=32)
    stats = CalibrationStatistics.collect(source, target, calibration, progress=False)
    closed = mapper_from_statistics(stats, top_k=2, ridge_lambda=0.01, dtype=torch.float64)
    streamed = fit_mapper(
        source, target, calibration, kind="ridge", statistics=stats, top_k=2, dtype=torch.float64, progress=False
    )
    assert streamed.config.kind == "ridge" and streamed.config.source_layers == closed.config.source_layers
    for name, tensor in closed.state_dict().items():
        torch.testing.assert_close(streamed.state_dict()[name], tensor, rtol=1e-7, atol=1e-8)


def test_windowed_self_fit_recovers_the_identity(tiny, tmp_path):
    """Fitting reads inputs in the layout the cache builds them: a self-map with a window and both kinds puts the
    identity on position t's own kind and generates the model's own tokens."""
    model = tiny.model(sharpen=False, layers=3, seed=0)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    mapper = fit_mapper(
        model,
        model,
        tiny.batches(seed=3, count=4, size=4, length=64),
        top_k=1,
        ridge_lambda=1e-8,
        context_window=2,
        input_kinds="both",
        progress=False,
    )
    assert (mapper.config.context_window, mapper.config.input_kinds) == (2, "both")
    width = model.config.num_key_value_heads * model.config.head_dim
    for layer in mapper.layers:
        for proj, offset in ((layer.key_proj, 0), (layer.value_proj, width)):
            expected = torch.zeros_like(proj.weight)
            expected[:, offset : offset + width] = torch.eye(width)
            torch.testing.assert_close(proj.weight, expected, rtol=0, atol=2e-3)
    ids = torch.randint(0, tiny.VOCAB, (2, 24), generator=torch.Generator().manual_seed(9))
    cache = MappedCache.from_source(model(ids, use_cache=True).past_key_values, mapper)
    assert torch.equal(
        model.generate(ids, **cache_kwargs(cache), max_new_tokens=8, do_sample=False),
        model.generate(ids, max_new_tokens=8, do_sample=False),
    )
    mapper.save_pretrained(tmp_path)
    assert MapperModel.from_pretrained(tmp_path).config.context_window == 2


def fit_mlp(source, target, calibration, **kwargs):
    return fit_mapper(source, target, calibration, kind="mlp", **kwargs)


def test_windowed_mlp_mapper_trains_and_maps(tiny):
    source, target = tiny.model(sharpen=False, seed=0, layers=2), tiny.model(sharpen=False, seed=1, layers=3)
    calibration = tiny.batches(seed=6, count=2, size=4, length=32)
    kwargs = dict(top_k=2, hidden_size=32, epochs=2, batch_tokens=64, val_fraction=0.25, progress=False)
    mapper = fit_mlp(source, target, calibration, context_window=2, input_kinds="both", **kwargs)
    width = source.config.num_key_value_heads * source.config.head_dim
    assert (mapper.config.kind, mapper.config.context_window, mapper.config.input_kinds) == ("mlp", 2, "both")
    assert isinstance(mapper.layers[0].key_proj, HeadwiseMLP)
    assert mapper.layers[0].key_proj.in_features == mapper.config.input_width(0) == 3 * 2 * 2 * width
    for entry in mapper.config.calibration["mlp_training"]["layers"]:
        for kind in ("key", "value"):  # starts at the (windowed) ridge and keeps the best
            assert entry[kind]["val_mse"] <= entry[kind]["ridge_val_mse"] * (1 + 1e-4)
    ids = torch.randint(0, tiny.VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    cache = MappedCache.from_source(source(ids, use_cache=True).past_key_values, mapper)
    assert all(torch.isfinite(layer.keys).all() and layer.keys.shape[2] == 19 for layer in cache.layers)
    assert torch.isfinite(target(ids[:, -1:], **cache_kwargs(cache)).logits).all()


def test_mlp_fit_records_training_and_is_reproducible(mlp_pair, calibration, fitted):
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

    again = fit_mlp(*mlp_pair, calibration, **kwargs)
    for name, tensor in mapper.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name


def test_random_init_and_bad_arguments_are_refused(mlp_pair, calibration):
    source, target = mlp_pair
    with pytest.raises(ValueError, match="init='ridge' needs hidden_size >= 2 \\* head_dim = 16"):
        fit_mlp(source, target, calibration, hidden_size=8, progress=False)
    with pytest.raises(ValueError, match="init="):
        fit_mlp(source, target, calibration, init="zeros", progress=False)


def test_fit_with_given_statistics_and_features_without_validation(mlp_pair, calibration):
    from hf_kvmap.statistics import CalibrationStatistics

    source, target = mlp_pair
    stats = CalibrationStatistics.collect(source, target, calibration, progress=False)
    features = gather_features(source, target, calibration, source_layers=[1], progress=False)
    mapper = fit_mlp(
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
        fit_mlp(
            source,
            target,
            calibration,
            source_layers=[[0]] * 3,
            statistics=stats,
            features=features,
            epochs=1,
            progress=False,
        )


def test_given_features_are_fitted_on_for_a_per_position_ridge_too(mlp_pair, calibration):
    """A plain ridge with `features` given is solved on them (not silently from the statistics): on the same
    calibration at stride 1 both solves see the same positions, so they agree; on other features they do not."""
    from hf_kvmap.fitting import fit

    source, target = mlp_pair
    stats = CalibrationStatistics.collect(source, target, calibration, progress=False)
    selection = LayerSelection.from_statistics(stats).with_top_k(1)
    plain = fit(statistics=stats, selection=selection, progress=False)
    features = gather_features(source, target, calibration, progress=False)
    same = fit(statistics=stats, selection=selection, features=features, progress=False)
    assert "features" in same.config.calibration and "features" not in plain.config.calibration
    for name, tensor in plain.state_dict.items():
        assert_close(same.state_dict[name], tensor, 1e-4)
    half = gather_features(source, target, calibration[:1], progress=False)
    other = fit(statistics=stats, selection=selection, features=half, progress=False)
    assert not torch.allclose(
        other.state_dict["layers.0.key_proj.weight"], plain.state_dict["layers.0.key_proj.weight"]
    )


def test_the_ridge_solve_gives_the_same_bytes_at_any_thread_count():
    # LAPACK's Cholesky splits its blocks by the thread count (two threads round otherwise than one): the solve runs
    # on one thread, so a refit from the same statistics is the same mapper on a machine with other threads
    from hf_kvmap.regression import ridge_from_moments, spd_solve

    g = torch.Generator().manual_seed(0)
    a = torch.randn(1024, 256, generator=g, dtype=torch.float64)
    gram, cross = a.T @ a, torch.randn(256, 32, generator=g, dtype=torch.float64)
    mean_x, mean_y = (
        torch.randn(256, generator=g, dtype=torch.float64),
        torch.randn(32, generator=g, dtype=torch.float64),
    )
    before = torch.get_num_threads()
    solved = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            solved[threads] = (spd_solve(gram, cross), *ridge_from_moments(gram.clone(), cross, mean_x, mean_y, 0.1))
            assert torch.get_num_threads() == threads  # the caller's count, as it was
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(x, y) for x, y in zip(solved[1], solved[2]))
