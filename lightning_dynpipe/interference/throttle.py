"""An outside CPU throttle: SIGSTOP/SIGCONT duty cycling that holds a process to an average CPU share.

The technique of ``cpulimit``: a controller process watches the target's CPU time (``/proc/<pid>/stat``) and
stops the target with SIGSTOP whenever it has used more than ``fraction`` CPU-seconds per second, resuming it
with SIGCONT once the debt is repaid. Like a CFS bandwidth quota it counts all threads of the process together
and carries no more than one period's unused budget forward; unlike a cgroup it needs no privileges beyond
signalling the process, and it does not cover processes the target forks.

The controller is a separate helper process, so a process may throttle itself (a stage limiting its own CPU):
a thread inside the target would be stopped together with it.
"""

from __future__ import annotations

import functools
import logging
import os
import signal

from lightning_dynpipe.interference.base import ChildProcesses, InterferenceError, Lifecycle, check_fraction

__all__ = ["CpuThrottle"]

log = logging.getLogger(__name__)

# Runs in the helper: argv = [target_pid, fraction, period_s, parent_pid]. Whatever ends it (SIGTERM, the
# target or the parent disappearing), the target is left running.
_THROTTLE_CODE = r"""
import os, signal, sys, time
pid, fraction, period, parent = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
tick = os.sysconf("SC_CLK_TCK")

def cpu():
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick  # utime + stime of all threads

def resume(*_):
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass

def on_term(*_):
    resume()
    os._exit(0)

signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us properly
try:
    last_cpu = cpu()
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
        now, used = time.monotonic(), cpu()
        balance = min(cap, balance + fraction * (now - last_wall) - (used - last_cpu))
        last_wall, last_cpu = now, used
        if balance < 0:
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(-balance / fraction)  # the time that earns the debt back
            finally:
                resume()
except (ProcessLookupError, FileNotFoundError):  # the target ended
    pass
finally:
    resume()
"""


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


class CpuThrottle(Lifecycle):
    """Holds process ``pid`` to ``fraction`` of one CPU on average by stopping and continuing it from outside.

    Example::

        with CpuThrottle(pid=stage_pid, fraction=0.25):
            ...                         # the stage now gets a quarter of one CPU, averaged over ~0.1 s

    The fallback for :class:`~lightning_dynpipe.interference.quota.CpuQuota` where cgroups are not writable
    (:class:`~lightning_dynpipe.interference.quota.CpuLimit` chooses). Differences from a cgroup: the target's
    children are not limited, and a target that was stopped on purpose (Ctrl-Z) is continued. The target is
    always left running: by :meth:`stop`, by the helper's SIGTERM handler, when the helper sees its parent or
    the target disappear, and by a final SIGCONT from this process after the helper is gone.

    Args:
        pid: the process to throttle (0: this one).
        fraction: CPUs' worth of time per second, in (0, number of CPUs].
        period_s: how often the helper measures (and the shortest stop); 0.02 s by default.
        stop_timeout_s: how long :meth:`stop` waits for the helper after SIGTERM before SIGKILL.
    """

    backend = "throttle"

    def __init__(self, pid: int, fraction: float, period_s: float = 0.02, stop_timeout_s: float = 2.0) -> None:
        self.pid = pid or os.getpid()
        cpus = os.cpu_count() or 1
        self.fraction = check_fraction(
            "fraction",
            fraction,
            0.0,
            float(cpus),
            f"Use the share of one CPU the process may use, e.g. 0.25 (at most {cpus}).",
        )
        self.period_s = check_fraction("period_s", period_s, 0.001, 1.0, "Use e.g. 0.02 (20 ms).", low_open=False)
        self._children = ChildProcesses("CpuThrottle", stop_timeout_s, after_stop=functools.partial(_resume, self.pid))

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
        self._children.spawn(_THROTTLE_CODE, [[str(self.pid), repr(self.fraction), repr(self.period_s)]])
        log.debug("%r started: controller pid %s", self, self.helper_pid)

    def stop(self) -> None:
        """Stops the controller and makes sure the target runs; idempotent."""
        self._children.stop()
