"""Behaviour of the planner beyond the brute-force cases: what it chooses and why, errors, the Plan."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import numpy as np
import pytest

from lightning_dynpipe.errors import ConfigurationError, PartitionError, ScheduleError
from lightning_dynpipe.plan import (
    CommModel,
    ConvergenceModel,
    DefaultCostModel,
    DeviceSpec,
    ModelCost,
    Partition,
    Plan,
    assign_devices,
    evaluate,
    solve,
    throughput_optimal,
)
from lightning_dynpipe.plan.costs import FloatArray
from lightning_dynpipe.schedule import get_schedule


def uniform(n: int, *, param_bytes: int = 10, activation_bytes: int = 10) -> ModelCost:
    return ModelCost.from_arrays(
        [1.0] * n, [2.0] * n, param_bytes=param_bytes, activation_bytes=activation_bytes, optimizer_state_bytes=20
    )


class Dense:
    """Hides DefaultCostModel's prefix form, forcing the solver's dense path (an independent DP)."""

    def __init__(self, inner: DefaultCostModel) -> None:
        self.inner = inner

    def stage_time(self, model: ModelCost, first: Any, stop: Any, **kw: Any) -> FloatArray:
        return self.inner.stage_time(model, first, stop, **kw)


def test_staleness_makes_fewer_stages_faster_to_accuracy() -> None:
    # With parameters spread evenly and nothing but compute, (1/S) * (1 + beta (S-1)/2) falls with S for
    # beta < 2; a per-boundary cost that 1F1B does not hide is what makes an intermediate depth best.
    model = uniform(16)
    conv = ConvergenceModel(beta=1.0)
    cost = DefaultCostModel(CommModel(latency_s=1.0))
    tta = solve(model, num_devices=8, convergence=conv, cost_model=cost)
    fast = throughput_optimal(model, num_devices=8, convergence=conv, cost_model=cost)
    assert fast.num_stages == 8
    assert 1 < tta.num_stages < 8
    assert tta.time_to_accuracy_s < fast.time_to_accuracy_s
    assert tta.iteration_time_s > fast.iteration_time_s  # it buys fewer iterations with a slower pipeline
    assert tta.iterations < fast.iterations


def test_unhidden_communication_makes_fewer_stages_faster() -> None:
    model = uniform(12, activation_bytes=1000)
    cheap = solve(model, num_devices=6, convergence=ConvergenceModel(beta=0.2))
    costly = solve(
        model, num_devices=6, convergence=ConvergenceModel(beta=0.2),
        cost_model=DefaultCostModel(CommModel(bandwidth_Bps=200.0)),
    )  # fmt: skip
    assert costly.num_stages < cheap.num_stages
    # the measured overlap hides part of the transfer: with all of it hidden, we are back to compute only
    hidden = solve(
        model, num_devices=6, convergence=ConvergenceModel(beta=0.2),
        cost_model=DefaultCostModel(CommModel(bandwidth_Bps=200.0, overlap=1.0)),
    )  # fmt: skip
    assert hidden.partition == cheap.partition


def test_slowdown_moves_layers_away_from_the_slowed_stage() -> None:
    model = uniform(24)
    even = solve(model, num_devices=4, fixed_num_stages=4, convergence=ConvergenceModel(beta=0.0))
    assert even.partition.balance == (6, 6, 6, 6)
    slowed = solve(
        model, num_devices=4, fixed_num_stages=4, convergence=ConvergenceModel(beta=0.0), slowdowns=[1, 1, 3, 1]
    )
    assert slowed.partition.balance[2] < 6
    assert slowed.partition.balance[2] == min(slowed.partition.balance)
    assert slowed.devices == ((0,), (1,), (2,), (3,))  # stages keep their devices: only layers move


def test_a_slowed_device_is_left_out_when_a_stage_can_be_spared() -> None:
    assert assign_devices([1.0, 5.0, 1.0, 1.0], 3, 1) == ((0,), (2,), (3,))
    assert assign_devices([1.0, 5.0, 1.0, 1.0, 1.0], 2, 2) == ((0, 2), (3, 4))
    with pytest.raises(ConfigurationError, match="only 4 exist"):
        assign_devices([1.0] * 4, 3, 2)
    plan = solve(uniform(12), num_devices=4, max_stages=3, slowdowns=[1.0, 5.0, 1.0, 1.0])
    assert 1 not in {d for group in plan.devices for d in group}


def test_data_parallel_width_is_chosen_when_the_all_reduce_is_cheap() -> None:
    model = uniform(8)
    free = solve(model, num_devices=4, dp=None, cost_model=DefaultCostModel(CommModel(bandwidth_Bps=1e12)))
    assert (free.num_stages, free.dp) == (1, 4)  # no staleness, no bubbles, a negligible all-reduce
    assert free.partition.replicas == (4,)
    costly = solve(model, num_devices=4, dp=None, cost_model=DefaultCostModel(CommModel(bandwidth_Bps=1.0)))
    assert costly.dp == 1


def test_memory_caps_force_more_stages_and_are_respected() -> None:
    model = uniform(8)
    unlimited = solve(model, num_devices=4, convergence=ConvergenceModel(beta=5.0))
    assert unlimited.num_stages == 1
    need_one = unlimited.stage_memory_bytes[0]
    capped = solve(model, num_devices=4, convergence=ConvergenceModel(beta=5.0), memory_cap=need_one - 1)
    assert capped.num_stages > 1
    assert capped.fits_memory
    assert max(capped.stage_memory_bytes) <= need_one - 1


def test_a_stage_after_the_first_is_charged_the_input_it_keeps_per_micro_batch() -> None:
    # a stage starting at layer l keeps layer l-1's output (the message it received) per micro-batch in flight
    model = ModelCost.from_arrays([1.0] * 4, [1.0] * 4, activation_bytes=[1, 50, 1, 1], held_bytes=[1, 50, 1, 1])
    plans = {b: evaluate(model, Partition(b)) for b in [(1, 3), (2, 2), (3, 1)]}
    assert [plans[b].stage_memory_bytes for b in plans] == [
        (2 * 1, 1 * (1 + 50 + 1 + 1)),
        (2 * (1 + 50), 1 * (50 + 1 + 1)),
        (2 * (1 + 50 + 1), 1 * (1 + 1)),
    ]


def test_a_layer_is_charged_at_least_what_its_output_adds_over_its_input() -> None:
    # layer 2 holds 1 byte but outputs 500 (a buffer it returns, say, which held bytes leave out): charged 499, so
    # that a last stage [2, 4) is charged no less than [3, 4), which receives the 500 bytes; the planner's searches
    # over a stage's start rely on that
    model = ModelCost.from_arrays([1.0] * 4, [1.0] * 4, activation_bytes=[1, 1, 500, 1], held_bytes=[1, 1, 1, 1])
    assert np.diff(model.kept_prefix).tolist() == [1, 1, 499, 1]
    memory = [evaluate(model, Partition(b)).stage_memory_bytes[1] for b in [(1, 3), (2, 2), (3, 1)]]
    assert memory == [1 + 1 + 499 + 1, 1 + 499 + 1, 500 + 1]
    assert memory == sorted(memory, reverse=True)
    plan = solve(model, num_devices=2, fixed_num_stages=2, memory_cap=510, convergence=ConvergenceModel(beta=0.0))
    assert plan.fits_memory


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_devices": 0}, ConfigurationError, "num_devices must be a positive integer"),
        ({"num_devices": 2, "schedule": "zb"}, ScheduleError, r"Valid schedules: 'async', 'sync', 'gpipe'"),
        ({"num_devices": 2, "schedule": "gpipe"}, ConfigurationError, "pass num_microbatches >= 1"),
        ({"num_devices": 2, "schedule": "sync"}, ConfigurationError, "pass num_microbatches >= 1"),
        ({"num_devices": 8, "fixed_num_stages": 5}, PartitionError, r"fixed_num_stages must be in \[1, num_layers=4\]"),
        ({"num_devices": 2, "fixed_num_stages": 3}, ConfigurationError, "exceeds num_devices=2"),
        ({"num_devices": 2, "slowdowns": [1.0]}, ConfigurationError, "len\\(slowdowns\\)=1"),
        ({"num_devices": 2, "memory_cap": [1e9]}, ConfigurationError, "len\\(memory_cap\\)=1"),
        ({"num_devices": 2, "dp": 3}, ConfigurationError, "dp must be an integer in \\[1, num_devices=2\\]"),
        ({"num_devices": 2, "max_stages": 0}, ConfigurationError, "max_stages must be >= 1"),
    ],
)
def test_argument_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        solve(uniform(4), **kwargs)


def test_sync_with_one_microbatch_per_step_does_not_pipeline() -> None:
    # a flush after every micro-batch leaves nothing to overlap: one stage is as fast and has no bubbles
    plan = solve(uniform(8), num_devices=4, schedule="sync", num_microbatches=1)
    assert plan.num_stages == 1
    deep = solve(uniform(8), num_devices=4, schedule="sync", num_microbatches=64)
    assert deep.num_stages == 4
    assert deep.staleness == (0, 0, 0, 0)
    assert deep.iteration_time_s == pytest.approx((63 * 6.0 + 4 * 6.0) / 64)


def test_plan_is_immutable_plain_data_with_a_table() -> None:
    plan = solve(uniform(6), num_devices=3, fixed_num_stages=3)
    assert isinstance(plan, Plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.iterations = 1.0  # type: ignore[misc]
    assert plan.partition == Partition((2, 2, 2))
    assert plan.staleness == (2, 1, 0)
    assert plan.num_stages == 3 and plan.dp == 1 and plan.num_devices_used == 3
    assert plan.time_to_accuracy_s == pytest.approx(plan.iterations * plan.iteration_time_s)
    table = plan.table()
    lines = table.splitlines()
    assert lines[0].split() == ["stage", "layers", "devices", "time/mb", "memory", "cap", "staleness", "params"]
    assert lines[1].split()[:3] == ["0*", "0-1", "0"]
    assert "partition=[2, 2, 2]" in table and "time to accuracy" in table


def test_evaluate_reports_memory_overruns_instead_of_raising() -> None:
    plan = evaluate(uniform(4), Partition((3, 1)), memory_cap=100)
    assert not plan.fits_memory
    assert plan.stage_memory_bytes[0] > 100


def test_zero_cost_layers() -> None:
    model = ModelCost.from_arrays([0.0] * 5, [0.0] * 5)
    plan = solve(model, num_devices=3)
    assert plan.time_to_accuracy_s == 0.0


@pytest.mark.parametrize("seed", range(4))
def test_fast_path_matches_the_dense_path_on_medium_models(seed: int) -> None:
    """Beyond brute-force sizes: the shared right-to-left DP over all S against the per-S dense DP."""
    rng = random.Random(seed)
    n = 40
    model = ModelCost.from_arrays(
        [rng.uniform(0.1, 2) for _ in range(n)], [rng.uniform(0.1, 4) for _ in range(n)],
        activation_bytes=[rng.randint(0, 500) for _ in range(n)],
        param_bytes=[rng.choice([0, rng.randint(1, 1000)]) for _ in range(n)],
        optimizer_state_bytes=[rng.randint(0, 1000) for _ in range(n)],
    )  # fmt: skip
    cost = DefaultCostModel(CommModel(latency_s=rng.uniform(0, 1), bandwidth_Bps=rng.uniform(100, 1000)))
    kw: dict[str, Any] = {
        "num_devices": 8,
        "convergence": ConvergenceModel(beta=rng.choice([0.02, 0.1, 0.5])),
        "memory_cap": rng.choice([None, 12_000.0]),
        "slowdowns": rng.choice([None, [rng.choice([1.0, 1.5]) for _ in range(8)]]),
        "schedule": rng.choice(["async", "sync"]),
        "num_microbatches": 8,
    }
    fast = solve(model, cost_model=cost, **kw)
    dense = solve(model, cost_model=Dense(cost), **kw)
    assert fast.time_to_accuracy_s == pytest.approx(dense.time_to_accuracy_s, rel=1e-9)


def test_large_model_plans_and_is_at_least_as_good_as_simple_splits() -> None:
    rng = np.random.default_rng(0)
    n = 300
    model = ModelCost.from_arrays(
        rng.uniform(0.5, 2, n).tolist(), rng.uniform(1, 4, n).tolist(),
        param_bytes=rng.integers(1, 1000, n).tolist(), activation_bytes=rng.integers(1, 1000, n).tolist(),
    )  # fmt: skip
    cost = DefaultCostModel(CommModel(latency_s=0.05, bandwidth_Bps=1e5))
    plan = solve(model, num_devices=16, cost_model=cost)
    assert plan.partition.num_layers == n
    for S in (2, 4, 8, 16):
        even = Partition.from_balance([n // S + (1 if k < n % S else 0) for k in range(S)])
        assert plan.time_to_accuracy_s <= evaluate(model, even, cost_model=cost).time_to_accuracy_s
    assert not math.isnan(plan.time_to_accuracy_s)
    assert DeviceSpec() == DeviceSpec(math.inf, 1.0)


def test_gpipe_plans_with_the_flush_objective_and_its_own_memory() -> None:
    model = ModelCost.from_arrays([1.0, 2.0, 3.0, 1.0], [2.0, 4.0, 6.0, 2.0], param_bytes=10, activation_bytes=5)
    sync = solve(model, num_devices=2, schedule="sync", num_microbatches=4)
    gpipe = solve(model, num_devices=2, schedule="gpipe", num_microbatches=4)
    assert gpipe.partition == sync.partition and gpipe.iteration_time_s == sync.iteration_time_s
    assert gpipe.schedule == "gpipe" and gpipe.staleness == (0, 0)
    assert gpipe.stage_memory_bytes[0] > sync.stage_memory_bytes[0]  # 4 micro-batches in flight, not 2


def test_deeper_async_is_charged_its_staleness_and_memory() -> None:
    """``async+d`` has staleness ``(1+d)(S-1-k)``: the convergence charge is ``1+d`` times PipeDream's, stage ``k``
    keeps ``w + 1`` weight versions and activations, and a strong staleness penalty then prefers fewer stages."""
    model = uniform(8)
    conv = ConvergenceModel(i0=1.0, beta=0.5)
    base = evaluate(model, Partition((4, 4)), convergence=conv)
    deep = evaluate(model, Partition((4, 4)), schedule="async+2", convergence=conv)
    assert deep.staleness == (3, 0) and base.staleness == (1, 0)
    assert deep.schedule == "async+2" and deep.iteration_time_s == base.iteration_time_s
    assert base.iterations == pytest.approx(1.0 + 0.5 * 0.5) and deep.iterations == pytest.approx(1.0 + 0.5 * 1.5)
    assert deep.stage_memory_bytes[0] > base.stage_memory_bytes[0]  # two more versions and activations
    assert deep.stage_memory_bytes[1] == base.stage_memory_bytes[1]  # the last stage has no staleness
    assert solve(model, num_devices=2, convergence=ConvergenceModel(beta=1.0)).num_stages == 2  # 18 against 24
    assert solve(model, num_devices=2, convergence=ConvergenceModel(beta=1.0), schedule="async+2").num_stages == 1  # 30


def test_planner_refuses_a_staleness_profile_it_cannot_charge() -> None:
    class Uneven(type(get_schedule("async"))):  # type: ignore[misc]
        def _staleness(self, stage_idx: int, num_stages: int) -> int:
            return 0 if stage_idx == num_stages - 1 else 1  # not proportional to S-1-k

    with pytest.raises(ConfigurationError, match=r"staleness c \(S-1-k\) for a constant c >= 1; schedule 'async'"):
        solve(uniform(4), num_devices=2, schedule=Uneven())
