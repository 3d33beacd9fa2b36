"""Repeated fit/validate in one process (popen), no wrapper around the module, no leaked process groups."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "fit_twice.py"


@pytest.mark.multiprocess
def test_fit_twice_then_validate_with_popen() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "FIT_TWICE_OK" in proc.stdout
