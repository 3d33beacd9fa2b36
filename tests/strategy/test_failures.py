"""Failures end cleanly: every rank stops within 60 s (not at the 30-minute collective timeout), and the error
names the stage and rank that failed first. Runs the real popen launcher through a script."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.multiprocess
SCRIPT = Path(__file__).parent / "scripts" / "failing_fit.py"


def _start(mode: str, *, one_thread: bool = True, **popen: Any) -> subprocess.Popen[str]:
    """The script in ``mode``, in a new session (so that the whole process group can be inspected and killed), its
    output on a pipe; without the launcher's variables of the environment it runs in."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    if one_thread:
        env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **popen,
    )


def _run(mode: str) -> tuple[int, str, float]:
    t0 = time.monotonic()
    proc = _start(mode)
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
    return proc.returncode, out, time.monotonic() - t0


def _no_survivors(marker: str) -> None:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not [line for line in ps.splitlines() if "failing_fit.py" in line and marker in line]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # the last stage raises, and the launching process goes on after fit until the other rank has ended:
        # Lightning's child-process observer would SIGKILL it then (exit -9, no traceback)
        ("last-exception-slow-exit", "Stage 1 (rank 0) failed first: ValueError: boom in training_step"),
        ("first-exception", "Stage 0 (rank 1) failed first: RuntimeError: boom in stage 0's layer"),
        ("first-sigkill", "stage 0 (rank 1)"),
        # the last stage is in a callback's barrier when stage 0 fails: gloo's "Connection closed by peer" there
        # carries a note with the failure that caused it (stage 0's ABORT, read from its channel)
        (
            "first-update-exception",
            "this error followed another stage's failure. Stage 0 (rank 1) failed first: RuntimeError: boom in "
            "stage 0's update",
        ),
        # refused at the start of the step, before stage 0 sends anything: the last stage learns it from its receive
        (
            "finetune-group",
            "Stage 0 (rank 1) failed first: ConfigurationError: The optimizer's parameters changed during fit: on "
            "stage 0 its groups hold [0, 2] parameters",
        ),
    ],
)
def test_a_failing_stage_ends_every_rank(mode: str, expected: str) -> None:
    code, out, elapsed = _run(mode)
    assert code != 0
    if (
        mode.endswith("exception") or mode == "finetune-group"
    ):  # the process that called fit ends like any failed Python program
        assert code == 1, f"exit code {code}: {out[-2000:]}"
        assert "terminate called" not in out and "Traceback" in out
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert expected in out, out[-4000:]
    _no_survivors(mode)


def _signal_once_training(signum: int, **start: Any) -> tuple[float, str]:
    """Starts ``long``, sends ``signum`` to the main process once it trains; seconds until every rank ended, and the
    output. Fails the test if the run is still going 60 s later."""
    proc = _start("long", **start)
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:  # wait until the pipeline is set up and training (rank 0 after step 2)
            seen.append(line)
            if "TRAINING STARTED" in line:
                break
        time.sleep(2)
        proc.send_signal(signum)  # to the main process only, as Ctrl-C on a non-interactive run or a scheduler
        t0 = time.monotonic()
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            survivors = subprocess.run(
                ["ps", "-o", "pid,stat,etimes,args", "-g", str(proc.pid)], capture_output=True, text=True
            )
            os.killpg(proc.pid, 9)
            rest, _ = proc.communicate()
            pytest.fail(
                f"still running 60 s after signal {signum}:\n{survivors.stdout}\n{(''.join(seen) + rest)[-4000:]}"
            )
        elapsed = time.monotonic() - t0
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
    time.sleep(1)
    _no_survivors("long")
    return elapsed, "".join(seen) + rest


def test_keyboard_interrupt_on_the_main_process_stops_the_others() -> None:
    elapsed, _ = _signal_once_training(
        signal.SIGINT,
        one_thread=False,
        # A child inherits an ignored SIGINT, and Python then installs no KeyboardInterrupt handler: give the
        # run the default disposition a terminal's Ctrl-C meets, whatever the test runner's is.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert elapsed < 30, f"took {elapsed:.0f} s"


def test_sigterm_on_the_main_process_stops_every_rank() -> None:
    # Lightning's SIGTERM handler broadcasts from inside the handler; with no collective at every batch to pair
    # with, a rank hung there (1 run in 4) until that broadcast was taken out
    elapsed, out = _signal_once_training(signal.SIGTERM)
    assert elapsed < 30, f"took {elapsed:.0f} s"
    assert "Training was interrupted" in out, out[-4000:]  # every rank's fit ended by Lightning's SIGTERM path


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left to a parent that does not reap it has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_the_rank_processes_end_when_the_launching_process_is_killed() -> None:
    """The spawn launcher's ranks are children of a launching process that does not train: when that process is
    killed with SIGKILL (nothing can run in it), the ranks end within seconds instead of waiting for their peers'
    messages forever. The run starts with SIGINT ignored, as under ``nohup`` or in a background job: the SIGINT that
    torch's spawn asks the kernel to send a child whose parent dies is then ignored too."""
    proc = _start("long-spawn", preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    ranks: list[int] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "TRAINING STARTED" in line:
                break
        ps = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(proc.pid)], capture_output=True, text=True)
        ranks = [int(line.split()[0]) for line in ps.stdout.splitlines() if "spawn_main" in line]
        assert len(ranks) == 2, ps.stdout
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in ranks if _running(pid)], "rank processes still running 20 s after the kill"
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
