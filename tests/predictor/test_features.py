"""The forest's feature schema and rows: columns, missing readings, the analytic priors and the labels."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.monitor.stats import StageSample, StageSummary, SystemReading
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor import PipelineWindow, StageTimes
from lightning_dynpipe.predictor.features import (
    BOUNDARY_FEATURES,
    FEATURE_SCHEMA,
    MISSING,
    STAGE_FEATURES,
    FeatureSchema,
    LabelledSamples,
    boundary_priors,
    boundary_rows,
    estimate_fixed_s,
    measured_message_s,
    samples_from_windows,
    stage_priors,
    stage_rows,
    window_label,
)
from lightning_dynpipe.predictor.link import LinkEstimate

COST = ModelCost.from_arrays(
    [1e-3] * 4, [2e-3] * 4, activation_bytes=[1 << 20, 2 << 20, 3 << 20, 4 << 20], param_bytes=[1 << 20] * 4
)
LINK = CommModel(latency_s=1e-4, bandwidth_Bps=1e9)


def _col(name: str) -> int:
    return STAGE_FEATURES.index(name)


def test_schema_round_trips_and_a_different_version_is_refused_with_the_rule_and_the_fix() -> None:
    assert FeatureSchema.from_dict(FEATURE_SCHEMA.to_dict()) == FEATURE_SCHEMA
    FEATURE_SCHEMA.check(FeatureSchema.from_dict(FEATURE_SCHEMA.to_dict()), where="f.npz")
    older = FeatureSchema(FEATURE_SCHEMA.name, FEATURE_SCHEMA.version - 1, FEATURE_SCHEMA.stage[:-1], ())
    with pytest.raises(
        ConfigurationError, match=rf"f\.npz was trained on feature schema .* version {older.version}.*calibrate"
    ):
        FEATURE_SCHEMA.check(older, where="f.npz")
    with pytest.raises(ConfigurationError, match="needs 'name', 'version'"):
        FeatureSchema.from_dict({"name": "x"})


def test_stage_rows_hold_the_environment_and_the_candidates_layer_set() -> None:
    window = PipelineWindow(
        Partition((2, 2)),
        (
            StageTimes(compute_s=24e-3, step_s=40e-3, cpu_share=0.6, other_cpu_load=0.5),
            StageTimes(compute_s=48e-3, step_s=48e-3, cpu_limit=0.5, cpu_share=0.5),
        ),
        4,
    )
    rows = stage_rows(COST, window, Partition((3, 1)))
    assert rows.shape == (2, len(STAGE_FEATURES))
    assert rows[0, _col("cpu_limit_cores")] == MISSING and rows[1, _col("cpu_limit_cores")] == 0.5
    assert rows[0, _col("other_cpu_load")] == 0.5 and rows[1, _col("other_cpu_load")] == MISSING
    assert rows[0, _col("gpu_util")] == MISSING  # no NVML
    assert rows[0, _col("candidate_profile_ms")] == pytest.approx(9.0)  # 3 layers of 3 ms
    assert rows[1, _col("candidate_num_layers")] == 1.0
    assert rows[0, _col("work_ratio")] == pytest.approx(1.5) and rows[1, _col("work_ratio")] == pytest.approx(0.5)
    assert rows[0, _col("measured_raw_ratio")] == pytest.approx(1.0)  # 24 ms = 4 micro-batches x 6 ms
    assert rows[1, _col("measured_duty")] == pytest.approx(1.0)
    assert rows[1, _col("quota_demand")] == pytest.approx(0.5 / 0.5)
    assert rows[1, _col("candidate_activation_out_mib")] == 4.0


def test_stage_prior_is_the_measured_stretch_floored_at_one_over_the_quota() -> None:
    window = PipelineWindow(
        Partition((2, 2)),
        (StageTimes(compute_s=48e-3, step_s=60e-3), StageTimes(compute_s=30e-3, step_s=60e-3, cpu_limit=0.25)),
        4,
    )
    prior = stage_priors(COST, window, Partition((1, 3)))
    assert prior[0] == pytest.approx(2.0 * 3e-3)  # measured 2x the profile, one layer
    assert prior[1] == pytest.approx(4.0 * 9e-3)  # 1.25x measured, but a quarter core means at least 4x


def test_a_limited_stages_prior_keeps_the_cpu_spent_around_its_layers() -> None:
    """Stage 1 under a quarter core used 40 ms of CPU per step; at the machine's present speed (stage 1 measured
    1.25x its profile, the least slowed) its two layers' 4 micro-batches are 30 ms of it. Giving one layer away
    saves that layer's CPU only: (10 ms / 4 + 1.25 x 3 ms) / 0.25 per micro-batch, not a quarter core's 4x of the
    one layer (12 ms)."""
    limited = StageTimes(compute_s=30e-3, step_s=160e-3, cpu_limit=0.25, cpu_s=40e-3)
    window = PipelineWindow(Partition((2, 2)), (StageTimes(compute_s=48e-3, step_s=160e-3), limited), 4)
    prior = stage_priors(COST, window, Partition((3, 1)))
    assert prior[1] == pytest.approx((10e-3 / 4 + 1.25 * 3e-3) / 0.25)
    assert prior[0] == pytest.approx(2.0 * 9e-3)  # the unlimited stage: its stretch, as before
    # without the CPU measured, the stretch floored at 1/q alone
    unmeasured = PipelineWindow(
        Partition((2, 2)), (window.stages[0], StageTimes(compute_s=30e-3, step_s=160e-3, cpu_limit=0.25)), 4
    )
    assert stage_priors(COST, unmeasured, Partition((3, 1)))[1] == pytest.approx(4.0 * 3e-3)
    # no limit, but beside a CPU hog: busy 40% of the time, waiting for its core 40%, it got half a core
    hogged = StageTimes(30e-3, 160e-3, cpu_s=40e-3, cpu_share=0.4, run_queue_wait_share=0.4, other_cpu_load=0.5)
    quiet = replace(window.stages[0], cpu_share=0.3, other_cpu_load=0.0)
    beside = PipelineWindow(Partition((2, 2)), (quiet, hogged), 4)
    assert stage_priors(COST, beside, Partition((3, 1)))[1] == pytest.approx((10e-3 / 4 + 1.25 * 3e-3) / 0.5)


def test_a_limited_stages_cpu_around_its_layers_is_its_floor_not_a_stretch_of_the_layers_it_receives() -> None:
    """Stage 1 under a quarter core holds one layer (3 ms profiled) and spends 40 ms of CPU per step of 4
    micro-batches, 28 ms of it around the layer; it uses its whole quota, so its CPU over the limit is 40 ms per
    micro-batch, 13.3x its layer's profile, while its forward+backward read 4x (the quota's stretch). Given a second
    layer it needs (28 ms / 4 + 6 ms) / 0.25 = 52 ms per micro-batch; stretching both layers by 13.3x would say
    80."""
    limited = StageTimes(compute_s=48e-3, step_s=160e-3, cpu_limit=0.25, cpu_share=0.25, cpu_s=40e-3)
    window = PipelineWindow(Partition((3, 1)), (StageTimes(compute_s=36e-3, step_s=160e-3), limited), 4)
    needed = (28e-3 / 4 + 6e-3) / 0.25
    assert stage_priors(COST, window, Partition((2, 2)))[1] == pytest.approx(needed)
    # with the sweep's fixed cost per micro-batch as well: the stretch is the quota's 4x of 7 ms, below the floor
    assert stage_priors(COST, window, Partition((2, 2)), fixed_s=1e-3)[1] == pytest.approx(needed)
    # its own layer is priced at what it measured: its CPU over the limit
    assert stage_priors(COST, window, window.partition)[1] == pytest.approx(40e-3)
    # without its CPU per step measured there is no floor, and its time over the limit stretches its layers
    unmeasured = PipelineWindow(window.partition, (window.stages[0], replace(limited, cpu_s=0.0)), 4)
    assert stage_priors(COST, unmeasured, Partition((2, 2)))[1] == pytest.approx(40e-3 / 3e-3 * 6e-3)


class _Quiet:
    """Quiet readings for the tests: the pipeline's speed and what stages read quiet under given layers."""

    def __init__(self, reference: float | None, readings: dict[tuple[int, int, int], float]) -> None:
        self._reference, self._readings = reference, readings

    @property
    def reference(self) -> float | None:
        return self._reference

    def quiet_ratio(self, stage: int, layers: range) -> float | None:
        return self._readings.get((stage, layers.start, layers.stop))


