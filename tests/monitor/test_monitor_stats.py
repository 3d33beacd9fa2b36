"""Pure tests of monitor/stats.py: samples, rolling medians, replica aggregation, snapshots and their metrics."""

from __future__ import annotations

import ast
import math
import sys
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import Any

import pytest

from lightning_dynpipe.engine.executor import StepStats
from lightning_dynpipe.monitor.stats import (
    METRIC_NAMES,
    REPORT_LENGTH,
    PipelineSnapshot,
    StageReport,
    StageSample,
    StageStatsAccumulator,
    StageSummary,
    SystemReading,
    idle_time,
)

STATS_PY = Path(__file__).resolve().parents[2] / "lightning_dynpipe" / "monitor" / "stats.py"


def _sample(step_s: float = 0.1, **kw: Any) -> StageSample:
    return StageSample(step_s=step_s, **kw)


def _summary(busy_ms: float, step_ms: float = 100.0, count: int = 5, **kw: float | None) -> StageSummary:
    values: dict[str, Any] = dict(
        count=count,
        step_s=step_ms / 1e3,
        forward_s=busy_ms / 2e3,
        backward_s=busy_ms / 2e3,
        optimizer_s=0.0,
        recv_wait_s=0.0,
        send_s=0.0,
        idle_s=0.0,
        comm_s=0.0,
        exposed_comm_s=0.0,
        num_forward=4.0,
        num_backward=4.0,
        num_updates=4.0,
        in_flight=1.0,
        stash_depth=1.0,
        rss_bytes=float(1 << 20),
        cpu_share=0.5,
        steal_share=0.0,
    )
    values.update(kw)
    values.setdefault("compute_s", values["forward_s"] + values["backward_s"] + values["optimizer_s"])
    values.setdefault("busy_s", values["compute_s"] + values["send_s"])
    return StageSummary(**values)


# ---------------------------------------------------------------------------------------------- samples
def test_idle_is_the_rest_of_the_step_and_never_negative() -> None:
    assert idle_time(10.0, 4.0, 3.0, 1.0) == pytest.approx(2.0)
    assert idle_time(10.0, 8.0, 3.0, 1.0) == 0.0  # timer overlap must not make idle negative


def test_from_step_reads_executor_stats_and_system_reading() -> None:
    stats = StepStats(
        forward_s=0.01,
        backward_s=0.02,
        optimizer_s=0.005,
        recv_wait_s=0.03,
        send_s=0.001,
        comm_s=0.004,
        exposed_comm_s=0.002,
        step_s=0.07,
        in_flight=2,
        stash_depth=3,
        max_stash_depth=4,
        num_forward=4,
        num_backward=4,
        num_updates=4,
    )
    system = SystemReading(
        wall_s=0.07,
        cpu_s=0.05,
        cpu_share=0.7,
        steal_share=0.01,
        rss_bytes=123,
        cuda_allocated_bytes=10,
        cuda_reserved_bytes=20,
        gpu_util=0.5,
        gpu_mem_used_bytes=30,
        step_cpu_s=0.06,
    )
    s = StageSample.from_step(stats, system)
    assert (s.step_s, s.forward_s, s.backward_s, s.optimizer_s) == (0.07, 0.01, 0.02, 0.005)
    assert (s.recv_wait_s, s.send_s, s.comm_s, s.exposed_comm_s) == (0.03, 0.001, 0.004, 0.002)
    assert s.compute_s == pytest.approx(0.035)
    assert s.idle_s == pytest.approx(0.07 - 0.035 - 0.03 - 0.001)
    assert (s.in_flight, s.stash_depth) == (2, 3)
    assert (s.num_forward, s.num_backward, s.num_updates) == (4, 4, 4)
    assert (s.rss_bytes, s.cpu_share, s.steal_share) == (123, 0.7, 0.01)
    assert (s.cuda_allocated_bytes, s.cuda_reserved_bytes, s.gpu_util, s.gpu_mem_used_bytes) == (10, 20, 0.5, 30)
    assert s.cpu_s == 0.06  # the step's whole cycle, not the batch's cpu_s


