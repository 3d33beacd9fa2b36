"""Dry run of every stage of a pipeline: deadlocks, bubbles, step times and a Chrome trace, without torch.

The simulator executes each stage's instruction list strictly in order, as the executor would:

* ``F``, ``B`` and ``U`` take ``forward_time``, ``backward_time`` and ``update_time`` (per stage, times
  the stage's ``slowdown``) and count as busy time; ``W`` takes no time;
* a send keeps its stage busy for ``send_overhead`` (the sender's own work: headers, copying into the
  transport; 0 by default) and is otherwise non-blocking (buffered): data whose send ends at time ``t``
  over boundary ``b`` (between stages ``b`` and ``b + 1``) arrives at ``t + comm_time[b]``. Transfers over
  one link do not queue behind each other;
* ``step_overhead`` is host work at the start of every step outside the schedule (the training loop, hooks,
  ``training_step`` bookkeeping, fetching the batch; 0 by default); it runs after the step gate below and
  counts as busy time (event ``H<step>``);
* a receive blocks until its data has arrived; the wait is recorded as the receive's event;
* ``step_sync="last_stage_broadcast"`` models a wait for global rank 0, which hosts the *last* stage, at every
  training step (a blocking broadcast from it, or a callback that reads the mirrored metrics on every rank at
  every batch's end; the strategy itself has none): no other stage can begin step ``t > 0`` before the last
  stage has finished step ``t - 1``. The last stage never waits for it, and the drain is not gated.

Besides timing, a run checks the schedule: every receive is matched by exactly one send of the same
micro-batch on the neighbouring stage, no stage waits forever (:class:`ScheduleDeadlockError` names each
stage's blocked instruction), a backward follows its forward, stage ``k`` never keeps more than ``S - k``
stashed weight versions (the schedule's ``max_stash`` when it keeps more micro-batches in flight), and every
forward of micro-batch ``i`` on stage ``k`` runs after exactly ``max(0, i - (S - 1 - k))`` updates (``"async"``;
``max(0, i - (S - 1 - k)(1 + d))`` for ``"async+d"``) or ``i // M`` updates (``"sync"``, ``"gpipe"``).

The loop is event driven: a stage runs until it blocks on a receive, and a send wakes exactly the stage
waiting for it, so a run costs time linear in the number of instructions.

Example::

    >>> r = simulate("sync", num_stages=2, num_microbatches=4, num_steps=3, forward_time=1.0, backward_time=2.0)
    >>> r.steady_state_step_time
    15.0
    >>> simulate("async", 2, 4, 3, step_sync="last_stage_broadcast").steady_state_step_time
    12.0
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

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
from lightning_dynpipe.schedule.kinds import Schedule, ScheduleKind, get_schedule
from lightning_dynpipe.schedule.kinds import _check as _check_args

__all__ = [
    "StepSync",
    "STEP_SYNCS",
    "ScheduleDeadlockError",
    "SimEvent",
    "SimResult",
    "simulate",
    "simulate_programs",
    "validate_schedule",
]

StepSync = Literal["none", "last_stage_broadcast"]
"""How steps are coupled across stages besides point-to-point data (see the module docstring)."""

STEP_SYNCS: tuple[StepSync, ...] = get_args(StepSync)

Times = float | Sequence[float]
"""One value for every stage (or boundary), or one value per stage (or per boundary)."""


class ScheduleDeadlockError(ScheduleError):
    """The stages' instruction lists wait for each other in a cycle: no stage can progress."""


