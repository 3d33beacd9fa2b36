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
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition

__all__ = ["StageTimes", "PipelineWindow", "Interval", "PartitionPrediction", "InterferencePredictor"]


@dataclass(frozen=True)
class StageTimes:
    """Per-step medians of one stage over the monitor's window (seconds).

    Attributes:
        compute_s: forward plus backward time of the stage's layers per step.
        step_s: wall time of the step on this stage.
        comm_s: time the incoming transfers took per step.
        exposed_comm_s: the part of ``comm_s`` the stage waited for (not hidden behind compute).
        cpu_limit: cgroup CPU bandwidth limit of the stage's process, in cores; ``None`` when nothing limits it.
    """

    compute_s: float
    step_s: float
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    cpu_limit: float | None = None


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
        """The measured step time of the pipeline: its slowest stage's."""
        return max(t.step_s for t in self.stages)


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
