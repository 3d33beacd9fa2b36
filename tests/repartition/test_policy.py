"""The default repartition policy: gain vs. cost, relative threshold, hysteresis, cool-down, outcome check
(roll back a move that made the pipeline slower, refuse that partition for a while); and plan_moves."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from lightning_dynpipe import ConfigurationError, Partition, PartitionError
from lightning_dynpipe.repartition import plan_moves
from lightning_dynpipe.repartition.policy import GainOverCostPolicy, PolicyInputs, RepartitionPolicy

CUR, CAND = Partition((3, 3)), Partition((4, 2))


def _inputs(
    step: int,
    current_s: float = 1.0,
    candidate_s: float = 0.6,
    cost: float = 5.0,
    candidate: Partition = CAND,
    remaining: int | None = None,
    current: Partition = CUR,
    measured_s: float | None = None,
    factor: float = 1.0,
    causes: str = "",
    conditions: tuple[bool, ...] = (),
    cause_stages: tuple[bool, ...] = (),
    link_cause: bool = False,
    cause_age_s: tuple[float, ...] = (),
    window_s: float = 0.0,
    link_age_s: float = math.inf,
) -> PolicyInputs:
    return PolicyInputs(
        step=step,
        current=current,
        candidate=candidate,
        current_step_s=current_s,
        candidate_step_s=candidate_s,
        measured_step_s=current_s if measured_s is None else measured_s,
        migration_cost_s=cost,
        remaining_steps=remaining,
        slowdowns=(1.0, 2.0),
        convergence_factor=factor,
        causes=causes,
        conditions=conditions,
        cause_stages=cause_stages,
        link_cause=link_cause,
        cause_age_s=cause_age_s,
        window_s=window_s,
        link_age_s=link_age_s,
    )


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


def test_a_slowdown_with_a_visible_cause_moves_at_the_first_check() -> None:
    """A cgroup limit or a slower link lasts: ``explained_patience`` checks (1) instead of ``patience`` (2)."""
    policy = GainOverCostPolicy(patience=2)
    moved = policy.decide(_inputs(10, causes="stage 1: cgroup CPU limit 0.25 cores"))
    assert moved.repartition and moved.reason == (
        "predicted gain pays the migration (after 1 check: stage 1: cgroup CPU limit 0.25 cores)"
    )
    plain = GainOverCostPolicy(patience=2)
    assert "waiting for 2 checks in a row (1 so far)" in plain.decide(_inputs(10)).reason  # no cause: a spike?
    assert plain.decide(_inputs(20)).repartition
    patient = GainOverCostPolicy(patience=3, explained_patience=2)
    assert "waiting for 2 checks" in patient.decide(_inputs(10, causes="the link measured slower")).reason
    assert patient.decide(_inputs(20, causes="the link measured slower")).repartition
    with pytest.raises(ConfigurationError, match="1 <= explained_patience <= patience"):
        GainOverCostPolicy(patience=2, explained_patience=3)


def test_a_stages_sign_explains_a_move_once_it_has_shown_for_half_a_second() -> None:
    """Other processes' load is read over quarter-second spans; a window of a fast model can hold one reading, and a
    neighbour's burst read once moved a pipeline at one check. A stage's sign explains a move after it has shown for
    ``explained_min_s`` (0.5 s) at consecutive checks; until then the move waits ``patience`` checks and the measured
    step must show the slowdown. A CPU limit (its age infinite: configuration) and a slower link explain at once."""
    busy = "stage 1: other processes busy on its cores (0.40 cores)"

    def seen(step: int, age_s: float, **kw: float) -> PolicyInputs:
        return _inputs(step, causes=busy, cause_stages=(False, True), cause_age_s=(0.0, age_s), **kw)

    assert seen(10, 0.3).explained and not seen(10, 0.3).explained_for(0.5)
    assert seen(10, 0.6).explained_for(0.5) and seen(10, math.inf).explained_for(0.5)
    link = _inputs(10, causes="the link", cause_stages=(False, False), link_cause=True, cause_age_s=(0.0, 0.0))
    assert link.explained_for(0.5)
    assert _inputs(10, causes=busy, cause_stages=(False, True)).explained_for(0.5)  # ages not known: lasting
    # a young sign on the stage the move relieves (0.40 cores) next to a lasting one elsewhere does not explain it
    assert not _inputs(10, causes=busy, cause_stages=(True, True), cause_age_s=(9.0, 0.3)).explained_for(0.5)

    policy = GainOverCostPolicy(patience=2)
    young = policy.decide(seen(10, 0.3))
    assert not young.repartition
    assert young.reason == (
        "waiting for 2 checks in a row (1 so far; signs shown on stage 1 for 0.30 s, less than 0.5 s)"
    )
    assert policy.decide(seen(20, 0.6)).repartition
    assert GainOverCostPolicy(patience=2).decide(seen(10, 0.6)).repartition  # lasting at the first check
    assert GainOverCostPolicy(patience=2).decide(seen(10, math.inf)).repartition  # a CPU limit
    assert GainOverCostPolicy(patience=2, explained_min_s=0.0).decide(seen(10, 0.3)).repartition
    # a young sign is tested like no sign: here the measured step does not show the slowdown it was priced from
    contradicted = GainOverCostPolicy(patience=1).decide(seen(10, 0.3, current_s=1.5, measured_s=1.0))
    assert not contradicted.repartition
    assert contradicted.reason.startswith(
        "no visible cause that has shown for 0.5 s (the link, or on the stages it relieves)"
    )
    # the link too: a message waits for the receiving thread while its core is busy, and that reads as a slower link
    young_link = _inputs(10, causes="the link", cause_stages=(False, False), link_cause=True, link_age_s=0.3)
    assert young_link.explained and not young_link.explained_for(0.5)
    waiting = GainOverCostPolicy(patience=2).decide(young_link)
    assert (
        waiting.reason
        == "waiting for 2 checks in a row (1 so far; signs shown on the link for 0.30 s, less than 0.5 s)"
    )
    assert GainOverCostPolicy(patience=2).decide(replace(young_link, link_age_s=0.6)).repartition
    with pytest.raises(ConfigurationError, match="0 <= explained_min_s < inf"):
        GainOverCostPolicy(explained_min_s=-1.0)


def test_checks_that_agree_must_also_cover_patience_s_of_the_pipelines_time() -> None:
    """A fast model's checks are a tenth of a second apart: with no cause explaining it, a move waits until the
    checks agreeing on it cover ``patience_s`` (0.75 s) besides ``patience`` checks; a new candidate starts both over.
    Where the checks' time is not known (``window_s`` 0) the checks alone count; a lasting cause moves at once."""
    policy = GainOverCostPolicy(patience=2)
    reasons = [policy.decide(_inputs(10 * k, window_s=0.1)) for k in range(1, 8)]
    assert not any(d.repartition for d in reasons)
    assert reasons[0].reason == "waiting for 2 checks in a row over 0.75 s (1 so far, 0.10 s)"
    assert reasons[6].reason == "waiting for 2 checks in a row over 0.75 s (7 so far, 0.70 s)"
    assert policy.decide(_inputs(80, window_s=0.1)).repartition  # 8 checks, 0.8 s
    other = GainOverCostPolicy(patience=2)
    for k in range(1, 6):
        other.decide(_inputs(10 * k, window_s=0.1))
    switched = other.decide(_inputs(60, window_s=0.1, candidate=Partition((2, 4)), candidate_s=0.6))
    assert switched.reason == "waiting for 2 checks in a row over 0.75 s (1 so far, 0.10 s)"
    slow = GainOverCostPolicy(patience=2)  # checks half a second apart: two of them
    assert not slow.decide(_inputs(10, window_s=0.5)).repartition
    assert slow.decide(_inputs(20, window_s=0.5)).repartition
    assert GainOverCostPolicy(patience=2, patience_s=0.0).decide(_inputs(10, window_s=0.1)).reason == (
        "waiting for 2 checks in a row (1 so far)"
    )
    lasting = _inputs(10, causes="stage 1: cgroup CPU limit 0.25 cores", cause_stages=(False, True), window_s=0.1)
    assert GainOverCostPolicy(patience=2).decide(lasting).repartition
    with pytest.raises(ConfigurationError, match="0 <= patience_s < inf"):
        GainOverCostPolicy(patience_s=math.inf)


