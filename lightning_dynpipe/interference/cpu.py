"""CPU hogs pinned to chosen cores, and pinning a stage's process to its cores.

A hog is one busy-loop process per core, pinned with ``sched_setaffinity``, that spins for
``duty_cycle * period_s`` (wall time) and sleeps for the rest of each period. On a core it shares with a busy
stage, the default scheduler splits the core evenly while the hog spins, so the stage keeps roughly
``1 - duty_cycle / 2`` of it: the co-located-job interference DynPipe adapts to.
"""

from __future__ import annotations

import abc
import logging
import os
from collections.abc import Iterable, Sequence

from lightning_dynpipe.interference.base import ChildProcesses, InterferenceConfigError, Lifecycle, check_fraction

__all__ = ["CpuHog", "CpuBursts", "pin_current_process", "pin_process", "allowed_cores"]

log = logging.getLogger(__name__)

# Runs in each helper: argv = [core, duty_cycle, period_s, parent_pid]. Exits when the parent is gone.
_HOG_CODE = r"""
import os, sys, time
core, duty, period, parent = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
try:
    os.sched_setaffinity(0, {core})
except OSError as exc:
    sys.stderr.write(f"cannot pin to core {core}: {exc}")
    sys.exit(3)
sys.stdout.write("ready\n")
sys.stdout.flush()
busy = duty * period
idle = period - busy
clock = time.perf_counter
while os.getppid() == parent:
    end = clock() + busy
    while clock() < end:
        pass
    if idle > 0:
        time.sleep(idle)
"""

# Runs in the bursts helper: argv = [cores, shortest, longest, max_gap, seed, parent_pid]. Exits when the parent is
# gone.
_BURSTS_CODE = r"""
import os, random, sys, time
cores = [int(c) for c in sys.argv[1].split(",")]
shortest, longest, max_gap = float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
rng, parent = random.Random(int(sys.argv[5])), int(sys.argv[6])
try:
    os.sched_setaffinity(0, {cores[0]})
except OSError as exc:
    sys.stderr.write(f"cannot pin to core {cores[0]}: {exc}")
    sys.exit(3)
sys.stdout.write("ready\n")
sys.stdout.flush()
clock = time.perf_counter
while os.getppid() == parent:
    time.sleep(rng.uniform(0.0, max_gap))
    os.sched_setaffinity(0, {rng.choice(cores)})
    end = clock() + rng.uniform(shortest, longest)
    while clock() < end:
        pass
"""


def allowed_cores(pid: int = 0) -> list[int]:
    """The cores ``pid`` (0: this process) may run on, sorted."""
    return sorted(os.sched_getaffinity(pid))


def _check_cores(cores: Iterable[int], what: str) -> list[int]:
    cores = list(cores)
    existing = os.cpu_count() or 1
    fix = f"Pass distinct core ids in [0, {existing - 1}] (this process may use {allowed_cores()})."
    if not cores:
        raise InterferenceConfigError(f"{what} needs at least one core; got an empty list. {fix}", field="cores")
    bad = [c for c in cores if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < existing]
    if bad:
        raise InterferenceConfigError(
            f"{what}: cores {bad} do not exist on this machine ({existing} cores). {fix}", field="cores"
        )
    if len(set(cores)) != len(cores):
        raise InterferenceConfigError(f"{what}: cores must be distinct; got {cores}. {fix}", field="cores")
    return cores


def pin_process(pid: int, cores: Sequence[int]) -> list[int]:
    """Restricts every thread of process ``pid`` to ``cores``; returns the cores it was allowed on before.

    ``os.sched_setaffinity(pid, ...)`` only changes the thread whose id is ``pid``; threads that already run
    (intra-op pools, P2P receiver threads) keep their mask, so this sets it on each thread in ``/proc/pid/task``.
    Threads started later inherit the mask of the thread that starts them.
    """
    cores = _check_cores(cores, "pin_process")
    real_pid = pid or os.getpid()
    before = allowed_cores(real_pid)
    mask = set(cores)
    for tid in os.listdir(f"/proc/{real_pid}/task"):
        try:
            os.sched_setaffinity(int(tid), mask)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return before


def pin_current_process(cores: Sequence[int]) -> list[int]:
    """Pins every thread of this process to ``cores`` (benchmarks pin each stage to its own core).

    Returns the previous cores, so the pinning can be undone with ``pin_current_process(previous)``.

    Example::

        >>> previous = pin_current_process([0])
        >>> allowed_cores()
        [0]
        >>> _ = pin_current_process(previous)
    """
    return pin_process(0, cores)


class _BusyHelpers(Lifecycle):
    """A source made of busy-loop helper processes: each runs :attr:`_code` with one of :meth:`_argv_sets`."""

    _code: str
    _children: ChildProcesses

    @abc.abstractmethod
    def _argv_sets(self) -> list[list[str]]:
        """One argument list per helper process."""

    @property
    def active(self) -> bool:
        """Whether the helper processes are running."""
        return bool(self._children.pids)

    @property
    def pids(self) -> list[int]:
        """Process ids of the running helpers, in the order they were started."""
        return self._children.pids

    def start(self) -> None:
        """Starts the helpers; a no-op if already running.

        Raises:
            InterferenceError: a helper could not start (e.g. pinning refused); none is left running.
        """
        if self._children.procs:
            return
        self._children.spawn(self._code, self._argv_sets())
        log.debug("%r started: pids %s", self, self.pids)

    def stop(self) -> None:
        """Stops every helper process (SIGTERM, then SIGKILL); idempotent."""
        if self._children.procs:
            log.debug("%r stopping: pids %s", self, self.pids)
        self._children.stop()