class SimEvent(NamedTuple):
    """One executed instruction: its string form and when it started and ended (receives: the wait)."""

    instruction: str
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """Timeline and summary of a simulated run of all stages.

    Example::

        >>> r = simulate("gpipe", num_stages=2, num_microbatches=4, num_steps=2)
        >>> r.makespan, r.step_end_times[1]
        (30.0, (13.0, 28.0))
        >>> [round(b, 3) for b in r.bubble_fraction]
        [0.2, 0.2]

    Attributes:
        kind: the schedule simulated, or ``None`` for hand-written programs.
        num_stages: ``S``.
        num_microbatches: micro-batches per step ``M`` (for hand-written programs: the forwards in the last
            stage's first step).
        num_steps: steps simulated (the drain, if any, is not a step).
        events: per stage, every executed instruction in order.
        makespan: end of the last event of any stage.
        step_end_times: per stage, when the stage finished each step.
        finish_times: per stage, when it finished its last instruction (drain included).
        busy_times: per stage, total compute time (``F``, ``B``, ``U``).
        stash_peaks: per stage, the most weight versions it held stashed at once.
    """

    kind: ScheduleKind | None
    num_stages: int
    num_microbatches: int
    num_steps: int
    events: tuple[tuple[SimEvent, ...], ...]
    makespan: float
    step_end_times: tuple[tuple[float, ...], ...]
    finish_times: tuple[float, ...]
    busy_times: tuple[float, ...]
    stash_peaks: tuple[int, ...]

    @property
    def bubble_fraction(self) -> tuple[float, ...]:
        """Per stage, the idle share of the makespan, ``1 - busy / makespan`` (0 when the makespan is 0)."""
        if self.makespan <= 0:
            return tuple(0.0 for _ in self.busy_times)
        return tuple(1.0 - busy / self.makespan for busy in self.busy_times)

    @property
    def utilisation(self) -> float:
        """Busy share of all stages' time together, ``sum(busy) / (S * makespan)`` (1 when makespan is 0)."""
        if self.makespan <= 0:
            return 1.0
        return sum(self.busy_times) / (self.num_stages * self.makespan)

    @property
    def steady_state_step_time(self) -> float:
        """Median step duration of the last stage over the steps after the first.

        The first step includes the pipeline's fill, so it is left out; with a single step, that step's
        duration is returned.
        """
        ends = self.step_end_times[-1]
        if len(ends) < 2:
            return ends[0] if ends else 0.0
        return float(statistics.median(b - a for a, b in zip(ends, ends[1:])))

    def throughput(self, microbatch_size: int = 1) -> float:
        """Samples per time unit in steady state: ``M * microbatch_size / steady_state_step_time``."""
        step_time = self.steady_state_step_time
        if step_time <= 0:
            return float("inf")
        return self.num_microbatches * microbatch_size / step_time

    def to_chrome_trace(self, us_per_unit: float = 1000.0) -> dict[str, Any]:
        """The timeline as Chrome trace JSON (open in ``chrome://tracing`` or https://ui.perfetto.dev).

        One process (pid 0) with one thread per stage (``tid`` = ``stage_idx``); every instruction is a
        complete (``"ph": "X"``) event with category ``compute`` (F, B, U), ``stash`` (W) or ``comm``
        (sends, and receives whose duration is the wait).

        Args:
            us_per_unit: microseconds per simulated time unit (default: a unit is a millisecond).
        """
        name = f"{self.kind} pipeline" if self.kind is not None else "pipeline"
        trace: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": name}}]
        for stage_idx in range(self.num_stages):
            trace.append(
                {"name": "thread_name", "ph": "M", "pid": 0, "tid": stage_idx, "args": {"name": f"stage {stage_idx}"}}
            )
        for stage_idx, stage_events in enumerate(self.events):
            for ev in stage_events:
                code = ev.instruction.rstrip("0123456789")
                mb = ev.instruction[len(code) :]
                trace.append(
                    {
                        "name": ev.instruction,
                        "cat": _CATEGORY[code],
                        "ph": "X",
                        "ts": ev.start * us_per_unit,
                        "dur": (ev.end - ev.start) * us_per_unit,
                        "pid": 0,
                        "tid": stage_idx,
                        "args": {"mb_idx": int(mb) if mb else None},
                    }
                )
        return {
            "traceEvents": trace,
            "displayTimeUnit": "ms",
            "otherData": {
                "kind": self.kind,
                "num_stages": self.num_stages,
                "num_microbatches": self.num_microbatches,
                "num_steps": self.num_steps,
                "makespan": self.makespan,
            },
        }

    def write_chrome_trace(self, path: str | os.PathLike[str], us_per_unit: float = 1000.0) -> None:
        """Writes :meth:`to_chrome_trace` to ``path`` as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome_trace(us_per_unit), f)


_CATEGORY = {"H": "host", "F": "compute", "B": "compute", "U": "compute", "W": "stash", "RA": "comm", "SA": "comm"}
_CATEGORY.update(RG="comm", SG="comm")


class _StepEnd:
    """Marker the simulator appends after each step of a stage's program."""

    __slots__ = ("step",)

    def __init__(self, step: int) -> None:
        self.step = step


