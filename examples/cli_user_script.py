"""Your own ``LightningCLI`` script with ``DynPipeStrategy``: all it needs is ``import lightning_dynpipe``.

The import registers the strategy names (``dynpipe``, ``dynpipe_spawn``, ``dynpipe_fork``) and the
lower-cased class-path aliases with Lightning's ``StrategyRegistry``. Without it, ``--trainer.strategy=dynpipe``
fails with ``ValueError: You selected an invalid strategy name``. Every form Lightning's CLI offers then works::

    ARGS="--trainer.accelerator=cpu --trainer.devices=2 --trainer.max_epochs=3"
    python examples/cli_user_script.py fit $ARGS --trainer.strategy=dynpipe
    python examples/cli_user_script.py fit $ARGS --trainer.strategy=lightning_dynpipe.DynPipeStrategy
    python examples/cli_user_script.py fit $ARGS --trainer.strategy=DynPipeStrategy --trainer.strategy.schedule=sync
    python examples/cli_user_script.py fit $ARGS --config my_strategy.yaml
    python examples/cli_user_script.py fit $ARGS --trainer.strategy=DynPipeStrategy --print_config

where ``my_strategy.yaml`` holds::

    trainer:
      strategy:
        class_path: lightning_dynpipe.DynPipeStrategy
        init_args: {num_microbatches: 8, schedule: sync}

A registered name (``dynpipe``) takes no nested ``--trainer.strategy.*`` flags; use the class name or class
path for those. The default launcher runs this script again, with the same command line, for each other
rank, so the CLI is built under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import ArgsType, LightningCLI
from torch import nn

import lightning_dynpipe  # noqa: F401  (registers strategy="dynpipe" and the class-path aliases)
from lightning_dynpipe.demos import DigitsDataModule


class DigitsNet(L.LightningModule):
    """A 3-layer MLP for the 8x8 digits that follows the DynPipe contract.

    Every trainable parameter lives in ``self.pipeline`` and each ``*_step`` calls it exactly once.

    Args:
        width: features of the two hidden layers.
        lr: SGD learning rate.
    """

    def __init__(self, width: int = 64, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        self.pipeline = nn.Sequential(
            nn.Sequential(nn.Linear(64, width), nn.ReLU()),
            nn.Sequential(nn.Linear(width, width), nn.ReLU()),
            nn.Linear(width, 10),
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.pipeline(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.pipeline(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_acc", (self.pipeline(x).argmax(-1) == y).float().mean())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def cli_main(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """The user's CLI: a fixed model class and data module, the Trainer (and its strategy) from the command line.

    Args:
        args: the arguments; ``None`` reads ``sys.argv[1:]`` (what the popen launcher's other ranks see).
        run: run the subcommand; ``False`` only builds the Trainer, model and data module.

    Returns:
        The ``LightningCLI`` instance.
    """
    return LightningCLI(DigitsNet, DigitsDataModule, seed_everything_default=0, args=args, run=run)


if __name__ == "__main__":
    cli_main()
