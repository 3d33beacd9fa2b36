"""keep_freed_memory: a loop that allocates and frees a few MiB per step stops faulting in fresh pages."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from lightning_dynpipe.engine import allocator

# Whether a fresh process's default allocator trims depends on what was allocated and freed before (glibc raises its
# thresholds when a mapped block is freed): a 16 MiB block freed at import time stops the 1 MiB case below from
# faulting at all. So the loop first sets glibc's initial thresholds (128 KiB) explicitly, which makes every 1 MiB
# tensor a mapped block that faults on each step, whatever the import did; "kept" then calls keep_freed_memory.
_LOOP = """
import ctypes, resource, sys
import torch
from lightning_dynpipe.engine.allocator import keep_freed_memory
mallopt = ctypes.CDLL(None).mallopt
assert mallopt(-3, 128 << 10) == 1 and mallopt(-1, 128 << 10) == 1  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
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
    _, trimming = _faults_per_step("trimming")
    assert applied == "True"
    # 4 MiB of 4 KiB pages mapped and unmapped per step: about 1,000 faults (fewer with huge pages); none kept
    assert kept <= 1.0 < 100.0 < trimming, (kept, trimming)


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
