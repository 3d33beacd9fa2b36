"""CpuQuota (cgroup), CpuThrottle (SIGSTOP/SIGCONT) and CpuLimit hold a busy process to about its CPU share."""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import psutil
import pytest

from lightning_dynpipe.interference import quota as quota_module
from lightning_dynpipe.interference.base import InterferenceConfigError, InterferenceError, InterferenceUnavailable
from lightning_dynpipe.interference.quota import CpuLimit, CpuQuota
from lightning_dynpipe.interference.throttle import CpuThrottle
from lightning_dynpipe.monitor.cgroups import CgroupMount
from tests.interference.helpers import cpu_shares, gone

FRACTION = 0.3


@pytest.fixture
def busy() -> Iterator[int]:
    """A process spinning on one core for as long as the test needs it."""
    proc = subprocess.Popen([sys.executable, "-I", "-c", "while True: pass"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _share(pid: int, seconds: float = 1.5) -> float:
    return cpu_shares([pid], seconds)[0][0]


def _running(pid: int) -> bool:
    return psutil.Process(pid).status() != psutil.STATUS_STOPPED


def _start_or_skip(quota: CpuQuota) -> Path:
    """Starts ``quota`` (the test is skipped where this machine has no cgroup CPU controller); its cgroup."""
    try:
        quota.start()
    except InterferenceUnavailable as exc:
        pytest.skip(f"no cgroup CPU controller here: {exc}")
    assert quota.cgroup is not None
    return quota.cgroup


def test_cgroup_quota_limits_a_busy_process(busy: int) -> None:
    before = Path(f"/proc/{busy}/cgroup").read_text()
    quota = CpuQuota(busy, FRACTION)
    cgroup = _start_or_skip(quota)
    try:
        assert cgroup.is_dir() and quota.backend in ("cgroup v1", "cgroup v2")
        assert str(busy) in (cgroup / "cgroup.procs").read_text().split()
        share = _share(busy)
    finally:
        quota.stop()
    assert 0.1 < share < FRACTION + 0.1, share
    assert not cgroup.exists()
    assert Path(f"/proc/{busy}/cgroup").read_text() == before
    quota.stop()  # idempotent


def test_cgroup_quota_holds_the_processes_the_target_started_within_its_limit() -> None:
    """A container's limit holds a job with its helpers: a child the limited process started before the quota (a
    stage's refit process, started at set-up) is moved in with it and shares the limit, and moves back after."""
    spin = "subprocess.Popen([sys.executable, '-I', '-c', 'while True: pass'])"
    code = f"import subprocess, sys, time; {spin}; time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-I", "-c", code])
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = psutil.Process(parent.pid).children()
        before = Path(f"/proc/{child.pid}/cgroup").read_text()
        quota = CpuQuota(parent.pid, FRACTION)
        cgroup = _start_or_skip(quota)
        try:
            assert str(child.pid) in (cgroup / "cgroup.procs").read_text().split()
            share = _share(child.pid)
        finally:
            quota.stop()
        assert share < FRACTION + 0.1, share  # the parent sleeps: the child has the whole limit, and no more
        assert Path(f"/proc/{child.pid}/cgroup").read_text() == before
    finally:
        for proc in psutil.Process(parent.pid).children(recursive=True):
            proc.kill()
        parent.kill()
        parent.wait()


def test_cgroup_quota_is_removed_when_garbage_collected(busy: int) -> None:
    quota = CpuQuota(busy, 0.5)
    cgroup = _start_or_skip(quota)
    del quota
    gc.collect()
    assert not cgroup.exists()


def test_throttle_limits_a_busy_process(busy: int) -> None:
    with CpuThrottle(busy, FRACTION) as throttle:
        helper = throttle.helper_pid
        assert helper is not None
        share = _share(busy)
    assert 0.1 < share < FRACTION + 0.1, share
    assert gone(helper)
    assert _running(busy)


