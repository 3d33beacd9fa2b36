"""The user contract fails loudly in a real 2-stage run: a second pipeline call, a batch stage 0 cannot read,
a last batch that cannot be split (before the first step), and async with tied weights split across stages
(before any process group). Spawned processes: the first rank's error reaches the caller."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from pipeline_models import TinyGPT, TinyNet, loader, token_loader, trainer_kwargs
from torch.utils.data import DataLoader

from lightning_dynpipe import DynPipeStrategy

pytestmark = pytest.mark.multiprocess


class TwoViews(TinyNet):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        a, b = self.pipeline(x), self.pipeline(x + 0.1 * torch.randn_like(x))  # consistency loss: two calls
        return F.cross_entropy(a, y) + F.mse_loss(a, b)


class DictBatches(TinyNet):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.pipeline(batch["x"]), batch["y"])


def _dict_loader() -> DataLoader:
    data = [{"x": x, "y": y} for x, y in loader().dataset]  # type: ignore[attr-defined]
    return DataLoader(data, batch_size=12)


def _fit(model: L.LightningModule, data: DataLoader, **strategy: Any) -> None:
    s = DynPipeStrategy(num_microbatches=4, start_method="spawn", adaptive=False, **strategy)
    L.Trainer(devices=2, max_steps=2, strategy=s, **trainer_kwargs()).fit(model, data)


@pytest.mark.parametrize(
    ("model", "data", "match"),
    [
        (TwoViews(), loader(), r"self.pipeline\(...\) was called twice in one step"),
        (DictBatches(), _dict_loader(), r"batch of type dict.*def pipeline_input"),
        (TinyGPT(tie=True), token_loader(), r"cannot be trained exactly by schedule='async'"),
    ],
    ids=["two-calls", "dict-batch", "tied-async"],
)
def test_contract_errors(model: L.LightningModule, data: DataLoader, match: str) -> None:
    with pytest.raises(Exception, match=match):
        _fit(model, data, balance=[2, 3])


def test_a_last_batch_too_small_to_split_is_refused_before_the_first_step() -> None:
    """98 samples in batches of 12: the epoch's last batch holds 2 < num_microbatches=4 (refused in
    ``on_train_start``, where it used to fail only when that batch arrived, after a whole epoch)."""
    s = DynPipeStrategy(num_microbatches=4, balance=[2, 3], start_method="spawn", adaptive=False)
    with pytest.raises(Exception, match=r"last training batch of each epoch holds 2 samples .*drop_last=True"):
        L.Trainer(devices=2, max_epochs=1, strategy=s, **trainer_kwargs()).fit(TinyNet(), loader(n=98))
