"""An outside CPU throttle: SIGSTOP/SIGCONT duty cycling that holds a process to an average CPU share.

The technique of ``cpulimit``: a controller process watches the CPU time (``/proc/<pid>/stat``) of the target
and of the processes it started (its children, theirs, and so on, found again every period), and stops them all
with SIGSTOP whenever together they have used more than ``fraction`` CPU-seconds per second, continuing them with
SIGCONT once the debt is repaid. Like a CFS bandwidth quota it counts all threads of the processes together and
carries no more than one period's unused budget forward, and like a container's limit it holds the target's
helpers (a stage's refit process) within the same share; unlike a cgroup it needs no privileges beyond signalling
the processes. A process the target started before the throttle counts from the throttle's start; one started
later counts from its own start; what a child used in the period it ended in is not counted.

The controller is a separate helper process, so a process may throttle itself (a stage limiting its own CPU):
a thread inside the target would be stopped together with it.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
from collections.abc import Collection

from lightning_dynpipe.interference.base import ChildProcesses, InterferenceError, Lifecycle, check_fraction
from lightning_dynpipe.monitor.stats import process_descendants

__all__ = ["CpuThrottle"]

log = logging.getLogger(__name__)

# Runs in the helper: argv = [target_pid, fraction, period_s, excluded pids (comma-separated), parent_pid].
# Whatever ends it (SIGTERM, the target or the parent disappearing), the target and the processes it stopped are
# left running.
_THROTTLE_CODE = r"""
import os, signal, sys, time
pid, fraction, period, parent = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[5])
exclude = {int(p) for p in sys.argv[4].split(",") if p}  # processes (and what they started) not held
tick = os.sysconf("SC_CLK_TCK")
stopped = set()  # the processes this helper stopped and has not continued yet