def test_a_cause_explains_only_a_move_away_from_its_stage_or_any_move_for_the_link() -> None:
    """[3, 3] -> [4, 2] relieves stage 1. A quota on stage 1 explains it; a quota on stage 0 does not (the move was
    priced from a slowdown of stage 1 that shows no cause: a spike?), so it waits ``patience`` checks and the
    measurement must show the slowdown; a slower link explains any move."""
    quota = "stage 0: cgroup CPU limit 0.25 cores"
    on_other = _inputs(10, causes=quota, cause_stages=(True, False))
    assert not on_other.explained
    assert _inputs(10, causes="stage 1: cgroup CPU limit 0.25 cores", cause_stages=(False, True)).explained
    assert _inputs(10, causes="the link", cause_stages=(False, False), link_cause=True).explained
    assert _inputs(10, causes=quota).explained  # the causes' stages not known: any cause explains the move
    assert not _inputs(10, cause_stages=(True, True)).explained  # no causes at all
    policy = GainOverCostPolicy(patience=2)
    assert "waiting for 2 checks in a row (1 so far)" in policy.decide(on_other).reason
    moved = policy.decide(_inputs(20, causes=quota, cause_stages=(True, False)))
    assert moved.repartition and moved.reason == "predicted gain pays the migration"
    # the measurement must agree: predicted 1.5x the measured step at a first check, with the quota on stage 0
    contradicted = GainOverCostPolicy(patience=1).decide(
        _inputs(10, current_s=1.5, measured_s=1.0, causes=quota, cause_stages=(True, False))
    )
    assert not contradicted.repartition
    assert contradicted.reason.startswith("no visible cause on the stages it relieves, and the measured step time")


