"""The adaptive loop's decision logic on a stand-in strategy (no processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from lightning_dynpipe.adaptive import AdaptiveController, StageTimes
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
