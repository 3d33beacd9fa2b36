"""The escalation ladder: ignore a short imbalance, re-split when one replica is slow, hand balanced replicas to
the layer controller, report a better number of stages; and its wiring into the adaptive loop."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.monitor.stats import StageReport, StageSample, StageSummary, interference_excess
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.plan.replicas import ReplicaSplit
from lightning_dynpipe.repartition.ladder import EscalationLadder, ReplicaWindow, replica_window
from lightning_dynpipe.strategy.adaptation import MIN_SAMPLES, AdaptationWiring
from lightning_dynpipe.strategy.config import DynPipeConfig

EVEN = ReplicaSplit.even(2)


def _window(step: int, compute: tuple[float, float], split: ReplicaSplit = EVEN, n: int = 32) -> ReplicaWindow:
    shares = split.shares(n, 4)
    return ReplicaWindow(step, tuple(float(s) for s in shares), ((compute[0],), (compute[1],)), split)


def test_a_slow_replica_is_ignored_once_then_resplit_by_speed() -> None:
    ladder = EscalationLadder(min_gain=0.05, patience=2)
    first = ladder.decide(_window(10, (0.010, 0.020)))  # replica 1 at half speed
    assert first.rung == "ignore" and "1 of 2 checks" in first.reason
    second = ladder.decide(_window(20, (0.010, 0.020)))
    assert second.rung == "resplit" and second.split is not None
    assert second.split.weights == pytest.approx((2 / 3, 1 / 3))
    # 32 samples at 1600 and 800 samples/s: 16/800 = 20 ms evenly, 32 * (2/3) / 1600 = 13.3 ms split (1.5x)
    assert "replica samples/s [1600, 800]" in second.reason and "20.0 -> 13.3 ms (+33%)" in second.reason
    # under the new split the replicas are balanced: nothing more to do (no churn)
    shares = second.split.shares(32, 4)  # (21, 11)
    third = ladder.decide(_window(30, (shares[0] * 0.010 / 16, shares[1] * 0.020 / 16), second.split))
    assert third.rung == "keep" and "balanced" in third.reason
    assert [d.rung for d in ladder.decisions] == ["ignore", "resplit", "keep"]


def test_an_imbalance_that_persists_after_a_resplit_is_refined_at_once() -> None:
    ladder = EscalationLadder(patience=2)
    ladder.decide(_window(10, (0.010, 0.020)))
    first = ladder.decide(_window(20, (0.010, 0.020)))
    assert first.rung == "resplit" and first.split is not None  # 21:11
    # the slow replica has a fixed cost per step: with 11 samples it still takes 16 ms, the other 13 ms
    again = ladder.decide(_window(30, (0.013, 0.016), first.split))
    assert again.rung == "resplit" and again.split is not None and again.split.weights[1] < first.split.weights[1]


def test_a_resplit_that_does_not_shorten_the_step_is_rolled_back_and_held() -> None:
    ladder = EscalationLadder(patience=1)
    w = _window(10, (0.010, 0.020))
    first = ladder.decide(ReplicaWindow(w.step, w.samples, w.compute_s, w.split, step_s=0.030))
    assert first.rung == "resplit" and first.split is not None
    # under the new split the step measured no faster (the slow replica's time did not follow its share)
    shares = first.split.shares(32, 4)
    after = ReplicaWindow(20, tuple(float(x) for x in shares), ((0.010,), (0.020,)), first.split, step_s=0.033)
    back = ladder.decide(after)
    assert back.rung == "resplit" and back.split == EVEN and "roll back" in back.reason
    # back at the even split the same imbalance is measured again: held, no ping-pong
    held = ladder.decide(ReplicaWindow(30, w.samples, w.compute_s, EVEN, step_s=0.030))
    assert held.rung == "keep" and "held" in held.reason
    # the interference moves to the other replica: the target turns the other way, the hold is released
    other = ladder.decide(ReplicaWindow(40, w.samples, ((0.020,), (0.010,)), EVEN, step_s=0.030))
    assert other.rung == "resplit" and other.split is not None and other.split.weights[1] > 0.5


def test_a_resplit_is_judged_by_mean_step_times_where_measured() -> None:
    """Under a quota the median can say slower (30 -> 33 ms) while the mean says faster (45 -> 36 ms): kept."""
    ladder = EscalationLadder(patience=1)
    w = _window(10, (0.010, 0.020))
    first = ladder.decide(ReplicaWindow(w.step, w.samples, w.compute_s, w.split, step_s=0.030, mean_step_s=0.045))
    assert first.rung == "resplit" and first.split is not None
    shares = tuple(float(x) for x in first.split.shares(32, 4))
    after = ReplicaWindow(20, shares, ((0.014,), (0.014,)), first.split, step_s=0.033, mean_step_s=0.036)
    kept = ladder.decide(after)
    assert kept.rung == "keep" and "roll back" not in kept.reason
    assert (
        after.judged_step_s == 0.036 and ReplicaWindow(20, shares, ((0.01,), (0.01,)), EVEN, 0.03).judged_step_s == 0.03
    )


def test_a_resplit_measured_within_the_noise_of_before_is_not_rolled_back() -> None:
    ladder = EscalationLadder(patience=1, rollback_tolerance=0.02)  # the test measures +1%
    w = _window(10, (0.010, 0.020))
    first = ladder.decide(ReplicaWindow(w.step, w.samples, w.compute_s, w.split, step_s=0.030))
    assert first.split is not None
    shares = tuple(float(x) for x in first.split.shares(32, 4))
    same = ladder.decide(ReplicaWindow(20, shares, ((0.014,), (0.014,)), first.split, step_s=0.0303))  # +1%
    assert same.rung == "keep" and "roll back" not in same.reason


def test_a_held_direction_is_tried_again_after_hold_checks() -> None:
    ladder = EscalationLadder(patience=1, hold_checks=2)
    w = _window(10, (0.010, 0.020))
    first = ladder.decide(ReplicaWindow(w.step, w.samples, w.compute_s, EVEN, step_s=0.030))
    assert first.split is not None
    shares = tuple(float(x) for x in first.split.shares(32, 4))
    back = ladder.decide(ReplicaWindow(20, shares, ((0.010,), (0.020,)), first.split, step_s=0.040))
    assert "roll back" in back.reason
    rungs = [ladder.decide(ReplicaWindow(30 + 10 * i, w.samples, w.compute_s, EVEN, step_s=0.030)).rung
             for i in range(3)]  # fmt: skip
    assert rungs == ["keep", "keep", "resplit"]  # held for 2 checks, then the same re-split once more


def _probe_window(step: int, split: ReplicaSplit, step_s: float) -> ReplicaWindow:
    """Replica 1 computes a sample 3x slower than replica 0; the split in use makes both arrive together."""
    shares = tuple(float(x) for x in split.shares(64, 4))
    compute = ((shares[0] * 0.001,), (shares[1] * 0.003,))
    return ReplicaWindow(step, shares, compute, split, step_s=step_s, update_s=((0.005,), (0.005,)))


def test_from_equal_arrival_a_probe_further_is_kept_while_it_shortens_the_step() -> None:
    ladder = EscalationLadder(patience=1, probe=0.05, probe_growth=1.0)
    start = ReplicaSplit((0.75, 0.25))
    first = ladder.decide(_probe_window(10, start, step_s=0.060))
    assert first.rung == "resplit" and "probe" in first.reason and first.split is not None
    assert first.split.weights == pytest.approx((0.80, 0.20))
    # faster: kept, and the next probe goes further
    second = ladder.decide(_probe_window(20, first.split, step_s=0.055))
    assert second.rung == "resplit" and "probe" in second.reason and second.split is not None
    assert second.split.weights == pytest.approx((0.85, 0.15))
    # not faster: back to the best, and no more probes that way
    third = ladder.decide(_probe_window(30, second.split, step_s=0.056))
    assert third.rung == "resplit" and "roll back: probe" in third.reason and third.split == first.split
    fourth = ladder.decide(_probe_window(40, first.split, step_s=0.055))
    assert fourth.rung == "keep"


def test_probes_expand_while_they_pay_and_start_small_again_after_a_rollback() -> None:
    ladder = EscalationLadder(patience=1, probe=0.05)  # probe_growth 2
    first = ladder.decide(_probe_window(10, ReplicaSplit((0.6, 0.4)), step_s=0.080))
    assert first.split is not None and first.split.weights == pytest.approx((0.65, 0.35))
    second = ladder.decide(_probe_window(20, first.split, step_s=0.075))  # kept: the next moves 0.10
    assert second.split is not None and second.split.weights == pytest.approx((0.75, 0.25))
    third = ladder.decide(_probe_window(30, second.split, step_s=0.070))  # kept: 0.20
    assert third.split is not None and third.split.weights == pytest.approx((0.95, 0.05))
    back = ladder.decide(_probe_window(40, third.split, step_s=0.072))  # not faster: back to 0.75
    assert "roll back: probe" in back.reason and back.split == second.split
    # the direction is held, then tried again with the first probe's size
    rungs = [ladder.decide(_probe_window(50 + 10 * i, second.split, step_s=0.070)) for i in range(6)]
    assert [d.rung for d in rungs] == ["keep"] * 5 + ["resplit"]
    assert rungs[-1].split is not None and rungs[-1].split.weights == pytest.approx((0.80, 0.20))


def test_an_expanded_probe_is_halved_to_leave_the_slow_replica_a_sample() -> None:
    ladder = EscalationLadder(patience=1, probe=0.05)
    first = ladder.decide(_probe_window(10, ReplicaSplit((0.85, 0.15)), step_s=0.080))
    assert first.split is not None and first.split.weights == pytest.approx((0.90, 0.10))
    second = ladder.decide(_probe_window(20, first.split, step_s=0.075))  # 0.10 would leave nothing: 0.05
    assert second.split is not None and second.split.weights == pytest.approx((0.95, 0.05))


def test_no_probe_when_the_replicas_compute_alike() -> None:
    ladder = EscalationLadder(patience=1, probe=0.05)
    w = _timed(10, (0.010, 0.012), (0.011, 0.010), step_s=0.040)  # 1.2x apart: a noisy machine, not interference
    assert ladder.decide(w).rung == "keep"


def test_a_resplit_that_pays_is_kept_and_refined() -> None:
    ladder = EscalationLadder(patience=1)
    w = _window(10, (0.010, 0.030))
    first = ladder.decide(ReplicaWindow(w.step, w.samples, w.compute_s, w.split, step_s=0.035))
    assert first.rung == "resplit" and first.split is not None
    shares = first.split.shares(32, 4)
    faster = ReplicaWindow(20, tuple(float(x) for x in shares), ((0.016,), (0.020,)), first.split, step_s=0.025)
    again = ladder.decide(faster)
    assert again.rung == "resplit" and "roll back" not in again.reason


def test_a_spike_that_goes_away_resets_the_patience() -> None:
    ladder = EscalationLadder(patience=2)
    assert ladder.decide(_window(10, (0.010, 0.030))).rung == "ignore"
    assert ladder.decide(_window(20, (0.010, 0.010))).rung == "keep"
    assert ladder.decide(_window(30, (0.010, 0.030))).rung == "ignore"  # counted from 1 again


def _caused(window: ReplicaWindow, causes: tuple[str, str]) -> ReplicaWindow:
    w = window
    return ReplicaWindow(w.step, w.samples, w.compute_s, w.split, w.step_s, w.update_s, causes)


def test_a_slowdown_without_a_visible_cause_must_persist_for_unexplained_patience() -> None:
    # a shared machine slows one core for a second with no job of its own on it: two overlapping monitor
    # windows in a row see it, and nothing in the readings explains it
    ladder = EscalationLadder()  # patience 2, unexplained 4
    rungs = [ladder.decide(_caused(_window(10 * i, (0.020, 0.010)), ("", ""))) for i in range(1, 5)]
    assert [d.rung for d in rungs] == ["ignore", "ignore", "ignore", "resplit"]
    assert "seen in 2 of 4 checks" in rungs[1].reason and "no sign of interference on replica 0" in rungs[1].reason
    # it went away after two checks: nothing changed, and the count starts again
    ladder = EscalationLadder()
    for i in range(2):
        assert ladder.decide(_caused(_window(10 * i, (0.020, 0.010)), ("", ""))).rung == "ignore"
    assert ladder.decide(_caused(_window(30, (0.010, 0.010)), ("", ""))).rung == "keep"
    assert ladder.decide(_caused(_window(40, (0.020, 0.010)), ("", ""))).rung == "ignore"


def test_a_slowdown_with_a_visible_cause_is_acted_on_at_the_first_check() -> None:
    ladder = EscalationLadder()  # explained_patience 1
    d = ladder.decide(_caused(_window(10, (0.010, 0.020)), ("", "cgroup CPU limit 0.50 cores")))
    assert d.rung == "resplit" and d.split is not None and d.split.weights[1] < 0.5
    assert d.reason.endswith("; replica 1: cgroup CPU limit 0.50 cores")
    # the cause that counts is the one of the replica that would give samples up, not of the other one
    other = EscalationLadder().decide(_caused(_window(10, (0.020, 0.010)), ("", "cgroup CPU limit 0.50 cores")))
    assert other.rung == "ignore" and "no sign of interference on replica 0" in other.reason


def test_a_probe_needs_a_visible_cause_on_the_slow_replica() -> None:
    w = _probe_window(10, ReplicaSplit((0.75, 0.25)), step_s=0.060)  # replica 1 3x slower per sample
    assert EscalationLadder(probe=0.05).decide(_caused(w, ("", ""))).rung == "keep"
    probed = EscalationLadder(probe=0.05).decide(_caused(w, ("", "other processes busy on its cores (0.90 cores)")))
    assert probed.rung == "resplit" and "probe" in probed.reason


def _summary(**readings: Any) -> StageSummary:
    return StageSummary.of([StageSample(step_s=0.05, forward_s=0.01, **readings)] * 5)


def test_interference_signs_are_what_one_replica_shows_beyond_the_others() -> None:
    quiet = _summary(cpu_share=0.95, other_cpu_load=0.05, run_queue_wait_share=0.05)
    quota = _summary(cpu_share=0.5, cpu_limit=0.5, run_queue_wait_share=0.48, steal_share=0.3)
    assert interference_excess([quiet, quota]) == [
        "",
        "cgroup CPU limit 0.50 cores, waiting for a core 48% of the time",
    ]
    hog = _summary(cpu_share=0.6, other_cpu_load=0.8)
    assert interference_excess([hog, quiet]) == ["other processes busy on its cores (0.80 cores)", ""]
    # what every replica shows says nothing about which one is slow: two ranks of one job sharing the cores,
    # a pinned process's own threads delaying its main thread, a limit on the whole job, stolen CPU
    shared = [_summary(cpu_share=0.9, other_cpu_load=0.9, run_queue_wait_share=0.2, cpu_limit=0.8, steal_share=0.2)]
    assert interference_excess(shared * 2) == ["", ""]
    startup = _summary(cpu_share=0.9, run_queue_wait_share=0.25)  # seen on a clean run's first window
    assert interference_excess([startup, _summary(cpu_share=0.9, run_queue_wait_share=0.05)]) == ["", ""]
    gpu = _summary(cpu_share=1.0, gpu_throttled=1.0)
    assert interference_excess([gpu, _summary(cpu_share=1.0, gpu_throttled=0.0)]) == ["GPU clock throttled", ""]
    assert interference_excess([quiet, StageSummary.of([StageSample(step_s=0.05)] * 5)]) is None  # no readings


def test_a_pipelines_stage_signs_compare_every_process_with_the_least_affected() -> None:
    from lightning_dynpipe.strategy.adaptation import _stage_signs

    quiet = _summary(cpu_share=0.95, other_cpu_load=0.05, run_queue_wait_share=0.05)
    quota = _summary(cpu_share=0.25, cpu_limit=0.25, run_queue_wait_share=0.05)
    two_stages = SimpleNamespace(replicas=[StageReport(0, 0, quiet), StageReport(0, 1, quota)])
    assert _stage_signs(two_stages) == ["", "cgroup CPU limit 0.25 cores"]  # type: ignore[arg-type]
    # two replicas of stage 1, one of them limited: the stage shows it
    replicated = SimpleNamespace(
        replicas=[
            StageReport(0, 0, quiet),
            StageReport(1, 0, quiet),
            StageReport(0, 1, quota),
            StageReport(1, 1, quiet),
        ]
    )
    assert _stage_signs(replicated) == ["", "cgroup CPU limit 0.25 cores"]  # type: ignore[arg-type]
    no_readings = StageSummary.of([StageSample(step_s=0.05)] * 5)
    assert _stage_signs(SimpleNamespace(replicas=[StageReport(0, 0, quiet), StageReport(0, 1, no_readings)])) == []  # type: ignore[arg-type]


def test_replica_window_joins_each_replicas_signs() -> None:
    compute = [(0, 0, 0.01), (0, 1, 0.01), (1, 0, 0.02), (1, 1, 0.02)]
    causes = [(0, 0, ""), (0, 1, ""), (1, 1, "GPU clock throttled"), (1, 0, "cgroup CPU limit 0.50 cores")]
    w = replica_window(5, (16, 16), compute, EVEN, 2, causes_by_rank=causes)
    assert w.causes == ("", "stage 0: cgroup CPU limit 0.50 cores; stage 1: GPU clock throttled")
    assert replica_window(5, (16, 16), compute, EVEN, 2).causes == ()


def test_small_differences_keep_the_split() -> None:
    ladder = EscalationLadder(min_gain=0.05, patience=1)
    assert ladder.decide(_window(10, (0.010, 0.0104))).rung == "keep"  # 2% gain: noise


def _timed(
    step: int, compute: tuple[float, float], update: tuple[float, float], step_s: float, split: ReplicaSplit = EVEN
) -> ReplicaWindow:
    w = _window(step, compute, split)
    return ReplicaWindow(w.step, w.samples, w.compute_s, split, step_s=step_s, update_s=((update[0],), (update[1],)))


def test_the_waits_at_the_all_reduce_place_the_split_with_each_replicas_fixed_costs() -> None:
    # replica 1 computes at half speed, and its step has 20 ms more of work that no split moves (a throttled
    # replica's batch reading and framework work): replica 0 waits 20 ms at the all-reduce
    ladder = EscalationLadder(patience=1)
    d = ladder.decide(_timed(10, (0.010, 0.020), (0.030, 0.010), step_s=0.050))
    assert d.rung == "resplit" and d.split is not None
    # need 30 and 50 ms, 0.625 and 1.25 ms per sample: equal at 36.7 ms with 26.7 and 5.3 of the 32 samples;
    # speeds alone would say 2:1
    assert d.split.weights == pytest.approx((5 / 6, 1 / 6))
    assert "waits at the all-reduce [20.0, 0.0] ms" in d.reason and "50.0 -> 36.7 ms (+27%)" in d.reason


def test_waits_smaller_than_the_gain_threshold_keep_the_split() -> None:
    # a 10% difference in compute, but each replica's wait is 1 ms of a 40 ms step: not worth a re-split
    ladder = EscalationLadder(patience=1)
    d = ladder.decide(_timed(10, (0.010, 0.011), (0.012, 0.011), step_s=0.040))
    assert d.rung == "keep" and "balanced" in d.reason


def test_a_replica_keeps_at_least_one_sample() -> None:
    ladder = EscalationLadder(patience=1, min_gain=0.05)
    # replica 1's fixed work alone is longer than replica 0's whole step: everything but one sample moves
    d = ladder.decide(_timed(10, (0.010, 0.020), (0.200, 0.010), step_s=0.220))
    assert d.split is not None and d.split.weights == pytest.approx((31 / 32, 1 / 32))
    assert "220.0 -> 201.2 ms" in d.reason  # replica 1's 220 ms of work less 15 samples at 1.25 ms


def test_without_update_times_or_step_time_the_split_follows_the_speeds() -> None:
    w = _window(10, (0.010, 0.020))
    assert ReplicaWindow(w.step, w.samples, w.compute_s, EVEN, update_s=((0.02,), (0.01,))).replica_slack_s() is None
    d = EscalationLadder(patience=1).decide(w)
    assert d.split is not None and d.split.weights == pytest.approx((2 / 3, 1 / 3)) and "waits" not in d.reason


def test_stage_count_rung_says_what_to_do() -> None:
    d = EscalationLadder.stage_count_decision(50, 2, 1, "predicted time to accuracy 10 s vs 14 s")
    assert d.rung == "change_stages" and d.num_stages == 1
    assert "restart from the checkpoint with num_stages=1" in str(d)


def test_ladder_and_window_refuse_bad_inputs() -> None:
    with pytest.raises(ConfigurationError, match="unexplained_patience >= 1.*unexplained_patience=0"):
        EscalationLadder(unexplained_patience=0)
    with pytest.raises(ConfigurationError, match="causes for 2 replicas; got 1"):
        ReplicaWindow(1, (16.0, 16.0), ((0.01,), (0.01,)), EVEN, causes=("",))
    with pytest.raises(ConfigurationError, match="rollback_tolerance=1.5"):
        EscalationLadder(rollback_tolerance=1.5)
    with pytest.raises(ConfigurationError, match="probe_growth >= 1; got probe_growth=0.5"):
        EscalationLadder(probe_growth=0.5)
    with pytest.raises(ConfigurationError, match="one entry per replica"):
        ReplicaWindow(1, (16.0,), ((0.01,), (0.01,)), EVEN)


def test_replica_window_takes_each_replicas_slowest_stage() -> None:
    w = replica_window(5, (16, 16), [(0, 0, 0.01), (0, 1, 0.03), (1, 0, 0.02), (1, 1, 0.01)], EVEN, 2)
    assert w.replica_compute_s() == (0.03, 0.02) and w.replica_slack_s() is None


def test_a_replicas_slack_is_its_smallest_wait_over_its_stages() -> None:
    updates = [(0, 0, 0.030), (0, 1, 0.015), (1, 0, 0.010), (1, 1, 0.012)]
    w = replica_window(5, (16, 16), [(0, 0, 0.01), (0, 1, 0.01), (1, 0, 0.02), (1, 1, 0.02)], EVEN, 2,
                       step_s=0.05, update_s_by_rank=updates)  # fmt: skip
    # stage 0: replica 0 waited 20 ms longer; stage 1: 3 ms: replica 0 can take 3 ms more work, not 20
    assert w.replica_slack_s() == pytest.approx((0.003, 0.0))


# ---------------------------------------------------------------------------------------------- the wiring


def _snapshot(compute: tuple[float, float], limits: tuple[float | None, float | None] | None = None) -> Any:
    """Replica d computes for compute[d] s per step; the fast one then waits in the update's all-reduce for the slow
    one, so the update (optimizer_s) evens out their compute_s: the ladder must not look at it. ``limits``: system
    readings too, replica d under a CPU limit of limits[d] cores (None: no limit); without it, no readings."""
    slowest = max(compute)
    readings = [
        {} if limits is None else {"cpu_share": limit or 0.95, "cpu_limit": limit} for limit in limits or (0, 0)
    ]
    reports = [
        StageReport(
            d,
            0,
            StageSummary.of(
                [
                    StageSample(
                        step_s=0.05,
                        forward_s=c / 3,
                        backward_s=2 * c / 3,
                        optimizer_s=slowest - c + 0.001,
                        **readings[d],
                    )
                ]
                * 6
            ),
        )
        for d, c in enumerate(compute)
    ]
    assert reports[0].summary.compute_s == pytest.approx(reports[1].summary.compute_s)
    return SimpleNamespace(stages=[StageSummary.combine([r.summary for r in reports])], replicas=reports)


def _speed_wiring(queued: list[ReplicaSplit], ladder: EscalationLadder) -> AdaptationWiring:
    """The adaptive loop of a 1-stage x 2-replica fit with replica_split='speed', queuing its re-splits."""
    wiring = AdaptationWiring(
        DynPipeConfig.from_arguments(replica_split="speed", adaptive=False),
        partition=lambda: Partition((5,)),
        pending=lambda: False,
        repartition=lambda p: None,
        past_pauses=lambda: [],
        replica_split=lambda: EVEN,
        replica_samples=lambda: EVEN.shares(32, 4),
        resplit=queued.append,
    )
    wiring.ladder = ladder
    return wiring


def test_the_wiring_resplits_through_the_strategy_after_the_patience() -> None:
    queued: list[ReplicaSplit] = []
    wiring = _speed_wiring(queued, EscalationLadder(patience=2))
    trainer = SimpleNamespace(global_step=40, estimated_stepping_batches=100)
    assert MIN_SAMPLES <= 6
    wiring.on_snapshot(_snapshot((0.010, 0.020)), trainer)  # type: ignore[arg-type]
    assert queued == []
    wiring.on_snapshot(_snapshot((0.010, 0.020)), trainer)  # type: ignore[arg-type]
    assert len(queued) == 1 and queued[0].weights == pytest.approx((2 / 3, 1 / 3))
    assert [d.rung for d in wiring.ladder_decisions] == ["ignore", "resplit"]


def test_the_wiring_weighs_the_patience_by_the_signs_of_interference_it_reads() -> None:
    queued: list[ReplicaSplit] = []
    wiring = _speed_wiring(queued, EscalationLadder())
    trainer = SimpleNamespace(global_step=40, estimated_stepping_batches=100)
    for _ in range(3):  # replica 1 slower with nothing in its readings: taken to be short
        wiring.on_snapshot(_snapshot((0.010, 0.020), (None, None)), trainer)  # type: ignore[arg-type]
    assert queued == [] and "no sign of interference on replica 1" in wiring.ladder_decisions[-1].reason
    wiring.ladder = EscalationLadder()
    wiring.on_snapshot(_snapshot((0.010, 0.020), (None, 0.5)), trainer)  # type: ignore[arg-type]
    assert len(queued) == 1 and "replica 1: cgroup CPU limit 0.50 cores" in wiring.ladder_decisions[-1].reason


def test_the_controller_reports_a_better_number_of_stages_every_n_checks() -> None:
    """Rung 4: under async with a staleness penalty (beta=2), 2 processes train faster to accuracy as 2 replicas
    of 1 stage than as a 2-stage pipeline; the controller says so, and solves for it every stage_count_every
    checks only."""
    from lightning_dynpipe.plan.convergence import ConvergenceModel
    from lightning_dynpipe.plan.costs import CommModel, ModelCost
    from lightning_dynpipe.repartition.controller import AdaptiveController, StageTimes
    from lightning_dynpipe.repartition.policy import GainOverCostPolicy

    cost = ModelCost.from_arrays([0.001] * 8, [0.002] * 8, param_bytes=[1000] * 8)
    c = AdaptiveController(
        GainOverCostPolicy(),
        model_cost=cost,
        comm=CommModel(),
        schedule="async",
        num_microbatches=4,
        convergence=ConvergenceModel(beta=2.0),
        stage_count_every=3,
    )
    times = [StageTimes(0.048, 0.048), StageTimes(0.048, 0.048)]
    hints = []
    for step in range(4):
        c.check(10 * step, times, Partition((4, 4)), remaining_steps=1000)
        hints.append(c.stage_count_hint)
    assert hints[0] is not None and hints[0][0] == 1 and hints[0][1] < 0.9 * hints[0][2]
    assert hints[1] is None and hints[2] is None and hints[3] == hints[0]
    d = EscalationLadder.stage_count_decision(30, 2, hints[0][0], "x")
    assert d.rung == "change_stages" and d.num_stages == 1


def test_the_wiring_warns_once_per_better_stage_count_and_records_the_rung() -> None:
    class Controller:
        stage_count_hint = (1, 10.0, 14.0)

        def check(self, step: int, *args: Any, **kwargs: Any) -> Any:
            return SimpleNamespace(repartition=False, partition=Partition((4, 4)), reason="already the best")

    wiring = AdaptationWiring(
        DynPipeConfig.from_arguments(),
        partition=lambda: Partition((4, 4)),
        pending=lambda: False,
        repartition=lambda p: None,
        past_pauses=lambda: [],
    )
    wiring.controller = Controller()  # type: ignore[assignment]
    wiring.ladder = EscalationLadder()
    stage = StageSummary.of([StageSample(step_s=0.1, forward_s=0.02, backward_s=0.04)] * MIN_SAMPLES)
    snapshot = SimpleNamespace(stages=[stage, stage], replicas=[])
    trainer = SimpleNamespace(global_step=40, estimated_stepping_batches=100)
    with pytest.warns(UserWarning, match=r"rung change_stages: the best plan .* has 1 stages.*num_stages=1"):
        wiring.on_snapshot(snapshot, trainer)  # type: ignore[arg-type]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second check records the rung without warning again
        wiring.on_snapshot(snapshot, trainer)  # type: ignore[arg-type]
    assert [d.rung for d in wiring.ladder_decisions] == ["change_stages", "change_stages"]
