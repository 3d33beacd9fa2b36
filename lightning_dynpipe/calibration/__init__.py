"""Single-process references: the PipeDream replay (test oracle and staleness emulator) and ``beta`` fitting.

:func:`replay_async` trains a model in one process exactly as the asynchronous pipeline would; the tests
compare the pipeline against it, and :func:`calibrate_beta` uses it to measure what staleness costs in
iterations on the user's own model and data (the planner's convergence model).
"""

from __future__ import annotations

from lightning_dynpipe.calibration.beta import (
    ProfileRun,
    calibrate_beta,
    layer_parameter_counts,
    measure_profiles,
    median_observations,
    resolve_profile,
    steps_to_target,
)
from lightning_dynpipe.calibration.replay import default_staleness, replay_async

__all__ = [
    "replay_async",
    "default_staleness",
    "ProfileRun",
    "calibrate_beta",
    "layer_parameter_counts",
    "measure_profiles",
    "median_observations",
    "resolve_profile",
    "steps_to_target",
]
