"""Simulator: hand-checked step times and bubbles, rule checks, deadlock detection, Chrome trace."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from lightning_dynpipe.errors import ScheduleError
from lightning_dynpipe.schedule import (
    ASYNC,
    GPIPE,
    SCHEDULES,
    SYNC,
    OptimizerStep,
    Schedule,
    ScheduleDeadlockError,
    SimResult,
    instructions,
    max_stash,
    parse_instructions,
    simulate,
    simulate_programs,
    step_instructions,
    validate_schedule,
)

p = parse_instructions


# --- step times worked out by hand (F=1, B=2, no comm) --------------------------------------------------


def test_sync_two_stages_four_microbatches() -> None:
    # Stage 0: F0 [0,1] F1 [1,2] B0 [4,6] F2 [6,7] B1 [7,9] F3 [9,10] B2 [10,12] B3 [13,15]
    # Stage 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7] F2 [7,8] B2 [8,10] F3 [10,11] B3 [11,13]
    # => a step is (M + S - 1) * (F + B) = 5 * 3 = 15; the next step restarts from the flush.
    r = simulate("sync", 2, 4, 3, forward_time=1.0, backward_time=2.0)
    assert r.step_end_times == ((15.0, 30.0, 45.0), (13.0, 28.0, 43.0))
    assert r.steady_state_step_time == 15.0
    assert r.makespan == 45.0
    assert r.busy_times == (36.0, 36.0)
    assert r.bubble_fraction == pytest.approx((0.2, 0.2))
    assert r.utilisation == pytest.approx(0.8)
    assert r.throughput() == pytest.approx(4 / 15)
    assert r.throughput(microbatch_size=8) == pytest.approx(32 / 15)
    ev0 = [(e.instruction, e.start, e.end) for e in r.events[0] if e.instruction[0] in "FB"][:8]
    assert ev0 == [
        ("F0", 0, 1), ("F1", 1, 2), ("B0", 4, 6), ("F2", 6, 7),
        ("B1", 7, 9), ("F3", 9, 10), ("B2", 10, 12), ("B3", 13, 15),
    ]  # fmt: skip


def test_async_two_stages_with_lightning_broadcast() -> None:
    # Step 0: stage 0 F0 [0,1] F1 [1,2] B0 [4,6] F2 [6,7] B1 [7,9] F3 [9,10] B2 [10,12]; the last stage
    # F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7] F2 [7,8] B2 [8,10] F3 [10,11]: it ends its step at 11, after the
    # forward of F3, and opens step 1 with B3 [11,13]. The broadcast lets stage 0 start step 1 at 11, but it
    # is busy until 12: F4 [12,13] B3 [13,15] F5 [15,16] B4 [16,18] F6 [18,19] B5 [19,21] F7 [21,22] B6 [22,24];
    # the last stage F4 [13,14] B4 [14,16] F5 [16,17] B5 [17,19] F6 [19,20] B6 [20,22] F7 [22,23].
    # => steady steps of 12 = M * (F + B): the broadcast costs nothing, because both stages end a step
    # at the same point of the endless 1F1B sequence.
    r = simulate("async", 2, 4, 4, forward_time=1.0, backward_time=2.0, step_sync="last_stage_broadcast")
    assert r.step_end_times[1] == (11.0, 23.0, 35.0, 47.0)
    assert r.step_end_times[0] == (12.0, 24.0, 36.0, 48.0)
    assert r.steady_state_step_time == 12.0
    first_f4 = next(e for e in r.events[0] if e.instruction == "F4")
    assert (first_f4.start, first_f4.end) == (12.0, 13.0)


def test_async_two_stages_without_broadcast_is_pure_1f1b() -> None:
    # Without the broadcast nothing flushes: M * (F + B) = 12 per step in steady state, the same timeline.
    r = simulate("async", 2, 4, 4, forward_time=1.0, backward_time=2.0)
    assert r.steady_state_step_time == 12.0
    assert r.step_end_times[1] == (11.0, 23.0, 35.0, 47.0)


def test_async_last_stage_cut_after_a_forward_saves_the_broadcast_wait() -> None:
    # The old cut (the last stage backwarding all of its batch in the step) made stage 0 wait for the last
    # stage's final backward before step t+1, and the last stage then wait for stage 0's first forward: one
    # forward of idle time per step, 13 instead of 12 with F=1, B=2, M=4. Rebuilt here from the same blocks.
    from lightning_dynpipe.schedule.kinds import _backward_block, _forward_block

    def old_last(t: int) -> str:
        out = []
        for j in range(4 * t, 4 * t + 4):
            out += [*_forward_block(j, False, True, False), *_backward_block(j, False, True, True)]
        return " ".join(str(i) for i in out)

    programs = [
        [step_instructions("async", 0, 2, 4, t) for t in range(4)],
        [p(old_last(t)) for t in range(4)],
    ]
    drains = [ASYNC.drain_instructions(0, 2, 4, 4), []]
    old = simulate_programs(
        programs, drains=drains, forward_time=1.0, backward_time=2.0, step_sync="last_stage_broadcast"
    )
    new = simulate("async", 2, 4, 4, forward_time=1.0, backward_time=2.0, step_sync="last_stage_broadcast")
    assert (old.steady_state_step_time, new.steady_state_step_time) == (13.0, 12.0)


def test_gpipe_two_stages() -> None:
    # Stage 0: F0..F3 [0,4]; stage 1: F0..F3 [1,5], B0..B3 [5,13]; stage 0: B0..B3 [7,15].
    r = simulate("gpipe", 2, 4, 3, forward_time=1.0, backward_time=2.0, step_sync="last_stage_broadcast")
    assert r.step_end_times == ((15.0, 30.0, 45.0), (13.0, 28.0, 43.0))
    assert r.steady_state_step_time == 15.0


def test_kinds_compared_with_broadcast() -> None:
    times = {
        kind: simulate(
            kind, 2, 4, 6, forward_time=1.0, backward_time=2.0, step_sync="last_stage_broadcast"
        ).steady_state_step_time
        for kind in SCHEDULES
    }
    assert times == {"async": 12.0, "sync": 15.0, "gpipe": 15.0}


def test_broadcast_changes_nothing_for_flushing_schedules() -> None:
    for kind in ("sync", "gpipe"):
        a = simulate(kind, 4, 6, 3, step_sync="none")  # type: ignore[arg-type]
        b = simulate(kind, 4, 6, 3, step_sync="last_stage_broadcast")  # type: ignore[arg-type]
        assert a.step_end_times == b.step_end_times


def test_comm_time() -> None:
    # sync, S=2, M=1, comm 0.5: F0 [0,1] -> arrives 1.5; F0 [1.5,2.5] B0 [2.5,4.5] -> arrives 5; B0 [5,7].
    r = simulate("sync", 2, 1, 2, forward_time=1.0, backward_time=2.0, comm_time=0.5)
    assert r.step_end_times == ((7.0, 14.0), (4.5, 11.5))
    rg0 = next(e for e in r.events[0] if e.instruction == "RG0")
    assert (rg0.start, rg0.end) == (1.0, 5.0)  # a receive's event is its wait
    assert simulate("sync", 3, 1, 1, comm_time=[0.5, 0.25]).makespan == pytest.approx(3 * 1 + 3 * 2 + 2 * 0.75)


def test_slowdown_and_per_stage_times() -> None:
    # gpipe, S=2, M=2, stage 0 twice as slow: F0 [0,2] F1 [2,4]; stage 1: F0 [2,3] F1 [4,5] B0 [5,7]
    # B1 [7,9]; stage 0: B0 [7,11] B1 [11,15].
    r = simulate("gpipe", 2, 2, 1, forward_time=1.0, backward_time=2.0, slowdown=[2.0, 1.0])
    assert r.step_end_times == ((15.0,), (9.0,))
    assert r.busy_times == (12.0, 6.0)
    assert r.bubble_fraction == pytest.approx((0.2, 0.6))
    assert r.utilisation == pytest.approx(0.6)
    same = simulate("gpipe", 2, 2, 1, forward_time=[2.0, 1.0], backward_time=[4.0, 2.0])
    assert same.step_end_times == r.step_end_times


def test_send_overhead_keeps_the_sender_busy_before_the_transfer() -> None:
    # F=1, B=2, send 0.5, no comm: stage 0 F0 [0,1] SA0 [1,1.5]; stage 1 F0 [1.5,2.5] B0 [2.5,4.5]
    # SG0 [4.5,5]; stage 0 waits for the gradient until 5, B0 [5,7].
    r = simulate_programs([[p("F0 SA0 RG0 B0")], [p("RA0 F0 B0 SG0")]], send_overhead=0.5)
    assert r.makespan == 7.0
    assert r.busy_times == (3.5, 3.5)
    sa0 = next(e for e in r.events[0] if e.instruction == "SA0")
    assert (sa0.start, sa0.end) == (1.0, 1.5)
    # with comm 0.25 the transfer starts when the send ends: F0 on stage 1 at 1.75, gradient back at 5.5
    assert (
        simulate_programs(
            [[p("F0 SA0 RG0 B0")], [p("RA0 F0 B0 SG0")]], send_overhead=[0.5, 0.5], comm_time=0.25
        ).makespan
        == 7.5
    )
    assert simulate_programs([[p("F0 SA0 RG0 B0")], [p("RA0 F0 B0 SG0")]]).makespan == 6.0  # the default: 0


def test_step_overhead_runs_after_the_gate_at_every_step() -> None:
    # F=1, overhead [0.5, 0.25], Lightning's broadcast: stage 0 H0 [0,0.5] F0 [0.5,1.5]; stage 1 H0 [0,0.25]
    # waits until 1.5, F0 [1.5,2.5]; stage 0 waits for stage 1's step 0 (2.5), H1 [2.5,3] F1 [3,4];
    # stage 1 H1 [2.5,2.75], F1 [4,5].
    r = simulate_programs(
        [[p("F0 SA0"), p("F1 SA1")], [p("RA0 F0"), p("RA1 F1")]],
        step_overhead=[0.5, 0.25],
        step_sync="last_stage_broadcast",
    )
    assert r.step_end_times == ((1.5, 4.0), (2.5, 5.0))
    assert r.busy_times == (3.0, 2.5)
    assert [(e.instruction, e.start, e.end) for e in r.events[0] if e.instruction.startswith("H")] == [
        ("H0", 0.0, 0.5),
        ("H1", 2.5, 3.0),
    ]
    assert {ev["cat"] for ev in r.to_chrome_trace()["traceEvents"] if ev["name"].startswith("H")} == {"host"}
    # one stage, M=2: every step is F F B B (F=1, B=2) plus the overhead
    assert simulate("gpipe", 1, 2, 3, step_overhead=0.5).steady_state_step_time == 6.5
    with pytest.raises(ScheduleError, match="step_overhead must be one number or one per stage"):
        simulate("async", 2, 2, 2, step_overhead=[0.1])
    with pytest.raises(ScheduleError, match="send_overhead must be finite and >= 0"):
        simulate("async", 2, 2, 2, send_overhead=-1.0)


def test_update_time_counts_as_busy() -> None:
    r = simulate("async", 1, 2, 2, forward_time=1.0, backward_time=2.0, update_time=0.5)
    assert r.step_end_times == ((7.0, 14.0),)
    assert r.busy_times == (14.0,)
    assert r.bubble_fraction == (0.0,)


def test_single_step_steady_state_is_the_step() -> None:
    # measured on the last stage, which ends the first step at 13 (stage 0 at 15)
    assert simulate("sync", 2, 4, 1).steady_state_step_time == 13.0


def test_zero_durations() -> None:
    r = simulate("async", 3, 2, 2, forward_time=0.0, backward_time=0.0)
    assert r.makespan == 0.0 and r.bubble_fraction == (0.0, 0.0, 0.0) and r.utilisation == 1.0
    assert r.throughput() == float("inf")


# --- rule checks ---------------------------------------------------------------------------------------


def _peak(w: int, n: int) -> int:
    """Distinct weight versions stage with staleness w holds at most, after n forwards (by hand)."""
    if w == 0:
        return 0
    if n - 1 >= 2 * w:
        return w + 1
    return n - w if n - 1 >= w else 1


@pytest.mark.parametrize("S", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("M,T", [(1, 1), (1, 3), (2, 2), (3, 4), (8, 2)])
def test_stash_peaks(S: int, M: int, T: int) -> None:
    r = simulate("async", S, M, T)
    for k in range(S):
        assert r.stash_peaks[k] == _peak(S - 1 - k, M * T)
        assert r.stash_peaks[k] <= max_stash("async", k, S)
    for kind in ("sync", "gpipe"):
        assert simulate(kind, S, M, T).stash_peaks == (0,) * S  # type: ignore[arg-type]


def test_drain_at_end_false_leaves_work_in_flight() -> None:
    r = simulate("async", 4, 2, 2, drain_at_end=False)
    done = simulate("async", 4, 2, 2)
    assert r.step_end_times == done.step_end_times
    assert r.makespan < done.makespan
    assert sum(e.instruction.startswith("B") for e in r.events[0]) == 4 - 3


def test_deadlock_is_detected_and_explained() -> None:
    # Stage 0 waits for the gradient of micro-batch 0 before it has sent the activation.
    programs = [[p("RG0 F0 SA0 B0")], [p("RA0 F0 B0 SG0")]]
    with pytest.raises(ScheduleDeadlockError) as info:
        simulate_programs(programs)
    msg = str(info.value)
    assert "The schedule deadlocks" in msg
    assert "stage 0 blocked at instruction #0 'RG0' waiting for 'SG0' from stage 1" in msg
    assert "stage 1 blocked at instruction #0 'RA0' waiting for 'SA0' from stage 0" in msg
    assert isinstance(info.value, ScheduleError) and isinstance(info.value, ValueError)
    # the repaired order runs
    assert simulate_programs([[p("F0 SA0 RG0 B0")], [p("RA0 F0 B0 SG0")]]).makespan == 6.0


def test_deadlock_through_the_lightning_broadcast() -> None:
    # The last stage's step 0 needs micro-batch 1, which stage 0 only forwards in its step 1: fine without
    # a per-step barrier, a deadlock with one (stage 0 waits for the last stage to finish step 0).
    programs = [[p("F0 SA0"), p("F1 SA1")], [p("RA0 F0 RA1 F1"), p("B0 B1")]]
    assert simulate_programs(programs).makespan == 7.0
    with pytest.raises(ScheduleDeadlockError) as info:
        simulate_programs(programs, step_sync="last_stage_broadcast")
    msg = str(info.value)
    assert "stage 0 waits before step 1 for the last stage to finish step 0" in msg
    assert "stage 1 blocked at instruction #2 'RA1' waiting for 'SA1' from stage 0" in msg


def _variant(base: Schedule, edit: Any) -> Schedule:
    """``base`` with each step program passed through ``edit(stage_idx, program)``: a schedule broken on purpose."""

    class Edited(type(base)):  # type: ignore[misc]
        def _step(self, k: int, S: int, M: int, t: int) -> Any:
            return tuple(edit(k, list(super()._step(k, S, M, t))))

    return Edited()


def test_generated_schedule_broken_on_purpose() -> None:
    """A gpipe variant whose stage 0 waits for gradients before sending its last activation deadlocks."""

    def late_send(k: int, prog: list[Any]) -> list[Any]:
        if k == 0:  # move SA of the step's last micro-batch after the backwards
            last_send = max(i for i, inst in enumerate(prog) if str(inst).startswith("SA"))
            prog.insert(len(prog) - 1, prog.pop(last_send))
        return prog

    with pytest.raises(ScheduleDeadlockError, match=r"stage 0 blocked at instruction #\d+ 'RG0' waiting for 'SG0'"):
        validate_schedule(_variant(GPIPE, late_send), 3, 2, num_steps=1)


def test_async_staleness_rule_is_checked() -> None:
    def no_updates_on_stage_0(k: int, prog: list[Any]) -> list[Any]:
        return [i for i in prog if not (k == 0 and isinstance(i, OptimizerStep))]

    with pytest.raises(
        ScheduleError,
        match=re.escape(
            "async staleness rule broken: stage 0 (staleness w=1) must forward micro-batch 2 after exactly "
            "max(0, 2 - 1) = 1 updates, but it has run 0."
        ),
    ):
        simulate(_variant(ASYNC, no_updates_on_stage_0), 2, 2, 2)
    with pytest.raises(
        ScheduleError, match=r"sync rule broken: stage 0 must forward micro-batch 2 after exactly 2 // 2 = 1"
    ):
        simulate(_variant(SYNC, no_updates_on_stage_0), 2, 2, 2)


def test_stash_bound_is_checked() -> None:
    # stage 0 of 2 may keep 2 versions; a third distinct version bound to an in-flight micro-batch breaks it.
    with pytest.raises(
        ScheduleError,
        match=r"Stash bound broken: stage 0 of 2 may keep at most 2 weight versions, "
        r"but binding micro-batch 2 \(instruction #6\) makes 3",
    ):
        simulate_programs([[p("W0 F0 U W1 F1 U W2 F2")], [[]]])
    with pytest.raises(ScheduleError, match="stashes weights for micro-batch 0 twice"):
        simulate_programs([[p("W0 W0 F0")]])


def test_backward_needs_forward() -> None:
    with pytest.raises(
        ScheduleError, match=r"Stage 0 backwards micro-batch 0 \(instruction #0\) without a pending forward"
    ):
        simulate_programs([[p("B0 F0")]])
    with pytest.raises(ScheduleError, match="forwards micro-batch 0 twice"):
        simulate_programs([[p("F0 F0")]])


def test_unmatched_transfers() -> None:
    with pytest.raises(
        ScheduleError,
        match=r"Unmatched activation transfer: .*stage 1 receives \(RA\) micro-batches \[1\] that stage 0 never sends",
    ):
        simulate_programs([[p("F0 SA0 F1")], [p("RA0 F0 RA1 F1")]])
    with pytest.raises(ScheduleError, match=r"stage 0 sends \(SA\) micro-batches \[1\] that stage 1 never receives"):
        simulate_programs([[p("F0 SA0 F1 SA1")], [p("RA0 F0")]])
    with pytest.raises(ScheduleError, match=r"stage 1 sends \(SG\) micro-batches \[0\] more than once"):
        simulate_programs([[p("F0 SA0 RG0 B0")], [p("RA0 F0 B0 SG0 SG0")]])
    with pytest.raises(ScheduleError, match=r"Stage 0 of 1 has no next stage, but it runs SA for micro-batches \[0\]"):
        simulate_programs([[p("F0 SA0")]])
    with pytest.raises(
        ScheduleError, match=r"Stage 0 of 2 has no previous stage, but it runs RA for micro-batches \[0\]"
    ):
        simulate_programs([[p("RA0 F0")], [[]]])
    with pytest.raises(ScheduleError, match=r"Stage 0 of 1 has no previous stage, but it runs SG"):
        simulate_programs([[p("F0 B0 SG0")]])


def test_argument_errors() -> None:
    with pytest.raises(ScheduleError, match="Unknown schedule 'zb'. Valid schedules: 'async', 'sync', 'gpipe'"):
        simulate("zb", 2, 2, 1)  # type: ignore[arg-type]
    with pytest.raises(
        ScheduleError, match="Unknown step_sync 'barrier'. Valid options: 'none', 'last_stage_broadcast'"
    ):
        simulate("async", 2, 2, 1, step_sync="barrier")  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match=r"num_steps must be a positive int; got num_steps=0"):
        simulate("async", 2, 2, 0)
    with pytest.raises(ScheduleError, match=r"num_stages must be a positive int; got num_stages=0"):
        simulate("async", 0, 2, 1)
    with pytest.raises(ScheduleError, match=r"num_microbatches must be a positive int"):
        validate_schedule("sync", 2, 0)
    with pytest.raises(ScheduleError, match=r"forward_time must be one number or one per stage \(3\); got 2 values"):
        simulate("async", 3, 2, 1, forward_time=[1.0, 2.0])
    with pytest.raises(
        ScheduleError, match=r"comm_time must be one number or one per stage boundary \(num_stages - 1\) \(2\)"
    ):
        simulate("async", 3, 2, 1, comm_time=[1.0, 2.0, 3.0])
    with pytest.raises(ScheduleError, match=r"backward_time must be finite and >= 0"):
        simulate("async", 2, 2, 1, backward_time=-1.0)
    with pytest.raises(ScheduleError, match=r"slowdown must be finite and > 0"):
        simulate("async", 2, 2, 1, slowdown=[1.0, 0.0])
    with pytest.raises(
        ScheduleError, match=r"Every stage must run the same number of steps; stage 0 has 1 and stage 1 has 2"
    ):
        simulate_programs([[p("F0")], [p("F0"), p("F1")]])
    with pytest.raises(ScheduleError, match="not an instruction"):
        simulate_programs([[["F0"]]])  # type: ignore[list-item]


# --- outputs -------------------------------------------------------------------------------------------


def _check_trace(trace: dict[str, Any], r: SimResult) -> None:
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    meta = [e for e in events if e["ph"] == "M"]
    assert len(complete) == sum(len(ev) for ev in r.events)
    assert {e["pid"] for e in events} == {0}
    assert {e["tid"] for e in complete} == set(range(r.num_stages))
    assert sorted(e["args"]["name"] for e in meta if e["name"] == "thread_name") == [
        f"stage {k}" for k in range(r.num_stages)
    ]
    for e in complete:
        assert set(e) >= {"name", "cat", "ph", "ts", "dur", "pid", "tid"}
        assert e["dur"] >= 0 and e["ts"] >= 0
        assert e["cat"] in {"compute", "comm", "stash"}
    f0 = next(e for e in complete if e["name"] == "F0" and e["tid"] == 1)
    assert (f0["ts"], f0["dur"], f0["cat"], f0["args"]["mb_idx"]) == (1000.0, 1000.0, "compute", 0)
    u = next(e for e in complete if e["name"] == "U")
    assert u["args"]["mb_idx"] is None


def test_chrome_trace(tmp_path: Path) -> None:
    r = simulate("sync", 3, 2, 2)
    trace = r.to_chrome_trace()
    _check_trace(trace, r)
    assert trace["otherData"]["num_stages"] == 3
    assert r.to_chrome_trace(us_per_unit=1.0)["traceEvents"][-1]["ts"] == trace["traceEvents"][-1]["ts"] / 1000
    path = tmp_path / "trace.json"
    r.write_chrome_trace(path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace))


def test_events_are_ordered_and_cover_every_instruction() -> None:
    r = simulate("async", 3, 4, 2, comm_time=0.3, step_sync="last_stage_broadcast")
    for k in range(3):
        names = [e.instruction for e in r.events[k]]
        expected = [str(i) for t in range(2) for i in step_instructions("async", k, 3, 4, t)]
        assert names[: len(expected)] == expected
        for a, b in zip(r.events[k], r.events[k][1:]):
            assert a.start <= a.end <= b.start
        assert r.finish_times[k] == r.events[k][-1].end


def _render_compute_timeline(r: SimResult, width: int) -> list[str]:
    rows = []
    for k, events in enumerate(r.events):
        slot = {int(e.start): e.instruction for e in events if e.instruction[0] in "FB"}
        boundary = int(r.step_end_times[k][0])
        cells = "".join((("|" if t == boundary else " ") if t else "") + f"{slot.get(t, '.'):<2}" for t in range(width))
        rows.append(f"stage {k}  {cells} ...")
    return rows


def test_docstring_timeline_matches_simulation() -> None:
    """The ASCII timeline in instructions.py is what the simulator produces (S=3, M=4, F=B=1)."""
    doc = instructions.__doc__ or ""
    drawn = [line.strip() for line in doc.splitlines() if line.strip().startswith("stage ")]
    r = simulate("async", 3, 4, 3, forward_time=1.0, backward_time=1.0)
    assert drawn == _render_compute_timeline(r, 14)


def test_timeline_plot_draws_sends_and_step_overhead(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from lightning_dynpipe.schedule.plot import plot_timeline

    r = simulate("async", 2, 4, 3, step_overhead=0.5, send_overhead=0.2, step_sync="last_stage_broadcast")
    path = tmp_path / "timeline.png"
    plot_timeline(r, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
