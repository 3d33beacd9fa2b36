"""Stage statistics as plain data: one stage's numbers for one step, rolling medians, and a pipeline snapshot.

Pure (standard library only): no torch, no torch.distributed, no Lightning. The executor's
:class:`~lightning_dynpipe.engine.executor.StepStats` reach :meth:`StageSample.from_step` through the
:class:`StepTimes` protocol, and the process/GPU readings through :class:`SystemReading`, which
:mod:`lightning_dynpipe.monitor.system` fills in. The Lightning side (gathering, logging) lives in
:mod:`lightning_dynpipe.monitor.callback`.

Vocabulary of one stage's step (seconds, wall clock, as the executor measures them)::

    step_s = forward_s + backward_s + optimizer_s   (compute_s: the stage's own work)
           + send_s                                 (handing tensors to the next/previous stage)
           + recv_wait_s                            (blocked until a neighbour's message was there)
           + idle_s                                 (the rest: schedule bookkeeping, Python, hooks)

    busy_s = compute_s + send_s      the time the stage *needs* per step; in a pipeline every stage's
                                     step_s converges to the slowest stage's busy_s, so busy_s (not
                                     step_s) is what tells the stages apart.

Counts per step: ``num_forward`` / ``num_backward`` micro-batches the stage ran forward / backward, and
``num_updates`` optimizer steps it took (``async``: M each per step in steady state; ``sync`` and
``gpipe``: M, M and 1).
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Protocol

__all__ = [
    "register_helper",
    "unregister_helper",
    "helper_pids",
    "process_children",
    "process_descendants",
    "read_proc",
    "helpers_cpu_s",
    "process_cpu_s",
    "process_cpu_and_start_s",
    "INTERFERENCE_SIGNS",
    "InterferenceReadings",
    "interference_excess",
    "METRIC_NAMES",
    "PipelineSnapshot",
    "REPORT_LENGTH",
    "StageReport",
    "StageSample",
    "StageStatsAccumulator",
    "StageSummary",
    "StepTimes",
    "SystemReading",
    "idle_time",
    "mean_step_time",
]

_MIB = float(1 << 20)


class StepTimes(Protocol):
    """What :meth:`StageSample.from_step` reads from a step: the executor's ``StepStats`` satisfy it."""

    @property
    def forward_s(self) -> float: ...
    @property
    def backward_s(self) -> float: ...
    @property
    def optimizer_s(self) -> float: ...
    @property
    def recv_wait_s(self) -> float: ...
    @property
    def send_s(self) -> float: ...
    @property
    def comm_s(self) -> float: ...
    @property
    def exposed_comm_s(self) -> float: ...
    @property
    def step_s(self) -> float: ...
    @property
    def num_forward(self) -> int: ...
    @property
    def num_backward(self) -> int: ...
    @property
    def num_updates(self) -> int: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def stash_depth(self) -> int: ...


@dataclass(frozen=True)
class SystemReading:
    """The stage process's resource use over one sampling window (see :class:`~.system.ProcessSampler`).

    Attributes:
        wall_s: length of the window.
        cpu_s: CPU time of this process (all threads, user + system) in the window.
        cpu_share: ``cpu_s / wall_s``: cores this process kept busy (1.0 = one full core; above 1 with
            several busy threads).
        steal_share: share of the machine's CPU time stolen by the hypervisor (0 where not reported).
        cpu_limit: the cgroup CPU bandwidth limit on this process in cores
            (:func:`~lightning_dynpipe.monitor.cgroups.cpu_limit_cores`), None when nothing limits it.
        rss_bytes: resident set size at the end of the window.
        cuda_allocated_bytes / cuda_reserved_bytes: the CUDA caching allocator's current numbers (None when
            the stage is not on a CUDA device).
        gpu_util: GPU utilisation from NVML, 0..1 (None without CUDA or without ``pynvml``).
        gpu_mem_used_bytes: device memory in use from NVML, all processes (None likewise).
        run_queue_wait_share: share of the window the stage's main thread was runnable but waiting for a core
            (``/proc/self/schedstat``; 0 where not reported).
        ctx_switches_per_s: involuntary context switches (preemptions) of this process per second.
        other_cpu_load: cores' worth of CPU time that other processes used on the cores this process may run
            on (``/proc/stat`` per core, minus this process's own time; None where not reported).
        gpu_sm_clock_mhz: the SM clock from NVML (None without CUDA or ``pynvml``).
        gpu_throttled: 1 when NVML reports a clock throttle reason other than idle, else 0 (None likewise).
        gpu_other_mem_bytes: device memory used by other processes, from NVML's process list (None likewise).
        step_cpu_s: CPU time of this process since the previous reading (all threads): a whole training step's cycle,
            the work between the batch hooks included (``cpu_s`` starts at the batch's start), except what ran
            between a :meth:`~.system.ProcessSampler.pause` and the next window's start (the stage monitor pauses for a
            validation run and an epoch's end). Under a cgroup CPU limit this is what the quota must pay for every
            step.
    """

    wall_s: float = 0.0
    cpu_s: float = 0.0
    cpu_share: float = 0.0
    steal_share: float = 0.0
    rss_bytes: int = 0
    cuda_allocated_bytes: int | None = None
    cuda_reserved_bytes: int | None = None
    gpu_util: float | None = None
    gpu_mem_used_bytes: int | None = None
    cpu_limit: float | None = None
    run_queue_wait_share: float = 0.0
    ctx_switches_per_s: float = 0.0
    other_cpu_load: float | None = None
    gpu_sm_clock_mhz: float | None = None
    gpu_throttled: float | None = None
    gpu_other_mem_bytes: int | None = None
    step_cpu_s: float = 0.0


