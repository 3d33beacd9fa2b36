"""Lower precision profiles, plans and adapts: the profiling sample is cast like the model's inputs and runs
under the precision plugin's context (an fp32 sample used to meet bf16 weights, which switched adaptation off),
and the wire carries the activations' dtype."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from pipeline_models import TinyNet, loader, trainer_kwargs

from lightning_dynpipe import DynPipeStrategy


class ProfiledAndAdapting(L.Callback):
    """Fails the run in the worker unless the set-up profile exists and the adaptive loop is on."""

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        strategy: Any = trainer.strategy
        assert strategy.model_cost is not None, "the set-up profile failed"
        assert strategy.controller is not None, "adaptation was switched off"
        assert next(pl_module.parameters()).dtype == torch.bfloat16

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        assert torch.isfinite(outputs["loss"]), outputs


@pytest.mark.multiprocess
def test_bf16_true_two_stages_profile_plan_and_adapt() -> None:
    strategy = DynPipeStrategy(num_microbatches=4, start_method="fork")  # balance="auto": profile and plan
    trainer = L.Trainer(
        devices=2,
        max_steps=3,
        precision="bf16-true",
        strategy=strategy,
        **trainer_kwargs(callbacks=[ProfiledAndAdapting()]),
    )
    trainer.fit(TinyNet(), loader())


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-true", "bf16-true"])
def test_each_precision_profiles_on_one_stage(precision: str) -> None:
    trainer = L.Trainer(devices=1, max_steps=2, precision=precision, strategy=DynPipeStrategy(), **trainer_kwargs())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyNet(), loader())
    assert not [w for w in caught if "could not profile" in str(w.message)]
    assert trainer.strategy.model_cost is not None  # type: ignore[attr-defined]
