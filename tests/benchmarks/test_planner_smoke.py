"""Smoke tests of ``benchmarks/simulator_accuracy.py``, ``benchmarks/planner.py`` and
``benchmarks/profile_inputs.py`` (``--quick``).

Not performance tests: no speed is asserted (STYLE.md: a benchmark is a script that prints a table, not a timed
unit test). The first two run the script's ``main`` in the test process (its imports already paid), the
last runs the script in a subprocess as a user would; all with tiny models and sizes (two spawned gloo
workers for the measured parts; about 15-30 s each on two cores), writing into a temporary directory so the
documented plots in docs/img/ are left alone. They check that the tables and verdict lines print and that the
raw JSON record and the plots are written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def _run(run_benchmark: Callable[..., Any], script: str, tmp_path: Path, *extra: str) -> str:
    proc = run_benchmark(script, "--quick", "--out-dir", str(tmp_path), *extra)
    return proc.stdout


@pytest.mark.multiprocess
def test_simulator_accuracy_quick_prints_table_for_three_models(
    tmp_path: Path, run_benchmark_main: Callable[..., Any], table_rows: Callable[..., list[str]]
) -> None:
    out = _run(run_benchmark_main, "simulator_accuracy.py", tmp_path)

    rows = table_rows(
        out, ("model", "partition", "predicted: profile", "predicted: profile + framework", "measured (median)"), 3
    )
    assert [r.split()[0] for r in rows] == ["MLP", "CNN", "HeavyLayerMLP"], "\n".join(rows)
    for row in rows:
        assert row.count("%") == 2, f"not two error percentages in row {row!r}"
    assert (
        "target |predicted/measured - 1| <= 15% on every model (profile + framework costs from the null model)" in out
    )
    framework = table_rows(out, ("null model / stage", "per forward", "per send", "per step"), 2)
    assert [r.split()[:4] for r in framework] == [["null", "32/4", "/", "stage"]] * 2, "\n".join(framework)
    assert "sim: costs inside the runs" in out
    assert "run-queue wait" in out

    records = list(tmp_path.glob("simulator_accuracy-*-quick.json"))
    assert len(records) == 1
    payload = json.loads(records[0].read_text())
    # all quick models share one batch shape, so one null model runs beside them
    assert {r["system"] for r in payload["runs"]} == {"MLP", "CNN", "HeavyLayerMLP", "null 32/4"}
    assert payload["machine"]["torch"] and payload["machine"]["lightning"] and payload["command"]
    assert set(payload["summary"]) == {"MLP", "CNN", "HeavyLayerMLP"}
    assert (tmp_path / "simulator_accuracy-quick.png").is_file()


@pytest.mark.multiprocess
def test_planner_quick_prints_all_three_parts(
    tmp_path: Path, run_benchmark_main: Callable[..., Any], table_rows: Callable[..., list[str]]
) -> None:
    out = _run(run_benchmark_main, "planner.py", tmp_path)

    rows = table_rows(out, ("system", "partition", "samples/s (median)", "auto / this (paired)"), 3)
    assert [r.split()[0] for r in rows] == ["auto", "parameters", "uniform"], "\n".join(rows)
    assert "target (a) auto >= 1.10x the better of parameters/uniform" in out
    assert "(b) planning time, 100 layers x 8 stages" in out
    assert "best_plan(num_stages=8)" in out and "target (b) planning < 1 s" in out
    assert "(c) simulation time, 8 stages" in out and "target (c) simulate < 5 s" in out

    records = list(tmp_path.glob("planner-*-quick.json"))
    assert len(records) == 1
    payload = json.loads(records[0].read_text())
    assert {"a", "b", "c", "summary", "machine", "command"} <= set(payload)
    for name in ("planner_throughput", "planner_timeline", "planner_timeline_uniform", "planner_speed"):
        assert (tmp_path / f"{name}-quick.png").is_file(), name


def test_profile_inputs_quick_compares_the_three_samples(
    tmp_path: Path, run_benchmark: Callable[..., Any], table_rows: Callable[..., list[str]]
) -> None:
    out = _run(run_benchmark, "profile_inputs.py", tmp_path)

    rows = table_rows(out, ("model / stage", "fwd zeros", "fwd random", "fwd MNIST", "fwd zeros/MNIST"), 4)
    assert [r.split()[0] for r in rows] == ["MLP", "MLP", "CNN", "CNN"], "\n".join(rows)
    assert all(r.count("x") >= 4 for r in rows), "\n".join(rows)  # four ratios per row
    records = list(tmp_path.glob("profile_inputs-*-quick.json"))
    assert len(records) == 1
    payload = json.loads(records[0].read_text())
    assert {r["sample"] for r in payload["records"]} == {"zeros", "random", "MNIST"}
    assert payload["machine"]["torch"] and payload["command"]
    assert (tmp_path / "profile_inputs-quick.png").is_file()