def idle_time(step_s: float, compute_s: float, recv_wait_s: float, send_s: float) -> float:
    """The part of a step that is neither compute, nor waiting for a message, nor sending (never negative)."""
    return max(0.0, step_s - compute_s - recv_wait_s - send_s)


@dataclass(frozen=True, slots=True)
class StageSample:
    """One stage's numbers for one step.

    Example::

        sample = StageSample.from_step(trainer.strategy.executor.stats, sampler.sample())
        accumulator.add(sample)

    Times are in seconds. ``idle_s`` is derived (:func:`idle_time`); build samples with :meth:`from_step`
    so that it is consistent with the other times. ``num_forward``, ``num_backward`` and ``num_updates``
    count the micro-batch forwards, backwards and optimizer steps the stage ran in the step. ``cpu_s`` is the
    process's CPU time over the step's whole cycle (:attr:`SystemReading.step_cpu_s`).
    """

    step_s: float
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    recv_wait_s: float = 0.0
    send_s: float = 0.0
    idle_s: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    num_forward: int = 0
    num_backward: int = 0
    num_updates: int = 0
    in_flight: int = 0
    stash_depth: int = 0
    rss_bytes: int = 0
    cpu_share: float = 0.0
    steal_share: float = 0.0
    cuda_allocated_bytes: int | None = None
    cuda_reserved_bytes: int | None = None
    gpu_util: float | None = None
    gpu_mem_used_bytes: int | None = None
    cpu_limit: float | None = None
    run_queue_wait_share: float = 0.0
    ctx_switches_per_s: float = 0.0
    other_cpu_load: float | None = None
    gpu_sm_clock_mhz: float | None = None
    gpu_throttled: float | None = None
    gpu_other_mem_bytes: int | None = None
    cpu_s: float = 0.0

    @classmethod
    def from_step(cls, step: StepTimes, system: SystemReading | None = None) -> StageSample:
        """Combines the executor's times for one step with the process readings over it."""
        compute = step.forward_s + step.backward_s + step.optimizer_s
        sys_ = system if system is not None else SystemReading()
        return cls(
            step_s=step.step_s,
            forward_s=step.forward_s,
            backward_s=step.backward_s,
            optimizer_s=step.optimizer_s,
            recv_wait_s=step.recv_wait_s,
            send_s=step.send_s,
            idle_s=idle_time(step.step_s, compute, step.recv_wait_s, step.send_s),
            comm_s=step.comm_s,
            exposed_comm_s=step.exposed_comm_s,
            num_forward=step.num_forward,
            num_backward=step.num_backward,
            num_updates=step.num_updates,
            in_flight=step.in_flight,
            stash_depth=step.stash_depth,
            rss_bytes=sys_.rss_bytes,
            cpu_share=sys_.cpu_share,
            steal_share=sys_.steal_share,
            cuda_allocated_bytes=sys_.cuda_allocated_bytes,
            cuda_reserved_bytes=sys_.cuda_reserved_bytes,
            gpu_util=sys_.gpu_util,
            gpu_mem_used_bytes=sys_.gpu_mem_used_bytes,
            cpu_limit=sys_.cpu_limit,
            run_queue_wait_share=sys_.run_queue_wait_share,
            ctx_switches_per_s=sys_.ctx_switches_per_s,
            other_cpu_load=sys_.other_cpu_load,
            gpu_sm_clock_mhz=sys_.gpu_sm_clock_mhz,
            gpu_throttled=sys_.gpu_throttled,
            gpu_other_mem_bytes=sys_.gpu_other_mem_bytes,
            cpu_s=sys_.step_cpu_s,
        )

    @property
    def compute_s(self) -> float:
        """Forward plus backward plus optimizer time."""
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def busy_s(self) -> float:
        """Compute plus send time: what the stage needed in this step, its waits excluded."""
        return self.compute_s + self.send_s


