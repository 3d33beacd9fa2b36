"""The adaptive loop's decisions from explicit inputs (no strategy, no processes)."""

from __future__ import annotations

import pytest

from lightning_dynpipe.plan.convergence import ConvergenceModel
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.repartition.controller import AdaptiveController, StageTimes, measured_slowdowns
from lightning_dynpipe.repartition.policy import GainOverCostPolicy

M = 4
COST = ModelCost.from_arrays([0.001] * 8, [0.002] * 8, param_bytes=[1000] * 8)


def _controller(policy: GainOverCostPolicy) -> AdaptiveController:
    return AdaptiveController(
        policy,
        model_cost=COST,
        comm=CommModel(),
        schedule="async",
        num_microbatches=M,
        convergence=ConvergenceModel(beta=0.0),
    )


PART = Partition((4, 4))


def _times(slow1: float) -> list[StageTimes]:
    base = M * 4 * 0.003
    return [StageTimes(base, base * slow1), StageTimes(base * slow1, base * slow1)]


def test_no_interference_keeps_the_partition() -> None:
    c = _controller(GainOverCostPolicy(patience=1))
    d = c.check(10, _times(1.0), PART, remaining_steps=1000)
    assert d is not None and not d.repartition and "already the best" in d.reason


def test_a_slowed_stage_loses_layers_after_the_policy_agrees() -> None:
    c = _controller(GainOverCostPolicy(patience=2, horizon_steps=500))
    first = c.check(10, _times(3.0), PART, remaining_steps=1000)
    assert first is not None and not first.repartition
    assert first.inputs.slowdowns == pytest.approx((1.0, 3.0))
    second = c.check(20, _times(3.0), PART, remaining_steps=1000)
    assert second is not None and second.repartition
    assert second.partition == Partition((6, 2))  # 3x slower stage 1 gets a third of stage 0's layers
    assert second.inputs.candidate_step_s < second.inputs.current_step_s
    assert len(c.decisions) == 2 and "repartition [4, 4] -> [6, 2]" in str(second)


def test_no_decision_for_a_window_of_another_stage_count() -> None:
    assert _controller(GainOverCostPolicy()).check(10, _times(3.0), Partition((3, 3, 2)), None) is None


def test_the_migration_cost_is_the_mean_measured_pause_once_there_is_one() -> None:
    c = _controller(GainOverCostPolicy(patience=1))
    estimate = c.check(10, _times(3.0), PART, 1000)
    measured = c.check(20, _times(3.0), PART, 1000, past_pauses_s=[0.2, 0.4])
    assert estimate is not None and measured is not None
    assert measured.inputs.migration_cost_s == pytest.approx(0.3)
    assert estimate.inputs.migration_cost_s >= max(t.step_s for t in _times(3.0))  # a drain: at least one step


def test_a_cpu_limited_stage_counts_as_at_least_one_over_its_limit_slowed() -> None:
    # Under a 25% quota a stage that does little work shows little stretch in its compute (its throttling
    # lands in its waits), yet it cannot run faster than a quarter of a core: the limit is a floor.
    mild = [StageTimes(0.048, 0.1), StageTimes(0.06, 0.1, cpu_limit=0.25)]
    assert measured_slowdowns(COST, Partition((4, 4)), mild, M) == pytest.approx((1.0, 4.0))
    strong = [StageTimes(0.048, 0.3), StageTimes(0.288, 0.3, cpu_limit=0.25)]
    assert measured_slowdowns(COST, Partition((4, 4)), strong, M) == pytest.approx((1.0, 6.0))  # measured wins
    roomy = [StageTimes(0.048, 0.1), StageTimes(0.06, 0.1, cpu_limit=1.5)]  # more than the one core it uses
    assert measured_slowdowns(COST, Partition((4, 4)), roomy, M) == pytest.approx((1.0, 1.25))

    c = _controller(GainOverCostPolicy(patience=1, horizon_steps=500))
    d = c.check(10, mild, PART, remaining_steps=1000)
    assert d is not None and d.repartition and d.inputs.slowdowns == pytest.approx((1.0, 4.0))
    assert d.partition == Partition((7, 1))  # a 4x slower stage keeps an eighth of the work


def test_a_limited_stages_cpu_around_its_layers_moves_the_proposal_further() -> None:
    """Under half a core, stage 1 spends 40 ms per step besides its layers' 48: priced per layer (2x), [5, 3] or
    [6, 2] balance it; priced as all its CPU over the limit, [7, 1] is faster (26 against 32 ms per micro-batch for
    [6, 2]), and two layers away from [4, 4] only the second solve, under the stages' multipliers as priced, finds
    it."""
    measured = [StageTimes(0.048, 0.2), StageTimes(0.048, 0.2, cpu_limit=0.5, cpu_s=0.088)]
    d = _controller(GainOverCostPolicy(patience=1, horizon_steps=500)).check(10, measured, PART, remaining_steps=1000)
    assert d is not None and d.repartition and d.inputs.slowdowns == pytest.approx((1.0, 2.0))
    assert d.partition == Partition((7, 1))
    assert d.inputs.current_step_s == pytest.approx(M * (0.040 / M + 0.012) / 0.5, rel=0.05)  # the quota's step
    unmeasured = [measured[0], StageTimes(0.048, 0.2, cpu_limit=0.5)]  # the CPU not measured: the slowdown alone
    d = _controller(GainOverCostPolicy(patience=1, horizon_steps=500)).check(10, unmeasured, PART, remaining_steps=1000)
    assert d is not None and d.repartition and d.partition in (Partition((5, 3)), Partition((6, 2)))
