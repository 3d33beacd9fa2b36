"""A 2-stage fit (popen launcher) in which one stage fails at step 3, or (``long``) that trains until interrupted.

Usage: python failing_fit.py {last-exception,last-exception-slow-exit,first-exception,first-sigkill,
first-update-exception,finetune-group,long,long-spawn}

``long-spawn``: as ``long``, with the spawn launcher (the ranks are children of the launching process, which does
not train).

``first-update-exception``: under ``sync``, stage 0 raises in ``on_before_optimizer_step`` at FAIL_STEP, when the
last stage has finished that step and waits in a collective (a callback's barrier at every batch's end, as a
user's callback may hold), not on a pipeline receive.

``finetune-group``: a finetuning callback adds stage 0's first layer to the optimizer as a new parameter group at
the second epoch (refused: the optimizer was split at set-up).

``last-exception-slow-exit``: as ``last-exception``, and the script goes on after ``fit`` raised (as a script
that cleans up or logs would) until the other rank has ended, plus 6 s, before it re-raises: Lightning's
child-process observer, which polls every 5 s, sees the other rank's exit code 1 while this process still runs.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import BaseFinetuning
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline_models import TinyNet, loader, trainer_kwargs  # noqa: E402

from lightning_dynpipe import DynPipeStrategy  # noqa: E402

FAIL_STEP = 3


class Bomb(nn.Module):
    """Identity that raises in its forward once the stage reaches FAIL_STEP (runs on stage 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > FAIL_STEP * 4:
            raise RuntimeError("boom in stage 0's layer")
        return x


class FailingNet(TinyNet):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        if mode == "first-exception":
            self.pipeline.insert(0, Bomb())

    def configure_optimizers(self) -> Any:  # the trainable parameters only, as a finetuning set-up does
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.mode.startswith("last-exception") and batch_idx == FAIL_STEP:
            raise ValueError("boom in training_step")
        return super().training_step(batch, batch_idx)


class KillStageZero(L.Callback):
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == FAIL_STEP and trainer.strategy.stage_idx == 0:  # type: ignore[attr-defined]
            os.kill(os.getpid(), signal.SIGKILL)


class FailStageZerosUpdate(L.Callback):
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == FAIL_STEP and trainer.strategy.stage_idx == 0:  # type: ignore[attr-defined]
            raise RuntimeError("boom in stage 0's update")


class BarrierAtBatchEnd(L.Callback):
    """A collective on every rank at every batch's end, as a user's callback may hold."""

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        trainer.strategy.barrier()


class UnfreezeIntoNewGroup(BaseFinetuning):
    """Freezes the first layer, and adds it to the optimizer as a group of its own at the second epoch."""

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.pipeline[0])

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(modules=pl_module.pipeline[0], optimizer=optimizer, lr=0.05)


class AnnounceTraining(L.Callback):
    """Prints ``TRAINING STARTED`` on global rank 0 once two steps have run (the pipeline is set up and training)."""

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.is_global_zero and trainer.global_step == 2:
            print("TRAINING STARTED", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    callbacks: list[L.Callback] = {
        "first-sigkill": [KillStageZero()],
        "long": [AnnounceTraining()],
        "long-spawn": [AnnounceTraining()],
        "finetune-group": [UnfreezeIntoNewGroup()],
        "first-update-exception": [FailStageZerosUpdate(), BarrierAtBatchEnd()],
    }.get(mode, [])
    balance = [3, 3] if mode == "first-exception" else [2, 3]
    epochs = 10_000 if mode.startswith("long") else 2
    schedule = "sync" if mode == "first-update-exception" else "async"  # sync: stage 0 updates after the last stage
    start = "spawn" if mode == "long-spawn" else "popen"
    trainer = L.Trainer(
        devices=2,
        max_epochs=epochs,
        strategy=DynPipeStrategy(num_microbatches=4, balance=balance, schedule=schedule, start_method=start),
        **trainer_kwargs(callbacks=callbacks),
    )
    try:
        trainer.fit(FailingNet(mode), loader())
    except Exception:
        children = trainer.strategy.launcher.procs if trainer.strategy.launcher else []  # type: ignore[attr-defined]
        if mode == "last-exception-slow-exit" and children:  # the launching process
            deadline = time.monotonic() + 60
            while any(p.poll() is None for p in children) and time.monotonic() < deadline:
                time.sleep(0.2)
            print(f"the other ranks ended with {[p.returncode for p in children]}", flush=True)
            time.sleep(6.0)
        raise
