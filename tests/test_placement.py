"""Device placement: every mapped layer lands on the device of the target layer that reads it (meta = 2nd device)."""

from __future__ import annotations

import torch
from conftest import SUPPORTED, build_model

from hf_kvmap import MappedCache, MapperModel, mapper_device_map, target_layer_devices


def _source_cache(config, tokens=10):
    model = build_model(config)
    with torch.no_grad():
        return model(torch.randint(3, 128, (1, tokens)), use_cache=True).past_key_values


def _target_on_two_devices(config):
    target = build_model(config)
    target.hf_device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "meta",
        "model.norm": "meta",
        "lm_head": "meta",
    }
    return target


def test_device_map_derived_from_target():
    config = SUPPORTED["qwen3"]()
    target = _target_on_two_devices(config)
    assert target_layer_devices(target) == [torch.device("cpu"), torch.device("meta")]
    assert mapper_device_map(target) == {"layers.0": "cpu", "layers.1": "meta"}
    cuda_target = build_model(config)
    cuda_target.hf_device_map = {"model": 0, "model.layers.1": 3, "lm_head": 3}
    assert mapper_device_map(cuda_target) == {"layers.0": 0, "layers.1": 3}
    plain = build_model(config)  # no hf_device_map: parameter devices
    assert mapper_device_map(plain) == {"layers.0": "cpu", "layers.1": "cpu"}


def test_mapped_layers_land_where_the_mapper_layers_run():
    config = SUPPORTED["llama"]()
    mapper = MapperModel.identity(config)
    mapper.layers[1].to("meta")
    cache = MappedCache.from_source(_source_cache(config), mapper)
    assert [layer.keys.device.type for layer in cache.layers] == ["cpu", "meta"]
    assert [layer.values.device.type for layer in cache.layers] == ["cpu", "meta"]
    assert cache.layers[1].keys.shape == cache.layers[0].keys.shape == (1, 2, 9, 16)


def test_devices_argument_follows_target_layers():
    config = SUPPORTED["qwen3"]()
    target = _target_on_two_devices(config)
    cache = MappedCache.from_source(
        _source_cache(config), MapperModel.identity(config), devices=target_layer_devices(target)
    )
    assert [layer.keys.device.type for layer in cache.layers] == ["cpu", "meta"]
    assert torch.isfinite(cache.layers[0].keys).all()


def test_mapper_loaded_with_target_device_map(tmp_path):
    config = SUPPORTED["qwen3"]()
    MapperModel.identity(config).save_pretrained(tmp_path)
    target = _target_on_two_devices(config)
    mapper = MapperModel.from_pretrained(tmp_path, device_map=mapper_device_map(target))
    assert mapper.hf_device_map == {"layers.0": "cpu", "layers.1": "meta"}
