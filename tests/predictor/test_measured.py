"""The predictor protocol's data types and the measured-slowdown baseline (pure, no torch)."""

from __future__ import annotations

import doctest
from dataclasses import replace

import pytest

import lightning_dynpipe.predictor.base
import lightning_dynpipe.predictor.measured
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor import (
    InterferencePredictor,
    Interval,
    MeasuredSlowdownPredictor,
    PipelineWindow,
    StageTimes,
)
from lightning_dynpipe.predictor.measured import cpu_limited_floors, measured_slowdowns

COST = ModelCost.from_arrays([1.0] * 4, [2.0] * 4, activation_bytes=[100, 200, 300, 400])


@pytest.mark.parametrize("module", [lightning_dynpipe.predictor.base, lightning_dynpipe.predictor.measured])
def test_docstring_examples(module: object) -> None:
    result = doctest.testmod(module)  # type: ignore[arg-type]
    assert result.failed == 0


def test_baseline_carries_each_stage_slowdown_to_any_partition() -> None:
    window = PipelineWindow(Partition((2, 2)), (StageTimes(12.0, 30.0), StageTimes(36.0, 40.0)), 2)
    p = MeasuredSlowdownPredictor().predict(
        COST, CommModel(latency_s=1e-3, bandwidth_Bps=1e5), window, Partition((1, 3))
    )
    assert p.slowdowns == (1.0, 3.0)
    assert [i.value for i in p.stage_compute_s] == [3.0, 27.0]  # 1 layer x 3 s x 1.0 ; 3 layers x 3 s x 3.0
    assert p.boundary_s[0].value == pytest.approx(1e-3 + 100 / 1e5)  # the activation of layer 0 crosses
    assert all(i.low == i.value == i.high for i in (*p.stage_compute_s, *p.boundary_s))  # no spread model
    assert isinstance(MeasuredSlowdownPredictor(), InterferencePredictor)


def test_a_limited_stage_pays_its_framework_cpu_out_of_its_quota() -> None:
    """A stage under a quarter core that used 20 s of CPU per step for layers that profile at 2 x 2 x 1 s: 16 s of
    its CPU is not its layers' and stays with it whichever layers it holds; the stage is priced at no less than
    all its CPU over the quota (the slowdown alone, 4x the layers, missed the 16 s)."""
    cost = ModelCost.from_arrays([1.0] * 4, [0.0] * 4)
    limited = StageTimes(12.0, 80.0, cpu_limit=0.25, cpu_s=20.0)
    window = PipelineWindow(Partition((2, 2)), (StageTimes(4.0, 80.0), limited), 2)
    predictor = MeasuredSlowdownPredictor()
    here = predictor.predict(cost, CommModel(), window, Partition((2, 2)))
    assert here.slowdowns == (1.0, 4.0)  # the slowdowns (updates, the planner's solve) are unchanged
    assert here.stage_compute_s[1].value == pytest.approx((16.0 / 2 + 2.0) / 0.25)  # 2 micro-batches: 40 s each
    assert 2 * here.stage_compute_s[1].value == pytest.approx(20.0 / 0.25)  # the step the quota allows
    there = predictor.predict(cost, CommModel(), window, Partition((3, 1)))
    assert there.stage_compute_s[1].value == pytest.approx((8.0 + 1.0) / 0.25)  # one layer less: 4 s, not half
    assert there.stage_compute_s[0].value == pytest.approx(3.0)
    # updates the window ran come out of the other CPU (the controller adds the candidate's own)
    upd = ModelCost.from_arrays([1.0] * 4, [0.0] * 4, update_s=[0.5] * 4)
    with_updates = PipelineWindow(
        Partition((2, 2)), (StageTimes(4.0, 80.0), StageTimes(12.0, 80.0, cpu_limit=0.25, cpu_s=20.0, num_updates=2)), 2
    )
    assert cpu_limited_floors(upd, with_updates, Partition((2, 2)))[1] == pytest.approx((14.0 / 2 + 2.0) / 0.25)
    # in the profile's units: a machine twice as slow as its profile doubles every measured time
    slow = PipelineWindow(
        Partition((2, 2)), (StageTimes(8.0, 160.0), StageTimes(24.0, 160.0, cpu_limit=0.25, cpu_s=40.0)), 2
    )
    assert cpu_limited_floors(cost, slow, Partition((3, 1)))[1] == pytest.approx((8.0 + 1.0) / 0.25)


