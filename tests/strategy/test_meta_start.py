"""A model built on ``meta`` with ``balance="auto"`` and the adaptive loop, through Lightning (the popen launcher
runs ``scripts/meta_auto.py``; its docstring lists what it checks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "meta_auto.py"


@pytest.mark.multiprocess
def test_a_meta_built_model_plans_adapts_and_equals_the_run_built_on_the_cpu() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "META_AUTO_OK" in proc.stdout