_SAMPLE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StageSample))


def mean_step_time(step_s: Sequence[float]) -> float:
    """The mean of per-step times without the slowest (NaN for none; all of them for fewer than four).

    The mean, not the median, is what a pipeline's throughput follows; the slowest step is left out because one
    step that waited for a checkpoint or a validation drain would otherwise move it.

    Example::

        >>> round(mean_step_time([0.05] * 12 + [0.125] * 8), 4)  # a CPU quota: 8 steps of 20 wait a period
        0.0776
        >>> round(mean_step_time([0.05] * 19 + [5.0]), 4)        # one step that waited for a checkpoint
        0.05
    """
    values = [v for v in step_s if not math.isnan(v)]
    if not values:
        return math.nan
    if len(values) >= 4:
        values.remove(max(values))
    return float(sum(values) / len(values))


def _spread(values: Sequence[float]) -> float:
    """90th minus 10th percentile (nearest rank) of ``values``; 0 for fewer than two."""
    if len(values) < 2:
        return 0.0
    ordered = sorted(values)
    last = len(ordered) - 1
    return float(ordered[round(0.9 * last)] - ordered[round(0.1 * last)])


_OPTIONAL_FIELDS = frozenset(
    {
        "cuda_allocated_bytes",
        "cuda_reserved_bytes",
        "gpu_util",
        "gpu_mem_used_bytes",
        "cpu_limit",
        "other_cpu_load",
        "gpu_sm_clock_mhz",
        "gpu_throttled",
        "gpu_other_mem_bytes",
    }
)
_SMALLEST_WINS = frozenset({"cpu_limit"})  # across replicas, the tightest limit sets the stage's pace


