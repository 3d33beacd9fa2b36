"""Sharded checkpoints and a module left sharded after fit, through Lightning (the popen launcher runs
``scripts/sharded_checkpoint.py``; its docstring lists what it checks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "sharded_checkpoint.py"


@pytest.mark.multiprocess
def test_sharded_checkpoint_resumes_under_other_layouts_and_equals_the_full_one(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "SHARDED_CHECKPOINT_OK" in proc.stdout
