"""Smoke test of ``benchmarks/activation_memory.py --quick``: the table prints for both stages, checkpointing keeps
fewer bytes for the backward, and the JSON record is written (to a temporary directory)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.multiprocess
def test_quick_run_prints_the_memory_table(run_benchmark_main: Callable[..., Any], tmp_path: Path) -> None:
    out = run_benchmark_main("activation_memory.py", "--quick", "--out-dir", str(tmp_path)).stdout
    assert "checkpointed MiB" in out and "time ratio" in out
    (record,) = tmp_path.glob("activation_memory-*.json")
    data = json.loads(record.read_text())
    off, on = data["exact_peak_bytes"]["False"], data["exact_peak_bytes"]["True"]
    assert len(off) == len(on) == 2 and all(b < a for a, b in zip(off, on))
    assert {r["checkpoint"] for r in data["runs"]} == {False, True}
    assert "predicted/kept" in out
    assert all(len(data[key][c]) == 2 for key in ("storage_peak_bytes", "predicted_bytes") for c in ("False", "True"))