def test_a_limited_stage_pays_for_the_bytes_its_boundaries_carry_at_the_links_cpu_per_byte() -> None:
    """The same quarter-core stage, with the link's CPU at 0.01 s per byte of a message: a candidate whose boundary
    next to it carries 100 bytes more per micro-batch (each way: an activation in, its gradient out) costs it 2 s more
    CPU per micro-batch, priced over its quota, and one that carries fewer costs it less; ``message_cpu=False``
    keeps the CPU as measured; a stage under no limit is not floored, so its messages are not priced there."""
    cost = ModelCost.from_arrays([1.0] * 4, [0.0] * 4, activation_bytes=[100, 200, 300, 400])
    limited = StageTimes(12.0, 80.0, cpu_limit=0.25, cpu_s=20.0)
    window = PipelineWindow(Partition((2, 2)), (StageTimes(4.0, 80.0), limited), 2)
    link = CommModel(cpu_s_per_byte=0.01)
    # [2, 2] -> [3, 1]: the boundary moves from layer 1's 200-byte output to layer 2's 300 bytes
    assert cpu_limited_floors(cost, window, Partition((3, 1)), message_cpu_s_per_byte=0.01)[1] == pytest.approx(
        (8.0 + 2 * 100 * 0.01 + 1.0) / 0.25
    )
    assert cpu_limited_floors(cost, window, Partition((1, 3)), message_cpu_s_per_byte=0.01)[1] == pytest.approx(
        (8.0 - 2 * 100 * 0.01 + 3.0) / 0.25
    )
    # the window's own partition: no bytes moved, priced at what it measured
    assert cpu_limited_floors(cost, window, Partition((2, 2)), message_cpu_s_per_byte=0.01)[1] == pytest.approx(
        20.0 / 2 / 0.25
    )
    priced = MeasuredSlowdownPredictor().predict(cost, link, window, Partition((3, 1)))
    assert priced.stage_compute_s[1].value == pytest.approx((8.0 + 2.0 + 1.0) / 0.25)
    unpriced = MeasuredSlowdownPredictor(message_cpu=False).predict(cost, link, window, Partition((3, 1)))
    assert unpriced.stage_compute_s[1].value == pytest.approx((8.0 + 1.0) / 0.25)
    assert priced.stage_compute_s[0] == unpriced.stage_compute_s[0]
    with pytest.raises(ConfigurationError, match="message_cpu"):
        MeasuredSlowdownPredictor(message_cpu=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="cpu_s_per_byte"):
        CommModel(cpu_s_per_byte=-1.0)


def test_the_cpu_floor_needs_a_limit_and_a_measured_cpu() -> None:
    cost = ModelCost.from_arrays([1.0] * 4, [0.0] * 4)
    for limited in (
        StageTimes(12.0, 80.0, cpu_s=20.0),  # no limit
        StageTimes(12.0, 80.0, cpu_limit=1.5, cpu_s=20.0),  # a limit of more than one core: the stage is not slowed
        StageTimes(12.0, 80.0, cpu_limit=0.25),  # the CPU per step not measured: the 1/q slowdown alone
    ):
        window = PipelineWindow(Partition((2, 2)), (StageTimes(4.0, 80.0), limited), 2)
        assert cpu_limited_floors(cost, window, Partition((3, 1))) == (None, None)
    # a stage whose CPU is all its layers' is priced by its slowdown (the floor is below it)
    lean = PipelineWindow(
        Partition((2, 2)), (StageTimes(4.0, 80.0), StageTimes(16.0, 80.0, cpu_limit=0.25, cpu_s=4.0)), 2
    )
    assert MeasuredSlowdownPredictor().predict(cost, CommModel(), lean, Partition((3, 1))).stage_compute_s[
        1
    ].value == pytest.approx(4.0)
    with pytest.raises(ConfigurationError, match="same pipeline"):
        cpu_limited_floors(cost, lean, Partition((1, 1, 2)))