@dataclass(frozen=True)
class StageSummary:
    """Medians of one stage's samples over a window (the fields of :class:`StageSample`), plus their count.

    Medians, not means: one step that waited for a checkpoint or a validation drain should not move the
    picture. Optional readings (CUDA, NVML) are the median of the samples that had them, None if none did.
    A summary of no samples (``count == 0``) holds NaN times.

    ``compute_s`` (forward + backward + optimizer) and ``busy_s`` (compute + send) are the medians of the
    per-step sums, so they compare with ``step_s`` step by step (a sum of medians need not). ``comm_spread_s``
    is the spread of the per-step transfer time (90th minus 10th percentile): the link's jitter as the stage
    saw it.

    ``mean_cpu_s`` is the mean of the per-step CPU time of the process (``cpu_s``: a step's whole cycle, every
    thread) without the window's largest (0 in a summary built without it): the CPU a step costs, which a cgroup
    CPU limit of ``q`` cores stretches to at least ``mean_cpu_s / q`` per step.

    ``mean_step_s`` is the mean step time without the window's slowest step (:func:`mean_step_time`; 0 in a
    summary built without it): the stage's throughput. The median is not when step times are bimodal, as under
    a CPU quota, which stops a process for the rest of its period once it used its share: some steps fit in the
    share and some wait a period, and the median follows the majority however long the others wait.
    """

    count: int
    compute_s: float
    busy_s: float
    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    recv_wait_s: float
    send_s: float
    idle_s: float
    comm_s: float
    exposed_comm_s: float
    num_forward: float
    num_backward: float
    num_updates: float
    in_flight: float
    stash_depth: float
    rss_bytes: float
    cpu_share: float
    steal_share: float
    cuda_allocated_bytes: float | None = None
    cuda_reserved_bytes: float | None = None
    gpu_util: float | None = None
    gpu_mem_used_bytes: float | None = None
    cpu_limit: float | None = None
    run_queue_wait_share: float = 0.0
    ctx_switches_per_s: float = 0.0
    other_cpu_load: float | None = None
    gpu_sm_clock_mhz: float | None = None
    gpu_throttled: float | None = None
    gpu_other_mem_bytes: float | None = None
    comm_spread_s: float = 0.0
    mean_step_s: float = 0.0
    cpu_s: float = 0.0
    mean_cpu_s: float = 0.0

    @classmethod
    def of(cls, samples: Iterable[StageSample]) -> StageSummary:
        """The summary of ``samples`` (any order)."""
        items = list(samples)
        values: dict[str, float | None] = {}
        for name in _SAMPLE_FIELDS:
            if name in _OPTIONAL_FIELDS:
                present = [v for v in (getattr(s, name) for s in items) if v is not None]
                values[name] = float(statistics.median(present)) if present else None
            else:
                values[name] = float(statistics.median([getattr(s, name) for s in items])) if items else math.nan
        for name, per_step in (("compute_s", [s.compute_s for s in items]), ("busy_s", [s.busy_s for s in items])):
            values[name] = float(statistics.median(per_step)) if items else math.nan
        values["comm_spread_s"] = _spread([s.comm_s for s in items]) if items else math.nan
        values["mean_step_s"] = mean_step_time([s.step_s for s in items])
        values["mean_cpu_s"] = mean_step_time([s.cpu_s for s in items])
        return cls(count=len(items), **values)  # type: ignore[arg-type]

    @classmethod
    def combine(cls, summaries: Sequence[StageSummary]) -> StageSummary:
        """The aggregate of one stage's data-parallel replicas: each field's maximum, the smallest count.

        Replicas of a stage all-reduce their gradients at every update, so they advance in lockstep and the
        slowest replica sets the stage's pace; the maximum also bounds memory per process. ``cpu_limit`` is
        the exception: the smallest limit (the most constrained replica) is kept.
        """
        if not summaries:
            raise ValueError("combine() needs at least one StageSummary; got none.")
        if len(summaries) == 1:
            return summaries[0]
        values: dict[str, float | None] = {}
        for name in (*_SAMPLE_FIELDS, "compute_s", "busy_s", "comm_spread_s", "mean_step_s", "mean_cpu_s"):
            got = [getattr(s, name) for s in summaries]
            present = [v for v in got if v is not None and not math.isnan(v)]
            if present:
                values[name] = min(present) if name in _SMALLEST_WINS else max(present)
            else:
                values[name] = None if name in _OPTIONAL_FIELDS else math.nan
        return cls(count=min(s.count for s in summaries), **values)  # type: ignore[arg-type]

    @property
    def comm_overlap(self) -> float:
        """Share of incoming transfer time hidden behind compute (1 with no transfers)."""
        return 1.0 if not self.comm_s > 0 else max(0.0, 1.0 - self.exposed_comm_s / self.comm_s)


class InterferenceReadings(Protocol):
    """The readings :func:`interference_excess` compares: a :class:`StageSummary`, or the predictor's
    ``StageTimes`` (a monitor window's medians, recorded or synthetic)."""

    @property
    def cpu_share(self) -> float: ...
    @property
    def cpu_limit(self) -> float | None: ...
    @property
    def other_cpu_load(self) -> float | None: ...
    @property
    def run_queue_wait_share(self) -> float: ...
    @property
    def gpu_throttled(self) -> float | None: ...


def interference_excess(summaries: Sequence[InterferenceReadings]) -> list[str] | None:
    """For the replicas of one stage: what each one's system readings show beyond the least affected replica's.

    A slowdown with a cause that lasts is visible in the readings: a cgroup CPU limit below one core (and below
    the others'), other processes busy on its cores, its main thread runnable but waiting for a core, a throttled
    GPU clock. Each counts only by how much it exceeds the replica that shows the least of it, so what every
    replica shares says nothing about which one is slow: processes of the same job sharing cores, a process's
    own threads competing with its main thread on a pinned core, CPU time the hypervisor steals from the whole
    machine (not used at all). A replica slowed with no such excess (a noisy neighbour outside this machine's
    view, a passing hiccup) gets ``""``. Thresholds: :data:`INTERFERENCE_SIGNS`. Returns ``None`` when a
    summary has no system readings (no sampler, or a platform without them).
    """
    if not summaries or any(not s.cpu_share > 0 for s in summaries):
        return None
    t = INTERFERENCE_SIGNS
    limits = [s.cpu_limit if s.cpu_limit is not None else math.inf for s in summaries]
    others = [s.other_cpu_load or 0.0 for s in summaries]
    waits = [s.run_queue_wait_share for s in summaries]
    throttled = [(s.gpu_throttled or 0.0) >= t["gpu_throttled"] for s in summaries]
    out = []
    for i in range(len(summaries)):
        signs = []
        if limits[i] < t["cpu_limit"] and limits[i] < max(limits):
            signs.append(f"cgroup CPU limit {limits[i]:.2f} cores")
        if others[i] - min(others) >= t["other_cpu_load"]:
            signs.append(f"other processes busy on its cores ({others[i]:.2f} cores)")
        if waits[i] - min(waits) >= t["run_queue_wait_share"]:
            signs.append(f"waiting for a core {waits[i]:.0%} of the time")
        if throttled[i] and not all(throttled):
            signs.append("GPU clock throttled")
        out.append(", ".join(signs))
    return out


