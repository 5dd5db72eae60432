"""Layouts hf-kvmap maps exactly, and the ones it refuses with a clear error."""

from __future__ import annotations

import pytest

from hf_kvmap import (
    MapperModel,
    UnsupportedArchitectureError,
)
from hf_kvmap.configuration_mapper import summarize_model_config


def test_unsupported_layouts_are_refused(refused):
    config, fragment = refused
    with pytest.raises(UnsupportedArchitectureError, match=fragment):
        MapperModel.identity(config)


def test_supported_layouts_are_accepted(model_and_config):
    from hf_kvmap.geometry import KVGeometry, check_supported_layout

    _, config = model_and_config
    assert check_supported_layout(config).model_type == config.model_type
    geometry = KVGeometry.from_config(config)
    assert geometry == KVGeometry.from_config(summarize_model_config(config))
    assert geometry.layer_width == geometry.num_kv_heads * geometry.head_dim
