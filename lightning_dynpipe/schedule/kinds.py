"""Pipeline schedules as objects: one instance per kind, each with its generators and its rules.

A :class:`Schedule` answers everything the rest of the package needs to know about a schedule: the
instructions of each stage in each step and in a drain, the staleness of each stage, the weight versions and
in-flight micro-batches it keeps (the planner's memory model), whether it accumulates the gradients of a step
into one update, how many updates precede each forward (the simulator's version rule) and how long an
iteration takes given the stage times (the planner's closed form). ``"async"``, ``"sync"`` and ``"gpipe"`` are
the names of :data:`ASYNC`, :data:`SYNC` and :data:`GPIPE`, and ``"async+d"`` that of
``AsyncSchedule(extra_in_flight=d)``, which keeps ``d`` more micro-batches in flight over every boundary;
:func:`get_schedule` resolves a name, and code outside this package calls the object's methods instead of
comparing names.

Example::

    >>> from lightning_dynpipe.schedule import format_instructions, get_schedule
    >>> sched = get_schedule("async")
    >>> [sched.staleness(k, 3) for k in range(3)], sched.accumulates
    ([2, 1, 0], False)
    >>> format_instructions(sched.step_instructions(1, 2, 2, step=0))
    'RA0 F0 B0 SG0 U0 RA1 F1'
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal, get_args

from lightning_dynpipe.errors import ScheduleError
from lightning_dynpipe.schedule.instructions import (
    Backward,
    Forward,
    Instruction,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    StashWeights,
)

__all__ = ["Schedule", "AsyncSchedule", "ScheduleKind", "SCHEDULES", "ASYNC", "SYNC", "GPIPE", "get_schedule"]

ScheduleKind = Literal["async", "sync", "gpipe"]
"""Name of a pipeline schedule."""

SCHEDULES: tuple[ScheduleKind, ...] = get_args(ScheduleKind)
"""Every schedule name, the default (``"async"``) first."""

_SYNC_UPDATE = OptimizerStep(None)


def _is_int(value: object) -> bool:
    return type(value) is int


def _check_kind(kind: object) -> None:
    if not isinstance(kind, Schedule) and kind not in SCHEDULES and _deeper_async(kind) is None:
        raise ScheduleError(
            f"Unknown schedule {kind!r}. Valid schedules: {', '.join(repr(s) for s in SCHEDULES)} "
            "('async' = PipeDream 1F1B without flush, 'sync' = 1F1B with a flush every step, "
            "'gpipe' = all forwards then all backwards), or 'async+d' for async with d more micro-batches in "
            "flight per boundary (e.g. 'async+1')."
        )


def _check_stage(kind: object, stage_idx: object, num_stages: object) -> None:
    _check_kind(kind)
    if not _is_int(num_stages) or num_stages < 1:  # type: ignore[operator]
        raise ScheduleError(
            f"num_stages must be a positive int; got num_stages={num_stages!r}. Pass the number of pipeline "
            "stages, e.g. num_stages=2."
        )
    if not _is_int(stage_idx) or not 0 <= stage_idx < num_stages:  # type: ignore[operator]
        raise ScheduleError(
            f"stage_idx must be an int in [0, num_stages) = [0, {num_stages}); got stage_idx={stage_idx!r}. "
            "Stages are numbered from 0 (the first layers) to num_stages - 1 (the loss)."
        )


def _check(kind: object, stage_idx: object, num_stages: object, num_microbatches: object) -> None:
    _check_stage(kind, stage_idx, num_stages)
    if not _is_int(num_microbatches) or num_microbatches < 1:  # type: ignore[operator]
        raise ScheduleError(
            f"num_microbatches must be a positive int; got num_microbatches={num_microbatches!r}. Pass how "
            "many micro-batches each Lightning batch is split into, e.g. num_microbatches=4."
        )


def _check_count(name: str, value: object) -> None:
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise ScheduleError(
            f"{name} must be a non-negative int (steps are counted 0, 1, 2, ... since the last drain); "
            f"got {name}={value!r}."
        )


# Instructions are immutable, so schedules share them: the instructions around one micro-batch's forward
# (or backward) are built once as a block, and regenerating a step (every Lightning step, and thousands of
# times in validation) costs a dict lookup per block. Bounded because mb_idx grows between drains.
_BLOCK_LIMIT = 8192
_BLOCKS: dict[int, tuple[Instruction, ...]] = {}


def _store(key: int, block: tuple[Instruction, ...]) -> tuple[Instruction, ...]:
    if len(_BLOCKS) >= _BLOCK_LIMIT:
        _BLOCKS.clear()
    _BLOCKS[key] = block
    return block


def _forward_block(j: int, first: bool, last: bool, stash: bool) -> tuple[Instruction, ...]:
    """``[RA j] [W j] F j [SA j]``."""
    key = j << 4 | first | last << 1 | stash << 2
    block = _BLOCKS.get(key)
    if block is None:
        out: list[Instruction] = []
        if not first:
            out.append(RecvActivation(j))
        if stash:
            out.append(StashWeights(j))
        out.append(Forward(j))
        if not last:
            out.append(SendActivation(j))
        block = _store(key, tuple(out))
    return block


def _backward_block(j: int, first: bool, last: bool, update: bool) -> tuple[Instruction, ...]:
    """``[RG j] B j [SG j] [U j]``."""
    key = j << 4 | first | last << 1 | update << 2 | 8
    block = _BLOCKS.get(key)
    if block is None:
        out: list[Instruction] = []
        if not last:
            out.append(RecvGrad(j))
        out.append(Backward(j))
        if not first:
            out.append(SendGrad(j))
        if update:
            out.append(OptimizerStep(j))
        block = _store(key, tuple(out))
    return block


class Schedule(ABC):
    """One pipeline schedule: its per-stage programs and the rules the planner and the simulator use.

    Subclass it to add a schedule; the executor, the planner and the simulator take any instance. Stage
    arguments are checked (:class:`~lightning_dynpipe.errors.ScheduleError` names the valid range).
    """

    name: str
    """The schedule's name (``str(schedule)``)."""
    accumulates: bool
    """Whether the gradients of a step's ``M`` micro-batches are accumulated into one update (a flush every
    step), rather than applied after every micro-batch."""
    description: str
    """One line for messages and docs."""

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"get_schedule({self.name!r})"

    # ------------------------------------------------------------------ programs
    def step_instructions(
        self, stage_idx: int, num_stages: int, num_microbatches: int, step: int
    ) -> tuple[Instruction, ...]:
        """The instructions stage ``stage_idx`` runs in step ``step`` (counted since the last drain)."""
        _check(self, stage_idx, num_stages, num_microbatches)
        _check_count("step", step)
        return self._step(stage_idx, num_stages, num_microbatches, step)

    def drain_instructions(
        self, stage_idx: int, num_stages: int, num_microbatches: int, steps_done: int
    ) -> tuple[Instruction, ...]:
        """The instructions that finish the work still in flight on a stage after ``steps_done`` steps."""
        pending = self.in_flight_after(stage_idx, num_stages, num_microbatches, steps_done)
        first = stage_idx == 0
        last = stage_idx == num_stages - 1
        end = steps_done * num_microbatches
        out: list[Instruction] = []
        for j in range(end - pending, end):
            out.extend(_backward_block(j, first, last, True))
        return tuple(out)

    def in_flight_after(self, stage_idx: int, num_stages: int, num_microbatches: int, steps_done: int) -> int:
        """Micro-batches forwarded but not yet backwarded on a stage after ``steps_done`` steps."""
        _check(self, stage_idx, num_stages, num_microbatches)
        _check_count("steps_done", steps_done)
        return self._carried(stage_idx, num_stages, num_microbatches, steps_done)

    # ------------------------------------------------------------------ rules
    def staleness(self, stage_idx: int, num_stages: int) -> int:
        """Updates between a micro-batch's forward and its own update on stage ``stage_idx``, in steady state."""
        _check_stage(self, stage_idx, num_stages)
        return self._staleness(stage_idx, num_stages)

    def max_stash(self, stage_idx: int, num_stages: int) -> int:
        """Most weight versions stage ``stage_idx`` keeps stashed: ``S - k`` with staleness ``> 0``, else 0."""
        w = self.staleness(stage_idx, num_stages)
        return w + 1 if w > 0 else 0

    def weight_versions(self, stage_idx: int, num_stages: int) -> int:
        """Copies of the stage's weights held at most, the live weights included (at least 1)."""
        return max(1, self.max_stash(stage_idx, num_stages))

    @abstractmethod
    def in_flight(self, stage_idx: int, num_stages: int, num_microbatches: int) -> int:
        """Micro-batches whose activations the stage holds at once, in steady state."""

    def updates_per_step(self, num_microbatches: int) -> int:
        """Optimizer updates per step: 1 when the schedule accumulates, else ``M``."""
        return 1 if self.accumulates else num_microbatches

    def microbatches_per_update(self, num_microbatches: int) -> int:
        """Micro-batches whose gradients one update applies: ``M`` when the schedule accumulates, else 1."""
        return num_microbatches if self.accumulates else 1

    @abstractmethod
    def updates_before_forward(self, mb_idx: int, stage_idx: int, num_stages: int, num_microbatches: int) -> int:
        """Updates the stage has applied when it forwards micro-batch ``mb_idx`` (counted since the last drain).

        The simulator checks every schedule against this rule; with weight stashing, the backward of the
        micro-batch uses the same version.
        """

    def forward_rule_broken(self, mb_idx: int, stage_idx: int, num_stages: int, num_microbatches: int, ran: int) -> str:
        """The simulator's message when a stage forwards ``mb_idx`` after ``ran`` updates, against the rule."""
        expected = self.updates_before_forward(mb_idx, stage_idx, num_stages, num_microbatches)
        return (
            f"{self.name} rule broken: stage {stage_idx} must forward micro-batch {mb_idx} after exactly {expected} "
            f"updates, but it has run {ran}."
        )

    @abstractmethod
    def iteration_time(self, stage_times: Sequence[float], num_microbatches: int) -> float:
        """The planner's closed form: seconds per micro-batch given each stage's time per micro-batch."""

    def round_trip_time(self, compute: Sequence[float], update: Sequence[float], messages: Sequence[float]) -> float:
        """Seconds per micro-batch that the round trips of micro-batches through several stages impose.

        :meth:`iteration_time` prices each stage alone; a schedule that bounds the micro-batches in flight is
        also bound by how long one of them takes to go through a run of stages and back, messages included,
        which a slow link makes the binding limit. The base class models none (0.0), which the flush schedules
        keep: their closed form counts one pass through every stage per step, but with each message only as the
        stage's cost charges it, so under a slow link it is optimistic for them (the event simulator is not).

        Args:
            compute: each stage's forward and backward time per micro-batch.
            update: each stage's optimizer update time per micro-batch (amortised over an update's micro-batches).
            messages: each boundary's time per message (activation or gradient), the part the stages do not
                spend computing included.
        """
        return 0.0

    # ------------------------------------------------------------------ the kind's own program
    @abstractmethod
    def _step(self, stage_idx: int, num_stages: int, num_microbatches: int, step: int) -> tuple[Instruction, ...]:
        """The step program, arguments already checked."""

    def _staleness(self, stage_idx: int, num_stages: int) -> int:
        return 0

    def _carried(self, stage_idx: int, num_stages: int, num_microbatches: int, steps_done: int) -> int:
        return 0


