"""Calibration of the convergence model with the staleness emulator, on scikit-learn's digits (a few dozen steps)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dynpipe.calibration import (
    ProfileRun,
    calibrate_beta,
    layer_parameter_counts,
    measure_profiles,
    median_observations,
    resolve_profile,
    steps_to_target,
)
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan import ConvergenceModel, Partition

_Batch = tuple[Tensor, Tensor]


@pytest.fixture(scope="module")
def digits() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    data = sklearn_datasets.load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def _net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Linear(64, 32), nn.ReLU()), nn.Sequential(nn.Linear(32, 32), nn.ReLU()), nn.Linear(32, 10)
    )


def _batches(x: Tensor, y: Tensor, seed: int, batch_size: int = 32) -> Iterator[_Batch]:
    g = torch.Generator().manual_seed(seed)
    while True:  # epochs until the caller stops (steps_to_target takes the first max_steps)
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x) - batch_size + 1, batch_size):
            idx = perm[i : i + batch_size]
            yield x[idx], y[idx]


def _loss(out: Tensor, mb: _Batch) -> Tensor:
    return F.cross_entropy(out, mb[1])


def _common(digits: tuple[Tensor, Tensor, Tensor, Tensor], lr: float = 0.02) -> dict[str, object]:
    _, _, xv, yv = digits

    def accuracy(net: nn.Sequential) -> float:
        return float((net(xv).argmax(-1) == yv).float().mean())

    return dict(
        num_microbatches=2,
        make_optimizer=lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9),
        loss_fn=_loss,
        eval_fn=accuracy,
        eval_every=2,
        max_steps=80,
    )


def test_steps_to_target_is_a_sane_step_count(digits: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    xt, yt, _, _ = digits
    curve: list[tuple[int, float]] = []
    steps = steps_to_target(
        lambda: _net(0),
        _batches(xt, yt, 0),
        num_stages=1,
        target=0.8,
        on_eval=lambda s, v: curve.append((s, v)),
        **_common(digits),
    )  # type: ignore[arg-type]
    assert steps is not None and 2 <= steps <= 80 and steps % 2 == 0
    # it stopped at the first evaluation that met the target, and not before
    assert curve[-1][0] == steps and curve[-1][1] >= 0.8
    assert all(v < 0.8 for _, v in curve[:-1])
    assert [s for s, _ in curve] == list(range(2, steps + 1, 2))


def test_unreachable_target_gives_none_and_trains_max_steps(digits: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    xt, yt, _, _ = digits
    curve: list[tuple[int, float]] = []
    kwargs = _common(digits) | {"max_steps": 7, "eval_every": 3}
    steps = steps_to_target(
        lambda: _net(0),
        _batches(xt, yt, 0),
        num_stages=2,
        target=1.01,
        on_eval=lambda s, v: curve.append((s, v)),
        **kwargs,
    )  # type: ignore[arg-type]
    assert steps is None
    assert [s for s, _ in curve] == [3, 6, 7]  # the last step is always evaluated


def test_whole_curve_and_min_mode(digits: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    xt, yt, xv, yv = digits
    curve: list[tuple[int, float]] = []
    kwargs = _common(digits) | {"max_steps": 20, "eval_fn": lambda net: float(F.cross_entropy(net(xv), yv))}
    steps = steps_to_target(
        lambda: _net(0),
        _batches(xt, yt, 0),
        num_stages=2,
        target=2.1,
        mode="min",
        stop_at_target=False,
        on_eval=lambda s, v: curve.append((s, v)),
        **kwargs,
    )  # type: ignore[arg-type]
    assert curve[-1][0] == 20  # trained to max_steps although the target was met earlier
    assert steps is not None and steps < 20
    assert min(s for s, v in curve if v <= 2.1) == steps


def test_staleness_zero_and_large_differ(digits: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    xt, yt, _, _ = digits
    curves: dict[str, list[float]] = {"fresh": [], "stale": []}
    results = {}
    for name, staleness in [("fresh", [0, 0, 0]), ("stale", [12, 12, 0])]:
        results[name] = steps_to_target(
            lambda: _net(0),
            _batches(xt, yt, 0),
            num_stages=3,
            staleness=staleness,
            target=0.9,
            stop_at_target=False,
            on_eval=lambda s, v, c=curves[name]: c.append(v),  # type: ignore[misc]
            **_common(digits),
        )  # type: ignore[arg-type]
    assert results["fresh"] is not None
    assert curves["fresh"] != curves["stale"]
    # same weights, same batches: only the staleness differs, and it must not help here
    assert results["stale"] is None or results["stale"] >= results["fresh"]


def test_staleness_zero_is_deterministic(digits: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    xt, yt, _, _ = digits
    a = steps_to_target(lambda: _net(1), _batches(xt, yt, 1), num_stages=2, target=0.85, **_common(digits))  # type: ignore[arg-type]
    b = steps_to_target(lambda: _net(1), _batches(xt, yt, 1), num_stages=2, target=0.85, **_common(digits))  # type: ignore[arg-type]
    assert a == b and a is not None


def test_resolve_profile_balances_by_parameters() -> None:
    net = _net(0)
    assert layer_parameter_counts(net) == [64 * 32 + 32, 32 * 32 + 32, 32 * 10 + 10]
    part, stale, params = resolve_profile(net, 2)
    assert part.balance == (1, 2) and stale == (1, 0) and params == (2080, 1056 + 330)
    part, stale, params = resolve_profile(net, [0, 5, 0])
    assert part.balance == (1, 1, 1) and stale == (0, 5, 0) and sum(params) == sum(layer_parameter_counts(net))
    part, _, params = resolve_profile(net, 2, balance=[2, 1])
    assert params == (2080 + 1056, 330)


def test_a_partition_profile_is_measured_with_its_own_balance(digits: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    net = _net(0)
    part, stale, params = resolve_profile(net, Partition((2, 1)))
    assert part.balance == (2, 1) and stale == (1, 0) and params == (2080 + 1056, 330)
    with pytest.raises(ConfigurationError, match="is its own balance"):
        resolve_profile(net, Partition((2, 1)), balance=[1, 2])
    # two partitions of the same staleness are two observations: the stale stage holds different parameters
    xt, yt, _, _ = digits
    runs = measure_profiles(
        _net,
        lambda seed: _batches(xt, yt, seed),
        profiles=[Partition((1, 2)), Partition((2, 1))],
        seeds=[0],
        target=0.8,
        **_common(digits),
    )  # type: ignore[arg-type]
    assert [(r.profile, r.balance, r.staleness) for r in runs] == [
        (Partition((1, 2)), (1, 2), (1, 0)),
        (Partition((2, 1)), (2, 1), (1, 0)),
    ]
    obs = median_observations(runs)
    assert [o.weights for o in obs] == [(2080.0, 1056.0 + 330.0), (2080.0 + 1056.0, 330.0)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_stages": 2, "staleness": [1]}, "one entry per stage"),
        ({"num_stages": 2, "balance": [1, 1, 1]}, "has 3 stages"),
        ({"num_stages": 4}, "Cannot split 3 layers into 4 stages"),
        ({"num_stages": 1, "eval_every": 0}, "eval_every and max_steps must be >= 1"),
        ({"num_stages": 1, "mode": "best"}, "valid options are"),
    ],
)
def test_steps_to_target_rejects(
    digits: tuple[Tensor, Tensor, Tensor, Tensor], kwargs: dict[str, object], match: str
) -> None:
    xt, yt, _, _ = digits
    args = _common(digits) | kwargs
    with pytest.raises(ConfigurationError, match=match):
        steps_to_target(lambda: _net(0), _batches(xt, yt, 0), target=0.9, **args)  # type: ignore[arg-type]


def test_resolve_profile_rejects() -> None:
    with pytest.raises(ConfigurationError, match="must be >= 1"):
        resolve_profile(_net(0), 0)
    with pytest.raises(ConfigurationError, match="one value >= 0 per stage"):
        resolve_profile(_net(0), [1, -1])


def test_calibrate_beta_returns_a_finite_model(digits: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    xt, yt, _, _ = digits
    model = calibrate_beta(
        _net, lambda seed: _batches(xt, yt, seed), profiles=[1, 2, 3], seeds=[0, 1], target=0.8, **_common(digits)
    )  # type: ignore[arg-type]
    assert isinstance(model, ConvergenceModel)
    assert math.isfinite(model.i0) and model.i0 > 0
    assert math.isfinite(model.beta) and model.beta >= 0


def test_measure_profiles_pairs_seeds_and_reports_iterations(digits: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    xt, yt, _, _ = digits
    runs = measure_profiles(
        _net, lambda seed: _batches(xt, yt, seed), profiles=[1, [0, 3, 0]], seeds=[0], target=0.8, **_common(digits)
    )  # type: ignore[arg-type]
    assert [(r.profile, r.seed) for r in runs] == [(1, 0), ((0, 3, 0), 0)]
    assert runs[1].staleness == (0, 3, 0) and runs[1].balance == (1, 1, 1)
    for r in runs:
        assert r.steps is not None and r.iterations == 2 * r.steps
        assert r.curve[-1][0] == r.steps
        assert r.observation().iterations == r.iterations
    obs = median_observations(runs)
    assert len(obs) == 2


def test_median_observations_refuses_a_run_that_missed_the_target() -> None:
    miss = ProfileRun(
        profile=2, seed=0, balance=(1, 2), staleness=(1, 0), stage_parameters=(10, 5), steps=None, num_microbatches=4
    )
    hit = ProfileRun(
        profile=2, seed=1, balance=(1, 2), staleness=(1, 0), stage_parameters=(10, 5), steps=30, num_microbatches=4
    )
    assert hit.iterations == 120
    with pytest.raises(ConfigurationError, match=r"did not reach the target for seeds \[0\]"):
        median_observations([miss, hit])
    with pytest.raises(ConfigurationError, match="never reached the target"):
        miss.observation()


def test_lr_scale_reaches_every_update(digits: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    # lr_scale multiplies each update's learning rate, as DynPipeStrategy(lr_scale=...) does: scaling lr=0.02 by
    # 1/2 (exact in binary) trains the same weights as lr=0.01, through every layer of the calibration API.
    xt, yt, _, _ = digits

    def batches(seed: int) -> Iterator[_Batch]:
        return _batches(xt, yt, seed)

    def run(lr: float, **extra: object) -> list[ProfileRun]:
        kwargs = _common(digits, lr=lr) | {"max_steps": 20, "stop_at_target": False} | extra
        return measure_profiles(_net, batches, profiles=[2], seeds=[0], target=0.8, **kwargs)  # type: ignore[arg-type]

    scaled, halved, unscaled = run(0.02, lr_scale=0.5), run(0.01), run(0.02)
    assert scaled[0].curve == halved[0].curve
    assert scaled[0].curve != unscaled[0].curve

    def fit(lr: float, **extra: object) -> ConvergenceModel:
        kwargs = _common(digits, lr=lr) | {"max_steps": 40} | extra
        return calibrate_beta(_net, batches, profiles=[1, 2], seeds=[0], target=0.5, **kwargs)  # type: ignore[arg-type]

    a, b = fit(0.02, lr_scale=0.5), fit(0.01)
    assert (a.i0, a.beta) == (b.i0, b.beta)


@pytest.mark.parametrize("lr_scale", [0.0, -1.0, math.inf, math.nan])
def test_steps_to_target_rejects_a_bad_lr_scale(digits: tuple[Tensor, Tensor, Tensor, Tensor], lr_scale: float) -> None:
    xt, yt, _, _ = digits
    with pytest.raises(ConfigurationError, match="lr_scale must be a finite positive number"):
        steps_to_target(
            lambda: _net(0), _batches(xt, yt, 0), num_stages=1, target=0.9, lr_scale=lr_scale, **_common(digits)
        )  # type: ignore[arg-type]
