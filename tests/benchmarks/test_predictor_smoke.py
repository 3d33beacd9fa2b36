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
    runs = json.loads((tmp_path / "predictor-runs.json").read_text())["runs"]
    assert len(runs) == 9 and {r["scenario"] for r in runs} == {"none", "quota50", "delay1"}
    forest = ForestPredictor.load(tmp_path / "forest.npz")
    assert forest.fitted and len(forest.samples) == 54  # every ordered pair of 3 partitions x 3 scenarios x 2 stages
    reports = list(tmp_path.glob("*-predictor.md"))
    assert len(reports) == 1 and "Commit:" in reports[0].read_text() and "Command:" in reports[0].read_text()
