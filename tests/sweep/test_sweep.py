"""The calibration sweep's refusals and its worker's handling of what crosses a boundary, without a worker process.

The sweep itself runs in tests/benchmarks/test_predictor_smoke.py (the ``calibrate`` command) and in
tests/strategy/test_calibrate_at_setup.py (at set-up, on a transformer).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor import PipelineWindow, StageTimes
from lightning_dynpipe.sweep import (
    SCENARIOS,
    CalibrationRun,
    SweepSettings,
    calibrate_pipeline,
    calibration_samples,
    planned_partitions,
    run_sweep,
)
from lightning_dynpipe.sweep.worker import _backward, _stage_input

COST = ModelCost.from_arrays([1.0] * 4, [2.0] * 4)


class _ScriptLayer(nn.Linear):
    pass


_ScriptLayer.__module__ = "__main__"  # as if defined in the script being run


def test_layers_defined_in_the_script_are_refused_before_a_worker_starts() -> None:
    pipeline = nn.Sequential(nn.Linear(4, 4), _ScriptLayer(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(ConfigurationError, match=r"classes defined in the script being run \(__main__\): \['_Script"):
        calibrate_pipeline(pipeline, torch.randn(2, 4), COST, num_stages=2, num_microbatches=2)


def test_balances_must_split_the_pipeline_and_stages_must_be_two_or_more() -> None:
    pipeline = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    bad = SweepSettings(balances=((2, 2), (1, 2)))
    with pytest.raises(ConfigurationError, match=r"balances \[\(2, 2\), \(1, 2\)\] must each split 4 layers into 2"):
        calibrate_pipeline(pipeline, torch.randn(2, 4), COST, num_stages=2, num_microbatches=2, settings=bad)
    with pytest.raises(ConfigurationError, match="at least 2 stages"):
        calibrate_pipeline(pipeline, torch.randn(2, 4), COST, num_stages=1, num_microbatches=2)


def test_a_stage_input_is_detached_with_gradients_on_its_floating_leaves() -> None:
    h = torch.randn(2, 3, requires_grad=True) * 2  # not a leaf
    pos = torch.arange(3)
    got = _stage_input({"x": (h, pos), "n": 3})
    x, p = got["x"]
    assert x.is_leaf and x.requires_grad and torch.equal(x, h) and not p.requires_grad and got["n"] == 3
    w = nn.Parameter(torch.ones(3))
    _backward(((x * w).sum(1), p))  # the int64 leaf takes no gradient
    assert torch.equal(w.grad, x.detach().sum(0)) and torch.equal(x.grad, w.detach().expand(2, 3))


class _Worker:
    """Stands in for the sweep's worker connection: answers each window with a compute time, one of them slow."""

    def __init__(self, slow_call: int) -> None:
        self.windows: list[tuple[int, int]] = []
        self.slow_call = slow_call

    def send(self, cmd: tuple[int, int, int, int, float]) -> None:
        self.windows.append(cmd[:2])

    def recv(self) -> StageTimes:
        compute = (
            0.05 if len(self.windows) - 1 == self.slow_call else 0.01 * (self.windows[-1][1] - self.windows[-1][0])
        )
        return StageTimes(compute_s=compute, step_s=compute)


class _Link:
    def message_s(self, nbytes: int, delay: object) -> float:
        return 1e-4


@pytest.mark.parametrize("rounds", [1, 3])
def test_clean_readings_are_taken_in_rounds_and_keep_their_median(rounds: int) -> None:
    """Every layer set is measured clean once per round, the rounds going over all of them; a window caught by a
    burst of other load (here the second one measured) does not become that layer set's clean reading when there
    are three rounds, and is with one."""
    partitions = [Partition((2, 2)), Partition((3, 1))]
    worker = _Worker(slow_call=1)
    runs = run_sweep(
        COST, worker, 0, 0, scenarios=[SCENARIOS["none"]], partitions=partitions, num_microbatches=2, steps=2,
        link=_Link(), clean_rounds=rounds,  # type: ignore[arg-type]
    )  # fmt: skip
    one_round = [(0, 2), (2, 4), (0, 3), (3, 4)]
    assert worker.windows == one_round * rounds
    measured = [t.compute_s for run in runs for t in run.window.stages]
    expected = [0.02, 0.02, 0.03, 0.01]
    if rounds == 1:
        expected[1] = 0.05  # the burst's window is the only reading of (2, 4)
    assert measured == pytest.approx(expected)