class _Host:
    """Marker at the start of step ``step`` of a stage: ``step_overhead`` of host work outside the schedule."""

    __slots__ = ("step",)

    def __init__(self, step: int) -> None:
        self.step = step

    def __str__(self) -> str:
        return f"H{self.step}"


class _Gate:
    """Marker before step ``step + 1`` of a stage: wait until the last stage has finished ``step``."""

    __slots__ = ("step",)

    def __init__(self, step: int) -> None:
        self.step = step


_Op = Instruction | _StepEnd | _Gate | _Host


def _check_times(name: str, value: Times, count: int, what: str, positive: bool = False) -> list[float]:
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, (int, float)):
        values = [float(value)] * count
    else:
        values = [float(v) for v in value]
        if len(values) != count:
            raise ScheduleError(
                f"{name} must be one number or one per {what} ({count}); got {len(values)} values "
                f"{list(value)}. Pass a single float or a sequence of length {count}."
            )
    bad = [v for v in values if not (v > 0 if positive else v >= 0) or v == float("inf")]
    if bad:
        raise ScheduleError(f"{name} must be finite and {bound}; got {value!r}. Fix the offending values {bad}.")
    return values


def _check_steps(num_steps: object) -> None:
    if type(num_steps) is not int or num_steps < 1:
        raise ScheduleError(f"num_steps must be a positive int; got num_steps={num_steps!r}. Pass e.g. num_steps=3.")


def _check_step_sync(step_sync: object) -> None:
    if step_sync not in STEP_SYNCS:
        raise ScheduleError(
            f"Unknown step_sync {step_sync!r}. Valid options: {', '.join(repr(s) for s in STEP_SYNCS)}."
        )


def _transfers(program: Sequence[_Op], cls: type[Instruction]) -> list[int]:
    return [op.mb_idx for op in program if isinstance(op, cls) and op.mb_idx is not None]


def _check_matching(flat: Sequence[Sequence[_Op]]) -> None:
    """Raises if some receive lacks exactly one matching send on the neighbouring stage, or vice versa."""
    S = len(flat)
    for k in range(S):
        for recv_cls, send_cls, peer, what in (
            (RecvActivation, SendActivation, k - 1, "activation"),
            (RecvGrad, SendGrad, k + 1, "gradient"),
        ):
            recv = _transfers(flat[k], recv_cls)
            sent = _transfers(flat[peer], send_cls) if 0 <= peer < S else []
            recv_code, send_code = recv_cls.code, send_cls.code
            dup_recv = sorted({j for j in recv if recv.count(j) > 1})
            dup_sent = sorted({j for j in sent if sent.count(j) > 1})
            missing = sorted(set(recv) - set(sent))
            extra = sorted(set(sent) - set(recv))
            if not (dup_recv or dup_sent or missing or extra):
                continue
            if not 0 <= peer < S:
                raise ScheduleError(
                    f"Stage {k} of {S} has no {'previous' if peer < 0 else 'next'} stage, but it runs "
                    f"{recv_code} for micro-batches {missing[:8]}. Remove these {recv_code} instructions."
                )
            parts = []
            if missing:
                parts.append(
                    f"stage {k} receives ({recv_code}) micro-batches {missing[:8]} that stage {peer} never sends"
                )
            if extra:
                parts.append(
                    f"stage {peer} sends ({send_code}) micro-batches {extra[:8]} that stage {k} never receives"
                )
            if dup_recv:
                parts.append(f"stage {k} receives ({recv_code}) micro-batches {dup_recv[:8]} more than once")
            if dup_sent:
                parts.append(f"stage {peer} sends ({send_code}) micro-batches {dup_sent[:8]} more than once")
            raise ScheduleError(
                f"Unmatched {what} transfer: every {recv_code} j on a stage needs exactly one {send_code} j on its "
                f"peer stage; {'; '.join(parts)}. Add the missing instructions or remove the extra ones."
            )
    for k, target in ((S - 1, "next"), (0, "previous")):
        cls = SendActivation if target == "next" else SendGrad
        stray = _transfers(flat[k], cls)
        if stray:
            raise ScheduleError(
                f"Stage {k} of {S} has no {target} stage, but it runs {cls.code} for micro-batches {stray[:8]}. "
                f"Remove these {cls.code} instructions."
            )


