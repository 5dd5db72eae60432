"""Device placement: every mapped layer lands on the device of the target layer that reads it (meta = 2nd device)."""

from __future__ import annotations

import torch

from hf_kvmap import (
    MappedCache,
    MapperModel,
    mapper_device_map,
    target_layer_devices,
)


def _source_cache(tiny, config, tokens=10):
    model = tiny.model(config)
    with torch.no_grad():
        return model(torch.randint(3, 128, (1, tokens)), use_cache=True).past_key_values


def _target_on_two_devices(tiny, config):
    target = tiny.model(config)
    target.hf_device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "meta",
        "model.norm": "meta",
        "lm_head": "meta",
    }
    return target


def test_device_map_derived_from_target(tiny):
    config = tiny.SUPPORTED["qwen3"]()
    cuda_target = tiny.model(config)
    cuda_target.hf_device_map = {"model": 0, "model.layers.1": 3, "lm_head": 3}
    assert target_layer_devices(cuda_target) == [torch.device("cuda", 0), torch.device("cuda", 3)]
    assert mapper_device_map(cuda_target) == {"layers.0": 0, "layers.1": 3}
    plain = tiny.model(config)  # no hf_device_map: parameter devices
    assert mapper_device_map(plain) == {"layers.0": "cpu", "layers.1": "cpu"}
    cpu_only = tiny.model(config)
    cpu_only.hf_device_map = {"": "cpu"}
    assert mapper_device_map(cpu_only) == {"layers.0": "cpu", "layers.1": "cpu"}


def test_offloaded_target_layers_run_on_the_main_device(tiny):
    """accelerate executes layers mapped to "cpu"/"disk" on the main device when the map has an accelerator."""
    config = tiny.SUPPORTED["qwen3"]()
    target = tiny.model(config)
    target.hf_device_map = {"model.embed_tokens": 1, "model.layers.0": "cpu", "model.layers.1": "disk", "lm_head": 2}
    assert target_layer_devices(target) == [torch.device("cuda", 1)] * 2
    assert mapper_device_map(target) == {"layers.0": 1, "layers.1": 1}
    two = _target_on_two_devices(tiny, config)  # cpu + meta: the cpu layer is offloaded and runs on meta
    assert target_layer_devices(two) == [torch.device("meta")] * 2


def test_mapped_layers_land_where_the_mapper_layers_run(tiny):
    config = tiny.SUPPORTED["llama"]()
    mapper = MapperModel.identity(config)
    mapper.layers[1].to("meta")
    cache = MappedCache.from_source(_source_cache(tiny, config), mapper)
    assert [layer.keys.device.type for layer in cache.layers] == ["cpu", "meta"]
    assert [layer.values.device.type for layer in cache.layers] == ["cpu", "meta"]
    assert cache.layers[1].keys.shape == cache.layers[0].keys.shape == (1, 2, 9, 16)


def test_devices_argument_follows_target_layers(tiny):
    config = tiny.SUPPORTED["qwen3"]()
    cache = MappedCache.from_source(_source_cache(tiny, config), MapperModel.identity(config), devices=["cpu", "meta"])
    assert [layer.keys.device.type for layer in cache.layers] == ["cpu", "meta"]
    assert torch.isfinite(cache.layers[0].keys).all()


def test_mapper_loaded_with_target_device_map(tiny, tmp_path):
    config = tiny.SUPPORTED["qwen3"]()
    MapperModel.identity(config).save_pretrained(tmp_path)
    target = _target_on_two_devices(tiny, config)
    device_map = {"layers.0": "cpu", "layers.1": "meta"}
    mapper = MapperModel.from_pretrained(tmp_path, device_map=device_map)
    assert mapper.hf_device_map == device_map
    # accelerate offloads the "cpu" layer and runs it on the main device (meta): so do its mapped tensors
    cache = MappedCache.from_source(_source_cache(tiny, config), mapper)
    assert [layer.keys.device.type for layer in cache.layers] == ["meta", "meta"]
    assert mapper_device_map(target) == {"layers.0": "meta", "layers.1": "meta"}