INTERFERENCE_SIGNS: dict[str, float] = {
    "cpu_limit": 1.0,  # cores: a limit below one core throttles a stage's main thread
    "other_cpu_load": 0.25,  # cores' worth of other processes' CPU time on its cores, beyond the least affected
    "run_queue_wait_share": 0.30,  # share of the time its main thread waited for a core, beyond the least affected
    "gpu_throttled": 0.5,  # median of NVML's throttle flag over the window
}
"""Thresholds of :func:`interference_excess` (medians over the monitor's window)."""


class StageStatsAccumulator:
    """A rolling window of one stage's samples; :meth:`summary` gives their medians.

    Example::

        acc = StageStatsAccumulator(window=20)
        for step in range(100):
            acc.add(StageSample.from_step(executor.stats, sampler.sample()))
        acc.summary().busy_s          # median over the last 20 steps

    ``add`` is O(1) (a bounded deque); ``summary`` sorts the window once per field.

    Args:
        window: how many of the most recent samples to keep (>= 1).
    """

    def __init__(self, window: int) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be a positive number of steps; got {window!r}. Use e.g. window=20.")
        self.window = window
        self._samples: deque[StageSample] = deque(maxlen=window)
        self.total = 0

    def add(self, sample: StageSample) -> None:
        """Appends one step's sample, dropping the oldest once the window is full."""
        self._samples.append(sample)
        self.total += 1

    def reset(self) -> None:
        """Forgets every sample (e.g. after a repartition: old samples describe the old stage)."""
        self._samples.clear()
        self.total = 0

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def samples(self) -> tuple[StageSample, ...]:
        """The samples in the window, oldest first."""
        return tuple(self._samples)

    @property
    def last(self) -> StageSample | None:
        """The most recent sample, if any."""
        return self._samples[-1] if self._samples else None

    def summary(self) -> StageSummary:
        """Medians of the samples in the window."""
        return StageSummary.of(self._samples)


@dataclass(frozen=True)
class StageReport:
    """One process's summary, tagged with where it runs: what every rank contributes to a snapshot.

    It travels as a fixed-length vector of floats (:meth:`to_vector` / :meth:`from_vector`), so the gather
    is one plain all-gather of :data:`REPORT_LENGTH` numbers per rank: no pickling, no size exchange.

    ``token`` is a number the process publishes with its report for the listeners to agree on (the adaptive loop:
    the newest background refit of its predictor that is finished on this rank); every rank sees every token, so
    :attr:`PipelineSnapshot.agreed_token` (their minimum) is the same everywhere.
    """

    dp_rank: int
    stage_idx: int
    summary: StageSummary
    token: float = 0.0
    rank: int = -1
    """The process's global rank: its place in the gather (not in the vector); ``-1``: not known."""

    def to_vector(self) -> list[float]:
        """``[dp_rank, stage_idx, count, <summary fields>, token]``; None travels as NaN."""
        s = self.summary
        values = [getattr(s, name) for name in _SUMMARY_FIELDS]
        return [
            float(self.dp_rank),
            float(self.stage_idx),
            float(s.count),
            *(math.nan if v is None else float(v) for v in values),
            float(self.token),
        ]

    @classmethod
    def from_vector(cls, vector: Sequence[float]) -> StageReport:
        """The inverse of :meth:`to_vector` (optional readings that were None come back as None)."""
        if len(vector) != REPORT_LENGTH:
            raise ValueError(
                f"A StageReport vector has {REPORT_LENGTH} entries; got {len(vector)}. Every rank must run the "
                "same version of lightning_dynpipe."
            )
        values: dict[str, float | None] = {}
        for name, v in zip(_SUMMARY_FIELDS, vector[3:-1]):
            values[name] = None if name in _OPTIONAL_FIELDS and math.isnan(v) else float(v)
        summary = StageSummary(count=int(vector[2]), **values)  # type: ignore[arg-type]
        return cls(dp_rank=int(vector[0]), stage_idx=int(vector[1]), summary=summary, token=float(vector[-1]))


