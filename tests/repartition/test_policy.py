"""The default repartition policy: gain vs. cost, relative threshold, hysteresis, cool-down; and plan_moves."""

from __future__ import annotations

import pytest

from lightning_dynpipe import ConfigurationError, Partition, PartitionError
from lightning_dynpipe.repartition import plan_moves
from lightning_dynpipe.repartition.policy import GainOverCostPolicy, PolicyInputs, RepartitionPolicy

CUR, CAND = Partition((3, 3)), Partition((4, 2))


def _inputs(step: int, current_s: float = 1.0, candidate_s: float = 0.6, cost: float = 5.0,
            candidate: Partition = CAND, remaining: int | None = None) -> PolicyInputs:
    return PolicyInputs(step=step, current=CUR, candidate=candidate, current_step_s=current_s,
                        candidate_step_s=candidate_s, measured_step_s=current_s, migration_cost_s=cost,
                        remaining_steps=remaining, slowdowns=(1.0, 2.0))


def test_moves_after_patience_and_then_cools_down() -> None:
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=2, cooldown_steps=30)
    assert isinstance(policy, RepartitionPolicy)
    first = policy.decide(_inputs(10))
    assert not first.repartition and "2 checks in a row (1 so far)" in first.reason
    second = policy.decide(_inputs(20))
    assert second.repartition and second.partition == CAND and second.predicted_gain_s == pytest.approx(40.0)
    policy.migrated(21)
    assert "cool-down" in policy.decide(_inputs(40)).reason
    assert not policy.decide(_inputs(60)).repartition  # patience starts over after the cool-down
    assert policy.decide(_inputs(70)).repartition


def test_a_spike_does_not_move() -> None:
    policy = GainOverCostPolicy(patience=3)
    assert not policy.decide(_inputs(10)).repartition
    assert not policy.decide(_inputs(20, candidate=CUR)).repartition  # the spike is gone: streak resets
    assert not policy.decide(_inputs(30)).repartition
    assert not policy.decide(_inputs(40)).repartition
    assert policy.decide(_inputs(50)).repartition


def test_gain_must_pay_the_migration() -> None:
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1)
    assert "does not pay" in policy.decide(_inputs(10, cost=50.0)).reason
    assert "does not pay" in policy.decide(_inputs(10, remaining=5)).reason  # near the end of the run
    assert "below 10%" in policy.decide(_inputs(10, candidate_s=0.97)).reason
    assert "already the best" in policy.decide(_inputs(10, candidate=CUR)).reason
    assert "keep [3, 3]" in str(policy.decide(_inputs(10, candidate=CUR)))


def test_policy_arguments_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="patience >= 1"):
        GainOverCostPolicy(patience=0)


def test_plan_moves() -> None:
    moves = plan_moves(Partition((3, 2, 1)), Partition((1, 2, 3)))
    assert [(m.layer_idx, m.src, m.dst) for m in moves] == [(1, 0, 1), (2, 0, 1), (3, 1, 2), (4, 1, 2)]
    assert plan_moves(CUR, CUR) == ()
    with pytest.raises(PartitionError, match="keeps the layers and the number of stages"):
        plan_moves(CUR, Partition((2, 2, 2)))
