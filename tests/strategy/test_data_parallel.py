"""Data-parallel pipeline replicas: devices=4, num_stages=2 gives 2 pipelines of 2 stages whose stage replicas
average gradients before every update. dp=2 x S=2 must equal dp=1 x S=2 on the same global batches: with
micro-batch i of the global batch made of micro-batch i of each replica, the averaged gradient is the
gradient of the merged micro-batch (equal sizes). Async, compared with the PipeDream replay to 1e-6."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from pipeline_models import TinyNet, dataset, make_optimizer, trainer_kwargs
from torch.utils.data import DataLoader, Subset

from lightning_dynpipe import DynPipeStrategy
from lightning_dynpipe.calibration import replay_async
from lightning_dynpipe.plan.convergence import staleness_profile

pytestmark = pytest.mark.multiprocess

B, M, N = 8, 4, 64  # per-replica batch, micro-batches, samples


class ShardedData(L.LightningDataModule):
    """Pipeline replica r reads the samples with index % 2 == r, in order (no sampler injection)."""

    def train_dataloader(self) -> DataLoader:
        r = self.trainer.strategy.dp_rank  # type: ignore[attr-defined]
        return DataLoader(Subset(dataset(N), list(range(r, N, 2))), batch_size=B)


class Checks(L.Callback):
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = trainer.strategy
        assert isinstance(s, DynPipeStrategy)
        assert s.topology.dp_size == 2 and s.num_stages == 2
        assert s.distributed_sampler_kwargs == {"num_replicas": 2, "rank": s.dp_rank}


def _global_batches() -> list[Any]:
    data = dataset(N)
    shards = [[data[i] for i in range(r, N, 2)] for r in range(2)]
    out = []
    for t in range(N // (2 * B)):
        rows = []
        for i in range(M):
            for r in range(2):
                rows += shards[r][t * B + i * (B // M) : t * B + (i + 1) * (B // M)]
        out.append((torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])))
    return out


@pytest.mark.parametrize("schedule", ["async", "async+1"])
def test_two_replicas_equal_one_pipeline_on_the_same_global_batches(schedule: str) -> None:
    """``async+1``: each replica keeps one more micro-batch in flight; the replicas still average every update."""
    model = TinyNet()
    ref = copy.deepcopy(model)
    trainer = L.Trainer(
        devices=4,
        max_epochs=1,
        strategy=DynPipeStrategy(
            num_stages=2, balance=[2, 3], num_microbatches=M, schedule=schedule, start_method="fork", adaptive=False
        ),
        **trainer_kwargs(callbacks=[Checks()]),
    )
    trainer.fit(model, datamodule=ShardedData())
    replay_async(
        ref.pipeline,
        [2, 3],
        make_optimizer,
        _global_batches(),
        M,
        lambda out, mb: F.cross_entropy(out, mb[1]),
        staleness=staleness_profile(2, schedule),
        lr_scale=1 / M,  # DynPipe's default lr_scale='auto': 1/M per async update
    )
    for k, v in ref.state_dict().items():
        assert torch.allclose(model.state_dict()[k], v, atol=1e-6, rtol=0), k


def test_sync_replicas_clip_by_the_whole_model_s_norm_of_the_averaged_gradient() -> None:
    """Clipping by norm under ``sync`` with 2 replicas of 2 stages: each replica averages its stages' gradients with
    the other replica's first, then takes the norm over its pipeline's stages; equals one device clipping the
    gradient of the global batch (the clip is active: the norm stays far above it)."""
    clip = 0.05
    model = TinyNet()
    ref = copy.deepcopy(model)
    trainer = L.Trainer(
        devices=4,
        max_epochs=1,
        gradient_clip_val=clip,
        strategy=DynPipeStrategy(
            num_stages=2, balance=[2, 3], num_microbatches=M, schedule="sync", start_method="fork", adaptive=False
        ),
        **trainer_kwargs(callbacks=[Checks()]),
    )
    trainer.fit(model, datamodule=ShardedData())
    opt = make_optimizer(list(ref.parameters()))
    norms = []
    for x, y in _global_batches():
        opt.zero_grad()
        F.cross_entropy(ref.pipeline(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        opt.step()
    assert min(norms) > 5 * clip
    assert not torch.equal(ref.pipeline[0].weight, TinyNet().pipeline[0].weight)  # it trained
    for k, v in ref.state_dict().items():
        assert torch.allclose(model.state_dict()[k], v, atol=1e-6, rtol=0), k