_SUMMARY_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StageSummary) if f.name != "count")
REPORT_LENGTH = 3 + len(_SUMMARY_FIELDS) + 1
"""Entries of :meth:`StageReport.to_vector`."""


# (metric name, StageSummary attribute or property, scale). Times in ms; bytes in MiB (2**20).
_METRICS: tuple[tuple[str, str, float], ...] = (
    ("step_ms", "step_s", 1e3),
    ("mean_step_ms", "mean_step_s", 1e3),
    ("mean_cpu_ms", "mean_cpu_s", 1e3),
    ("compute_ms", "compute_s", 1e3),
    ("busy_ms", "busy_s", 1e3),
    ("forward_ms", "forward_s", 1e3),
    ("backward_ms", "backward_s", 1e3),
    ("optimizer_ms", "optimizer_s", 1e3),
    ("recv_wait_ms", "recv_wait_s", 1e3),
    ("send_ms", "send_s", 1e3),
    ("idle_ms", "idle_s", 1e3),
    ("comm_ms", "comm_s", 1e3),
    ("exposed_comm_ms", "exposed_comm_s", 1e3),
    ("comm_overlap", "comm_overlap", 1.0),
    ("in_flight", "in_flight", 1.0),
    ("stash_depth", "stash_depth", 1.0),
    ("cpu_share", "cpu_share", 1.0),
    ("steal_share", "steal_share", 1.0),
    ("cpu_limit", "cpu_limit", 1.0),
    ("rss_mb", "rss_bytes", 1.0 / _MIB),
    ("cuda_allocated_mb", "cuda_allocated_bytes", 1.0 / _MIB),
    ("cuda_reserved_mb", "cuda_reserved_bytes", 1.0 / _MIB),
    ("gpu_util", "gpu_util", 1.0),
    ("gpu_mem_used_mb", "gpu_mem_used_bytes", 1.0 / _MIB),
    ("run_queue_wait_share", "run_queue_wait_share", 1.0),
    ("ctx_switches_per_s", "ctx_switches_per_s", 1.0),
    ("other_cpu_load", "other_cpu_load", 1.0),
    ("gpu_sm_clock_mhz", "gpu_sm_clock_mhz", 1.0),
    ("gpu_throttled", "gpu_throttled", 1.0),
    ("gpu_other_mem_mb", "gpu_other_mem_bytes", 1.0 / _MIB),
    ("comm_spread_ms", "comm_spread_s", 1e3),
    ("samples", "count", 1.0),
)

METRIC_NAMES: tuple[str, ...] = tuple(name for name, _, _ in _METRICS)
"""Per-stage metric names of :meth:`PipelineSnapshot.to_metrics` (``dynpipe/stage{k}/<name>``)."""


def _summary_metrics(prefix: str, summary: StageSummary) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, attr, scale in _METRICS:
        value = getattr(summary, attr)
        if value is None or (attr in ("mean_step_s", "mean_cpu_s") and not value > 0):  # 0: a summary built without it
            continue
        out[f"{prefix}/{name}"] = float(value) * scale
    return out


