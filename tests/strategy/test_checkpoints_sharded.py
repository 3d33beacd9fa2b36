"""Sharded checkpoints and a module left sharded after fit, through Lightning (the popen launcher runs
``scripts/sharded_checkpoint.py``; its docstring lists what it checks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pipeline_models import run_popen_script

SCRIPT = Path(__file__).parent / "scripts" / "sharded_checkpoint.py"


@pytest.mark.multiprocess
def test_sharded_checkpoint_resumes_under_other_layouts_and_equals_the_full_one(tmp_path: Path) -> None:
    proc = run_popen_script(SCRIPT, str(tmp_path))
    assert "SHARDED_CHECKPOINT_OK" in proc.stdout