def _small_last_stage(reading: float, **limits: float) -> PipelineWindow:
    """``[3, 1]``, 4 micro-batches: stage 0 at its profile (9 ms per micro-batch), the last stage's one layer
    (3 ms profiled) at ``reading`` times its profile."""
    return PipelineWindow(
        Partition((3, 1)),
        (StageTimes(compute_s=36e-3, step_s=60e-3), StageTimes(compute_s=4 * reading * 3e-3, step_s=60e-3, **limits)),
        4,
    )


def test_a_quiet_reading_prices_a_stage_with_its_fixed_cost_not_as_a_stretch_of_the_layers_it_receives() -> None:
    """The last stage's one layer read 2x its profile quiet: 3 ms per micro-batch the layers do not explain. Given
    two layers, it costs 6 ms + those 3 ms, not 2 x 6 ms; under a hog that doubles its reading, both double."""
    quiet = _Quiet(1.1, {(1, 3, 4): 2.0})
    window = _small_last_stage(2.0)
    assert stage_priors(COST, window, Partition((2, 2)))[1] == pytest.approx(12e-3)  # no reading known: the stretch
    prior = stage_priors(COST, window, Partition((2, 2)), quiet)
    assert prior[1] == pytest.approx(9e-3) and prior[0] == pytest.approx(6e-3)
    assert stage_priors(COST, window, Partition((3, 1)), quiet)[1] == pytest.approx(6e-3)  # what it measured
    hogged = _small_last_stage(4.0)
    assert stage_priors(COST, hogged, Partition((2, 2)), quiet)[1] == pytest.approx(18e-3)
    assert stage_priors(COST, hogged, Partition((3, 1)), quiet)[1] == pytest.approx(12e-3)
    row = stage_rows(COST, window, Partition((2, 2)), quiet)
    assert row[1, _col("fixed_share")] == pytest.approx(3 / 9) and row[0, _col("fixed_share")] == 0.0
    assert stage_rows(COST, window, Partition((2, 2)))[1, _col("fixed_share")] == 0.0
    # a reading under other layers, or under a CPU limit below one core, is not the stage's fixed cost
    assert stage_priors(COST, window, Partition((2, 2)), _Quiet(1.1, {(1, 2, 4): 2.0}))[1] == pytest.approx(12e-3)
    limited = _small_last_stage(4.0, cpu_limit=0.5)
    assert stage_priors(COST, limited, Partition((2, 2)), quiet)[1] == pytest.approx(
        stage_priors(COST, limited, Partition((2, 2)))[1]
    )