def test_a_stage_beside_a_hog_pays_all_its_cpu_at_the_share_of_the_core_it_gets() -> None:
    """Stage 1 shares its core with another busy process: busy half the time, its main thread waiting for the core
    the other half, 10 s of CPU per step of which its layers' profile is 2 x 2 x 1 s. Everything it does runs at half
    speed, its 6 s around the layers too: it is priced at no less than its CPU per step over the half core it gets
    (its slowdown, 3x its layers, missed the 6 s). The hog's core share is measured, not configured."""
    cost = ModelCost.from_arrays([1.0] * 4, [0.0] * 4)
    quiet = StageTimes(4.0, 80.0, cpu_s=5.0, cpu_share=0.3, other_cpu_load=0.0)
    hogged = StageTimes(12.0, 80.0, cpu_s=10.0, cpu_share=0.5, run_queue_wait_share=0.5, other_cpu_load=0.5)
    window = PipelineWindow(Partition((2, 2)), (quiet, hogged), 2)
    predictor = MeasuredSlowdownPredictor()
    here = predictor.predict(cost, CommModel(), window, Partition((2, 2)))
    assert here.slowdowns == (1.0, 3.0)
    assert 2 * here.stage_compute_s[1].value == pytest.approx(10.0 / 0.5)  # the step its share of the core allows
    there = predictor.predict(cost, CommModel(), window, Partition((3, 1)))
    assert there.stage_compute_s[1].value == pytest.approx((6.0 / 2 + 1.0) / 0.5)  # one layer less: 2 s of 10
    assert there.stage_compute_s[0].value == pytest.approx(3.0)  # the quiet stage: its slowdown (no floor)


_HOGGED = StageTimes(12.0, 80.0, cpu_s=10.0, cpu_share=0.5, run_queue_wait_share=0.5, other_cpu_load=0.5)


@pytest.mark.parametrize(
    ("quiet", "hogged"),
    [
        # the other stage as busy beside other processes and waiting as long: nothing beyond the least affected's
        (replace(_HOGGED, compute_s=4.0), _HOGGED),
        # several threads at work (busy and waiting over one core's time): CPU per step is not one thread's path
        (StageTimes(4.0, 80.0, cpu_share=0.3, other_cpu_load=0.0), replace(_HOGGED, cpu_share=1.2)),
        # no system readings
        (StageTimes(4.0, 80.0), StageTimes(12.0, 80.0, cpu_s=10.0)),
    ],
)
def test_the_hog_floor_needs_a_measured_contention_of_one_busy_thread(quiet: StageTimes, hogged: StageTimes) -> None:
    cost = ModelCost.from_arrays([1.0] * 4, [0.0] * 4)
    window = PipelineWindow(Partition((2, 2)), (quiet, hogged), 2)
    assert cpu_limited_floors(cost, window, Partition((3, 1))) == (None, None)


def test_the_mean_step_is_never_below_what_a_cpu_limit_allows() -> None:
    """A window of bimodal steps under a quarter core measured 60 ms; the stage's 21 ms of CPU per step need 84 ms
    at a quarter core over many periods."""
    free, limited = StageTimes(0.02, 0.06, mean_step_s=0.06), StageTimes(0.02, 0.06, mean_step_s=0.06, cpu_limit=0.25)
    assert PipelineWindow(Partition((2, 2)), (free, limited), 4).mean_step_s == pytest.approx(0.06)  # CPU unmeasured
    lucky = replace(limited, cpu_s=0.021)
    assert PipelineWindow(Partition((2, 2)), (free, lucky), 4).mean_step_s == pytest.approx(0.084)
    slow = replace(lucky, mean_step_s=0.1)  # a window that waited longer: the measurement stands
    assert PipelineWindow(Partition((2, 2)), (free, slow), 4).mean_step_s == pytest.approx(0.1)
    roomy = replace(lucky, cpu_limit=1.5)  # a limit above one core bounds nothing here
    assert PipelineWindow(Partition((2, 2)), (free, roomy), 4).mean_step_s == pytest.approx(0.06)


def test_window_measures_overlap_and_the_pipeline_step() -> None:
    w = PipelineWindow(Partition((2, 2)), (StageTimes(1.0, 5.0, 2.0, 0.5), StageTimes(1.0, 6.0, 2.0, 1.5)), 4)
    assert w.comm_overlap == pytest.approx(0.5) and w.step_s == 6.0
    assert PipelineWindow(Partition((4,)), (StageTimes(1.0, 1.0),), 1).comm_overlap == 0.0
    with pytest.raises(ConfigurationError, match="one StageTimes per stage"):
        PipelineWindow(Partition((2, 2)), (StageTimes(1.0, 1.0),), 4)


