"""Smoke test of ``benchmarks/interference.py --quick``: it runs end to end and prints the scenario table.

Not a performance test: it asserts no speed or ratio (STYLE.md: a benchmark prints a table, it is not a timed
unit test). It runs the script's ``main`` in the test process: two spawned gloo workers pinned to their own
cores, a tiny MLP, one seed, scenarios ``none`` and ``quota25`` for the forest and static systems (about 30-60 s
on two cores).
Outputs go to a temporary directory, so the documented plots in docs/img/ are left alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HEADER = ("scenario", "system", "TTA s", "static TTA s", "static/system", "migrations", "onset->move", "limit over run")


@pytest.mark.multiprocess
def test_quick_run_prints_scenario_table(
    tmp_path: Path, run_benchmark_main: Callable[..., Any], table_rows: Callable[..., list[str]]
) -> None:
    proc = run_benchmark_main("interference.py", "--quick", "--out-dir", str(tmp_path))

    rows = table_rows(proc.stdout, HEADER, 2)
    assert [r.split()[:2] for r in rows] == [["none", "forest"], ["quota25", "forest"]], "\n".join(rows)
    assert "machine:" in proc.stdout and "command:" in proc.stdout

    (raw,) = tmp_path.glob("interference-*.json")
    payload = json.loads(raw.read_text())
    assert {(r["scenario"], r["system"]) for r in payload["runs"]} == {
        (s, y) for s in ("none", "quota25") for y in ("forest", "static")
    }
    assert payload["machine"]["torch"] and payload["command"]
    assert (tmp_path / "interference_accuracy.png").exists() and (tmp_path / "interference_stages.png").exists()
