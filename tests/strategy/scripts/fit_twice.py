"""popen launcher: fit, fit again with a new Trainer, then validate; checks that nothing leaks in between.

Also: every fit's stage processes keep freed CPU memory (the default), and a strategy told not to leaves the
allocator alone.

Also: with one pipeline, Lightning's advice to log epoch-level values with ``sync_dist=True`` is hidden during
the runs (only the last stage logs; there is nothing to reduce over), and the filter is gone afterwards.
"""

from __future__ import annotations

import os
import sys
import warnings

import lightning.pytorch as L
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline_models import TinyNet, loader, trainer_kwargs  # noqa: E402

from lightning_dynpipe import DynPipeStrategy  # noqa: E402


def own_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map) - 1  # everything but WORLD


if __name__ == "__main__":
    model = TinyNet()
    seen = warnings.catch_warnings(record=True)
    caught = seen.__enter__()
    warnings.simplefilter("always")
    for attempt in range(2):
        trainer = L.Trainer(devices=2, max_steps=4, strategy=DynPipeStrategy(), **trainer_kwargs())
        trainer.fit(model, loader(), loader(n=24))
        assert trainer.model is model, "the strategy must not wrap the LightningModule"
        assert own_groups() == 0, f"fit {attempt} left {own_groups()} process groups behind"
        assert all(p.device.type == "cpu" for p in model.parameters()), "model not reassembled"
        assert trainer.strategy.cpu_memory_kept, "keep_freed_cpu_memory=True (the default) was not applied"
    plain = DynPipeStrategy(keep_freed_cpu_memory=False)
    metrics = L.Trainer(devices=2, strategy=plain, **trainer_kwargs()).validate(model, loader(n=24))
    assert not plain.cpu_memory_kept
    assert own_groups() == 0
    seen.__exit__(None, None, None)
    advice = [str(w.message) for w in caught if "sync_dist=True" in str(w.message)]
    assert not advice, f"the sync_dist advice reached the user with one pipeline: {advice}"
    assert not any("sync_dist" in str(f[1].pattern if f[1] else "") for f in warnings.filters), "filter leaked"
    if dist.get_rank() == 0:
        assert "val_loss" in metrics[0]
        print("FIT_TWICE_OK", flush=True)
