"""The spec checks every dataset source shares: a key's value must be an integer in range, a number, a
list of names, a non-empty string or a shape; each fault is a one-line UserError naming the key and the
fix. Standard library only (the config layer imports the layouts that use it). A library module.
"""

from __future__ import annotations

import math
from typing import Any

from shardfuse.io import UserError

SPEC_FIX = "fix the dataset's spec in the config"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require_int(spec: dict, key: str, minimum: int, maximum: int | None = None) -> None:
    value = spec[key]
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        what = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise UserError(f"spec key {key!r} must be an integer {what}, got {value!r}; {SPEC_FIX}")


def require_number(spec: dict, key: str, low: float, high: float, *, open_interval: bool) -> None:
    value = spec[key]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not is_number or not (low < value < high if open_interval else low <= value <= high):
        what = f"strictly between {low} and {high}" if open_interval else f">= {low}"
        raise UserError(f"spec key {key!r} must be a number {what}, got {value!r}; {SPEC_FIX}")


def require_names(spec: dict, key: str, what: str, *, allow_empty: bool = False) -> None:
    """``spec[key]`` must be a list of distinct non-empty strings (non-empty unless ``allow_empty``)."""
    value = spec[key]
    if (
        not isinstance(value, list)
        or not (value or allow_empty)
        or not all(isinstance(item, str) and item for item in value)
        or len(set(value)) != len(value)
    ):
        raise UserError(f"spec key {key!r} must be a {what}, got {value!r}; {SPEC_FIX}")


def require_string(spec: dict, key: str) -> None:
    if not isinstance(spec[key], str) or not spec[key]:
        raise UserError(f"spec key {key!r} must be a non-empty string, got {spec[key]!r}; {SPEC_FIX}")


def require_shape(spec: dict, key: str, num_dims: int | None = None) -> None:
    """``spec[key]`` must be a list of positive integers (``num_dims`` of them if given, else at least 1)."""
    value = spec[key]
    if (
        not isinstance(value, list)
        or not value
        or (num_dims is not None and len(value) != num_dims)
        or not all(is_int(size) and size >= 1 for size in value)
    ):
        what = f"a list of {num_dims}" if num_dims else "a non-empty list of"
        raise UserError(f"spec key {key!r} must be {what} positive integers, got {value!r}; {SPEC_FIX}")
