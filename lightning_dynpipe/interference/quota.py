"""CPU quotas on a process: a cgroup CPU bandwidth limit where the machine allows it, else an outside throttle.

:class:`CpuQuota` puts the process into a new child cgroup with a CFS bandwidth limit: ``cpu.max`` on the
unified (v2) hierarchy, or ``cpu.cfs_quota_us``/``cpu.cfs_period_us`` where the ``cpu`` controller is mounted
as cgroup v1 (hybrid hosts, many containers and micro-VMs). It needs a writable cgroup filesystem and the right
to move the process (root, or a delegated subtree); where that is missing it raises
:class:`~lightning_dynpipe.interference.base.InterferenceUnavailable` with each reason.
:class:`CpuLimit` tries :class:`CpuQuota` and falls back to :class:`~lightning_dynpipe.interference.throttle.
CpuThrottle`, which reaches the same average share with SIGSTOP/SIGCONT from a helper process. Both hold the
processes the limited process started (a stage's refit process) within the same limit.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import time
import weakref
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from lightning_dynpipe.interference.base import (
    InterferenceConfigError,
    InterferenceError,
    InterferenceUnavailable,
    Lifecycle,
    check_fraction,
)
from lightning_dynpipe.interference.throttle import CpuThrottle
from lightning_dynpipe.monitor.cgroups import cgroup_dir, cgroup_mounts, process_cgroups
from lightning_dynpipe.monitor.stats import process_descendants

__all__ = ["CpuQuota", "CpuLimit"]

log = logging.getLogger(__name__)

_MIN_QUOTA_US = 1000  # the kernel refuses smaller quotas and periods (EINVAL)
_MAX_PERIOD_US = 1_000_000


@dataclass(frozen=True)
class _Candidate:
    version: Literal[1, 2]
    home: Path  # the process's cgroup now (where it goes back to)
    parent: Path  # where the new cgroup is created


@dataclass
class _Made:
    """What :meth:`CpuQuota.start` changed, for the stop path (kept apart from the object for the finaliser)."""

    pid: int
    home: Path
    cgroup: Path | None = None
    enabled_cpu_in: Path | None = None  # v2: where this object had to add "+cpu" to cgroup.subtree_control
    done: bool = field(default=False)


def _read(path: Path) -> str:
    return path.read_text().strip()


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _why(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "error")
    hint = {
        errno.EROFS: "the cgroup filesystem is read-only (usual in unprivileged containers)",
        errno.EACCES: "permission denied (needs root or a delegated cgroup subtree)",
        errno.EPERM: "operation not permitted (needs root or a delegated cgroup subtree)",
        errno.EBUSY: "busy: cgroup v2 allows controllers only in cgroups without member processes "
        "(the 'no internal processes' rule)",
        errno.ENOENT: "file missing: the controller is not enabled there",
        errno.EINVAL: "invalid value (a quota above the parent cgroup's, or a period out of range)",
    }.get(exc.errno or 0, exc.strerror or str(exc))
    return f"{name}: {hint}"


def _candidates(pid: int) -> tuple[list[_Candidate], list[str]]:
    """Places where a cpu-limited child cgroup may be created for ``pid``, best first, and why others cannot."""
    reasons: list[str] = []
    try:
        mounts = cgroup_mounts()
        groups = process_cgroups(pid)
    except OSError as exc:
        return [], [f"cannot read the cgroup tables ({exc})"]
    if not mounts:
        return [], ["no cgroup filesystem is mounted"]
    out: list[_Candidate] = []
    v2 = next((m for m in mounts if m.fstype == "cgroup2"), None)
    if v2 is None or "" not in groups:
        reasons.append("cgroup v2: no unified hierarchy is mounted")
    elif v2.read_only:
        reasons.append(f"cgroup v2: {v2.mountpoint} is mounted read-only")
    else:
        home = cgroup_dir(v2, groups[""])
        try:
            controllers = _read(v2.mountpoint / "cgroup.controllers").split()
        except OSError as exc:
            controllers = []
            reasons.append(f"cgroup v2: cannot read cgroup.controllers ({_why(exc)})")
        if "cpu" not in controllers:
            reasons.append(
                f"cgroup v2: the unified hierarchy at {v2.mountpoint} has no cpu controller "
                f"(controllers: {' '.join(controllers) or 'none'}; cpu is bound to cgroup v1 or disabled)"
            )
        else:
            out.append(_Candidate(2, home, home))
            if home != v2.mountpoint:
                out.append(_Candidate(2, home, v2.mountpoint))
    v1 = next((m for m in mounts if m.fstype == "cgroup" and "cpu" in m.super_options), None)
    if v1 is None or "cpu" not in groups:
        reasons.append("cgroup v1: the cpu controller is not mounted")
    elif v1.read_only:
        reasons.append(f"cgroup v1: {v1.mountpoint} is mounted read-only")
    else:
        home = cgroup_dir(v1, groups["cpu"])
        out.append(_Candidate(1, home, home))
    return out, reasons


def _remove(made: _Made, timeout_s: float = 2.0) -> None:
    """Moves every process of the quota cgroup back home and removes the cgroup. Never raises; idempotent."""
    if made.done or made.cgroup is None:
        made.done = True
        return
    made.done = True
    cg = made.cgroup
    try:
        members = _read(cg / "cgroup.procs").split()
    except OSError:
        members = []
    for p in members:
        try:
            _write(made.home / "cgroup.procs", p)
        except OSError as exc:
            if exc.errno != errno.ESRCH:
                log.error("Could not move process %s out of quota cgroup %s back to %s: %s", p, cg, made.home, exc)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(cg)
            break
        except FileNotFoundError:
            break
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                log.error("Could not remove quota cgroup %s: %s. Remove it with `rmdir %s`.", cg, exc, cg)
                break
            time.sleep(0.02)  # exiting members leave the cgroup asynchronously
    if made.enabled_cpu_in is not None:
        try:
            _write(made.enabled_cpu_in / "cgroup.subtree_control", "-cpu")
        except OSError:  # another cgroup below uses it now; leaving it enabled is harmless
            pass


class CpuQuota(Lifecycle):
    """A cgroup CPU bandwidth limit on a process: it may use ``fraction`` of one CPU per period.

    Example::

        try:
            with CpuQuota(pid=os.getpid(), fraction=0.25):
                train_some_steps()      # this process (all its threads together) gets 25% of one CPU
        except InterferenceUnavailable as exc:
            print(exc)                  # why not (read-only cgroupfs, no cpu controller, ...)

    :meth:`start` creates ``dynpipe-quota-<pid>-<token>`` under the process's current cgroup (cgroup v2: or the
    hierarchy root when the current one may not hold controllers), writes the limit, and moves the process in with
    the processes it started (its children, theirs, and so on), as a container's limit holds a job with its helper
    processes: a stage's forest refit process, started at set-up, then runs within the stage's limit, not beside it;
    processes it forks later are limited with it. :meth:`stop` (idempotent; also run when the object is
    garbage-collected and at exit) moves every member back and removes the cgroup. If the owning process is
    killed with SIGKILL, nothing runs: the limited process stays limited until it exits, and an empty
    ``dynpipe-quota-*`` directory is left behind (harmless; ``rmdir`` removes it).

    Args:
        pid: the process to limit (0: this one).
        fraction: CPUs' worth of time per period, in (0, number of CPUs]; 0.25 is a quarter of one core.
        period_s: the CFS bandwidth period (1 ms to 1 s).
        exclude: processes the target started that are not its helpers, left outside the limit with what they
            started: the job's other ranks, which Lightning's default launcher starts from rank 0.

    Raises:
        InterferenceUnavailable: from :meth:`start`, when neither cgroup v2 nor v1 offers a writable cpu
            controller; the message lists each reason. :class:`CpuLimit` falls back to a throttle instead.
    """

    def __init__(self, pid: int, fraction: float, period_s: float = 0.1, exclude: Collection[int] = ()) -> None:
        self.pid = pid or os.getpid()
        self.exclude = frozenset(exclude)
        cpus = os.cpu_count() or 1
        self.fraction = check_fraction(
            "fraction",
            fraction,
            0.0,
            float(cpus),
            f"Use the share of one CPU the process may use, e.g. 0.25 (at most {cpus}).",
        )
        self.period_s = check_fraction(
            "period_s", period_s, 0.001, 1.0, "Use e.g. 0.1 (the kernel default).", low_open=False
        )
        self.period_us = int(round(self.period_s * 1e6))
        self.quota_us = int(round(self.fraction * self.period_us))
        if self.quota_us < _MIN_QUOTA_US:
            raise InterferenceConfigError(
                f"CpuQuota: fraction * period_s must be at least 1 ms (the kernel's smallest quota); got "
                f"{self.fraction:g} * {self.period_s:g} s = {self.fraction * self.period_s * 1e3:.3g} ms. Raise "
                f"period_s to {min(1.0, 0.001 / self.fraction):.3g} s or more, or raise the fraction.",
                field="fraction",
            )
        self.backend: str | None = None
        self._made: _Made | None = None
        self._finalizer: weakref.finalize[..., CpuQuota] | None = None

    def __repr__(self) -> str:
        return f"CpuQuota(pid={self.pid}, fraction={self.fraction:g}, period_s={self.period_s:g})"

    @property
    def active(self) -> bool:
        """Whether the process is in the quota cgroup."""
        return self._made is not None and not self._made.done

    @property
    def cgroup(self) -> Path | None:
        """The quota cgroup's directory while active."""
        return self._made.cgroup if self.active and self._made is not None else None

    def start(self) -> None:
        """Creates the quota cgroup and moves the process in; a no-op if already active.

        Raises:
            InterferenceUnavailable: no writable cpu controller (each reason listed).
            InterferenceError: the process does not exist.
        """
        if self.active:
            return
        if not Path(f"/proc/{self.pid}").exists():
            raise InterferenceError(f"CpuQuota: process {self.pid} does not exist. Pass the pid of a running process.")
        candidates, reasons = _candidates(self.pid)
        for cand in candidates:
            made = _Made(self.pid, cand.home)
            try:
                self._create(cand, made)
            except OSError as exc:
                reasons.append(f"cgroup v{cand.version} under {cand.parent}: {_why(exc)}")
                _remove(made)
                continue
            self._made = made
            self._finalizer = weakref.finalize(self, _remove, made)
            self.backend = f"cgroup v{cand.version}"
            log.debug("%r: process %d is in %s (%s)", self, self.pid, made.cgroup, self.backend)
            return
        raise InterferenceUnavailable(
            f"CpuQuota cannot limit process {self.pid} with a cgroup on this machine: " + "; ".join(reasons) + ". "
            "Fix: run as root with a writable cgroup filesystem (cgroup v2 with the cpu controller, or the v1 cpu "
            "controller), e.g. a privileged container; or use CpuLimit (falls back to CpuThrottle, the same average "
            "share by SIGSTOP/SIGCONT) or CpuHog (steals the stage's core instead)."
        )

    def _create(self, cand: _Candidate, made: _Made) -> None:
        name = f"dynpipe-quota-{self.pid}-{secrets.token_hex(3)}"
        if cand.version == 2:
            control = cand.parent / "cgroup.subtree_control"
            if "cpu" not in _read(control).split():
                _write(control, "+cpu")
                made.enabled_cpu_in = cand.parent
            made.cgroup = cand.parent / name
            made.cgroup.mkdir()
            _write(made.cgroup / "cpu.max", f"{self.quota_us} {self.period_us}")
        else:
            made.cgroup = cand.parent / name
            made.cgroup.mkdir()
            _write(made.cgroup / "cpu.cfs_period_us", str(self.period_us))
            _write(made.cgroup / "cpu.cfs_quota_us", str(self.quota_us))
        _write(made.cgroup / "cgroup.procs", str(self.pid))
        # what the process started (a refit process) shares its limit; the excluded (other ranks) do not
        for child in process_descendants(self.pid, self.exclude):
            try:
                _write(made.cgroup / "cgroup.procs", str(child))
            except OSError as exc:
                if exc.errno != errno.ESRCH:  # a child that ended meanwhile is not an error
                    raise

    def stop(self) -> None:
        """Moves the process (and anything it forked meanwhile) back and removes the cgroup; idempotent."""
        if self._finalizer is not None and self._finalizer.alive:
            log.debug("%r: removing %s", self, self.cgroup)
            self._finalizer()
        self._made = None