class _FlushSchedule(Schedule):
    """A schedule that flushes every step: one update per step, the gradients of its ``M`` micro-batches
    accumulated, no staleness."""

    accumulates = True

    def updates_before_forward(self, mb_idx: int, stage_idx: int, num_stages: int, num_microbatches: int) -> int:
        return mb_idx // num_microbatches

    def forward_rule_broken(self, mb_idx: int, stage_idx: int, num_stages: int, num_microbatches: int, ran: int) -> str:
        M = num_microbatches
        return (
            f"{self.name} rule broken: stage {stage_idx} must forward micro-batch {mb_idx} after exactly "
            f"{mb_idx} // {M} = {mb_idx // M} updates (one per step), but it has run {ran}."
        )

    def iteration_time(self, stage_times: Sequence[float], num_microbatches: int) -> float:
        # M micro-batches through S stages with a flush: (M - 1) bottleneck slots plus one pass through all.
        M = num_microbatches
        return ((M - 1) * max(stage_times) + math.fsum(stage_times)) / M


class AsyncSchedule(Schedule):
    """PipeDream 1F1B without a flush: an update after every backward, weight stashing, staleness ``S-1-k``.

    Where a step ends on each stage does not change what it computes (every stage runs one endless
    sequence), but it decides what the per-step synchronisation costs: the training loop broadcasts from
    the last stage at every step, so no other stage starts step ``t + 1`` before the last stage has ended
    step ``t``. The last stage of a multi-stage pipeline therefore ends its step right after its last
    forward (the loss of every micro-batch of the step is known then) and opens the next step with that
    micro-batch's backward and update; with two stages this puts both stages' step ends at the same point
    of the 1F1B timeline, and the broadcast costs no idle time (one forward per step otherwise).

    ``extra_in_flight=d`` keeps ``d`` more micro-batches in flight over every boundary: stage ``k`` runs
    ``w = (S-1-k) (1+d)`` forwards ahead of its backwards, so its staleness is ``w``, it stashes up to ``w + 1``
    weight versions and holds the activations of ``w + 1`` micro-batches. A round trip through stages ``a..b``
    then carries ``(b-a)(1+d) + 1`` micro-batches instead of ``b-a+1``, which hides a slow link's latency
    (:meth:`round_trip_time`) at the price of staleness (the convergence model charges it). The semantics stay
    PipeDream's with the deeper staleness: every backward uses its forward's weights, and
    :func:`~lightning_dynpipe.calibration.replay_async` with ``staleness=[w_0, ..., 0]`` is the exact reference.

    Example::

        >>> deep = AsyncSchedule(extra_in_flight=1)
        >>> deep, [deep.staleness(k, 3) for k in range(3)], [deep.in_flight(k, 3, 8) for k in range(3)]
        (get_schedule('async+1'), [4, 2, 0], [5, 3, 1])
    """

    accumulates = False

    def __init__(self, extra_in_flight: int = 0) -> None:
        if not _is_int(extra_in_flight) or extra_in_flight < 0:
            raise ScheduleError(
                f"extra_in_flight must be a non-negative int (micro-batches kept in flight over each boundary "
                f"beyond PipeDream's one); got extra_in_flight={extra_in_flight!r}. Use 0 for PipeDream's 1F1B, "
                "1 or 2 to hide a slow link."
            )
        self.extra_in_flight = extra_in_flight
        self.name = "async" if extra_in_flight == 0 else f"async+{extra_in_flight}"
        self.description = (
            "PipeDream 1F1B without flush"
            if extra_in_flight == 0
            else f"PipeDream 1F1B without flush, {extra_in_flight} more micro-batch(es) in flight per boundary"
        )

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.extra_in_flight == self.extra_in_flight

    def __hash__(self) -> int:
        return hash((type(self), self.extra_in_flight))

    def _depth(self, stage_idx: int, num_stages: int) -> int:
        """``w``: the stage's forwards ahead of its backwards, and its staleness."""
        return (num_stages - 1 - stage_idx) * (1 + self.extra_in_flight)

    def _step(self, stage_idx: int, num_stages: int, num_microbatches: int, step: int) -> tuple[Instruction, ...]:
        first = stage_idx == 0
        last = stage_idx == num_stages - 1
        w = self._depth(stage_idx, num_stages)
        begin = step * num_microbatches
        end = begin + num_microbatches
        out: list[Instruction] = []
        if last and num_stages > 1:
            # The same sequence F0 B0 F1 B1 ..., cut after a forward: the step's last backward opens the next
            # step. See the class docstring.
            if begin > 0:
                out.extend(_backward_block(begin - 1, first, last, True))
            for j in range(begin, end):
                out.extend(_forward_block(j, first, last, False))
                if j < end - 1:
                    out.extend(_backward_block(j, first, last, True))
            return tuple(out)
        stash = w > 0
        for j in range(begin, end):
            out.extend(_forward_block(j, first, last, stash))
            if j >= w:
                out.extend(_backward_block(j - w, first, last, True))
        return tuple(out)

    def _staleness(self, stage_idx: int, num_stages: int) -> int:
        return self._depth(stage_idx, num_stages)

    def _carried(self, stage_idx: int, num_stages: int, num_microbatches: int, steps_done: int) -> int:
        if num_stages > 1 and stage_idx == num_stages - 1:
            return min(1, steps_done * num_microbatches)
        return min(self._depth(stage_idx, num_stages), steps_done * num_microbatches)

    def in_flight(self, stage_idx: int, num_stages: int, num_microbatches: int) -> int:
        _check_stage(self, stage_idx, num_stages)
        return self._depth(stage_idx, num_stages) + 1

    def updates_before_forward(self, mb_idx: int, stage_idx: int, num_stages: int, num_microbatches: int) -> int:
        return max(0, mb_idx - self._depth(stage_idx, num_stages))

    def forward_rule_broken(self, mb_idx: int, stage_idx: int, num_stages: int, num_microbatches: int, ran: int) -> str:
        w = self._depth(stage_idx, num_stages)
        expected = self.updates_before_forward(mb_idx, stage_idx, num_stages, num_microbatches)
        return (
            f"{self.name} staleness rule broken: stage {stage_idx} (staleness w={w}) must forward micro-batch "
            f"{mb_idx} after exactly max(0, {mb_idx} - {w}) = {expected} updates, but it has run {ran}. Each stage "
            "must run F(j) then B(j-w) U(j-w), 1F1B without flush."
        )

    def iteration_time(self, stage_times: Sequence[float], num_microbatches: int) -> float:
        return max(stage_times)  # steady state: the bottleneck stage sets the pace

    def round_trip_time(self, compute: Sequence[float], update: Sequence[float], messages: Sequence[float]) -> float:
        """The slowest round trip over every run of two or more stages ``a..b``, per micro-batch.

        Stage ``k`` forwards a micro-batch ``w_k + 1`` micro-batches after the one whose backward it has just
        finished (``w_k = (S-1-k)(1+d)``), so a cycle of dependencies goes forward from stage ``a`` to ``b``, back
        to ``a``, through its update and on to its next forward, with ``w_a - w_b + 1 = (b-a)(1+d) + 1``
        micro-batches on it::

            (sum(compute[a..b]) + update[a] + 2 * sum(messages[a..b-1])) / ((b - a)(1 + d) + 1)

        (the gradient is sent before the update, so only stage ``a``'s is on the cycle). With the single stages'
        own times (:meth:`iteration_time`), this is the steady-state time of the event simulator's 1F1B for two
        stages, and within a few percent of it for deeper pipelines with ``M >= 4`` (the per-step broadcast adds
        more there, and more with ``d > 0``: the last stage ends each step after its last forward, which the
        first stage then waits for).

        Example::

            >>> get_schedule("async").round_trip_time([4.0, 21.0], [0.0, 0.0], [21.0])  # (4 + 21 + 2 * 21) / 2
            33.5
            >>> get_schedule("async+1").round_trip_time([4.0, 21.0], [0.0, 0.0], [21.0])  # the same over 3
            22.333333333333332
        """
        S = len(compute)
        if len(update) != S or len(messages) != S - 1:
            raise ScheduleError(
                f"round_trip_time needs one compute and update time per stage and one message time per boundary; "
                f"got {len(compute)} stages, {len(update)} update times and {len(messages)} message times."
            )
        worst = 0.0
        for a in range(S - 1):
            total = compute[a] + update[a]
            for b in range(a + 1, S):
                total += compute[b] + 2.0 * messages[b - 1]
                worst = max(worst, total / ((b - a) * (1 + self.extra_in_flight) + 1))
        return worst


