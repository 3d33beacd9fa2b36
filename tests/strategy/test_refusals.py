"""Every refusal: a bad configuration fails before any process group exists, with a message that states the
rule, the value and the fix. Single-process (devices=1, popen: nothing is launched) unless a rule needs two."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import ManualOptimBoringModel
from lightning.pytorch.plugins.precision import MixedPrecision
from pipeline_models import TinyNet, loader, trainer_kwargs
from torch import nn

from lightning_dynpipe import ConfigurationError, DynPipeStrategy, PartitionError


def _fit(model: L.LightningModule, strategy: DynPipeStrategy | None = None, **kw: Any) -> None:
    trainer = L.Trainer(devices=1, max_steps=2, strategy=strategy or DynPipeStrategy(), **trainer_kwargs(**kw))
    trainer.fit(model, loader())


def _refused(model: L.LightningModule, match: str, strategy: DynPipeStrategy | None = None, **kw: Any) -> None:
    with pytest.raises((ConfigurationError, PartitionError), match=match):
        _fit(model, strategy, **kw)
    assert not dist.is_initialized(), "the refusal must come before the process group is created"


class ManualPipe(ManualOptimBoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.pipeline = nn.Sequential(self.layer)


class NoPipeline(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.layers = self.pipeline
        del self.pipeline


class ListPipeline(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.pipeline = nn.ModuleList(list(self.pipeline))  # type: ignore[assignment]


class ParamOutside(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(2, 2)


class IterStep(TinyNet):
    def training_step(self, dataloader_iter: Any) -> torch.Tensor:  # type: ignore[override]
        x, y = next(dataloader_iter)[0]
        return torch.nn.functional.cross_entropy(self.pipeline(x), y)


class NoneStep(TinyNet):
    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        self.pipeline(batch[0])
        return None


class OneLayer(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.pipeline = nn.Sequential(nn.Linear(8, 3))


class OwnBackward(TinyNet):
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward()


def test_manual_optimization() -> None:
    _refused(ManualPipe(), r"manual optimization \(automatic_optimization=False\) is not supported")


def test_accumulate_grad_batches() -> None:
    _refused(TinyNet(), r"accumulate_grad_batches=2 is not supported.*num_microbatches", accumulate_grad_batches=2)


class AccumulateFromTheSecondEpoch(L.Callback):
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 1:
            trainer.accumulate_grad_batches = 2


def test_accumulation_switched_on_during_fit() -> None:
    """Lightning would skip optimizer steps the pipeline does not skip: measured on 2 stages under sync with a
    GradientAccumulationScheduler({1: 2}), the weights ended 0.08 from one device's. That callback is refused at
    set-up (``test_config_and_contract.py``); any other change is refused at the next training step."""
    trainer = L.Trainer(
        devices=1, max_epochs=2, strategy=DynPipeStrategy(), callbacks=[AccumulateFromTheSecondEpoch()],
        **trainer_kwargs(),
    )  # fmt: skip
    try:
        with pytest.raises(ConfigurationError, match=r"accumulate_grad_batches=2 .* \(it changed during fit"):
            trainer.fit(TinyNet(), loader())
        assert trainer.current_epoch == 1 and trainer.global_step == 8  # the first epoch ran
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_grad_scaler_precision() -> None:
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    _refused(TinyNet(), r"precision='16-mixed' uses a GradScaler.*bf16-mixed", plugins=[plugin])


def test_sync_batchnorm() -> None:
    _refused(TinyNet(), r"sync_batchnorm=True is not supported.*sync_batchnorm=False", sync_batchnorm=True)


def test_compiled_model() -> None:
    _refused(torch.compile(TinyNet()), r"torch.compile'd model cannot be partitioned")  # type: ignore[arg-type]


def test_missing_pipeline_attribute() -> None:
    _refused(NoPipeline(), r"needs the model's layers in `NoPipeline.pipeline`.*pipeline_attr")


def test_pipeline_must_be_sequential() -> None:
    _refused(ListPipeline(), r"`pipeline` must be an nn.Sequential.*got ModuleList")


def test_parameters_outside_the_pipeline() -> None:
    _refused(ParamOutside(), r"All trainable parameters must live in `pipeline`.*'extra.weight'")


def test_balance_must_sum_to_layer_count() -> None:
    _refused(
        TinyNet(),
        r"balance must sum to the number of layers.*= 4, but the pipeline has 5",
        DynPipeStrategy(balance=[4]),
    )


def test_balance_without_zero_entries() -> None:
    with pytest.raises(PartitionError, match=r"Every stage must own at least one layer; got balance=\[5, 0\]"):
        DynPipeStrategy(balance=[5, 0])


def test_num_microbatches_positive() -> None:
    with pytest.raises(ConfigurationError, match="num_microbatches must be a positive integer; got 0"):
        DynPipeStrategy(num_microbatches=0)


def test_batch_smaller_than_num_microbatches() -> None:
    # refused at fit start from the dataloader, before any step (the executor would refuse the first batch)
    with pytest.raises(ConfigurationError, match=r"batch_size=12 is smaller than num_microbatches=16"):
        _fit(TinyNet(), DynPipeStrategy(num_microbatches=16))


def test_world_size_divisible_by_num_stages() -> None:
    with pytest.raises(ConfigurationError, match=r"\(3 = devices x num_nodes\) must be divisible by num_stages=2"):
        L.Trainer(accelerator="cpu", devices=3, strategy=DynPipeStrategy(num_stages=2))


def test_dataloader_iter_training_step() -> None:
    _refused(IterStep(), r"training_step\(dataloader_iter\) is not supported")


def test_training_step_returning_none() -> None:
    with pytest.raises(ConfigurationError, match=r"training_step must return the loss .* got NoneType"):
        _fit(NoneStep())


def test_overridden_backward_warns() -> None:
    with pytest.warns(UserWarning, match="OwnBackward.backward is overridden but DynPipeStrategy does not call it"):
        _fit(OwnBackward())


@pytest.mark.multiprocess
def test_more_stages_than_layers_refused_on_every_rank() -> None:
    """Two processes: both raise the refusal (spawn re-raises the first), none hangs."""
    with pytest.raises(Exception, match=r"Cannot run 2 stages on a pipeline of 1 layers"):
        L.Trainer(devices=2, max_steps=1, strategy=DynPipeStrategy(start_method="fork"), **trainer_kwargs()).fit(
            OneLayer(), loader()
        )


class _OutsideOnMeta(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(2))  # outside the pipeline: on meta it cannot start exactly


def test_a_refused_model_built_on_meta_shows_the_refusal_not_a_teardown_error() -> None:
    """Lightning's teardown moves the module to the CPU, which raises for meta tensors; the refusal must surface."""
    trainer = L.Trainer(
        devices=1, max_steps=2, strategy=DynPipeStrategy(balance=[5], adaptive=False), **trainer_kwargs()
    )
    with trainer.init_module(empty_init=True):
        model = _OutsideOnMeta()
    with pytest.raises(ConfigurationError, match=r"\['scale'\] outside `pipeline` are on the meta device"):
        trainer.fit(model, loader())
    assert model.scale.is_meta and model.pipeline[0].weight.is_meta


