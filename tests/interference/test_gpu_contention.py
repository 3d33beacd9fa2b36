"""GpuContention refuses clearly where there is no CUDA (the kernel itself needs a GPU to test)."""

from __future__ import annotations

import pytest
import torch

from lightning_dynpipe.interference.base import InterferenceConfigError, InterferenceUnavailable
from lightning_dynpipe.interference.gpu import GpuContention


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_start_says_why_and_what_to_use() -> None:
    contention = GpuContention("cuda:0", duty_cycle=0.5)  # constructing is fine anywhere
    with pytest.raises(InterferenceUnavailable, match=r"needs CUDA.*is_available\(\) is False.*CpuHog"):
        contention.start()
    assert not contention.active
    contention.stop()  # nothing to stop, no error


def test_arguments_are_checked_on_construction() -> None:
    with pytest.raises(InterferenceConfigError, match=r"duty_cycle must be in \(0, 1\]; got 0"):
        GpuContention(duty_cycle=0)
    with pytest.raises(InterferenceConfigError, match="size must be a positive integer"):
        GpuContention(size=0)
