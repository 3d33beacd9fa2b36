"""Smoke test of ``benchmarks/detection.py`` on its own: one seed, the measured predictor, a clean run and a quota.

Not a performance test: the replay is deterministic for the measured predictor (no clock in it), so its result is
checked: the quota is found at the first check after the onset (the window shows the cgroup limit), nothing moves
on the clean run, and the table, the JSON record and the plot are written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def test_detection_replay_prints_its_table_and_writes_its_record(
    tmp_path: Path, run_benchmark_main: Callable[..., Any], table_rows: Callable[..., list[str]]
) -> None:
    args = ("--systems", "measured", "--scenarios", "none,quota25", "--seeds", "1", "--steps", "120", "--onset", "40")
    out = run_benchmark_main("detection.py", *args, "--out-dir", str(tmp_path)).stdout
    rows = [r.split() for r in table_rows(out, ("system", "scenario", "detected", "limit share"), 2)]
    assert rows[0][:5] == ["measured", "none", "-", "-", "0"], rows
    assert rows[1][:5] == ["measured", "quota25", "1/1", "10", "1"], rows
    assert "detection measured: 0 migrations on clean runs (target met)" in out
    (record,) = tmp_path.glob("detection-*.json")
    data = json.loads(record.read_text())
    assert data["config"] == "1 seeds x 120 steps, onset 40, signs on" and data["command"]
    assert [r["scenario"] for r in data["summary"]] == ["none", "quota25"]
    assert list(tmp_path.glob("detection-*.png")), "no plot written"
