"""``python -m lightning_dynpipe calibrate``: arguments are checked before any model is built or process started.

The sweep itself runs in tests/benchmarks/test_predictor_smoke.py (through benchmarks/predictor.py --quick).
"""

from __future__ import annotations

import pytest

from lightning_dynpipe.cli import dispatch
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.costs import ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.sweep import SCENARIOS, candidate_partitions

BASE = ["calibrate", "--model", "nowhere:Model", "--batch-size", "8"]


def test_an_unknown_scenario_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ConfigurationError, match=r"--scenarios names \['bogus'\]; the known scenarios are \['none'"):
        dispatch([*BASE, "--scenarios", "none,bogus"])


def test_too_few_stages_partitions_or_steps_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="--num-stages >= 2, --partitions >= 2 and --steps >= 2; got 2, 1, 6"):
        dispatch([*BASE, "--partitions", "1"])


def test_candidate_partitions_spread_around_the_balanced_split() -> None:
    cost = ModelCost.from_arrays([1.0] * 8, [2.0] * 8)
    parts = candidate_partitions(cost, 2, 5)
    assert parts[0] == Partition((4, 4))
    assert set(parts) == {Partition(b) for b in ((4, 4), (5, 3), (3, 5), (6, 2), (2, 6))}
    assert {"none", "hog100", "quota25", "delay"} <= set(SCENARIOS)


def test_balances_name_the_partitions_to_measure() -> None:
    from lightning_dynpipe.cli.calibrate import _parse_balances

    assert _parse_balances("2,7;3,6", 2, 9) == [Partition((2, 7)), Partition((3, 6))]
    with pytest.raises(ConfigurationError, match=r"'2,6' is not a split of 9 layers into 2 stages"):
        _parse_balances("2,7;2,6", 2, 9)
    with pytest.raises(ConfigurationError, match=r"--balances takes 'a,b;c,d'"):
        _parse_balances("2,x", 2, 9)
