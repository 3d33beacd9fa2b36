"""Batches and layer outputs as nested collections of tensors, and splitting a batch into micro-batches.

Batches and layer outputs come as tensors, tuples, named tuples, lists and dicts of them. Pure torch, no
process groups: the executor, the single-process replay, the profiler and the model summary share these.

Example::

    >>> import torch
    >>> micro, sizes = split_microbatches((torch.zeros(5, 3), torch.arange(5)), 2)
    >>> sizes, micro[1][1].tolist()
    ([3, 2], [3, 4])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_dynpipe.errors import ConfigurationError

__all__ = [
    "iter_tensors",
    "tree_map",
    "batch_len",
    "split_microbatches",
    "microbatch_sizes",
    "check_batch_size",
    "take_share",
    "batch_fingerprint",
    "sample_identity",
    "merge_step_outputs",
]


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


def batch_len(obj: Any) -> int | None:
    """The size of the first dimension of the first tensor (with one) in ``obj``; ``None`` if there is none."""
    if isinstance(obj, Tensor):
        return int(obj.shape[0]) if obj.dim() > 0 else None
    if isinstance(obj, Mapping):
        for v in obj.values():
            n = batch_len(v)
            if n is not None:
                return n
    if isinstance(obj, (list, tuple)):
        for v in obj:
            n = batch_len(v)
            if n is not None:
                return n
    return None


def _split(obj: Any, sections: Sequence[int]) -> list[Any]:
    if isinstance(obj, Tensor) and obj.dim() > 0:
        return list(torch.split(obj, list(sections)))
    if isinstance(obj, Mapping):
        parts = {k: _split(v, sections) for k, v in obj.items()}
        factory = type(obj) if isinstance(obj, dict) else dict
        return [factory({k: parts[k][i] for k in obj}) for i in range(len(sections))]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        cols = [_split(v, sections) for v in obj]
        return [type(obj)(*(c[i] for c in cols)) for i in range(len(sections))]
    if isinstance(obj, (list, tuple)):
        cols = [_split(v, sections) for v in obj]
        return [type(obj)(c[i] for c in cols) for i in range(len(sections))]
    return [obj] * len(sections)


def split_microbatches(batch: Any, num_microbatches: int) -> tuple[list[Any], list[int]]:
    """Splits every tensor of ``batch`` along dim 0 into ``num_microbatches`` near-equal parts.

    Non-tensor leaves are shared by all micro-batches. Returns the micro-batches and their sizes.
    """
    sizes = microbatch_sizes(check_batch_size(batch, num_microbatches), num_microbatches)
    return _split(batch, sizes), sizes


def microbatch_sizes(batch_size: int, num_microbatches: int) -> list[int]:
    """The sizes :func:`split_microbatches` gives a batch of ``batch_size``: near-equal, larger ones first."""
    base, extra = divmod(batch_size, num_microbatches)
    return [base + (1 if i < extra else 0) for i in range(num_microbatches)]


def take_share(batch: Any, offset: int, size: int) -> Any:
    """The samples ``offset : offset + size`` of every tensor of ``batch`` (dim 0): one replica's share.

    Non-tensor leaves are kept as they are. Raises if the batch is shorter than ``offset + size``.
    """
    n = batch_len(batch)
    if n is None or offset < 0 or size < 0 or offset + size > n:
        raise ConfigurationError(
            f"Cannot take samples {offset}:{offset + size} of a batch of {n} samples: a replica's share must lie "
            "inside the global batch. Every replica must read the same global batch (replica_split)."
        )
    return _split(batch, [offset, size, n - offset - size])[1]


def check_batch_size(batch: Any, num_microbatches: int) -> int:
    """The batch size of ``batch``; raises if it cannot be split into ``num_microbatches`` non-empty parts."""
    n = batch_len(batch)
    if n is None:
        raise ConfigurationError(
            "The batch holds no tensor with a batch dimension, so it cannot be split into micro-batches. "
            "Return tensors (or tuples/dicts of tensors) from your dataloader."
        )
    if n < num_microbatches:
        raise ConfigurationError(
            f"A batch of size {n} cannot be split into num_microbatches={num_microbatches}: every micro-batch "
            f"needs at least one sample. Use a batch size >= {num_microbatches} (or drop_last=True in the "
            "dataloader), or lower num_microbatches."
        )
    return n


def batch_fingerprint(batch: Any) -> float:
    """A number that differs, almost surely, between two batches that differ in content or sample order.

    Each sample's values are summed (float64) and weighted by its position, so the same samples in another
    order give another number too: replicas that must read the same global batch compare these.
    """
    total = float(batch_len(batch) or 0)
    for t in iter_tensors(batch):
        if t.dim() == 0 or t.is_complex() or t.shape[0] == 0:
            continue
        total += _positional_sum(t)
    return total


def sample_identity(batch: Any) -> float:
    """The position-weighted checksum :func:`batch_fingerprint` sums, over the batch's integer and boolean tensors
    only (labels, token ids, indices): what identifies its samples, whatever a random augmentation did to their
    float inputs. ``nan`` when the batch holds none. Stage 0 and the last stage compare it: each reads the batch
    in its own process."""
    ints = [
        t
        for t in iter_tensors(batch)
        if not (t.is_floating_point() or t.is_complex()) and t.dim() > 0 and t.shape[0] > 0
    ]
    return float(sum(_positional_sum(t) for t in ints)) if ints else math.nan


def _positional_sum(t: Tensor) -> float:
    """Each sample's values summed in float64 and weighted by its position (1, 2, ...)."""
    per_sample = t.detach().reshape(t.shape[0], -1).double().sum(1)
    return float((per_sample * torch.arange(1, t.shape[0] + 1, dtype=torch.float64, device=t.device)).sum())


def merge_step_outputs(outputs: Sequence[Mapping[str, Any]], sizes: Sequence[int]) -> dict[str, Any]:
    """What ``training_step`` returned for a step's micro-batches besides the loss, as one batch's outputs.

    ``outputs``: each micro-batch's dict without ``"loss"``, in order; ``sizes``: their sample counts. A key whose
    value is, in every micro-batch, a tensor with one row per sample (its first dimension the micro-batch's size) is
    concatenated along that dimension (where the other dimensions, the dtype and the device agree): the batch's
    per-sample tensor, in the batch's order, as one device's step returns it. Any other key (a scalar, a number, a
    key missing from some micro-batches) gives the list of the micro-batches' values (``None`` where one lacks it).

    Example::

        >>> merged = merge_step_outputs(
        ...     [{"preds": torch.tensor([1, 0]), "n": 2}, {"preds": torch.tensor([2]), "n": 1}], [2, 1]
        ... )
        >>> merged["preds"].tolist(), merged["n"]
        ([1, 0, 2], [2, 1])
    """
    keys = list(dict.fromkeys(k for out in outputs for k in out))
    merged: dict[str, Any] = {}
    for key in keys:
        values = [out.get(key) for out in outputs]
        first = values[0]
        per_sample = isinstance(first, Tensor) and all(
            isinstance(v, Tensor)
            and v.dim() >= 1
            and v.shape[0] == n
            and v.shape[1:] == first.shape[1:]
            and v.dtype == first.dtype
            and v.device == first.device
            for v, n in zip(values, sizes, strict=True)
        )
        merged[key] = torch.cat(values) if per_sample else values  # type: ignore[arg-type]
    return merged
