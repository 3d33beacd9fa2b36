"""Small models and data for the multi-process strategy tests (importable by spawned workers)."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

LR = 0.1
MOMENTUM = 0.9


class TinyNet(L.LightningModule):
    """Five layers, no randomness in forward: numerics must match references exactly."""

    def __init__(self, optimizer: str = "sgd", seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.pipeline = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.pipeline(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.pipeline(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.pipeline(batch[0])

    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


def make_optimizer(params: list[nn.Parameter], optimizer: str = "sgd") -> torch.optim.Optimizer:
    """The same optimizer TinyNet builds, for single-process references."""
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def dataset(n: int = 96, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def loader(batch_size: int = 12, n: int = 96) -> DataLoader:
    return DataLoader(dataset(n), batch_size=batch_size, shuffle=False)


def plain_training(model: TinyNet, batches: list[Any], optimizer: str = "sgd") -> TinyNet:
    """Single-device reference: one update per whole batch."""
    ref = copy.deepcopy(model)
    opt = make_optimizer(list(ref.parameters()), optimizer)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(ref.pipeline(x), y).backward()
        opt.step()
    return ref


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    kw.update(overrides)
    return kw


class ScheduledNet(TinyNet):
    """TinyNet with Adam and a per-step StepLR, so resumption must restore optimizer and scheduler state."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(optimizer="adam", seed=seed)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def plain_scheduled_training(model: ScheduledNet, batches: list[Any]) -> ScheduledNet:
    """Single-device reference for ScheduledNet: Adam, StepLR stepped after every batch."""
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(ref.pipeline(x), y).backward()
        opt.step()
        sched.step()
    return ref
