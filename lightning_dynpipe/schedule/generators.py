"""Per-stage schedules: pure functions from ``(kind, stage, step)`` to the instructions the stage runs.

Notation: ``S = num_stages``, ``k = stage_idx``, ``M = num_microbatches`` (per Lightning step),
``w = S - 1 - k`` (stage ``k``'s warm-up depth and, in ``"async"``, its staleness). Micro-batch indices
``mb_idx`` count from 0 since the last drain: step ``t`` holds ``t*M .. t*M+M-1``.

Communication is part of every schedule: a forward is preceded by ``RA`` (except on stage 0) and
followed by ``SA`` (except on the last stage); a backward is preceded by ``RG`` (except on the last stage)
and followed by ``SG`` (except on stage 0).

``"async"`` -- PipeDream 1F1B, no flush, one update after every backward. Stage ``k``'s endless sequence
is ``F0 .. F(w-1)``, then pairs ``F(j) B(j-w)``. Step ``t`` holds, for ``j = t*M .. t*M+M-1``::

    [RA j] [W j] F j [SA j]    then, if j >= w:    [RG j-w] B j-w [SG j-w] U j-w

``W`` appears on every stage but the last (``w > 0``); the last stage's forward and backward are
adjacent, with no update between them, but in a pipeline of two or more stages its step is cut after a
forward: step ``t`` runs ``[B (t*M-1) U (t*M-1)]``, then ``F j B j U j`` for the batch's first ``M-1``
micro-batches and ``F (t*M+M-1)``, whose backward opens step ``t+1``. So the per-step broadcast of the
training loop from the last stage finds every stage at the same point of the 1F1B timeline. Stage 0 and
the last stage forward all of batch ``t`` in step ``t``; stage ``k < S-1`` carries ``min(w, t*M+M)``
backwards into the next step (or into :func:`drain_instructions`), the last stage one. Consequences,
checked by the simulator:

* stage ``k``'s forward of micro-batch ``i`` runs after exactly ``max(0, i - w)`` updates, and its
  backward after ``i``: its update is ``w`` versions stale (:func:`staleness`; fewer for the first ``w``
  micro-batches after a drain);
* at most ``S - k`` micro-batches are in flight on stage ``k`` and so at most ``S - k`` weight versions
  are stashed there (:func:`max_stash`).

``"sync"`` -- 1F1B with a flush every step: ``min(w, M)`` warm-up forwards, then one forward and one
backward in turn, then the remaining backwards, then one ``U`` (gradients accumulated over the step).

``"gpipe"`` -- all ``M`` forwards, then all ``M`` backwards, then one ``U``. Backwards run in ascending
order ``t*M .. t*M+M-1`` on every stage (not GPipe's usual reverse order). Any order is deadlock-free
here, because every forward of the step precedes every backward and in the backward phase a stage only
waits on the next one; stages that disagree on the order only add bubbles. Ascending was chosen because it
accumulates the gradients in the same order as ``"sync"`` (so both give the same floats), and with uniform
costs it is exactly as fast as the reverse order.

Example::

    >>> from lightning_dynpipe.schedule import format_instructions
    >>> format_instructions(step_instructions("async", 0, 2, 2, step=0))
    'W0 F0 SA0 W1 F1 SA1 RG0 B0 U0'
    >>> format_instructions(drain_instructions("async", 0, 2, 2, steps_done=1))
    'RG1 B1 U1'
"""

from __future__ import annotations

from collections.abc import Iterator

from lightning_dynpipe.schedule.instructions import Instruction
from lightning_dynpipe.schedule.kinds import SCHEDULES, Schedule, ScheduleKind, _check, get_schedule

__all__ = [
    "ScheduleKind",
    "SCHEDULES",
    "step_instructions",
    "drain_instructions",
    "iter_steps",
    "in_flight_after",
    "staleness",
    "max_stash",
]


def staleness(kind: ScheduleKind | Schedule, stage_idx: int, num_stages: int) -> int:
    """Stage ``stage_idx``'s staleness: updates between a micro-batch's forward and its own update.

    Equivalently, how many versions older than the live weights are the weights that the stage computes a
    gradient with, in steady state.

    Example::

        >>> [staleness("async", k, 4) for k in range(4)]
        [3, 2, 1, 0]
        >>> staleness("sync", 0, 4)
        0

    Args:
        kind: the schedule.
        stage_idx: the stage ``k``, ``0 <= k < num_stages``.
        num_stages: the number of stages ``S``.

    Returns:
        ``S - 1 - k`` for ``"async"``; 0 for ``"sync"`` and ``"gpipe"``.

    Raises:
        ScheduleError: unknown ``kind`` or a stage out of range.
    """
    return get_schedule(kind).staleness(stage_idx, num_stages)


