"""Smoke test of ``benchmarks/gloo_exit.py``: one spawned pair per arm (about 20 s on two cores).

It checks that the table and the record come out, and that a pair whose processes called
``destroy_default_group_at_exit`` (what DynPipeStrategy does) exits cleanly. The "no hook" arm aborts only
sometimes (about one pair in four to eight here), so its count is reported, not asserted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.multiprocess
def test_gloo_exit_reports_every_arm_and_the_hook_exits_cleanly(
    tmp_path: Path, run_benchmark: Callable[..., Any]
) -> None:
    proc = run_benchmark("gloo_exit.py", "--trials", "1", "--out-dir", str(tmp_path))
    for arm in ("no hook", "hook", "hook, group referenced"):
        assert any(line.startswith(arm) for line in proc.stdout.splitlines()), proc.stdout
    (record_path,) = tmp_path.glob("gloo_exit-*.json")
    record = json.loads(record_path.read_text())
    assert set(record["failures"]) == {"no hook", "hook", "hook, group referenced"}
    assert record["trials"] == 1 and "python" in json.dumps(record["machine"]).lower()
    assert record["failures"]["hook"] == 0, proc.stderr[-4000:]
