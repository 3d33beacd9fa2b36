"""The time-to-accuracy planner: an exact solver over contiguous layer ranges.

``solve`` picks the number of stages ``S``, the data-parallel width ``dp`` and the layer boundaries that
minimise the predicted time to reach a target accuracy::

    time_to_accuracy = iterations(staleness profile) * iteration_time

For ``schedule="async"`` ``iteration_time = max_k T_k`` (steady-state 1F1B: the bottleneck stage) and
``iterations = I0 * (1 + beta * sum_k w_k (S-1-k))``; ``"async+d"`` has ``(1+d)`` times that staleness, which the
objective charges as ``beta * (1+d)``; for ``"sync"`` there is no staleness and a step of ``M`` micro-batches takes
``(M-1) max_k T_k + sum_k T_k`` (fill and drain around the steady state).

Why the solver is exact
-----------------------
1. *The objective is a max term and an additive term.* For async, with ``P(c)`` the parameter bytes of
   layers ``[0, c)`` and cuts ``c_1 < ... < c_{S-1}``::

       sum_k (S-1-k) P_k  =  sum_m P(c_m)  =:  A(partition)

   so ``time_to_accuracy = f(B, A) = I0 * B * (1 + beta * A / P_total)``, ``B = max_k T_k``. For sync,
   ``f(B, A) = I0 * ((M-1) B + A) / M`` with ``A = sum_k T_k``. Both are non-decreasing in ``B`` and ``A``
   (``beta >= 0``).
2. *Reduction to a cap on the bottleneck.* Let ``F_S(tau)`` be the least ``A`` over ``S``-stage partitions
   whose every stage has ``T_k <= tau`` and fits in memory (``inf`` if none). Then
   ``min_partitions f(B, A) = min_tau f(tau, F_S(tau))``: the optimum ``p*`` is feasible at
   ``tau = B(p*)``, so ``F_S(B(p*)) <= A(p*)``; conversely the partition achieving ``F_S(tau)`` has
   ``B <= tau``, so its objective is at most ``f(tau, F_S(tau))``. ``F_S`` is non-increasing and changes
   only at stage times ``tau = T(i, j)`` ("candidates"), so the minimum is over finitely many ``tau``.
3. *``F_S(tau)`` is a DP.* Index stages from the end, ``m = S - k``: weight versions, in-flight micro-batches
   (memory) and the async charge ``P(i)`` at a stage's start ``i`` depend on ``m``, not on ``S`` (``P(0) =
   0`` for the first stage). With ``G_0(n) = 0``::

       G_m(i) = P(i) + min { G_{m-1}(j) : i < j, stage m on [i, j) is allowed }     F_S(tau) = G_S(0)

   (sync: ``G_m(i) = min_j G_{m-1}(j) + T_m(i, j)``). One pass over ``m = 1 .. S_max`` yields ``F_S`` for
   every ``S`` whose stages (counted from the end) run on the same kind of device: with identical devices
   all ``S`` of one ``dp`` share it. For the default cost model ``T(i, j) = (q[j] - q[i]) + r[j]`` with
   ``q`` non-decreasing, and memory grows with the range, so the allowed starts for a stop ``j`` are an
   interval ``[lo_m(j), j-1]`` (a binary search); pushing each ``G_{m-1}(j)`` to its interval is an
   offline range-chmin (a sparse table in reverse): ``O(S n log n)`` numpy work per pass. Any other
   :class:`CostModel` is handled by enumerating all ranges densely (``O(S n^2)``), assuming nothing about
   its shape.
4. *Branch and bound over ``tau``.* A node is an interval ``(lo, hi]`` of caps with ``F_S(hi)`` known; for
   ``tau`` in it, ``f(tau, F_S(tau)) >= f(lo, F_S(hi))`` (and ``F_S = inf`` below any cap where ``S`` was
   found infeasible). Best-first on that bound: evaluate ``F`` at a split point (the geometric midpoint, or
   the largest candidate below the node's useful top), which also yields real partitions that update the
   incumbent; children are ``(lo, mid]`` and ``(mid, hi]``, the latter dropped when ``F`` did not change
   (everything in it is dominated by a point of the former) or when it holds no candidate. Caps above
   ``tau_limit`` (where ``f(tau, F_S(hi))`` reaches the incumbent) cannot win. The search stops when no
   node's bound is below the incumbent, within a relative 1e-12 (float rounding). Every candidate lies in
   some node until it is proven unable to beat the incumbent, so the result is the minimum of ``f`` over
   all partitions, ``S`` and ``dp`` (``tests/plan`` checks it against brute force on every small case).

Devices: with per-device slowdowns the plan uses the ``S * dp`` least slowed devices, keeping their order,
``dp`` consecutive ones per stage (see :func:`assign_devices`); optimality is over partitions for that
assignment. Distinct devices split the single DP pass into one pass per ``S`` (slower); re-planning at run
time with ``fixed_num_stages`` keeps one pass.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from lightning_dynpipe.errors import ConfigurationError, PartitionError
from lightning_dynpipe.plan.convergence import ConvergenceModel, staleness_profile
from lightning_dynpipe.plan.costs import CostModel, DefaultCostModel, DeviceSpec, ModelCost, PrefixCostModel
from lightning_dynpipe.plan.memory import (
    ScheduleLike,
    format_bytes,
    in_flight_microbatches,
    stage_memory,
    weight_versions,
)
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.schedule.kinds import Schedule, get_schedule

__all__ = ["Plan", "assign_devices", "evaluate", "solve", "throughput_optimal"]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

_OkFn = Callable[[IntArray, IntArray], NDArray[np.bool_]]

_RTOL = 1e-12  # prune a node whose lower bound is within this relative distance of the incumbent


# --------------------------------------------------------------------------------------------------- Plan


def _fmt_time(seconds: float) -> str:
    if seconds == 0 or seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.3f} us"


@dataclass(frozen=True)
class Plan:
    """A partition with its predicted per-stage costs and time to accuracy. Immutable, plain data.

    Example::

        >>> model = ModelCost.from_arrays([1.0, 1.0, 2.0], [2.0, 2.0, 4.0], param_bytes=[1, 1, 1])
        >>> plan = solve(model, num_devices=2, convergence=ConvergenceModel(beta=0.0))
        >>> plan.partition.balance, plan.iteration_time_s
        ((2, 1), 6.0)
        >>> print(plan.table())  # doctest: +ELLIPSIS
        stage  layers  ...

    Attributes:
        partition: layers and replicas per stage (what the engine builds).
        schedule: the schedule's name (``"async"``, ``"sync"``, ``"gpipe"``).
        devices: device indices of each stage (``dp`` of them), in the order of ``slowdowns``.
        stage_times_s: predicted seconds per micro-batch of each stage, all replicas together.
        stage_memory_bytes: predicted peak bytes on each device of each stage.
        stage_memory_caps: the memory cap that applied to each stage (``inf``: none).
        staleness: per-stage staleness (``S-1-k`` async, 0 sync).
        param_shares: each stage's share of the parameters (the convergence model's ``w_k``).
        iteration_time_s: predicted seconds per micro-batch of the whole pipeline in steady state.
        iterations: predicted micro-batches to reach the target.
        time_to_accuracy_s: ``iterations * iteration_time_s``, the objective the solver minimises.
        num_microbatches: micro-batches per step ``M`` (used by ``"sync"``; ``None`` for async).
    """

    partition: Partition
    schedule: str
    devices: tuple[tuple[int, ...], ...]
    stage_times_s: tuple[float, ...]
    stage_memory_bytes: tuple[int, ...]
    stage_memory_caps: tuple[float, ...]
    staleness: tuple[int, ...]
    param_shares: tuple[float, ...]
    iteration_time_s: float
    iterations: float
    time_to_accuracy_s: float
    num_microbatches: int | None = None

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages ``S``."""
        return self.partition.num_stages

    @property
    def dp(self) -> int:
        """Data-parallel width (replicas of every stage)."""
        return self.partition.replicas[0]

    @property
    def num_devices_used(self) -> int:
        """``S * dp``."""
        return sum(self.partition.replicas)

    @property
    def bottleneck_stage(self) -> int:
        """Index of the slowest stage (the first one on ties)."""
        return int(np.argmax(self.stage_times_s))

    @property
    def fits_memory(self) -> bool:
        """Whether every stage fits its device's memory cap."""
        return all(m <= c for m, c in zip(self.stage_memory_bytes, self.stage_memory_caps, strict=True))

    def table(self) -> str:
        """A printable table: one row per stage, then the pipeline totals."""
        header = ("stage", "layers", "devices", "time/mb", "memory", "cap", "staleness", "params")
        rows = []
        for k in range(self.num_stages):
            layers = self.partition.stage_layers(k)
            rows.append(
                (
                    str(k) + ("*" if k == self.bottleneck_stage else ""),
                    f"{layers.start}-{layers.stop - 1}",
                    ",".join(str(d) for d in self.devices[k]),
                    _fmt_time(self.stage_times_s[k]),
                    format_bytes(self.stage_memory_bytes[k]),
                    format_bytes(self.stage_memory_caps[k]),
                    str(self.staleness[k]),
                    f"{100 * self.param_shares[k]:.1f}%",
                )
            )
        widths = [max(len(h), *(len(r[c]) for r in rows)) for c, h in enumerate(header)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines.append(
            f"schedule={self.schedule}  stages={self.num_stages}  dp={self.dp}  partition={self.partition}  "
            f"(* = bottleneck)"
        )
        lines.append(
            f"iteration time {_fmt_time(self.iteration_time_s)}/micro-batch  x  {self.iterations:.6g} iterations"
            f"  =  time to accuracy {self.time_to_accuracy_s:.6g} s"
        )
        return "\n".join(lines)


# ------------------------------------------------------------------------------------- problem set-up


def assign_devices(slowdowns: Sequence[float], num_stages: int, dp: int) -> tuple[tuple[int, ...], ...]:
    """Which devices run which stage: the ``S * dp`` least slowed ones, in their original order.

    Ties go to the lower device index. Stage ``k`` gets the ``k``-th group of ``dp`` consecutive chosen
    devices, so with no slowdowns stage ``k`` runs on devices ``k*dp .. k*dp+dp-1``.

    Example::

        >>> assign_devices([1.0, 3.0, 1.0, 1.0], num_stages=3, dp=1)
        ((0,), (2,), (3,))
    """
    need = num_stages * dp
    if need > len(slowdowns):
        raise ConfigurationError(
            f"num_stages * dp = {num_stages} * {dp} = {need} devices needed, but only {len(slowdowns)} exist. "
            "Use fewer stages or a smaller dp."
        )
    chosen = sorted(sorted(range(len(slowdowns)), key=lambda d: (slowdowns[d], d))[:need])
    return tuple(tuple(chosen[k * dp : (k + 1) * dp]) for k in range(num_stages))


def _device_specs(
    num_devices: int, slowdowns: Sequence[float] | None, memory_cap: float | Sequence[float] | None
) -> tuple[DeviceSpec, ...]:
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ConfigurationError(f"num_devices must be a positive integer; got {num_devices!r}.")
    slow = [1.0] * num_devices if slowdowns is None else [float(s) for s in slowdowns]
    if len(slow) != num_devices:
        raise ConfigurationError(
            f"slowdowns needs one factor per device: num_devices={num_devices}, len(slowdowns)={len(slow)}."
        )
    if memory_cap is None:
        caps = [math.inf] * num_devices
    elif isinstance(memory_cap, (int, float)):
        caps = [float(memory_cap)] * num_devices
    else:
        caps = [float(c) for c in memory_cap]
        if len(caps) != num_devices:
            raise ConfigurationError(
                f"memory_cap needs one value per device (or a single number): num_devices={num_devices}, "
                f"len(memory_cap)={len(caps)}."
            )
    return tuple(DeviceSpec(memory_cap_bytes=c, slowdown=s) for c, s in zip(caps, slow, strict=True))


def _stage_device(devices: Sequence[DeviceSpec], ids: Sequence[int]) -> DeviceSpec:
    # Replicas all-reduce every update, so a stage runs at its slowest replica and fits its smallest one.
    return DeviceSpec(
        memory_cap_bytes=min(devices[d].memory_cap_bytes for d in ids), slowdown=max(devices[d].slowdown for d in ids)
    )


def _check_schedule(schedule: ScheduleLike, num_microbatches: int | None) -> tuple[Schedule, int]:
    """The schedule object and the micro-batches per update; refuses what the solver's objective cannot model
    (see :func:`_staleness_factor`)."""
    sched = get_schedule(schedule)
    if sched.accumulates:
        if num_microbatches is None or num_microbatches < 1:
            raise ConfigurationError(
                f'schedule="{sched}" flushes the pipeline every step, so its time depends on the micro-batches per '
                f"step: pass num_microbatches >= 1 (got {num_microbatches!r})."
            )
        return sched, num_microbatches
    _staleness_factor(sched)
    return sched, 1


def _staleness_factor(sched: Schedule) -> int:
    """``c`` with staleness ``c (S-1-k)`` on every stage ``k`` (1 for PipeDream, ``1 + d`` for ``"async+d"``).

    Without a flush the objective charges staleness through the cuts' parameter prefixes, which is exact for a
    profile proportional to PipeDream's ``S-1-k`` only: ``sum_k c (S-1-k) P_k = c sum_m P(c_m)``.
    """
    c = sched.staleness(0, 2)
    for S in (1, 2, 5):
        if c < 1 or [sched.staleness(k, S) for k in range(S)] != [c * (S - 1 - k) for k in range(S)]:
            raise ConfigurationError(
                f"The planner models schedules that flush every step, or that run 1F1B without a flush with "
                f"staleness c (S-1-k) for a constant c >= 1; schedule {sched.name!r} does neither. Plan it as "
                "'async', 'async+d' or 'sync'."
            )
    return c


# ------------------------------------------------------------------------------------------- evaluate


def evaluate(
    model_cost: ModelCost,
    partition: Partition,
    *,
    schedule: ScheduleLike = "async",
    convergence: ConvergenceModel | None = None,
    cost_model: CostModel | None = None,
    slowdowns: Sequence[float] | None = None,
    memory_cap: float | Sequence[float] | None = None,
    num_microbatches: int | None = None,
    num_devices: int | None = None,
    devices: Sequence[Sequence[int]] | None = None,
) -> Plan:
    """Predicts the costs of a given partition (e.g. a hand-made or parameter-balanced one).

    Does not reject a partition that exceeds the memory caps: check :attr:`Plan.fits_memory`.

    Example::

        >>> model = ModelCost.from_arrays([1.0, 1.0, 2.0], [2.0, 2.0, 4.0])
        >>> evaluate(model, Partition((1, 2))).stage_times_s
        (3.0, 9.0)

    Args:
        model_cost: per-layer costs.
        partition: the layers (and replicas, which must all be equal) per stage.
        schedule: a :class:`~lightning_dynpipe.schedule.Schedule` or its name.
        convergence: the staleness model (default :class:`ConvergenceModel`).
        cost_model: the stage time model (default :class:`DefaultCostModel`).
        slowdowns: per-device compute slowdown factors; their count is the number of devices.
        memory_cap: bytes per device, one number or one per device.
        num_microbatches: micro-batches per step (required for schedules that flush every step).
        num_devices: devices available; default: the length of ``slowdowns`` or ``memory_cap`` when given
            as sequences, else ``num_stages * dp``.
        devices: device indices per stage; default :func:`assign_devices`.
    """
    sched, mpu = _check_schedule(schedule, num_microbatches)
    convergence = convergence or ConvergenceModel()
    cost_model = cost_model or DefaultCostModel()
    S = partition.num_stages
    if partition.num_layers != model_cost.num_layers:
        raise PartitionError(
            f"The partition covers {partition.num_layers} layers but the model has {model_cost.num_layers}: "
            f"partition={partition}. Fix the balance."
        )
    dp = partition.replicas[0]
    if any(r != dp for r in partition.replicas):
        raise PartitionError(
            f"The planner models one data-parallel width for every stage; got replicas={list(partition.replicas)}."
        )
    if num_devices is None:
        if slowdowns is not None:
            num_devices = len(slowdowns)
        elif isinstance(memory_cap, Sequence):
            num_devices = len(memory_cap)
        else:
            num_devices = S * dp
    specs = _device_specs(num_devices, slowdowns, memory_cap)
    ids = assign_devices([d.slowdown for d in specs], S, dp) if devices is None else tuple(tuple(g) for g in devices)
    if len(ids) != S or any(len(g) != dp for g in ids) or any(not 0 <= d < num_devices for g in ids for d in g):
        raise ConfigurationError(
            f"devices must give {dp} device indices in [0, {num_devices}) for each of the {S} stages; got {ids}."
        )
    bounds = partition.boundaries
    times: list[float] = []
    mems: list[int] = []
    caps: list[float] = []
    for k in range(S):
        dev = _stage_device(specs, ids[k])
        t = cost_model.stage_time(
            model_cost, np.asarray([bounds[k]]), np.asarray([bounds[k + 1]]),
            stage_idx=k, num_stages=S, replicas=dp, device=dev, microbatches_per_update=mpu,
        )  # fmt: skip
        times.append(float(np.asarray(t).reshape(-1)[0]))
        mem = stage_memory(
            model_cost, [bounds[k]], [bounds[k + 1]], stage_idx=k, num_stages=S, schedule=sched,
            num_microbatches=num_microbatches,
        )  # fmt: skip
        mems.append(int(mem[0]))
        caps.append(dev.memory_cap_bytes)
    params = [model_cost.param_bytes(bounds[k], bounds[k + 1]) for k in range(S)]
    total = sum(params)
    shares = tuple(p / total if total > 0 else 0.0 for p in params)
    stale = staleness_profile(S, sched)
    iteration_time = sched.iteration_time(times, mpu)
    iterations = convergence.iterations(stale, params)
    return Plan(
        partition=partition,
        schedule=sched.name,
        devices=ids,
        stage_times_s=tuple(times),
        stage_memory_bytes=tuple(mems),
        stage_memory_caps=tuple(caps),
        staleness=stale,
        param_shares=shares,
        iteration_time_s=iteration_time,
        iterations=iterations,
        time_to_accuracy_s=iterations * iteration_time,
        num_microbatches=num_microbatches if sched.accumulates else None,
    )


# --------------------------------------------------------------------------------------------- solver


class _Problem:
    """Everything shared by the configurations of one solve: the objective and cached per-layer arrays."""

    def __init__(
        self,
        model: ModelCost,
        cost_model: CostModel,
        convergence: ConvergenceModel,
        schedule: ScheduleLike,
        num_microbatches: int | None,
        devices: tuple[DeviceSpec, ...],
    ) -> None:
        self.model = model
        self.cost_model = cost_model
        self.convergence = convergence
        self.schedule, self.mpu = _check_schedule(schedule, num_microbatches)
        self.num_microbatches = num_microbatches
        self.sync = self.schedule.accumulates  # the flush objective; otherwise the staleness-charged one
        # beta charged per unit of the cuts' prefix sum: the schedule's staleness is c times PipeDream's (checked
        # above; computing c again costs a few staleness calls once per solve)
        self.beta = 0.0 if self.sync else self.convergence.beta * _staleness_factor(self.schedule)
        self.devices = devices
        self.n = model.num_layers
        self.cut_cost = model.param_prefix.astype(np.float64)
        self.ptot = float(model.total_param_bytes)
        if self.ptot * self.n >= 2.0**53:
            # The cut costs are summed in float64; beyond 2**53 the sums stop being exact integers.
            raise ConfigurationError(
                f"Parameter bytes too large for exact planning: {self.ptot:.3g} bytes x {self.n} layers >= 2**53. "
                "Express param_bytes in a coarser unit (e.g. KiB): only their ratios matter to the planner."
            )
        self.fast = isinstance(cost_model, PrefixCostModel)
        self._prefix: dict[tuple[int, DeviceSpec], tuple[FloatArray, FloatArray]] = {}
        self._lo_mem: dict[tuple[int, int, float], IntArray] = {}
        self.log2 = np.zeros(self.n + 2, dtype=np.int64)
        for length in range(2, self.n + 2):
            self.log2[length] = self.log2[length // 2] + 1

    # The objective f(tau, A), non-decreasing in both: async  I0 * tau * (1 + beta * A / P_total), with A the
    # sum of the cuts' parameter prefixes; sync  I0 * ((M-1) tau + A) / M, with A the sum of stage times.
    def f(self, tau: float, a: float) -> float:
        return float(self.f_vec(tau, np.asarray([a]))[0])

    def f_vec(self, tau: float | FloatArray, a: FloatArray) -> FloatArray:
        i0 = self.convergence.i0
        finite = np.isfinite(a)
        safe = np.where(finite, a, 0.0)
        if self.sync:
            M = self.mpu
            val = i0 * ((M - 1) * tau + safe) / M
        else:
            share = safe / self.ptot if self.ptot > 0 else np.zeros_like(safe)
            val = i0 * tau * (1.0 + self.beta * share)
        return np.where(finite, val, np.inf)

    def tau_limit_vec(self, a: FloatArray, bound: float) -> FloatArray:
        """Sup of tau with f(tau, a) < bound: larger bottlenecks cannot beat the incumbent."""
        if math.isinf(bound):
            return np.full(a.shape, np.inf)
        i0 = self.convergence.i0
        finite = np.isfinite(a)
        safe = np.where(finite, a, 0.0)
        if self.sync:
            M = self.mpu
            if M == 1:
                out = np.where(i0 * safe < bound, np.inf, -np.inf)
            else:
                out = (bound * M / i0 - safe) / (M - 1)
        else:
            share = safe / self.ptot if self.ptot > 0 else np.zeros_like(safe)
            out = bound / (i0 * (1.0 + self.beta * share))
        return np.where(finite, out, -np.inf)

    def prefix(self, dp: int, device: DeviceSpec) -> tuple[FloatArray, FloatArray]:
        key = (dp, device)
        if key not in self._prefix:
            assert isinstance(self.cost_model, PrefixCostModel)
            q, r = self.cost_model.prefix_form(self.model, replicas=dp, device=device, microbatches_per_update=self.mpu)
            q = np.asarray(q, dtype=np.float64)
            r = np.asarray(r, dtype=np.float64)
            if q.shape != (self.n + 1,) or r.shape != (self.n + 1,) or np.any(np.diff(q) < 0):
                raise ConfigurationError(
                    f"{type(self.cost_model).__name__}.prefix_form must return two arrays of length "
                    f"num_layers + 1 = {self.n + 1} with q non-decreasing; got shapes {q.shape}, {r.shape}."
                )
            self._prefix[key] = (q, r)
        return self._prefix[key]

    def lo_mem(self, stages_to_end: int, cap: float) -> IntArray:
        """For each stop j (index j), the smallest start i at which a stage with ``stages_to_end = S - k``
        fits ``cap`` (j if even one layer does not)."""
        # memory depends on the position only through S - k: pose it as stage 0 of an (S-k)-stage pipeline
        versions = weight_versions(0, stages_to_end, self.schedule)
        in_flight = in_flight_microbatches(0, stages_to_end, self.schedule, self.num_microbatches)
        key = (versions, in_flight, cap)
        if key not in self._lo_mem:
            J = np.arange(self.n + 1, dtype=np.int64)
            if math.isinf(cap):
                out = np.zeros(self.n + 1, dtype=np.int64)
            else:
                model, schedule, M = self.model, self.schedule, self.num_microbatches

                def fits(i: IntArray, j: IntArray) -> NDArray[np.bool_]:
                    mem = stage_memory(
                        model, i, j, stage_idx=0, num_stages=stages_to_end, schedule=schedule, num_microbatches=M
                    )
                    return np.asarray(mem <= cap)

                out = _leftmost(fits, np.zeros_like(J), J.copy(), J)
            out.flags.writeable = False
            self._lo_mem[key] = out
        return self._lo_mem[key]


def _leftmost(ok: _OkFn, lo: IntArray, hi: IntArray, J: IntArray) -> IntArray:
    """Vectorised binary search: smallest i in [lo, hi] with ok(i, J), where ok is monotone in i
    (False ... False True ... True) and ok(hi, J) is taken as True."""
    lo = lo.copy()
    hi = hi.copy()
    active = np.flatnonzero(lo < hi)
    while active.size:
        mid = (lo[active] + hi[active]) // 2
        good = ok(mid, J[active])
        hi[active[good]] = mid[good]
        lo[active[~good]] = mid[~good] + 1
        active = active[lo[active] < hi[active]]
    return lo


def _stage_times_prefix(q: FloatArray, r: FloatArray, i: IntArray, j: IntArray) -> FloatArray:
    # The one formula for a stage's time on the fast path; DefaultCostModel.stage_time uses the same.
    return np.asarray((q[j] - q[i]) + r[j])


def _leftmost_time(q: FloatArray, r: FloatArray, J: IntArray, tau: float, strict: bool) -> IntArray:
    """Smallest i in [0, J] with T(i, J) <= tau (< tau if strict); J where none (T is non-increasing in i)."""
    if tau == math.inf:
        return np.zeros_like(J)

    def ok(i: IntArray, j: IntArray) -> NDArray[np.bool_]:
        t = _stage_times_prefix(q, r, i, j)
        return np.asarray(t < tau) if strict else np.asarray(t <= tau)

    # searchsorted lands within a position or two of the answer (rounding); an exact fix-up follows, and a
    # binary search for stragglers (long runs of zero-cost layers make q flat).
    i = np.searchsorted(q, (q[J] + r[J]) - tau, side="left").astype(np.int64)
    np.minimum(i, J, out=i)
    for _ in range(3):
        left = (i > 0) & ok(np.maximum(i - 1, 0), J)
        right = (i < J) & ~ok(i, J)
        if not (left.any() or right.any()):
            return i
        i = i - left + right
    bad = np.flatnonzero(((i > 0) & ok(np.maximum(i - 1, 0), J)) | ((i < J) & ~ok(i, J)))
    if bad.size:
        i[bad] = _leftmost(ok, np.zeros(bad.size, dtype=np.int64), J[bad].copy(), J[bad])
    return i


def _range_chmin(n: int, lo: IntArray, hi: IntArray, v: FloatArray, log2: IntArray) -> FloatArray:
    """out[x] = min of v[t] over the t with lo[t] <= x <= hi[t] (inf if none), for x in [0, n); lo <= hi.

    Offline range-chmin: each interval is two (possibly overlapping) power-of-two blocks; block minima are
    pushed down level by level, a sparse table in reverse. O(n log n).
    """
    lev = log2[hi - lo + 1]
    depth = int(lev.max())
    table = np.full((depth + 1) * n, np.inf)
    base = lev * n
    blocks = np.concatenate((base + lo, base + hi + 1 - np.left_shift(1, lev)))
    np.minimum.at(table, blocks, np.concatenate((v, v)))
    grid = table.reshape(depth + 1, n)
    for level in range(depth, 0, -1):
        half = 1 << (level - 1)
        below = grid[level - 1]
        np.minimum(below, grid[level], out=below)
        np.minimum(below[half:], grid[level, : n - half], out=below[half:])
    out: FloatArray = grid[0]
    return out


@dataclass
class _Witness:
    balance: tuple[int, ...]
    bottleneck: float
    objective: float


class _PrefixGroup:
    """Configurations sharing ``dp`` and the devices of their last stages, solved by one DP pass.

    Stages are indexed from the end, ``m = S - k``: a stage's weight versions, in-flight micro-batches and
    (for async) its staleness charge depend on ``m`` alone, so the pass over ``m = 1, 2, ...`` computes
    ``F_S(tau)`` for every ``S`` at once. ``G_m(i)`` is the least cost of the last ``m`` stages on layers
    ``[i, n)``; stage ``m`` on ``[i, j)`` is allowed when ``i >= lo_m(j)`` (time and memory are monotone in
    the start), so each ``G_{m-1}(j)`` is pushed to the interval ``[lo_m(j), j-1]`` (a range-chmin).
    """

    def __init__(
        self,
        prob: _Problem,
        dp: int,
        specs: Sequence[DeviceSpec],
        members: Sequence[int],
        device_ids: dict[int, tuple[tuple[int, ...], ...]],
    ) -> None:
        self.prob, self.dp = prob, dp
        self.members = np.asarray(sorted(members), dtype=np.int64)
        self.index = {int(S): t for t, S in enumerate(self.members)}
        self.smax = int(self.members[-1])
        self.device_ids = device_ids
        self.specs = list(specs[: self.smax])  # specs[m-1]: the device of stage m (from the end)
        n = prob.n
        self.J = np.arange(1, n + 1, dtype=np.int64)
        keys: dict[DeviceSpec, int] = {}
        self.key_of = [keys.setdefault(sp, len(keys)) for sp in self.specs]
        self.key_qr = [prob.prefix(dp, sp) for sp in keys]
        self.lo_mem = np.stack(
            [prob.lo_mem(m, self.specs[m - 1].memory_cap_bytes)[1:] for m in range(1, self.smax + 1)]
        )
        self._lo_mem_min: dict[tuple[int, int], IntArray] = {}
        c_total = float(prob.model.compute_prefix[-1])
        inv = np.cumsum([1.0 / sp.slowdown for sp in self.specs])
        # max_k T_k >= max_k s_k C_k / dp >= C / (dp * sum_k 1/s_k); a margin for rounding
        tau_lb = c_total / (dp * inv[self.members - 1])
        self.lo0 = float(tau_lb.min()) * (1.0 - 1e-9) if c_total > 0 else -1e-300
        if prob.sync:  # sum_k T_k >= C * min_k s_k / dp
            min_s = np.minimum.accumulate([sp.slowdown for sp in self.specs])
            self.a_lb = c_total * min_s[self.members - 1] / dp * (1.0 - 1e-9)
        else:  # every cut as far left as it can go
            self.a_lb = np.cumsum(np.concatenate([[0.0], prob.cut_cost[1 : self.smax]]))[self.members - 1]
        self._pushed: list[tuple[FloatArray, IntArray]] = []

    def evaluate(self, tau: float, max_s: int) -> FloatArray:
        prob, n, J = self.prob, self.prob.n, self.J
        max_s = min(max_s, self.smax)
        lo_time: dict[int, IntArray] = {}
        G = np.full(n + 1, np.inf)
        G[n] = 0.0
        F = np.full(len(self.members), np.inf)
        self._pushed = []
        for m in range(1, max_s + 1):
            key = self.key_of[m - 1]
            q, r = self.key_qr[key]
            if key not in lo_time:
                lo_time[key] = _leftmost_time(q, r, J, tau, strict=False)
            lo = np.maximum(lo_time[key], self.lo_mem[m - 1])
            v = G[1:] + (q[1:] + r[1:]) if prob.sync else G[1:]
            ok = lo < J
            v_ok = np.where(ok, v, np.inf)  # a stop without an allowed start pushes nothing
            if not np.isfinite(v_ok).any():
                break
            pushed = _range_chmin(n, np.minimum(lo, J - 1), J - 1, v_ok, prob.log2)
            self._pushed.append((v_ok, lo))
            G = np.empty(n + 1)
            G[:n] = pushed - q[:n] if prob.sync else pushed + prob.cut_cost[:n]
            G[n] = np.inf
            t = self.index.get(m)
            if t is not None:
                F[t] = G[0]
        return F

    def witness(self, S: int) -> _Witness:
        """The partition behind ``F_S`` of the last :meth:`evaluate` call."""
        prob, J = self.prob, self.J
        bounds = [0]
        i = 0
        for m in range(S, 0, -1):
            v, lo = self._pushed[m - 1]
            cand = np.where((J > i) & (lo <= i), v, np.inf)
            i = int(np.argmin(cand)) + 1
            assert math.isfinite(float(cand[i - 1])), "DP backtrack lost its path"
            bounds.append(i)
        assert i == prob.n
        times = []
        for k in range(S):
            q, r = self.key_qr[self.key_of[S - k - 1]]
            times.append(float((q[bounds[k + 1]] - q[bounds[k]]) + r[bounds[k + 1]]))
        bottleneck = max(times)
        if prob.sync:
            a_real = 0.0
            for t in times:
                a_real += t
        else:
            a_real = float(sum(int(prob.model.param_prefix[c]) for c in bounds[1:-1]))
        balance = tuple(bounds[k + 1] - bounds[k] for k in range(S))
        return _Witness(balance, bottleneck, prob.f(bottleneck, a_real))

    def pred(self, top: float, max_s: int) -> float | None:
        """The largest candidate stage time strictly below ``top`` for pipelines of at most ``max_s`` stages
        (over a superset of the candidates: positions are not checked)."""
        max_s = min(max_s, self.smax)
        n, J = self.prob.n, self.J
        if max_s == 1:  # a single stage owns everything: one candidate
            q, r = self.key_qr[self.key_of[0]]
            t = float((q[n] - q[0]) + r[n])
            return t if t < top and self.lo_mem[0][n - 1] == 0 else None
        best = -math.inf
        for key in sorted(set(self.key_of[:max_s])):
            q, r = self.key_qr[key]
            cache = (key, max_s)
            if cache not in self._lo_mem_min:
                rows = [m for m in range(max_s) if self.key_of[m] == key]
                self._lo_mem_min[cache] = self.lo_mem[rows].min(axis=0)
            i = np.maximum(_leftmost_time(q, r, J, top, strict=True), self._lo_mem_min[cache])
            ok = i < J
            if ok.any():
                best = max(best, float(_stage_times_prefix(q, r, i[ok], J[ok]).max()))
        return best if best > -math.inf else None


class _DenseGroup:
    """One (S, dp) configuration for a cost model without a prefix form: all ranges are enumerated."""

    def __init__(self, prob: _Problem, S: int, dp: int) -> None:
        self.prob, self.S, self.dp = prob, S, dp
        n = prob.n
        self.members = np.asarray([S], dtype=np.int64)
        self.smax = S
        ids = assign_devices([d.slowdown for d in prob.devices], S, dp)
        self.device_ids = {S: ids}
        self.stage_dev = [_stage_device(prob.devices, g) for g in ids]
        # T[k][i, j]: stage k on [i, j); inf where not allowed (position, memory)
        self.T: list[FloatArray] = []
        for k in range(S):
            lo_mem = prob.lo_mem(S - k, self.stage_dev[k].memory_cap_bytes)
            Im, Jm = (x.astype(np.int64) for x in np.triu_indices(n + 1, 1))
            # stage k starts at >= k (0 for the first), ends by n - (S-1-k) (n for the last), fits memory
            keep = (Im >= lo_mem[Jm]) & ((Im == 0) if k == 0 else (Im >= k))
            keep &= (Jm == n) if k == S - 1 else (Jm <= n - S + k + 1)
            Im, Jm = Im[keep], Jm[keep]
            out = np.full((n + 1, n + 1), np.inf)
            if Im.size:
                t = prob.cost_model.stage_time(
                    prob.model, Im, Jm, stage_idx=k, num_stages=S, replicas=dp, device=self.stage_dev[k],
                    microbatches_per_update=prob.mpu,
                )  # fmt: skip
                t = np.asarray(t, dtype=np.float64).reshape(-1)
                if t.shape != Im.shape or np.any(np.isnan(t)):
                    raise ConfigurationError(
                        f"{type(prob.cost_model).__name__}.stage_time must return one time per range; got "
                        f"shape {t.shape} for {Im.size} ranges."
                    )
                out[Im, Jm] = t
            self.T.append(out)
        finite = [t[np.isfinite(t)] for t in self.T]
        mins = [float(x.min()) for x in finite if x.size]
        self.lo0 = float(np.nextafter(min(mins), -np.inf)) if mins else 0.0
        self.a_lb = np.asarray([0.0 if prob.sync else float(prob.cut_cost[1:S].sum())])
        self._choices: list[IntArray] = []

    def evaluate(self, tau: float, max_s: int) -> FloatArray:
        prob, n = self.prob, self.prob.n
        g = np.full(n + 1, np.inf)
        g[0] = 0.0
        self._choices = []
        for k in range(self.S):
            T = self.T[k]
            add = T if prob.sync else (prob.cut_cost[:, None] if k > 0 else np.zeros((n + 1, 1)))
            cand = np.where(np.isfinite(T) & (T <= tau), g[:, None] + add, np.inf)
            arg = cand.argmin(axis=0)
            g = cand[arg, np.arange(n + 1)]
            self._choices.append(arg)
        return np.asarray([g[n]])

    def witness(self, S: int) -> _Witness:
        prob, n = self.prob, self.prob.n
        stops = [n]
        for k in range(S - 1, 0, -1):
            stops.append(int(self._choices[k][stops[-1]]))
        bounds = [0, *reversed(stops)]
        times = [float(self.T[k][bounds[k], bounds[k + 1]]) for k in range(S)]
        bottleneck = max(times)
        if prob.sync:
            a_real = 0.0
            for t in times:
                a_real += t
        else:
            a_real = float(sum(int(prob.model.param_prefix[c]) for c in bounds[1:-1]))
        balance = tuple(bounds[k + 1] - bounds[k] for k in range(S))
        return _Witness(balance, bottleneck, prob.f(bottleneck, a_real))

    def pred(self, top: float, max_s: int) -> float | None:
        best = -math.inf
        for T in self.T:
            below = T[np.isfinite(T) & (T < top)]
            if below.size:
                best = max(best, float(below.max()))
        return best if best > -math.inf else None


_Group = _PrefixGroup | _DenseGroup


def _build_groups(prob: _Problem, pairs: Sequence[tuple[int, int]]) -> list[_Group]:
    if not prob.fast:
        return [_DenseGroup(prob, S, dp) for S, dp in pairs]
    slow = [d.slowdown for d in prob.devices]
    # (dp, device specs from the last stage backwards) -> members; a configuration joins a group whose
    # sequence it is a prefix of, so with identical devices every S of one dp shares one DP pass.
    groups: list[tuple[int, list[DeviceSpec], list[int], dict[int, tuple[tuple[int, ...], ...]]]] = []
    for S, dp in sorted(pairs, key=lambda p: (p[1], -p[0])):
        ids = assign_devices(slow, S, dp)
        specs = [_stage_device(prob.devices, ids[S - m]) for m in range(1, S + 1)]
        for g_dp, g_specs, g_members, g_ids in groups:
            if g_dp == dp and g_specs[:S] == specs:
                g_members.append(S)
                g_ids[S] = ids
                break
        else:
            groups.append((dp, specs, [S], {S: ids}))
    return [_PrefixGroup(prob, dp, specs, members, ids) for dp, specs, members, ids in groups]


def _infeasible_message(prob: _Problem, pairs: Sequence[tuple[int, int]]) -> str:
    least: tuple[int, int, int] | None = None
    for S, dp in pairs:
        # memory if every stage took the single layer where it is cheapest: a lower bound per configuration
        need = 0
        for k in range(S):
            J = np.arange(k + 1, prob.n - S + k + 2) if k < S - 1 else np.asarray([prob.n])
            first = J - 1 if k > 0 else np.zeros_like(J)
            mem = stage_memory(
                prob.model, first, J, stage_idx=k, num_stages=S, schedule=prob.schedule,
                num_microbatches=prob.num_microbatches,
            )  # fmt: skip
            need = max(need, int(mem.min()))
        if least is None or need < least[0]:
            least = (need, S, dp)
    assert least is not None
    caps = sorted({d.memory_cap_bytes for d in prob.devices})
    return (
        f"No partition of the {prob.n} layers fits the memory cap: each stage needs weight versions x params "
        f"+ optimizer state + in-flight activations + workspace <= its device's cap (caps: "
        f"{[format_bytes(c) for c in caps]}). Tried (num_stages, dp) in {sorted(pairs)}; even the most favourable "
        f"(num_stages={least[1]}, dp={least[2]}) needs at least {format_bytes(least[0])} ({least[0]} bytes) on "
        "one stage. Raise memory_cap, allow more stages or devices, use schedule='sync' (one weight version), "
        "or reduce activation memory (smaller micro-batches)."
    )


def _search(prob: _Problem, groups: Sequence[_Group]) -> tuple[float, int, int, tuple[int, ...]] | None:
    """Best-first branch and bound over (group, bottleneck interval); see the module docstring."""
    best: tuple[float, int, int, tuple[int, ...]] | None = None
    bound = math.inf
    counter = itertools.count()
    heap: list[tuple[float, int, int, float, float, FloatArray | None, bool]] = []
    # infeasible[gi][t]: a bottleneck cap known to admit no partition into members[t] stages (F = inf there)
    infeasible = [np.full(len(g.members), -np.inf) for g in groups]

    def lower(gi: int, lo: float, F: FloatArray) -> FloatArray:
        # For tau in (lo, hi]: f(tau, F_S(tau)) >= f(lo, F_S(hi)); and S is infeasible up to infeasible[S].
        return prob.f_vec(np.maximum(max(lo, 0.0), infeasible[gi]), F)

    def push(gi: int, lo: float, hi: float, F: FloatArray, upper: bool = False) -> None:
        lb = float(lower(gi, lo, F).min())
        if lb < bound * (1 - _RTOL):
            heapq.heappush(heap, (lb, next(counter), gi, lo, hi, F, upper))

    def run(gi: int, tau: float, lo: float, max_s: int) -> FloatArray:
        # Evaluate F(tau), learn infeasibility, and rebuild the partitions behind the two most promising F_S
        # (the others stay covered by the search).
        nonlocal best, bound
        group = groups[gi]
        F = group.evaluate(tau, max_s)
        inf_now = ~np.isfinite(F) & (group.members <= max_s)
        infeasible[gi][inf_now] = np.maximum(infeasible[gi][inf_now], tau)
        promising = np.flatnonzero(lower(gi, lo, F) < bound * (1 - _RTOL))
        if promising.size:
            est = prob.f_vec(tau, F[promising]) if math.isfinite(tau) else F[promising]
            for t in promising[np.argsort(est, kind="stable")[:2]]:
                S = int(group.members[t])
                wit = group.witness(S)
                if best is None or wit.objective < best[0]:
                    best = (wit.objective, gi, S, wit.balance)
                    bound = wit.objective
        return F

    for gi, group in enumerate(groups):
        lb0 = float(prob.f_vec(max(group.lo0, 0.0), group.a_lb).min())
        heapq.heappush(heap, (lb0, next(counter), gi, group.lo0, math.nan, None, False))
    while heap:
        lb, _, gi, lo, hi, F, upper = heapq.heappop(heap)
        if lb >= bound * (1 - _RTOL):
            break
        group = groups[gi]
        if F is None:
            top_all = group.pred(math.inf, group.smax)  # the largest stage time of all: F there = F(inf)
            if top_all is not None:
                push(gi, lo, top_all, run(gi, top_all, lo, group.smax))
            continue
        alive = lower(gi, lo, F) < bound * (1 - _RTOL)
        if not alive.any():
            continue
        max_s = int(group.members[alive].max())
        top = min(hi, float(prob.tau_limit_vec(F[alive], bound).max()))
        if not top > lo:
            continue
        p = group.pred(top, max_s)
        if p is None or p <= lo:
            continue
        if upper and top < hi:
            # An upper part (mid, hi] whose F(hi) comes from far above, cut at top by the incumbent:
            # probe the top candidate, which raises F for the whole rest instead of creeping towards top.
            push(gi, lo, p, run(gi, p, lo, max_s))
            continue
        split = math.sqrt(lo * top) if lo > 0 else lo + (top - lo) / 2
        mid = min(p, split)
        if not lo < mid < top:
            mid = p
        Fm = run(gi, mid, lo, max_s)
        push(gi, lo, mid, Fm)
        if mid < p and bool(np.any(Fm[alive] != F[alive])):
            push(gi, mid, hi, F, upper=True)
    return best


def solve(
    model_cost: ModelCost,
    *,
    num_devices: int,
    max_stages: int | None = None,
    schedule: ScheduleLike = "async",
    convergence: ConvergenceModel | None = None,
    cost_model: CostModel | None = None,
    slowdowns: Sequence[float] | None = None,
    memory_cap: float | Sequence[float] | None = None,
    fixed_num_stages: int | None = None,
    dp: int | None = 1,
    num_microbatches: int | None = None,
) -> Plan:
    """The plan with the least predicted time to accuracy (exact; see the module docstring).

    Example::

        >>> model = ModelCost.from_arrays([1.0] * 8, [2.0] * 8, param_bytes=[1] * 8)
        >>> solve(model, num_devices=4, convergence=ConvergenceModel(beta=0.0)).partition.balance
        (2, 2, 2, 2)
        >>> solve(model, num_devices=4, convergence=ConvergenceModel(beta=3.0)).num_stages  # costly staleness
        1

    Args:
        model_cost: per-layer costs (from the profiler).
        num_devices: devices available; the plan uses ``num_stages * dp <= num_devices`` of them.
        max_stages: most stages to consider (default: ``min(num_devices, num_layers)``).
        schedule: ``"async"`` (PipeDream 1F1B, staleness ``S-1-k``) or ``"sync"`` (flush every step).
        convergence: the staleness model; default :class:`ConvergenceModel` (``beta=DEFAULT_BETA``).
        cost_model: the stage time model; default :class:`DefaultCostModel` (no communication charged).
        slowdowns: per-device compute slowdown factors (the runtime adaptation's hook); default all 1.
        memory_cap: bytes per device, one number or one per device; default unlimited.
        fixed_num_stages: plan exactly this many stages instead of choosing.
        dp: data-parallel width of every stage; ``None`` lets the solver choose it too.
        num_microbatches: micro-batches per step ``M`` (required for ``"sync"``).

    Raises:
        ConfigurationError: inconsistent arguments.
        PartitionError: no partition fits the memory caps, or more stages than layers were asked for.
    """
    convergence = convergence or ConvergenceModel()
    cost_model = cost_model or DefaultCostModel()
    devices = _device_specs(num_devices, slowdowns, memory_cap)
    prob = _Problem(model_cost, cost_model, convergence, schedule, num_microbatches, devices)
    n = prob.n
    if dp is not None and (not isinstance(dp, int) or dp < 1 or dp > num_devices):
        raise ConfigurationError(f"dp must be an integer in [1, num_devices={num_devices}] or None; got {dp!r}.")
    if fixed_num_stages is not None:
        if fixed_num_stages < 1 or fixed_num_stages > n:
            raise PartitionError(
                f"fixed_num_stages must be in [1, num_layers={n}] (every stage needs a layer); got {fixed_num_stages}."
            )
        if fixed_num_stages * (dp or 1) > num_devices:
            raise ConfigurationError(
                f"fixed_num_stages * dp = {fixed_num_stages} * {dp or 1} exceeds num_devices={num_devices}. "
                "Use fewer stages, a smaller dp, or more devices."
            )
        stage_range = [fixed_num_stages]
    else:
        most = min(num_devices, n) if max_stages is None else max_stages
        if most < 1:
            raise ConfigurationError(f"max_stages must be >= 1; got {max_stages}.")
        stage_range = list(range(1, min(most, n, num_devices) + 1))
    pairs = [(S, w) for S in stage_range for w in ([dp] if dp is not None else range(1, num_devices // S + 1))]
    pairs = [(S, w) for S, w in pairs if S * w <= num_devices]
    groups = _build_groups(prob, pairs)
    found = _search(prob, groups)
    if found is None:
        raise PartitionError(_infeasible_message(prob, pairs))
    _, gi, S, balance = found
    group = groups[gi]
    return evaluate(
        model_cost, Partition(balance, (group.dp,) * S), schedule=schedule, convergence=convergence,
        cost_model=cost_model, slowdowns=slowdowns, memory_cap=memory_cap, num_microbatches=num_microbatches,
        num_devices=num_devices, devices=group.device_ids[S],
    )  # fmt: skip


def throughput_optimal(
    model_cost: ModelCost,
    *,
    num_devices: int,
    max_stages: int | None = None,
    schedule: ScheduleLike = "async",
    convergence: ConvergenceModel | None = None,
    cost_model: CostModel | None = None,
    slowdowns: Sequence[float] | None = None,
    memory_cap: float | Sequence[float] | None = None,
    fixed_num_stages: int | None = None,
    dp: int | None = 1,
    num_microbatches: int | None = None,
) -> Plan:
    """The plan with the highest predicted throughput, ignoring staleness (``solve`` with ``beta = 0``).

    The comparison point for the time-to-accuracy plan: the plan's ``iterations`` and
    ``time_to_accuracy_s`` are still predicted with the given ``convergence`` model, so the two plans can
    be compared on the same scale.

    Example::

        >>> model = ModelCost.from_arrays([1.0] * 8, [2.0] * 8, param_bytes=[1] * 8)
        >>> throughput_optimal(model, num_devices=4).num_stages
        4
    """
    convergence = convergence or ConvergenceModel()
    plan = solve(
        model_cost, num_devices=num_devices, max_stages=max_stages, schedule=schedule,
        convergence=ConvergenceModel(i0=convergence.i0, beta=0.0), cost_model=cost_model, slowdowns=slowdowns,
        memory_cap=memory_cap, fixed_num_stages=fixed_num_stages, dp=dp, num_microbatches=num_microbatches,
    )  # fmt: skip
    return evaluate(
        model_cost, plan.partition, schedule=schedule, convergence=convergence, cost_model=cost_model,
        slowdowns=slowdowns, memory_cap=memory_cap, num_microbatches=num_microbatches, num_devices=num_devices,
        devices=plan.devices,
    )  # fmt: skip
