"""A model built on ``meta`` with ``balance="auto"`` and the adaptive loop, through Lightning (the popen launcher
runs ``scripts/meta_auto.py``; its docstring lists what it checks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pipeline_models import run_popen_script

SCRIPT = Path(__file__).parent / "scripts" / "meta_auto.py"


@pytest.mark.multiprocess
def test_a_meta_built_model_plans_adapts_and_equals_the_run_built_on_the_cpu() -> None:
    proc = run_popen_script(SCRIPT)
    assert "META_AUTO_OK" in proc.stdout
