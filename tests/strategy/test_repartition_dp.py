"""Live repartitioning with data-parallel pipeline replicas: devices=4, num_stages=2 (2 pipelines x 2 stages).

Each pipeline moves its layers inside its own group, every rank taking the same decisions. The run, with layers
moving both ways, must equal the PipeDream replay with the same partition changes on the merged global batches
(as in test_data_parallel: dp=2 x S=2 equals dp=1 x S=2), weights and optimizer state to 1e-6; both replicas of
a stage must hold identical weights and optimizer state after every migration; a checkpoint saved after the
migrations loads strictly into the plain LightningModule.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from pipeline_models import TinyNet, make_optimizer, trainer_kwargs
from test_data_parallel import M, ShardedData, _global_batches
from torch import nn

from lightning_dynpipe import DynPipeStrategy
from lightning_dynpipe.calibration import replay_async

pytestmark = pytest.mark.multiprocess

BALANCE = [2, 3]
MOVES = {1: [4, 1], 3: [1, 4]}  # before batch 1: layers 2, 3 move to stage 0; before batch 3: layers 1-3 to stage 1


class MigrateAndCheck(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx in MOVES:
            trainer.strategy.repartition(MOVES[batch_idx])  # type: ignore[attr-defined]

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        s = trainer.strategy
        assert isinstance(s, DynPipeStrategy) and s.partition is not None
        if batch_idx in MOVES:
            assert list(s.partition.balance) == MOVES[batch_idx]
        # Both replicas of this stage: the same layers, weights and momentum, bit for bit (one step after a move).
        pipeline: nn.Sequential = pl_module.pipeline  # type: ignore[assignment]
        opt = trainer.optimizers[0]
        params = [p for i in s.partition.stage_layers(s.stage_idx) for p in pipeline[i].parameters()]
        assert params and all(p.device.type == "cpu" for p in params)
        flat = torch.cat([t.detach().reshape(-1) for p in params for t in (p, opt.state[p]["momentum_buffer"])])
        gathered = s.all_gather(flat)  # over this stage's replicas
        assert gathered.shape == (2, flat.numel())
        assert torch.equal(gathered[0], gathered[1]), (s.global_rank, batch_idx)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = trainer.strategy
        assert isinstance(s, DynPipeStrategy)
        assert s.topology.dp_size == 2
        assert [list(r.new.balance) for r in s.migrations] == list(MOVES.values())
        assert [r.moved for r in s.migrations] == [(2, 3), (1, 2, 3)]
        trainer.save_checkpoint(self.path)


def test_replicas_migrate_like_one_pipeline_on_the_same_global_batches(tmp_path: Path) -> None:
    ckpt = tmp_path / "after_migrations.ckpt"
    model = TinyNet()
    ref = copy.deepcopy(model)
    trainer = L.Trainer(
        devices=4,
        max_epochs=1,
        strategy=DynPipeStrategy(
            num_stages=2, balance=BALANCE, num_microbatches=M, start_method="fork", adaptive=False
        ),
        **trainer_kwargs(callbacks=[MigrateAndCheck(ckpt)]),
    )
    trainer.fit(model, datamodule=ShardedData())

    ref_opts: list[torch.optim.Optimizer] = []

    def recording_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        ref_opts.append(make_optimizer(params))
        return ref_opts[-1]

    replay_async(
        ref.pipeline,
        BALANCE,
        recording_optimizer,
        _global_batches(),
        M,
        lambda out, mb: F.cross_entropy(out, mb[1]),
        repartitions={k - 1: v for k, v in MOVES.items()},
        lr_scale=1 / M,  # DynPipe's default lr_scale='auto': 1/M per async update
    )
    for k, v in ref.state_dict().items():
        assert torch.allclose(model.state_dict()[k], v, atol=1e-6, rtol=0), k

    loaded = TinyNet.load_from_checkpoint(ckpt)  # strict, original names, full shapes
    for k, v in ref.state_dict().items():
        assert torch.allclose(loaded.state_dict()[k], v, atol=1e-6, rtol=0), k
    data = torch.load(ckpt, weights_only=False)
    assert data["dynpipe"]["balance"] == MOVES[3]
    state = data["optimizer_states"][0]["state"]
    ref_state = {id(p): st for o in ref_opts for p, st in o.state.items()}
    assert sorted(state) == list(range(6))
    for j, p in enumerate(ref.parameters()):  # canonical index = position in TinyNet.parameters()
        assert torch.allclose(state[j]["momentum_buffer"], ref_state[id(p)]["momentum_buffer"], atol=1e-6, rtol=0), j