class SyncSchedule(_FlushSchedule):
    """1F1B with a flush every step: ``min(w, M)`` warm-up forwards, alternating forwards and backwards, the
    remaining backwards, one update."""

    name = "sync"
    description = "1F1B with a flush every step"

    def _step(self, stage_idx: int, num_stages: int, num_microbatches: int, step: int) -> tuple[Instruction, ...]:
        first = stage_idx == 0
        last = stage_idx == num_stages - 1
        w = num_stages - 1 - stage_idx
        begin = step * num_microbatches
        end = begin + num_microbatches
        out: list[Instruction] = []
        warmup = min(w, num_microbatches)
        for j in range(begin, begin + warmup):
            out.extend(_forward_block(j, first, last, False))
        for j in range(begin + warmup, end):
            out.extend(_forward_block(j, first, last, False))
            out.extend(_backward_block(j - warmup, first, last, False))
        for j in range(end - warmup, end):
            out.extend(_backward_block(j, first, last, False))
        out.append(_SYNC_UPDATE)
        return tuple(out)

    def in_flight(self, stage_idx: int, num_stages: int, num_microbatches: int) -> int:
        _check(self, stage_idx, num_stages, num_microbatches)
        return min(num_stages - stage_idx, num_microbatches)


class GPipeSchedule(_FlushSchedule):
    """All ``M`` forwards, then all ``M`` backwards (ascending), then one update."""

    name = "gpipe"
    description = "all forwards then all backwards"

    def _step(self, stage_idx: int, num_stages: int, num_microbatches: int, step: int) -> tuple[Instruction, ...]:
        first = stage_idx == 0
        last = stage_idx == num_stages - 1
        begin = step * num_microbatches
        end = begin + num_microbatches
        out: list[Instruction] = []
        for j in range(begin, end):
            out.extend(_forward_block(j, first, last, False))
        for j in range(begin, end):
            out.extend(_backward_block(j, first, last, False))
        out.append(_SYNC_UPDATE)
        return tuple(out)

    def in_flight(self, stage_idx: int, num_stages: int, num_microbatches: int) -> int:
        _check(self, stage_idx, num_stages, num_microbatches)
        return num_microbatches