class CpuLimit(Lifecycle):
    """Limits a process to ``fraction`` of one CPU: :class:`CpuQuota` if cgroups allow it, else :class:`CpuThrottle`.

    Example::

        with CpuLimit(pid=os.getpid(), fraction=0.5) as limit:
            print(limit.backend)        # "cgroup v2", "cgroup v1" or "throttle"
            train_some_steps()

    This is what the schedule kind ``"cpu_quota"`` uses; the choice is logged.

    Args:
        pid: the process to limit (0: this one).
        fraction: CPUs' worth of time, in (0, number of CPUs].
        period_s: the quota period; ``None``: 0.1 s for a cgroup, 0.02 s for the throttle.
        backend: ``"auto"`` (cgroup, else throttle), ``"cgroup"`` (raise where unavailable) or ``"throttle"``.
        exclude: processes the target started that are not its helpers and stay outside the limit, with what
            they started (the job's other ranks, where the target launched them).
    """

    def __init__(
        self,
        pid: int,
        fraction: float,
        period_s: float | None = None,
        backend: Literal["auto", "cgroup", "throttle"] = "auto",
        exclude: Collection[int] = (),
    ) -> None:
        if backend not in ("auto", "cgroup", "throttle"):
            raise InterferenceConfigError(
                f"CpuLimit backend must be one of 'auto', 'cgroup', 'throttle'; got {backend!r}.", field="backend"
            )
        self.pid = pid or os.getpid()
        self.fraction = fraction
        self.period_s = period_s
        self.requested_backend = backend
        # Built now so that argument errors surface at construction.
        self._quota = CpuQuota(self.pid, fraction, period_s if period_s is not None else 0.1, exclude)
        self._throttle = CpuThrottle(self.pid, fraction, period_s if period_s is not None else 0.02, exclude=exclude)
        self._running: CpuQuota | CpuThrottle | None = None

    def __repr__(self) -> str:
        backend = self.backend or self.requested_backend
        return f"CpuLimit(pid={self.pid}, fraction={self.fraction:g}, backend={backend!r})"

    @property
    def backend(self) -> str | None:
        """``"cgroup v2"``, ``"cgroup v1"`` or ``"throttle"`` while active, else ``None``."""
        if self._running is None:
            return None
        return self._running.backend if isinstance(self._running, CpuQuota) else "throttle"

    @property
    def active(self) -> bool:
        """Whether the limit is in force."""
        return self._running is not None and self._running.active

    def start(self) -> None:
        """Applies the limit with the best available mechanism (logged); a no-op if already active.

        Raises:
            InterferenceUnavailable: ``backend="cgroup"`` where cgroups cannot limit the process.
        """
        if self.active:
            return
        if self.requested_backend != "throttle":
            try:
                self._quota.start()
                self._running = self._quota
                log.info(
                    "CPU quota of %.3g CPU on process %d: %s (%s).",
                    self._quota.fraction,
                    self.pid,
                    self.backend,
                    self._quota.cgroup,
                )
                return
            except InterferenceUnavailable as exc:
                if self.requested_backend == "cgroup":
                    raise
                log.warning(
                    "CPU quota on process %d: cgroups unavailable, using CpuThrottle (SIGSTOP/SIGCONT) instead. %s",
                    self.pid,
                    exc,
                )
        self._throttle.start()
        self._running = self._throttle
        log.info(
            "CPU quota of %.3g CPU on process %d: throttle (SIGSTOP/SIGCONT every %.3g s).",
            self._throttle.fraction,
            self.pid,
            self._throttle.period_s,
        )

    def stop(self) -> None:
        """Lifts the limit; idempotent."""
        running, self._running = self._running, None
        if running is not None:
            running.stop()