def test_a_sample_is_labelled_against_the_prior_the_quiet_readings_gave() -> None:
    quiet = _Quiet(1.1, {(1, 3, 4): 2.0})
    after = PipelineWindow(
        Partition((2, 2)), (StageTimes(compute_s=24e-3, step_s=40e-3), StageTimes(compute_s=36e-3, step_s=40e-3)), 4
    )
    s = samples_from_windows(COST, LINK, _small_last_stage(2.0), after, quiet)
    assert s.stage_y.tolist() == pytest.approx([0.0, 0.0])  # 9 ms measured, 9 ms priced
    assert samples_from_windows(COST, LINK, _small_last_stage(2.0), after).stage_y[1] == pytest.approx(math.log(9 / 12))


def test_gpu_readings_reach_the_rows_from_the_monitor() -> None:
    reading = SystemReading(gpu_util=0.8, gpu_sm_clock_mhz=1200.0, gpu_throttled=1.0, gpu_other_mem_bytes=1 << 30)

    class Step:
        forward_s, backward_s, optimizer_s, recv_wait_s, send_s = 0.01, 0.02, 0.0, 0.0, 0.0
        comm_s, exposed_comm_s, step_s = 0.0, 0.0, 0.04
        num_forward = num_backward = num_updates = 4
        in_flight = stash_depth = 0

    summary = StageSummary.of([StageSample.from_step(Step(), reading)] * 3)  # type: ignore[arg-type]
    times = StageTimes.from_summary(summary)
    window = PipelineWindow(Partition((4,)), (times,), 4)
    row = stage_rows(COST, window, Partition((4,)))[0]
    assert row[_col("gpu_util")] == 0.8 and row[_col("gpu_sm_clock_mhz")] == 1200.0
    assert row[_col("gpu_throttled")] == 1.0 and row[_col("gpu_other_mem_mib")] == 1024.0
    assert times.compute_s == pytest.approx(0.03)


