"""Checks of the library's arguments: a wrong one is a `ValueError` naming it, never a TypeError or an IndexError
from deep inside torch or transformers."""

from __future__ import annotations

import numbers
import operator


def count(name: str, value, low: int = 0) -> int:
    """An integer argument >= `low` (ints, numpy ints, 0-d integer tensors); ValueError for anything else,
    floats included: 2.5 tokens is a mistake, not a request to round."""
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}") from None
    if isinstance(value, bool) or number < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return number


def real(name: str, value) -> float:
    """A number argument (ints, floats, numpy numbers; not a bool, a string or None) as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)
