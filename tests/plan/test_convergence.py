"""The staleness model and its least-squares calibration."""

from __future__ import annotations

import logging
import random

import pytest

from lightning_dynpipe.errors import ConfigurationError, ScheduleError
from lightning_dynpipe.plan import DEFAULT_BETA, ConvergenceModel, Observation, fit_beta, staleness_profile


def test_staleness_profile() -> None:
    assert staleness_profile(4) == (3, 2, 1, 0)
    assert staleness_profile(4, "sync") == (0, 0, 0, 0)
    assert staleness_profile(1) == (0,)
    assert staleness_profile(3, "gpipe") == (0, 0, 0)  # every schedule object knows its own staleness
    with pytest.raises(ScheduleError, match="Valid schedules: 'async', 'sync', 'gpipe'"):
        staleness_profile(2, "zb")


def test_iterations_formula() -> None:
    model = ConvergenceModel(i0=200.0, beta=0.5)
    # weights are normalised to shares: (1, 3) -> (0.25, 0.75)
    assert model.iterations((2, 0), (1, 3)) == pytest.approx(200 * (1 + 0.5 * 0.5))
    assert model.iterations((0, 0), (1, 3)) == 200.0
    # a model without parameters has nothing to go stale
    assert model.iterations((3, 2, 1, 0), (0, 0, 0, 0)) == 200.0
    assert ConvergenceModel().beta == DEFAULT_BETA


def test_convergence_model_validation() -> None:
    with pytest.raises(ConfigurationError, match="beta"):
        ConvergenceModel(beta=-0.1)
    with pytest.raises(ConfigurationError, match="i0"):
        ConvergenceModel(i0=0.0)
    with pytest.raises(ConfigurationError, match="one entry per stage"):
        ConvergenceModel().iterations((1, 0), (1, 1, 1))


def _observations(i0: float, beta: float, noise: float, seed: int, count: int) -> list[Observation]:
    rng = random.Random(seed)
    truth = ConvergenceModel(i0=i0, beta=beta)
    out = []
    for _ in range(count):
        S = rng.choice([1, 2, 4, 8])
        weights = tuple(rng.uniform(0.1, 1.0) for _ in range(S))
        stale = staleness_profile(S)
        measured = truth.iterations(stale, weights) * (1 + rng.gauss(0.0, noise))
        out.append(Observation(stale, weights, measured))
    return out


@pytest.mark.parametrize("beta", [0.0, 0.03, 0.2, 1.5])
def test_fit_beta_recovers_a_known_beta_exactly(beta: float) -> None:
    model = fit_beta(_observations(1500.0, beta, noise=0.0, seed=1, count=6))
    assert model.i0 == pytest.approx(1500.0, rel=1e-9)
    assert model.beta == pytest.approx(beta, rel=1e-9, abs=1e-12)


def test_fit_beta_with_noise_and_fixed_i0() -> None:
    obs = _observations(1000.0, 0.12, noise=0.01, seed=7, count=60)
    assert fit_beta(obs).beta == pytest.approx(0.12, rel=0.1)
    assert fit_beta(obs, i0=1000.0).beta == pytest.approx(0.12, rel=0.1)
    # with i0 known, one asynchronous profile is enough
    one = [Observation((1, 0), (1.0, 1.0), 1000.0 * (1 + 0.12 * 0.5))]
    assert fit_beta(one, i0=1000.0).beta == pytest.approx(0.12)


def test_fit_beta_clips_a_negative_fit(caplog: pytest.LogCaptureFixture) -> None:
    obs = [Observation((0,), (1,), 110.0), Observation((1, 0), (1, 1), 100.0)]
    with caplog.at_level(logging.WARNING):
        assert fit_beta(obs).beta == 0.0
    assert "beta=0" in caplog.text


def test_fit_beta_needs_enough_observations() -> None:
    with pytest.raises(ConfigurationError, match="at least one Observation"):
        fit_beta([])
    same = [Observation((1, 0), (1, 1), 100.0), Observation((1, 0), (1, 1), 102.0)]
    with pytest.raises(ConfigurationError, match="two or more distinct weighted staleness"):
        fit_beta(same)
    with pytest.raises(ConfigurationError, match="staleness on parameter-holding stages"):
        fit_beta([Observation((0,), (1,), 100.0)], i0=100.0)
    with pytest.raises(ConfigurationError, match="finite and > 0"):
        fit_beta([Observation((0,), (1,), -5.0), Observation((1, 0), (1, 1), 100.0)])
