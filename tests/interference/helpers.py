"""Measuring what interference does to processes: CPU share and run-queue demand over a short window."""

from __future__ import annotations

import time
from collections.abc import Sequence

import psutil


def _schedstat(pid: int) -> float:
    """Seconds ``pid`` was on a CPU or waiting for one (runnable), all threads, from ``/proc/<pid>/schedstat``."""
    with open(f"/proc/{pid}/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return (int(on_cpu) + int(waiting)) / 1e9


def cpu_shares(pids: Sequence[int], seconds: float) -> list[tuple[float, float]]:
    """``(cpu_share, runnable_share)`` of each process over ``seconds`` of wall time.

    ``cpu_share`` is CPU time over wall time (psutil). ``runnable_share`` also counts the time spent waiting for
    a CPU, so it shows what a process asked for even when other jobs on this shared machine compete for the
    cores (only the main thread is counted, which is all a busy loop has).
    """
    procs = [psutil.Process(p) for p in pids]
    cpu0 = [sum(p.cpu_times()[:2]) for p in procs]
    run0 = [_schedstat(p) for p in pids]
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    cpu1 = [sum(p.cpu_times()[:2]) for p in procs]
    run1 = [_schedstat(p) for p in pids]
    return [((c1 - c0) / wall, (r1 - r0) / wall) for c0, c1, r0, r1 in zip(cpu0, cpu1, run0, run1)]


def gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (absent, or a zombie waiting for a parent that is not us)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: Sequence[int], timeout_s: float = 5.0) -> bool:
    """Waits until every pid is gone; whether they all went in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.02)
    return all(gone(p) for p in pids)
