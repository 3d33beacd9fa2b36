"""keep_freed_memory: a loop that allocates and frees a few MiB per step stops faulting in fresh pages."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from lightning_dynpipe.engine import allocator

_LOOP = """
import resource, sys
import torch
from lightning_dynpipe.engine.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "kept" else None

def step():  # a micro-batch's worth of activations: 4 tensors of 1 MiB, written, then freed
    ts = [torch.empty(1 << 18).fill_(1.0) for _ in range(4)]
    del ts

for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def _faults_per_step(mode: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", _LOOP, mode], capture_output=True, text=True, check=True, timeout=120)
    applied, faults = out.stdout.split()
    return applied, float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and ru_minflt: Linux")
def test_kept_freed_memory_stops_the_page_faults_of_a_step() -> None:
    applied, kept = _faults_per_step("kept")
    _, plain = _faults_per_step("plain")
    assert applied == "True"
    # glibc 2.36 here: about 50 faults per step by default (the heap's top trimmed and grown again), none kept
    assert kept <= 1.0 < plain, (kept, plain)


def test_without_glibc_nothing_is_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "sys", types.SimpleNamespace(platform="darwin"))  # this module's view only
    assert allocator.keep_freed_memory() is False


def test_the_strategy_option_is_checked() -> None:
    from lightning_dynpipe import DynPipeStrategy
    from lightning_dynpipe.errors import ConfigurationError

    assert DynPipeStrategy().config.keep_freed_cpu_memory is True
    assert DynPipeStrategy(keep_freed_cpu_memory=False).config.keep_freed_cpu_memory is False
    with pytest.raises(ConfigurationError, match="keep_freed_cpu_memory must be True or False"):
        DynPipeStrategy(keep_freed_cpu_memory="yes")  # type: ignore[arg-type]
