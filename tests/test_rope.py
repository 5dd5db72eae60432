"""Content space: each model's own rotary embedding stripped and re-applied exactly."""

from __future__ import annotations

import torch

from hf_kvmap.rope import RotaryCodec


def test_rotary_codec_round_trip_and_scaling(tiny):
    config = tiny.SUPPORTED["qwen3-yarn"]()
    table = RotaryCodec(config).table(torch.arange(50)[None])
    keys = torch.randn(1, 2, 50, 16)
    torch.testing.assert_close(table.strip(table.apply(keys)), keys, rtol=1e-5, atol=1e-5)
    cos, sin, scale2 = table.on("cpu")
    assert scale2.min().item() > 1.01  # YaRN's attention factor is in cos/sin and is undone by the strip
