"""Smoke test of ``benchmarks/async_lr.py --quick``: it runs end to end, prints its tables and writes its record.

Not a performance or convergence test (STYLE.md: a benchmark is a script that prints a table, not a timed unit
test). Single-process (the PipeDream replay), digits only, 2 seeds, 1 epoch: about 12 s on two cores, writing
into a temporary directory so that docs/img/async_lr.png is left alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def test_async_lr_quick_prints_the_tables_and_writes_the_record(
    tmp_path: Path, run_benchmark_main: Callable[..., Any], table_rows: Callable[..., list[str]]
) -> None:
    out = run_benchmark_main("async_lr.py", "--quick", "--out-dir", str(tmp_path)).stdout

    rows = table_rows(out, ("case", "setting", "lr_scale", "steps to target", "steps / plain", "final val acc"), 6)
    assert [r.split()[0] for r in rows] == ["digits-sgd"] * 3 + ["digits-adamw"] * 3, "\n".join(rows)
    assert [r.split()[1] for r in rows] == ["plain,", "async", "async"] * 2, "\n".join(rows)
    assert all("(1/M)" in r for r in (rows[2], rows[5])), "\n".join(rows)
    assert "derived: time / plain = (steps / plain) / 1.08" in out
    # plain reaches the quick target only at the example's lr (x1), the one base of the transfer table
    transfer = table_rows(out, ("case", "base: plain's lr x", "plain steps", "lr_scale 1", "lr_scale 1/M"), 2)
    assert [r.split()[0] for r in transfer] == ["digits-sgd", "digits-adamw"], "\n".join(transfer)
    assert all("1 (example, plain best)" in r for r in transfer), "\n".join(transfer)
    for family in ("all", "adamw", "sgd"):
        assert f"[{family}] every base where plain reaches the target: " in out
        assert f"[{family}] only the example's lr and plain's best: " in out

    records = list(tmp_path.glob("async_lr-*-quick.json"))
    assert len(records) == 1
    payload = json.loads(records[0].read_text())
    assert payload["machine"]["torch"] and payload["machine"]["lightning"] and payload["command"]
    # every (seed, case, setting) ran: 2 seeds x 2 cases x (plain at 1 and 1/4, async S=2 at 1 and 1/4)
    assert len(payload["runs"]) == 16
    assert {(r["system"], r["stages"], r["scale"]) for r in payload["runs"]} == {
        ("plain", 1, 1.0),
        ("plain", 1, 0.25),
        ("async", 2, 1.0),
        ("async", 2, 0.25),
    }
    assert all(r["curve"] and r["balance"] for r in payload["runs"])
    assert (tmp_path / "async_lr-quick.png").is_file()