def test_a_cause_the_current_partition_was_kept_under_explains_no_later_move() -> None:
    """A 25% quota on stage 1 from the start: the first check's move is explained (1 check). Once a check kept the
    partition under the same conditions as the check before it (it was the best, or the gain did not pay), a gain
    that appears later comes from the measured times changing, not from the quota: it waits ``patience`` checks and
    the measurement must show the slowdowns. New conditions (a hog on stage 0 as well, the link slower) explain
    again."""
    quota = "stage 1: cgroup CPU limit 0.25 cores"
    limited, hogged = (False, True), (True, True)

    def quota_inputs(step: int, **kw: object) -> PolicyInputs:
        return _inputs(step, causes=quota, conditions=limited, cause_stages=limited, **kw)  # type: ignore[arg-type]

    policy = GainOverCostPolicy(patience=2, cooldown_steps=0)
    assert policy.decide(quota_inputs(10)).repartition  # new: the first window under the quota
    policy.migrated(10)
    assert not policy.decide(quota_inputs(20, current=CAND, candidate=CAND)).repartition  # kept under the quota
    later = Partition((5, 1))
    waiting = policy.decide(quota_inputs(30, current=CAND, candidate=later))
    assert not waiting.repartition and "waiting for 2 checks in a row (1 so far)" in waiting.reason
    moved = policy.decide(quota_inputs(40, current=CAND, candidate=later))
    assert moved.repartition and moved.reason == "predicted gain pays the migration"
    # the same with the predicted slowdown not in the measured step: tested like a move without a cause
    tested = GainOverCostPolicy(patience=1)
    for step in (10, 20):  # kept: the best candidate is the current partition
        assert not tested.decide(quota_inputs(step, candidate=CUR)).repartition
    contradicted = tested.decide(quota_inputs(30, current_s=1.5, measured_s=1.0))
    assert not contradicted.repartition and "does not show the slowdowns" in contradicted.reason
    # a check refusing a gain too small to pay settles the conditions as well
    small = GainOverCostPolicy(patience=2)
    assert "below 10%" in small.decide(quota_inputs(10, candidate_s=0.95)).reason
    assert "below 10%" in small.decide(quota_inputs(20, candidate_s=0.95)).reason
    assert "waiting for 2 checks" in small.decide(quota_inputs(30)).reason
    # but not the first window of new conditions: it may straddle their onset (the signs show, the slowdown does
    # not yet), and a hog that slows the pipeline in the next window is new there
    hog = "stage 0: other processes busy on its cores"
    onset = GainOverCostPolicy(patience=2)
    assert not onset.decide(_inputs(10, candidate=CUR, conditions=(False, False))).repartition
    assert not onset.decide(_inputs(20, candidate=CUR, conditions=(True, False))).repartition  # straddles
    over = Partition((2, 4))
    moved = onset.decide(_inputs(30, candidate=over, causes=hog, conditions=(True, False), cause_stages=(True, False)))
    assert moved.repartition and "after 1 check" in moved.reason
    # new conditions explain again: a hog on stage 0 too, or the link measured slower
    for other in (
        _inputs(30, causes=quota, conditions=hogged, cause_stages=hogged),
        _inputs(30, causes=quota + "; the link", conditions=limited, cause_stages=limited, link_cause=True),
    ):
        fresh = GainOverCostPolicy(patience=2)
        assert not fresh.decide(quota_inputs(10, candidate=CUR)).repartition
        assert not fresh.decide(quota_inputs(20, candidate=CUR)).repartition
        assert fresh.decide(other).repartition, other
    # a new fit forgets what it kept
    policy.reset()
    assert policy.decide(quota_inputs(10)).repartition


def test_a_spike_does_not_move() -> None:
    policy = GainOverCostPolicy(patience=3)
    assert not policy.decide(_inputs(10)).repartition
    assert not policy.decide(_inputs(20, candidate=CUR)).repartition  # the spike is gone: streak resets
    assert not policy.decide(_inputs(30)).repartition
    assert not policy.decide(_inputs(40)).repartition
    assert policy.decide(_inputs(50)).repartition


def test_an_unexplained_slowdown_the_measured_step_does_not_show_does_not_move() -> None:
    """The current partition predicted at 1.5 s per step under the measured slowdowns, measured at 1.0 s."""
    policy = GainOverCostPolicy(patience=2)
    for step in (10, 20, 30):
        kept = policy.decide(_inputs(step, current_s=1.5, candidate_s=1.1, measured_s=1.0))
        assert not kept.repartition and "does not show the slowdowns: 1500.0 ms predicted" in kept.reason
    # a visible cause is not tested (a quota's floor is priced above what the stage measures under it)
    quota = "stage 1: cgroup CPU limit 0.25 cores"
    assert policy.decide(_inputs(40, current_s=1.5, candidate_s=1.1, measured_s=1.0, causes=quota)).repartition
    # within max_overprediction (10%) of the measured step: moves after its patience
    shown = GainOverCostPolicy(patience=2)
    assert not shown.decide(_inputs(10, current_s=1.5, candidate_s=1.1, measured_s=1.4)).repartition
    assert shown.decide(_inputs(20, current_s=1.5, candidate_s=1.1, measured_s=1.4)).repartition
    # the convergence factor is taken out of the predicted time before comparing step times
    weighted = GainOverCostPolicy(patience=1)
    assert weighted.decide(_inputs(10, current_s=1.5 * 1.3, candidate_s=1.1, measured_s=1.4, factor=1.3)).repartition
    untested = GainOverCostPolicy(patience=1, max_overprediction=math.inf)
    assert untested.decide(_inputs(10, current_s=1.5, candidate_s=1.1, measured_s=1.0)).repartition


def test_predictions_that_sit_steadily_above_the_measurement_are_the_usual_ratio() -> None:
    """A run whose clean predictions sit 15% above the measured step: once three checks of the partition say so, a
    slowdown the measurement shows moves, and one it contradicts still does not. A new fit starts from 1."""
    policy = GainOverCostPolicy(patience=1)
    for step in (10, 20, 30):  # clean: the current partition is the best; 1.15 s predicted, 1.0 s measured
        assert not policy.decide(_inputs(step, current_s=1.15, candidate=CUR, measured_s=1.0)).repartition
    assert "usually 1.15x" in policy.decide(_inputs(40, current_s=1.8, candidate_s=1.1, measured_s=1.0)).reason
    assert policy.decide(_inputs(50, current_s=1.8, candidate_s=1.1, measured_s=1.5)).repartition  # 1.2x
    policy.reset()
    assert "usually 1.00x" in policy.decide(_inputs(10, current_s=1.15, candidate_s=0.9, measured_s=1.0)).reason


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
    with pytest.raises(ConfigurationError, match="memory_steps >= 0"):
        GainOverCostPolicy(memory_steps=-1)
    with pytest.raises(ConfigurationError, match="max_overprediction >= 0"):
        GainOverCostPolicy(max_overprediction=-0.1)


def _move_to_candidate(policy: GainOverCostPolicy, step: int = 10) -> None:
    decision = policy.decide(_inputs(step))  # measured 1.0 s/step under CUR, CAND predicted at 0.6
    assert decision.repartition and decision.partition == CAND
    policy.migrated(step)


