"""The mapper kinds, one file each with its options dataclass, behind one registration
(`hf_kvmap.kinds.base.register_mapper_kind`):

- `ridge` ([`RidgeKind`]): one affine map per target layer and K/V (the paper's).
- `mlp` ([`MLPKind`]): one MLP per target layer, KV head and K/V.

A new kind is one file here with a `MapperKind` subclass decorated with `register_mapper_kind`, imported below.
"""

from .base import KIND_REGISTRY, MapperKind, map_inputs, register_mapper_kind
from .mlp import MLPKind, MLPOptions  # imports .ridge first, so the ridge registers first
from .ridge import RidgeKind, RidgeOptions

#: The names of the mapper kinds (what `MapperConfig.kind` and `FitOptions.kind` accept).
MAPPER_KINDS = tuple(KIND_REGISTRY)


def get_kind(name: str) -> type[MapperKind]:
    """The registered kind `name`; raises `ValueError` naming the known ones."""
    if name not in KIND_REGISTRY:
        raise ValueError(f"kind={name!r} is not one of {MAPPER_KINDS}.")
    return KIND_REGISTRY[name]


__all__ = [
    "KIND_REGISTRY",
    "MAPPER_KINDS",
    "MLPKind",
    "MLPOptions",
    "MapperKind",
    "RidgeKind",
    "RidgeOptions",
    "get_kind",
    "map_inputs",
    "register_mapper_kind",
]
