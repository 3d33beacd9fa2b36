"""Smoke test of ``benchmarks/monitor_overhead.py --quick``: it runs end to end, prints its tables and writes its
record and plot. Not a performance test (STYLE.md): it asserts no overhead, only that every measure is there."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.multiprocess
def test_quick_run_prints_the_overhead_table(tmp_path: Path, run_benchmark_main: Callable[..., Any]) -> None:
    proc = run_benchmark_main("monitor_overhead.py", "--quick", "--out-dir", str(tmp_path))
    out = proc.stdout
    for text in (
        "monitor pieces alone",
        "sampler.sample",
        "cgroup CPU limit, kept open",
        "no monitor",
        "StageMonitor() (every 10)",
        "StageMonitor(every_n_steps=1)",
        "A/A control",
        "noise floor",
        "in-hook share",
        "extra CPU (paired)",
        "target: StageMonitor()",
    ):
        assert text in out, f"{text!r} missing from:\n{out}"
    records = list(tmp_path.glob("monitor_overhead-*-quick.json"))
    assert len(records) == 1
    payload = json.loads(records[0].read_text())
    assert {r["system"] for r in payload["runs"]} == {"off", "on", "every-step", "off-again"}
    on = [r for r in payload["runs"] if r["system"] == "on"][0]
    assert on["monitors"] == [1, 1] and all(n >= 1 for n in on["snapshots"])
    for off in (r for r in payload["runs"] if r["system"].startswith("off")):
        assert off["monitors"] == [0, 0]
    assert payload["machine"]["torch"] and payload["command"]
    assert (tmp_path / "monitor_overhead-quick.png").is_file()