def test_from_step_without_system_reading_leaves_gpu_fields_none() -> None:
    s = StageSample.from_step(StepStats(step_s=0.01, forward_s=0.004))
    assert s.idle_s == pytest.approx(0.006)
    assert s.rss_bytes == 0 and s.cpu_share == 0.0
    assert s.cuda_allocated_bytes is None and s.gpu_util is None and s.gpu_mem_used_bytes is None


def test_sample_is_frozen() -> None:
    with pytest.raises(FrozenInstanceError):
        _sample().step_s = 1.0  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------- accumulator
def test_summary_is_the_median_of_the_window() -> None:
    acc = StageStatsAccumulator(window=5)
    for v in (0.3, 0.1, 0.9, 0.2, 0.5):  # median 0.3; a mean would say 0.4
        acc.add(_sample(step_s=v, forward_s=v / 3, cpu_share=v))
    s = acc.summary()
    assert s.count == 5
    assert s.step_s == pytest.approx(0.3)
    assert s.forward_s == pytest.approx(0.1)
    assert s.cpu_share == pytest.approx(0.3)


def test_compute_and_busy_are_medians_of_per_step_sums() -> None:
    acc = StageStatsAccumulator(window=3)
    acc.add(_sample(step_s=0.10, forward_s=0.01, backward_s=0.09))  # compute 0.10
    acc.add(_sample(step_s=0.10, forward_s=0.09, backward_s=0.01))  # compute 0.10
    acc.add(_sample(step_s=0.10, forward_s=0.05, backward_s=0.02, send_s=0.01))  # compute 0.07, busy 0.08
    s = acc.summary()
    assert s.forward_s + s.backward_s == pytest.approx(0.07)  # the sum of medians...
    assert s.compute_s == pytest.approx(0.10)  # ...is not the median of the sums
    assert s.busy_s == pytest.approx(0.10)
    assert s.compute_s <= s.step_s


def test_counts_per_step_are_medians_over_the_window() -> None:
    acc = StageStatsAccumulator(window=5)
    # async stage 0 with M=4: the first step backwards 3 (one micro-batch still in flight), then 4 each
    for f, b, u in ((4, 3, 3), (4, 4, 4), (4, 4, 4), (4, 4, 4), (4, 5, 5)):
        acc.add(StageSample.from_step(StepStats(step_s=0.01, num_forward=f, num_backward=b, num_updates=u)))
    s = acc.summary()
    assert (s.num_forward, s.num_backward, s.num_updates) == (4.0, 4.0, 4.0)
    empty = StageStatsAccumulator(2).summary()
    assert math.isnan(empty.num_forward) and math.isnan(empty.num_updates)


def test_even_window_median_averages_the_middle_two() -> None:
    acc = StageStatsAccumulator(window=4)
    for v in (1.0, 2.0, 3.0, 10.0):
        acc.add(_sample(step_s=v, in_flight=int(v)))
    assert acc.summary().step_s == pytest.approx(2.5)
    assert acc.summary().in_flight == pytest.approx(2.5)


def test_window_rolls_and_drops_the_oldest() -> None:
    acc = StageStatsAccumulator(window=3)
    for v in range(1, 11):
        acc.add(_sample(step_s=float(v)))
    assert len(acc) == 3 and acc.total == 10
    assert [s.step_s for s in acc.samples] == [8.0, 9.0, 10.0]
    assert acc.summary().step_s == 9.0 and acc.summary().count == 3
    assert acc.last is not None and acc.last.step_s == 10.0


def test_a_spike_does_not_move_the_median() -> None:
    acc = StageStatsAccumulator(window=9)
    for i in range(9):
        acc.add(_sample(step_s=5.0 if i == 4 else 0.1))  # e.g. the step after a validation drain
    assert acc.summary().step_s == pytest.approx(0.1)