def test_interval_must_contain_its_value() -> None:
    assert Interval.point(2.0) == Interval(2.0, 2.0, 2.0)
    with pytest.raises(ConfigurationError, match="low <= value <= high"):
        Interval(1.0, 2.0, 3.0)


def _two_stage(c0: float, c1: float) -> PipelineWindow:
    """[2, 2] of COST (6 s of profile per stage and micro-batch), stage compute ``c0`` and ``c1`` per step of 2."""
    return PipelineWindow(Partition((2, 2)), (StageTimes(c0, 50.0), StageTimes(c1, 50.0)), 2)


def _relative(predictor: MeasuredSlowdownPredictor, window: PipelineWindow) -> tuple[float, ...]:
    """The window's slowdowns relative to the speed ``predictor`` remembers (what tells a slowed stage)."""
    return measured_slowdowns(COST, window.partition, window.stages, 2, reference=predictor.reference)


def test_a_slowed_least_slowed_stage_reads_slowed_once_a_window_showed_it_faster() -> None:
    """Stage 1 reads 3x its profile throughout (its fixed costs, say); a hog then doubles stage 0. Relative to the
    window alone stage 0 would stay at 1.0; relative to the speed the pipeline showed before, it reads 2x. Either
    way a prediction is in seconds: stage 0 at twice its profile (the slowdowns a prediction carries are each
    stage's stretch at the pipeline's speed)."""
    predictor = MeasuredSlowdownPredictor(tolerance=0.0)
    for _ in range(2):  # two windows: the reference is the second lowest speed seen
        predictor.observe(COST, CommModel(), _two_stage(12.0, 36.0))
    hogged = _two_stage(24.0, 36.0)
    predictor.observe(COST, CommModel(), hogged)  # the adaptive loop gives the window before it asks
    assert _relative(predictor, hogged) == (2.0, 3.0)
    p = predictor.predict(COST, CommModel(), hogged, Partition((3, 1)))
    assert p.slowdowns == (2.0, 3.0)
    assert [i.value for i in p.stage_compute_s] == [18.0, 9.0]
    alone = MeasuredSlowdownPredictor(remember=0)
    alone.observe(COST, CommModel(), _two_stage(12.0, 36.0))
    assert alone.reference is None
    assert _relative(alone, hogged) == (1.0, 1.5)
    seconds = alone.predict(COST, CommModel(), hogged, Partition((3, 1)))
    assert seconds.slowdowns == (2.0, 3.0) and seconds.stage_compute_s == p.stage_compute_s
    # a window faster than any before sets the speed itself
    assert _relative(predictor, _two_stage(6.0, 36.0)) == (1.0, 6.0)


def test_a_least_slowed_stage_within_the_tolerance_reads_unslowed() -> None:
    """The windows' noise: stage 0 reading up to 10% over the remembered speed is the window alone's answer; beyond,
    only the excess counts (continuous in the reading)."""
    predictor = MeasuredSlowdownPredictor()
    for _ in range(2):
        predictor.observe(COST, CommModel(), _two_stage(12.0, 36.0))
    for c0, expected in ((12.6, (1.0, 36 / 12.6)), (13.2, (1.0, 36 / 13.2)), (26.4, (2.0, 36 / 13.2))):
        assert _relative(predictor, _two_stage(c0, 36.0)) == pytest.approx(expected)


def test_the_reference_is_robust_to_one_fast_window_and_starts_afresh_with_another_profile() -> None:
    predictor = MeasuredSlowdownPredictor()
    assert predictor.reference is None
    for c0 in (12.0, 13.2, 6.0, 14.4):  # ratios 1.0, 1.1, 0.5 (a timer hiccup), 1.2
        predictor.observe(COST, CommModel(), _two_stage(c0, 36.0))
    # the second lowest (the one fast window does not set it) with the 10% tolerance
    assert predictor.reference == pytest.approx(1.0 * 1.1)
    assert predictor._least == pytest.approx([0.5, 1.0, 1.1])  # bounded: the lowest `remember`
    other = ModelCost.from_arrays([1.0] * 4, [2.0] * 4)  # another fit's profile: another object
    predictor.observe(other, CommModel(), _two_stage(24.0, 36.0))
    assert predictor.reference == pytest.approx(2.0 * 1.1)
    no_compute = PipelineWindow(Partition((2, 2)), (StageTimes(0.0, 50.0), StageTimes(0.0, 50.0)), 2)
    predictor.observe(other, CommModel(), no_compute)  # nothing measured: nothing remembered
    assert predictor.reference == pytest.approx(2.0 * 1.1)


