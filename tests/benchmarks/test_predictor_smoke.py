"""Smoke test of ``benchmarks/predictor.py --quick``, which runs ``python -m lightning_dynpipe calibrate`` first.

Not a performance test: no error or speed is asserted (STYLE.md). One run (about 20 s on two cores, most of it
importing torch and Lightning in the sweep's worker) checks that the calibration sweep measures every scenario and
partition and saves a forest that loads, and that the benchmark prints its table and verdict lines and writes its
record and its dated report.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lightning_dynpipe.predictor import ForestPredictor


@pytest.mark.multiprocess
def test_predictor_quick_calibrates_and_reports(
    tmp_path: Path, run_benchmark_main: Callable[..., Any], table_rows: Callable[..., list[str]]
) -> None:
    out = run_benchmark_main("predictor.py", "--quick", "--out-dir", str(tmp_path)).stdout
    assert "calibrated on 9 windows (3 scenarios x 3 partitions" in out
    rows = table_rows(out, ("held out", "stage: forest", "prior", "baseline", "coverage"), 6)
    assert [" ".join(r.split()[:2]) for r in rows[:3]] == ["scenario none", "scenario quota50", "scenario delay1"]
    assert all(r.startswith("partition [") for r in rows[3:]), rows
    assert "held-out scenario types: stage MdAPE forest" in out and "partitions never run:" in out
    assert "ms per check" in out
    line = next(x for x in out.splitlines() if x.startswith("repeatability:"))
    assert "(max " in line and "6 stages" in line  # the same 3 partitions x 2 stages in both sweeps
    repeat = json.loads((tmp_path / "predictor-repeat-runs.json").read_text())["runs"]
    assert {r["scenario"] for r in repeat} == {"none"} and len(repeat) == 3
    runs = json.loads((tmp_path / "predictor-runs.json").read_text())["runs"]
    assert len(runs) == 9 and {r["scenario"] for r in runs} == {"none", "quota50", "delay1"}
    forest = ForestPredictor.load(tmp_path / "forest.npz")
    assert forest.fitted and len(forest.samples) == 54  # every ordered pair of 3 partitions x 3 scenarios x 2 stages
    reports = list(tmp_path.glob("*-predictor.md"))
    assert len(reports) == 1 and "Commit:" in reports[0].read_text() and "Command:" in reports[0].read_text()


def test_repeatability_compares_the_same_clean_layer_sets() -> None:
    from benchmarks.predictor import repeatability
    from lightning_dynpipe.plan.partition import Partition
    from lightning_dynpipe.predictor import PipelineWindow, StageTimes
    from lightning_dynpipe.sweep import CalibrationRun

    def run(scenario: str, balance: tuple[int, int], computes: tuple[float, float]) -> CalibrationRun:
        stages = tuple(StageTimes(compute_s=c, step_s=0.1) for c in computes)
        return CalibrationRun(scenario, PipelineWindow(Partition(balance), stages, 4))

    first = [run("none", (2, 3), (0.04, 0.08)), run("none", (3, 2), (0.06, 0.05)), run("hog50", (2, 3), (1, 1))]
    second = [run("none", (2, 3), (0.05, 0.08)), run("none", (3, 2), (0.03, 0.05))]
    r = repeatability(first, second)  # |second / first - 1| per stage: 0.25, 0, 0.5, 0; interfered runs ignored
    assert r["n"] == 4 and r["max"] == pytest.approx(0.5) and r["mdape"] == pytest.approx(0.125)
