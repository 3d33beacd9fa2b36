"""Interference predictors: from stage statistics measured under one partition to the costs of any other.

* :class:`InterferencePredictor`: the protocol (plain data in and out, see :mod:`.base`);
* :class:`MeasuredSlowdownPredictor`: the baseline, each stage's measured slowdown against its profile (at
  least ``1/q`` under a cgroup CPU limit of ``q`` cores) carried over to any partition.

Pure: no torch, no Lightning.
"""

from __future__ import annotations

from lightning_dynpipe.predictor.base import (
    InterferencePredictor,
    Interval,
    PartitionPrediction,
    PipelineWindow,
    StageTimes,
)
from lightning_dynpipe.predictor.measured import MeasuredSlowdownPredictor, measured_slowdowns

__all__ = [
    "InterferencePredictor",
    "Interval",
    "PartitionPrediction",
    "PipelineWindow",
    "StageTimes",
    "MeasuredSlowdownPredictor",
    "measured_slowdowns",
]
