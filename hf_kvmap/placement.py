"""Placing mapper layers beside the target layers that read their output."""

from __future__ import annotations

import torch
from torch import nn


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"Could not find the decoder layers of {type(model).__name__} (expected `get_decoder().layers`)."
        )
    return layers


def _as_device(value) -> torch.device:
    if isinstance(value, int):
        return torch.device("cuda", value)
    if value == "disk":
        return torch.device("cpu")
    return torch.device(value)


def execution_device_map(device_map: dict) -> dict:
    """Where each entry of an accelerate `device_map` runs.

    accelerate's dispatch rule: when the map names any accelerator, modules mapped to `"cpu"` or `"disk"` are
    offloaded there and *executed* on the main device (the first non-cpu/disk entry); only an all-CPU map runs on
    the CPU. So a target layer offloaded to the CPU keeps its cache on the main device, and so must its mapped layer.
    """
    offloaded = ("cpu", "disk")
    main = next((device for device in device_map.values() if device not in offloaded), "cpu")
    return {name: main if device in offloaded else device for name, device in device_map.items()}


def execution_devices(model: nn.Module, layers: nn.ModuleList) -> list[torch.device]:
    """The device each of `layers` (submodules of `model`) executes on.

    Uses `hf_device_map` when accelerate dispatched the model (so offloaded layers report where they run, see
    `execution_device_map`, not the `meta` placeholder of their parameters), otherwise the device of each layer's
    parameters.
    """
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        device_map = execution_device_map(device_map)
        names = {id(module): name for name, module in model.named_modules()}
        devices = []
        for layer in layers:
            name = names[id(layer)]
            matches = [key for key in device_map if key == "" or name == key or name.startswith(key + ".")]
            if not matches:
                raise ValueError(f"hf_device_map has no entry covering layer `{name}` of {type(model).__name__}.")
            devices.append(_as_device(device_map[max(matches, key=len)]))
        return devices
    devices = []
    for layer in layers:
        param = next(layer.parameters(), None)
        devices.append(param.device if param is not None else torch.device("cpu"))
    return devices


def target_layer_devices(target_model: nn.Module) -> list[torch.device]:
    """The execution device of every decoder layer of a loaded target model.

    Pass it as `MappedCache.from_source(..., devices=target_layer_devices(target))` when the mapper is not placed
    beside the target (e.g. a mapper on one GPU serving a target spread over several).
    """
    return execution_devices(target_model, _decoder_layers(target_model))


def mapper_device_map(target_model: nn.Module) -> dict[str, int | str]:
    """An accelerate `device_map` for a `MapperModel` that puts mapper layer `l` beside target layer `l`.

    Example:

    ```python
    >>> from transformers import Qwen3Config, Qwen3ForCausalLM
    >>> from hf_kvmap import mapper_device_map
    >>> config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    >>> mapper_device_map(Qwen3ForCausalLM(config))
    {'layers.0': 'cpu', 'layers.1': 'cpu'}
    ```

    Pass it as `MapperModel.from_pretrained(path, device_map=mapper_device_map(target))`.
    """
    device_map: dict[str, int | str] = {}
    for idx, device in enumerate(target_layer_devices(target_model)):
        device_map[f"layers.{idx}"] = device.index if device.type == "cuda" else device.type
    return device_map
