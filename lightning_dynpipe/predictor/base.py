"""What a predictor sees and what it answers: measured windows in, per-stage and per-boundary times out.

The adaptive loop measures the pipeline under its current partition only, but must price partitions that
have not run. An :class:`InterferencePredictor` bridges the two: given what the monitor measured over one
window (:class:`PipelineWindow`), the planner's per-layer profile and the link model, it predicts for any
candidate partition each stage's compute time per micro-batch and each boundary's time per message, each
with an interval, and the slowdown of each stage against the profile (what interference does to it).

Everything here is plain data: no torch, no Lightning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.monitor.stats import INTERFERENCE_SIGNS, StageSummary, interference_excess
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition

__all__ = [
    "StageTimes",
    "PipelineWindow",
    "Interval",
    "PartitionPrediction",
    "InterferencePredictor",
    "check_same_pipeline",
    "cpu_contended",
]


_ONE_CORE = 1.1
"""Busy plus waiting shares up to which a stage's process counts as one thread's worth of work (the readings of one
busy thread sum to 1.0-1.05: the receive threads' CPU and the sampling's noise)."""


@dataclass(frozen=True)
class StageTimes:
    """Per-step medians of one stage over the monitor's window (seconds).

    Attributes:
        compute_s: forward plus backward time of the stage's layers per step.
        step_s: wall time of the step on this stage.
        comm_s: time the incoming transfers took per step.
        exposed_comm_s: the part of ``comm_s`` the stage waited for (not hidden behind compute).
        cpu_limit: cgroup CPU bandwidth limit of the stage's process, in cores; ``None`` when nothing limits it.
        comm_spread_s: spread of the per-step transfer time (90th minus 10th percentile): the link's jitter.
        cpu_share: cores the stage's process kept busy.
        steal_share: share of the machine's CPU time stolen by the hypervisor.
        run_queue_wait_share: share of the time the stage's main thread waited for a core.
        other_cpu_load: cores' worth of CPU other processes used on the stage's cores (``None``: unknown).
        ctx_switches_per_s: involuntary context switches of the stage's process per second.
        rss_bytes: resident set size of the stage's process.
        gpu_util: GPU utilisation 0..1 (``None`` without CUDA or NVML), and likewise:
        gpu_sm_clock_mhz: the SM clock;
        gpu_throttled: 1 when the clocks are throttled (not idle), else 0;
        gpu_other_mem_bytes: device memory used by other processes.
        mean_step_s: the mean step time over the window without its slowest step (the stage's throughput,
            which the median ``step_s`` misjudges when step times are bimodal, as under a CPU quota); 0 when
            not measured, and ``step_s`` stands in.
        cpu_s: the stage process's mean CPU time per step (every thread, the step's whole cycle); 0 when not
            measured.
        num_updates: optimizer updates per step on the stage; 0 when not measured.
        recv_wait_s: time per step the stage was blocked until a neighbour's message was there (a link's time it
            waited for, or a neighbour that had not sent yet); 0 when not measured.

    The fields from ``cpu_limit`` to ``gpu_other_mem_bytes`` describe the stage's environment; they are the
    forest's features (:mod:`lightning_dynpipe.predictor.features`) and default to "nothing measured".
    """

    compute_s: float
    step_s: float
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    cpu_limit: float | None = None
    comm_spread_s: float = 0.0
    cpu_share: float = 0.0
    steal_share: float = 0.0
    run_queue_wait_share: float = 0.0
    other_cpu_load: float | None = None
    ctx_switches_per_s: float = 0.0
    rss_bytes: float = 0.0
    gpu_util: float | None = None
    gpu_sm_clock_mhz: float | None = None
    gpu_throttled: float | None = None
    gpu_other_mem_bytes: float | None = None
    mean_step_s: float = 0.0
    cpu_s: float = 0.0
    num_updates: float = 0.0
    recv_wait_s: float = 0.0

    @property
    def binding_cpu_limit(self) -> float | None:
        """``cpu_limit`` where it is below one core (the stage's process then cannot keep one core busy), else None."""
        return self.cpu_limit if self.cpu_limit is not None and 0 < self.cpu_limit < 1 else None

    @property
    def obtained_core_share(self) -> float | None:
        """The share of one core the stage's process got while it was ready to run: its busy cores over its busy
        cores plus the share of the time its main thread waited for a core (``cpu_share / (cpu_share +
        run_queue_wait_share)``); ``None`` without system readings (``cpu_share`` 0) or where the process kept more
        than one core's worth of time busy or waiting (several threads at work: their CPU per step is not the time
        of one thread's path through the step).

        Example (a stage beside a CPU hog on its core: busy half the time, waiting for the core the other half)::

            >>> StageTimes(9.0, 10.0, cpu_share=0.5, run_queue_wait_share=0.5).obtained_core_share
            0.5
        """
        busy = self.cpu_share
        if not busy > 0 or busy + self.run_queue_wait_share > _ONE_CORE:
            return None
        return busy / (busy + self.run_queue_wait_share)

    @property
    def throughput_step_s(self) -> float:
        """``mean_step_s`` where measured (> 0), else ``step_s``."""
        return self.mean_step_s if self.mean_step_s > 0 else self.step_s

    @classmethod
    def from_summary(cls, summary: StageSummary) -> StageTimes:
        """The times and environment of one stage from the monitor's window summary (compute: forward + backward)."""
        return cls(
            compute_s=summary.forward_s + summary.backward_s,
            step_s=summary.step_s,
            comm_s=summary.comm_s,
            exposed_comm_s=summary.exposed_comm_s,
            cpu_limit=summary.cpu_limit,
            comm_spread_s=0.0 if math.isnan(summary.comm_spread_s) else summary.comm_spread_s,
            cpu_share=summary.cpu_share,
            steal_share=summary.steal_share,
            run_queue_wait_share=summary.run_queue_wait_share,
            other_cpu_load=summary.other_cpu_load,
            ctx_switches_per_s=summary.ctx_switches_per_s,
            rss_bytes=summary.rss_bytes,
            gpu_util=summary.gpu_util,
            gpu_sm_clock_mhz=summary.gpu_sm_clock_mhz,
            gpu_throttled=summary.gpu_throttled,
            gpu_other_mem_bytes=summary.gpu_other_mem_bytes,
            mean_step_s=summary.mean_step_s,
            cpu_s=summary.mean_cpu_s if summary.mean_cpu_s > 0 else 0.0,
            num_updates=summary.num_updates if summary.num_updates > 0 else 0.0,
            recv_wait_s=summary.recv_wait_s if summary.recv_wait_s > 0 else 0.0,
        )


@dataclass(frozen=True)
class PipelineWindow:
    """What the monitor measured over one window, under one partition (identical on every rank).

    Attributes:
        partition: the partition the window was measured under.
        stages: one :class:`StageTimes` per stage.
        num_microbatches: ``M``, micro-batches per step.
    """

    partition: Partition
    stages: tuple[StageTimes, ...]
    num_microbatches: int

    def __post_init__(self) -> None:
        if len(self.stages) != self.partition.num_stages:
            raise ConfigurationError(
                f"A window needs one StageTimes per stage: the partition {self.partition} has "
                f"{self.partition.num_stages} stages, got {len(self.stages)}."
            )
        if self.num_microbatches < 1:
            raise ConfigurationError(f"num_microbatches must be >= 1; got {self.num_microbatches}.")

    @property
    def comm_overlap(self) -> float:
        """Measured share of the transfer time hidden behind compute, over all stages (0 with no transfers)."""
        comm_s = sum(t.comm_s for t in self.stages)
        if comm_s <= 0:
            return 0.0
        return min(max(1.0 - sum(t.exposed_comm_s for t in self.stages) / comm_s, 0.0), 1.0)

    @property
    def step_s(self) -> float:
        """The measured step time of the pipeline: its slowest stage's (medians)."""
        return max(t.step_s for t in self.stages)

    @property
    def mean_step_s(self) -> float:
        """The pipeline's measured throughput as a step time: its slowest stage's mean (:attr:`StageTimes.mean_step_s`).

        What a move's outcome is judged by: under a CPU quota the medians can say a move made the pipeline slower
        when it made it faster.

        Never below the step a stage's CPU limit allows over many periods, its CPU per step over the limit
        (:attr:`StageTimes.cpu_s` over :attr:`StageTimes.binding_cpu_limit`; the CPU of a step's whole cycle, so this
        bounds the cycle, the work between two batches included, which the stages' own step times leave out): under a
        quota steps are bimodal (some fit in what is left of the period's quota, the others wait for the next period),
        and a window of ten steps that caught more of the fast ones measured a partition at 60 ms per step that
        averaged 80-107 ms over whole runs.
        """
        bound = max((t.cpu_s / q for t in self.stages if (q := t.binding_cpu_limit) is not None), default=0.0)
        return max(max(t.throughput_step_s for t in self.stages), bound)

    def signs(self) -> tuple[str, ...]:
        """Per stage, the signs of interference its readings show beyond the least affected stage's (``""``: none).

        What the strategy gives the controller as ``stage_signs`` for one pipeline replica
        (:func:`~lightning_dynpipe.monitor.stats.interference_excess` over the stages' readings: a cgroup CPU limit,
        other processes on its cores, waiting for a core, a throttled GPU clock). Empty when a stage has no system
        readings (``cpu_share`` 0).

        Example::

            >>> quota = StageTimes(9.0, 10.0, cpu_limit=0.25, cpu_share=0.25)
            >>> PipelineWindow(Partition((2, 2)), (StageTimes(4.0, 10.0, cpu_share=0.4), quota), 2).signs()
            ('', 'cgroup CPU limit 0.25 cores')
        """
        return tuple(interference_excess(self.stages) or ())


@dataclass(frozen=True)
class Interval:
    """A predicted value with the interval the predictor believes it lies in (``low <= value <= high``)."""

    value: float
    low: float
    high: float

    def __post_init__(self) -> None:
        if not (self.low <= self.value <= self.high) or any(math.isnan(x) for x in (self.value, self.low, self.high)):
            raise ConfigurationError(
                f"An interval needs low <= value <= high; got {self.low}, {self.value}, {self.high}."
            )

    @classmethod
    def point(cls, value: float) -> Interval:
        """A prediction without a spread model: the interval is the point itself."""
        return cls(value, value, value)


@dataclass(frozen=True)
class PartitionPrediction:
    """One predictor's answer for one candidate partition.

    Attributes:
        partition: the candidate.
        slowdowns: per stage, the factor by which the stage's environment stretches the profiled compute of
            the layers the candidate gives it (1: as profiled).
        stage_compute_s: per stage, forward plus backward seconds per micro-batch.
        boundary_s: per boundary ``b`` (between stages ``b`` and ``b + 1``), seconds per message.
    """

    partition: Partition
    slowdowns: tuple[float, ...]
    stage_compute_s: tuple[Interval, ...]
    boundary_s: tuple[Interval, ...]


@runtime_checkable
class InterferencePredictor(Protocol):
    """Prices a candidate partition from what was measured under the current one.

    Example::

        predictor = MeasuredSlowdownPredictor()
        prediction = predictor.predict(model_cost, comm, window, Partition((6, 2)))
        prediction.stage_compute_s[1].high     # seconds per micro-batch, upper end

    Implementations must be deterministic functions of their inputs and of the samples they were given (every
    rank asks with the same window and must get the same answer, or the ranks would decide differently).
    """

    def predict(
        self, model_cost: ModelCost, comm: CommModel, window: PipelineWindow, candidate: Partition
    ) -> PartitionPrediction:
        """Each stage's compute and each boundary's message time under ``candidate``."""
        ...


def check_same_pipeline(window: PipelineWindow, candidate: Partition) -> None:
    """Raises :class:`ConfigurationError` unless ``candidate`` has the window's stage and layer counts."""
    if candidate.num_stages != window.partition.num_stages or candidate.num_layers != window.partition.num_layers:
        raise ConfigurationError(
            f"A candidate is priced from a window of the same pipeline: the window ran {window.partition} "
            f"({window.partition.num_stages} stages, {window.partition.num_layers} layers), the candidate is "
            f"{candidate} ({candidate.num_stages} stages, {candidate.num_layers} layers). Give a candidate with "
            "the window's stage and layer counts."
        )


def cpu_contended(window: PipelineWindow) -> list[bool]:
    """Per stage, whether its process competes for its cores beyond the least affected stage's: a CPU limit below one
    core, or (where the stages report their system readings) other processes busy on its cores or its main thread
    waiting for a core, by the thresholds of :func:`~lightning_dynpipe.monitor.stats.interference_excess`.

    Example::

        >>> hogged = StageTimes(9.0, 10.0, cpu_share=0.5, other_cpu_load=0.5)
        >>> cpu_contended(PipelineWindow(Partition((2, 2)), (hogged, StageTimes(8.0, 10.0, cpu_share=0.8)), 2))
        [True, False]
    """
    stages = window.stages
    out = [t.binding_cpu_limit is not None for t in stages]
    if not stages or any(not t.cpu_share > 0 for t in stages):  # no system readings: the limits alone
        return out
    signs = INTERFERENCE_SIGNS
    others = [t.other_cpu_load or 0.0 for t in stages]
    waits = [t.run_queue_wait_share for t in stages]
    return [
        limited
        or others[k] - min(others) >= signs["other_cpu_load"]
        or waits[k] - min(waits) >= signs["run_queue_wait_share"]
        for k, limited in enumerate(out)
    ]