def stat(p):
    # (utime + stime of all threads in seconds, start time in ticks since boot)
    with open(f"/proc/{p}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick, int(fields[19])

def children(p):
    out = []
    try:
        tids = os.listdir(f"/proc/{p}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{p}/task/{tid}/children", "rb") as f:
                out.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            pass
    return out

def members():
    # the target, then the processes it started, theirs, and so on (not the excluded ones)
    found, todo = [pid], children(pid)
    while todo:
        child = todo.pop()
        if child not in found and child not in exclude:
            found.append(child)
            todo.extend(children(child))
    return found

def resume(*_):
    for p in [pid, *stopped]:
        try:
            os.kill(p, signal.SIGCONT)
        except ProcessLookupError:
            pass
    stopped.clear()

def on_term(*_):
    resume()
    os._exit(0)

signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us properly
try:
    since = stat(os.getpid())[1]  # a process started from now on counts from its own start
    last = {pid: stat(pid)}  # pid -> (CPU seconds at the last reading, start time): a reused pid starts again
    for p in members()[1:]:
        try:
            last[p] = stat(p)
        except (OSError, IndexError, ValueError):
            pass  # a child that ended
    os.kill(pid, signal.SIGCONT)  # harmless, and proves we may signal the target
except OSError as exc:
    sys.stderr.write(f"cannot watch or signal process {pid}: {exc}")
    sys.exit(3)
sys.stdout.write("ready\n")
sys.stdout.flush()
cap = fraction * period  # unused budget carried forward, as a CFS quota: at most one period's worth
balance = 0.0
last_wall = time.monotonic()
try:
    while os.getppid() == parent:
        time.sleep(period)
        now, used, seen = time.monotonic(), 0.0, {}
        for p in members():
            try:
                cpu, start = stat(p)
            except (OSError, IndexError, ValueError):
                if p == pid:
                    raise ProcessLookupError(pid)
                continue  # a child that ended
            seen[p] = (cpu, start)
            before = last.get(p)
            if before is not None and before[1] == start:
                used += cpu - before[0]
            elif start >= since:
                used += cpu
        last = seen
        balance = min(cap, balance + fraction * (now - last_wall) - used)
        last_wall = now
        if balance < 0:
            for p in last:
                try:
                    os.kill(p, signal.SIGSTOP)
                    stopped.add(p)
                except ProcessLookupError:
                    pass
            try:
                time.sleep(-balance / fraction)  # the time that earns the debt back
            finally:
                resume()
except (ProcessLookupError, FileNotFoundError):  # the target ended
    pass
finally:
    resume()
"""


def _resume(pid: int, exclude: Collection[int] = ()) -> None:
    """Continues ``pid`` and the processes it started (a helper killed mid-stop leaves them stopped)."""
    for p in [pid, *process_descendants(pid, exclude)]:
        try:
            os.kill(p, signal.SIGCONT)
        except ProcessLookupError:
            pass


class CpuThrottle(Lifecycle):
    """Holds process ``pid`` to ``fraction`` of one CPU on average by stopping and continuing it from outside.

    Example::

        with CpuThrottle(pid=stage_pid, fraction=0.25):
            ...                         # the stage now gets a quarter of one CPU, averaged over ~0.1 s

    The fallback for :class:`~lightning_dynpipe.interference.quota.CpuQuota` where cgroups are not writable
    (:class:`~lightning_dynpipe.interference.quota.CpuLimit` chooses). Like the cgroup quota it holds the
    processes the target started (a stage's refit process) within the same share (module docstring). Differences
    from a cgroup: the share is kept by stopping every one of them for a while, and a process that was stopped on
    purpose (Ctrl-Z) is continued. The target and the processes it started are always left running: by
    :meth:`stop`, by the helper's SIGTERM handler, when the helper sees its parent or the target disappear, and by
    a final SIGCONT from this process after the helper is gone.

    Args:
        pid: the process to throttle (0: this one).
        fraction: CPUs' worth of time per second, in (0, number of CPUs].
        period_s: how often the helper measures (and the shortest stop); 0.02 s by default.
        stop_timeout_s: how long :meth:`stop` waits for the helper after SIGTERM before SIGKILL.
        exclude: processes the target started that are not its helpers, left running at their own pace with
            what they started: the job's other ranks, which Lightning's default launcher starts from rank 0.
    """

    backend = "throttle"

    def __init__(
        self,
        pid: int,
        fraction: float,
        period_s: float = 0.02,
        stop_timeout_s: float = 2.0,
        exclude: Collection[int] = (),
    ) -> None:
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
        self.period_s = check_fraction("period_s", period_s, 0.001, 1.0, "Use e.g. 0.02 (20 ms).", low_open=False)
        self._children = ChildProcesses(
            "CpuThrottle", stop_timeout_s, after_stop=functools.partial(_resume, self.pid, self.exclude)
        )

    def __repr__(self) -> str:
        return f"CpuThrottle(pid={self.pid}, fraction={self.fraction:g}, period_s={self.period_s:g})"

    @property
    def active(self) -> bool:
        """Whether the controller process is running."""
        return bool(self._children.pids)

    @property
    def helper_pid(self) -> int | None:
        """The controller process's id while active."""
        pids = self._children.pids
        return pids[0] if pids else None

    def start(self) -> None:
        """Starts the controller process; a no-op if already running.

        Raises:
            InterferenceError: the process does not exist or may not be signalled.
        """
        if self._children.procs:
            return
        if not os.path.exists(f"/proc/{self.pid}"):
            raise InterferenceError(
                f"CpuThrottle: process {self.pid} does not exist. Pass the pid of a running process."
            )
        excluded = ",".join(map(str, sorted(self.exclude)))
        self._children.spawn(_THROTTLE_CODE, [[str(self.pid), repr(self.fraction), repr(self.period_s), excluded]])
        log.debug("%r started: controller pid %s", self, self.helper_pid)

    def stop(self) -> None:
        """Stops the controller and makes sure the target runs; idempotent."""
        self._children.stop()
