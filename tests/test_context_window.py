"""Mappers that read earlier positions (`context_window`) and both kinds (`input_kinds="both"`)."""

from __future__ import annotations

import pytest
import torch
from conftest import SUPPORTED, build_model, left_padded_batch
from test_core import greedy, prefill
from test_fitting import VOCAB, batches, tiny_model

from hf_kvmap import MappedCache, MapperConfig, MapperModel
from hf_kvmap.configuration_mapper import summarize_model_config
from hf_kvmap.fitting import fit_mapper, mapper_from_statistics
from hf_kvmap.mlp import fit_feature_mapper, gather_features
from hf_kvmap.modeling_mapper import mapper_inputs, window_features
from hf_kvmap.rope import RotaryCodec
from hf_kvmap.statistics import CalibrationStatistics

pytestmark = pytest.mark.usefixtures("one_thread")


def test_window_features_shift_and_stop_at_the_first_token():
    x = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3) + 1
    out = window_features(x, 2).view(2, 5, 3, 3)
    for t in range(5):
        for shift in range(3):
            expected = x[:, t - shift] if t >= shift else torch.zeros(2, 3)
            assert torch.equal(out[:, t, shift], expected), (t, shift)
    assert window_features(x, 0) is x
    # left padding: row 1 starts at index 2 (positions as generate derives them, pads at 1)
    positions = torch.tensor([[0, 1, 2, 3, 4], [1, 1, 0, 1, 2]])
    padded = window_features(x, 2, positions).view(2, 5, 3, 3)
    assert torch.equal(padded[0], out[0])
    assert torch.equal(padded[1, 2, 1], torch.zeros(3)) and torch.equal(padded[1, 2, 2], torch.zeros(3))
    assert torch.equal(padded[1, 3, 1], x[1, 2]) and torch.equal(padded[1, 3, 2], torch.zeros(3))
    assert torch.equal(padded[1, 4, 1], x[1, 3]) and torch.equal(padded[1, 4, 2], x[1, 2])
    # a window longer than the sequence
    assert torch.equal(window_features(x[:, :1], 3).view(2, 1, 4, 3)[:, 0, 1:], torch.zeros(2, 3, 3))


def _config(model_config, **kwargs) -> MapperConfig:
    side = summarize_model_config(model_config)
    return MapperConfig(source_config=side, target_config=side, **kwargs)


def test_config_validates_and_sizes_the_inputs(tmp_path):
    config = SUPPORTED["qwen3"]()
    width = config.num_key_value_heads * config.head_dim
    assert _config(config).input_width(0) == width
    assert _config(config, context_window=3).input_width(0) == 4 * width
    assert _config(config, input_kinds="both", context_window=2).input_width(0) == 6 * width
    for kwargs, fragment in (
        ({"context_window": -1}, "context_window=-1"),
        ({"context_window": True}, "context_window=True"),
        ({"context_window": 1.5}, "context_window=1.5"),
        ({"input_kinds": "keys"}, "input_kinds='keys'"),
    ):
        with pytest.raises(ValueError, match=fragment):
            _config(config, **kwargs)
    mapper = MapperModel(_config(config, input_kinds="both", context_window=2))
    mapper.save_pretrained(tmp_path)
    loaded = MapperModel.from_pretrained(tmp_path)
    assert (loaded.config.input_kinds, loaded.config.context_window) == ("both", 2)
    assert loaded.layers[0].key_proj.weight.shape == (width, 6 * width)
    assert "| context window (earlier positions read) | 2 |" in (tmp_path / "README.md").read_text()


def test_mapper_inputs_layout():
    config = _config(SUPPORTED["qwen3"](), input_kinds="both", context_window=1)
    keys, values = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    key_inputs, value_inputs = mapper_inputs(config, keys, values)
    assert key_inputs is value_inputs and key_inputs.shape == (1, 4, 32)
    assert torch.equal(key_inputs[0, 2], torch.cat([keys[0, 2], values[0, 2], keys[0, 1], values[0, 1]]))
    same = _config(SUPPORTED["qwen3"](), context_window=1)
    key_inputs, value_inputs = mapper_inputs(same, keys, values)
    assert torch.equal(value_inputs[0, 3], torch.cat([values[0, 3], values[0, 2]]))


@pytest.mark.parametrize("input_kinds", ["same", "both"])
def test_windowed_identity_generates_identical_tokens(input_kinds):
    config = SUPPORTED["qwen3"]()
    model = build_model(config)
    ids = torch.randint(3, 128, (1, 17), generator=torch.Generator().manual_seed(3))
    mapper = MapperModel.identity(config, context_window=3, input_kinds=input_kinds)
    cache = MappedCache.from_source(prefill(model, ids), mapper)
    for mapped, original in zip(cache.layers, prefill(model, ids).layers):
        torch.testing.assert_close(mapped.keys, original.keys[:, :, :16], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mapped.values, original.values[:, :, :16], rtol=0, atol=0)
    assert torch.equal(greedy(model, ids, cache=cache), greedy(model, ids))


