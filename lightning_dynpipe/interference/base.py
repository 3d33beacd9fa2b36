"""What every interference source shares: the start/stop protocol, the exceptions, and child-process hygiene.

An interference source is anything with ``start()``, ``stop()`` and ``active``; :class:`Lifecycle` adds the
context-manager form. Sources that launch helper processes keep them in a :class:`ChildProcesses` set, whose
``stop`` is idempotent, terminates then kills, and also runs from a :func:`weakref.finalize` finaliser (which
Python calls at exit too), so a helper never outlives the object that started it, nor the interpreter. The
helpers additionally exit on their own when their parent process disappears (``os.getppid()`` changes), which
covers a parent killed with SIGKILL.
"""

from __future__ import annotations

import abc
import logging
import os
import select
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Protocol, runtime_checkable

from typing_extensions import Self

from lightning_dynpipe.errors import ConfigurationError, DynPipeError

__all__ = [
    "Interference",
    "Lifecycle",
    "InterferenceError",
    "InterferenceUnavailable",
    "InterferenceConfigError",
    "ChildProcesses",
]

log = logging.getLogger(__name__)


class InterferenceError(DynPipeError, RuntimeError):
    """An interference source failed to start or to stop."""


class InterferenceUnavailable(InterferenceError):
    """This machine cannot provide the requested interference (no writable cgroup CPU controller, no CUDA, ...)."""


class InterferenceConfigError(ConfigurationError):
    """An interference argument or schedule entry that breaks a rule.

    Attributes:
        field: the offending field (``None`` when the error concerns the entry as a whole).
        entry: index of the schedule entry (``None`` outside a schedule).
    """

    def __init__(self, message: str, field: str | None = None, entry: int | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.entry = entry


@runtime_checkable
class Interference(Protocol):
    """Something that slows a stage down between :meth:`start` and :meth:`stop`.

    ``stop`` must be idempotent and must release everything ``start`` acquired (processes, threads, cgroups,
    channel hooks), also when called after a failed ``start``.
    """

    @property
    def active(self) -> bool:
        """Whether the interference is running."""
        ...

    def start(self) -> None:
        """Starts the interference; raises :class:`InterferenceUnavailable` where the machine cannot."""
        ...

    def stop(self) -> None:
        """Stops the interference and releases its resources; a no-op when not running."""
        ...


class Lifecycle(abc.ABC):
    """Mix-in: ``with source: ...`` starts and stops an :class:`Interference`."""

    @abc.abstractmethod
    def start(self) -> None:
        """Starts the interference."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stops it (idempotent)."""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def check_fraction(name: str, value: float, low: float, high: float, fix: str, *, low_open: bool = True) -> float:
    """``value`` as a float in ``(low, high]`` (or ``[low, high]``), else :class:`InterferenceConfigError`."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InterferenceConfigError(f"{name} must be a number; got {value!r}. {fix}", field=name) from None
    ok = (low < v if low_open else low <= v) and v <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise InterferenceConfigError(
            f"{name} must be in {bracket}{low:g}, {high:g}]; got {value!r}. {fix}", field=name
        )
    return v


def _stop_children(
    procs: list[subprocess.Popen[bytes]], timeout_s: float, after: Callable[[], None] | None = None
) -> None:
    """Terminates ``procs``, kills what is left after ``timeout_s``, reaps all, then runs ``after``. Never raises."""
    for p in procs:
        if p.poll() is None:
            try:
                p.terminate()
            except OSError:  # already gone
                pass
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                p.kill()
            except OSError:
                pass
            try:
                p.wait(5.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process that survives SIGKILL for 5 s
                log.error("Interference helper process %d did not exit after SIGKILL.", p.pid)
        for stream in (p.stdin, p.stdout, p.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
    procs.clear()
    if after is not None:
        try:
            after()
        except Exception:  # pragma: no cover - the hook's own errors must not stop the clean-up
            log.exception("Interference clean-up hook failed.")


class ChildProcesses:
    """Helper processes running a Python snippet, stopped for sure (``stop``, garbage collection, exit).

    Each helper gets ``argv = [code, *args, parent_pid]`` and must write one line ``ready`` to stdout once set
    up (or exit non-zero with a reason on stderr), and should exit by itself when ``os.getppid()`` is no longer
    ``parent_pid``.

    Args:
        what: a name for messages, e.g. ``"CpuHog"``.
        stop_timeout_s: how long ``stop`` waits after SIGTERM before SIGKILL.
        after_stop: runs after the helpers are gone (also from the finaliser); must not reference the owner.
    """

    def __init__(self, what: str, stop_timeout_s: float = 2.0, after_stop: Callable[[], None] | None = None) -> None:
        self.what = what
        self.stop_timeout_s = stop_timeout_s
        self.after_stop = after_stop
        self.procs: list[subprocess.Popen[bytes]] = []
        self._finalizer: weakref.finalize[..., ChildProcesses] | None = None

    @property
    def pids(self) -> list[int]:
        """Process ids of the running helpers."""
        return [p.pid for p in self.procs if p.poll() is None]

    def spawn(
        self, code: str, argv_sets: Sequence[Sequence[str]], ready_timeout_s: float = 30.0, stdin: bool = False
    ) -> None:
        """Starts one helper per entry of ``argv_sets`` and waits until each said ``ready``.

        Raises:
            InterferenceError: a helper exited or stayed silent; every helper started is stopped first.
        """
        if self._finalizer is None or not self._finalizer.alive:
            # The finaliser holds the list, never ``self``: it runs at garbage collection and at exit.
            self._finalizer = weakref.finalize(self, _stop_children, self.procs, self.stop_timeout_s, self.after_stop)
        parent = str(os.getpid())
        for argv in argv_sets:
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-I", "-c", code, *argv, parent],
                    stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    close_fds=True,
                )
            )
        deadline = time.monotonic() + ready_timeout_s
        for p in self.procs[-len(argv_sets) :] if argv_sets else []:
            assert p.stdout is not None
            ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = p.stdout.readline() if ready else b""
            if line.strip() != b"ready":
                silent = f"no reply within {ready_timeout_s:.0f} s" if not ready else "no reason given"
                reason = _stderr_of(p) or silent
                args = [str(a) for a in p.args][4:-1]  # type: ignore[union-attr]
                self.stop()
                raise InterferenceError(
                    f"{self.what} helper process (arguments {args}) failed to start: {reason}. "
                    "Check the arguments (e.g. cores that exist on this machine) and that the Python interpreter "
                    f"{sys.executable} can be started."
                )

    def stop(self) -> None:
        """Terminates (then kills) every helper and reaps it; idempotent."""
        if self._finalizer is not None and self._finalizer.alive:
            self._finalizer()
        elif self.procs:
            _stop_children(self.procs, self.stop_timeout_s, self.after_stop)


def _stderr_of(p: subprocess.Popen[bytes]) -> str:
    """The helper's stderr once it has exited ("" while it still runs: reading would block)."""
    if p.stderr is None:
        return ""
    try:
        p.wait(1.0)
    except subprocess.TimeoutExpired:
        return ""
    try:
        return p.stderr.read().decode(errors="replace").strip()
    except (OSError, ValueError):
        return ""
