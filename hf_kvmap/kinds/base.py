"""What a mapper kind is ([`MapperKind`]) and the one registry of them ([`register_mapper_kind`]).

A kind is one file in `hf_kvmap/kinds/` holding everything about it: its options dataclass, the module of one map
(`build_map`, what `MapperModel` is made of) and how its maps are fitted on calibration features kept in memory
(`fit_on_features`, what `hf_kvmap.fitting.fit` runs). One `@register_mapper_kind` line makes it a kind:
`MapperConfig`, `FitOptions`, `MapperModel`, fitting and the command line all read this registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from torch import nn

from ..layout import part_inputs
from ..registry import registrar


class MapperKind:
    r"""
    One mapper kind (subclass it in its own file and decorate it with [`register_mapper_kind`]).

    Class attributes:
        name (`str`): the kind's name (`MapperConfig.kind`, `FitOptions.kind`, `hf-kvmap fit --kind`).
        options_class (`type`): its options dataclass; its fields are `FitOptions` fields of the same name.
        needs_features (`bool`): whether its maps are always fitted on features kept in memory (else a per-position
            map may be solved from the sufficient statistics alone, as the ridge is).
    """

    name: ClassVar[str]
    options_class: ClassVar[type]
    needs_features: ClassVar[bool] = True

    @staticmethod
    def build_map(config, in_features: int) -> nn.Module:
        """The module of one map: `(..., in_features)` to `(..., n_kv_target * head_dim_target)`."""
        raise NotImplementedError

    @staticmethod
    def check_options(options, head_dim: Callable[[], int]) -> None:
        """Refuse `options` (`FitOptions`) this kind cannot fit (before any pass over the data; `head_dim()` is the
        target's head dim); raises `ValueError` naming the fix."""

    @staticmethod
    def fit_on_features(features, selection, options, target, progress: bool) -> tuple[dict, dict[str, Any]]:
        """Every map fitted on `features` (`CalibrationFeatures`) with `selection` and `options` (`FitOptions`) for
        the `target` geometry: `({(target_layer, part): state dict of the map}, calibration record)`."""
        raise NotImplementedError


#: Every mapper kind by name, in registration order; filled by [`register_mapper_kind`] as `hf_kvmap.kinds` loads.
KIND_REGISTRY: dict[str, type[MapperKind]] = {}


#: Class decorator: make `cls` the mapper kind `cls.name` (refusing a second one of the same name).
register_mapper_kind = registrar(KIND_REGISTRY, "a mapper kind")


def map_inputs(options, layer: int, part: str) -> tuple[int, str]:
    """`(context_window, input_kinds)` of one map under `options` (its `layer_inputs` entry, else the global)."""
    return part_inputs(options.layer_inputs or {}, layer, part, options.context_window, options.input_kinds)


__all__ = ["KIND_REGISTRY", "MapperKind", "map_inputs", "register_mapper_kind"]
