"""The validators every option bundle and config shares: each raises `ValueError` naming the value and what it must
be."""

from __future__ import annotations


def check_bool(name: str, value) -> None:
    """Raise `TypeError` unless `value` is `True` or `False` (a string such as `"no"` would read as true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False, not a {type(value).__name__}.")


def check_choice(name: str, value, choices: tuple) -> None:
    """Raise `ValueError` unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}.")


def check_int(name: str, value, minimum: int, *, allow_none: bool = False, meaning: str = "") -> None:
    """Raise `ValueError` unless `value` is an integer (not a bool) `>= minimum` (or `None` with `allow_none`)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = {1: "a positive integer", 0: "a non-negative integer"}.get(minimum, f"an integer >= {minimum}")
        raise ValueError(f"{name}={value!r} must be {what}{meaning}.")


def check_number(name: str, value, minimum: float, *, strict: bool = False, below: float | None = None) -> None:
    """Raise `ValueError` unless `value` is a real number `>= minimum` (`> minimum` with `strict`, `< below`)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > minimum if strict else value >= minimum) and (below is None or value < below)
    if not ok:
        bound = f"{'>' if strict else '>='} {minimum}" + (f" and < {below}" if below is not None else "")
        raise ValueError(f"{name}={value!r} must be a number {bound}.")


__all__ = ["check_bool", "check_choice", "check_int", "check_number"]