ASYNC: Schedule = AsyncSchedule()
"""``"async"``: PipeDream 1F1B without flush (the default)."""
SYNC: Schedule = SyncSchedule()
"""``"sync"``: 1F1B with a flush every step."""
GPIPE: Schedule = GPipeSchedule()
"""``"gpipe"``: all forwards, then all backwards, every step."""

_BY_NAME: dict[str, Schedule] = {s.name: s for s in (ASYNC, SYNC, GPIPE)}


def get_schedule(schedule: Schedule | str) -> Schedule:
    """The schedule object for a name (``"async"``, ``"sync"``, ``"gpipe"``), or the object itself.

    Raises:
        ScheduleError: an unknown name, with the valid ones.
    """
    if isinstance(schedule, Schedule):
        return schedule
    deeper = _deeper_async(schedule)
    if deeper is not None:
        return deeper
    _check_kind(schedule)
    return _BY_NAME[schedule]


def _deeper_async(name: object) -> Schedule | None:
    """``"async+d"`` (``d`` a positive int): :class:`AsyncSchedule` with ``extra_in_flight=d``; else None."""
    if isinstance(name, str) and name.startswith("async+") and name[6:].isdigit() and int(name[6:]) > 0:
        return AsyncSchedule(int(name[6:]))
    return None
