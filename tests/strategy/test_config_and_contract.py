"""The strategy's configuration and the model contract, without a Trainer or processes."""

from __future__ import annotations

import doctest
from datetime import timedelta

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

import lightning_dynpipe.strategy.config
from lightning_dynpipe.errors import ConfigurationError, PartitionError
from lightning_dynpipe.repartition import GainOverCostPolicy
from lightning_dynpipe.schedule import SYNC
from lightning_dynpipe.strategy.config import DEFAULT_TIMEOUT, DynPipeConfig
from lightning_dynpipe.strategy.contract import check_model, find_pipeline


def test_docstring_examples() -> None:
    assert doctest.testmod(lightning_dynpipe.strategy.config).failed == 0


def test_defaults() -> None:
    cfg = DynPipeConfig.from_arguments()
    assert (cfg.num_stages, cfg.stages_auto, cfg.balance_mode, cfg.balance) == (None, False, "auto", None)
    assert cfg.schedule.name == "async" and isinstance(cfg.policy, GainOverCostPolicy)
    assert cfg.timeout == DEFAULT_TIMEOUT and cfg.monitor_every_n_steps == 10
    with pytest.raises(AttributeError):
        cfg.num_microbatches = 2  # type: ignore[misc]


def test_values_are_normalised() -> None:
    cfg = DynPipeConfig.from_arguments(schedule=SYNC, balance=[2, 1], timeout=5, adaptive=False)
    assert cfg.schedule is SYNC and cfg.balance == (2, 1) and cfg.num_stages == 2
    assert cfg.timeout == timedelta(seconds=5) and cfg.policy is None
    assert DynPipeConfig.from_arguments(num_stages="auto").stages_auto


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"schedule": "zb"}, ConfigurationError, "schedule must be one of"),
        ({"num_microbatches": 0}, ConfigurationError, "num_microbatches must be a positive integer"),
        ({"num_stages": 0}, ConfigurationError, "num_stages must be a positive integer"),
        ({"num_stages": "auto", "balance": [1, 1]}, ConfigurationError, "needs balance='auto'"),
        ({"balance": "even"}, ConfigurationError, "balance must be a list"),
        ({"balance": [2, 0]}, PartitionError, "Every stage must own at least one layer"),
        ({"balance": [2, 2], "num_stages": 3}, PartitionError, "balance has 2 entries but num_stages=3"),
        ({"monitor_every_n_steps": 0}, ConfigurationError, "monitor_every_n_steps must be >= 1"),
        ({"monitor_every_n_steps": None}, ConfigurationError, "Runtime adaptation needs the stage monitor"),
    ],
)
def test_refusals(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        DynPipeConfig.from_arguments(**kwargs)


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Module()
        self.body.layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        self.extra = nn.Linear(2, 2)
        self.extra.requires_grad_(False)


def _check(module: L.LightningModule, **overrides: object) -> nn.Sequential:
    kwargs: dict = dict(
        pipeline_attr="body.layers",
        fitting=True,
        accumulate_grad_batches=1,
        precision_plugin=Precision(),
        sync_batchnorm=False,
        balance=None,
        num_stages=2,
    )
    kwargs.update(overrides)
    return check_model(module, **kwargs)


def test_contract_accepts_a_dotted_pipeline_with_frozen_parameters_outside() -> None:
    m = Model()
    assert _check(m) is m.body.layers is find_pipeline(m, "body.layers")


@pytest.mark.parametrize(
    ("change", "overrides", "match"),
    [
        (lambda m: None, {"pipeline_attr": "layers"}, "`layers` does not exist"),
        (lambda m: setattr(m, "automatic_optimization", False), {}, "manual optimization"),
        (lambda m: None, {"accumulate_grad_batches": 2}, "accumulate_grad_batches=2 is not supported"),
        (lambda m: None, {"sync_batchnorm": True}, "sync_batchnorm=True is not supported"),
        (lambda m: m.extra.requires_grad_(True), {}, r"\['extra.weight', 'extra.bias'\] are outside it"),
        (lambda m: None, {"balance": (1, 2)}, "balance must sum to the number of layers"),
        (lambda m: None, {"num_stages": 3}, "Cannot run 3 stages on a pipeline of 2 layers"),
    ],
)
def test_contract_refusals(change: object, overrides: dict, match: str) -> None:
    m = Model()
    change(m)  # type: ignore[operator]
    with pytest.raises((ConfigurationError, PartitionError), match=match):
        _check(m, **overrides)


def test_evaluation_runs_skip_the_optimizer_rules() -> None:
    m = Model()
    m.automatic_optimization = False
    _check(m, fitting=False, accumulate_grad_batches=4)


def test_a_compiled_layer_is_refused() -> None:
    m = Model()
    m.body.layers[0] = torch.compile(m.body.layers[0])
    with pytest.raises(ConfigurationError, match="torch.compile'd model"):
        _check(m)


@pytest.mark.parametrize("M", [1, 4, 8])
def test_lr_scale_auto_is_one_over_m_for_async_and_one_for_accumulating_schedules(M: int) -> None:
    # The default measured by benchmarks/async_lr.py: 1/M for every optimizer under async.
    assert DynPipeConfig.from_arguments(num_microbatches=M).lr_scale == 1.0 / M
    for schedule in ("sync", "gpipe"):
        assert DynPipeConfig.from_arguments(num_microbatches=M, schedule=schedule).lr_scale == 1.0
    for schedule in ("async", "sync", "gpipe"):  # a number means itself under every schedule
        cfg = DynPipeConfig.from_arguments(num_microbatches=M, schedule=schedule, lr_scale=0.3)
        assert (cfg.lr_scale, cfg.lr_scale_requested) == (0.3, 0.3)


@pytest.mark.parametrize("bad", [0, -1.0, "half", True, float("nan"), float("inf")])
def test_lr_scale_refusals(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="lr_scale must be 'auto' or a positive number"):
        DynPipeConfig.from_arguments(lr_scale=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, "each update's learning rate is scaled by 1/4, so that a batch moves the weights about as far"),
        ({"lr_scale": 0.25}, "scaled by 1/4, so that a batch moves the weights about as far as one single-device"),
        ({"lr_scale": 1.0}, "learning rates as configured, so a batch moves the weights about 4 times as far"),
        ({"lr_scale": 0.5}, "each update's learning rate is multiplied by 0.5 (lr_scale=0.5)"),
        ({"num_microbatches": 1}, "one micro-batch per batch, so one update per batch as on one device"),
        ({"schedule": "sync"}, "one optimizer update per batch from the gradients of its 4 micro-batches"),
        ({"schedule": "gpipe", "lr_scale": 0.5}, "as on one device; learning rates times 0.5 (lr_scale=0.5)"),
    ],
)
def test_describe_updates_says_what_the_schedule_does_to_the_updates(kwargs: dict, expected: str) -> None:
    line = DynPipeConfig.from_arguments(**kwargs).describe_updates()
    assert expected in line, line
    assert "\n" not in line
    if kwargs.get("schedule", "async") == "async":
        assert "stage k of S computes its gradients on weights S-1-k updates old" in line