def _run(
    programs: Sequence[Sequence[Sequence[Instruction]]],
    drains: Sequence[Sequence[Instruction]],
    *,
    kind: Schedule | None,
    num_microbatches: int,
    forward: Sequence[float],
    backward: Sequence[float],
    update: Sequence[float],
    comm: Sequence[float],
    gate: bool,
    host: Sequence[float] = (),
    send: Sequence[float] = (),
    record: bool,
    expect_in_flight: Sequence[int] | None,
) -> SimResult:
    S = len(programs)
    num_steps = len(programs[0])
    last = S - 1
    host = list(host) or [0.0] * S
    send = list(send) or [0.0] * S

    # One flat list per stage: the steps with markers between them, then the drain.
    flat: list[list[_Op]] = []
    for k in range(S):
        steps = programs[k]
        if len(steps) != num_steps:
            raise ScheduleError(
                f"Every stage must run the same number of steps; stage 0 has {num_steps} and stage {k} has "
                f"{len(steps)}. Give each stage one instruction list per step."
            )
        program: list[_Op] = []
        for t, body in enumerate(steps):
            if gate and t > 0 and k != last:
                program.append(_Gate(t - 1))
            if host[k] > 0.0:
                program.append(_Host(t))
            program.extend(body)
            program.append(_StepEnd(t))
        program.extend(drains[k])
        flat.append(program)

    # Arrival times of data at each stage, keyed by mb_idx. Index S is a sink for sends that have no
    # receiver (SA on the last stage, SG on stage 0 through index -1); the matching check reports them.
    act_at: list[dict[int, float]] = [{} for _ in range(S + 1)]
    grad_at: list[dict[int, float]] = [{} for _ in range(S + 1)]
    wait_act = [-1] * (S + 1)  # mb_idx the stage is blocked on, -1 when not blocked on an activation
    wait_grad = [-1] * (S + 1)
    act_delay = list(comm) + [0.0, 0.0]  # SA of stage k travels over boundary k
    grad_delay = [0.0] + list(comm) + [0.0]  # SG of stage k travels over boundary k - 1
    last_step_end: dict[int, float] = {}
    gate_waiters: dict[int, list[int]] = {}

    sched = kind
    M = max(num_microbatches, 1)
    clock = [0.0] * S
    ptr = [0] * S
    busy = [0.0] * S
    updates = [0] * S
    peaks = [0] * S
    step_ends: list[list[float]] = [[] for _ in range(S)]
    events: list[list[tuple[Instruction, float, float]]] = [[] for _ in range(S)]
    in_flight: list[set[int]] = [set() for _ in range(S)]  # forwarded, not yet backwarded
    stashes: list[dict[int, int]] = [{} for _ in range(S)]  # mb_idx -> weight version it is bound to
    version_refs: list[dict[int, int]] = [{} for _ in range(S)]  # version -> micro-batches bound to it
    # PipeDream's bound S - k, or the schedule's own when it keeps more micro-batches in flight
    stash_bound = [max(S - k, sched.max_stash(k, S)) if sched is not None else S - k for k in range(S)]

    H_ = _Host
    F_, B_, RA_, SA_, RG_, SG_, U_, W_ = (
        Forward,
        Backward,
        RecvActivation,
        SendActivation,
        RecvGrad,
        SendGrad,
        OptimizerStep,
        StashWeights,
    )
    ready = list(range(S))
    while ready:
        k = ready.pop()
        program = flat[k]
        n = len(program)
        c = clock[k]
        fcost, bcost, ucost, scost = forward[k], backward[k], update[k], send[k]
        my_act, my_grad = act_at[k], grad_at[k]
        next_act, prev_grad = act_at[k + 1], grad_at[k - 1]
        sa_delay, sg_delay = act_delay[k], grad_delay[k]
        fwd = in_flight[k]
        stash = stashes[k]
        versions = version_refs[k]
        ev = events[k]
        n_updates = updates[k]
        stage_busy = busy[k]
        for i in range(ptr[k], n):
            # Any: dispatch is on the exact type below, which mypy cannot narrow from type(inst).
            inst: Any = program[i]
            cls = type(inst)
            if cls is F_:
                mb = inst.mb_idx
                if mb in fwd:
                    raise ScheduleError(
                        f"Stage {k} forwards micro-batch {mb} twice before its backward (instruction #{i}). "
                        "Each micro-batch is forwarded once between drains."
                    )
                fwd.add(mb)
                if sched is not None:
                    expected = sched.updates_before_forward(mb, k, S, M)
                    if n_updates != expected:
                        raise ScheduleError(sched.forward_rule_broken(mb, k, S, M, n_updates))
                e = c + fcost
                stage_busy += fcost
                if record:
                    ev.append((inst, c, e))
                c = e
            elif cls is B_:
                mb = inst.mb_idx
                if mb not in fwd:
                    raise ScheduleError(
                        f"Stage {k} backwards micro-batch {mb} (instruction #{i}) without a pending forward of "
                        "it. Put F j before B j, and each B j once."
                    )
                fwd.remove(mb)
                if stash:
                    v = stash.pop(mb, -1)
                    if v >= 0:
                        left = versions[v] - 1
                        if left:
                            versions[v] = left
                        else:
                            del versions[v]
                e = c + bcost
                stage_busy += bcost
                if record:
                    ev.append((inst, c, e))
                c = e
            elif cls is RA_:
                mb = inst.mb_idx
                arrival = my_act.pop(mb, None)
                if arrival is None:
                    wait_act[k] = mb
                    break
                e = arrival if arrival > c else c
                if record:
                    ev.append((inst, c, e))
                c = e
            elif cls is SA_:
                mb = inst.mb_idx
                if mb in next_act:
                    _check_matching(flat)
                e = c + scost
                stage_busy += scost
                next_act[mb] = e + sa_delay
                if wait_act[k + 1] == mb:
                    wait_act[k + 1] = -1
                    ready.append(k + 1)
                if record:
                    ev.append((inst, c, e))
                c = e
            elif cls is RG_:
                mb = inst.mb_idx
                arrival = my_grad.pop(mb, None)
                if arrival is None:
                    wait_grad[k] = mb
                    break
                e = arrival if arrival > c else c
                if record:
                    ev.append((inst, c, e))
                c = e
            elif cls is SG_:
                mb = inst.mb_idx
                if mb in prev_grad:
                    _check_matching(flat)
                e = c + scost
                stage_busy += scost
                prev_grad[mb] = e + sg_delay
                if wait_grad[k - 1] == mb:
                    wait_grad[k - 1] = -1
                    ready.append(k - 1)
                if record:
                    ev.append((inst, c, e))
                c = e
            elif cls is U_:
                n_updates += 1
                e = c + ucost
                stage_busy += ucost
                if record:
                    ev.append((inst, c, e))
                c = e
            elif cls is W_:
                mb = inst.mb_idx
                if mb in stash:
                    raise ScheduleError(
                        f"Stage {k} stashes weights for micro-batch {mb} twice (instruction #{i}) before its "
                        "backward. Stash each micro-batch once, before its forward."
                    )
                stash[mb] = n_updates
                versions[n_updates] = versions.get(n_updates, 0) + 1
                depth = len(versions)
                if depth > peaks[k]:
                    peaks[k] = depth
                    if depth > stash_bound[k]:
                        raise ScheduleError(
                            f"Stash bound broken: stage {k} of {S} may keep at most {stash_bound[k]} weight "
                            f"versions, but binding micro-batch {mb} (instruction #{i}) makes {depth} "
                            f"(versions {sorted(versions)}). Backward older micro-batches before forwarding "
                            "new ones."
                        )
                if record:
                    ev.append((inst, c, c))
            elif cls is H_:
                e = c + host[k]
                stage_busy += host[k]
                if record:
                    ev.append((inst, c, e))
                c = e
            elif cls is _StepEnd:
                step_ends[k].append(c)
                if gate and k == last:
                    step = inst.step
                    last_step_end[step] = c
                    waiters = gate_waiters.pop(step, None)
                    if waiters:
                        ready.extend(waiters)
            elif cls is _Gate:
                step = inst.step
                done = last_step_end.get(step)
                if done is None:
                    gate_waiters.setdefault(step, []).append(k)
                    break
                if done > c:
                    c = done
            else:
                raise ScheduleError(
                    f"Stage {k} holds {inst!r} at position {i}, which is not an instruction. Use the types of "
                    "lightning_dynpipe.schedule.instructions (or parse_instructions('F0 B0 ...'))."
                )
        else:
            i = n
        ptr[k] = i
        clock[k] = c
        updates[k] = n_updates
        busy[k] = stage_busy

    if any(ptr[k] < len(flat[k]) for k in range(S)):
        _check_matching(flat)  # a receive without a send shows up as a wait: report the real cause
        raise _deadlock_error(flat, ptr)
    if expect_in_flight is None or not any(expect_in_flight):
        # Data sent but never received. Legitimate only when work is knowingly left in flight.
        if act_at[S] or grad_at[S] or any(act_at[:S]) or any(grad_at[:S]):
            _check_matching(flat)
    if expect_in_flight is not None:
        for k in range(S):
            if len(in_flight[k]) != expect_in_flight[k]:
                raise ScheduleError(
                    f"Stage {k} ends with {len(in_flight[k])} micro-batches in flight "
                    f"({sorted(in_flight[k])[:8]}), but {expect_in_flight[k]} were expected: in_flight_after "
                    "and drain_instructions disagree with the schedule."
                )

    if kind is None:
        num_microbatches = sum(1 for inst in programs[last][0] if type(inst) is Forward)
    return SimResult(
        kind=kind.name if kind is not None else None,  # type: ignore[arg-type]
        num_stages=S,
        num_microbatches=num_microbatches,
        num_steps=num_steps,
        events=tuple(
            tuple(SimEvent(str(inst), start, end) for inst, start, end in stage_events) for stage_events in events
        ),
        makespan=max(clock),
        step_end_times=tuple(tuple(ends) for ends in step_ends),
        finish_times=tuple(clock),
        busy_times=tuple(busy),
        stash_peaks=tuple(peaks),
    )


