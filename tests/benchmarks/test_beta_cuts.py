"""``benchmarks/beta_cuts.py``'s analysis: medians per cut, weighted staleness, the fit of ``beta`` on the medians."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.beta_cuts import analyse, profiles, render, weighted_staleness  # noqa: E402
from benchmarks.interference import Config  # noqa: E402


def _run(seed: int, balance: list[int], params: list[int], steps: int | None) -> dict[str, Any]:
    staleness = [0] if len(balance) == 1 else [1, 0]
    return {"seed": seed, "balance": balance, "staleness": staleness, "stage_parameters": params, "steps": steps}


def test_the_profiles_are_one_stage_then_every_cut() -> None:
    assert profiles(Config(model="cnn")) == [(5,), (1, 4), (2, 3), (3, 2), (4, 1)]


def test_beta_is_fitted_on_the_medians_of_each_cut() -> None:
    # 100 parameters: the cut [1, 1] puts 90 of them one update stale (x = 0.9), the one stage none
    runs = [
        _run(0, [2], [100], 100),
        _run(1, [2], [100], 120),
        _run(2, [2], [100], 80),
        _run(0, [1, 1], [90, 10], 150),
        _run(1, [1, 1], [90, 10], 140),
        _run(2, [1, 1], [90, 10], 400),  # one slow seed does not pull the median
    ]
    assert weighted_staleness(runs[3]) == pytest.approx(0.9)
    result = analyse(runs, num_microbatches=4)
    rows = {tuple(r["balance"]): r for r in result["rows"]}
    assert rows[(2,)]["median"] == 100 and rows[(1, 1)]["median"] == 150 and rows[(1, 1)]["relative"] == 1.5
    assert result["i0_steps"] == pytest.approx(100.0) and result["beta"] == pytest.approx(0.5 / 0.9)
    assert rows[(1, 1)]["fit"] == pytest.approx(1.5)
    assert "[1, 1]" in render(result)


def test_a_cut_that_missed_the_target_has_no_median_and_is_not_fitted() -> None:
    runs = [_run(0, [2], [100], 100), _run(0, [1, 1], [90, 10], None)]
    result = analyse(runs, num_microbatches=4)
    assert result["beta"] is None and result["rows"][1]["median"] is None
    assert "-" in render(result)
