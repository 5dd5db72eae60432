"""The one registration helper: every registry of methods (mapper kinds, fine-tuning objectives, repair strategies,
probes) is a dict from a class's `name` to the class, filled by a class decorator this module makes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T", bound=type)


def registrar(registry: dict[str, type], what: str) -> Callable[[T], T]:
    """A class decorator adding a class to `registry` under its `name`; `what` names one entry, with its article
    ("a probe"). It refuses a class without a name and a second class of a name already taken.

    >>> PETS: dict = {}
    >>> register_pet = registrar(PETS, "a pet")
    >>> @register_pet
    ... class Cat:
    ...     name = "cat"
    >>> sorted(PETS)
    ['cat']
    """

    def register(cls: T) -> T:
        name = getattr(cls, "name", "")
        if not name:
            raise ValueError(f"{cls.__name__} needs a non-empty `name` to be registered as {what}.")
        if name in registry and registry[name] is not cls:
            raise ValueError(
                f"{what[0].upper()}{what[1:]} named {name!r} is already registered ({registry[name].__name__})."
            )
        registry[name] = cls
        return cls

    register.__doc__ = (
        f"Class decorator: register `cls` as {what} under `cls.name` (a second one of that name raises)."
    )
    return register


__all__ = ["registrar"]