@dataclass(frozen=True)
class PipelineSnapshot:
    """Every stage's summary at one step: identical on every rank after the monitor's gather.

    Example::

        snap = PipelineSnapshot.from_reports(step=120, reports=gathered)
        snap.stages[snap.bottleneck_stage].busy_s
        trainer.logger.log_metrics(snap.to_metrics(), step=snap.step)

    Attributes:
        step: the trainer's ``global_step`` when the snapshot was taken.
        stages: per-stage aggregate, index ``k`` = stage ``k`` (with several pipeline replicas, the
            field-wise maximum over the replicas of the stage, see :meth:`StageSummary.combine`).
        replicas: every process's own summary, ordered by ``(stage_idx, dp_rank)``.
        balance: layers per stage of the partition the samples were taken under (None when unknown).
    """

    step: int
    stages: tuple[StageSummary, ...]
    replicas: tuple[StageReport, ...]
    balance: tuple[int, ...] | None = None

    @classmethod
    def from_reports(
        cls, step: int, reports: Iterable[StageReport], balance: Sequence[int] | None = None
    ) -> PipelineSnapshot:
        """Builds a snapshot from each process's report; every stage ``0..S-1`` must be present."""
        ordered = sorted(reports, key=lambda r: (r.stage_idx, r.dp_rank))
        if not ordered:
            raise ValueError("A PipelineSnapshot needs at least one StageReport; got none.")
        seen = [(r.dp_rank, r.stage_idx) for r in ordered]
        if len(set(seen)) != len(seen):
            raise ValueError(
                f"Each (dp_rank, stage_idx) may report once; got {seen}. Gather exactly one report per process."
            )
        stage_ids = sorted({r.stage_idx for r in ordered})
        if stage_ids != list(range(len(stage_ids))):
            raise ValueError(
                f"Reports must cover stages 0..S-1 without gaps; got stages {stage_ids}. Gather the reports of "
                "every process of the pipeline (all ranks of WORLD)."
            )
        stages = tuple(StageSummary.combine([r.summary for r in ordered if r.stage_idx == k]) for k in stage_ids)
        if balance is not None and len(balance) != len(stages):
            raise ValueError(
                f"balance has {len(balance)} entries but the reports cover {len(stages)} stages; pass the "
                "partition the reports were measured under."
            )
        return cls(
            step=step,
            stages=stages,
            replicas=tuple(ordered),
            balance=tuple(int(b) for b in balance) if balance is not None else None,
        )

    @property
    def num_stages(self) -> int:
        """``S``."""
        return len(self.stages)

    @property
    def agreed_token(self) -> float:
        """The smallest :attr:`StageReport.token` of all processes (the same on every rank)."""
        return min(r.token for r in self.replicas)

    @property
    def dp_size(self) -> int:
        """Pipeline replicas that reported."""
        return len({r.dp_rank for r in self.replicas})

    def replica(self, dp_rank: int, stage_idx: int) -> StageSummary:
        """The summary of stage ``stage_idx`` in pipeline replica ``dp_rank``."""
        for r in self.replicas:
            if r.dp_rank == dp_rank and r.stage_idx == stage_idx:
                return r.summary
        known = [(r.dp_rank, r.stage_idx) for r in self.replicas]
        raise KeyError(f"No report from dp_rank={dp_rank}, stage_idx={stage_idx}; known (dp_rank, stage_idx): {known}.")

    @property
    def bottleneck_stage(self) -> int | None:
        """The stage with the largest median busy time (compute + send): the one the others wait for.

        Ties go to the lower stage index. None only when no stage has samples.
        """
        best: int | None = None
        best_busy = -math.inf
        for k, s in enumerate(self.stages):
            busy = s.busy_s
            if not math.isnan(busy) and busy > best_busy:
                best, best_busy = k, busy
        return best

    @property
    def step_s(self) -> float:
        """The pipeline's step time: the largest median step time of any stage."""
        times = [s.step_s for s in self.stages if not math.isnan(s.step_s)]
        return max(times) if times else math.nan

    @property
    def imbalance(self) -> float:
        """Largest busy time over the mean busy time of the stages (1.0: perfectly balanced)."""
        busy = [s.busy_s for s in self.stages if not math.isnan(s.busy_s)]
        mean = sum(busy) / len(busy) if busy else math.nan
        return max(busy) / mean if busy and mean > 0 else math.nan

    def to_metrics(self, prefix: str = "dynpipe", *, per_replica: bool = False) -> dict[str, float]:
        """Flat metrics for Lightning loggers.

        Keys: ``{prefix}/stage{k}/<name>`` for each name of :data:`METRIC_NAMES` whose value exists (times in
        ms, memory in MiB, shares in 0..1), plus ``{prefix}/step_ms``, ``{prefix}/bottleneck_stage`` and
        ``{prefix}/imbalance``. ``per_replica=True`` adds ``{prefix}/stage{k}/replica{d}/<name>``.
        """
        out: dict[str, float] = {}
        for k, summary in enumerate(self.stages):
            out.update(_summary_metrics(f"{prefix}/stage{k}", summary))
        if per_replica:
            for r in self.replicas:
                out.update(_summary_metrics(f"{prefix}/stage{r.stage_idx}/replica{r.dp_rank}", r.summary))
        out[f"{prefix}/step_ms"] = self.step_s * 1e3
        bottleneck = self.bottleneck_stage
        if bottleneck is not None:
            out[f"{prefix}/bottleneck_stage"] = float(bottleneck)
        out[f"{prefix}/imbalance"] = self.imbalance
        return out

    def table(self) -> str:
        """A fixed-width text table, one row per stage (ms, MiB), the bottleneck marked with ``*``.

        ``F/B/U``: micro-batch forwards, backwards and optimizer updates per step. The title gives the
        step and, when known, the partition (layers per stage) the numbers were measured under.
        """
        headers = (
            "stage",
            "step",
            "busy",
            "fwd",
            "bwd",
            "opt",
            "recv wait",
            "send",
            "idle",
            "exp. comm",
            "F/B/U",
            "in flight",
            "cpu",
            "rss MiB",
            "n",
        )
        rows = []
        bottleneck = self.bottleneck_stage
        for k, s in enumerate(self.stages):
            ms = [
                s.step_s,
                s.busy_s,
                s.forward_s,
                s.backward_s,
                s.optimizer_s,
                s.recv_wait_s,
                s.send_s,
                s.idle_s,
                s.exposed_comm_s,
            ]
            counts = "/".join(f"{c:g}" for c in (s.num_forward, s.num_backward, s.num_updates))
            rows.append(
                [
                    f"{k}{'*' if k == bottleneck else ''}",
                    *(f"{v * 1e3:.1f}" for v in ms),
                    counts,
                    f"{s.in_flight:g}",
                    f"{s.cpu_share:.2f}",
                    f"{s.rss_bytes / _MIB:.0f}",
                    str(s.count),
                ]
            )
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        where = f"step {self.step}" + (f", balance {list(self.balance)}" if self.balance is not None else "")
        legend = "medians per step: ms, F/B/U = forwards/backwards/updates; * = bottleneck"
        return f"DynPipe stages at {where} ({legend})\n" + "\n".join(lines)


