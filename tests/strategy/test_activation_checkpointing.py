"""Activation checkpointing in a 2-process run of a transformer with dropout: the recomputation in the backward
replays each micro-batch's random state and uses the weight version its forward used, so the weights equal
those of the same run without checkpointing, exactly."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from pipeline_models import trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynpipe import DynPipeStrategy
from lightning_dynpipe.demos import CharGPT

pytestmark = pytest.mark.multiprocess


def _tokens() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (48, 17), generator=g)
    return DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=8)


def _fit(checkpointing: bool | list[int]) -> CharGPT:
    L.seed_everything(0)
    model = CharGPT(block_size=16, d_model=32, n_layers=3, n_heads=2, dropout=0.1)
    strategy = DynPipeStrategy(
        balance=[2, 3], num_microbatches=4, start_method="fork", adaptive=False, activation_checkpointing=checkpointing
    )
    L.Trainer(devices=2, max_steps=5, strategy=strategy, **trainer_kwargs()).fit(model, _tokens())
    return model


def test_checkpointed_async_run_with_dropout_equals_the_run_without() -> None:
    plain, some = _fit(False), _fit([1, 3, 4])  # layers on both stages; every layer: tests/engine
    for (name, a), b in zip(plain.state_dict().items(), some.state_dict().values()):
        assert torch.equal(a, b), name
    L.seed_everything(0)
    untrained = CharGPT(block_size=16, d_model=32, n_layers=3, n_heads=2, dropout=0.1)
    assert not torch.equal(plain.pipeline[1].ln_1.weight, untrained.pipeline[1].ln_1.weight)  # it did train
