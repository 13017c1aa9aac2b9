"""Checks of the library's arguments: a wrong one is a `ValueError` naming it, never a TypeError or an IndexError
from deep inside torch or transformers."""

from __future__ import annotations

import numbers
import operator

import torch


def integer(name: str, value) -> int:
    """An integer argument (ints, numpy ints, 0-d integer tensors; not a bool); ValueError for anything else,
    floats included: 2.5 tokens is a mistake, not a request to round."""
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return number


def count(name: str, value, low: int = 0) -> int:
    """An integer argument >= `low`."""
    try:
        number = integer(name, value)
    except ValueError:
        number = None
    if number is None or number < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return number


def flag(name: str, value) -> bool:
    """A switch: True or False (or a 0-d bool tensor), never a string: "no" is truthy, and would turn it on."""
    if isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype == torch.bool:
        return bool(value)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def real(name: str, value) -> float:
    """A number argument (ints, floats, numpy numbers, 0-d tensors; not a bool, a string or None) as a float."""
    if isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype != torch.bool:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def tokenizer_like(name: str, value):
    """A tokenizer (or None): something that encodes when called, decodes and lists its vocabulary, as
    transformers' tokenizers do; ValueError otherwise, not an AttributeError from inside a generation."""
    if value is not None and not (callable(value) and all(hasattr(value, m) for m in ("decode", "get_vocab"))):
        raise ValueError(f"{name} must be a tokenizer (transformers' AutoTokenizer), got {type(value).__name__}")
    return value