def test_a_move_that_made_the_pipeline_slower_is_rolled_back_and_its_partition_refused() -> None:
    # What a CPU quota does: the slowed stage gave layers away, now fits in its quota and looks fast, so the
    # planner's prediction for CAND was wrong; measured, CAND is slower than CUR was.
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=30, memory_steps=200)
    _move_to_candidate(policy)
    back = policy.decide(_inputs(20, current=CAND, candidate=CUR, current_s=1.3, candidate_s=0.9, measured_s=1.3))
    assert back.repartition and back.partition == CUR  # within the cool-down: a rollback does not wait
    assert "roll back" in back.reason and "1300.0 ms/step" in back.reason and "1000.0 ms/step" in back.reason
    assert back.predicted_gain_s == pytest.approx(30.0)  # (1.3 - 1.0) s/step over 100 steps
    policy.migrated(20)
    # Back under CUR, the planner proposes CAND again with the same optimistic prediction: refused ...
    assert "made the pipeline slower at step 20" in policy.decide(_inputs(60)).reason
    assert not policy.decide(_inputs(150)).repartition
    # ... until the memory expires (conditions may have changed by then).
    assert policy.decide(_inputs(230)).repartition


def test_a_move_that_paid_off_is_kept() -> None:
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=30)
    _move_to_candidate(policy)
    kept = policy.decide(_inputs(20, current=CAND, candidate=CAND, current_s=0.7, measured_s=0.7))
    assert not kept.repartition and "already the best" in kept.reason
    # Later checks no longer judge that move, even if the step time rises (interference changed).
    later = policy.decide(_inputs(30, current=CAND, candidate=CAND, current_s=1.5, measured_s=1.5))
    assert not later.repartition


def test_the_outcome_is_judged_with_each_partitions_convergence_factor() -> None:
    """A move decided on time to accuracy is judged on it: CUR has most parameters stale (1.30x the steps), CAND
    few (1.02x). Measured 1.0 s/step under CUR and 1.2 under CAND is slower per step but faster to accuracy (1.224
    against 1.30 s per unstale step): kept. 1.35 s/step under CAND (1.377) is slower to accuracy: rolled back."""
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=30)
    moved = policy.decide(_inputs(10, factor=1.30))
    assert moved.repartition and moved.inputs.measured_tta_step_s == pytest.approx(1.30)
    policy.migrated(10)
    kept = policy.decide(_inputs(20, current=CAND, candidate=CAND, current_s=1.224, measured_s=1.2, factor=1.02))
    assert not kept.repartition and "already the best" in kept.reason

    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=30)
    policy.decide(_inputs(10, factor=1.30))
    policy.migrated(10)
    back = policy.decide(
        _inputs(20, current=CAND, candidate=CUR, current_s=1.377, measured_s=1.35, factor=1.02, cost=1.0)
    )
    assert back.repartition and back.partition == CUR
    assert "1350.0 ms/step x 1.020, slower than 1000.0 ms/step x 1.300" in back.reason
    assert back.predicted_gain_s == pytest.approx((1.35 * 1.02 - 1.30) * 100)
    # unweighted (no staleness model in play) the message is the plain one
    assert "weighted" not in policy.decide(_inputs(30, current=CUR, candidate=CUR)).reason


def test_a_rollback_is_not_judged_and_the_loss_must_pay_it() -> None:
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=30)
    _move_to_candidate(policy)
    assert policy.decide(_inputs(20, current=CAND, candidate=CAND, current_s=1.3, measured_s=1.3)).repartition
    policy.migrated(20)
    # The rollback measured worse still (the interference grew): no second rollback, no ping-pong.
    after = policy.decide(_inputs(30, current=CUR, candidate=CUR, current_s=1.6, measured_s=1.6))
    assert not after.repartition
    # A slightly slower outcome whose loss does not pay the migration is kept (but still refused later).
    small = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0)
    _move_to_candidate(small)
    kept = small.decide(_inputs(20, current=CAND, candidate=CAND, current_s=1.05, measured_s=1.05))
    assert not kept.repartition
    back = small.decide(_inputs(30, current=CAND, candidate=CUR, current_s=1.05, candidate_s=0.6))
    assert back.repartition and back.reason == "predicted gain pays the migration"
    small.migrated(30)
    assert "made the pipeline slower at step 20" in small.decide(_inputs(40)).reason
    # Without rollback the policy only remembers.
    plain = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0, rollback=False)
    _move_to_candidate(plain)
    assert not plain.decide(_inputs(20, current=CAND, candidate=CAND, current_s=1.3, measured_s=1.3)).repartition


def test_plan_moves() -> None:
    moves = plan_moves(Partition((3, 2, 1)), Partition((1, 2, 3)))
    assert [(m.layer_idx, m.src, m.dst) for m in moves] == [(1, 0, 1), (2, 0, 1), (3, 1, 2), (4, 1, 2)]
    assert plan_moves(CUR, CUR) == ()
    with pytest.raises(PartitionError, match="keeps the layers and the number of stages"):
        plan_moves(CUR, Partition((2, 2, 2)))


def test_after_a_backfire_moves_further_the_same_way_are_refused_the_other_way_is_not() -> None:
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0)
    _move_to_candidate(policy)  # (3, 3) -> (4, 2): stage 1's layers moved to stage 0
    assert policy.decide(_inputs(20, current=CAND, candidate=CAND, current_s=1.3, measured_s=1.3)).repartition
    policy.migrated(20)
    further = policy.decide(_inputs(30, candidate=Partition((5, 1))))  # the boundary further the same way
    assert not further.repartition and "[5, 1] is refused" in further.reason
    other_way = policy.decide(_inputs(40, candidate=Partition((2, 4))))
    assert other_way.repartition and other_way.partition == Partition((2, 4))


