"""popen launcher, 2 processes: ``change_stages="restart"`` and ``fit_with_restarts``, every process running the loop.

A 2-stage async fit whose planner, with a strong staleness penalty, prefers 2 replicas of 1 stage: it ends at the
step of that decision and continues from the checkpoint under 1 stage on the same processes (the process group of
the first fit, no new launch). Each rank checks that it ran two fits, the second with 1 stage x 2 replicas from
the first one's last step to ``max_steps``, and prints ``RESTART_OK``.

Usage: python restart_popen.py ROOT_DIR
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as L
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline_models import TinyNet, loader, restarting_trainer  # noqa: E402

from lightning_dynpipe import fit_with_restarts  # noqa: E402

MAX_STEPS = 16


class Steps(L.Callback):
    def __init__(self) -> None:
        self.fits: list[tuple[int, int, int, int]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = trainer.strategy
        self.fits.append((self.start, trainer.global_step, s.num_stages, s.topology.dp_size))  # type: ignore[attr-defined]


def main(root: str) -> None:
    steps = Steps()
    trainers: list[L.Trainer] = []

    def make_trainer(num_stages: int | None) -> L.Trainer:
        trainers.append(restarting_trainer(num_stages, root, MAX_STEPS, [steps]))
        return trainers[-1]

    last = fit_with_restarts(make_trainer, TinyNet(), loader(batch_size=16))
    plan = trainers[0].strategy.restart_plan  # type: ignore[attr-defined]
    assert plan is not None and plan.num_stages == 1 and os.path.exists(plan.checkpoint), plan
    assert steps.fits == [(0, plan.step, 2, 1), (plan.step, MAX_STEPS, 1, 2)], steps.fits
    assert last is trainers[1] and last.global_step == MAX_STEPS
    sys.stdout.write(f"RESTART_OK rank {dist.get_rank()}\n")  # one write: both ranks share the pipe
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
