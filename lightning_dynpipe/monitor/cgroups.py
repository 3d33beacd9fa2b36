"""Reading Linux control groups: where a process's cgroups are, and the CPU bandwidth limit they put on it.

Shared by :mod:`lightning_dynpipe.interference.quota` (which creates CPU-limited cgroups) and the stage
monitor (which reads the limit a stage runs under, whoever set it: our interference injection, a container
runtime's CPU limit, a batch system). Linux only; everywhere else the readers find nothing and say so by
returning empty results or ``None``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CgroupMount", "cgroup_dir", "cgroup_mounts", "cpu_limit_cores", "process_cgroups"]


@dataclass(frozen=True)
class CgroupMount:
    """One mounted cgroup hierarchy, from ``/proc/self/mountinfo``."""

    fstype: str  # "cgroup" (v1) or "cgroup2"
    root: str  # the hierarchy path mounted at ``mountpoint``
    mountpoint: Path
    read_only: bool
    super_options: frozenset[str]  # for v1: the controllers bound to this hierarchy


def _unescape(path: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def cgroup_mounts(mountinfo: str | os.PathLike[str] = "/proc/self/mountinfo") -> list[CgroupMount]:
    """Every mounted cgroup hierarchy (v1 and v2). Raises ``OSError`` when ``mountinfo`` cannot be read."""
    mounts = []
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            lf, rf = left.split(), right.split()
            if len(lf) < 6 or len(rf) < 1 or rf[0] not in ("cgroup", "cgroup2"):
                continue
            super_opts = frozenset(rf[2].split(",")) if len(rf) > 2 else frozenset()
            mounts.append(
                CgroupMount(
                    rf[0],
                    _unescape(lf[3]),
                    Path(_unescape(lf[4])),
                    "ro" in lf[5].split(",") or "ro" in super_opts,
                    super_opts,
                )
            )
    return mounts


def process_cgroups(pid: int, proc: str | os.PathLike[str] = "/proc") -> dict[str, str]:
    """``{"": v2 path, "cpu": v1 path of the cpu hierarchy, ...}`` from ``/proc/<pid>/cgroup``.

    Raises ``OSError`` when the file cannot be read.
    """
    out: dict[str, str] = {}
    with open(Path(proc) / str(pid) / "cgroup") as f:
        for line in f:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) != 3:
                continue
            hid, controllers, path = parts
            if hid == "0" and controllers == "":
                out[""] = path
            for c in controllers.split(","):
                if c:
                    out[c] = path
    return out


def cgroup_dir(mount: CgroupMount, path: str) -> Path:
    """The directory of cgroup ``path`` (as ``/proc/<pid>/cgroup`` names it) under ``mount``."""
    root = mount.root.rstrip("/")
    rel = path[len(root) :] if root and (path == root or path.startswith(root + "/")) else path
    return mount.mountpoint / rel.lstrip("/")


def _v2_limit(directory: Path) -> float | None:
    """``cpu.max`` of one v2 cgroup in cores (``"25000 100000"`` -> 0.25), None for ``max`` or no file."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_limit(directory: Path) -> float | None:
    """``cpu.cfs_quota_us / cpu.cfs_period_us`` of one v1 cgroup in cores, None for -1 (no limit) or no file."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota < 0 or period <= 0 else quota / period


def _walk_up(directory: Path, top: Path) -> list[Path]:
    """``directory`` and its parents up to and including ``top`` (only ``top`` if it is not below it)."""
    out = [directory]
    while directory != top and top in directory.parents:
        directory = directory.parent
        out.append(directory)
    return out


def cpu_limit_cores(
    pid: int | None = None,
    *,
    mountinfo: str | os.PathLike[str] = "/proc/self/mountinfo",
    proc: str | os.PathLike[str] = "/proc",
) -> float | None:
    """The CFS bandwidth limit on process ``pid`` (default: this one), in cores; None when nothing limits it.

    A limit anywhere on the path from the process's cgroup up to the hierarchy's root applies, so this is the
    smallest ``quota / period`` along it, over the v2 (``cpu.max``) and v1 (``cpu.cfs_quota_us`` and
    ``cpu.cfs_period_us``) hierarchies. Example: a container started with ``--cpus=0.5`` reads 0.5, a stage
    under ``{"kind": "cpu_quota", "fraction": 0.25}`` (cgroup backend) 0.25. A CPU limit that is not a cgroup
    bandwidth limit (an affinity mask, the SIGSTOP throttle fallback, another job sharing the core) is not
    seen here. Never raises; unreadable files count as no limit.
    """
    try:
        mounts = cgroup_mounts(mountinfo)
        groups = process_cgroups(os.getpid() if pid is None else pid, proc)
    except OSError:
        return None
    limits: list[float] = []
    for mount in mounts:
        if mount.fstype == "cgroup2" and "" in groups:
            reader, path = _v2_limit, groups[""]
        elif mount.fstype == "cgroup" and "cpu" in mount.super_options and "cpu" in groups:
            reader, path = _v1_limit, groups["cpu"]
        else:
            continue
        for directory in _walk_up(cgroup_dir(mount, path), mount.mountpoint):
            limit = reader(directory)
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None
