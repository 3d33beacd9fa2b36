"""The smallest complete DynPipe program: your own LightningModule, ``Trainer(strategy="dynpipe")``.

Trains a 3-layer MLP on scikit-learn's 8x8 digits in a 2-stage asynchronous pipeline on CPU::

    python examples/digits_quickstart.py

The user contract, in short:

* every trainable parameter lives in ``self.pipeline``, an ``nn.Sequential`` whose elements are the units
  the strategy places on stages;
* each ``*_step`` calls ``self.pipeline(...)`` exactly once; the strategy routes that call through the
  stages and runs the rest of the step (loss, ``self.log``) on the last stage, which is global rank 0.

The default launcher runs this script once more for rank 1, so all the set-up is under
``if __name__ == "__main__":`` and seeded.
"""

from __future__ import annotations

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dynpipe  # noqa: F401  (registers strategy="dynpipe")


class Net(L.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.pipeline = nn.Sequential(  # all trainable parameters live here; layers are the units
            nn.Sequential(nn.Linear(64, 128), nn.ReLU()),
            nn.Sequential(nn.Linear(128, 128), nn.ReLU()),
            nn.Linear(128, 10),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.pipeline(x), y)  # one call; the strategy routes it through the stages
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        acc = (self.pipeline(x).argmax(-1) == y).float().mean()
        self.log("test_acc", acc)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loaders(batch_size: int = 32) -> tuple[DataLoader, DataLoader]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))  # same split on every rank
    train, test = perm[:1400], perm[1400:]
    # drop_last: each training batch must split into num_microbatches (default 4) non-empty micro-batches.
    train_dl = DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True, drop_last=True)
    test_dl = DataLoader(TensorDataset(x[test], y[test]), batch_size=128)
    return train_dl, test_dl


if __name__ == "__main__":
    L.seed_everything(0, verbose=False)
    train_dl, test_dl = loaders()
    model = Net()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,  # two processes, one pipeline stage each
        strategy="dynpipe",  # = DynPipeStrategy(): async schedule, num_microbatches=4
        max_epochs=5,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, train_dl)
    (result,) = trainer.test(model, test_dl, verbose=False)
    if trainer.is_global_zero:
        print(f"test accuracy: {result['test_acc']:.4f}")
