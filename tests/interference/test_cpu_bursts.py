"""CpuBursts: a bursty neighbour that really burns CPU in short bursts on random cores, and stops with its owner."""

from __future__ import annotations

import psutil
import pytest

from lightning_dynpipe.interference import CpuBursts
from lightning_dynpipe.interference.base import InterferenceConfigError
from lightning_dynpipe.interference.cpu import allowed_cores
from tests.interference.helpers import cpu_shares, gone

CORES = allowed_cores()[:2]


def test_bursts_burn_cpu_in_proportion_to_bursts_over_gaps_and_stop() -> None:
    """Back-to-back bursts (no gap) keep one core busy; bursts of 20 ms with gaps of up to 200 ms (100 on average)
    about a sixth of one. What the helper asks for (on a CPU or waiting for one) does not depend on other jobs."""
    with CpuBursts(CORES, shortest_s=0.05, longest_s=0.05, max_gap_s=0.0) as bursts:
        assert len(bursts.pids) == 1 and bursts.active
        [(_, busy)] = cpu_shares(bursts.pids, 0.6)
        pid = bursts.pids[0]
    assert busy > 0.85
    assert gone(pid) and not bursts.active
    with CpuBursts(CORES, shortest_s=0.02, longest_s=0.02, max_gap_s=0.2, seed=3) as bursts:
        [(_, sparse)] = cpu_shares(bursts.pids, 1.0)
    assert 0.05 < sparse < 0.45


def test_bursts_move_between_the_given_cores() -> None:
    if len(CORES) < 2:
        pytest.skip("needs two cores")
    seen: set[int] = set()
    with CpuBursts(CORES, shortest_s=0.005, longest_s=0.005, max_gap_s=0.0) as bursts:
        proc = psutil.Process(bursts.pids[0])
        for _ in range(200):
            seen.update(proc.cpu_affinity())
            if len(seen) == len(CORES):
                break
            psutil.cpu_percent(0.005)
    assert seen == set(CORES)


def test_stop_is_idempotent_and_the_helper_restarts() -> None:
    bursts = CpuBursts(CORES[:1], max_gap_s=0.05)
    bursts.start()
    bursts.start()  # no second helper
    first = bursts.pids
    assert len(first) == 1
    bursts.stop()
    bursts.stop()
    assert gone(first[0]) and bursts.pids == []
    bursts.start()
    again = bursts.pids
    bursts.stop()
    assert again != first and gone(again[0])
    assert repr(bursts) == f"CpuBursts(cores={CORES[:1]}, shortest_s=0.01, longest_s=0.15, max_gap_s=0.05, seed=0)"


def test_invalid_arguments_state_the_rule() -> None:
    with pytest.raises(InterferenceConfigError, match=r"longest_s >= shortest_s; got 0.01 < 0.1") as info:
        CpuBursts([0], shortest_s=0.1, longest_s=0.01)
    assert info.value.field == "longest_s"
    with pytest.raises(InterferenceConfigError, match=r"max_gap_s must be in \[0, 60\]; got -1"):
        CpuBursts([0], max_gap_s=-1)
    with pytest.raises(InterferenceConfigError, match="at least one core"):
        CpuBursts([])
