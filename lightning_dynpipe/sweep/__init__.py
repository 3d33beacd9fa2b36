"""The calibration sweep that trains the interference forest on this machine, with the model's own layers.

Run from the command line (``python -m lightning_dynpipe calibrate``) or at set-up
(``DynPipeStrategy(predictor="forest", calibrate=True)``); see :mod:`lightning_dynpipe.sweep.core`.
"""

from __future__ import annotations

from lightning_dynpipe.sweep.core import (
    DEFAULT_SCENARIOS,
    SCENARIOS,
    CalibrationRun,
    Scenario,
    SweepResult,
    SweepSettings,
    calibrate_pipeline,
    calibration_samples,
    candidate_partitions,
    median_reading,
    planned_partitions,
    run_sweep,
)

__all__ = [
    "Scenario",
    "SCENARIOS",
    "DEFAULT_SCENARIOS",
    "SweepSettings",
    "SweepResult",
    "CalibrationRun",
    "candidate_partitions",
    "planned_partitions",
    "run_sweep",
    "median_reading",
    "calibration_samples",
    "calibrate_pipeline",
]
