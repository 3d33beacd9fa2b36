"""Live repartitioning: layers, buffers and optimizer state move between stages without a restart.

(a) a run that migrates equals the PipeDream replay with the same drains and the same partition changes
    (async, Adam and SGD with momentum; tolerance 1e-6);
(b) 100 random migrations leave the full state dict and the canonical optimizer state exactly unchanged;
(c) a checkpoint taken after migrations is still partition-independent (strict load into the plain module).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from pipeline_models import TinyNet, fit_three_stages_against_the_replay, loader, trainer_kwargs

from lightning_dynpipe import DynPipeStrategy, Partition
from lightning_dynpipe.repartition import plan_moves

pytestmark = pytest.mark.multiprocess

MOVES = {3: [1, 3, 1], 6: [3, 1, 1]}  # before batch 3 and batch 6 of the first epoch


class Repartitioner(L.Callback):
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.current_epoch == 0 and batch_idx in MOVES:
            trainer.strategy.repartition(MOVES[batch_idx])  # type: ignore[attr-defined]

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = trainer.strategy
        assert isinstance(s, DynPipeStrategy)
        assert [list(r.new.balance) for r in s.migrations] == list(MOVES.values())
        assert all(r.pause_s > 0 for r in s.migrations)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])  # sgd: momentum, and its updates write fresh storage
def test_a_migrating_run_equals_the_replay_with_the_same_partition_changes(optimizer: str) -> None:
    fit_three_stages_against_the_replay(Repartitioner(), optimizer, repartitions={k - 1: v for k, v in MOVES.items()})


class RandomMigrations(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx != 2:
            return
        s = trainer.strategy
        assert isinstance(s, DynPipeStrategy) and s.partition is not None
        opt = trainer.optimizers[0]
        before = (s.lightning_module_state_dict(), s.optimizer_state(opt))
        rng = random.Random(0)  # the same sequence on every rank
        moved = 0
        for _ in range(100):
            cuts = sorted(rng.sample(range(1, 5), 2))
            new = Partition.from_balance([cuts[0], cuts[1] - cuts[0], 5 - cuts[1]])
            moved += len(plan_moves(s.partition, new))
            s._migrate(new, step=batch_idx)
        after = (s.lightning_module_state_dict(), s.optimizer_state(opt))
        trainer.save_checkpoint(self.path)
        if trainer.is_global_zero:
            assert moved > 100
            assert list(after[0]) == list(before[0])
            assert all(torch.equal(after[0][k], v) for k, v in before[0].items())
            assert after[1]["param_groups"] == before[1]["param_groups"]
            for idx, st in before[1]["state"].items():
                assert sorted(after[1]["state"][idx]) == sorted(st)
                assert all(
                    torch.equal(torch.as_tensor(after[1]["state"][idx][k]), torch.as_tensor(v)) for k, v in st.items()
                ), idx


def test_random_migrations_preserve_state_and_checkpoints(tmp_path: Path) -> None:
    ckpt = tmp_path / "after_migrations.ckpt"
    trainer = L.Trainer(
        devices=3,
        max_steps=4,
        strategy=DynPipeStrategy(balance=[2, 2, 1], num_microbatches=4, start_method="fork", adaptive=False),
        **trainer_kwargs(callbacks=[RandomMigrations(ckpt)]),
    )
    model = TinyNet(optimizer="adam")
    trainer.fit(model, loader())
    loaded = TinyNet.load_from_checkpoint(ckpt, optimizer="adam")  # strict, original names
    data = torch.load(ckpt, weights_only=False)
    assert list(data["state_dict"]) == list(TinyNet().state_dict())
    assert sorted(data["optimizer_states"][0]["state"]) == list(range(6))
    assert loaded.pipeline[0].weight.shape == (16, 8)