def test_boundary_prior_carries_the_measured_extra_latency_and_follows_the_bytes() -> None:
    M = 4
    msg = 5e-3  # a delayed link: 5 ms per message
    window = PipelineWindow(
        Partition((2, 2)),
        (StageTimes(0.024, 0.06, comm_s=M * msg, comm_spread_s=M * 1e-3), StageTimes(0.024, 0.06, comm_s=M * msg)),
        M,
    )
    ((median, spread),) = measured_message_s(window)
    assert median == pytest.approx(msg) and spread == pytest.approx(0.5e-3)
    prior = boundary_priors(COST, LINK, window, Partition((3, 1)))
    link = lambda b: 1e-4 + b / 1e9  # noqa: E731
    assert prior[0] == pytest.approx(msg - link(2 << 20) + link(3 << 20))
    rows = boundary_rows(COST, LINK, window, Partition((3, 1)))
    assert rows.shape == (1, len(BOUNDARY_FEATURES)) and rows[0, BOUNDARY_FEATURES.index("candidate_mib")] == 3.0
    idle = PipelineWindow(Partition((2, 2)), (StageTimes(0.024, 0.06), StageTimes(0.024, 0.06)), M)
    assert boundary_priors(COST, LINK, idle, Partition((1, 3)))[0] == pytest.approx(link(1 << 20))


def test_a_boundary_beside_a_throttled_stage_is_measured_on_its_other_side() -> None:
    """Under a quarter core the limited stage sees most arrivals late (its process is stopped when they come): its
    times are its throttling, not the link's."""
    M = 4
    free = StageTimes(0.024, 0.1, comm_s=M * 1e-3, comm_spread_s=M * 0.2e-3)
    limited = StageTimes(0.024, 0.1, comm_s=M * 30e-3, comm_spread_s=M * 40e-3, cpu_limit=0.25)
    ((median, spread),) = measured_message_s(PipelineWindow(Partition((2, 2)), (free, limited), M))
    assert (median, spread) == (pytest.approx(1e-3), pytest.approx(0.2e-3))
    ((median, _),) = measured_message_s(PipelineWindow(Partition((2, 2)), (limited, free), M))
    assert median == pytest.approx(1e-3)
    both = replace(free, cpu_limit=0.5)  # both limited: each side reads at least the link's time, the lower counts
    ((median, _),) = measured_message_s(PipelineWindow(Partition((2, 2)), (both, limited), M))
    assert median == pytest.approx(1e-3)
    # three stages, the middle one limited: each boundary from its free side (the middle's times span both)
    mid = replace(limited, comm_s=2 * M * 30e-3)
    times = measured_message_s(PipelineWindow(Partition((1, 2, 1)), (free, mid, free), M))
    assert [m for m, _ in times] == [pytest.approx(1e-3), pytest.approx(1e-3)]


def test_a_boundary_beside_a_stage_that_waits_for_its_core_is_measured_on_its_other_side() -> None:
    """Beside a CPU hog the stage's threads that receive wait for the core, and it sees messages late: on the CNN the
    hogged side read 11 ms per message where the other read 0.3. Other processes on its cores or its main thread
    waiting for a core (beyond the other stage's, by the monitor's thresholds) count; noise below them does not."""
    M = 4
    quiet = StageTimes(0.024, 0.1, comm_s=M * 0.3e-3, cpu_share=0.9, other_cpu_load=0.0, run_queue_wait_share=0.02)
    hogged = replace(quiet, comm_s=M * 11e-3, cpu_share=0.5, other_cpu_load=0.5, run_queue_wait_share=0.5)
    ((median, _),) = measured_message_s(PipelineWindow(Partition((2, 2)), (hogged, quiet), M))
    assert median == pytest.approx(0.3e-3)
    waiting = replace(hogged, other_cpu_load=0.0)  # its own threads, or another process the monitor cannot see
    ((median, _),) = measured_message_s(PipelineWindow(Partition((2, 2)), (quiet, waiting), M))
    assert median == pytest.approx(0.3e-3)
    noisy = replace(hogged, other_cpu_load=0.1, run_queue_wait_share=0.1)
    ((median, _),) = measured_message_s(PipelineWindow(Partition((2, 2)), (noisy, quiet), M))
    assert median == pytest.approx((11e-3 + 0.3e-3) / 2)
    unread = replace(hogged, cpu_share=0.0)  # a stage without system readings: both sides, as without the rule
    ((median, _),) = measured_message_s(PipelineWindow(Partition((2, 2)), (unread, quiet), M))
    assert median == pytest.approx((11e-3 + 0.3e-3) / 2)


