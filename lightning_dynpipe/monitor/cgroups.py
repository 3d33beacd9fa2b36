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

__all__ = ["CgroupMount", "CpuLimitReader", "cgroup_dir", "cgroup_mounts", "cpu_limit_cores", "process_cgroups"]


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
    with open(Path(proc) / str(pid) / "cgroup") as f:
        return _parse_cgroups(f.read())


def _parse_cgroups(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
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


_V2_FILES: tuple[str, ...] = ("cpu.max",)
_V1_FILES: tuple[str, ...] = ("cpu.cfs_quota_us", "cpu.cfs_period_us")


def _parse_limit(texts: list[str]) -> float | None:
    """Cores from the contents of one cgroup's limit files: ``[cpu.max]`` (v2: ``"25000 100000"`` -> 0.25,
    ``max`` -> None) or ``[cfs_quota_us, cfs_period_us]`` (v1: -1 -> None). None for anything unparsable."""
    try:
        if len(texts) == 1:
            quota, period = texts[0].split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        q, p = int(texts[0]), int(texts[1])
    except (ValueError, ZeroDivisionError):
        return None
    return None if q < 0 or p <= 0 else q / p


def _walk_up(directory: Path, top: Path) -> list[Path]:
    """``directory`` and its parents up to and including ``top`` (only ``top`` if it is not below it)."""
    out = [directory]
    while directory != top and top in directory.parents:
        directory = directory.parent
        out.append(directory)
    return out


def _limit_files(mounts: list[CgroupMount], groups: dict[str, str]) -> list[tuple[Path, ...]]:
    """The limit files of every cgroup on the process's path, per hierarchy that limits CPU: one tuple per
    cgroup, ``(cpu.max,)`` for v2 and ``(cfs_quota_us, cfs_period_us)`` for v1 (files may not exist)."""
    out: list[tuple[Path, ...]] = []
    for mount in mounts:
        if mount.fstype == "cgroup2" and "" in groups:
            names, path = _V2_FILES, groups[""]
        elif mount.fstype == "cgroup" and "cpu" in mount.super_options and "cpu" in groups:
            names, path = _V1_FILES, groups["cpu"]
        else:
            continue
        for directory in _walk_up(cgroup_dir(mount, path), mount.mountpoint):
            out.append(tuple(directory / n for n in names))
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
    seen here. Never raises; unreadable files count as no limit. Parses the mount table on every call (about
    0.1 ms); :class:`CpuLimitReader` reads the same limit of this process in a few microseconds.
    """
    try:
        mounts = cgroup_mounts(mountinfo)
        groups = process_cgroups(os.getpid() if pid is None else pid, proc)
    except OSError:
        return None
    limits: list[float] = []
    for files in _limit_files(mounts, groups):
        try:
            limit = _parse_limit([f.read_text() for f in files])
        except OSError:
            continue
        if limit is not None:
            limits.append(limit)
    return min(limits) if limits else None


class CpuLimitReader:
    """:func:`cpu_limit_cores` of this process, cheap enough to call every training step.

    Keeps ``/proc/self/cgroup`` and the limit files of the cgroups on the process's path open and re-reads them
    with ``pread`` (a few microseconds in all, against about 0.1 ms for :func:`cpu_limit_cores`, which parses
    the mount table). When the process moves to another cgroup (an interference injection, a batch system
    re-placing it) the membership file changes and the files are reopened for the new path; a cgroup removed
    under it (the read fails) or a fork (the descriptors belong to the parent's ``/proc/self``) does the same.
    The mount table is parsed once: a cgroup hierarchy mounted after the first read is not seen.

    Example::

        limit = CpuLimitReader()
        limit.read()   # 0.25 under a quarter-core quota, None when nothing limits this process
        limit.close()
    """

    def __init__(
        self,
        *,
        mountinfo: str | os.PathLike[str] = "/proc/self/mountinfo",
        proc: str | os.PathLike[str] = "/proc",
    ) -> None:
        self._mountinfo = mountinfo
        self._membership_path = Path(proc) / "self" / "cgroup"
        self._mounts: list[CgroupMount] | None = None
        self._membership_fd: int | None = None
        self._membership: bytes | None = None  # the contents the limit files below were opened for
        self._files: list[tuple[int, ...]] = []
        self._pid = -1

    def read(self) -> float | None:
        """The smallest CFS limit on this process's cgroup path now, in cores; None when nothing limits it.

        Never raises; unreadable tables or files count as no limit, as in :func:`cpu_limit_cores`.
        """
        if self._pid != os.getpid():
            self.close()
            self._pid = os.getpid()
        if self._membership_fd is None:
            try:
                self._membership_fd = os.open(self._membership_path, os.O_RDONLY)
            except OSError:
                return None
        try:
            membership = os.pread(self._membership_fd, 1 << 16, 0)
        except OSError:
            self.close()
            return None
        if membership != self._membership:
            self._open_files(membership)
        limits: list[float] = []
        for fds in self._files:
            try:
                limit = _parse_limit([os.pread(fd, 64, 0).decode("ascii", "replace") for fd in fds])
            except OSError:  # the cgroup was removed: reopen for the current path at the next read
                self._membership = None
                continue
            if limit is not None:
                limits.append(limit)
        return min(limits) if limits else None

    def _open_files(self, membership: bytes) -> None:
        self._close_files()
        self._membership = membership
        if self._mounts is None:
            try:
                self._mounts = cgroup_mounts(self._mountinfo)
            except OSError:
                self._mounts = []
        groups = _parse_cgroups(membership.decode("utf-8", "replace"))
        for files in _limit_files(self._mounts, groups):
            fds: list[int] = []
            try:
                for f in files:
                    fds.append(os.open(f, os.O_RDONLY))
            except OSError:  # no limit file in this cgroup (a v2 root, a hierarchy without the cpu controller)
                for fd in fds:
                    os.close(fd)
                continue
            self._files.append(tuple(fds))

    def _close_files(self) -> None:
        if self._pid == os.getpid():
            for fds in self._files:
                for fd in fds:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        self._files = []
        self._membership = None

    def close(self) -> None:
        """Closes the descriptors (the next :meth:`read` opens them again)."""
        self._close_files()
        if self._membership_fd is not None and self._pid == os.getpid():
            try:
                os.close(self._membership_fd)
            except OSError:
                pass
        self._membership_fd = None
