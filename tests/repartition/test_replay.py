"""Replaying the adaptive loop on the synthetic pipeline: deterministic, detects an onset, and switches the
partition the next windows are drawn under."""

from __future__ import annotations

import pytest

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.convergence import ConvergenceModel
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.repartition import AdaptiveController, GainOverCostPolicy, RepartitionPolicy
from lightning_dynpipe.repartition.replay import Env, ReplayResult, SyntheticPipeline, replay, synthetic_model_cost
from lightning_dynpipe.repartition.rules import VarunaRule

COST = synthetic_model_cost()
START = Partition((6, 4))  # the planner's best on the clean profile of the synthetic model
QUOTA = [(0, Env(noise=0.03)), (50, Env(noise=0.03, quota=(None, 0.25)))]


def _replay(
    policy: RepartitionPolicy, timeline: list[tuple[int, Env]], seed: int = 0
) -> tuple[ReplayResult, SyntheticPipeline, AdaptiveController]:
    pipe = SyntheticPipeline(COST, timeline, seed=seed)
    controller = AdaptiveController(
        policy, model_cost=COST, comm=pipe.link, schedule="async", num_microbatches=4,
        convergence=ConvergenceModel(beta=0.0),
    )  # fmt: skip
    result = replay(controller, pipe.window, START, steps=150, every=10)
    return result, pipe, controller


def test_the_default_policy_detects_a_quota_and_moves_towards_the_oracle() -> None:
    result, pipe, controller = _replay(GainOverCostPolicy(), QUOTA)
    first = result.first_move_after(50)
    assert first is not None and first <= 20, result.moves
    assert result.moves_between(0, 50) == 0
    moved_to = result.partition_at(150)
    assert moved_to.balance[1] < START.balance[1]  # layers leave the limited stage
    assert pipe.step_s(150, moved_to) < pipe.step_s(150, START)
    assert len(controller.decisions) == 15 and result.partitions[-1][1] == result.partition_at(149)


def test_replays_are_deterministic_and_clean_runs_stay() -> None:
    a, _, _ = _replay(GainOverCostPolicy(), QUOTA, seed=3)
    b, _, _ = _replay(GainOverCostPolicy(), QUOTA, seed=3)
    assert a == b
    clean, _, _ = _replay(GainOverCostPolicy(), [(0, Env(noise=0.03))])
    assert clean.moves == ()


def test_varuna_moves_on_a_spike_where_the_gain_policy_does_not() -> None:
    spiky = [(0, Env(noise=0.02, spike=0.3))]
    varuna, _, _ = _replay(VarunaRule(), spiky)
    gain, _, _ = _replay(GainOverCostPolicy(), spiky)
    assert len(varuna.moves) > 0 and gain.moves == ()


def test_bad_timelines_and_lengths_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="the first at step 0"):
        SyntheticPipeline(COST, [(10, Env())])
    controller = _replay(GainOverCostPolicy(), QUOTA)[2]
    with pytest.raises(ConfigurationError, match="steps >= 1"):
        replay(controller, SyntheticPipeline(COST, QUOTA).window, START, steps=0)