def _deadlock_error(flat: Sequence[Sequence[_Op]], ptr: Sequence[int]) -> ScheduleDeadlockError:
    lines = []
    for k, program in enumerate(flat):
        i = ptr[k]
        if i >= len(program):
            lines.append(f"stage {k} finished")
            continue
        inst = program[i]
        if isinstance(inst, _Gate):
            lines.append(f"stage {k} waits before step {inst.step + 1} for the last stage to finish step {inst.step}")
        elif isinstance(inst, RecvActivation):
            lines.append(
                f"stage {k} blocked at instruction #{i} '{inst}' waiting for 'SA{inst.mb_idx}' from stage {k - 1}"
            )
        elif isinstance(inst, RecvGrad):
            lines.append(
                f"stage {k} blocked at instruction #{i} '{inst}' waiting for 'SG{inst.mb_idx}' from stage {k + 1}"
            )
        else:  # only receives and gates block
            lines.append(f"stage {k} stopped at instruction #{i} {inst!r}")
    return ScheduleDeadlockError(
        "The schedule deadlocks: every stage that has not finished waits for data that a peer would only send "
        "later. " + "; ".join(lines) + ". Reorder the instructions so that each stage sends what its "
        "peers wait for before blocking on a receive of its own (e.g. 1F1B: all warm-up forwards first)."
    )


