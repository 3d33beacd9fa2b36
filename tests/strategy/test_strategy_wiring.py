"""Registry, constructor refusals and connector wiring: no processes are started."""

from __future__ import annotations

from datetime import timedelta

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

import lightning_dynpipe
from lightning_dynpipe import ConfigurationError, DynPipeStrategy, PartitionError


def test_registered_names() -> None:
    assert StrategyRegistry["dynpipe"]["strategy"] is DynPipeStrategy
    assert StrategyRegistry["dynpipe_spawn"]["init_params"] == {"start_method": "spawn"}
    assert StrategyRegistry["dynpipe_fork"]["init_params"] == {"start_method": "fork"}
    DynPipeStrategy.register_strategies(StrategyRegistry)  # idempotent: a re-import must not raise
    assert lightning_dynpipe.__version__


@pytest.mark.parametrize(
    ("name", "launcher"),
    [
        ("dynpipe", _SubprocessScriptLauncher),
        ("dynpipe_spawn", _MultiProcessingLauncher),
        ("lightning_dynpipe.DynPipeStrategy", _SubprocessScriptLauncher),
    ],
)
def test_trainer_wiring(name: str, launcher: type) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
    s = trainer.strategy
    assert isinstance(s, DynPipeStrategy)
    assert s.parallel_devices == [torch.device("cpu")] * 2
    assert s.num_processes == 2 and s.world_size == 2 and s.root_device == torch.device("cpu")
    assert isinstance(s.launcher, launcher)
    assert s.num_stages == 2 and s.topology.dp_size == 1
    assert s.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_constructor_refusals() -> None:
    with pytest.raises(ConfigurationError, match=r"schedule must be one of \['async', 'sync', 'gpipe'\]"):
        DynPipeStrategy(schedule="pipedream")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="num_microbatches must be a positive integer; got 0"):
        DynPipeStrategy(num_microbatches=0)
    with pytest.raises(PartitionError, match="Every stage must own at least one layer"):
        DynPipeStrategy(balance=[3, 0])
    with pytest.raises(PartitionError, match="balance has 2 entries but num_stages=3"):
        DynPipeStrategy(balance=[3, 2], num_stages=3)


def test_timeout_accepts_seconds() -> None:
    assert DynPipeStrategy(timeout=12).config.timeout == timedelta(seconds=12)


def test_adaptation_needs_the_monitor() -> None:
    with pytest.raises(ConfigurationError, match="Runtime adaptation needs the stage monitor"):
        DynPipeStrategy(monitor_every_n_steps=None)
    assert DynPipeStrategy(monitor_every_n_steps=None, adaptive=False).monitor_every_n_steps is None
    with pytest.raises(ConfigurationError, match="num_stages='auto' lets the planner choose"):
        DynPipeStrategy(num_stages="auto", balance=[2, 3])


def test_the_hooks_before_each_update_run_only_when_something_observes_them() -> None:
    """``async`` updates M times per step; Lightning's on_before_optimizer_step/clipping dispatch is skipped only when
    no callback, module hook, clipping setting or precision plugin would see it (the counts themselves are checked
    by the multi-process ``_PipelineInvariants`` in test_numerics.py)."""
    from lightning.pytorch.plugins.precision import Precision

    from lightning_dynpipe.strategy.dynpipe import _update_hooks_observed

    class Plain(L.LightningModule):
        pass

    class Watching(L.LightningModule):
        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            pass

    class Clipping(L.LightningModule):
        def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, **kwargs: object) -> None:
            pass

    class Counting(L.Callback):
        def on_before_optimizer_step(self, *args: object) -> None:
            pass

    class OwnPrecision(Precision):
        def _after_closure(self, model: L.LightningModule, optimizer: object) -> None:  # type: ignore[override]
            pass

    def observed(module: L.LightningModule, precision: Precision | None = None, **trainer_kw: object) -> bool:
        module.trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, **trainer_kw)  # type: ignore[arg-type]
        return _update_hooks_observed(module, precision or Precision())

    assert not observed(Plain())
    assert observed(Watching())
    assert observed(Clipping())
    assert observed(Plain(), callbacks=[Counting()])
    assert observed(Plain(), gradient_clip_val=1.0)
    assert observed(Plain(), precision=OwnPrecision())
