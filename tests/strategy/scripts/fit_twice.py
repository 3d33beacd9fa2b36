"""popen launcher: fit, fit again with a new Trainer, then validate; checks that nothing leaks in between."""

from __future__ import annotations

import os
import sys

import lightning.pytorch as L
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline_models import TinyNet, loader, trainer_kwargs  # noqa: E402

from lightning_dynpipe import DynPipeStrategy  # noqa: E402


def own_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map) - 1  # everything but WORLD


if __name__ == "__main__":
    model = TinyNet()
    for attempt in range(2):
        trainer = L.Trainer(devices=2, max_steps=4, strategy=DynPipeStrategy(), **trainer_kwargs())
        trainer.fit(model, loader(), loader(n=24))
        assert trainer.model is model, "the strategy must not wrap the LightningModule"
        assert own_groups() == 0, f"fit {attempt} left {own_groups()} process groups behind"
        assert all(p.device.type == "cpu" for p in model.parameters()), "model not reassembled"
    metrics = L.Trainer(devices=2, strategy=DynPipeStrategy(), **trainer_kwargs()).validate(model, loader(n=24))
    assert own_groups() == 0
    if dist.get_rank() == 0:
        assert "val_loss" in metrics[0]
        print("FIT_TWICE_OK", flush=True)
