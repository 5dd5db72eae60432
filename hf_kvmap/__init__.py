"""hf-kvmap: map a source model's KV cache into the cache a larger (or smaller) model of the same family expects.

The public names load on first use (a module `__getattr__`, as transformers' `_LazyModule` does), so that
`import hf_kvmap.cache` loads the mapping code only, not fitting, fine-tuning, evaluation or serving. The config and
the model load at once: they are registered with `AutoConfig` and `AutoModel`. `cache_kwargs` and `output_cache` are
the one transformers version gate that code driving a model around a cache needs (the cache argument's and the output
field's name, `past_key_values` before transformers 5.24, `cache` from it).
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING

from transformers import AutoConfig, AutoModel

from ._compat import check_transformers_version
from ._version import __version__

check_transformers_version()

from .configuration_mapper import MapperConfig  # noqa: E402
from .modeling_mapper import MapperModel  # noqa: E402

AutoConfig.register(MapperConfig.model_type, MapperConfig, exist_ok=True)
AutoModel.register(MapperConfig, MapperModel, exist_ok=True)

#: Public name -> the module that defines it (imported on first access).
_LAZY_NAMES = {
    "CalibrationStatistics": "statistics",
    "FitOptions": "fit_options",
    "FittedMapper": "fitting",
    "GuardLadder": "serving.ladder",
    "HandoffRefusedError": "serving.report",
    "HandoffReport": "serving.report",
    "HandoffSession": "serving.session",
    "LadderItem": "calibration.ladder_items",
    "LadderRung": "serving.ladder",
    "LayerSelection": "selection",
    "MappedCache": "cache",
    "MappedLayer": "cache",
    "Probe": "serving.probes.base",
    "UnsupportedArchitectureError": "geometry",
    "cache_kwargs": "_compat",
    "calibrate_probe": "calibration.probe_thresholds",
    "fit_mapper": "fitting",
    "fitted_config": "fitting",
    "handoff": "serving.handoff",
    "calibrate_ladder": "calibration.ladder",
    "load_cache": "delivery",
    "mapper_device_map": "placement",
    "mapper_from_statistics": "fitting",
    "measure_ladder_items": "calibration.ladder_items",
    "output_cache": "_compat",
    "register_probe": "serving.probes.base",
    "DecodeRefresh": "repair",
    "RepairConfig": "repair",
    "repair_cache": "repair",
    "save_cache": "delivery",
    "target_layer_devices": "placement",
    "use_packed_attention": "packed_attention",
}

if TYPE_CHECKING:
    from ._compat import cache_kwargs, output_cache
    from .cache import MappedCache, MappedLayer
    from .calibration.ladder import calibrate_ladder
    from .calibration.ladder_items import LadderItem, measure_ladder_items
    from .calibration.probe_thresholds import calibrate_probe
    from .delivery import load_cache, save_cache
    from .fit_options import FitOptions
    from .fitting import FittedMapper, fit_mapper, fitted_config, mapper_from_statistics
    from .geometry import UnsupportedArchitectureError
    from .packed_attention import use_packed_attention
    from .placement import mapper_device_map, target_layer_devices
    from .repair import DecodeRefresh, RepairConfig, repair_cache
    from .selection import LayerSelection
    from .serving.handoff import handoff
    from .serving.ladder import GuardLadder, LadderRung
    from .serving.probes.base import Probe, register_probe
    from .serving.report import HandoffRefusedError, HandoffReport
    from .serving.session import HandoffSession
    from .statistics import CalibrationStatistics


def __getattr__(name: str):
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(f".{_LAZY_NAMES[name]}", __name__), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a submodule, e.g. `hf_kvmap.zoo`
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_NAMES))


__all__ = [
    "CalibrationStatistics",
    "DecodeRefresh",
    "FitOptions",
    "FittedMapper",
    "GuardLadder",
    "HandoffRefusedError",
    "HandoffReport",
    "HandoffSession",
    "LadderItem",
    "LadderRung",
    "LayerSelection",
    "MappedCache",
    "MappedLayer",
    "MapperConfig",
    "MapperModel",
    "Probe",
    "RepairConfig",
    "UnsupportedArchitectureError",
    "__version__",
    "cache_kwargs",
    "calibrate_ladder",
    "calibrate_probe",
    "fit_mapper",
    "fitted_config",
    "handoff",
    "load_cache",
    "mapper_device_map",
    "mapper_from_statistics",
    "measure_ladder_items",
    "output_cache",
    "register_probe",
    "repair_cache",
    "save_cache",
    "target_layer_devices",
    "use_packed_attention",
]
