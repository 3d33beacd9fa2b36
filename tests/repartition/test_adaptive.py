"""The adaptive loop's decision logic on a stand-in strategy (no processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from lightning_dynpipe.adaptive import AdaptiveController, StageTimes, measured_slowdowns
from lightning_dynpipe.plan.convergence import ConvergenceModel
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.repartition.policy import GainOverCostPolicy

M = 4
COST = ModelCost.from_arrays([0.001] * 8, [0.002] * 8, param_bytes=[1000] * 8)


@dataclass
class _Topo:
    dp_size: int = 1


@dataclass
class FakeStrategy:
    partition: Partition = field(default_factory=lambda: Partition((4, 4)))
    model_cost: ModelCost = COST
    num_microbatches: int = M
    schedule: str = "async"
    convergence: ConvergenceModel = field(default_factory=lambda: ConvergenceModel(beta=0.0))
    comm: CommModel = field(default_factory=CommModel)
    topology: _Topo = field(default_factory=_Topo)
    migrations: list[Any] = field(default_factory=list)
    _pending_partition: Partition | None = None
    requested: list[Partition] = field(default_factory=list)

    def repartition(self, p: Partition) -> None:
        self.requested.append(p)


def _times(slow1: float) -> list[StageTimes]:
    base = M * 4 * 0.003
    return [StageTimes(base, base * slow1), StageTimes(base * slow1, base * slow1)]


def test_no_interference_keeps_the_partition() -> None:
    s = FakeStrategy()
    c = AdaptiveController(s, GainOverCostPolicy(patience=1))  # type: ignore[arg-type]
    d = c.check(10, _times(1.0), remaining_steps=1000)
    assert d is not None and not d.repartition and "already the best" in d.reason
    assert s.requested == []


def test_a_slowed_stage_loses_layers_after_the_policy_agrees() -> None:
    s = FakeStrategy()
    c = AdaptiveController(s, GainOverCostPolicy(patience=2, horizon_steps=500))  # type: ignore[arg-type]
    first = c.check(10, _times(3.0), remaining_steps=1000)
    assert first is not None and not first.repartition
    assert first.inputs.slowdowns == pytest.approx((1.0, 3.0))
    second = c.check(20, _times(3.0), remaining_steps=1000)
    assert second is not None and second.repartition
    assert s.requested == [Partition((6, 2))]  # 3x slower stage 1 gets a third of stage 0's layers
    assert second.inputs.candidate_step_s < second.inputs.current_step_s
    assert len(c.decisions) == 2 and "repartition [4, 4] -> [6, 2]" in str(second)


def test_no_decision_while_a_migration_is_pending_or_without_a_profile() -> None:
    s = FakeStrategy(_pending_partition=Partition((5, 3)))
    assert AdaptiveController(s, GainOverCostPolicy()).check(10, _times(3.0), None) is None  # type: ignore[arg-type]


def test_a_cpu_limited_stage_counts_as_at_least_one_over_its_limit_slowed() -> None:
    # Under a 25% quota a stage that does little work shows little stretch in its compute (its throttling
    # lands in its waits), yet it cannot run faster than a quarter of a core: the limit is a floor.
    mild = [StageTimes(0.048, 0.1), StageTimes(0.06, 0.1, cpu_limit=0.25)]
    assert measured_slowdowns(COST, Partition((4, 4)), mild, M) == pytest.approx((1.0, 4.0))
    strong = [StageTimes(0.048, 0.3), StageTimes(0.288, 0.3, cpu_limit=0.25)]
    assert measured_slowdowns(COST, Partition((4, 4)), strong, M) == pytest.approx((1.0, 6.0))  # measured wins
    roomy = [StageTimes(0.048, 0.1), StageTimes(0.06, 0.1, cpu_limit=1.5)]  # more than the one core it uses
    assert measured_slowdowns(COST, Partition((4, 4)), roomy, M) == pytest.approx((1.0, 1.25))

    s = FakeStrategy()
    c = AdaptiveController(s, GainOverCostPolicy(patience=1, horizon_steps=500))  # type: ignore[arg-type]
    d = c.check(10, mild, remaining_steps=1000)
    assert d is not None and d.repartition and d.inputs.slowdowns == pytest.approx((1.0, 4.0))
    assert s.requested == [Partition((7, 1))]  # a 4x slower stage keeps an eighth of the work
