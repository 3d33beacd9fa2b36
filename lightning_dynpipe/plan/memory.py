"""Per-device memory of a pipeline stage: weight versions, optimizer state, in-flight activations.

The schedule says how many of each a stage keeps (:class:`~lightning_dynpipe.schedule.Schedule`):
PipeDream-style asynchronous 1F1B keeps, on stage ``k`` of ``S``, ``S - k`` weight versions (the live
weights plus one stashed version per micro-batch whose backward is still to come) and the activations of
``S - k`` micro-batches in flight. With ``schedule="sync"`` (1F1B, flush every step) one version suffices and
at most ``min(S - k, M)`` micro-batches are in flight; ``"gpipe"`` holds all ``M``.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike, NDArray

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.costs import ModelCost
from lightning_dynpipe.schedule.kinds import Schedule, get_schedule

__all__ = [
    "ScheduleLike",
    "weight_versions",
    "in_flight_microbatches",
    "stage_memory",
    "activation_memory",
    "stage_input_bytes",
    "format_bytes",
]

ScheduleLike = Schedule | str
"""A schedule object or its name (``"async"``, ``"sync"``, ``"gpipe"``)."""


def _check(stage_idx: int, num_stages: int, schedule: ScheduleLike, num_microbatches: int | None) -> Schedule:
    sched = get_schedule(schedule)
    if not 0 <= stage_idx < num_stages:
        raise ConfigurationError(f"stage_idx must be in [0, {num_stages}); got stage_idx={stage_idx}.")
    if sched.accumulates and (num_microbatches is None or num_microbatches < 1):
        raise ConfigurationError(
            f'schedule="{sched}" needs num_microbatches >= 1 (micro-batches per step); got {num_microbatches!r}.'
        )
    return sched


def weight_versions(stage_idx: int, num_stages: int, schedule: ScheduleLike = "async") -> int:
    """Weight versions stage ``stage_idx`` keeps: ``S - k`` for async (stashing), 1 for sync and gpipe."""
    return _check(stage_idx, num_stages, schedule, 1).weight_versions(stage_idx, num_stages)


def in_flight_microbatches(
    stage_idx: int, num_stages: int, schedule: ScheduleLike = "async", num_microbatches: int | None = None
) -> int:
    """Micro-batches whose activations stage ``stage_idx`` holds at once in steady state.

    ``S - k`` for async; ``min(S - k, M)`` for sync and ``M`` for gpipe, where ``M = num_microbatches``.
    """
    sched = _check(stage_idx, num_stages, schedule, num_microbatches)
    return sched.in_flight(stage_idx, num_stages, num_microbatches or 1)


def stage_memory(
    model: ModelCost,
    first: ArrayLike,
    stop: ArrayLike,
    *,
    stage_idx: int,
    num_stages: int,
    schedule: ScheduleLike = "async",
    num_microbatches: int | None = None,
) -> NDArray[np.int64]:
    """Peak bytes on each device of the stage owning layers ``[first, stop)``, vectorised over ranges.

    ``versions * params + optimizer_state + in_flight * (input + kept) + max(workspace)``, where ``kept`` is what
    one micro-batch in flight keeps for the stage's layers until its backward (:attr:`LayerCost.kept_bytes
    <lightning_dynpipe.plan.costs.LayerCost.kept_bytes>`: the saved tensors and outputs the profile measured, else
    the outputs) and ``input`` the message it received (see :func:`activation_memory`). Replicas do not change it:
    each replica holds the whole stage.

    Example::

        >>> model = ModelCost.from_arrays([1.0, 1.0], [1.0, 1.0], param_bytes=10, activation_bytes=3,
        ...                               optimizer_state_bytes=20)
        >>> stage_memory(model, [0], [2], stage_idx=0, num_stages=2).tolist()  # 2*20 + 40 + 2*6
        [92]
        >>> stage_memory(model, [1], [2], stage_idx=1, num_stages=2).tolist()  # 1*10 + 20 + 1*(3 + 3)
        [36]
    """
    versions = weight_versions(stage_idx, num_stages, schedule)
    i = np.asarray(first, dtype=np.int64)
    j = np.asarray(stop, dtype=np.int64)
    params = model.param_prefix[j] - model.param_prefix[i]
    optim = model.optimizer_prefix[j] - model.optimizer_prefix[i]
    acts = activation_memory(
        model, i, j, stage_idx=stage_idx, num_stages=num_stages, schedule=schedule, num_microbatches=num_microbatches
    )
    return np.asarray(versions * params + optim + acts, dtype=np.int64)


def activation_memory(
    model: ModelCost,
    first: ArrayLike,
    stop: ArrayLike,
    *,
    stage_idx: int,
    num_stages: int,
    schedule: ScheduleLike = "async",
    num_microbatches: int | None = None,
) -> NDArray[np.int64]:
    """The activation part of :func:`stage_memory`: ``in_flight * (input + kept) + max(workspace)``, vectorised.

    What the stage's micro-batches in flight keep for their backwards (each storage once), and the largest
    transient of one layer. ``input`` is the message a stage after the first receives per micro-batch, the
    previous layer's output (``activation_bytes[first - 1]``): the stage keeps it until the micro-batch's backward
    has produced its gradient, whether or not the first layer saves it; the first stage's input (the user's batch)
    is not counted.
    """
    in_flight = in_flight_microbatches(stage_idx, num_stages, schedule, num_microbatches)
    i = np.asarray(first, dtype=np.int64)
    j = np.asarray(stop, dtype=np.int64)
    kept = model.kept_prefix[j] - model.kept_prefix[i]
    return np.asarray(in_flight * (stage_input_bytes(model, i) + kept) + model.workspace_max(i, j), dtype=np.int64)


def stage_input_bytes(model: ModelCost, first: ArrayLike) -> NDArray[np.int64]:
    """Bytes of the message a stage starting at layer ``first`` receives per micro-batch (0 for ``first == 0``).

    Example::

        >>> model = ModelCost.from_arrays([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], activation_bytes=[5, 7, 2])
        >>> stage_input_bytes(model, [0, 1, 2]).tolist()
        [0, 5, 7]
    """
    i = np.asarray(first, dtype=np.int64)
    acts = model.activation_prefix
    return np.asarray(np.where(i > 0, acts[i] - acts[np.maximum(i - 1, 0)], 0), dtype=np.int64)


def format_bytes(num: float) -> str:
    """``num`` bytes in binary units, e.g. ``format_bytes(1536)`` -> ``'1.5 KiB'`` (``'inf'`` for no cap)."""
    if math.isinf(num):
        return "inf"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