def test_throttle_holds_the_processes_the_target_started_before_and_after_within_its_share(tmp_path: Path) -> None:
    """As a cgroup quota does, the throttle holds the target's helpers: a child started before the throttle (a
    stage's refit process, started at set-up) and one started while it runs share the target's limit; a helper
    killed while it has them stopped leaves them stopped only until :meth:`CpuThrottle.stop` continues them."""
    flag = tmp_path / "second"
    spin = "subprocess.Popen([sys.executable, '-I', '-c', 'while True: pass'])"
    wait = f"while not os.path.exists({str(flag)!r}): time.sleep(0.01)"
    code = "\n".join(["import os, subprocess, sys, time", spin, wait, spin, "time.sleep(60)"])
    parent = subprocess.Popen([sys.executable, "-I", "-c", code])

    def children(n: int) -> list[psutil.Process]:
        deadline = time.monotonic() + 10
        while len(found := psutil.Process(parent.pid).children()) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(found) == n, found
        return found

    try:
        children(1)
        throttle = CpuThrottle(parent.pid, FRACTION)
        throttle.start()
        try:
            flag.touch()
            pids = [c.pid for c in children(2)]
            shares = cpu_shares(pids, 1.5)
            helper = throttle.helper_pid
            assert helper is not None
            os.kill(helper, signal.SIGKILL)  # maybe while the children are stopped
            psutil.Process(helper).wait(5)
        finally:
            throttle.stop()
        total = sum(cpu for cpu, _ in shares)
        assert total < FRACTION + 0.1, shares  # the parent sleeps: its children have the whole share, and no more
        assert all(cpu > 0.02 for cpu, _ in shares), shares  # each of them ran
        assert all(_running(p) for p in pids)
    finally:
        for proc in psutil.Process(parent.pid).children(recursive=True):
            proc.kill()
        parent.kill()
        parent.wait()