def test_a_hogged_stage_sends_late_and_its_boundary_is_the_lower_sides_reading() -> None:
    """The GPT example after the move off a hogged stage 0: the hogged stage, waiting for gradients most of the step,
    read 0.6 ms per message; stage 1 read 4.5 ms for the activations the hogged stage stamped and then sent when its
    threads got the core. The link had measured 0.2-1.5 ms; re-fitted from 4.5 ms it fell to 23-60 MB/s."""
    M = 4
    quiet = StageTimes(0.178, 0.21, comm_s=M * 4.5e-3, cpu_share=0.98, other_cpu_load=0.0, run_queue_wait_share=0.03)
    hogged = StageTimes(0.121, 0.2, comm_s=M * 0.6e-3, cpu_share=0.42, other_cpu_load=0.59, run_queue_wait_share=0.38)
    ((median, _),) = measured_message_s(PipelineWindow(Partition((2, 4)), (hogged, quiet), M))
    assert median == pytest.approx(0.6e-3)
    link = LinkEstimate(CommModel(latency_s=1.4e-4, bandwidth_Bps=195e6))  # the set-up probe's link
    slow = link.add([(262_144.0, median)]).model()
    assert slow == link.base  # within 1 ms of the probe's: the link is not re-fitted


def test_samples_pair_the_environment_before_with_the_times_after() -> None:
    before = PipelineWindow(
        Partition((2, 2)), (StageTimes(0.024, 0.05, comm_s=0.004), StageTimes(0.048, 0.05, comm_s=0.004)), 4
    )
    after = PipelineWindow(
        Partition((3, 1)), (StageTimes(0.036, 0.04, comm_s=0.004), StageTimes(0.024, 0.04, comm_s=0.004)), 4
    )
    s = samples_from_windows(COST, LINK, before, after)
    assert s.stage_x.shape == (2, len(STAGE_FEATURES)) and len(s) == 2
    # stage 0: 1x the profile before and after, no residual; stage 1: 2x before, 24 ms / 4 / 3 ms = 2x after
    assert s.stage_y[0] == pytest.approx(0.0, abs=1e-12)
    assert s.stage_y[1] == pytest.approx(math.log((0.024 / 4) / (2.0 * 3e-3)))
    assert s.boundary_y.shape == (1,) and np.isfinite(s.boundary_y).all()


def test_a_candidate_of_another_pipeline_is_refused() -> None:
    window = PipelineWindow(Partition((2, 2)), (StageTimes(0.02, 0.05), StageTimes(0.02, 0.05)), 4)
    with pytest.raises(ConfigurationError, match="window.s stage and layer counts"):
        stage_rows(COST, window, Partition((1, 1, 2)))


def test_docstring_examples() -> None:
    import doctest

    import lightning_dynpipe.predictor.features as features

    assert doctest.testmod(features).failed == 0


def test_under_a_cpu_limit_a_stage_needs_at_least_its_cpu_time_over_the_limit() -> None:
    from lightning_dynpipe.predictor.features import effective_compute_s

    # throttled in its waits: 12 ms of compute, but 16 ms of CPU per 80 ms step under a quarter core
    quota = StageTimes(compute_s=0.012, step_s=0.080, cpu_share=0.2, cpu_limit=0.25)
    assert effective_compute_s(quota) == pytest.approx(0.064)
    assert effective_compute_s(StageTimes(compute_s=0.012, step_s=0.080, cpu_share=0.2)) == 0.012
    window = PipelineWindow(Partition((2, 2)), (StageTimes(0.024, 0.08), quota), 4)
    rows = stage_rows(COST, window, Partition((3, 1)))
    # the other stage's prior (3 layers of 3 ms at 1x) sets the pace the limited stage must keep
    assert rows[1, _col("pace_ms")] == pytest.approx(9.0)
    assert rows[1, _col("quota_pressure")] > 0 and rows[0, _col("quota_pressure")] == 0.0


def _clean(balance: tuple[int, ...], fixed_s: float, stretch: float = 1.5, slow: float = 1.0) -> PipelineWindow:
    """A window of COST's layers (3 ms each) measured at ``stretch * (profile + fixed_s)`` per micro-batch, M = 4;
    ``slow`` multiplies stage 0's reading (a window caught by other load)."""
    stages = tuple(
        StageTimes(compute_s=4 * stretch * (n * 3e-3 + fixed_s) * (slow if k == 0 else 1.0), step_s=0.1)
        for k, n in enumerate(balance)
    )
    return PipelineWindow(Partition(balance), stages, 4)