def test_direction_rule_with_three_stages() -> None:
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0)
    old, new = Partition((2, 2, 2)), Partition((3, 2, 1))  # boundaries (2, 4) -> (3, 5)
    assert policy.decide(_inputs(10, current=old, candidate=new)).repartition
    policy.migrated(10)
    assert policy.decide(_inputs(20, current=new, candidate=new, current_s=1.4, measured_s=1.4)).repartition
    policy.migrated(20)

    def refused(balance: tuple[int, ...]) -> bool:
        return (
            "made the pipeline slower" in policy.decide(_inputs(30, current=old, candidate=Partition(balance))).reason
        )

    assert refused((4, 1, 1))  # (4, 5): both boundaries further the same way
    assert refused((2, 3, 1))  # (2, 5): only the second, the same way
    assert refused((3, 1, 2))  # (3, 4): only the first, the same way
    assert not refused((1, 3, 2))  # (1, 4): the first boundary the other way
    assert not refused((2, 1, 3))  # (2, 3): the second boundary the other way


CLEAN, HOG = (False, False), (True, False)  # stage 0 shows a sign of interference, or nothing does
MS = 1e-3


def test_a_move_made_for_a_cause_is_undone_when_the_cause_has_gone() -> None:
    """What a co-located job that comes and goes does: CUR measured 27 ms/step clean; under the job on stage 0 the
    move to CAND pays (39 against 57 ms/step). When the job stops, the predictor ranks CAND first (its small stage 0
    looks slowed by its fixed costs), but CUR measured 27 ms/step under the same (clean) conditions: move back."""
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=2, cooldown_steps=30)
    keep = policy.decide(_inputs(10, current_s=27 * MS, candidate=CUR, cost=0.05, conditions=CLEAN))
    assert not keep.repartition and "already the best" in keep.reason
    moved = policy.decide(
        _inputs(40, current_s=57 * MS, candidate_s=40 * MS, cost=0.05, causes="stage 0: waiting", conditions=HOG)
    )
    assert moved.repartition and moved.partition == CAND
    policy.migrated(40)
    kept = policy.decide(_inputs(50, current=CAND, candidate=CAND, current_s=39 * MS, cost=0.02, conditions=HOG))
    assert not kept.repartition and "already the best" in kept.reason  # the move paid off under the job
    # the job stopped: CAND measures 38.5 ms/step and the predictor still ranks it first; nothing within the cool-down
    clean = {"current": CAND, "candidate": CAND, "current_s": 38.5 * MS, "cost": 0.02, "conditions": CLEAN}
    assert not policy.decide(_inputs(65, **clean)).repartition  # type: ignore[arg-type]
    back = policy.decide(_inputs(75, **clean))  # type: ignore[arg-type]
    assert back.repartition and back.partition == CUR
    assert back.reason == (
        "move back: [3, 3] measured 27.0 ms/step at step 10 under the same conditions (clean); "
        "[4, 2] measures 38.5 ms/step (the median of its last 2 windows)"
    )
    assert back.predicted_gain_s == pytest.approx(1.15)  # (38.5 - 27) ms over 100 steps
    policy.migrated(75)
    # The job is back at once: CUR measures 57 ms/step under it, against CAND's 38.5 without it. Measured under other
    # conditions than the window before the move, that is no judgement of the move: no rollback, no refusal
    after = policy.decide(_inputs(85, current_s=57 * MS, candidate=CUR, cost=0.02, causes="s0", conditions=HOG))
    assert not after.repartition and after.reason == "the current partition is already the best"
    # after the cool-down the job's cause explains the predicted move: back to CAND at the first check
    hog = {"current_s": 57 * MS, "candidate_s": 40 * MS, "cost": 0.02, "causes": "s0", "conditions": HOG}
    moved_again = policy.decide(_inputs(110, **hog))  # type: ignore[arg-type]
    assert moved_again.repartition and moved_again.partition == CAND
    policy.migrated(110)
    # The job has now come twice: its conditions come and go, so partitions are compared on their measured average
    # over the conditions (clean 4 of 8 checks, the job 4): CAND 38.8 ms/step against CUR 42 (27 clean, 57 with
    # the job), so it stays
    again = policy.decide(_inputs(140, **clean))  # type: ignore[arg-type]
    assert not again.repartition and "already the best" in again.reason


def test_a_refusal_holds_under_the_conditions_it_was_judged_in_only() -> None:
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0, recall_steps=0)
    assert policy.decide(_inputs(10, conditions=HOG)).repartition
    policy.migrated(10)
    rolled = policy.decide(_inputs(20, current=CAND, candidate=CUR, current_s=1.3, measured_s=1.3, conditions=HOG))
    assert rolled.repartition and "roll back" in rolled.reason
    policy.migrated(20)
    assert "made the pipeline slower at step 20" in policy.decide(_inputs(30, conditions=HOG)).reason
    assert policy.decide(_inputs(40, conditions=CLEAN)).repartition  # the interference it was judged under is gone
    unknown = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0)
    unknown.decide(_inputs(10, conditions=HOG))
    unknown.decide(_inputs(20, current=CAND, candidate=CUR, current_s=1.3, measured_s=1.3, conditions=HOG))
    assert "made the pipeline slower" in unknown.decide(_inputs(30)).reason  # conditions not known: refused


