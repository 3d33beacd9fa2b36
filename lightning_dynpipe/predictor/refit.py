"""Forest refits in a child process, so that a refit never holds the training process's GIL.

A refit in a background thread of the training process, even at the lowest CPU priority, stalls the pipeline
when its core is contended: the refit thread holds the GIL through scikit-learn's and numpy's Python code, the
OS scheduler gives a nice-19 thread about 1.5% of a core shared with a nice-0 process (another job's busy loop),
and the training thread, woken by a message, waits for the GIL until the refit thread is scheduled again. A
forest refitting every 50 steps on a stage with a CPU hog on its core made steps of 50 ms take 200-480 ms; a
thread doing forest fits beside a loop of convolution steps with a hog on the same core cut the steps done in
12 s from 383 to 159, with stalls up to 1.5 s. A child process has its own GIL.

:class:`RefitProcess` runs :func:`main` in a new Python process once (it imports numpy, scikit-learn
and this package's pure predictor modules, not torch), at nice 19 and, on Linux, ``SCHED_IDLE``, with one thread;
the strategy starts it at set-up and waits for its ``ready`` line (its imports done: :meth:`RefitProcess.wait_ready`,
called by :meth:`ForestPredictor.prepare <lightning_dynpipe.predictor.ForestPredictor.prepare>`), else
:meth:`ForestPredictor.observe <lightning_dynpipe.predictor.ForestPredictor.observe>` starts it at the first window, so
that it has imported scikit-learn when the first refit is due. A request is a file of pickled rows and forest
settings and a line on the child's stdin naming it; the child fits, writes the pickled forests to a result file and
answers with one line on its stdout (with the request's CPU seconds: :attr:`RefitProcess.cpu_s`). The parent reads
that line without blocking (:meth:`RefitProcess.done`) and loads the result file when it adopts the refit. The files
live in a private temporary directory and are written only by this process and its child: nothing is loaded from
anywhere else. Whichever ends first removes the directory: the parent in :meth:`RefitProcess.close`, the child when
its input ends, which is also what happens when the parent is killed (a rank lost to a failure leaves no directory
behind).
"""

from __future__ import annotations

import os
import pickle
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

__all__ = ["RefitProcess", "main"]


