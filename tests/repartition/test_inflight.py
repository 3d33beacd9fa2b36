"""The adaptive loop's choice of how many micro-batches are in flight: the depth policy's rules, and the controller
pricing ``async+d`` on the current partition in time to accuracy (a slow link hidden against the deeper
staleness's extra steps)."""

from __future__ import annotations

import pytest

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.convergence import ConvergenceModel
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor import StageTimes
from lightning_dynpipe.repartition import AdaptiveController, DepthInputs, GainOverCostPolicy, InFlightPolicy
from lightning_dynpipe.schedule import AsyncSchedule, get_schedule, simulate

ASYNC, DEEP = get_schedule("async"), get_schedule("async+1")


def _inputs(
    step: int,
    *,
    current: str = "async",
    candidate: str = "async+1",
    now: float = 0.020,
    then: float = 0.015,
    measured: float = 0.020,
    factor: float = 1.0,
    causes: str = "",
    waits: tuple[float, ...] = (),
) -> DepthInputs:
    return DepthInputs(
        step=step,
        current=get_schedule(current),
        candidate=get_schedule(candidate),
        current_step_s=now,
        candidate_step_s=then,
        candidate_step_high_s=then,
        measured_step_s=measured,
        convergence_factor=factor,
        change_cost_s=measured,
        remaining_steps=1000,
        causes=causes,
        waits_s=waits,
    )


def test_a_depth_that_pays_is_taken_after_patience_and_a_visible_cause_shortens_it() -> None:
    policy = InFlightPolicy(patience=2, explained_patience=1)
    first = policy.decide(_inputs(10))
    assert not first.change and "waiting for 2 checks in a row (1 so far)" in first.reason
    second = policy.decide(_inputs(20))
    assert second.change and second.schedule == DEEP, second
    assert second.predicted_gain_s == pytest.approx(0.005 * 200)
    assert "reschedule async -> async+1" in str(second)
    explained = InFlightPolicy(patience=2, explained_patience=1).decide(
        _inputs(10, causes="the link measured slower than the set-up probe")
    )
    assert explained.change and "after 1 check: the link measured slower" in explained.reason


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"then": 0.019}, "gain (lower end) below 10% of the step time"),
        ({"remaining": 1}, "does not pay 2x the change's cost"),
        ({"candidate": "async"}, "the current depth is already the best"),
        # a 25% saving of the measured 40 ms step predicted, but stage 1 waited 2 ms a step for a message: it is busy
        # for the rest (a small model's framework time per micro-batch), so the saving counts as 5% of the step
        (
            {"measured": 0.040, "waits": (0.015, 0.002)},
            "gain (lower end) below 10% of the step time; the saving bounded by the stages' waits: stage 1 waited "
            "2.0 ms per step for a message, so async+1 counts as 19.0 ms/step (weighted), not the predicted 15.0",
        ),
    ],
)
def test_small_gains_short_runs_and_the_best_depth_stay(kwargs: dict[str, object], reason: str) -> None:
    remaining = kwargs.pop("remaining", 1000)
    inputs = _inputs(10, **kwargs)  # type: ignore[arg-type]
    inputs = DepthInputs(**{**inputs.__dict__, "remaining_steps": remaining})
    decision = InFlightPolicy(patience=1).decide(inputs)
    assert not decision.change and reason in decision.reason, decision


def test_the_waits_bound_reads_seconds_on_both_sides_and_each_depth_at_its_own_convergence_factor() -> None:
    """The predicted saving is the predicted steps' relative difference (each without its own convergence factor)
    applied to the measured step, so a profile in other units than the measured seconds does not move the bound; the
    saving counts up to the least wait of a stage for a message."""
    # predicted 20 -> 15 ms a step (25%), the measured step 60 ms: waits of 16 ms (27%) leave the saving whole
    whole = InFlightPolicy(patience=1).decide(_inputs(10, measured=0.060, waits=(0.020, 0.016)))
    assert whole.change and "bounded" not in whole.reason and whole.predicted_gain_s == pytest.approx(0.005 * 200)
    # waits of 9 ms (15%): counted at 17 ms, still 15% faster
    part = InFlightPolicy(patience=1).decide(_inputs(10, measured=0.060, waits=(0.020, 0.009)))
    assert part.change and "so async+1 counts as 17.0 ms/step (weighted), not the predicted 15.0" in part.reason
    assert part.predicted_gain_s == pytest.approx(0.003 * 200)
    # weighted 20 -> 15 ms, but the deeper depth's factor is 1.2 against 1.0: 12.5 ms raw; with waits of 10% of the
    # step it counts as 18 ms raw, 21.6 weighted: slower to accuracy than the current depth
    deeper = DepthInputs(**{**_inputs(10, measured=0.040, waits=(0.020, 0.004)).__dict__,
                            "candidate_convergence_factor": 1.2})  # fmt: skip
    slower = InFlightPolicy(patience=1).decide(deeper)
    assert not slower.change and "counts as 21.6 ms/step (weighted), not the predicted 15.0" in slower.reason
    # no measured waits, or bound_by_waits=False: the predicted saving as it is
    assert InFlightPolicy(patience=1).decide(_inputs(10, measured=0.040)).change
    unbounded = InFlightPolicy(patience=1, bound_by_waits=False)
    assert unbounded.decide(_inputs(10, measured=0.040, waits=(0.0, 0.0))).change


