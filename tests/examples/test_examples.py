"""The examples run end to end: real processes through the default popen launcher, tiny sizes.

Each test starts the script in a fresh interpreter (``python examples/<script>.py ...``), exactly as a user
or ``make demo`` does, so the launcher re-runs the script for rank 1. About 15-30 s each on 2 CPU cores,
most of it process start-up.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 300


def _load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Loaded at collection: importing torch sets environment variables, which the suite's leak check would
# otherwise blame on the test.
schedule_timelines = _load_example("schedule_timelines")


_LAUNCH_ENV = ("MASTER_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK", "TORCHELASTIC_", "PL_")


def _run(script: str, *args: str) -> str:
    # A clean launch environment: rank variables inherited from a surrounding job would make Lightning think
    # the processes were already created.
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_ENV)}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{out[-4000:]}"
    return out


def _test_accuracy(out: str) -> float:
    m = re.search(r"^test accuracy: ([0-9.]+)", out, re.MULTILINE)
    assert m is not None, f"no 'test accuracy:' line in the output:\n{out[-4000:]}"
    return float(m.group(1))


@pytest.mark.multiprocess
def test_mnist_demo_tiny_prints_stage_table_and_test_accuracy() -> None:
    out = _run(
        "mnist_demo.py",
        "--max-epochs", "1",
        "--width", "32",
        "--depth", "1",
        "--batch-size", "32",
        "--num-microbatches", "4",
        "--limit-train-batches", "12",
        "--print-every", "6",
    )
    # One table per 6 steps (two in 12 steps), printed once (rank 0 only), with one row per stage.
    assert out.count("[per-stage step times") == 2, out[-4000:]
    header = next(line for line in out.splitlines() if line.lstrip().startswith("stage rank"))
    for column in ("step", "fwd", "bwd", "wait", "send"):
        assert column in header.split()
    rows = re.findall(r"^\s+(\d)\s+(\d)\s+(?:[0-9.]+\s+){6}", out, re.MULTILINE)
    assert sorted(set(rows)) == [("0", "1"), ("1", "0")], "stage 0 on rank 1, the last stage on rank 0"
    # 4 micro-batches per step: every stage forwards 4 and, in steady state, backwards and updates 4 per step.
    assert re.search(r"^\s+1\s+0\s+(?:[0-9.]+\s+){6}4\.0\s+4\.0\s+4\.0", out, re.MULTILINE), out[-4000:]
    acc = _test_accuracy(out)
    assert 0.0 <= acc <= 1.0
    assert out.count("test accuracy:") == 1  # rank 0 only


@pytest.mark.multiprocess
def test_digits_quickstart_trains_to_a_useful_accuracy() -> None:
    out = _run("digits_quickstart.py")
    # 5 epochs of the 2-stage async pipeline; the same script under a plain single-process Trainer also
    # reaches > 0.9, so this catches a pipeline that does not learn, not small numeric differences.
    assert _test_accuracy(out) > 0.85
    assert "DynPipe: 2 stages" in out


def test_schedules_doc_embeds_the_current_timelines() -> None:
    """docs/schedules.md shows the output of examples/schedule_timelines.py; regenerate it when this fails."""
    doc = (ROOT / "docs" / "schedules.md").read_text()
    m = re.search(r"<!-- schedule_timelines:begin -->\n```text\n(.*?)\n```\n<!-- schedule_timelines:end -->", doc, re.DOTALL)
    assert m is not None, "docs/schedules.md lost its schedule_timelines block"
    assert m.group(1) == schedule_timelines.report(), (
        "docs/schedules.md is out of date: paste the output of `python examples/schedule_timelines.py` "
        "between the schedule_timelines markers."
    )