@pytest.mark.parametrize("remember", [-1, 1.5, True, "3"])
def test_remember_must_be_a_whole_number_of_windows(remember: object) -> None:
    with pytest.raises(ConfigurationError, match=r"remember=\.\.\.\) takes a whole number of windows >= 0"):
        MeasuredSlowdownPredictor(remember=remember)  # type: ignore[arg-type]


@pytest.mark.parametrize("tolerance", [-0.1, 10.0, float("nan"), True, "0.1"])
def test_the_tolerance_is_a_share_of_the_remembered_speed(tolerance: object) -> None:
    with pytest.raises(ConfigurationError, match=r"tolerance=\.\.\.\) is a share of the remembered speed"):
        MeasuredSlowdownPredictor(tolerance=tolerance)  # type: ignore[arg-type]


def test_the_cpu_floor_converts_seconds_at_the_remembered_speed() -> None:
    """The floor's CPU seconds become profile units at the least slowed speed: with a remembered speed below the
    window's, the same CPU is more of the profile's units, and the floor in seconds is the same CPU over the quota."""
    cost = ModelCost.from_arrays([1e-3] * 4, [0.0] * 4)
    times = (StageTimes(0.012, 0.05), StageTimes(0.008, 0.05, cpu_limit=0.25, cpu_s=0.005))  # stage 0 at 6x
    window = PipelineWindow(Partition((3, 1)), times, 2)
    window_only = cpu_limited_floors(cost, window, Partition((2, 2)))[1]
    remembered = cpu_limited_floors(cost, window, Partition((2, 2)), reference=1.0)[1]
    assert window_only is not None and remembered is not None
    # the window alone: base 2 (stage 0 ran 12 ms for 6 ms of profile), so the 5 ms of CPU are 2.5 ms of profile,
    # 2 ms of them the layer it ran: 0.5 ms other; two layers and a quarter of it per micro-batch, over the quota
    assert window_only == pytest.approx((0.00025 + 0.002) / 0.25)
    # base 1: the 5 ms are 5 ms of profile, 3 ms of them other: 1.5 ms per micro-batch besides the two layers
    assert remembered == pytest.approx((0.0015 + 0.002) / 0.25)
    # in seconds at the speed each assumes: 18 ms against 14 ms (7 ms of CPU per micro-batch's step share)
    assert cpu_limited_floors(cost, window, Partition((2, 2)), seconds=True)[1] == pytest.approx(0.018)
    assert cpu_limited_floors(cost, window, Partition((2, 2)), seconds=True, reference=1.0)[1] == pytest.approx(0.014)


def _read(c0: float, c1: float, *, hog0: float = 0.0, limit1: float | None = None) -> PipelineWindow:
    """Like :func:`_two_stage`, with the stages' readings (so signs of interference can be told): ``hog0`` cores of
    other processes on stage 0's core, a CPU limit ``limit1`` on stage 1."""
    s0 = StageTimes(c0, 50.0, cpu_share=0.9, other_cpu_load=hog0)
    s1 = StageTimes(c1, 50.0, cpu_share=0.9, other_cpu_load=0.0, cpu_limit=limit1)
    return PipelineWindow(Partition((2, 2)), (s0, s1), 2)


def test_a_quiet_stage_prices_its_excess_as_a_fixed_cost_per_micro_batch() -> None:
    """Stage 1 reads 3x its profile with no sign of interference (the loss, the loop's work per micro-batch): those
    12 s per micro-batch stay with the stage whatever layers it holds, instead of stretching every layer it would
    receive 3x (on the CNN's clean cuts this model put the slowest stage within 4% where the stretch missed by 18%)."""
    predictor = MeasuredSlowdownPredictor()
    quiet = _read(12.0, 36.0)
    for _ in range(2):
        predictor.observe(COST, CommModel(), quiet)
    assert predictor.quiet_ratio(1, range(2, 4)) == pytest.approx(3.0)
    assert predictor.quiet_ratio(1, range(3, 4)) is None  # never held: nothing known
    here = predictor.predict(COST, CommModel(), quiet, Partition((2, 2)))
    assert here.slowdowns == (1.0, 3.0)  # the slowdowns (the planner's solve, the policy) are unchanged
    assert [i.value for i in here.stage_compute_s] == pytest.approx([6.0, 18.0])  # what the window measured
    more = predictor.predict(COST, CommModel(), quiet, Partition((1, 3)))
    assert [i.value for i in more.stage_compute_s] == pytest.approx([3.0, 9.0 + 12.0])  # not 3 x 9 = 27
    fewer = predictor.predict(COST, CommModel(), quiet, Partition((3, 1)))
    assert [i.value for i in fewer.stage_compute_s] == pytest.approx([9.0, 3.0 + 12.0])  # not 3 x 3 = 9
    stretched = MeasuredSlowdownPredictor(fixed_costs=False)
    for _ in range(2):
        stretched.observe(COST, CommModel(), quiet)
    assert [i.value for i in stretched.predict(COST, CommModel(), quiet, Partition((1, 3))).stage_compute_s] == (
        pytest.approx([3.0, 27.0])
    )


