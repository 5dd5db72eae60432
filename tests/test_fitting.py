"""Fitting: calibration statistics, source-layer selection, closed-form ridge, and the `fit` command."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from hf_kvmap import MappedCache, MapperModel
from hf_kvmap.fitting import (
    LayerSelection,
    fit_mapper,
    mapper_from_statistics,
    mapper_r2,
    r2_matrix,
    select_top_k,
    tokenizer_fingerprint,
)
from hf_kvmap.rope import RotaryCodec
from hf_kvmap.statistics import CalibrationStatistics

VOCAB = 128


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """max |actual - expected| <= rel * max |expected|."""
    error = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert error <= rel * scale, f"max error {error:.3e} > {rel:g} * {scale:.3e}"


def tiny_config(layers=3, kv_heads=2, head_dim=16, heads=4, hidden=64, vocab=VOCAB) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
    )


def tiny_model(seed=0, **kwargs) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_config(**kwargs)).eval()


def batches(seed=1, count=4, size=4, length=48, vocab=VOCAB):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (size, length), generator=generator) for _ in range(count)]


@pytest.fixture(scope="module")
def self_model():
    model = tiny_model(seed=0)
    # Random init is near-uniform; sharpen the output so greedy decoding is not decided by rounding noise.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    return model


@pytest.fixture(scope="module")
def pair():
    """A source and a deeper target with the same KV geometry (independent random weights)."""
    return tiny_model(seed=0, layers=4), tiny_model(seed=1, layers=3)


@pytest.fixture(scope="module")
def pair_stats(pair):
    source, target = pair
    return CalibrationStatistics.collect(source, target, batches(seed=2), stride=2, progress=False)


# ------------------------------------------------------------------------------------------------ planted relation
def test_planted_relation_recovered_exactly():
    source_config = tiny_config(layers=4, kv_heads=2, head_dim=4, heads=2, hidden=8)
    target_config = tiny_config(layers=3, kv_heads=2, head_dim=4, heads=2, hidden=8)
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


def test_select_top_k_rules():
    scores = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.7, 0.2]])
    assert select_top_k(scores, 1) == [[1], [0]]  # ties go to the lower layer
    assert select_top_k(scores, 2) == [[1, 2], [0, 1]]  # ascending
    assert select_top_k(scores, None) == select_top_k(scores, 7) == [[0, 1, 2]] * 2
    with pytest.raises(ValueError, match="top_k"):
        select_top_k(scores, 0)


# ------------------------------------------------------------------------------------------------ self map
def test_self_map_selects_diagonal_and_generates_identically(self_model, tmp_path):
    model = self_model
    stats = CalibrationStatistics.collect(model, model, batches(seed=3, count=4, size=4, length=64), progress=False)
    mapper = MapperModel.from_statistics(stats, top_k=1, ridge_lambda=1e-8)
    assert mapper.config.source_layers == [[0], [1], [2]]
    for kind, r2 in mapper_r2(stats, mapper).items():
        assert torch.all(r2 > 0.999), (kind, r2)
    probe = r2_matrix(stats)
    for kind in probe:
        assert torch.all(probe[kind].diagonal() > 0.999)

    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(9))
    reference = model.generate(ids, max_new_tokens=8, do_sample=False)
    source_cache = model(ids, use_cache=True).past_key_values
    cache = MappedCache.from_source(source_cache, mapper)
    mapped = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert torch.equal(mapped, reference)

    # The fitted mapper round-trips through save_pretrained with its provenance.
    mapper.save_pretrained(tmp_path / "mapper")
    loaded = MapperModel.from_pretrained(tmp_path / "mapper")
    assert loaded.config.source_layers == [[0], [1], [2]]
    assert loaded.config.calibration["fingerprint"] == stats.fingerprint
    assert loaded.config.calibration["positions"] == stats.count() == 4 * 4 * 64
    assert torch.equal(loaded.layers[1].key_proj.weight, mapper.layers[1].key_proj.weight)


def test_self_fit_every_architecture(model_and_config):
    """Every supported rope type / architecture (conftest registry): collect, probe and a near-exact self-map."""
    model, config = model_and_config
    stats = CalibrationStatistics.collect(model, model, batches(seed=7, count=2, size=4, length=48), progress=False)
    mapper = mapper_from_statistics(stats, top_k=1, ridge_lambda=1e-8)
    assert mapper.config.source_layers == [[layer] for layer in range(config.num_hidden_layers)]
    for kind, r2 in mapper_r2(stats, mapper).items():
        assert torch.all(r2 > 0.999), (kind, r2)


# ------------------------------------------------------------------------------------------------ one object, any k
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


def test_one_statistics_object_serves_every_k(pair, pair_stats):
    source, target = pair
    data = batches(seed=2)
    src_k, src_v = _direct_features(source, data, stride=2)
    tgt_k, tgt_v = _direct_features(target, data, stride=2)
    selection = LayerSelection.from_statistics(pair_stats, None)
    for k in (1, 2, None):
        mapper = mapper_from_statistics(pair_stats, top_k=k, ridge_lambda=0.01, dtype=torch.float64)
        # the same k from a pre-computed selection (no re-probe) and from freshly collected statistics
        swept = mapper_from_statistics(
            pair_stats, selection=selection.with_top_k(k), ridge_lambda=0.01, dtype=torch.float64
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


def test_per_token_lambda_convention(pair_stats):
    n = pair_stats.count()
    absolute = mapper_from_statistics(pair_stats, top_k=2, ridge_lambda=0.5 * n, dtype=torch.float64)
    per_token = mapper_from_statistics(
        pair_stats, top_k=2, ridge_lambda=0.5, lambda_convention="per_token", dtype=torch.float64
    )
    assert per_token.config.lambda_convention == "per_token"
    assert torch.allclose(absolute.layers[0].key_proj.weight, per_token.layers[0].key_proj.weight, atol=1e-12)


# ------------------------------------------------------------------------------------------------ mismatched geometry
def test_mismatched_geometry_beats_mean_predictor():
    source = tiny_model(seed=0, layers=3, kv_heads=2, head_dim=16, heads=4)
    target = tiny_model(seed=5, layers=4, kv_heads=4, head_dim=8, heads=8)
    stats = CalibrationStatistics.collect(source, target, batches(seed=4, count=6, size=4, length=64), progress=False)
    mapper = mapper_from_statistics(stats, top_k=2, ridge_lambda=1.0)
    assert mapper.config.calibration["probe"] == "whole_layer"
    assert tuple(mapper.layers[0].key_proj.weight.shape) == (32, 64)

    held_out = batches(seed=99, count=1, size=2, length=40)[0]
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


# ------------------------------------------------------------------------------------------------ statistics object
def test_save_load_round_trip_exact(pair_stats, tmp_path):
    pair_stats.save(tmp_path / "stats")
    assert sorted(os.listdir(tmp_path / "stats")) == ["statistics.json", "statistics.safetensors"]
    meta = json.loads((tmp_path / "stats" / "statistics.json").read_text())
    assert meta["calibration"]["fingerprint"] == pair_stats.fingerprint and meta["stride"] == 2
    assert meta["source_config"]["num_hidden_layers"] == 4
    loaded = CalibrationStatistics.load(tmp_path / "stats")
    assert loaded.kinds == pair_stats.kinds and loaded.provenance() == pair_stats.provenance()
    for name, tensor in pair_stats.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name

    with open(tmp_path / "stats" / "statistics.safetensors", "r+b") as handle:  # tamper with one byte
        handle.seek(-3, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-3, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ValueError, match="sha256"):
        CalibrationStatistics.load(tmp_path / "stats")


def test_merge_halves_equals_whole_and_rejects_incompatible(pair):
    source, target = pair
    data = batches(seed=2)
    whole = CalibrationStatistics.collect(source, target, data, stride=2, progress=False)
    first = CalibrationStatistics.collect(source, target, data[2:], stride=2, progress=False)
    second = CalibrationStatistics.collect(source, target, data[:2], stride=2, progress=False)
    merged = first.merge(second)
    assert merged.fingerprint == whole.fingerprint  # order independent
    for name, tensor in whole.state_dict().items():
        assert torch.allclose(merged.state_dict()[name], tensor, rtol=1e-12, atol=1e-9), name

    other_stride = CalibrationStatistics.collect(source, target, data[:1], stride=3, progress=False)
    with pytest.raises(ValueError, match="stride differs"):
        whole.merge(other_stride)
    restricted = CalibrationStatistics(source.config, target.config, stride=2, target_layers=[1])
    with pytest.raises(ValueError, match="target_layers differs"):
        whole.merge(restricted)
    swapped = CalibrationStatistics(target.config, source.config, stride=2)
    with pytest.raises(ValueError, match="source_config differs"):
        whole.merge(swapped)


@pytest.mark.parametrize(
    "kinds,target_layers,dtype",
    [(("key", "value"), None, torch.float64), (("key",), [2], torch.float32), (("value",), [0, 2], torch.float64)],
)
def test_memory_estimate_matches_collected(pair, kinds, target_layers, dtype):
    source, target = pair
    stats = CalibrationStatistics.collect(
        source,
        target,
        batches(count=1, size=1, length=8),
        kinds=kinds,
        target_layers=target_layers,
        dtype=dtype,
        progress=False,
    )
    estimate = CalibrationStatistics.memory_estimate(
        source.config, target.config, kinds=kinds, target_layers=target_layers, dtype=dtype
    )
    assert estimate["total"] == stats.nbytes()
    assert set(kinds) <= set(estimate)
    assert all(stats[kind].gram.dtype == dtype for kind in kinds)


def test_padded_batches_match_unpadded(self_model):
    model = self_model
    data = batches(seed=6, count=1, size=2, length=20)[0]
    plain = CalibrationStatistics.collect(model, model, [data[0:1], data[1:2, 5:]], progress=False)
    ids = data.clone()
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # left padding of the second row
    padded = CalibrationStatistics.collect(model, model, [{"input_ids": ids, "attention_mask": mask}], progress=False)
    assert padded.count() == plain.count() == 35
    assert padded.fingerprint == plain.fingerprint and int(padded.tokens) == 35
    for name, tensor in plain.state_dict().items():
        assert torch.allclose(padded.state_dict()[name], tensor, rtol=1e-5, atol=1e-4), name


def test_restricted_target_layers(pair, pair_stats):
    source, target = pair
    data = batches(seed=2)
    low = CalibrationStatistics.collect(source, target, data, stride=2, target_layers=[0, 1], progress=False)
    high = CalibrationStatistics.collect(source, target, data, stride=2, target_layers=[2], progress=False)
    with pytest.raises(ValueError, match=r"target layers \[2\] are missing"):
        mapper_from_statistics(low, top_k=2)
    scores = r2_matrix(high)["key"]
    assert torch.isnan(scores[:2]).all() and not torch.isnan(scores[2]).any()
    assert torch.allclose(scores[2], r2_matrix(pair_stats)["key"][2], atol=1e-12)
    parts = mapper_from_statistics([low, high], top_k=2, dtype=torch.float64)
    whole = mapper_from_statistics(pair_stats, top_k=2, dtype=torch.float64)
    assert parts.config.source_layers == whole.config.source_layers
    for a, b in zip(parts.parameters(), whole.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)


def test_update_rejects_bad_shapes(pair):
    source, target = pair
    stats = CalibrationStatistics(source.config, target.config)
    with pytest.raises(ValueError, match="width"):
        stats.update(torch.zeros(3, 5), torch.zeros(3, 5), torch.zeros(3, 5), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="values"):
        stats.update(torch.zeros(3, stats.source_width), None, torch.zeros(3, stats.target_width), None)
    layer = torch.zeros(1, 2, 5, 16)
    with pytest.raises(ValueError, match="model has 4 layers"):
        stats.update([layer] * 3, [layer] * 3, [layer] * 3, [layer] * 3)
    with pytest.raises(ValueError, match="n_kv \\* head_dim = 32"):
        stats.update([layer] * 4, [layer] * 4, [torch.zeros(1, 2, 5, 8)] * 3, [layer] * 3)


def test_non_finite_features_are_refused(pair):
    source, target = pair
    stats = CalibrationStatistics(source.config, target.config, kinds=("key",))
    bad = torch.zeros(3, stats.target_width)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        stats.update(torch.zeros(3, stats.source_width), None, bad, None)
    assert stats.count() == 0 and not stats["key"].gram.any()


def test_selection_json_and_heatmap(pair_stats, tmp_path):
    selection = LayerSelection.from_statistics(pair_stats, 2)
    selection.save_selection_json(tmp_path / "selection.json")
    data = json.loads((tmp_path / "selection.json").read_text())
    assert data["source_layers"] == selection.source_layers and data["probe"] == "per_head"
    assert len(data["scores"]) == 3 and len(data["scores"][0]) == 4 and set(data["r2"]) == {"key", "value"}
    pytest.importorskip("matplotlib")
    assert selection.save_heatmap(tmp_path / "selection.png")
    assert (tmp_path / "selection.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------------ command line
def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(30)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def _cli_pair(tmp_path):
    """A 2-layer source and a 3-layer target saved with one tokenizer, and 20 lines of calibration text
    (`data.txt`); returns `(tokenizer, lines)`."""
    tokenizer = _tiny_tokenizer()
    for name, seed, layers in (("src", 0, 2), ("tgt", 1, 3)):
        tiny_model(seed=seed, layers=layers, vocab=32).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    generator = torch.Generator().manual_seed(0)
    lines = [" ".join(f"w{i}" for i in torch.randint(0, 30, (40,), generator=generator).tolist()) for _ in range(20)]
    (tmp_path / "data.txt").write_text("\n".join(lines))
    return tokenizer, lines


def test_cli_fit_writes_loadable_mapper(tmp_path):
    from hf_kvmap.cli import main

    tokenizer, lines = _cli_pair(tmp_path)
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps({"text": line}) for line in lines))
    for data in ("data.txt", "data.jsonl"):
        out = tmp_path / f"mapper-{data}"
        code = main(
            [
                "fit",
                "--source",
                str(tmp_path / "src"),
                "--target",
                str(tmp_path / "tgt"),
                "--data",
                str(tmp_path / data),
                "--top-k",
                "1",
                "--ridge-lambda",
                "0.1",
                "--seq-len",
                "32",
                "--stride",
                "2",
                "--max-sequences",
                "12",
                "--batch-size",
                "4",
                "--out",
                str(out),
                "--stats",
                str(tmp_path / f"stats-{data}"),
                "--no-progress",
            ]
        )
        assert code == 0
        mapper = MapperModel.from_pretrained(out)
        assert len(mapper.config.source_layers) == 3 and all(len(s) == 1 for s in mapper.config.source_layers)
        assert mapper.config.source_model_id == str(tmp_path / "src")
        assert mapper.config.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)
        assert mapper.config.calibration["sequences"] == 12 and mapper.config.calibration["stride"] == 2
        assert (out / "selection.json").exists()
        stats = CalibrationStatistics.load(tmp_path / f"stats-{data}")
        assert stats.count() == 12 * 16
        assert stats.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)

    # Re-solve from the saved statistics with another k, without the models.
    out = tmp_path / "mapper-k2"
    assert main(["fit", "--from-stats", str(tmp_path / "stats-data.txt"), "--top-k", "all", "--out", str(out)]) == 0
    mapper = MapperModel.from_pretrained(out)
    assert all(layers == [0, 1] for layers in mapper.config.source_layers)
    assert mapper.config.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)
    assert (
        mapper.config.calibration["fingerprint"] == CalibrationStatistics.load(tmp_path / "stats-data.txt").fingerprint
    )
    with pytest.raises(SystemExit, match="--data"):
        main(["fit", "--source", str(tmp_path / "src"), "--target", str(tmp_path / "tgt"), "--out", str(out)])


def test_cli_fit_kind_mlp(tmp_path):
    from hf_kvmap.cli import main
    from hf_kvmap.mlp import HeadwiseMLP

    tokenizer, _ = _cli_pair(tmp_path)
    models = [
        "--source",
        str(tmp_path / "src"),
        "--target",
        str(tmp_path / "tgt"),
        "--data",
        str(tmp_path / "data.txt"),
    ]
    options = ["--kind", "mlp", "--top-k", "2", "--hidden-size", "48", "--epochs", "2", "--batch-tokens", "32"]
    options += ["--seq-len", "16", "--max-sequences", "8", "--batch-size", "4", "--stride", "1", "--seed", "5"]
    out = tmp_path / "mlp"
    assert main(["fit", *models, *options, "--out", str(out), "--no-progress"]) == 0
    mapper = MapperModel.from_pretrained(out)
    assert mapper.config.kind == "mlp" and mapper.config.mlp_hidden_size == 48
    assert isinstance(mapper.layers[0].key_proj, HeadwiseMLP)
    assert mapper.config.source_layers == [[0, 1]] * 3
    assert mapper.config.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)
    training = mapper.config.calibration["mlp_training"]
    assert (training["epochs"], training["batch_tokens"], training["seed"]) == (2, 32, 5)
    assert training["positions_train"] + training["positions_val"] == 8 * 16
    assert (out / "selection.json").exists() and "## MLP training" in (out / "README.md").read_text()
    pytest.importorskip("matplotlib")
    assert (out / "training_curves.png").exists()

    with pytest.raises(SystemExit, match="drop --from-stats"):
        main(["fit", "--kind", "mlp", "--from-stats", str(tmp_path), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="drop --from-stats"):
        main(["fit", "--context-window", "2", "--from-stats", str(tmp_path), "--out", str(tmp_path / "x")])

    # a windowed ridge reading keys and values
    out = tmp_path / "windowed"
    window = ["--top-k", "1", "--context-window", "2", "--input-kinds", "both", "--seq-len", "16"]
    window += ["--max-sequences", "8", "--batch-size", "4", "--stride", "2"]
    assert main(["fit", *models, *window, "--out", str(out), "--no-progress"]) == 0
    mapper = MapperModel.from_pretrained(out)
    assert (mapper.config.kind, mapper.config.context_window, mapper.config.input_kinds) == ("ridge", 2, "both")
    assert mapper.layers[0].key_proj.weight.shape[1] == 3 * 2 * mapper.config.source_geometry.layer_width
    assert "| context window (earlier positions read) | 2 |" in (out / "README.md").read_text()


def test_cli_refuses_different_tokenizers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_kvmap.cli import main

    other = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "a": 1}, unk_token="<unk>"))
    other.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    for name, tokenizer in (("src", _tiny_tokenizer()), ("tgt", PreTrainedTokenizerFast(tokenizer_object=other))):
        tiny_model(layers=1, vocab=32).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    (tmp_path / "data.txt").write_text("w1 w2 w3 " * 50)
    with pytest.raises(SystemExit, match="tokenizer"):
        main(
            [
                "fit",
                "--source",
                str(tmp_path / "src"),
                "--target",
                str(tmp_path / "tgt"),
                "--data",
                str(tmp_path / "data.txt"),
                "--out",
                str(tmp_path / "out"),
                "--no-progress",
            ]
        )
