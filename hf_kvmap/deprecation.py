"""Old public names kept for one release: a module's `__getattr__` that hands out the new object under the old name
with a `DeprecationWarning` naming the new name and the version that removes the old one."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

#: the release that removes the names deprecated in this one
REMOVED_IN = "0.2"


def deprecated_names(module: str, namespace: dict[str, Any], aliases: dict[str, Any]) -> Callable[[str], Any]:
    """A module `__getattr__`: `aliases` maps each old name to the new one in `namespace` (the module's globals), or
    to `(where the new one is, the object the old name gives)`.

    Example:

    ```python
    >>> __getattr__ = deprecated_names(__name__, globals(), {"SELECTORS": "STRATEGIES"})  # doctest: +SKIP
    ```
    """

    def __getattr__(name: str) -> Any:
        if name in aliases:
            new = aliases[name]
            where, value = new if isinstance(new, tuple) else (f"{module}.{new}", namespace[new])
            warnings.warn(
                f"{module}.{name} is deprecated and goes in hf-kvmap {REMOVED_IN}: use {where}.",
                DeprecationWarning,
                stacklevel=2,
            )
            return value
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


__all__ = ["REMOVED_IN", "deprecated_names"]