def test_recall_compares_only_equal_conditions_and_forgets() -> None:
    # a partition measured faster under other conditions is not a reason to move back
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0, recall_steps=50)
    policy.decide(_inputs(10, current_s=27 * MS, candidate=CUR, cost=0.01, conditions=CLEAN))
    assert policy.decide(_inputs(20, current_s=40 * MS, candidate_s=30 * MS, cost=0.01, conditions=HOG)).repartition
    policy.migrated(20)
    still = policy.decide(_inputs(30, current=CAND, candidate=CAND, current_s=38 * MS, cost=0.01, conditions=HOG))
    assert not still.repartition  # CUR measured 27 ms clean; under the job it measured 40
    assert policy.decide(
        _inputs(55, current=CAND, candidate=CAND, current_s=38 * MS, cost=0.01, conditions=CLEAN)
    ).repartition
    # remembered for recall_steps only
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0, recall_steps=50)
    policy.decide(_inputs(10, current_s=27 * MS, candidate=CUR, cost=0.01, conditions=CLEAN))
    policy.decide(_inputs(20, current_s=40 * MS, candidate_s=30 * MS, cost=0.01, conditions=HOG))
    policy.migrated(20)
    late = policy.decide(_inputs(61, current=CAND, candidate=CAND, current_s=38 * MS, cost=0.01, conditions=CLEAN))
    assert not late.repartition and "already the best" in late.reason
    # nor without known conditions, nor with recall off, nor below min_relative_gain or the migration's price
    for kwargs, conditions, now_ms, cost in (
        ({}, (), 38.0, 0.01),
        ({"recall_steps": 0}, CLEAN, 38.0, 0.01),
        ({}, CLEAN, 29.0, 0.01),  # 27 ms is 7% faster than 29
        ({}, CLEAN, 38.0, 1.0),  # 1.1 s over 100 steps does not pay 2 x 1 s
    ):
        p = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0, **kwargs)  # type: ignore[arg-type]
        p.decide(_inputs(10, current_s=27 * MS, candidate=CUR, cost=cost, conditions=conditions))
        hog = HOG if conditions else ()
        assert p.decide(_inputs(20, current_s=60 * MS, candidate_s=30 * MS, cost=0.01, conditions=hog)).repartition
        p.migrated(20)
        p.decide(_inputs(30, current=CAND, candidate=CAND, current_s=now_ms * MS, cost=cost, conditions=conditions))
        d = p.decide(_inputs(40, current=CAND, candidate=CAND, current_s=now_ms * MS, cost=cost, conditions=conditions))
        assert not d.repartition, (kwargs, conditions, now_ms, cost, d.reason)


def test_recall_waits_for_explained_patience() -> None:
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=2, explained_patience=2, cooldown_steps=0)
    policy.decide(_inputs(10, current_s=27 * MS, candidate=CUR, cost=0.01, conditions=CLEAN))
    for step in (20, 30):
        moved = policy.decide(
            _inputs(step, current_s=60 * MS, candidate_s=30 * MS, cost=0.01, causes="s0", conditions=HOG)
        )
    assert moved.repartition
    policy.migrated(30)
    clean = {"current": CAND, "candidate": CAND, "current_s": 38 * MS, "cost": 0.01, "conditions": CLEAN}
    first = policy.decide(_inputs(40, **clean))  # type: ignore[arg-type]
    assert not first.repartition and first.reason.endswith("waiting for 2 checks in a row (1 so far)")
    assert policy.decide(_inputs(50, **clean)).repartition  # type: ignore[arg-type]


def test_when_the_conditions_come_and_go_partitions_are_compared_on_their_average() -> None:
    """A job on stage 0 a quarter of the time: CUR measures 27 ms/step without it and 57 with it, CAND 38.5-39 either
    way. The first time, the policy moves to CAND under the job and back when it has gone; the second time the job
    comes, CUR's average over the conditions (34.5 ms/step) beats CAND's (38.6): it stays on CUR."""
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0)
    cur = {"current": CUR, "candidate": CUR, "current_s": 27 * MS, "cost": 0.01, "conditions": CLEAN}
    job = {"current_s": 57 * MS, "candidate_s": 39 * MS, "cost": 0.01, "causes": "stage 0", "conditions": HOG}
    for step in (10, 20, 30, 40, 50):
        assert not policy.decide(_inputs(step, **cur)).repartition  # type: ignore[arg-type]
    assert policy.decide(_inputs(60, **job)).partition == CAND  # type: ignore[arg-type]
    policy.migrated(60)
    on_cand = {"current": CAND, "candidate": CAND, "cost": 0.01}
    assert not policy.decide(_inputs(70, current_s=39 * MS, conditions=HOG, **on_cand)).repartition  # type: ignore[arg-type]
    back = policy.decide(_inputs(80, current_s=38.5 * MS, conditions=CLEAN, **on_cand))  # type: ignore[arg-type]
    assert back.repartition and back.partition == CUR and "under the same conditions" in back.reason
    policy.migrated(80)
    for step in (90, 100, 110):
        assert not policy.decide(_inputs(step, **cur)).repartition  # type: ignore[arg-type]
    stay = policy.decide(_inputs(120, **job))  # type: ignore[arg-type]
    assert not stay.repartition
    assert stay.reason == (
        "the conditions come and go (clean 75% of the checks, stage 0 slowed 25% of the checks): averaged over them "
        "[4, 2] measured 38.6 ms/step against 34.5 for [3, 3]"
    )
    # and the move it did not make is not judged at the next check
    assert not policy.decide(_inputs(130, **cur)).repartition  # type: ignore[arg-type]


