"""With a memory cap, the adaptive loop never chooses a partition or a depth predicted to need more memory on some
stage than the cap (weight versions, optimizer state, activations of the micro-batches in flight), and says which
faster choices it left out."""

from __future__ import annotations

import pytest

from lightning_dynpipe.plan.convergence import ConvergenceModel
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.memory import stage_memory
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor import StageTimes
from lightning_dynpipe.repartition import AdaptiveController, GainOverCostPolicy, InFlightPolicy
from lightning_dynpipe.schedule import AsyncSchedule

M = 4
# Five layers of 3 ms (forward 1, backward 2), 1 KB of parameters and 100 KB of activations each. Under async a
# stage k of 2 holds 2 - k weight versions and 2 - k micro-batches' activations (stage 1 also the 100 KB it
# received for each), async+d d more on stage 0.
UNIFORM = ModelCost.from_arrays([0.001] * 5, [0.002] * 5, param_bytes=[1000] * 5, activation_bytes=[100_000] * 5)
QUIET = CommModel(latency_s=1e-5, bandwidth_Bps=10e9)
SLOW = CommModel(latency_s=1e-3, bandwidth_Bps=20e6)


def _peak(balance: tuple[int, ...], schedule: str = "async") -> int:
    bounds = [0, balance[0], sum(balance)]
    return max(
        int(stage_memory(UNIFORM, [bounds[k]], [bounds[k + 1]], stage_idx=k, num_stages=2, schedule=schedule)[0])
        for k in range(2)
    )


def _controller(
    memory_cap: float | None, link: CommModel = QUIET, max_extra: int = 0, max_shift: int = 2
) -> AdaptiveController:
    return AdaptiveController(
        GainOverCostPolicy(patience=1, horizon_steps=500, patience_s=0.0),
        model_cost=UNIFORM,
        comm=link,
        schedule="async",
        num_microbatches=M,
        convergence=ConvergenceModel(beta=0.05),
        consider_stage_counts=False,
        max_extra_in_flight=max_extra,
        depth_policy=InFlightPolicy(patience=1, horizon_steps=500),
        memory_cap=memory_cap,
        max_shift=max_shift,
    )


def _last_stage_slowed() -> list[StageTimes]:
    """[2, 3] with the last stage's process 3x slower: moving layers to stage 0 pays."""
    return [StageTimes(M * 2 * 0.003, M * 0.027), StageTimes(M * 3 * 0.003 * 3, M * 0.027)]


def test_the_memory_model_of_the_cases_below() -> None:
    assert (_peak((1, 4)), _peak((2, 3)), _peak((3, 2)), _peak((4, 1))) == (504_000, 404_000, 606_000, 808_000)
    assert (_peak((2, 3), "async+1"), _peak((2, 3), "async+2")) == (606_000, 808_000)


def test_a_faster_partition_over_the_cap_is_not_chosen_and_the_decision_says_so() -> None:
    free = _controller(memory_cap=None).check(10, _last_stage_slowed(), Partition((2, 3)), remaining_steps=2000)
    assert free is not None and free.repartition and free.partition in (Partition((3, 2)), Partition((4, 1))), free
    capped = _controller(memory_cap=550_000)
    d = capped.check(10, _last_stage_slowed(), Partition((2, 3)), remaining_steps=2000)
    assert d is not None and not d.repartition, d
    assert d.reason == "the current partition is already the best"
    assert "faster but over the memory cap of 537.1 KiB (needed): " in str(d)
    assert "[3, 2] 591.8 KiB" in str(d) and "[4, 1] 789.1 KiB" in str(d)
    # the policy's recall is held to the same cap
    allowed = d.inputs.allowed
    assert allowed is not None and allowed(Partition((1, 4))) and not allowed(Partition((3, 2)))
    assert free.inputs.allowed is None
    # a cap that [3, 2] fits lets the loop move there, not to [4, 1]
    roomier = _controller(memory_cap=700_000)
    d = roomier.check(10, _last_stage_slowed(), Partition((2, 3)), remaining_steps=2000)
    assert d is not None and d.repartition and d.partition == Partition((3, 2)), d


def test_when_no_partition_fits_the_current_one_stays_without_an_error() -> None:
    # every 2-stage partition needs at least 404 KB on some stage: the planner finds none, the loop keeps [2, 3]
    controller = _controller(memory_cap=350_000)
    d = controller.check(10, _last_stage_slowed(), Partition((2, 3)), remaining_steps=2000)
    assert d is not None and not d.repartition, d


def _slow_link_window() -> list[StageTimes]:
    """[2, 3] under async on SLOW: every message 6 ms, hidden; the round trip binds at 13.5 ms a micro-batch
    (``tests/repartition/test_inflight.py`` checks it against the event simulator)."""
    return [StageTimes(M * 3 * f, M * 0.0135, comm_s=M * 0.006) for f in (0.002, 0.003)]


@pytest.mark.parametrize(
    ("cap", "chosen"),
    [(None, AsyncSchedule(1)), (700_000, AsyncSchedule(1)), (500_000, None)],
    ids=["no cap", "async+1 fits", "only async fits"],
)
def test_a_deeper_pipeline_over_the_cap_is_not_chosen(cap: float | None, chosen: AsyncSchedule | None) -> None:
    # the partition held (no neighbours priced; the planner proposes [2, 3] itself): the depth alone is chosen
    controller = _controller(memory_cap=cap, link=SLOW, max_extra=2, max_shift=0)
    d = controller.check(10, _slow_link_window(), Partition((2, 3)), remaining_steps=2000)
    assert d is not None and not d.repartition, d
    depth = controller.depth_decision
    assert depth is not None
    if chosen is None:
        assert not depth.change and depth.reason == "the current depth is already the best", depth
        assert "async+1 37.4 (needs 591.8 KiB: over the memory cap)" in str(depth)
        assert "async+2 38.2 (needs 789.1 KiB: over the memory cap)" in str(depth)
    else:
        assert depth.change and depth.schedule == chosen, depth


def test_under_the_cap_a_move_can_make_room_for_a_deeper_pipeline() -> None:
    """With a cap of 550 KB, async+1 does not fit [2, 3] (stage 0 needs 606 KB) but fits [1, 4] (303 and 504 KB),
    where it runs at 12 ms a micro-batch against [2, 3]'s 13.5 under async: the loop moves and deepens at once."""
    assert _peak((1, 4), "async+1") == 504_000
    controller = _controller(memory_cap=550_000, link=SLOW, max_extra=2)
    d = controller.check(10, _slow_link_window(), Partition((2, 3)), remaining_steps=2000)
    assert d is not None and d.repartition and d.partition == Partition((1, 4)), d
    depth = controller.depth_decision
    assert depth is not None and depth.change and depth.schedule == AsyncSchedule(1), depth
    assert "with async+1 (changed with the move)" in str(d)