def test_the_mean_step_follows_bimodal_steps_and_ignores_one_spike() -> None:
    acc = StageStatsAccumulator(window=20)
    for i in range(20):  # a CPU quota: 8 steps in 20 wait out the rest of a period
        acc.add(_sample(step_s=0.125 if i % 5 in (1, 3) else 0.05))
    s = acc.summary()
    assert s.step_s == pytest.approx(0.05)  # the median follows the majority...
    assert s.mean_step_s == pytest.approx((12 * 0.05 + 7 * 0.125) / 19)  # ...the mean the throughput
    acc.reset()
    for i in range(9):
        acc.add(_sample(step_s=5.0 if i == 4 else 0.1))  # the step after a validation drain
    assert acc.summary().mean_step_s == pytest.approx(0.1)
    assert math.isnan(StageStatsAccumulator(3).summary().mean_step_s)
    few = StageStatsAccumulator(3)
    for v in (0.1, 0.2, 0.6):
        few.add(_sample(step_s=v))
    assert few.summary().mean_step_s == pytest.approx(0.3)  # fewer than four: nothing left out
    both = StageSummary.combine([s, acc.summary()])  # replicas: the slowest one's
    assert both.mean_step_s == pytest.approx(max(s.mean_step_s, acc.summary().mean_step_s))


def test_the_mean_cpu_per_step_leaves_out_the_largest() -> None:
    acc = StageStatsAccumulator(window=5)
    for v in (0.01, 0.02, 0.03, 0.02, 0.5):  # the last step wrote a checkpoint
        acc.add(StageSample(step_s=0.05, cpu_s=v))
    s = acc.summary()
    assert s.mean_cpu_s == pytest.approx(0.02) and s.cpu_s == pytest.approx(0.02)
    report = StageReport.from_vector(StageReport(0, 0, s).to_vector())
    assert report.summary.mean_cpu_s == pytest.approx(0.02)  # it travels in the gather
    m = PipelineSnapshot.from_reports(0, [StageReport(0, 0, s)]).to_metrics()
    assert m["dynpipe/stage0/mean_cpu_ms"] == pytest.approx(20.0)
    assert (
        "dynpipe/stage0/mean_cpu_ms"
        not in PipelineSnapshot.from_reports(0, [StageReport(0, 0, _summary(1.0))]).to_metrics()
    )


def test_reset_forgets_everything() -> None:
    acc = StageStatsAccumulator(window=3)
    acc.add(_sample())
    acc.reset()
    assert len(acc) == 0 and acc.total == 0 and acc.last is None
    empty = acc.summary()
    assert empty.count == 0 and math.isnan(empty.step_s) and empty.gpu_util is None


def test_optional_fields_take_the_median_of_present_values() -> None:
    acc = StageStatsAccumulator(window=4)
    acc.add(_sample(gpu_util=0.2))
    acc.add(_sample(gpu_util=None))
    acc.add(_sample(gpu_util=0.6))
    acc.add(_sample(gpu_util=0.4))
    s = acc.summary()
    assert s.gpu_util == pytest.approx(0.4)
    assert s.cuda_allocated_bytes is None and s.gpu_mem_used_bytes is None


@pytest.mark.parametrize("window", [0, -1, 2.5, True, "3"])
def test_window_must_be_a_positive_int(window: object) -> None:
    with pytest.raises(ValueError, match="window must be a positive number of steps"):
        StageStatsAccumulator(window)  # type: ignore[arg-type]


def test_add_keeps_memory_bounded() -> None:
    acc = StageStatsAccumulator(window=7)
    s = _sample()
    for _ in range(20_000):
        acc.add(s)
    assert len(acc) == 7 and acc.total == 20_000


# ---------------------------------------------------------------------------------------------- summaries
def test_summary_comm_overlap() -> None:
    s = _summary(busy_ms=40.0, comm_s=0.01, exposed_comm_s=0.0025)
    assert s.comm_overlap == pytest.approx(0.75)
    assert _summary(busy_ms=1.0).comm_overlap == 1.0  # no transfers: nothing exposed


