"""Nested collections of tensors (tensors, tuples, named tuples, lists, dicts), as batches and layer outputs come.

Pure torch, no Lightning: the profiler and the model summary share these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor

__all__ = ["iter_tensors", "tree_map"]


def tree_map(fn: Callable[[Tensor], Tensor], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor; containers keep their type, other leaves stay as they are."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(tree_map(fn, v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(tree_map(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: tree_map(fn, v) for k, v in value.items()}
    return value


def iter_tensors(value: Any) -> Iterator[Tensor]:
    """Every tensor in ``value``, depth first."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from iter_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from iter_tensors(v)
