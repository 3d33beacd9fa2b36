"""Where a stage's gradients can be read: ``on_before_optimizer_step`` sees them before every update;
``on_after_backward`` fires once per step after the step's updates have applied and cleared them (the executor
back-propagated each micro-batch inside the step), so it sees none: log gradient norms in
``on_before_optimizer_step``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from pipeline_models import TinyNet, loader, trainer_kwargs

from lightning_dynpipe import DynPipeStrategy

pytestmark = pytest.mark.multiprocess


class _Seen(L.Callback):
    """Per rank: how many parameters had a gradient at each hook, written to ``<directory>/rank<r>.json``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.seen: dict[str, list[int]] = {"before_optimizer_step": [], "after_backward": []}

    def _record(self, trainer: L.Trainer, module: L.LightningModule, hook: str) -> None:
        self.seen[hook].append(sum(p.grad is not None for p in module.parameters()))
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.seen))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._record(trainer, pl_module, "before_optimizer_step")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record(trainer, pl_module, "after_backward")


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_gradients_are_seen_before_each_update_and_gone_after_the_step(schedule: str, tmp_path: Path) -> None:
    strategy = DynPipeStrategy(
        num_microbatches=2, schedule=schedule, start_method="fork", balance=[2, 3], adaptive=False
    )
    kw = trainer_kwargs(max_steps=3, callbacks=[_Seen(tmp_path)])
    L.Trainer(devices=2, strategy=strategy, **kw).fit(TinyNet(), loader())
    # TinyNet's 5 layers split [2, 3]: stage 0 (rank 1) owns one Linear (2 tensors), stage 1 (rank 0) two (4)
    for rank, owned in ((1, 2), (0, 4)):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        updates = seen["before_optimizer_step"]
        assert updates and all(n == owned for n in updates), (rank, seen)
        assert seen["after_backward"] == [0, 0, 0], (rank, seen)


class _NormNet(TinyNet):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        grads = [p.grad.norm() for p in self.parameters() if p.grad is not None]
        self.log(f"grad_norm_stage{self.trainer.strategy.stage_idx}", sum(grads))  # type: ignore[attr-defined]


def test_a_value_logged_on_another_rank_does_not_reach_the_logger(tmp_path: Path) -> None:
    """Loggers write on rank 0, the last stage: its own gradient norm reaches ``metrics.csv``, stage 0's (logged on
    rank 1) does not. What the user guide says under "Where your code runs"."""
    from lightning.pytorch.loggers import CSVLogger

    strategy = DynPipeStrategy(num_microbatches=2, schedule="sync", start_method="fork", balance=[2, 3], adaptive=False)
    kw = trainer_kwargs(max_steps=3, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    L.Trainer(devices=2, strategy=strategy, **kw).fit(_NormNet(), loader())
    [metrics] = list(tmp_path.glob("**/metrics.csv"))
    columns = metrics.read_text().splitlines()[0].split(",")
    assert "grad_norm_stage1" in columns and "grad_norm_stage0" not in columns, columns


class _FrozenByHook(TinyNet):
    """The first layer's weight gets a gradient hook that zeroes its gradient (a user's way to freeze it)."""

    def __init__(self) -> None:
        super().__init__()
        self.pipeline[0].weight.register_hook(torch.zeros_like)


def test_a_gradient_hook_on_a_stashed_stages_parameter_runs_under_async() -> None:
    """Stage 0 of ``async`` back-propagates through its stashed weight versions, not the parameters: the parameter's
    hook must still run on every micro-batch's gradient (here: the weight it zeroes stays as it was)."""
    strategy = DynPipeStrategy(
        num_microbatches=2, schedule="async", start_method="fork", balance=[2, 3], adaptive=False
    )
    model = _FrozenByHook()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(max_steps=3)).fit(model, loader())
    after = dict(model.named_parameters())  # gathered on rank 0 after the fit
    assert torch.equal(after["pipeline.0.weight"], before["pipeline.0.weight"])
    assert not torch.equal(after["pipeline.0.bias"], before["pipeline.0.bias"])  # the rest of stage 0 trained