def test_combine_takes_the_slowest_replica_and_smallest_count() -> None:
    a = _summary(busy_ms=10.0, step_ms=50.0, count=5, cpu_share=0.9, gpu_util=None)
    b = _summary(busy_ms=30.0, step_ms=40.0, count=3, cpu_share=0.4, gpu_util=0.7)
    c = StageSummary.combine([a, b])
    assert c.count == 3
    assert c.compute_s == pytest.approx(0.03)
    assert c.step_s == pytest.approx(0.05)
    assert c.cpu_share == pytest.approx(0.9)
    assert c.gpu_util == pytest.approx(0.7)
    assert StageSummary.combine([a, _summary(busy_ms=1.0, num_updates=1.0)]).num_updates == 4.0
    assert StageSummary.combine([a]) is a
    with pytest.raises(ValueError, match="at least one"):
        StageSummary.combine([])


def test_combine_keeps_the_tightest_cpu_limit() -> None:
    limited = _summary(busy_ms=10.0, cpu_limit=0.25)
    roomy = _summary(busy_ms=10.0, cpu_limit=1.5)
    free = _summary(busy_ms=10.0)
    assert StageSummary.combine([roomy, limited, free]).cpu_limit == 0.25  # the slowest replica sets the pace
    assert StageSummary.combine([free, free]).cpu_limit is None
    samples = [_sample(cpu_limit=0.5), _sample(cpu_limit=0.5), _sample()]
    assert StageSummary.of(samples).cpu_limit == 0.5  # the median of the samples that had a limit


# ---------------------------------------------------------------------------------------------- snapshots
def _two_stage(busy0: float = 20.0, busy1: float = 35.0) -> PipelineSnapshot:
    return PipelineSnapshot.from_reports(
        step=40,
        reports=[StageReport(0, 1, _summary(busy1, step_ms=40.0)), StageReport(0, 0, _summary(busy0, step_ms=41.0))],
    )


def test_snapshot_orders_stages_and_finds_the_bottleneck() -> None:
    snap = _two_stage()
    assert snap.step == 40 and snap.num_stages == 2 and snap.dp_size == 1
    assert [r.stage_idx for r in snap.replicas] == [0, 1]
    assert snap.stages[0].compute_s == pytest.approx(0.02)
    assert snap.bottleneck_stage == 1
    assert snap.step_s == pytest.approx(0.041)
    assert snap.imbalance == pytest.approx(35.0 / 27.5)
    assert _two_stage(busy0=50.0).bottleneck_stage == 0


def test_bottleneck_counts_send_time_and_breaks_ties_low() -> None:
    s0 = _summary(busy_ms=20.0)
    s1 = _summary(busy_ms=20.0)
    snap = PipelineSnapshot.from_reports(1, [StageReport(0, 0, s0), StageReport(0, 1, s1)])
    assert snap.bottleneck_stage == 0
    snap = PipelineSnapshot.from_reports(1, [StageReport(0, 0, s0), StageReport(0, 1, _summary(20.0, send_s=0.001))])
    assert snap.bottleneck_stage == 1


def test_bottleneck_is_none_without_samples() -> None:
    empty = StageStatsAccumulator(3).summary()
    snap = PipelineSnapshot.from_reports(0, [StageReport(0, 0, empty)])
    assert snap.bottleneck_stage is None
    assert "dynpipe/bottleneck_stage" not in snap.to_metrics()


def test_replicas_are_kept_and_aggregated_per_stage() -> None:
    reports = [
        StageReport(dp_rank=d, stage_idx=k, summary=_summary(busy_ms=10.0 * (k + 1) + d, count=4 + d))
        for d in range(2)
        for k in range(3)
    ]
    snap = PipelineSnapshot.from_reports(7, reversed(reports))
    assert snap.num_stages == 3 and snap.dp_size == 2
    assert [(r.stage_idx, r.dp_rank) for r in snap.replicas] == [(k, d) for k in range(3) for d in range(2)]
    assert snap.replica(1, 2).compute_s == pytest.approx(0.031)
    assert snap.stages[2].compute_s == pytest.approx(0.031)  # the slower replica
    assert snap.stages[2].count == 4
    with pytest.raises(KeyError, match="dp_rank=5"):
        snap.replica(5, 0)