class RefitProcess:
    """One child process that fits forests on request, one request at a time.

    Example::

        worker = RefitProcess()
        worker.submit({"n_estimators": 32, ...}, samples)   # returns at once
        ...
        if worker.done():
            stage, boundary = worker.result()
        worker.close()
    """

    def __init__(self, cores: Literal["own", "any"] = "own") -> None:
        if cores not in ("own", "any"):
            raise ValueError(f"RefitProcess(cores=...) takes 'own' or 'any'; got {cores!r}.")
        self.cores = cores
        """``"own"``: the child runs on the cores its parent may use; ``"any"``: on every core this machine lets it
        use (a cpuset still restricts it), so its idle-priority work can take an idle core of another stage."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._pending: Path | None = None
        self._answered = False
        self._ready = False  # the child's first line, "ready", was read
        self._count = 0
        self.cpu_s = 0.0
        """CPU seconds the child spent on the requests it answered (reading, fitting, writing), all children."""

    def start(self) -> None:
        """Starts the child now (it takes about a second to import scikit-learn), if it is not running."""
        self._start()

    def wait_ready(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for the child to finish its imports; whether it has.

        The child announces it with its first line. Until then it is importing (about 1.3 s of CPU here), and at
        the lowest priority beside running stages those imports spread over many steps, where they cost the
        stages far more wall time than their CPU (the caches and the cores' idle moments they take).
        """
        proc = self._start()
        if not self._ready:
            assert proc.stdout is not None
            readable, _, _ = select.select([proc.stdout], [], [], max(0.0, timeout_s))
            if readable:
                self._read_ready()
        return self._ready

    def _read_ready(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(
                f"The forest refit process did not start (exit code {self._proc.poll()}, said {line!r}); see its "
                "stderr."
            )
        self._ready = True

    def _start(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self.close()  # a child that ended: its pipes and files go before a new one starts
        self._dir = Path(tempfile.mkdtemp(prefix="dynpipe-refit-"))
        self._ready = False
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from lightning_dynpipe.predictor.refit import main; main()",
                str(self._dir),
                self.cores,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: a line read never pulls the next one out of select()'s sight
            env=env,
        )
        from lightning_dynpipe.monitor.stats import register_helper  # pure: the child imports no torch

        register_helper(self._proc.pid)  # the monitor counts its CPU as this process's, not as other load
        return self._proc

    @property
    def busy(self) -> bool:
        """Whether a request was submitted and its result not taken yet."""
        return self._pending is not None

    def submit(self, params: dict[str, Any], samples: Any) -> None:
        """Asks the child to fit ``ForestPredictor(**params)``'s two forests on ``samples``; returns at once."""
        if self._pending is not None:
            raise RuntimeError("RefitProcess.submit: the previous request's result was not taken yet.")
        proc = self._start()
        assert self._dir is not None and proc.stdin is not None
        self._count += 1
        request = self._dir / f"request-{self._count}.pkl"
        request.write_bytes(pickle.dumps((params, samples), protocol=pickle.HIGHEST_PROTOCOL))
        proc.stdin.write(f"{request}\n".encode())
        proc.stdin.flush()
        self._pending, self._answered = request, False

    def done(self) -> bool:
        """Whether the child has answered the pending request (never blocks)."""
        if self._pending is None:
            return False
        assert self._proc is not None and self._proc.stdout is not None
        while not self._answered and select.select([self._proc.stdout], [], [], 0)[0]:
            if self._ready:
                self._read_answer()
            else:
                self._read_ready()
        return self._answered

    def _read_answer(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        if not self._ready:
            self._read_ready()
        line = self._proc.stdout.readline()  # one short line, written at once
        if not line:
            raise RuntimeError(f"The forest refit process ended (exit code {self._proc.wait()}); see its stderr.")
        self._answered = True
        _, _, cpu = line.decode().partition(" ")
        try:
            self.cpu_s += float(cpu)
        except ValueError:  # an answer without its CPU time: nothing to add
            pass

    def result(self) -> Any:
        """The pending request's result, waiting for it if needed.

        Raises:
            RuntimeError: the child failed (its error is in the message) or ended.
        """
        if self._pending is None:
            raise RuntimeError("RefitProcess.result: nothing was submitted.")
        request, self._pending = self._pending, None
        if not self._answered:
            self._read_answer()
        answer = request.with_suffix(".out")
        try:
            ok, value = pickle.loads(answer.read_bytes())
        finally:
            request.unlink(missing_ok=True)
            answer.unlink(missing_ok=True)
        if not ok:
            raise RuntimeError(f"The forest refit failed in its process: {value}")
        return value

    def close(self) -> None:
        """Ends the child and removes its files; a later :meth:`submit` starts a new one.

        The child is killed, not asked to end: it holds nothing but a refit whose answer is no longer wanted and
        the files this removes, and at the lowest CPU priority its own exit (its imports' teardown, or the rest of
        its imports and a refit in progress first) took 0.5-3 s of the caller's time."""
        proc, self._proc = self._proc, None
        if proc is not None:
            from lightning_dynpipe.monitor.stats import unregister_helper

            unregister_helper(proc.pid)
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    try:
                        pipe.close()
                    except OSError:  # unflushed input for a child that is gone
                        pass
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._pending, self._answered, self._ready = None, False, False


def main() -> None:
    """The child: says ``ready`` once imported; then one request path per stdin line; writes ``(ok, forests or
    error)`` next to it and answers a line (``done <CPU seconds the request took>``).

    Its arguments are the parent's private directory, removed when stdin ends (the parent closed it, or died), and
    ``own`` or ``any`` (:attr:`RefitProcess.cores`). A
    parent that went away without reading its answers (it exited without :meth:`ForestPredictor.close
    <lightning_dynpipe.predictor.forest.ForestPredictor.close>`) ends it quietly.
    """
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    if len(sys.argv) > 2 and sys.argv[2] == "any":
        _any_core()
    answers = os.fdopen(os.dup(1), "wb")  # the answers' own descriptor: a stray print goes to stderr instead
    os.dup2(2, 1)
    try:
        _serve(answers)
    except BrokenPipeError:  # the parent is gone: nobody reads the answers
        try:
            answers.close()  # now, not at exit, where the unflushed answer would fail again
        except OSError:
            pass
    if directory is not None and directory.name.startswith("dynpipe-refit-"):
        shutil.rmtree(directory, ignore_errors=True)


def _serve(answers: Any) -> None:
    """Imports, says ``ready``, then answers each request line until stdin ends (see :func:`main`)."""
    _lowest_priority()
    from lightning_dynpipe.predictor.forest import ForestPredictor, _sklearn_forest

    _sklearn_forest()  # imported before the first request arrives
    answers.write(b"ready\n")
    answers.flush()
    for line in sys.stdin.buffer:
        request = Path(line.decode().strip())
        cpu0 = time.process_time()
        try:
            params, samples = pickle.loads(request.read_bytes())
            value: Any = (True, ForestPredictor(**params).fit_pair(samples))
        except Exception as exc:  # reported to the parent, which keeps its current forest
            value = (False, f"{type(exc).__name__}: {exc}")
        request.with_suffix(".out").write_bytes(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        answers.write(f"done {time.process_time() - cpu0:.6f}\n".encode())
        answers.flush()


def _any_core() -> None:
    """Lets this process run on every core of the machine that its cgroup's cpuset allows: the kernel keeps the
    allowed ones of the mask. A stage pinned to its core passes that pin to its children; at the lowest priority a
    refit then takes only its own stage's idle moments, even where another stage's core stands idle (a stage
    held to a quarter of its core by a CPU limit leaves three quarters of it)."""
    setaffinity = getattr(os, "sched_setaffinity", None)
    if setaffinity is not None:
        try:
            setaffinity(0, range(os.cpu_count() or 1))
        except OSError:
            pass


def _lowest_priority() -> None:
    """Nice 19 and, on Linux, ``SCHED_IDLE``: the refit then runs only in the time the stages leave, and a stage
    thread that wakes up (a message arrived) takes the core from it at once. Under nice 19 alone the scheduler may
    let the refit finish its time slice first, and the stage's main thread waits for its core."""
    try:
        os.nice(19)
    except OSError:
        pass
    idle = getattr(os, "SCHED_IDLE", None)
    if idle is not None:
        try:
            os.sched_setscheduler(0, idle, os.sched_param(0))
        except OSError:
            pass