def _costs(
    S: int,
    forward_time: Times,
    backward_time: Times,
    update_time: Times,
    comm_time: Times,
    slowdown: Sequence[float] | None,
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per-stage compute costs (times the slowdown) and per-boundary transfer times, checked."""
    slow = [1.0] * S if slowdown is None else _check_times("slowdown", slowdown, S, "stage", positive=True)
    fwd = _check_times("forward_time", forward_time, S, "stage")
    bwd = _check_times("backward_time", backward_time, S, "stage")
    upd = _check_times("update_time", update_time, S, "stage")
    comm = _check_times("comm_time", comm_time, S - 1, "stage boundary (num_stages - 1)")
    return (
        [f * s for f, s in zip(fwd, slow)],
        [b * s for b, s in zip(bwd, slow)],
        [u * s for u, s in zip(upd, slow)],
        comm,
    )


def _generated(
    kind: Schedule, num_stages: int, num_microbatches: int, num_steps: int, drain_at_end: bool
) -> tuple[list[list[tuple[Instruction, ...]]], list[tuple[Instruction, ...]]]:
    programs = [
        [kind.step_instructions(k, num_stages, num_microbatches, t) for t in range(num_steps)]
        for k in range(num_stages)
    ]
    drains = [
        kind.drain_instructions(k, num_stages, num_microbatches, num_steps) if drain_at_end else ()
        for k in range(num_stages)
    ]
    return programs, drains


def simulate(
    kind: ScheduleKind | Schedule,
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    *,
    forward_time: Times = 1.0,
    backward_time: Times = 2.0,
    update_time: Times = 0.0,
    comm_time: Times = 0.0,
    slowdown: Sequence[float] | None = None,
    step_sync: StepSync = "none",
    drain_at_end: bool = True,
    step_overhead: Times = 0.0,
    send_overhead: Times = 0.0,
) -> SimResult:
    """Simulates ``num_steps`` steps of schedule ``kind`` on all stages (then the drain, by default).

    Example::

        >>> r = simulate("async", num_stages=4, num_microbatches=8, num_steps=4, comm_time=0.1)
        >>> r.stash_peaks
        (4, 3, 2, 0)
        >>> r.write_chrome_trace("async.json")  # doctest: +SKIP

    Args:
        kind: ``"async"``, ``"sync"`` or ``"gpipe"``.
        num_stages: ``S``.
        num_microbatches: micro-batches per step ``M``.
        num_steps: steps to simulate from a drained pipeline.
        forward_time: time of one micro-batch's forward, for every stage or per stage.
        backward_time: time of one micro-batch's backward, for every stage or per stage.
        update_time: time of one optimizer step, for every stage or per stage.
        comm_time: transfer time of one activation or gradient, for every boundary or per boundary
            (``S - 1`` values; boundary ``b`` joins stages ``b`` and ``b + 1``).
        slowdown: per-stage multiplier of compute time (interference), 1.0 = nominal.
        step_sync: ``"last_stage_broadcast"`` to model a wait for the last stage at every step's end.
        drain_at_end: run :func:`drain_instructions` after the last step.
        step_overhead: host time at the start of every step, for every stage or per stage (the training
            loop outside the schedule); not scaled by ``slowdown``.
        send_overhead: time a stage is busy per send, for every stage or per stage (the sender's share of
            a transfer); not scaled by ``slowdown``.

    Returns:
        The timeline and its summary.

    Raises:
        ScheduleError: an argument out of range, or a schedule that breaks a rule (see the module docstring).
        ScheduleDeadlockError: a schedule in which no stage can progress.
    """
    _check_steps(num_steps)
    _check_step_sync(step_sync)
    sched = get_schedule(kind)
    _check_args(sched, 0, num_stages, num_microbatches)
    programs, drains = _generated(sched, num_stages, num_microbatches, num_steps, drain_at_end)
    fwd, bwd, upd, comm = _costs(num_stages, forward_time, backward_time, update_time, comm_time, slowdown)
    expect = (
        [0] * num_stages
        if drain_at_end
        else [sched.in_flight_after(k, num_stages, num_microbatches, num_steps) for k in range(num_stages)]
    )
    return _run(
        programs,
        drains,
        kind=sched,
        num_microbatches=num_microbatches,
        forward=fwd,
        backward=bwd,
        update=upd,
        comm=comm,
        gate=step_sync == "last_stage_broadcast" and num_stages > 1,
        host=_check_times("step_overhead", step_overhead, num_stages, "stage"),
        send=_check_times("send_overhead", send_overhead, num_stages, "stage"),
        record=True,
        expect_in_flight=expect,
    )


def simulate_programs(
    programs: Sequence[Sequence[Sequence[Instruction]]],
    *,
    drains: Sequence[Sequence[Instruction]] | None = None,
    forward_time: Times = 1.0,
    backward_time: Times = 2.0,
    update_time: Times = 0.0,
    comm_time: Times = 0.0,
    slowdown: Sequence[float] | None = None,
    step_sync: StepSync = "none",
    step_overhead: Times = 0.0,
    send_overhead: Times = 0.0,
) -> SimResult:
    """Simulates hand-written per-stage programs (for custom schedules and for testing the checks).

    Example::

        >>> from lightning_dynpipe.schedule import parse_instructions as p
        >>> r = simulate_programs([[p("F0 SA0 RG0 B0")], [p("RA0 F0 B0 SG0")]])
        >>> r.makespan
        6.0

    Args:
        programs: ``programs[k][t]`` is stage ``k``'s instruction list for step ``t``; every stage has the
            same number of steps.
        drains: per stage, instructions to run after the last step (not gated by ``step_sync``).
        forward_time: as in :func:`simulate`.
        backward_time: as in :func:`simulate`.
        update_time: as in :func:`simulate`.
        comm_time: as in :func:`simulate`.
        slowdown: as in :func:`simulate`.
        step_sync: as in :func:`simulate`.
        step_overhead: as in :func:`simulate`.
        send_overhead: as in :func:`simulate`.

    Raises:
        ScheduleError: unmatched transfers, a backward without forward, or a stash deeper than ``S - k``.
        ScheduleDeadlockError: no stage can progress.
    """
    num_stages = len(programs)
    if num_stages < 1 or len(programs[0]) < 1:
        raise ScheduleError(
            "programs must hold at least one stage with at least one step: programs[stage_idx][step] is a "
            f"list of instructions; got {len(programs)} stages. Pass e.g. [[parse_instructions('F0 B0')]]."
        )
    _check_step_sync(step_sync)
    if drains is None:
        drains = [()] * num_stages
    elif len(drains) != num_stages:
        raise ScheduleError(
            f"drains must hold one instruction list per stage ({num_stages}); got {len(drains)}. "
            "Pass () for stages with nothing to drain."
        )
    fwd, bwd, upd, comm = _costs(num_stages, forward_time, backward_time, update_time, comm_time, slowdown)
    return _run(
        programs,
        drains,
        kind=None,
        num_microbatches=0,
        forward=fwd,
        backward=bwd,
        update=upd,
        comm=comm,
        gate=step_sync == "last_stage_broadcast" and num_stages > 1,
        host=_check_times("step_overhead", step_overhead, num_stages, "stage"),
        send=_check_times("send_overhead", send_overhead, num_stages, "stage"),
        record=True,
        expect_in_flight=None,
    )


def validate_schedule(
    kind: ScheduleKind | Schedule, num_stages: int, num_microbatches: int, num_steps: int = 3
) -> None:
    """Checks schedule ``kind`` by a zero-duration dry run of ``num_steps`` steps and the drain.

    Example::

        >>> validate_schedule("async", num_stages=8, num_microbatches=3)

    Raises:
        ScheduleError: unmatched transfers or a broken staleness, stash or drain rule.
        ScheduleDeadlockError: the stages would wait for each other forever.
    """
    sched = get_schedule(kind)
    _check_args(sched, 0, num_stages, num_microbatches)
    _check_steps(num_steps)
    programs, drains = _generated(sched, num_stages, num_microbatches, num_steps, True)
    zeros = [0.0] * num_stages
    _run(
        programs,
        drains,
        kind=sched,
        num_microbatches=num_microbatches,
        forward=zeros,
        backward=zeros,
        update=zeros,
        comm=zeros[1:],
        gate=False,
        record=False,
        expect_in_flight=[0] * num_stages,
    )
