"""The calibration sweep's refusals and its worker's handling of what crosses a boundary, without a worker process.

The sweep itself runs in tests/benchmarks/test_predictor_smoke.py (the ``calibrate`` command) and in
tests/strategy/test_calibrate_at_setup.py (at set-up, on a transformer).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.costs import ModelCost
from lightning_dynpipe.sweep import SweepSettings, calibrate_pipeline
from lightning_dynpipe.sweep.worker import _backward, _stage_input

COST = ModelCost.from_arrays([1.0] * 4, [2.0] * 4)


class _ScriptLayer(nn.Linear):
    pass


_ScriptLayer.__module__ = "__main__"  # as if defined in the script being run


def test_layers_defined_in_the_script_are_refused_before_a_worker_starts() -> None:
    pipeline = nn.Sequential(nn.Linear(4, 4), _ScriptLayer(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(ConfigurationError, match=r"classes defined in the script being run \(__main__\): \['_Script"):
        calibrate_pipeline(pipeline, torch.randn(2, 4), COST, num_stages=2, num_microbatches=2)


def test_balances_must_split_the_pipeline_and_stages_must_be_two_or_more() -> None:
    pipeline = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    bad = SweepSettings(balances=((2, 2), (1, 2)))
    with pytest.raises(ConfigurationError, match=r"balances \[\(2, 2\), \(1, 2\)\] must each split 4 layers into 2"):
        calibrate_pipeline(pipeline, torch.randn(2, 4), COST, num_stages=2, num_microbatches=2, settings=bad)
    with pytest.raises(ConfigurationError, match="at least 2 stages"):
        calibrate_pipeline(pipeline, torch.randn(2, 4), COST, num_stages=1, num_microbatches=2)


def test_a_stage_input_is_detached_with_gradients_on_its_floating_leaves() -> None:
    h = torch.randn(2, 3, requires_grad=True) * 2  # not a leaf
    pos = torch.arange(3)
    got = _stage_input({"x": (h, pos), "n": 3})
    x, p = got["x"]
    assert x.is_leaf and x.requires_grad and torch.equal(x, h) and not p.requires_grad and got["n"] == 3
    w = nn.Parameter(torch.ones(3))
    _backward(((x * w).sum(1), p))  # the int64 leaf takes no gradient
    assert torch.equal(w.grad, x.detach().sum(0)) and torch.equal(x.grad, w.detach().expand(2, 3))