def test_a_predicted_move_to_a_partition_measured_slower_under_the_same_conditions_is_not_made() -> None:
    """The CNN under a steady hog on stage 0: CUR measured 80 ms/step, the move to CAND 55. On CAND, stage 0 reads
    less slowed (light work gets the core when it wakes), so the predictor prices CUR back at 46 ms/step against
    62: the measurements under the same conditions say otherwise, and the policy stays (it moved back and rolled
    back, two migrations, in 3 of 6 runs)."""
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0)
    hog = {"cost": 0.02, "causes": "stage 0: other processes", "conditions": HOG}
    assert policy.decide(_inputs(70, current_s=80 * MS, candidate_s=50 * MS, **hog)).partition == CAND  # type: ignore[arg-type]
    policy.migrated(70)
    on_cand = {"current": CAND, "candidate": CUR, "current_s": 62 * MS, "measured_s": 55 * MS, "candidate_s": 46 * MS}
    stay = policy.decide(_inputs(80, **on_cand, **hog))  # type: ignore[arg-type]
    assert not stay.repartition
    assert stay.reason == (
        "[3, 3] measured under the same conditions (stage 0 slowed) at step 70: 80.0 ms/step against 55.0 for [4, 2]"
    )
    assert not policy.decide(_inputs(90, **on_cand, **hog)).repartition  # type: ignore[arg-type]
    # measured under other conditions only, or not faster by less than min_relative_gain: the prediction decides
    other = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0)
    other.decide(_inputs(60, current_s=30 * MS, candidate=CUR, cost=0.02, conditions=CLEAN))
    assert other.decide(_inputs(70, current_s=80 * MS, candidate_s=50 * MS, **hog)).partition == CAND  # type: ignore[arg-type]
    other.migrated(70)
    clean = {**on_cand, "cost": 0.02, "conditions": CLEAN, "measured_s": 62 * MS}
    back = other.decide(_inputs(80, **clean))  # type: ignore[arg-type]
    assert back.repartition and back.partition == CUR  # CUR measured 30 ms/step clean


def test_a_rolled_back_window_is_remembered_and_averages_need_every_condition() -> None:
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0)
    policy.decide(_inputs(10, current_s=30 * MS, candidate_s=20 * MS, cost=0.01, conditions=CLEAN))
    policy.migrated(10)
    rolled = policy.decide(_inputs(20, current=CAND, candidate=CAND, current_s=40 * MS, cost=0.01, conditions=CLEAN))
    assert rolled.repartition and "roll back" in rolled.reason
    seen = policy._memory.measured(CAND, CLEAN)
    assert seen is not None and seen[2] == pytest.approx(0.040)

    # Stage 1's signs came and went twice, always on CUR: CAND was never measured under them, so no average
    # over the conditions exists for it, and the move back is judged under the same conditions as now.
    s1 = (False, True)
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0)
    for step, conditions in ((10, CLEAN), (20, s1), (30, CLEAN), (40, s1), (50, CLEAN)):
        policy.decide(_inputs(step, current_s=27 * MS, candidate=CUR, cost=0.01, conditions=conditions))
    job = {"current_s": 57 * MS, "candidate_s": 39 * MS, "cost": 0.01, "causes": "stage 0", "conditions": HOG}
    assert policy.decide(_inputs(60, **job)).repartition  # type: ignore[arg-type]
    policy.migrated(60)
    policy.decide(_inputs(70, current=CAND, candidate=CAND, current_s=39 * MS, cost=0.01, conditions=HOG))
    back = policy.decide(_inputs(80, current=CAND, candidate=CAND, current_s=38.5 * MS, cost=0.01, conditions=CLEAN))
    assert back.repartition and back.partition == CUR and "under the same conditions (clean)" in back.reason


def test_recall_skips_a_partition_the_controller_does_not_allow() -> None:
    """The controller's memory cap reaches the recall through ``PolicyInputs.allowed``: a partition measured faster
    is not moved back to when it is not allowed (and is when it is)."""

    for allowed, expected in ((None, True), (lambda p: p != CUR, False)):
        policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0, recall_steps=50)
        policy.decide(_inputs(10, current_s=27 * MS, candidate=CUR, cost=0.01, conditions=CLEAN))
        assert policy.decide(_inputs(20, current_s=40 * MS, candidate_s=30 * MS, cost=0.01, conditions=HOG)).repartition
        policy.migrated(20)
        now = _inputs(30, current=CAND, candidate=CAND, current_s=38 * MS, cost=0.01, conditions=CLEAN)
        d = policy.decide(replace(now, allowed=allowed))
        assert d.repartition is expected, d.reason
        assert not expected or d.partition == CUR


def test_a_move_is_not_judged_against_a_window_of_other_conditions() -> None:
    """The window before the move straddled a hog's onset on stage 0 (no sign yet: 'clean', 1.0 s/step); the one
    after it shows the hog (1.3 s/step). That is no evidence the move made the pipeline slower: no rollback, no
    refusal. Under the same conditions the same numbers roll it back."""
    clean, hogged = (False, False), (True, False)
    policy = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0)
    moved = policy.decide(_inputs(10, measured_s=1.0, conditions=clean))
    assert moved.repartition
    policy.migrated(10)
    after = policy.decide(_inputs(20, current=CAND, candidate=CAND, current_s=1.3, measured_s=1.3, conditions=hogged))
    assert not after.repartition and after.reason == "the current partition is already the best"
    later = policy.decide(_inputs(30, current=CAND, candidate=CUR, current_s=1.3, candidate_s=0.6, conditions=hogged))
    assert "made the pipeline slower" not in later.reason
    same = GainOverCostPolicy(horizon_steps=100, margin=2.0, patience=1, cooldown_steps=0)
    assert same.decide(_inputs(10, measured_s=1.0, conditions=hogged)).repartition
    same.migrated(10)
    back = same.decide(_inputs(20, current=CAND, candidate=CAND, current_s=1.3, measured_s=1.3, conditions=hogged))
    assert back.repartition and back.reason.startswith("roll back")