class CpuHog(_BusyHelpers):
    """Busy-loop processes pinned to ``cores``: a co-located job stealing CPU from a stage.

    Example::

        with CpuHog(cores=[1], duty_cycle=0.5):
            train_some_steps()          # the stage pinned to core 1 now shares it with the hog

        hog = CpuHog(cores=allowed_cores())    # or explicitly
        hog.start(); ...; hog.stop()

    One helper process per core (a ``sys.executable -c`` subprocess: nothing of the parent is imported or
    inherited), pinned to that core, busy for ``duty_cycle * period_s`` then asleep for the rest of each period.
    :meth:`stop` is idempotent, sends SIGTERM then SIGKILL after ``stop_timeout_s``, and also runs when the
    object is garbage-collected and at interpreter exit; a helper whose parent died exits within one period.

    Args:
        cores: the cores to burn, one process each.
        duty_cycle: share of each period the helper spins, in (0, 1].
        period_s: length of one busy + idle cycle in seconds.
        stop_timeout_s: how long :meth:`stop` waits after SIGTERM before SIGKILL.
    """

    _code = _HOG_CODE

    def __init__(
        self, cores: Sequence[int], duty_cycle: float = 1.0, period_s: float = 0.05, stop_timeout_s: float = 2.0
    ) -> None:
        self.cores = _check_cores(cores, "CpuHog")
        self.duty_cycle = check_fraction(
            "duty_cycle", duty_cycle, 0.0, 1.0, "Use 1.0 for a core fully busy, 0.5 for half of each period."
        )
        self.period_s = check_fraction("period_s", period_s, 0.0, 60.0, "Use e.g. 0.05 (50 ms).")
        self._children = ChildProcesses("CpuHog", stop_timeout_s)

    def __repr__(self) -> str:
        return f"CpuHog(cores={self.cores}, duty_cycle={self.duty_cycle:g}, period_s={self.period_s:g})"

    def _argv_sets(self) -> list[list[str]]:  # one helper per core
        return [[str(c), repr(self.duty_cycle), repr(self.period_s)] for c in self.cores]


class CpuBursts(_BusyHelpers):
    """A bursty neighbour: one process that busy-loops for short bursts on a random one of ``cores``, with random
    gaps between them. Every core gets the same load on average, so no stage is slower for long: the noise a
    repartition policy must not move on, though a window of a fast model may read one burst as another process's
    load on a stage's core.

    Example::

        with CpuBursts(cores=allowed_cores(), seed=0):     # bursts of 10-150 ms, 0-300 ms apart
            trainer.fit(model)

    Each burst lasts a uniform ``[shortest_s, longest_s]`` on a core drawn uniformly from ``cores``, after a gap
    drawn uniformly from ``[0, max_gap_s]``: on average the bursts take a share ``mean burst / (mean burst + mean
    gap)`` of one core, spread evenly over ``cores`` (with the defaults 80 / 230 ms, 35%: 17% of each of two cores);
    ``seed`` fixes the sequence. The helper is stopped like :class:`CpuHog`'s.

    Args:
        cores: the cores the bursts land on.
        shortest_s: the shortest burst, in seconds.
        longest_s: the longest burst, in seconds (>= ``shortest_s``).
        max_gap_s: the longest pause between two bursts, in seconds.
        seed: the random sequence of gaps, bursts and cores.
        stop_timeout_s: how long :meth:`stop` waits after SIGTERM before SIGKILL.
    """

    _code = _BURSTS_CODE

    def __init__(
        self,
        cores: Sequence[int],
        shortest_s: float = 0.01,
        longest_s: float = 0.15,
        max_gap_s: float = 0.3,
        seed: int = 0,
        stop_timeout_s: float = 2.0,
    ) -> None:
        self.cores = _check_cores(cores, "CpuBursts")
        fix = "Use e.g. shortest_s=0.01, longest_s=0.15, max_gap_s=0.3."
        self.shortest_s = check_fraction("shortest_s", shortest_s, 0.0, 60.0, fix)
        self.longest_s = check_fraction("longest_s", longest_s, 0.0, 60.0, fix)
        if self.longest_s < self.shortest_s:
            raise InterferenceConfigError(
                f"CpuBursts needs longest_s >= shortest_s; got {longest_s} < {shortest_s}. {fix}", field="longest_s"
            )
        self.max_gap_s = check_fraction("max_gap_s", max_gap_s, 0.0, 60.0, fix, low_open=False)
        self.seed = int(seed)
        self._children = ChildProcesses("CpuBursts", stop_timeout_s)

    def __repr__(self) -> str:
        return (
            f"CpuBursts(cores={self.cores}, shortest_s={self.shortest_s:g}, longest_s={self.longest_s:g}, "
            f"max_gap_s={self.max_gap_s:g}, seed={self.seed})"
        )

    def _argv_sets(self) -> list[list[str]]:  # one helper that moves between the cores
        cores = ",".join(map(str, self.cores))
        return [[cores, repr(self.shortest_s), repr(self.longest_s), repr(self.max_gap_s), str(self.seed)]]