def test_interference_stretches_a_stage_and_its_fixed_cost() -> None:
    """A hog on stage 0 (a sign) doubles it: that stretch carries to any layers (stage 0 was quiet at 1x, so it has
    no fixed cost); stage 1 keeps its fixed cost. Slowed beyond its quiet reading with no sign, stage 1 is stretched
    by the excess, fixed cost included; a window faster than the quiet reading makes the excess it shows the fixed
    cost."""
    predictor = MeasuredSlowdownPredictor(tolerance=0.0)
    for _ in range(2):
        predictor.observe(COST, CommModel(), _read(12.0, 36.0))
    hogged = _read(24.0, 36.0, hog0=1.0)
    assert hogged.signs()[0] and not hogged.signs()[1]
    predictor.observe(COST, CommModel(), hogged)
    assert predictor.quiet_ratio(0, range(0, 2)) == pytest.approx(1.0)  # the hogged window is not quiet
    p = predictor.predict(COST, CommModel(), hogged, Partition((1, 3)))
    assert p.slowdowns == (2.0, 3.0)
    assert [i.value for i in p.stage_compute_s] == pytest.approx([2.0 * 3.0, 9.0 + 12.0])
    slower = _read(12.0, 54.0)  # stage 1 at 4.5x, no sign: 1.5x over its quiet 3x
    p = predictor.predict(COST, CommModel(), slower, Partition((1, 3)))
    assert [i.value for i in p.stage_compute_s] == pytest.approx([3.0, 1.5 * (9.0 + 12.0)])
    faster = _read(12.0, 24.0)  # 2x: below the quiet reading, all of it fixed
    p = predictor.predict(COST, CommModel(), faster, Partition((1, 3)))
    assert [i.value for i in p.stage_compute_s] == pytest.approx([3.0, 9.0 + 6.0])


def test_only_quiet_unlimited_stages_with_readings_are_remembered() -> None:
    """A stage under a CPU limit keeps the limit's pricing (its floor); a window without the stages' readings
    cannot tell a quiet stage from a slowed one; ``remember=0`` keeps nothing; another profile starts afresh."""
    predictor = MeasuredSlowdownPredictor()
    predictor.observe(COST, CommModel(), _read(12.0, 36.0, limit1=0.25))
    assert predictor.quiet_ratio(0, range(0, 2)) == pytest.approx(1.0)
    assert predictor.quiet_ratio(1, range(2, 4)) is None
    predictor.observe(COST, CommModel(), _two_stage(12.0, 36.0))  # no readings
    assert predictor.quiet_ratio(1, range(2, 4)) is None
    nothing = MeasuredSlowdownPredictor(remember=0)
    nothing.observe(COST, CommModel(), _read(12.0, 36.0))
    assert nothing.quiet_ratio(1, range(2, 4)) is None
    predictor.observe(COST, CommModel(), _read(12.0, 36.0))
    other = ModelCost.from_arrays([1.0] * 4, [2.0] * 4)
    predictor.observe(other, CommModel(), _read(12.0, 24.0, hog0=1.0))
    assert predictor.quiet_ratio(1, range(2, 4)) == pytest.approx(2.0)  # only the new profile's window
    assert predictor.quiet_ratio(0, range(0, 2)) is None


def test_fixed_costs_is_a_flag() -> None:
    with pytest.raises(ConfigurationError, match=r"fixed_costs=\.\.\.\) takes True or False"):
        MeasuredSlowdownPredictor(fixed_costs=1)  # type: ignore[arg-type]