def test_snapshot_refuses_gaps_and_duplicates() -> None:
    with pytest.raises(ValueError, match=r"stages 0..S-1 without gaps; got stages \[0, 2\]"):
        PipelineSnapshot.from_reports(0, [StageReport(0, 0, _summary(1.0)), StageReport(0, 2, _summary(1.0))])
    with pytest.raises(ValueError, match="may report once"):
        PipelineSnapshot.from_reports(0, [StageReport(0, 0, _summary(1.0)), StageReport(0, 0, _summary(1.0))])
    with pytest.raises(ValueError, match="at least one"):
        PipelineSnapshot.from_reports(0, [])


def test_snapshot_records_the_partition_it_describes() -> None:
    reports = [StageReport(0, 0, _summary(1.0)), StageReport(0, 1, _summary(2.0))]
    assert PipelineSnapshot.from_reports(0, reports, balance=[2, 3]).balance == (2, 3)
    assert PipelineSnapshot.from_reports(0, reports).balance is None
    with pytest.raises(ValueError, match="balance has 3 entries but the reports cover 2 stages"):
        PipelineSnapshot.from_reports(0, reports, balance=[1, 1, 3])


def test_to_metrics_keys_units_and_optional_readings() -> None:
    snap = PipelineSnapshot.from_reports(
        3,
        [
            StageReport(
                0,
                0,
                _summary(
                    20.0,
                    step_ms=42.0,
                    recv_wait_s=0.015,
                    idle_s=0.004,
                    exposed_comm_s=0.002,
                    rss_bytes=float(300 << 20),
                    cpu_share=0.8,
                ),
            ),
            StageReport(0, 1, _summary(30.0, cuda_allocated_bytes=float(5 << 20), gpu_util=0.25)),
        ],
    )
    m = snap.to_metrics()
    for k in (0, 1):
        for name in (
            "step_ms",
            "compute_ms",
            "busy_ms",
            "recv_wait_ms",
            "idle_ms",
            "exposed_comm_ms",
            "cpu_share",
            "rss_mb",
            "in_flight",
            "stash_depth",
            "samples",
            "comm_overlap",
        ):
            assert f"dynpipe/stage{k}/{name}" in m
    assert m["dynpipe/stage0/step_ms"] == pytest.approx(42.0)
    assert m["dynpipe/stage0/compute_ms"] == pytest.approx(20.0)
    assert m["dynpipe/stage0/recv_wait_ms"] == pytest.approx(15.0)
    assert m["dynpipe/stage0/idle_ms"] == pytest.approx(4.0)
    assert m["dynpipe/stage0/exposed_comm_ms"] == pytest.approx(2.0)
    assert m["dynpipe/stage0/cpu_share"] == pytest.approx(0.8)
    assert m["dynpipe/stage0/rss_mb"] == pytest.approx(300.0)
    assert m["dynpipe/stage0/samples"] == 5.0
    assert "dynpipe/stage0/gpu_util" not in m and "dynpipe/stage0/cuda_allocated_mb" not in m
    assert m["dynpipe/stage1/gpu_util"] == pytest.approx(0.25)
    assert m["dynpipe/stage1/cuda_allocated_mb"] == pytest.approx(5.0)
    assert m["dynpipe/bottleneck_stage"] == 1.0
    assert m["dynpipe/step_ms"] == pytest.approx(100.0)
    assert "dynpipe/imbalance" in m
    assert all(isinstance(v, float) for v in m.values())
    names = {key.split("/")[-1] for key in m if key.startswith("dynpipe/stage")}
    assert names <= set(METRIC_NAMES)
    assert "dynpipe/stage0/mean_step_ms" not in m  # built without a mean: not reported as 0 ms
    acc = StageStatsAccumulator(window=4)
    for v in (0.01, 0.01, 0.04, 0.01):
        acc.add(_sample(step_s=v))
    one = PipelineSnapshot.from_reports(0, [StageReport(0, 0, acc.summary())]).to_metrics()
    assert one["dynpipe/stage0/step_ms"] == pytest.approx(10.0) and one["dynpipe/stage0/mean_step_ms"] == pytest.approx(
        10.0
    )


