"""Stage statistics: per-step samples, rolling medians, pipeline snapshots and the Lightning callback.

``stats`` is pure data (standard library only); ``system`` reads the process and the GPU, ``cgroups`` the
process's cgroup CPU limit; ``callback`` is the thin :class:`StageMonitor` that the strategy adds to the trainer
(``system`` and ``callback`` are imported on first use, so ``stats`` loads without torch or Lightning).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from lightning_dynpipe.monitor.callback import SnapshotListener, StageMonitor
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


_LAZY = {"StageMonitor": "callback", "SnapshotListener": "callback", "ProcessSampler": "system"}


def __getattr__(name: str) -> Any:
    # ``callback`` imports Lightning and ``system`` torch; ``stats`` must stay importable without either.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
