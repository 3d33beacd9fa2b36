"""Smoke test of ``benchmarks/intra_stage.py --quick``: it runs end to end, prints its table and writes the raw
record, the plot and the dated report. Not a performance test: it asserts no speed or ratio (STYLE.md). It runs
the script's ``main`` in the test process: two spawned gloo workers pinned to their own cores, a tiny MLP, one
seed, scenario quota50, the even, speed-weighted and one fixed split."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HEADER = ("scenario", "even TTA s", "speed TTA s", "even/speed", "measured limit", "best w0")


@pytest.mark.multiprocess
def test_quick_run_prints_table_and_writes_report(
    tmp_path: Path, run_benchmark_main: Callable[..., Any], table_rows: Callable[..., list[str]]
) -> None:
    proc = run_benchmark_main("intra_stage.py", "--quick", "--out-dir", str(tmp_path))
    rows = table_rows(proc.stdout, HEADER, 1)
    assert [r.split()[0] for r in rows] == ["quota50"], "\n".join(rows)
    assert "command:" in proc.stdout
    (raw,) = tmp_path.glob("intra-stage-*.json")
    payload = json.loads(raw.read_text())
    systems = {(r["scenario"], r["system"]) for r in payload["runs"]}
    assert systems == {("quota50", y) for y in ("even", "speed", "fixed-0.70")}
    # all systems train on the same global batches: the same accuracy at every evaluation (sync == plain)
    for scenario in ("quota50",):
        even, speed = (next(r for r in payload["runs"] if r["scenario"] == scenario and r["system"] == y)
                       for y in ("even", "speed"))  # fmt: skip
        assert [e["acc"] for e in even["evals"]] == pytest.approx([e["acc"] for e in speed["evals"]], abs=2e-3)
    assert payload["summary"]["quota50"]["best_fixed"] in ("0.70", "-")  # the one fixed split, if it reached
    assert payload["machine"]["torch"] and payload["command"]
    (report,) = tmp_path.glob("*-intra-stage.md")
    assert "| scenario" in report.read_text() and (tmp_path / "intra_stage.png").exists()
