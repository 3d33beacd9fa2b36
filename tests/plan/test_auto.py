"""best_plan uses every process (S divides the world size) and simulate_plan feeds the plan to the simulator."""

from __future__ import annotations

import pytest

from lightning_dynpipe.errors import PartitionError
from lightning_dynpipe.plan.auto import best_plan, simulate_plan
from lightning_dynpipe.plan.convergence import ConvergenceModel
from lightning_dynpipe.plan.costs import CommModel, ModelCost


def _cost(n: int = 6) -> ModelCost:
    return ModelCost.from_arrays([1.0] * n, [2.0] * n, param_bytes=[4] * n, activation_bytes=[1000] * n)


def test_every_process_is_used() -> None:
    for world in (1, 2, 3, 4, 6):
        plan = best_plan(_cost(), world, convergence=ConvergenceModel(beta=0.5))
        assert plan.num_stages * plan.dp == world


def test_fixed_stages_and_costly_staleness() -> None:
    assert best_plan(_cost(), 2, num_stages=2).partition.balance == (3, 3)
    # staleness so costly that replicas beat a pipeline on the same two processes
    assert best_plan(_cost(), 2, convergence=ConvergenceModel(beta=100.0)).num_stages == 1


def test_infeasible_reports_every_candidate() -> None:
    with pytest.raises(PartitionError, match="No feasible plan of"):
        best_plan(_cost(), 2, memory_cap=1.0)


def test_simulated_step_time_matches_the_hand_computation() -> None:
    """Two stages of 3 layers: F=3, B=6 per stage and micro-batch; comm 0.5 per boundary transfer."""
    plan = best_plan(_cost(), 2, num_stages=2)
    r = simulate_plan(plan, _cost(), schedule="sync", num_microbatches=4, num_steps=3, comm=CommModel(latency_s=0.5))
    # sync 1F1B with a flush: (M + S - 1) * (F + B) plus the exposed transfers of fill and drain
    assert r.steady_state_step_time == pytest.approx(5 * 9 + 2 * 0.5, rel=0.05)
    fast = simulate_plan(plan, _cost(), schedule="async", num_microbatches=4, num_steps=3)
    assert fast.steady_state_step_time < r.steady_state_step_time


def _embedding_first() -> ModelCost:
    """An embedding-like layer 0: little compute, a costly update (a large table), then four equal blocks."""
    return ModelCost.from_arrays(
        [0.1, 1.0, 1.0, 1.0, 1.0], [0.2, 2.0, 2.0, 2.0, 2.0], param_bytes=[64, 8, 8, 8, 8], update_s=[6.0, 0, 0, 0, 0]
    )


def test_updates_count_once_per_microbatch_without_a_flush_and_once_per_step_with_one() -> None:
    """async updates after every micro-batch: the embedding's update makes it as costly as two blocks, so the
    cut moves left ([2, 3]: 9.3 against 9 per micro-batch) of where compute alone puts it ([3, 2]); sync pays the
    update once per M = 4 micro-batches and keeps [3, 2]."""
    cost = _embedding_first()
    assert best_plan(cost, 2, num_stages=2, schedule="async", num_microbatches=4).partition.balance == (2, 3)
    assert best_plan(cost, 2, num_stages=2, schedule="sync", num_microbatches=4).partition.balance == (3, 2)
    compute_only = ModelCost.from_arrays(**{**cost.to_arrays(), "update_s": 0.0})
    assert best_plan(compute_only, 2, num_stages=2, schedule="async", num_microbatches=4).partition.balance == (3, 2)


def test_the_simulated_step_includes_the_updates() -> None:
    """async, [2, 3]: stage 0 forwards 1.1, backwards 2.2 and updates 6.0 per micro-batch; the bottleneck's
    9.3 per micro-batch sets the steady-state step (M = 4)."""
    cost = _embedding_first()
    plan = best_plan(cost, 2, num_stages=2, schedule="async", num_microbatches=4)
    r = simulate_plan(plan, cost, schedule="async", num_microbatches=4, num_steps=6)
    assert r.steady_state_step_time == pytest.approx(4 * 9.3, rel=0.02)
    assert plan.iteration_time_s == pytest.approx(9.3, rel=1e-9)