def test_no_change_within_the_cool_down_of_any_change() -> None:
    policy = InFlightPolicy(patience=1, cooldown_steps=30)
    policy.changed(10)  # a partition move at step 10
    assert "cool-down: 10 < 30" in policy.decide(_inputs(20)).reason
    assert policy.decide(_inputs(40)).change


def test_a_change_slower_to_accuracy_is_rolled_back_and_refused_for_a_while() -> None:
    policy = InFlightPolicy(patience=1, memory_steps=100)
    assert policy.decide(_inputs(10, measured=0.020, factor=1.1)).change  # before: 22 ms weighted
    policy.changed(10)
    # after: 17 ms a step but the deeper staleness weighs 1.4: 23.8 ms, slower to accuracy
    back = policy.decide(_inputs(20, current="async+1", candidate="async+1", measured=0.017, factor=1.4))
    assert back.change and back.schedule == ASYNC, back
    assert back.reason.startswith("roll back: async+1 measured 17.0 ms/step x 1.400, slower to accuracy")
    policy.changed(20)
    refused = policy.decide(_inputs(60))
    assert not refused.change and "async+1 made the pipeline slower to accuracy at step 20" in refused.reason
    assert policy.decide(_inputs(130)).change  # the memory has passed


def test_a_change_faster_to_accuracy_stays_and_the_rollback_is_not_judged() -> None:
    policy = InFlightPolicy(patience=1)
    assert policy.decide(_inputs(10, measured=0.020, factor=1.1)).change
    policy.changed(10)
    kept = policy.decide(_inputs(20, current="async+1", candidate="async+1", measured=0.015, factor=1.2))
    assert not kept.change and kept.reason == "the current depth is already the best"
    # a partition move before a change's first window: that window measures the partition, not the depth
    policy.changed(50)
    assert policy.decide(_inputs(90, measured=0.02, factor=1.1)).change
    policy.forget_change()
    assert not policy.decide(_inputs(100, current="async+1", candidate="async+1", measured=0.05)).change


def test_reset_forgets_and_bad_arguments_are_refused() -> None:
    policy = InFlightPolicy(patience=1)
    policy.changed(10)
    policy.reset()
    assert policy.decide(_inputs(11)).change
    with pytest.raises(ConfigurationError, match="explained_patience <= patience"):
        InFlightPolicy(patience=1, explained_patience=2)


# Five layers of 3 ms (forward 1, backward 2) whose activations are all 100 KB: moving the boundary changes nothing on
# the link. Over 20 MB/s with 1 ms latency a message takes 6 ms; on [2, 3] async's round trip (6 + 9 + 2 x 6) / 2 =
# 13.5 ms a micro-batch binds, above stage 1's 9 ms; async+1 carries 3 micro-batches per round trip: 9 ms.
UNIFORM = ModelCost.from_arrays([0.001] * 5, [0.002] * 5, param_bytes=[1000] * 5, activation_bytes=[100_000] * 5)
SLOW = CommModel(latency_s=1e-3, bandwidth_Bps=20e6)
M = 4


def _window(link: CommModel, schedule: str) -> list[StageTimes]:
    """[2, 3] as the event simulator runs it under ``schedule`` on ``link`` (every message hidden, overlap 1)."""
    fwd = [0.002, 0.003]
    msg = float(link.transfer_time(100_000))
    step = simulate(schedule, 2, M, 8, forward_time=fwd, backward_time=[2 * f for f in fwd], comm_time=[msg],
                    step_sync="last_stage_broadcast").steady_state_step_time  # fmt: skip
    return [StageTimes(M * 3 * f, step, comm_s=M * msg, exposed_comm_s=0.0) for f in fwd]