def test_the_fixed_cost_per_micro_batch_is_the_clean_readings_intercept_and_one_slow_window_does_not_move_it() -> None:
    windows = [_clean(b, 0.5e-3) for b in ((1, 3), (2, 2), (3, 1))]
    assert estimate_fixed_s(COST, windows) == pytest.approx(0.5e-3)
    caught = [_clean((1, 3), 0.5e-3, slow=1.5), *windows[1:]]  # one window 50% slow
    assert estimate_fixed_s(COST, caught) == pytest.approx(0.5e-3)
    assert estimate_fixed_s(COST, windows[:1]) == 0.0  # two layer-set sizes cannot tell a line
    below = [_clean(b, 0.0, stretch=1.0) for b in ((1, 3), (2, 2), (3, 1))]
    assert estimate_fixed_s(COST, [replace(w, stages=tuple(replace(t, compute_s=t.compute_s - 2e-3)
                                                            for t in w.stages)) for w in below]) == 0.0  # fmt: skip


def test_a_stage_prior_stretches_its_layers_and_the_fixed_cost_together() -> None:
    """Measured 1.5 x (6 ms + 0.5 ms) on two layers: one layer is 1.5 x (3 ms + 0.5 ms), not half the reading."""
    window = _clean((2, 2), 0.5e-3)
    with_fixed = stage_priors(COST, window, Partition((1, 3)), fixed_s=0.5e-3)
    assert with_fixed == pytest.approx([1.5 * 3.5e-3, 1.5 * 9.5e-3])
    without = stage_priors(COST, window, Partition((1, 3)))
    assert without == pytest.approx([1.5 * 6.5e-3 / 6e-3 * 3e-3, 1.5 * 6.5e-3 / 6e-3 * 9e-3])  # a pure stretch
    rows = stage_rows(COST, window, Partition((1, 3)), fixed_s=0.5e-3)
    assert rows[0, _col("fixed_share")] == pytest.approx(0.5 / 3.5)
    limited = PipelineWindow(window.partition, (replace(window.stages[0], cpu_limit=0.25), window.stages[1]), 4)
    assert stage_priors(COST, limited, Partition((1, 3)), fixed_s=0.5e-3)[0] >= 4.0 * 3.5e-3  # a quarter core


def test_samples_record_the_fixed_cost_they_were_priced_with_and_do_not_mix() -> None:
    a, b = _clean((2, 2), 0.5e-3), _clean((1, 3), 0.5e-3)
    priced = samples_from_windows(COST, LINK, a, b, fixed_s=0.5e-3)
    assert priced.fixed_s == 0.5e-3 and priced.stage_y == pytest.approx([0.0, 0.0])  # the prior is the truth here
    plain = samples_from_windows(COST, LINK, a, b)
    assert plain.fixed_s == 0.0 and abs(plain.stage_y[0]) > 0.05
    assert LabelledSamples.concat([LabelledSamples.empty(), priced]).fixed_s == 0.5e-3  # an empty part has none
    with pytest.raises(ValueError, match="different fixed costs per micro-batch"):
        LabelledSamples.concat([priced, plain])


def test_rows_carry_the_label_of_the_window_their_times_come_from() -> None:
    """Rows paired with one measured window share its noise: they carry its label (the same in every process, from
    what the window measured), whatever window they were priced from; other windows get other labels."""

    def linked(w: PipelineWindow) -> PipelineWindow:  # messages measured too: boundary rows
        return replace(w, stages=tuple(replace(t, comm_s=0.004) for t in w.stages))

    a, b = linked(_clean((2, 2), 0.5e-3)), linked(_clean((1, 3), 0.5e-3))
    from_a, from_b = samples_from_windows(COST, LINK, a, b), samples_from_windows(COST, LINK, b, b)
    assert len(from_a) == 2 and len(from_a.boundary_y) == 1
    assert set(from_a.windows("stage")) == set(from_b.windows("stage")) == {window_label(b)}
    assert set(from_a.windows("boundary")) == {window_label(b)}
    slower = replace(b, stages=tuple(replace(t, compute_s=t.compute_s * 1.01) for t in b.stages))
    assert len({window_label(a), window_label(b), window_label(slower)}) == 3
    both = LabelledSamples.concat([from_a, samples_from_windows(COST, LINK, a, a)])
    assert both.windows("stage").tolist() == [window_label(b)] * 2 + [window_label(a)] * 2
    unknown = LabelledSamples(from_a.stage_x, from_a.stage_y, from_a.boundary_x, from_a.boundary_y)
    assert len(set(unknown.windows("stage"))) == len(unknown)  # each row its own label
    with pytest.raises(ValueError, match="one label per row"):
        LabelledSamples(from_a.stage_x, from_a.stage_y, from_a.boundary_x, from_a.boundary_y, stage_window=[1])
