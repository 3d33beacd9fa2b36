"""Smoke test of ``benchmarks/memory.py --quick``: the sharded setting runs on 2 processes, every phase is
measured on both stages, each process ends holding its stage's layers only, and the JSON record and the plot are
written (to a temporary directory)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.multiprocess
def test_quick_run_prints_the_memory_table(run_benchmark: Callable[..., Any], tmp_path: Path) -> None:
    out = run_benchmark("memory.py", "--quick", "--out-dir", str(tmp_path)).stdout
    assert "checkpoint MiB (x share)" in out and "sharded S=2" in out
    (record,) = tmp_path.glob("memory-*.json")
    assert (tmp_path / "memory.png").is_file()
    runs = json.loads(record.read_text())["runs"]
    assert sorted((r["setting"], r["stage"]) for r in runs) == [("sharded", 0), ("sharded", 1)]
    for r in runs:
        assert set(r["peak_kib"]) == {"setup", "train", "checkpoint", "end"}
        assert all(v >= r["baseline_kib"] for v in r["peak_kib"].values())  # a peak is never below the start
        assert r["layers_held_after_fit"] == 4  # gather_after_fit=False: its own 4 of the 8 layers
