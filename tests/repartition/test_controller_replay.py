"""Replaying the adaptive loop on the synthetic pipeline: deterministic, detects an onset, and switches the
partition the next windows are drawn under."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.convergence import ConvergenceModel
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor.base import PipelineWindow
from lightning_dynpipe.repartition import AdaptiveController, GainOverCostPolicy, RepartitionPolicy
from lightning_dynpipe.repartition.replay import Env, ReplayResult, SyntheticPipeline, replay, synthetic_model_cost
from lightning_dynpipe.repartition.rules import VarunaRule

COST = synthetic_model_cost()
START = Partition((6, 4))  # the planner's best on the clean profile of the synthetic model
QUOTA = [(0, Env(noise=0.03)), (50, Env(noise=0.03, quota=(None, 0.25)))]


def _replay(
    policy: RepartitionPolicy, timeline: list[tuple[int, Env]], seed: int = 0, signs: bool = True, steps: int = 150
) -> tuple[ReplayResult, SyntheticPipeline, AdaptiveController]:
    pipe = SyntheticPipeline(COST, timeline, seed=seed)
    controller = AdaptiveController(
        policy, model_cost=COST, comm=pipe.link, schedule="async", num_microbatches=4,
        convergence=ConvergenceModel(beta=0.0),
    )  # fmt: skip
    result = replay(controller, pipe.window, START, steps=steps, every=10, signs=signs)
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


def test_the_windows_signs_reach_the_policy_so_a_hog_moves_at_the_first_check() -> None:
    """The strategy gives the controller each window's signs of interference; so does the replay (a hog shows as
    other processes busy on the stage's cores), and the policy's explained patience (1 check) applies instead of
    its patience (2). A CPU limit below one core is a cause either way: the controller reads it in the window."""
    hog = [(0, Env(noise=0.03)), (50, Env(noise=0.03, hog=(1.0, 0.0)))]
    shown, _, controller = _replay(GainOverCostPolicy(), hog)
    hidden, _, _ = _replay(GainOverCostPolicy(), hog, signs=False)
    assert shown.first_move_after(50) == 10 and hidden.first_move_after(50) == 20
    assert controller.decisions[5].inputs.causes.startswith("stage 0: other processes busy on its cores (1.00 cores)")
    quota, _, limited = _replay(GainOverCostPolicy(), QUOTA, signs=False)
    assert quota.first_move_after(50) == 10
    assert limited.decisions[5].inputs.causes == "stage 1: cgroup CPU limit 0.25 cores"


def test_a_compute_reading_the_step_time_contradicts_does_not_move() -> None:
    """Stage 0's compute reads 1.5x for three windows in a row while the pipeline's step time stays: no visible
    cause, and the measurement contradicts the prediction, so the default policy keeps the partition. The same
    reading with the step time slowed as the prediction says moves."""
    pipe = SyntheticPipeline(COST, [(0, Env(noise=0.0))], seed=0)

    def spiky(step: int, partition: Partition, slowed: bool) -> PipelineWindow:
        window = pipe.window(step, partition)
        if not 40 <= step <= 60:
            return window
        first = dataclasses.replace(window.stages[0], compute_s=window.stages[0].compute_s * 1.5)
        stages = [first, *window.stages[1:]]
        if slowed:  # the stage binds the pipeline: every stage's step time stretches with it
            stages = [dataclasses.replace(t, step_s=t.step_s * 1.4) for t in stages]
        return PipelineWindow(partition, tuple(stages), window.num_microbatches)

    for slowed in (False, True):
        controller = AdaptiveController(
            GainOverCostPolicy(), model_cost=COST, comm=pipe.link, schedule="async", num_microbatches=4,
            convergence=ConvergenceModel(beta=0.0),
        )  # fmt: skip
        result = replay(controller, lambda step, p, s=slowed: spiky(step, p, s), START, steps=100)
        if slowed:
            assert [m.step for m in result.moves][:1] == [50], result.moves
        else:
            assert result.moves == ()
            assert "does not show the slowdowns" in controller.decisions[3].reason


def test_bad_timelines_and_lengths_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="the first at step 0"):
        SyntheticPipeline(COST, [(10, Env())])
    controller = _replay(GainOverCostPolicy(), QUOTA)[2]
    with pytest.raises(ConfigurationError, match="steps >= 1"):
        replay(controller, SyntheticPipeline(COST, QUOTA).window, START, steps=0)


@pytest.mark.parametrize("seed", [0, 2])
def test_a_spike_beside_a_quota_does_not_move_layers_back_to_the_limited_stage(seed: int) -> None:
    """Quota 25% on stage 1 from step 100, and the 1.5x readings of a spike (5% of windows and stages): the loop
    moves once, layers off the limited stage. A spike on stage 0 later reads as stage 0 slowed (the predictor
    remembers its speed), but the quota on stage 1 does not explain moving a layer back there: that waits for
    patience, and a spike lasts one window."""
    timeline = [(0, Env(noise=0.03, spike=0.05)), (100, Env(noise=0.03, spike=0.05, quota=(None, 0.25)))]
    result, _, controller = _replay(GainOverCostPolicy(), timeline, seed=seed, steps=400)
    assert [(m.step, m.new) for m in result.moves] == [(110, Partition((9, 1)))]
    assert any(d.inputs.slowdowns[0] > 1.2 for d in controller.decisions[12:])  # the spikes were seen
