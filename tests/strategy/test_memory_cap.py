"""``DynPipeStrategy(memory_cap=...)``: what it accepts, and the set-up decision under it (in one process: the
adaptive loop's side is in ``tests/repartition/test_controller_memory.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_dynpipe import DynPipeStrategy
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.strategy.config import DynPipeConfig
from lightning_dynpipe.strategy.decision import decide


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "12GiB"])
def test_a_cap_must_be_a_positive_finite_number_of_bytes(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="memory_cap must be None"):
        DynPipeStrategy(memory_cap=bad)  # type: ignore[arg-type]


def test_a_cap_needs_something_that_chooses_a_partition() -> None:
    with pytest.raises(ConfigurationError, match=r"balance=\[2, 2\] with adaptive=False chooses none"):
        DynPipeStrategy(memory_cap=2**30, balance=[2, 2], adaptive=False)
    assert DynPipeStrategy(memory_cap=2**30).memory_cap == float(2**30)
    assert DynPipeStrategy(memory_cap=2**30, balance=[2, 2]).memory_cap == float(2**30)  # the adaptive loop's bound
    assert DynPipeStrategy(balance="auto", adaptive=False, memory_cap=2**30).memory_cap == float(2**30)
    assert DynPipeStrategy().memory_cap is None


def _decide(cap: float, balance: str | list[int] = "auto") -> object:
    torch.manual_seed(0)
    pipeline = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))  # about 130 KB of parameters
    config = DynPipeConfig.from_arguments(balance=balance, memory_cap=cap)
    return decide(
        config,
        pipeline=pipeline,
        fitting=True,
        global_rank=0,
        world_size=1,
        num_stages=1,
        first_batch=lambda: (torch.randn(32, 64), torch.randn(32, 64)),
        module=None,
        optimizer=lambda: torch.optim.SGD(pipeline.parameters(), lr=0.1),
        device=torch.device("cpu"),
    )


def test_the_set_up_plan_refuses_a_cap_that_nothing_fits_and_keeps_one_that_fits() -> None:
    with pytest.raises(
        ConfigurationError, match=r"no partition of the model that fits memory_cap=10000 bytes \(9.8 KiB\) per process"
    ):
        _decide(10_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the plan fits
        decision = _decide(2**30)
    assert decision.partition.balance == (3,)  # type: ignore[attr-defined]
    assert "cap" in (decision.plan_table or "")  # type: ignore[attr-defined]


def test_a_given_balance_over_the_cap_runs_as_given_and_says_so() -> None:
    with pytest.warns(UserWarning, match=r"balance=\[3\] is predicted to need more than memory_cap=9.8 KiB"):
        decision = _decide(10_000, balance=[3])
    assert decision.partition.balance == (3,)  # type: ignore[attr-defined]


def test_the_cap_reaches_the_adaptive_loop() -> None:
    from types import SimpleNamespace

    from lightning_dynpipe.monitor.callback import StageMonitor
    from lightning_dynpipe.plan.costs import CommModel, ModelCost
    from lightning_dynpipe.plan.partition import Partition
    from lightning_dynpipe.strategy.adaptation import AdaptationWiring

    config = DynPipeConfig.from_arguments(balance=[2, 2], memory_cap=2**20)
    wiring = AdaptationWiring(
        config, partition=lambda: Partition((2, 2)), pending=lambda: False, repartition=print, past_pauses=lambda: []
    )
    trainer = SimpleNamespace(callbacks=[StageMonitor(every_n_steps=10)])
    cost = ModelCost.from_arrays([1.0] * 4, [2.0] * 4)
    wiring.attach(trainer, model_cost=cost, comm=CommModel(), num_stages=2, replicas=1)  # type: ignore[arg-type]
    assert wiring.controller is not None and wiring.controller.memory_cap == float(2**20)
