"""The examples run end to end: real processes through the default popen launcher, tiny sizes.

Each test starts the script in a fresh interpreter (``python examples/<script>.py ...``), exactly as a user
or ``make demo`` does, so the launcher re-runs the script for rank 1. About 15-30 s each on 2 CPU cores,
most of it process start-up.
"""

from __future__ import annotations

import importlib.util
import math
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


def _stage_tables(out: str) -> list[tuple[str, list[dict[str, str]]]]:
    """The ``PipelineSnapshot.table()`` blocks in ``out``: (title, one {header: cell} dict per stage row)."""
    lines = out.splitlines()
    tables = []
    for i, line in enumerate(lines):
        if not line.startswith("DynPipe stages at step "):
            continue
        header = lines[i + 1].split("  ")
        header = [h.strip() for h in header if h.strip()]  # headers may contain one space ("recv wait")
        rows = []
        for row in lines[i + 2 :]:
            cells = row.split()
            if len(cells) != len(header) or not cells[0].rstrip("*").isdigit():
                break
            rows.append(dict(zip(header, cells)))
        tables.append((line, rows))
    return tables


@pytest.mark.multiprocess
def test_mnist_demo_tiny_prints_stage_table_and_test_accuracy() -> None:
    out = _run(
        "mnist_demo.py",
        "--max-epochs",
        "1",
        "--width",
        "32",
        "--depth",
        "1",
        "--batch-size",
        "32",
        "--num-microbatches",
        "4",
        "--limit-train-batches",
        "20",
        "--print-every",
        "10",
    )
    # Rank 0 (the last stage) prints where the stages run, from the strategy's topology, once.
    assert out.count("stage placement: stage 0 on rank 1, stage 1 on rank 0\n") == 1, out[-4000:]
    # The stage monitor snapshots every 10 steps; the demo prints the snapshots of steps 10 and 20 (the last
    # one published at the end of training), once each (rank 0 only), one row per stage.
    tables = _stage_tables(out)
    assert [title.split(" (")[0] for title, _ in tables] == [
        "DynPipe stages at step 10, balance [1, 1]",  # depth 1: two layers, one per stage
        "DynPipe stages at step 20, balance [1, 1]",
    ], out[-4000:]
    for (_, rows), samples in zip(tables, ("10", "20")):
        assert [r["stage"].rstrip("*") for r in rows] == ["0", "1"], rows
        assert sum(r["stage"].endswith("*") for r in rows) == 1, "exactly one bottleneck is marked"
        for r in rows:
            assert {"step", "busy", "fwd", "bwd", "opt", "recv wait", "send", "F/B/U", "n"} <= r.keys()
            assert float(r["step"]) > 0 and float(r["fwd"]) > 0 and float(r["bwd"]) > 0, r
            # async, 4 micro-batches per step: every stage forwards, backwards and updates 4 times per step
            # (medians over the monitor's window, so the pipeline's fill does not show).
            assert r["F/B/U"] == "4/4/4", r
            assert r["n"] == samples  # the monitor's window (20 steps) holds every step so far
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


@pytest.mark.multiprocess
def test_gpt_char_quick_prints_pipeline_and_one_device_rows() -> None:
    """The 2-stage async pipeline (popen: rank 1 re-runs the script), then one device in the main process only."""
    out = _run("gpt_char.py", "--quick")
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in out, "rank 1 was not started by the popen launcher"
    assert out.count("DynPipe: 2 stages x 1 pipeline(s)") == 1, out[-4000:]  # one pipeline fit, logged by rank 0
    assert out.count("`Trainer.fit` stopped: `max_steps=12` reached.") == 2, out[-4000:]  # pipeline + one device
    lines = out.splitlines()
    columns = ["run", "stages", "steps", "val_loss", "samples/s", "fit_s"]
    header = [i for i, line in enumerate(lines) if line.split() == columns]
    assert len(header) == 1, out[-4000:]  # the table is printed once, by the main process
    rows = {}
    for line in lines[header[0] + 2 : header[0] + 4]:
        *name, stages, steps, val_loss, samples_per_s, fit_s = line.split()
        rows[" ".join(name)] = (int(stages), int(steps), float(val_loss), float(samples_per_s), float(fit_s))
    assert set(rows) == {"pipeline async", "one device"}, out[-4000:]
    assert rows["pipeline async"][:2] == (2, 12) and rows["one device"][:2] == (1, 12)
    for name, (_, _, val_loss, samples_per_s, fit_s) in rows.items():
        # 12 steps from a uniform start (ln 256 = 5.55 nats): the validation loss is finite and below it.
        assert math.isfinite(val_loss) and 0 < val_loss < 5.6, (name, out[-4000:])
        assert samples_per_s > 0 and fit_s > 0, (name, out[-4000:])


def test_schedules_doc_embeds_the_current_timelines() -> None:
    """docs/schedules.md shows the output of examples/schedule_timelines.py; regenerate it when this fails."""
    doc = (ROOT / "docs" / "schedules.md").read_text()
    m = re.search(
        r"<!-- schedule_timelines:begin -->\n```text\n(.*?)\n```\n<!-- schedule_timelines:end -->", doc, re.DOTALL
    )
    assert m is not None, "docs/schedules.md lost its schedule_timelines block"
    assert m.group(1) == schedule_timelines.report(), (
        "docs/schedules.md is out of date: paste the output of `python examples/schedule_timelines.py` "
        "between the schedule_timelines markers."
    )
