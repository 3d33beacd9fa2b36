"""Stage statistics: per-step samples, rolling medians, pipeline snapshots and the Lightning callback.

``stats`` is pure data (standard library only); ``system`` reads the process and the GPU; ``callback`` is the
thin :class:`StageMonitor` that the strategy adds to the trainer.
"""

from __future__ import annotations

from lightning_dynpipe.monitor.callback import SnapshotListener, StageMonitor
from lightning_dynpipe.monitor.stats import (
    METRIC_NAMES,
    PipelineSnapshot,
    StageReport,
    StageSample,
    StageStatsAccumulator,
    StageSummary,
    StepTimes,
    SystemReading,
)
from lightning_dynpipe.monitor.system import ProcessSampler

__all__ = [
    "METRIC_NAMES",
    "PipelineSnapshot",
    "ProcessSampler",
    "SnapshotListener",
    "StageMonitor",
    "StageReport",
    "StageSample",
    "StageStatsAccumulator",
    "StageSummary",
    "StepTimes",
    "SystemReading",
]
