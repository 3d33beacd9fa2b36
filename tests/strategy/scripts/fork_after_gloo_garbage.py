"""fork launcher after an earlier run left a gloo process group as garbage in this process.

The group is kept in a reference cycle past a full collection (so it sits in the oldest generation, which the
collector rarely visits), then dropped: unreachable, not yet freed. Each forked worker runs a full collection
at the start of training, as its own collector eventually would. Unless the parent collected before forking,
the worker frees the inherited group there, and the group's destructor joins worker threads that a forked
process does not have: the fit never ends. Prints ``FORK_OK`` when the fit ends.
"""

from __future__ import annotations

import gc
import os
import socket
import sys

import lightning.pytorch as L
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline_models import TinyNet, loader, trainer_kwargs  # noqa: E402

from lightning_dynpipe import DynPipeStrategy  # noqa: E402


class CollectInWorker(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        gc.collect()


def leave_group_garbage() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cycle: list[object] = [dist.group.WORLD]
    cycle.append(cycle)
    gc.collect()  # the cycle survives: it moves to the oldest generation
    dist.destroy_process_group()
    del cycle  # unreachable now, and not freed until a full collection


if __name__ == "__main__":
    leave_group_garbage()
    strategy = DynPipeStrategy(start_method="fork", balance=[2, 3], num_microbatches=2, adaptive=False)
    trainer = L.Trainer(devices=2, max_steps=2, strategy=strategy, **trainer_kwargs(callbacks=[CollectInWorker()]))
    trainer.fit(TinyNet(), loader())
    print("FORK_OK")