def max_stash(kind: ScheduleKind | Schedule, stage_idx: int, num_stages: int) -> int:
    """Most weight versions stage ``stage_idx`` keeps stashed (bound by ``W`` to in-flight micro-batches).

    In ``"async"`` a stage with staleness ``w = S - 1 - k > 0`` has up to ``w + 1 = S - k`` micro-batches
    forwarded but not yet backwarded, each bound to its own weight version (the newest of them being the
    live weights). The last stage (``w = 0``) and the synchronous schedules stash nothing. The bound is
    reached once at least ``2w + 1`` micro-batches have been forwarded since the last drain.

    Example::

        >>> [max_stash("async", k, 4) for k in range(4)]
        [4, 3, 2, 0]

    Args:
        kind: the schedule.
        stage_idx: the stage ``k``, ``0 <= k < num_stages``.
        num_stages: the number of stages ``S``.

    Returns:
        ``S - k`` for ``"async"`` when ``S - 1 - k > 0``, else 0.

    Raises:
        ScheduleError: unknown ``kind`` or a stage out of range.
    """
    return get_schedule(kind).max_stash(stage_idx, num_stages)


def in_flight_after(
    kind: ScheduleKind | Schedule, stage_idx: int, num_stages: int, num_microbatches: int, steps_done: int
) -> int:
    """Micro-batches forwarded but not yet backwarded on a stage after ``steps_done`` steps.

    Example::

        >>> in_flight_after("async", 0, 4, 2, steps_done=1), in_flight_after("async", 0, 4, 2, steps_done=5)
        (2, 3)

    Args:
        kind: the schedule.
        stage_idx: the stage ``k``.
        num_stages: the number of stages ``S``.
        num_microbatches: micro-batches per step ``M``.
        steps_done: steps run since the last drain.

    Returns:
        ``min(S - 1 - k, steps_done * M)`` for ``"async"``; 0 for ``"sync"`` and ``"gpipe"`` (they flush).

    Raises:
        ScheduleError: an argument out of range.
    """
    return get_schedule(kind).in_flight_after(stage_idx, num_stages, num_microbatches, steps_done)


def step_instructions(
    kind: ScheduleKind | Schedule, stage_idx: int, num_stages: int, num_microbatches: int, step: int
) -> tuple[Instruction, ...]:
    """The instructions stage ``stage_idx`` runs in step ``step`` (counted since the last drain).

    Compute, weight stashing, updates and point-to-point communication are all included; see the module
    docstring for the three schedules.

    Example::

        >>> from lightning_dynpipe.schedule import format_instructions
        >>> format_instructions(step_instructions("sync", 1, 2, 2, step=1))
        'RA2 F2 B2 SG2 RA3 F3 B3 SG3 U'

    Args:
        kind: ``"async"``, ``"sync"`` or ``"gpipe"``.
        stage_idx: the stage ``k``, ``0 <= k < num_stages``.
        num_stages: the number of stages ``S``.
        num_microbatches: micro-batches per step ``M``.
        step: the step ``t`` since the last drain; it covers micro-batches ``t*M .. t*M+M-1``.

    Returns:
        The stage's instructions for the step, in execution order.

    Raises:
        ScheduleError: unknown ``kind`` or an argument out of range.
    """
    return get_schedule(kind).step_instructions(stage_idx, num_stages, num_microbatches, step)


def drain_instructions(
    kind: ScheduleKind | Schedule, stage_idx: int, num_stages: int, num_microbatches: int, steps_done: int
) -> tuple[Instruction, ...]:
    """The instructions that finish the work still in flight on a stage after ``steps_done`` steps.

    In ``"async"`` these are the backwards (and their updates) of the micro-batches
    ``max(0, T*M - w) .. T*M - 1`` with ``T = steps_done``; the synchronous schedules flush every step,
    so their drain is empty. After a drain the stage is quiescent (no stashed versions, nothing in
    flight) and the caller restarts the step count (and so ``mb_idx``) at 0.

    Example::

        >>> from lightning_dynpipe.schedule import format_instructions
        >>> format_instructions(drain_instructions("async", 1, 3, 4, steps_done=2))
        'RG7 B7 SG7 U7'

    Args:
        kind: the schedule.
        stage_idx: the stage ``k``.
        num_stages: the number of stages ``S``.
        num_microbatches: micro-batches per step ``M``.
        steps_done: steps ``T`` run since the last drain.

    Returns:
        The stage's drain instructions, in execution order (empty when nothing is in flight).

    Raises:
        ScheduleError: unknown ``kind`` or an argument out of range.
    """
    return get_schedule(kind).drain_instructions(stage_idx, num_stages, num_microbatches, steps_done)


def iter_steps(
    kind: ScheduleKind | Schedule, stage_idx: int, num_stages: int, num_microbatches: int
) -> Iterator[tuple[Instruction, ...]]:
    """Yields :func:`step_instructions` for steps 0, 1, 2, ... without end (until the caller drains).

    Example::

        >>> from itertools import islice
        >>> [len(s) for s in islice(iter_steps("gpipe", 0, 1, 2), 3)]
        [5, 5, 5]

    Raises:
        ScheduleError: unknown ``kind`` or an argument out of range (raised on creation, not on first
            ``next``).
    """
    sched = get_schedule(kind)
    _check(sched, stage_idx, num_stages, num_microbatches)

    def _steps() -> Iterator[tuple[Instruction, ...]]:
        step = 0
        while True:
            yield sched.step_instructions(stage_idx, num_stages, num_microbatches, step)
            step += 1

    return _steps()