def test_planted_shift_is_applied_exactly_and_left_padding_changes_nothing():
    """A map that copies the previous position's content: the mapped cache at t is the source's at t - 1 (zeros at
    each sequence's first token), and a left-padded batch maps each row exactly as that row alone."""
    config = SUPPORTED["qwen3"]()
    model = build_model(config)
    mapper = MapperModel(_config(config, context_window=1))
    width = config.num_key_value_heads * config.head_dim
    with torch.no_grad():
        for layer in mapper.layers:
            for proj in (layer.key_proj, layer.value_proj):
                proj.weight.zero_()
                proj.weight[:, width:] = torch.eye(width)
                proj.bias.zero_()
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    source = prefill(model, ids)
    cache = MappedCache.from_source(source, mapper)
    codec = RotaryCodec(config)
    table = codec.table(torch.arange(11)[None])
    for mapped, original in zip(cache.layers, source.layers):
        assert torch.equal(mapped.values[:, :, 0], torch.zeros_like(mapped.values[:, :, 0]))
        torch.testing.assert_close(mapped.values[:, :, 1:], original.values[:, :, :10], rtol=0, atol=0)
        content = table.strip(original.keys[:, :, :11])
        torch.testing.assert_close(table.strip(mapped.keys)[:, :, 1:], content[:, :, :10], rtol=1e-5, atol=1e-5)

    # random weights over a 3-position window: padded batch rows == the rows alone
    torch.manual_seed(0)
    mapper = MapperModel(_config(config, context_window=3, input_kinds="both"))
    ids, mask = left_padded_batch()
    batched = MappedCache.from_source(prefill(model, ids, mask), mapper, attention_mask=mask)
    for row in range(ids.shape[0]):
        start = int((mask[row] == 0).sum())
        alone = MappedCache.from_source(prefill(model, ids[row : row + 1, start:]), mapper)
        for mapped, single in zip(batched.layers, alone.layers):
            torch.testing.assert_close(mapped.keys[row : row + 1, :, start:], single.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(mapped.values[row : row + 1, :, start:], single.values, rtol=1e-4, atol=1e-5)


def test_gathered_window_reaches_between_strided_positions():
    source, target = tiny_model(seed=0, layers=2), tiny_model(seed=1, layers=2)
    calibration = batches(seed=4, count=1, size=2, length=10)
    full = gather_features(source, target, calibration, progress=False)
    strided = gather_features(source, target, calibration, stride=3, context_window=2, progress=False)
    assert strided.num_positions == 2 * 4 and strided.context_window == 2
    width = full.source["key"].shape[1]
    for kind in ("key", "value"):
        rows = full.source[kind].view(2, 10, width)
        held = strided.source[kind].view(2, 4, 3, width)
        for slot, t in enumerate(range(0, 10, 3)):
            for shift in range(3):
                expected = rows[:, t - shift] if t >= shift else torch.zeros(2, width)
                torch.testing.assert_close(held[:, slot, shift], expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="context_window=3, but the features hold 2"):
        strided.inputs("key", [0], context_window=3)


def test_feature_ridge_equals_statistics_ridge_without_a_window():
    source, target = tiny_model(seed=0, layers=3), tiny_model(seed=1, layers=2)
    calibration = batches(seed=5, count=3, size=4, length=32)
    stats = CalibrationStatistics.collect(source, target, calibration, progress=False)
    closed = mapper_from_statistics(stats, top_k=2, ridge_lambda=0.01, dtype=torch.float64)
    streamed = fit_feature_mapper(
        source, target, calibration, kind="ridge", statistics=stats, top_k=2, dtype=torch.float64, progress=False
    )
    assert streamed.config.kind == "ridge" and streamed.config.source_layers == closed.config.source_layers
    for name, tensor in closed.state_dict().items():
        torch.testing.assert_close(streamed.state_dict()[name], tensor, rtol=1e-7, atol=1e-8)


def test_windowed_self_fit_recovers_the_identity(tmp_path):
    """Fitting reads inputs in the layout the cache builds them: a self-map with a window and both kinds puts the
    identity on position t's own kind and generates the model's own tokens."""
    model = tiny_model(seed=0)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    mapper = fit_mapper(
        model,
        model,
        batches(seed=3, count=4, size=4, length=64),
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
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(9))
    cache = MappedCache.from_source(model(ids, use_cache=True).past_key_values, mapper)
    assert torch.equal(
        model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False),
        model.generate(ids, max_new_tokens=8, do_sample=False),
    )
    mapper.save_pretrained(tmp_path)
    assert MapperModel.from_pretrained(tmp_path).config.context_window == 2


def test_windowed_mlp_mapper_trains_and_maps():
    from hf_kvmap.mlp import HeadwiseMLP, fit_mlp_mapper

    source, target = tiny_model(seed=0, layers=2), tiny_model(seed=1, layers=3)
    calibration = batches(seed=6, count=2, size=4, length=32)
    kwargs = dict(top_k=2, hidden_size=32, epochs=2, batch_tokens=64, val_fraction=0.25, progress=False)
    mapper = fit_mlp_mapper(source, target, calibration, context_window=2, input_kinds="both", **kwargs)
    width = source.config.num_key_value_heads * source.config.head_dim
    assert (mapper.config.kind, mapper.config.context_window, mapper.config.input_kinds) == ("mlp", 2, "both")
    assert isinstance(mapper.layers[0].key_proj, HeadwiseMLP)
    assert mapper.layers[0].key_proj.in_features == mapper.config.input_width(0) == 3 * 2 * 2 * width
    for entry in mapper.config.calibration["mlp_training"]["layers"]:
        for kind in ("key", "value"):  # starts at the (windowed) ridge and keeps the best
            assert entry[kind]["val_mse"] <= entry[kind]["ridge_val_mse"] * (1 + 1e-4)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    cache = MappedCache.from_source(source(ids, use_cache=True).past_key_values, mapper)
    assert all(torch.isfinite(layer.keys).all() and layer.keys.shape[2] == 19 for layer in cache.layers)
    assert torch.isfinite(target(ids[:, -1:], past_key_values=cache).logits).all()
