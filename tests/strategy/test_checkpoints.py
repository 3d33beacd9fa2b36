"""Checkpoints are partition-independent: original parameter names and the optimizer state a plain model's
optimizer would have, so they load into the plain LightningModule and resume under any number of stages.

The trajectories use ``schedule="sync"``, which equals plain training, so "resuming continues the same
trajectory" is checked against an uninterrupted single-device reference (tolerance 1e-6 for float32 gradient
accumulation over micro-batches)."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from pipeline_models import ScheduledNet, loader, plain_scheduled_training, trainer_kwargs

from lightning_dynpipe import DynPipeStrategy

pytestmark = pytest.mark.multiprocess

N = 48  # 4 steps per epoch with batch 12


def _trainer(tmp: Path, devices: int | None, epochs: int, stages: int | None = None) -> L.Trainer:
    kw = trainer_kwargs(
        max_epochs=epochs,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp, save_last=True, save_top_k=0)],
    )
    if stages is None:
        return L.Trainer(devices=1, **kw)
    strategy = DynPipeStrategy(num_stages=stages, num_microbatches=3, schedule="sync", start_method="fork")
    return L.Trainer(devices=devices, strategy=strategy, **kw)


def _assert_close(a: torch.nn.Module, b: torch.nn.Module, atol: float = 1e-6) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.allclose(sa[k], sb[k], atol=atol, rtol=0), f"{k}: {(sa[k] - sb[k]).abs().max():.3g}"


def test_checkpoint_loads_into_plain_model_and_resumes_under_other_stage_counts(tmp_path: Path) -> None:
    model = ScheduledNet()
    batches = list(loader(n=N))
    ref1 = plain_scheduled_training(model, batches)
    ref2 = plain_scheduled_training(model, batches * 2)

    # 1 epoch on 2 stages -> last.ckpt
    m2 = copy.deepcopy(model)
    _trainer(tmp_path / "s2", devices=2, epochs=1, stages=2).fit(m2, loader(n=N))
    ckpt = tmp_path / "s2" / "last.ckpt"
    data = torch.load(ckpt, weights_only=False)
    assert list(data["state_dict"]) == list(model.state_dict())
    assert data["dynpipe"]["num_stages"] == 2
    opt_state = data["optimizer_states"][0]
    assert [g["params"] for g in opt_state["param_groups"]] == [list(range(6))]
    assert sorted(opt_state["state"]) == list(range(6))
    assert all(float(s["step"]) == 4 for s in opt_state["state"].values())

    # strict load into the plain LightningModule; equals the plain reference
    loaded = ScheduledNet.load_from_checkpoint(ckpt)
    _assert_close(loaded, ref1)

    # resume under 3 stages for a second epoch == uninterrupted plain training
    m3 = copy.deepcopy(model)
    t3 = _trainer(tmp_path / "s3", devices=3, epochs=2, stages=3)
    t3.fit(m3, loader(n=N), ckpt_path=ckpt)
    _assert_close(m3, ref2)
    data3 = torch.load(tmp_path / "s3" / "last.ckpt", weights_only=False)
    assert data3["global_step"] == 8 and data3["dynpipe"]["num_stages"] == 3
    assert data3["lr_schedulers"][0]["last_epoch"] == 8
    assert all(float(s["step"]) == 8 for s in data3["optimizer_states"][0]["state"].values())

    # resume the 2-stage checkpoint in a plain single-device Trainer
    mp = copy.deepcopy(model)
    _trainer(tmp_path / "plain", devices=None, epochs=2).fit(mp, loader(n=N), ckpt_path=ckpt)
    _assert_close(mp, ref2)


def test_plain_checkpoint_resumes_under_dynpipe(tmp_path: Path) -> None:
    model = ScheduledNet()
    ref2 = plain_scheduled_training(model, list(loader(n=N)) * 2)
    m1 = copy.deepcopy(model)
    _trainer(tmp_path / "plain", devices=None, epochs=1).fit(m1, loader(n=N))
    m2 = copy.deepcopy(model)
    _trainer(tmp_path / "s2", devices=2, epochs=2, stages=2).fit(
        m2, loader(n=N), ckpt_path=tmp_path / "plain" / "last.ckpt"
    )
    _assert_close(m2, ref2)