def test_the_saving_is_a_share_of_the_measured_step_where_the_prediction_is_shorter() -> None:
    """Clean windows of an 8-layer MLP on a noisy 2-core VM: [3, 6] priced at 15.0 ms/step, [2, 7] at 12.7, while
    the pipeline measured 32.0 (the framework's per-step work and the waits are not in the price, and are spent
    under either partition): 2.3 ms is 7% of the step, below the 10% minimum. The same saving where the step
    measures as priced moves; a hog's move (priced 108.1 -> 74.1 ms, measured 96.5) is not held back."""
    mlp = {"current_s": 15.0 * MS, "candidate_s": 12.7 * MS, "cost": 0.017, "conditions": CLEAN}
    policy = GainOverCostPolicy(patience=1)
    held = policy.decide(_inputs(381, measured_s=32.0 * MS, **mlp))  # type: ignore[arg-type]
    assert not held.repartition
    assert held.reason == ("gain (lower end) below 10% of the step time (2.3 ms of the 32.0 measured; 15.0 predicted)")
    # a saving below 10% of the prediction too: the reason names no measured step
    small = {**mlp, "candidate_s": 14.6 * MS}
    plain = GainOverCostPolicy(patience=1).decide(_inputs(381, measured_s=32.0 * MS, **small))  # type: ignore[arg-type]
    assert plain.reason == "gain (lower end) below 10% of the step time"
    # weighted by the convergence factor like the prediction: 2.3 of 15.5 x 1.05 is 14%
    weighted = GainOverCostPolicy(patience=1).decide(_inputs(381, measured_s=15.5 * MS, factor=1.05, **mlp))  # type: ignore[arg-type]
    assert weighted.repartition
    hog = GainOverCostPolicy(patience=1).decide(
        _inputs(71, current_s=108.1 * MS, candidate_s=74.1 * MS, measured_s=96.5 * MS, cost=0.05, causes="s0")
    )
    assert hog.repartition and hog.partition == CAND


def test_with_intervals_the_saving_at_the_values_must_be_material_and_its_lower_end_must_pay() -> None:
    """A forest calibrated at set-up, the CNN under a half-core quota on stage 1 at [2, 3] (measured 46.6 ms/step):
    [3, 2] priced at 35.4 ms per step at the forest's values, 40.0 at the upper ends of its intervals. Its saving at
    the values is 19% of the measured step (it measured 12% faster when run fixed), its lower end 4.2 ms, which over
    200 steps pays twice the 14 ms migration many times: it moves. Asked of the lower end (9% of the step), the 10%
    held it. A saving at the values below 10% is refused, and so is a lower end that does not pay the migration,
    however large the saving at the values; a point prediction is judged as before."""
    quota = {"current_s": 44.2 * MS, "measured_s": 46.6 * MS, "cost": 0.014, "conditions": (False, True)}

    def interval(candidate_s: float, high_s: float, **kw: object) -> PolicyInputs:
        args = {**quota, **kw}
        return replace(_inputs(11, candidate_s=candidate_s * MS, **args), candidate_step_high_s=high_s * MS)  # type: ignore[arg-type]

    moved = GainOverCostPolicy(patience=1).decide(interval(35.4, 40.0))
    assert moved.repartition and moved.partition == CAND
    assert moved.predicted_gain_s == pytest.approx((44.2 - 40.0) * MS * 200)
    small = GainOverCostPolicy(patience=1).decide(interval(41.0, 43.0))  # 3.2 ms: 7% of the measured step
    assert not small.repartition
    assert small.reason == "predicted gain below 10% of the step time"
    unsure = GainOverCostPolicy(patience=1).decide(interval(35.4, 44.1))  # 0.1 ms x 200 steps < 2 x 14 ms
    assert not unsure.repartition
    assert unsure.reason == "gain (lower end) over 200 steps does not pay 2x the migration cost"
    slower = GainOverCostPolicy(patience=1).decide(interval(35.4, 50.0))  # the lower end is a loss
    assert not slower.repartition and slower.reason == unsure.reason
    # a point prediction (the upper end is the value): the same numbers as before
    point = GainOverCostPolicy(patience=1).decide(interval(40.0, 40.0))
    assert not point.repartition and point.reason == "gain (lower end) below 10% of the step time"
    assert GainOverCostPolicy(patience=1).decide(interval(35.4, 35.4)).repartition


def test_recall_compares_the_medians_of_both_partitions_windows_not_one_window() -> None:
    """The windows of a clean run on a noisy VM, as measured: [3, 3] at 31.4, 33.5 and 39.5 ms/step before a move to
    [4, 2]; then [4, 2] at 32.7 ... 37.7. Against [3, 3]'s median (33.5) the single 37.7 ms window is 12.5% slower,
    and moved the pipeline back; [4, 2]'s median of its last three windows (34.2) is 2% slower: it stays. Once the
    median shows [4, 2] slower (a second slow window: 34.2, 37.7, 38.5), it moves back."""
    policy = GainOverCostPolicy(horizon_steps=200, margin=2.0, patience=2, cooldown_steps=30)
    on_cur = {"current": CUR, "candidate": CUR, "cost": 0.02, "conditions": CLEAN}
    for step, ms in ((231, 31.4), (241, 33.5)):
        assert not policy.decide(_inputs(step, current_s=ms * MS, **on_cur)).repartition  # type: ignore[arg-type]
    moved = policy.decide(
        _inputs(
            251,
            current_s=39.5 * MS,
            candidate_s=30 * MS,
            cost=0.02,
            causes="the link",
            link_cause=True,
            conditions=CLEAN,
        )
    )
    assert moved.repartition and moved.partition == CAND
    policy.migrated(251)
    on_cand = {"current": CAND, "candidate": CAND, "cost": 0.02, "conditions": CLEAN}
    for step, ms in ((261, 32.7), (271, 34.5), (281, 34.2), (291, 30.4), (301, 34.2), (311, 37.7)):
        d = policy.decide(_inputs(step, current_s=ms * MS, **on_cand))  # type: ignore[arg-type]
        assert not d.repartition, (step, d.reason)
    back = policy.decide(_inputs(321, current_s=38.5 * MS, **on_cand))  # type: ignore[arg-type]
    assert back.repartition and back.partition == CUR
    assert back.reason == (
        "move back: [3, 3] measured 33.5 ms/step at step 251 under the same conditions (clean); [4, 2] measures "
        "37.7 ms/step (the median of its last 3 windows)"
    )
