"""The set-up profile leaves the user's random streams as they were: a run that profiles (``balance="auto"`` or the
adaptive loop) trains with the same dropout masks and data order as the same run with its balance given."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynpipe.strategy.config import DynPipeConfig
from lightning_dynpipe.strategy.decision import _rng_devices, decide


@pytest.mark.parametrize("shuffle", [False, True])
def test_taking_the_first_batch_and_profiling_leave_torchs_generator_as_it_was(shuffle: bool) -> None:
    torch.manual_seed(0)
    pipeline = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 4))
    loader = DataLoader(TensorDataset(torch.randn(64, 16), torch.randn(64, 4)), batch_size=8, shuffle=shuffle)
    # what the strategy passes: the first batch of a new iterator over the training loader
    first_batch = lambda: next(iter(loader))  # noqa: E731
    state = torch.get_rng_state()
    next(iter(loader))
    assert not torch.equal(torch.get_rng_state(), state)  # an iterator alone draws from the generator
    torch.set_rng_state(state)
    before = (torch.get_rng_state(), random.getstate())
    decision = decide(
        DynPipeConfig.from_arguments(balance="auto"),
        pipeline=pipeline,
        fitting=True,
        global_rank=0,
        world_size=1,
        num_stages=1,
        first_batch=first_batch,
        module=None,
        optimizer=lambda: torch.optim.SGD(pipeline.parameters(), lr=0.1),
        device=torch.device("cpu"),
    )
    assert decision.model_cost is not None  # it profiled
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    # the first epoch's order and the first dropout mask are those of a run that never profiled
    order = [x for x, _ in loader]
    torch.set_rng_state(before[0])
    assert all(torch.equal(a, b) for a, b in zip(order, [x for x, _ in loader]))


def test_the_cuda_generator_kept_is_the_stages_device() -> None:
    assert _rng_devices(torch.device("cpu")) == []
    assert _rng_devices(torch.device("cuda", 1)) == [1]