class TwoOptimizers(TinyNet):
    def configure_optimizers(self) -> list[torch.optim.Optimizer]:  # type: ignore[override]
        params = list(self.pipeline.parameters())
        return [torch.optim.SGD(params[:2], lr=0.1), torch.optim.SGD(params[2:], lr=0.1)]


def test_more_than_one_optimizer() -> None:
    """Lightning refuses several optimizers under automatic optimization itself, while it configures them (the
    process group exists by then); manual optimization is refused before. The strategy's own check stays for the
    optimizers Lightning hands it, with its message."""
    from lightning_dynpipe.strategy.contract import check_optimizers

    try:
        with pytest.raises(RuntimeError, match="multiple optimizers is only supported with manual optimization"):
            _fit(TwoOptimizers())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    optimizers = TwoOptimizers().configure_optimizers()
    with pytest.raises(
        ConfigurationError, match="configure_optimizers returned 2 optimizers; DynPipeStrategy supports one"
    ):
        check_optimizers(optimizers)
    check_optimizers(optimizers[:1])
    params = list(TinyNet().parameters())
    with pytest.raises(ConfigurationError, match=r"LBFGS.step needs a closure that re-evaluates the loss.*Adam"):
        check_optimizers([torch.optim.LBFGS(params)])
    check_optimizers([torch.optim.AdamW(params)])


class NormNet(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.pipeline = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def test_batchnorm_under_sync_with_micro_batches() -> None:
    """Refused before any process group exists; accepted on request (then the fit runs)."""
    _refused(
        NormNet(), r"schedule='sync' with num_microbatches=4 .* BatchNorm layers \(\['1'\]\)",
        DynPipeStrategy(schedule="sync", balance=[4], adaptive=False),
    )  # fmt: skip
    _fit(NormNet(), DynPipeStrategy(schedule="sync", balance=[4], adaptive=False, microbatch_statistics=True))


@pytest.mark.parametrize("callback", ["ema", "pruning"])
def test_weight_rewriting_callbacks_on_one_stage_equal_plain_lightning(callback: str) -> None:
    """Refused on a split model (``test_config_and_contract.py``); with one stage each process holds the whole model
    and the callback rewrites it as without DynPipe (EMA of the weights; global L1 pruning every epoch)."""
    import copy

    from lightning.pytorch.callbacks import EMAWeightAveraging, ModelPruning

    def make() -> L.Callback:
        if callback == "ema":
            return EMAWeightAveraging(decay=0.5)
        return ModelPruning("l1_unstructured", amount=0.3, use_global_unstructured=True, verbose=0)

    model = TinyNet()
    plain = copy.deepcopy(model)
    L.Trainer(devices=1, max_epochs=2, callbacks=[make()], **trainer_kwargs()).fit(plain, loader())
    strategy = DynPipeStrategy(num_microbatches=1, balance=[5], adaptive=False)
    L.Trainer(devices=1, max_epochs=2, strategy=strategy, callbacks=[make()], **trainer_kwargs()).fit(model, loader())
    for k, v in plain.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    if callback == "pruning":
        assert int((model.pipeline[2].weight == 0).sum()) > 0  # it pruned
