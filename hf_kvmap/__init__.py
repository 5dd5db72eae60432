"""hf-kvmap: map a source model's KV cache into the cache a larger (or smaller) model of the same family expects."""

from transformers import AutoConfig, AutoModel

from ._compat import check_transformers_version
from ._version import __version__

check_transformers_version()

from .cache import MappedCache, MappedLayer  # noqa: E402
from .configuration_mapper import FitOptions, MapperConfig  # noqa: E402
from .delivery import load_cache, save_cache  # noqa: E402
from .fitting import FittedMapper  # noqa: E402
from .geometry import UnsupportedArchitectureError  # noqa: E402
from .handoff import HandoffRefusedError, HandoffReport, calibrate_probe, handoff  # noqa: E402
from .modeling_mapper import MapperModel, fit_mapper, mapper_from_statistics  # noqa: E402
from .placement import mapper_device_map, target_layer_devices  # noqa: E402
from .probes import Probe, register_probe  # noqa: E402
from .repair import RepairConfig, repair_cache  # noqa: E402
from .selection import LayerSelection  # noqa: E402
from .session import HandoffSession  # noqa: E402
from .statistics import CalibrationStatistics  # noqa: E402

AutoConfig.register(MapperConfig.model_type, MapperConfig, exist_ok=True)
AutoModel.register(MapperConfig, MapperModel, exist_ok=True)

__all__ = [
    "CalibrationStatistics",
    "FitOptions",
    "FittedMapper",
    "HandoffRefusedError",
    "HandoffReport",
    "HandoffSession",
    "LayerSelection",
    "MappedCache",
    "MappedLayer",
    "MapperConfig",
    "MapperModel",
    "Probe",
    "RepairConfig",
    "UnsupportedArchitectureError",
    "__version__",
    "calibrate_probe",
    "fit_mapper",
    "handoff",
    "load_cache",
    "mapper_device_map",
    "mapper_from_statistics",
    "register_probe",
    "repair_cache",
    "save_cache",
    "target_layer_devices",
]
