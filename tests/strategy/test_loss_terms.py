"""A loss averaged over more than the samples (a token-mean cross-entropy that skips padding) under a flush schedule:
with the module's ``loss_terms`` hook, ``sync`` gives one device's updates and logs one device's step losses.
The in-process tests of the weighting (``gpipe`` too, a micro-batch with no targets, the refusals of bad counts)
are in ``tests/engine/test_inprocess_numerics.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from pipeline_models import RecordEachStep, trainer_kwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynpipe import DynPipeStrategy
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.strategy.contract import check_loss_terms

T, IGNORE = 6, -100


class TokenNet(L.LightningModule):
    """Predicts ``T`` targets per sample; its loss is the mean over the targets that are not padding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pipeline = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, T * 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.pipeline(x).view(-1, 3), y.reshape(-1), ignore_index=IGNORE)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class WeightedTokenNet(TokenNet):
    def loss_terms(self, batch: Any) -> torch.Tensor:
        return (batch[1] != IGNORE).sum()


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    n = 48
    x, y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n, T), generator=g)
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    lengths[torch.arange(n) % 12 >= 6] = 1  # the second half of every batch of 12 is nearly all padding
    y[torch.arange(T)[None, :] >= lengths[:, None]] = IGNORE
    return DataLoader(TensorDataset(x, y), batch_size=12, shuffle=False)


def _losses(trainer: L.Trainer, outputs: Any) -> tuple[float, float]:
    """A step's logged ``train_loss`` and the ``outputs["loss"]`` that ``on_train_batch_end`` receives."""
    return float(trainer.callback_metrics["train_loss"]), float(outputs["loss"])


def _fit(model: TokenNet, path: Path, devices: int) -> None:
    strategy: Any = (
        DynPipeStrategy(num_microbatches=2, schedule="sync", start_method="fork", balance=[2, 3], adaptive=False)
        if devices > 1
        else "auto"
    )
    kw = trainer_kwargs(max_epochs=1, callbacks=[RecordEachStep(path, _losses)])
    L.Trainer(devices=devices, strategy=strategy, **kw).fit(model, _loader())


@pytest.mark.multiprocess
def test_sync_with_loss_terms_trains_and_logs_as_one_device(tmp_path: Path) -> None:
    """Two ``sync`` stages, two micro-batches of 6 samples whose targets differ in number: the weights equal one
    device's to 1e-6, and so do every step's logged ``train_loss`` and the loss ``on_train_batch_end`` receives.
    Without the hook the weights differ."""
    plain, weighted, by_samples = TokenNet(), WeightedTokenNet(), TokenNet()
    _fit(plain, tmp_path / "plain.json", devices=1)
    _fit(weighted, tmp_path / "weighted.json", devices=2)
    _fit(by_samples, tmp_path / "samples.json", devices=2)
    for a, b in zip(weighted.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    logged = json.loads((tmp_path / "weighted.json").read_text())
    plain_logged = json.loads((tmp_path / "plain.json").read_text())
    assert len(logged) == len(plain_logged) == 4
    for got, want in zip(logged, plain_logged):
        assert got == pytest.approx(want, abs=1e-6, rel=0)
    assert max((a - b).abs().max().item() for a, b in zip(by_samples.parameters(), plain.parameters())) > 1e-3


def test_only_a_method_named_loss_terms_is_the_hook() -> None:
    """An attribute named ``loss_terms`` that is not a method (a list of loss modules, which ``nn.Module`` makes
    callable) is not the hook, and is not refused with replicas."""
    from lightning_dynpipe.strategy.contract import loss_terms_hook

    module = TokenNet()
    module.loss_terms = nn.ModuleList([nn.CrossEntropyLoss()])
    assert loss_terms_hook(module) is None and loss_terms_hook(TokenNet()) is None
    check_loss_terms(module, num_replicas=2)
    hook = loss_terms_hook(WeightedTokenNet())
    assert hook is not None and int(hook((None, torch.tensor([[1, IGNORE], [2, 0]])))) == 3


def test_loss_terms_with_several_pipeline_replicas_is_refused() -> None:
    check_loss_terms(WeightedTokenNet(), num_replicas=1)
    check_loss_terms(TokenNet(), num_replicas=2)  # no hook: the samples weigh, as the replicas' average does
    with pytest.raises(ConfigurationError, match=r"WeightedTokenNet.loss_terms .* 2 pipeline replicas"):
        check_loss_terms(WeightedTokenNet(), num_replicas=2)