# ---- this process's helpers: their CPU is this process's own, not other processes' load
_HELPERS: set[int] = set()


def register_helper(pid: int) -> None:
    """Counts process ``pid`` (a child this process started to work for it, e.g. the forest's refit process) as
    this process's own CPU use, not as other processes' load on its cores."""
    _HELPERS.add(pid)


def unregister_helper(pid: int) -> None:
    """Undoes :func:`register_helper` (when the helper ends)."""
    _HELPERS.discard(pid)


def helper_pids() -> list[int]:
    """The processes registered with :func:`register_helper`."""
    return sorted(_HELPERS)


def helpers_cpu_s() -> float:
    """CPU seconds (user + system) the registered helpers have used; 0 where ``/proc`` is not available."""
    return sum(process_cpu_s(pid) for pid in list(_HELPERS))


_CLOCK_TICKS_PER_S = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


def process_children(pid: int) -> list[int]:
    """The children of process ``pid`` (of every thread: a child belongs to the thread that started it), from
    ``/proc/<pid>/task/<tid>/children``; empty where ``/proc`` does not list them."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tids:
        try:
            out.extend(int(c) for c in read_proc(f"/proc/{pid}/task/{tid}/children").split())
        except (OSError, ValueError):
            continue
    return out


def process_descendants(pid: int, exclude: Collection[int] = ()) -> list[int]:
    """The children of process ``pid``, their children, and so on (``pid`` left out); the processes in ``exclude``
    and what they started are left out too."""
    found: dict[int, None] = {}  # in the order found, each once
    todo = process_children(pid)
    while todo:
        child = todo.pop()
        if child == pid or child in found or child in exclude:
            continue
        found[child] = None
        todo.extend(process_children(child))
    return list(found)


def read_proc(path: str) -> bytes:
    """The start (4 KiB) of a small ``/proc`` file, with ``os.open`` and ``os.read`` (a third of ``open()``'s cost)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used; 0 where ``/proc`` cannot tell (gone, not Linux)."""
    return max(0.0, process_cpu_and_start_s(pid)[0])


def process_cpu_and_start_s(pid: int) -> tuple[float, float]:
    """Process ``pid``'s CPU seconds (user + system) and its start, in seconds since boot; ``(-1, 0)`` where
    ``/proc`` cannot tell (gone, not Linux)."""
    hz = _CLOCK_TICKS_PER_S
    try:
        fields = read_proc(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()  # after the command name: field 3 onwards
        return (int(fields[11]) + int(fields[12])) / hz, int(fields[19]) / hz  # utime + stime, starttime
    except (OSError, IndexError, ValueError):
        return -1.0, 0.0
