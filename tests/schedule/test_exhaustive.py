"""Exhaustive proof: every schedule, every S in 1..16 and M in 1..64 runs 2 steps and a drain without deadlock.

validate_schedule checks far more than deadlock freedom (matched transfers, staleness and stash rules, an empty
pipeline after the drain), so this also proves those rules over the whole grid.
"""

from __future__ import annotations

import time

import pytest

from lightning_dynpipe.schedule import SCHEDULES, simulate, validate_schedule

BUDGET_S = 60.0


def test_every_schedule_is_deadlock_free(capsys: pytest.CaptureFixture[str]) -> None:
    t0, cpu0 = time.perf_counter(), time.process_time()
    count = 0
    for kind in SCHEDULES:
        for num_stages in range(1, 17):
            for num_microbatches in range(1, 65):
                validate_schedule(kind, num_stages, num_microbatches, num_steps=2)
                count += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    with capsys.disabled():
        print(f"\n[schedule] validated {count} schedules (2 steps + drain): {cpu:.2f} s CPU, {wall:.2f} s wall")
    assert count == 3 * 16 * 64
    # CPU time, because the wall clock of a shared machine measures the neighbours as well
    assert cpu < BUDGET_S, f"exhaustive validation took {cpu:.1f} s of CPU; optimise the simulator"


def test_lightning_broadcast_never_deadlocks() -> None:
    """With the per-step broadcast from the last stage (timed simulation, comm included)."""
    for kind in SCHEDULES:
        for num_stages in (1, 2, 3, 4, 7, 16):
            for num_microbatches in (1, 2, 3, 5, 16):
                r = simulate(kind, num_stages, num_microbatches, 3, comm_time=0.25, step_sync="last_stage_broadcast")
                assert all(len(ends) == 3 for ends in r.step_end_times)


def test_deeper_async_is_deadlock_free_and_keeps_its_rules() -> None:
    """``async+d`` forwards ``(S-1-k)(1+d)`` micro-batches ahead: more than a step's ``M`` for small ``M``, so the
    steps carry micro-batches over and the drain finishes them; validation checks its staleness and stash rules
    (at most ``w + 1`` versions) on the whole grid, with and without the per-step broadcast."""
    count = 0
    for kind in ("async+1", "async+2", "async+5"):
        for num_stages in range(1, 9):
            for num_microbatches in range(1, 33):
                validate_schedule(kind, num_stages, num_microbatches, num_steps=3)
                count += 1
        for num_stages in (2, 3, 5):
            for num_microbatches in (1, 2, 4, 7):
                r = simulate(kind, num_stages, num_microbatches, 4, comm_time=0.25, step_sync="last_stage_broadcast")
                assert all(len(ends) == 4 for ends in r.step_end_times)
                # w + 1 distinct versions once the pipeline is full (the warm-up's w + 1 forwards share version 0)
                depth = [(num_stages - 1 - k) * (1 + int(kind[6:])) for k in range(num_stages)]
                n = 4 * num_microbatches
                assert list(r.stash_peaks) == [min(w + 1, max(n - w, 1)) if w else 0 for w in depth]
    assert count == 3 * 8 * 32
