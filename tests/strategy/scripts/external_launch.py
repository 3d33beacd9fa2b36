"""Trains TinyNet with DynPipe under an external launcher (torchrun, or one process per "node").

Usage: python external_launch.py OUT [--devices N] [--num-nodes N]. Rank 0 saves the trained state_dict to OUT.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning.pytorch as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline_models import TinyNet, loader, trainer_kwargs  # noqa: E402

from lightning_dynpipe import DynPipeStrategy  # noqa: E402

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1)
    a = p.parse_args()
    model = TinyNet()
    trainer = L.Trainer(
        devices=a.devices,
        num_nodes=a.num_nodes,
        max_epochs=1,
        strategy=DynPipeStrategy(balance=[2, 3], num_microbatches=4, adaptive=False),
        **trainer_kwargs(),
    )
    trainer.fit(model, loader())
    assert trainer.world_size == 2 and trainer.global_step == 8
    assert isinstance(trainer.strategy, DynPipeStrategy)
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), a.out)
