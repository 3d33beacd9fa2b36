"""CpuHog: pinned busy-loop processes that really burn CPU and never outlive their owner; pinning stages."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from lightning_dynpipe.interference import base as base_module
from lightning_dynpipe.interference.base import ChildProcesses, InterferenceConfigError, InterferenceError
from lightning_dynpipe.interference.cpu import _HOG_CODE, CpuHog, allowed_cores, pin_current_process
from tests.interference.helpers import cpu_shares, gone, wait_gone

CORES = allowed_cores()[:2]


def test_hog_burns_its_pinned_cores_with_the_duty_cycle() -> None:
    with CpuHog(CORES, duty_cycle=1.0) as hog:
        assert len(hog.pids) == len(CORES)
        assert [psutil.Process(p).cpu_affinity() for p in hog.pids] == [[c] for c in CORES]
        full = cpu_shares(hog.pids, 0.5)
    with CpuHog(CORES, duty_cycle=0.3) as hog:
        partial = cpu_shares(hog.pids, 0.5)
    # Other jobs share this machine, so the CPU each hog gets varies; what a hog asks for (on a CPU or waiting
    # for one) does not.
    for cpu, runnable in full:
        assert runnable > 0.85, full
        assert cpu > 0.2, full
    for cpu, runnable in partial:
        assert runnable < 0.6, partial
        assert cpu < 0.45, partial
    assert sum(c for c, _ in partial) < sum(c for c, _ in full)


def test_stop_ends_every_process_and_is_idempotent() -> None:
    hog = CpuHog(CORES, duty_cycle=0.2)
    hog.start()
    hog.start()  # no second set
    pids = hog.pids
    assert len(pids) == len(CORES) and hog.active
    hog.stop()
    assert all(gone(p) for p in pids)
    assert not hog.active and hog.pids == []
    hog.stop()
    hog.start()  # restartable after stop
    again = hog.pids
    hog.stop()
    assert set(again).isdisjoint(pids) and all(gone(p) for p in again)


def test_processes_end_when_the_hog_is_garbage_collected() -> None:
    hog = CpuHog(CORES[:1], duty_cycle=0.2)
    hog.start()
    pids = hog.pids
    del hog
    gc.collect()
    assert all(gone(p) for p in pids)


def test_hog_process_exits_when_its_parent_is_killed() -> None:
    # A parent killed with SIGKILL runs no finaliser: the hog notices its parent is gone and exits by itself.
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, os, signal\n"
            "p = subprocess.Popen([sys.executable, '-c', sys.argv[1], '0', '0.2', '0.05', str(os.getpid())],"
            " stdout=subprocess.PIPE)\n"
            "assert p.stdout.readline().strip() == b'ready'\n"
            "print(p.pid, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n",
            _HOG_CODE,
        ],
        stdout=subprocess.PIPE,
    )
    assert parent.stdout is not None
    hog_pid = int(parent.stdout.readline())
    parent.wait(10)
    assert parent.returncode == -signal.SIGKILL
    assert wait_gone([hog_pid], timeout_s=5.0)


def test_invalid_arguments_state_the_rule() -> None:
    with pytest.raises(InterferenceConfigError, match=r"cores \[99999\] do not exist on this machine") as info:
        CpuHog([99999])
    assert info.value.field == "cores"
    with pytest.raises(InterferenceConfigError, match=r"duty_cycle must be in \(0, 1\]; got 1.5"):
        CpuHog([0], duty_cycle=1.5)
    with pytest.raises(InterferenceConfigError, match="must be distinct"):
        CpuHog([0, 0])
    with pytest.raises(InterferenceConfigError, match="at least one core"):
        CpuHog([])


def test_a_helper_that_fails_to_start_is_reported_with_its_reason() -> None:
    children = ChildProcesses("Probe")
    with pytest.raises(InterferenceError, match="Probe helper process .* failed to start: cannot pin to core 7"):
        children.spawn("import sys; sys.stderr.write('cannot pin to core 7'); sys.exit(3)", [["7"]])
    assert children.procs == []


def test_stop_kills_a_helper_that_ignores_sigterm() -> None:
    children = ChildProcesses("Stubborn", stop_timeout_s=0.3)
    children.spawn(
        "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\ntime.sleep(60)",
        [[]],
    )
    pid = children.pids[0]
    children.stop()
    assert gone(pid)


def test_the_finaliser_runs_at_exit() -> None:
    # weakref.finalize objects run at interpreter exit by default: this is the atexit registration.
    hog = CpuHog(CORES[:1], duty_cycle=0.2)
    hog.start()
    try:
        finalizer = hog._children._finalizer
        assert finalizer is not None and finalizer.alive and finalizer.atexit
        assert finalizer.peek() is not None and finalizer.peek()[1] is base_module._stop_children  # type: ignore[index]
    finally:
        hog.stop()


def test_pin_current_process_pins_every_thread_and_can_be_undone() -> None:
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, daemon=True)
    worker.start()  # already running when the process is pinned
    previous = pin_current_process(CORES[-1:])
    try:
        for tid in os.listdir("/proc/self/task"):
            assert os.sched_getaffinity(int(tid)) == {CORES[-1]}
    finally:
        pin_current_process(previous)
        stop.set()
        worker.join()
    assert allowed_cores() == previous
