"""cgroup readers on fake /proc and cgroup trees, and one real quota where the machine allows it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dynpipe.monitor.cgroups import (
    CpuLimitReader,
    cgroup_dir,
    cgroup_mounts,
    cpu_limit_cores,
    process_cgroups,
)


def _fake(tmp_path: Path, cgroup_lines: str, mounts: list[tuple[str, Path, str]]) -> tuple[Path, Path]:
    """A mountinfo listing ``mounts`` (fstype, mountpoint, super options) and /proc/42/cgroup."""
    lines = [
        f"{30 + i} 1 0:{i} / {mp} rw,nosuid - {fstype} {fstype} {opts}" for i, (fstype, mp, opts) in enumerate(mounts)
    ]
    lines.insert(0, "22 1 0:5 / /proc rw - proc proc rw")  # not a cgroup: ignored
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("\n".join(lines) + "\n")
    proc = tmp_path / "proc"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "cgroup").write_text(cgroup_lines)
    return mountinfo, proc


def test_v2_limit_is_the_smallest_along_the_path(tmp_path: Path) -> None:
    root = tmp_path / "unified"
    leaf = root / "jobs" / "stage1"
    leaf.mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "jobs" / "cpu.max").write_text("150000 100000\n")  # 1.5 cores for the job
    (leaf / "cpu.max").write_text("25000 100000\n")  # a quarter of a core for the stage
    mountinfo, proc = _fake(tmp_path, "0::/jobs/stage1\n", [("cgroup2", root, "rw,nsdelegate")])

    assert cpu_limit_cores(42, mountinfo=mountinfo, proc=proc) == 0.25
    (leaf / "cpu.max").write_text("max 100000\n")
    assert cpu_limit_cores(42, mountinfo=mountinfo, proc=proc) == 1.5  # the parent's limit still applies
    (root / "jobs" / "cpu.max").write_text("max 100000\n")
    assert cpu_limit_cores(42, mountinfo=mountinfo, proc=proc) is None


def test_v1_cpu_hierarchy_and_unlimited_quota(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu"
    leaf = cpu / "dynpipe-quota"
    leaf.mkdir(parents=True)
    for d, quota in ((cpu, "-1"), (leaf, "50000")):
        (d / "cpu.cfs_quota_us").write_text(quota + "\n")
        (d / "cpu.cfs_period_us").write_text("100000\n")
    mountinfo, proc = _fake(
        tmp_path,
        "4:memory:/x\n2:cpu,cpuacct:/dynpipe-quota\n0::/\n",
        [("cgroup", cpu, "rw,cpu,cpuacct"), ("cgroup", tmp_path / "memory", "rw,memory")],
    )

    assert process_cgroups(42, proc) == {"memory": "/x", "cpu": "/dynpipe-quota", "cpuacct": "/dynpipe-quota", "": "/"}
    mount = next(m for m in cgroup_mounts(mountinfo) if "cpu" in m.super_options)
    assert cgroup_dir(mount, "/dynpipe-quota") == leaf
    assert cpu_limit_cores(42, mountinfo=mountinfo, proc=proc) == 0.5
    (leaf / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_limit_cores(42, mountinfo=mountinfo, proc=proc) is None


def test_unreadable_tables_mean_no_limit(tmp_path: Path) -> None:
    assert cpu_limit_cores(42, mountinfo=tmp_path / "missing", proc=tmp_path) is None
    mountinfo, proc = _fake(tmp_path, "0::/gone\n", [("cgroup2", tmp_path / "nowhere", "rw")])
    assert cpu_limit_cores(42, mountinfo=mountinfo, proc=proc) is None  # no cpu.max files to read
    (tmp_path / "nowhere").mkdir()
    (tmp_path / "nowhere" / "cpu.max").write_text("garbage\n")
    assert cpu_limit_cores(42, mountinfo=mountinfo, proc=proc) is None
    (tmp_path / "nowhere" / "cpu.max").write_text("25000 0\n")  # no period: no limit, not a ZeroDivisionError
    assert cpu_limit_cores(42, mountinfo=mountinfo, proc=proc) is None


def test_a_real_quota_is_read_back() -> None:
    from lightning_dynpipe.interference import CpuQuota, InterferenceUnavailable

    busy = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"])
    try:
        before = cpu_limit_cores(busy.pid)
        try:
            with CpuQuota(busy.pid, 0.25):
                assert cpu_limit_cores(busy.pid) == pytest.approx(0.25 if before is None else min(before, 0.25))
        except InterferenceUnavailable as exc:
            pytest.skip(f"no writable cgroup here: {exc}")
        assert cpu_limit_cores(busy.pid) == before
    finally:
        busy.kill()
        busy.wait()


def _v1_tree(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A v1 cpu hierarchy with a job cgroup and two stage cgroups below it; /proc/self/cgroup in the job's."""
    cpu = tmp_path / "cpu"
    for d, quota in ((cpu, "-1"), (cpu / "job", "150000"), (cpu / "job" / "a", "25000"), (cpu / "job" / "b", "-1")):
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.cfs_quota_us").write_text(quota + "\n")
        (d / "cpu.cfs_period_us").write_text("100000\n")
    mountinfo, proc = _fake(tmp_path, "2:cpu,cpuacct:/job\n", [("cgroup", cpu, "rw,cpu,cpuacct")])
    (proc / "self").mkdir()
    (proc / "self" / "cgroup").write_text("2:cpu,cpuacct:/job\n0::/\n")
    return mountinfo, proc, cpu