def _controller(beta: float, link: CommModel = SLOW, max_extra: int = 2, move_gain: float = 0.1) -> AdaptiveController:
    return AdaptiveController(
        GainOverCostPolicy(patience=1, horizon_steps=500, patience_s=0.0, min_relative_gain=move_gain),
        model_cost=UNIFORM,
        comm=link,
        schedule="async",
        num_microbatches=M,
        convergence=ConvergenceModel(beta=beta),
        consider_stage_counts=False,
        max_extra_in_flight=max_extra,
        depth_policy=InFlightPolicy(patience=1, horizon_steps=500),
    )


def test_a_slow_link_that_no_boundary_avoids_is_hidden_by_more_micro_batches_in_flight() -> None:
    controller = _controller(beta=0.05)
    d = controller.check(10, _window(SLOW, "async"), Partition((2, 3)), remaining_steps=2000)
    assert d is not None and not d.repartition, d  # every boundary carries 100 KB: no move helps
    depth = controller.depth_decision
    assert depth is not None and depth.change and depth.schedule == AsyncSchedule(1), depth
    # the gain is the round trip's: 13.5 -> 9 ms a micro-batch, less the deeper staleness's extra steps
    factor = {s: 1 + 0.05 * s * 2 / 5 for s in (1, 2)}  # stage 0 holds 2 of 5 layers' parameters
    assert depth.inputs.current_step_s == pytest.approx(M * 0.0135 * factor[1])
    assert depth.inputs.candidate_step_s == pytest.approx(M * 0.009 * factor[2])
    assert "depths (ms/step x convergence factor): async 55.1, async+1 37.4, async+2 38.2" in str(depth)
    # the event simulator agrees with the round trips priced (async+1 within 6%: with Lightning's broadcast at each
    # step end the first stage waits for the last stage's step end, which the closed form does not charge)
    assert _window(SLOW, "async")[0].step_s == pytest.approx(M * 0.0135)
    assert _window(SLOW, "async+1")[0].step_s == pytest.approx(M * 0.009, rel=0.06)
    controller.rescheduled(10, depth.schedule)
    assert controller.schedule == AsyncSchedule(1)
    later = controller.check(20, _window(SLOW, "async+1"), Partition((2, 3)), remaining_steps=2000)
    assert later is not None and not later.repartition  # the cool-down holds the partition too
    assert controller.depth_decision is not None and not controller.depth_decision.change


def test_a_high_price_of_staleness_or_a_quiet_link_keeps_the_depth() -> None:
    # async+1's 1.5x faster steps cost 5/3 x the steps to accuracy (the partition held: at this price of staleness
    # the planner would rather move parameters off stage 0)
    priced = _controller(beta=5.0, move_gain=0.9)
    priced.check(10, _window(SLOW, "async"), Partition((2, 3)), remaining_steps=2000)
    assert priced.depth_decision is not None and not priced.depth_decision.change
    assert priced.depth_decision.reason == "the current depth is already the best"
    quiet = CommModel(latency_s=1e-5, bandwidth_Bps=10e9)
    fast = _controller(beta=0.0, link=quiet)  # nothing to hide: the depths tie and the shallowest wins
    fast.check(10, _window(quiet, "async"), Partition((2, 3)), remaining_steps=2000)
    assert fast.depth_decision is not None and fast.depth_decision.inputs.candidate == AsyncSchedule(0)


def test_the_depth_is_not_considered_when_off_or_when_the_partition_moves() -> None:
    off = _controller(beta=0.05, max_extra=0)
    off.check(10, _window(SLOW, "async"), Partition((2, 3)), remaining_steps=2000)
    assert off.depth_decision is None and off.depth_decisions == []
    moving = _controller(beta=0.05)
    # stage 0 of [3, 2] slowed 3x on a quiet link: the partition moves, and the depth waits for its outcome
    quiet = CommModel(latency_s=1e-5, bandwidth_Bps=10e9)
    moving = _controller(beta=0.05, link=quiet)
    times = [StageTimes(M * 9 * 0.003, M * 0.0405), StageTimes(M * 6 * 0.001, M * 0.0405)]
    d = moving.check(10, times, Partition((3, 2)), remaining_steps=2000)
    assert d is not None and d.repartition and moving.depth_decision is None, d


def _slow_link_and_stage_1_slowed(balance: tuple[int, int]) -> list[StageTimes]:
    """``balance`` under async on SLOW (messages of 6 ms) with stage 1's process 2x slower: on [2, 3] stage 1 takes 18
    ms a micro-batch and the round trip (6 + 18 + 2 x 6) / 2 = 18 as well."""
    per_layer = (0.003, 0.006)
    compute = [n * t for n, t in zip(balance, per_layer)]
    step = M * max(max(compute), (sum(compute) + 2 * 0.006) / 2)
    return [StageTimes(M * c, step, comm_s=M * 0.006) for c in compute]


