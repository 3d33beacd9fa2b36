"""popen launcher, 2 processes: sharded checkpoints and a module left sharded after fit, end to end in Lightning.

1. 2 stages, ``checkpoint="sharded"``, ``gather_after_fit=False``: every process keeps its stage's layers after
   fit; metrics still reach every rank; the sharded checkpoint consolidates to exactly what ``checkpoint="full"``
   writes for the same run (2.), and loads into a plain module with the standard DCP call.
3. It resumes under 1 stage x 2 data-parallel replicas (sharded reading) and under another 2-stage partition with
   ``checkpoint="full"`` (which reads it whole): both continue the plain single-device trajectory.
4. The run of 2., built under ``trainer.init_module(empty_init=True)`` (on meta, each stage materialising only its
   own layers), ends with the same weights, bit for bit.
5. A module left sharded refuses to be saved whole.

Usage: python sharded_checkpoint.py <directory shared by the ranks>
"""

from __future__ import annotations

import copy
import io
import os
import sys
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline_models import ScheduledNet, loader, plain_scheduled_training, trainer_kwargs  # noqa: E402

from lightning_dynpipe import DynPipeStrategy  # noqa: E402
from lightning_dynpipe.engine import sharded  # noqa: E402
from lightning_dynpipe.engine.materialize import is_on_meta  # noqa: E402
from lightning_dynpipe.engine.shard import Placeholder  # noqa: E402
from lightning_dynpipe.errors import ConfigurationError  # noqa: E402

N = 48  # 4 steps per epoch with batch 12


def fit(model: ScheduledNet, out: Path, epochs: int, ckpt: Path | None = None, **strategy: object) -> L.Trainer:
    kw = trainer_kwargs(
        max_epochs=epochs,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=out, save_last=True, save_top_k=0)],
    )
    trainer = L.Trainer(
        devices=2,
        strategy=DynPipeStrategy(num_microbatches=3, schedule="sync", **strategy),
        **kw,  # type: ignore[arg-type]
    )
    trainer.fit(model, loader(n=N), ckpt_path=ckpt)
    return trainer


def close(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert list(a) == list(b)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), f"{k}: {(a[k] - b[k]).abs().max():.3g}"


def saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


if __name__ == "__main__":
    root = Path(sys.argv[1])
    model = ScheduledNet()
    batches = list(loader(n=N))
    ref1, ref2 = plain_scheduled_training(model, batches), plain_scheduled_training(model, batches * 2)

    # 1. sharded checkpoint, module left sharded
    m1 = copy.deepcopy(model)
    t1 = fit(m1, root / "sharded", 1, balance=[3, 2], checkpoint="sharded", gather_after_fit=False)
    stage = 1 if dist.get_rank() == 0 else 0  # the last stage sits on rank 0
    held = [i for i, layer in enumerate(m1.pipeline) if not isinstance(layer, Placeholder)]
    assert held == ([0, 1, 2] if stage == 0 else [3, 4]), held
    assert "train_loss" in t1.callback_metrics, sorted(t1.callback_metrics)  # the metrics mirror still works
    ckpt = root / "sharded" / "last.ckpt"
    assert sharded.is_sharded_checkpoint(ckpt)

    # 2. the same run with checkpoint="full"
    m2 = copy.deepcopy(model)
    fit(m2, root / "full", 1, balance=[3, 2])
    dist.barrier()
    if dist.get_rank() == 0:
        full = torch.load(root / "full" / "last.ckpt", weights_only=False)
        whole = sharded.consolidate(ckpt)
        assert list(whole["state_dict"]) == list(full["state_dict"])
        for k, v in full["state_dict"].items():
            assert torch.equal(whole["state_dict"][k], v), k
        assert saved(whole["optimizer_states"]) == saved(full["optimizer_states"])
        assert whole["lr_schedulers"] == full["lr_schedulers"] and whole["loops"] == full["loops"]
        assert whole["global_step"] == full["global_step"] == 4
        close(full["state_dict"], ref1.state_dict())
        plain = ScheduledNet(seed=3)
        # the docs' call, in one process (here with no_dist: rank 1 is not taking part)
        dcp.load({"state_dict": plain.state_dict()}, checkpoint_id=ckpt, no_dist=True)
        for k, v in full["state_dict"].items():
            assert torch.equal(plain.state_dict()[k], v), k
    dist.barrier()

    # 3. resume the sharded checkpoint under 1 stage x 2 replicas, and under checkpoint="full"
    m3 = copy.deepcopy(model)
    fit(m3, root / "dp", 2, ckpt, balance=[5], checkpoint="sharded")
    close(m3.state_dict(), ref2.state_dict())
    m4 = copy.deepcopy(model)
    fit(m4, root / "full2", 2, ckpt, balance=[2, 3])
    close(m4.state_dict(), ref2.state_dict())
    if dist.get_rank() == 0:
        resumed = sharded.consolidate(root / "dp" / "last.ckpt")
        assert resumed["global_step"] == 8 and resumed["lr_schedulers"][0]["last_epoch"] == 8
        assert all(float(s["step"]) == 8 for s in resumed["optimizer_states"][0]["state"].values())

    # 4. the same run as 2., built on meta and materialised per stage: the same weights, bit for bit
    kw = trainer_kwargs(max_epochs=1)
    t5 = L.Trainer(
        devices=2,
        strategy=DynPipeStrategy(num_microbatches=3, schedule="sync", balance=[3, 2], adaptive=False),
        **kw,  # type: ignore[arg-type]
    )
    with t5.init_module(empty_init=True):
        m5 = ScheduledNet()
    assert is_on_meta(m5)
    t5.fit(m5, loader(n=N))
    for k, v in m2.state_dict().items():
        assert torch.equal(m5.state_dict()[k], v), k

    # 5. the module left sharded is not saved as if it were whole
    try:
        t1.save_checkpoint(root / "after.ckpt")
    except ConfigurationError as exc:
        assert "gather_after_fit=False" in str(exc), exc
    else:
        raise AssertionError("saving a module left sharded must be refused")
    if dist.get_rank() == 0:
        print("SHARDED_CHECKPOINT_OK", flush=True)
