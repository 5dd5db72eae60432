"""Input features: the window layout a map reads, and the features gathered from calibration."""

from __future__ import annotations

import pytest
import torch

from hf_kvmap import (
    MapperConfig,
)
from hf_kvmap.configuration_mapper import summarize_model_config
from hf_kvmap.features import feature_bytes_per_position, gather_features
from hf_kvmap.layout import mapper_inputs, window_features

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
    return MapperConfig(source_summary=side, target_summary=side, **kwargs)


def test_mapper_inputs_layout(tiny):
    config = _config(tiny.SUPPORTED["qwen3"](), input_kinds="both", context_window=1)
    keys, values = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    key_inputs, value_inputs = mapper_inputs(config, keys, values)
    assert key_inputs is value_inputs and key_inputs.shape == (1, 4, 32)
    assert torch.equal(key_inputs[0, 2], torch.cat([keys[0, 2], values[0, 2], keys[0, 1], values[0, 1]]))
    same = _config(tiny.SUPPORTED["qwen3"](), context_window=1)
    key_inputs, value_inputs = mapper_inputs(same, keys, values)
    assert torch.equal(value_inputs[0, 3], torch.cat([values[0, 3], values[0, 2]]))


def test_gathered_window_reaches_between_strided_positions(tiny):
    source, target = tiny.model(sharpen=False, seed=0, layers=2), tiny.model(sharpen=False, seed=1, layers=2)
    calibration = tiny.batches(seed=4, count=1, size=2, length=10)
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


def test_feature_memory_bound_is_enforced(mlp_pair, calibration):
    source, target = mlp_pair
    per_position = feature_bytes_per_position(source.config, target.config, 2)
    assert per_position == 4 * 2 * (2 * 32 + 3 * 32)
    with pytest.raises(MemoryError, match="needs .* GiB .*384 positions"):
        gather_features(source, target, calibration, max_memory_bytes=per_position * 383, progress=False)
    features = gather_features(source, target, calibration, max_memory_bytes=per_position * 384, progress=False)
    assert features.source["key"].shape == (384, 64) and features.target["value"].shape == (384, 96)
    assert features.groups.unique().tolist() == list(range(8))


def test_gather_features_drops_padding(mlp_pair):
    source, target = mlp_pair
    ids = torch.randint(3, 64, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    features = gather_features(source, target, [{"input_ids": ids, "attention_mask": mask}], progress=False)
    assert features.num_positions == 16
    assert features.groups.tolist() == [0] * 6 + [1] * 10