def test_where_a_stage_waits_less_than_a_depth_would_save_no_depth_is_taken_alone_or_with_a_move() -> None:
    """[2, 3] on the slow link with stage 1's process 1.5x slower: the priced round trip (15.75 ms a micro-batch)
    binds above stage 1's 13.5 ms, so async+1 alone is predicted to save 9 ms of the 63 ms step, and the move to
    [3, 2] with async+1 pays more. Where stage 1 waited 10 ms a step for a message, which covers that saving, the move
    comes with async+1; where it waited 1 ms (busy for the whole step: the priced round trip is not what sets the
    pace), neither the depth alone nor a move paired with it is taken."""
    per_layer, balance = (0.003, 0.0045), (2, 3)
    compute = [n * t for n, t in zip(balance, per_layer)]
    step = M * (sum(compute) + 2 * 0.006) / 2

    def check(waits: tuple[float, float]) -> AdaptiveController:
        controller = _controller(beta=0.05, max_extra=1)
        times = [StageTimes(M * c, step, comm_s=M * 0.006, recv_wait_s=w) for c, w in zip(compute, waits)]
        controller.check(10, times, Partition(balance), remaining_steps=2000)
        return controller

    as_priced = check((0.036, 0.010))
    assert as_priced.decisions[-1].partition == Partition((3, 2)) and as_priced.decisions[-1].repartition
    assert as_priced.depth_decision is not None and as_priced.depth_decision.schedule == AsyncSchedule(1)
    busy = check((0.036, 0.001))
    assert not busy.decisions[-1].repartition or busy.decisions[-1].partition != Partition((3, 2))
    assert busy.depth_decision is not None and not busy.depth_decision.change
    assert busy.depth_decision.reason == "the current depth is already the best"
    assert "async+1 56.2 (bounded by the waits: 64.5)" in str(busy.depth_decision), busy.depth_decision
    assert "waited for messages (ms/step): 36.0, 1.0" in str(busy.depth_decision)


def test_a_move_that_pays_only_with_more_micro_batches_in_flight_takes_both_at_once() -> None:
    """[2, 3] with stage 1 slowed 2x on the slow link (18 ms a micro-batch): async+1 alone leaves stage 1's 18 ms; the
    best move under async is [4, 1], where the round trip binds at (12 + 6 + 12) / 2 = 15 ms; [3, 2] with async+1
    runs at stage 1's 12 ms. The loop takes that move and the depth together, and a roll back of the move takes the
    depth back."""
    controller = _controller(beta=0.05, max_extra=1)
    d = controller.check(10, _slow_link_and_stage_1_slowed((2, 3)), Partition((2, 3)), remaining_steps=2000)
    assert d is not None and d.repartition and d.partition == Partition((3, 2)), d
    assert "with async+1 (changed with the move)" in str(d)
    depth = controller.depth_decision
    assert depth is not None and depth.change and depth.schedule == AsyncSchedule(1), depth
    assert depth.reason == "with the move [2, 3] -> [3, 2]" and controller.depth_decisions == [depth]
    factor = {s: 1 + 0.05 * s * 3 / 5 for s in (1, 2)}  # stage 0 of [3, 2] holds 3 of 5 layers' parameters
    assert d.inputs.candidate_step_s == pytest.approx(M * 0.012 * factor[2])
    # without the depth to choose, the round trip caps what a move reaches
    alone = _controller(beta=0.05, max_extra=0)
    moved = alone.check(10, _slow_link_and_stage_1_slowed((2, 3)), Partition((2, 3)), remaining_steps=2000)
    assert moved is not None and moved.repartition and moved.partition == Partition((4, 1)), moved
    assert moved.inputs.candidate_step_s == pytest.approx(M * 0.015 * (1 + 0.05 * 4 / 5))
    # applied as the strategy does; the first window after it measures the pair slower than before: both go back
    controller.migrated(10)
    controller.rescheduled(10, AsyncSchedule(1))
    slower = [StageTimes(M * 0.009, M * 0.030, comm_s=M * 0.006), StageTimes(M * 0.012, M * 0.030, comm_s=M * 0.006)]
    back = controller.check(20, slower, Partition((3, 2)), remaining_steps=2000)
    assert back is not None and back.repartition and back.partition == Partition((2, 3)) and "roll back" in back.reason
    undo = controller.depth_decision
    assert undo is not None and undo.change and undo.schedule == AsyncSchedule(0), undo
    assert undo.reason == "with the roll back [3, 2] -> [2, 3]"