@pytest.mark.parametrize("backend", ["cgroup", "throttle"])
def test_a_limit_leaves_the_excluded_children_outside(backend: Literal["cgroup", "throttle"]) -> None:
    """Lightning's default launcher starts the other ranks from rank 0's process: a limit on rank 0's stage holds
    its helpers, not the job's other ranks (``exclude``), nor what those started."""
    spin = "subprocess.Popen([sys.executable, '-I', '-c', 'while True: pass'])"
    rank = (
        "subprocess.Popen([sys.executable, '-I', '-c', 'import subprocess, sys, time; ' + SPIN + '; time.sleep(60)'])"
    )
    code = "\n".join(["import subprocess, sys, time", f"SPIN = {spin!r}", spin, rank, "time.sleep(60)"])
    parent = subprocess.Popen([sys.executable, "-I", "-c", code])
    try:
        deadline = time.monotonic() + 10
        while len(psutil.Process(parent.pid).children(recursive=True)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        helper, other_rank = sorted(psutil.Process(parent.pid).children(), key=lambda c: c.pid)
        (its_child,) = other_rank.children()
        limit = CpuLimit(parent.pid, FRACTION, backend=backend, exclude=[other_rank.pid])
        try:
            limit.start()
        except InterferenceUnavailable as exc:
            pytest.skip(f"no cgroup CPU controller here: {exc}")
        try:
            held, free = cpu_shares([helper.pid, its_child.pid], 1.5)
        finally:
            limit.stop()
        assert held[0] < FRACTION + 0.1, held
        assert free[0] > 0.6, free  # one of the two cores (the helper and the limit's own helper share the other)
    finally:
        for proc in psutil.Process(parent.pid).children(recursive=True):
            proc.kill()
        parent.kill()
        parent.wait()


def test_the_quota_entry_leaves_out_the_ranks_this_process_launched() -> None:
    from types import SimpleNamespace

    from lightning_dynpipe.interference.schedule import InterferenceSpec, launched_ranks, make_interference

    host = SimpleNamespace(launcher=SimpleNamespace(procs=[SimpleNamespace(pid=123), SimpleNamespace(pid=456)]))
    assert launched_ranks(host) == [123, 456]
    assert launched_ranks(SimpleNamespace(launcher=None)) == [] and launched_ranks(object()) == []
    limit = make_interference(InterferenceSpec("cpu_quota", stage=0, fraction=0.5), host)
    assert isinstance(limit, CpuLimit)
    assert limit._quota.exclude == limit._throttle.exclude == {123, 456}


def test_throttle_leaves_the_target_running_however_it_ends(busy: int) -> None:
    throttle = CpuThrottle(busy, 0.1)
    throttle.start()
    helper = throttle.helper_pid
    assert helper is not None
    time.sleep(0.3)
    os.kill(helper, signal.SIGTERM)  # killed from outside, maybe while the target is stopped
    psutil.Process(helper).wait(5)
    assert _running(busy)
    throttle.stop()
    throttle.start()
    helper = throttle.helper_pid
    assert helper is not None
    del throttle  # garbage collection stops the helper too
    gc.collect()
    assert gone(helper) and _running(busy)


def test_cpu_limit_prefers_cgroups_and_falls_back_to_the_throttle(
    busy: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with CpuLimit(busy, 0.5) as limit:
        assert limit.backend in ("cgroup v1", "cgroup v2", "throttle")
    assert limit.backend is None and not limit.active
    with CpuLimit(busy, 0.5, backend="throttle") as limit:
        assert limit.backend == "throttle"
    monkeypatch.setattr(quota_module, "cgroup_mounts", lambda: [])
    with caplog.at_level(logging.INFO, logger="lightning_dynpipe.interference.quota"):
        with CpuLimit(busy, 0.5) as limit:
            assert limit.backend == "throttle"
    assert "cgroups unavailable, using CpuThrottle" in caplog.text
    with pytest.raises(InterferenceUnavailable):
        CpuLimit(busy, 0.5, backend="cgroup").start()


def test_unavailable_cgroups_say_why_and_what_to_use_instead(busy: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quota_module, "cgroup_mounts", lambda: [])
    with pytest.raises(InterferenceUnavailable, match="no cgroup filesystem is mounted.*CpuHog"):
        CpuQuota(busy, 0.5).start()
    read_only = [
        CgroupMount("cgroup2", "/", Path("/sys/fs/cgroup"), True, frozenset()),
        CgroupMount("cgroup", "/", Path("/sys/fs/cgroup/cpu"), True, frozenset({"rw", "cpu"})),
    ]
    monkeypatch.setattr(quota_module, "cgroup_mounts", lambda: read_only)
    monkeypatch.setattr(quota_module, "process_cgroups", lambda pid: {"": "/", "cpu": "/"})
    with pytest.raises(InterferenceUnavailable) as info:
        CpuQuota(busy, 0.5).start()
    message = str(info.value)
    assert "cgroup v2: /sys/fs/cgroup is mounted read-only" in message
    assert "cgroup v1: /sys/fs/cgroup/cpu is mounted read-only" in message
    assert "CpuThrottle" in message and "CpuLimit" in message


def test_a_v2_hierarchy_without_the_cpu_controller_is_reported(
    busy: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "cgroup.controllers").write_text("memory pids\n")
    monkeypatch.setattr(
        quota_module, "cgroup_mounts", lambda: [CgroupMount("cgroup2", "/", tmp_path, False, frozenset())]
    )
    monkeypatch.setattr(quota_module, "process_cgroups", lambda pid: {"": "/"})
    with pytest.raises(InterferenceUnavailable, match="has no cpu controller .controllers: memory pids"):
        CpuQuota(busy, 0.5).start()


def test_quota_arguments_are_checked() -> None:
    with pytest.raises(InterferenceConfigError, match=r"fraction must be in \(0, "):
        CpuQuota(os.getpid(), 0.0)
    with pytest.raises(InterferenceConfigError, match="at least 1 ms .* Raise period_s"):
        CpuQuota(os.getpid(), 0.005, period_s=0.1)
    with pytest.raises(InterferenceConfigError, match="backend must be one of"):
        CpuLimit(os.getpid(), 0.5, backend="nice")  # type: ignore[arg-type]
    gone_pid = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    ).stdout.strip()
    with pytest.raises(InterferenceError, match="does not exist"):
        CpuThrottle(int(gone_pid), 0.5).start()
    with pytest.raises(InterferenceError, match="does not exist"):
        CpuQuota(int(gone_pid), 0.5).start()
