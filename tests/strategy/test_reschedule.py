"""Live changes of schedule: more (or fewer) micro-batches in flight from one step on, without a restart.

A run that changes ``async`` -> ``async+1`` -> ``async`` (the last change with a repartition at the same step)
equals the PipeDream replay with the same drains, staleness changes and partition change (SGD with momentum,
tolerance 1e-6 as for migrations); one that changes ``sync`` -> ``gpipe`` equals plain training; the changes are
recorded and what cannot change live is refused.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from pipeline_models import (
    TinyNet,
    fit_three_stages_against_the_replay,
    loader,
    make_optimizer,
    plain_training,
    trainer_kwargs,
)

from lightning_dynpipe import DynPipeStrategy
from lightning_dynpipe.calibration import replay_async
from lightning_dynpipe.errors import ConfigurationError

pytestmark = pytest.mark.multiprocess

CHANGES = {3: "async+1", 6: "async"}  # before batch 3 and batch 6 of the first epoch
MOVE = {6: [1, 3, 1]}


class Rescheduler(L.Callback):
    def __init__(self) -> None:
        self.refusals: list[str] = []
        self.seen: list[str] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        s = trainer.strategy
        assert isinstance(s, DynPipeStrategy)
        self.seen.append(s.schedule)
        if trainer.current_epoch == 0 and batch_idx == 1:
            for bad in ("sync", "zb"):
                with pytest.raises(ConfigurationError) as info:
                    s.reschedule(bad)
                self.refusals.append(str(info.value))
        if trainer.current_epoch == 0 and batch_idx in CHANGES:
            s.reschedule(CHANGES[batch_idx])
        if trainer.current_epoch == 0 and batch_idx in MOVE:
            s.repartition(MOVE[batch_idx])

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        s = trainer.strategy
        assert isinstance(s, DynPipeStrategy) and s.executor is not None
        # the executor runs the schedule the strategy names, with its staleness
        assert s.executor.schedule.name == s.schedule
        assert s.executor.staleness == s.executor.schedule.staleness(s.stage_idx, s.num_stages)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = trainer.strategy
        assert isinstance(s, DynPipeStrategy)
        assert [(c.step, c.old, c.new) for c in s.schedule_changes] == [
            (3, "async", "async+1"),
            (6, "async+1", "async"),
        ]
        assert all(c.pause_s > 0 for c in s.schedule_changes)
        assert [list(m.new.balance) for m in s.migrations] == [[1, 3, 1]]
        # the callbacks' hook runs before the strategy's, which applies a change asked for in the same hook
        assert self.seen[:8] == ["async"] * 4 + ["async+1"] * 3 + ["async"]
        assert "reschedule() changes how many micro-batches are in flight, not how updates are made" in self.refusals[0]
        assert "Pass schedule='sync' to DynPipeStrategy" in self.refusals[0]
        assert "reschedule(): Unknown schedule 'zb'" in self.refusals[1]


def test_a_rescheduling_run_equals_the_replay_with_the_same_staleness_changes() -> None:
    fit_three_stages_against_the_replay(
        Rescheduler(), restaleness={2: [4, 2, 0], 5: [2, 1, 0]}, repartitions={k - 1: v for k, v in MOVE.items()}
    )
    # and the changes matter: PipeDream's staleness throughout gives other weights
    changed, pipedream = TinyNet(), TinyNet()
    for net, restale in ((changed, {2: [4, 2, 0], 5: [2, 1, 0]}), (pipedream, {})):
        replay_async(
            net.pipeline, [2, 2, 1], make_optimizer, list(loader()), 4, lambda out, mb: F.cross_entropy(out, mb[1]),
            restaleness=restale, repartitions={k - 1: v for k, v in MOVE.items()}, lr_scale=1 / 4,
        )  # fmt: skip
    assert any(not torch.allclose(changed.state_dict()[k], v, atol=1e-6) for k, v in pipedream.state_dict().items())


def test_reschedule_outside_a_fit_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"reschedule\(\) needs a running pipeline: call it during fit"):
        DynPipeStrategy().reschedule("async+1")


class FlushSwitcher(L.Callback):
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        s = trainer.strategy
        assert isinstance(s, DynPipeStrategy)
        if batch_idx == 3:
            s.reschedule("gpipe")
            with pytest.raises(
                ConfigurationError, match="'gpipe' updates once per step, 'async' after every micro-batch"
            ):
                s.reschedule("async")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = trainer.strategy
        assert isinstance(s, DynPipeStrategy)
        assert [(c.step, c.old, c.new) for c in s.schedule_changes] == [(3, "sync", "gpipe")]


def test_between_the_flush_schedules_training_stays_plain() -> None:
    """``sync`` -> ``gpipe``: both update once per step from the whole batch, so the run still equals plain
    training (1e-6); a change to ``async`` is refused."""
    model = TinyNet()
    ref = plain_training(model, list(loader()))
    trainer = L.Trainer(
        devices=2,
        max_epochs=1,
        strategy=DynPipeStrategy(
            balance=[2, 3], num_microbatches=4, schedule="sync", start_method="fork", adaptive=False
        ),
        **trainer_kwargs(callbacks=[FlushSwitcher()]),
    )
    trainer.fit(model, loader())
    for k, v in ref.state_dict().items():
        assert torch.allclose(model.state_dict()[k], v, atol=1e-6, rtol=0), k