def test_to_metrics_prefix_and_per_replica_keys() -> None:
    snap = PipelineSnapshot.from_reports(0, [StageReport(d, k, _summary(10.0)) for d in range(2) for k in range(2)])
    m = snap.to_metrics("pipe", per_replica=True)
    assert "pipe/stage1/replica1/step_ms" in m and "pipe/stage0/replica0/busy_ms" in m
    assert not any(key.startswith("dynpipe/") for key in m)
    assert "dynpipe/stage0/replica0/step_ms" not in _two_stage().to_metrics()


def test_table_has_one_row_per_stage_and_marks_the_bottleneck() -> None:
    text = _two_stage().table()
    lines = text.splitlines()
    assert "step 40" in lines[0] and "balance" not in lines[0]  # the partition is unknown
    assert len(lines) == 4
    assert lines[3].split()[0] == "1*" and lines[2].split()[0] == "0"


def test_table_shows_counts_per_step_and_the_balance() -> None:
    reports = [
        StageReport(0, 0, _summary(20.0, num_backward=3.5)),
        StageReport(0, 1, _summary(35.0, num_forward=8.0, num_backward=8.0, num_updates=1.0)),
    ]
    lines = PipelineSnapshot.from_reports(12, reports, balance=[3, 4]).table().splitlines()
    assert lines[0].startswith("DynPipe stages at step 12, balance [3, 4] (")
    header = [h.strip() for h in lines[1].split("  ") if h.strip()]
    rows = [dict(zip(header, line.split())) for line in lines[2:]]
    assert len(header) == len(lines[2].split()) == len(lines[3].split())
    assert [r["F/B/U"] for r in rows] == ["4/3.5/4", "8/8/1"]
    assert [r["stage"] for r in rows] == ["0", "1*"]
    assert rows[1]["step"] == "100.0" and rows[1]["n"] == "5"


def test_report_travels_as_a_fixed_vector_of_floats() -> None:
    full = StageReport(
        1,
        2,
        _summary(
            12.0,
            cuda_allocated_bytes=5.0,
            cuda_reserved_bytes=6.0,
            gpu_util=0.5,
            gpu_mem_used_bytes=7.0,
            num_forward=8.0,
            num_backward=7.5,
            num_updates=1.0,
            cpu_limit=0.25,
        ),
    )
    bare = StageReport(0, 0, _summary(3.0))
    empty = StageReport(0, 1, StageStatsAccumulator(2).summary())
    for report in (full, bare):
        vector = report.to_vector()
        assert len(vector) == REPORT_LENGTH and all(isinstance(v, float) for v in vector)
        assert StageReport.from_vector(vector) == report
    back = StageReport.from_vector(empty.to_vector())
    assert back.summary.count == 0 and math.isnan(back.summary.step_s) and back.summary.gpu_util is None
    with pytest.raises(ValueError, match=f"has {REPORT_LENGTH} entries; got 3"):
        StageReport.from_vector([0.0, 0.0, 1.0])


def test_snapshot_is_picklable() -> None:  # it crosses processes in all_gather_object
    import pickle

    snap = _two_stage()
    assert pickle.loads(pickle.dumps(snap)) == snap


# ---------------------------------------------------------------------------------------------- purity
def test_stats_module_imports_only_the_standard_library() -> None:
    """ARCHITECTURE.md: monitor/stats.py is pure, so the policy and its tests need neither torch nor Lightning."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(STATS_PY.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    assert names <= set(sys.stdlib_module_names), sorted(names - set(sys.stdlib_module_names))


def test_a_reports_token_travels_and_the_snapshot_agrees_on_the_smallest() -> None:
    reports = [StageReport(0, k, _summary(3.0), token=t) for k, t in ((0, 2.0), (1, 1.0))]
    back = [StageReport.from_vector(r.to_vector()) for r in reports]
    assert [r.token for r in back] == [2.0, 1.0]
    assert PipelineSnapshot.from_reports(10, back).agreed_token == 1.0