def test_limit_reader_follows_the_files_and_moves_between_cgroups(tmp_path: Path) -> None:
    mountinfo, proc, cpu = _v1_tree(tmp_path)
    reader = CpuLimitReader(mountinfo=mountinfo, proc=proc)
    try:
        assert reader.read() == 1.5
        (cpu / "job" / "cpu.cfs_quota_us").write_text("50000\n")  # changed in place: read through the open file
        assert reader.read() == 0.5
        (proc / "self" / "cgroup").write_text("2:cpu,cpuacct:/job/a\n0::/\n")  # moved into a tighter cgroup
        assert reader.read() == 0.25
        (proc / "self" / "cgroup").write_text("2:cpu,cpuacct:/job/b\n0::/\n")  # and into one without its own
        assert reader.read() == 0.5  # the parent's limit still applies
    finally:
        reader.close()


def test_limit_reader_agrees_with_the_parser_and_never_raises(tmp_path: Path) -> None:
    reader = CpuLimitReader(mountinfo=tmp_path / "missing", proc=tmp_path / "nowhere")
    assert reader.read() is None  # no /proc/self/cgroup: no limit, as cpu_limit_cores says
    mountinfo, proc, cpu = _v1_tree(tmp_path)
    (proc / "self" / "cgroup").write_text("2:cpu,cpuacct:/job/a\n0::/\n")
    reader = CpuLimitReader(mountinfo=mountinfo, proc=proc)
    (proc / "42" / "cgroup").write_text("2:cpu,cpuacct:/job/a\n0::/\n")
    assert reader.read() == cpu_limit_cores(42, mountinfo=mountinfo, proc=proc) == 0.25
    (cpu / "job" / "a" / "cpu.cfs_quota_us").write_text("garbage\n")
    assert reader.read() == cpu_limit_cores(42, mountinfo=mountinfo, proc=proc) == 1.5
    reader.close()
    assert reader.read() == 1.5  # reopens after close


def test_limit_reader_in_a_forked_child_reads_its_own_cgroup() -> None:
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    reader = CpuLimitReader()
    expected = reader.read()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's descriptors are not used (or closed) after the fork
        try:
            os.write(write_fd, repr(reader.read() == cpu_limit_cores()).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    assert os.read(read_fd, 16) == b"True"
    os.close(read_fd)
    assert reader.read() == expected
    reader.close()


def test_a_real_quota_shows_in_the_next_read() -> None:
    """The sampler's reader sees this very process enter and leave a quota, read for read."""
    from lightning_dynpipe.interference import CpuQuota, InterferenceUnavailable

    reader = CpuLimitReader()
    before = reader.read()
    try:
        with CpuQuota(os.getpid(), 0.5):
            assert reader.read() == pytest.approx(0.5 if before is None else min(before, 0.5))
        assert reader.read() == before
    except InterferenceUnavailable as exc:
        pytest.skip(f"no writable cgroup here: {exc}")
    finally:
        reader.close()