def test_clean_rounds_must_be_at_least_one() -> None:
    with pytest.raises(ConfigurationError, match="at least once; got clean_rounds=0"):
        SweepSettings(clean_rounds=0)


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_the_default_scenarios_limit_the_first_stages_layer_sets_and_the_last_stages(num_stages: int) -> None:
    """``calibrate=True`` measures a CPU limit on the first stage's layer sets (``quota50``) and on the last stage's
    (``quota25``): a small last stage's time is mostly fixed costs, which a limit stretches, and without rows of it
    the forest priced a limited last stage from the first stage's."""
    defaults = [SCENARIOS[name] for name in SweepSettings().scenarios]
    limited = {sc.name: sc.stage % num_stages for sc in defaults if sc.kind == "limit"}
    assert limited == {"quota50": 0, "quota25": num_stages - 1}
    assert {sc.kind for sc in defaults} == {"none", "hog", "limit", "delay"}


def test_calibration_rows_carry_the_fixed_cost_the_clean_windows_show() -> None:
    """Clean readings of 1.2 x (profile + 0.5 s) per micro-batch across three layer-set sizes (COST's layers take 3 s
    each): the rows are priced with a fixed cost of 0.5 s, from the windows of no interference only."""

    def window(balance: tuple[int, int], extra: float = 0.0) -> PipelineWindow:
        stages = tuple(StageTimes(compute_s=2 * (1.2 * (3.0 * n + 0.5) + extra), step_s=30.0) for n in balance)
        return PipelineWindow(Partition(balance), stages, 2)

    runs = [CalibrationRun("none", window(b)) for b in ((1, 3), (2, 2), (3, 1))]
    runs += [CalibrationRun("hog50", window(b, extra=1.0)) for b in ((1, 3), (2, 2), (3, 1))]
    samples = calibration_samples(COST, CommModel(1e-4, 1e9), runs)
    assert samples.fixed_s == pytest.approx(0.5)
    assert len(samples) == 2 * 9 * 2  # two scenarios, every ordered pair of three windows, two stages each


def test_the_sweep_also_measures_the_partitions_the_planner_proposes_from_its_windows() -> None:
    """A window of [2, 2] with every stage at its profile proposes nothing new; the same window whose 1 MiB messages
    took 20 ms each (a slower link) proposes the cut at the 1 KiB activation, [3, 1]; the cap holds."""
    cost = ModelCost.from_arrays([1e-3] * 4, [2e-3] * 4, activation_bytes=[1 << 20, 1 << 20, 1 << 10, 1 << 20])
    comm = CommModel(latency_s=1e-5, bandwidth_Bps=1e9)

    def window(comm_s: float) -> PipelineWindow:
        stages = tuple(
            StageTimes(compute_s=4 * 6e-3, step_s=0.03 + comm_s, comm_s=comm_s, exposed_comm_s=comm_s) for _ in range(2)
        )
        return PipelineWindow(Partition((2, 2)), stages, 4)

    known = [Partition((2, 2)), Partition((1, 3))]
    assert planned_partitions(cost, comm, [CalibrationRun("none", window(0.0))], known, 2) == []
    slow = [CalibrationRun("delay", window(4 * 0.02))]
    assert planned_partitions(cost, comm, slow, known, 2) == [Partition((3, 1))]
    assert planned_partitions(cost, comm, slow, known, 0) == []
