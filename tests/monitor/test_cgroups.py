"""cgroup readers on fake /proc and cgroup trees, and one real quota where the machine allows it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dynpipe.monitor.cgroups import cgroup_dir, cgroup_mounts, cpu_limit_cores, process_cgroups


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
