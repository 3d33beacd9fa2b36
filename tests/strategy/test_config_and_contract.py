"""The strategy's configuration and the model contract, without a Trainer or processes."""

from __future__ import annotations

import doctest
from datetime import timedelta

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from pipeline_models import TinyGPT
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dynpipe.strategy.config
from lightning_dynpipe import DynPipeStrategy
from lightning_dynpipe.engine.ties import shared_parameters
from lightning_dynpipe.errors import ConfigurationError, PartitionError
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.repartition import GainOverCostPolicy
from lightning_dynpipe.schedule import SYNC, get_schedule
from lightning_dynpipe.strategy.config import DEFAULT_TIMEOUT, DynPipeConfig
from lightning_dynpipe.strategy.contract import (
    check_batches,
    check_callbacks,
    check_model,
    check_setup,
    check_ties,
    find_pipeline,
)
from lightning_dynpipe.strategy.decision import first_stage_input


def test_docstring_examples() -> None:
    assert doctest.testmod(lightning_dynpipe.strategy.config).failed == 0


def test_defaults() -> None:
    cfg = DynPipeConfig.from_arguments()
    assert (cfg.num_stages, cfg.stages_auto, cfg.balance_mode, cfg.balance) == (None, False, "auto", None)
    assert cfg.schedule.name == "async" and isinstance(cfg.policy, GainOverCostPolicy)
    assert cfg.timeout == DEFAULT_TIMEOUT and cfg.monitor_every_n_steps == 10
    assert cfg.checkpoint == "full" and cfg.gather_after_fit is True
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
        ({"checkpoint": "dcp"}, ConfigurationError, r"checkpoint must be one of \['full', 'sharded'\]; got 'dcp'"),
        ({"gather_after_fit": 0}, ConfigurationError, "gather_after_fit must be True or False"),
        ({"microbatch_statistics": "yes"}, ConfigurationError, "microbatch_statistics must be True or False"),
        (
            {"gather_after_fit": False, "start_method": "spawn"},
            ConfigurationError,
            "copies rank 0's weights back into the main process",
        ),
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


def test_activation_checkpointing_selection() -> None:
    assert DynPipeConfig.from_arguments(activation_checkpointing=True).checkpoint_layers(3) == {0, 1, 2}
    assert DynPipeConfig.from_arguments().checkpoint_layers(3) == frozenset()
    some = DynPipeConfig.from_arguments(activation_checkpointing=[2, 0, 2])
    assert some.activation_checkpointing == (0, 2) and some.checkpoint_layers(3) == {0, 2}
    with pytest.raises(ConfigurationError, match=r"names layers \[5\], but the pipeline has 3 layers"):
        some.from_arguments(activation_checkpointing=[5]).checkpoint_layers(3)
    with pytest.raises(ConfigurationError, match="activation_checkpointing must be True, False or a list"):
        DynPipeConfig.from_arguments(activation_checkpointing=["0"])  # type: ignore[list-item]


def test_checkpointing_a_layer_with_batchnorm_statistics_is_refused() -> None:
    m = Model()
    m.body.layers = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with pytest.raises(ConfigurationError, match="Layer 1 of `body.layers` contains BatchNorm"):
        _check(m, checkpoint_layers=frozenset({1}))
    _check(m, checkpoint_layers=frozenset({0}))


@pytest.mark.parametrize(
    "norm", [nn.BatchNorm1d(2), nn.BatchNorm1d(2, track_running_stats=False)], ids=["stats", "no-stats"]
)
def test_batchnorm_under_a_flush_schedule_with_micro_batches_is_refused_unless_accepted(norm: nn.Module) -> None:
    from lightning_dynpipe.schedule import get_schedule
    from lightning_dynpipe.strategy.contract import check_batch_statistics

    pipeline = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), norm))

    def check(schedule: str, M: int, accepted: bool = False) -> None:
        check_batch_statistics(
            pipeline, schedule=get_schedule(schedule), num_microbatches=M, accepted=accepted, pipeline_attr="net"
        )

    for schedule in ("sync", "gpipe"):
        with pytest.raises(ConfigurationError) as err:
            check(schedule, 4)
        msg = str(err.value)
        assert f"schedule='{schedule}' with num_microbatches=4 trains on the whole batch" in msg
        assert "`net` holds BatchNorm layers (['1.1'])" in msg and "one micro-batch (1/4 of the batch)" in msg
        assert "LayerNorm, GroupNorm" in msg and "microbatch_statistics=True" in msg
        check(schedule, 4, accepted=True)
        check(schedule, 1)  # one micro-batch: the whole batch, exactly one device's update
    check("async", 4)  # each update is one micro-batch's: its statistics are that update's
    check("async+1", 4)
    check_batch_statistics(
        nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)), schedule=get_schedule("sync"), num_microbatches=4,
        accepted=False, pipeline_attr="net",
    )  # fmt: skip


def test_layers_with_extra_state_are_refused() -> None:
    class Extra(nn.Linear):
        def get_extra_state(self) -> object:
            return {"calls": 1}

    m = Model()
    m.body.layers[1] = Extra(2, 2)
    with pytest.raises(ConfigurationError, match=r"\['body.layers.1'\] define get_extra_state\(\)"):
        _check(m)


def _tied() -> nn.Sequential:
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    return nn.Sequential(emb, nn.Linear(4, 4), head)


def test_weight_averaging_and_pruning_callbacks_are_refused_on_a_split_model() -> None:
    """They rewrite the whole module's weights, which a stage does not hold (see ``check_callbacks``)."""
    from lightning.pytorch.callbacks import (
        EMAWeightAveraging,
        GradientAccumulationScheduler,
        ModelCheckpoint,
        ModelPruning,
        StochasticWeightAveraging,
    )

    class MyEMA(EMAWeightAveraging):
        pass

    for cb, name in [
        (StochasticWeightAveraging(swa_lrs=0.1), "StochasticWeightAveraging"),
        (EMAWeightAveraging(), "EMAWeightAveraging"),
        (MyEMA(), "MyEMA"),
    ]:
        with pytest.raises(ConfigurationError) as err:
            check_callbacks([ModelCheckpoint(), cb], num_stages=2)
        msg = str(err.value)
        assert f"{name} cannot average a model split into 2 stages" in msg and "num_stages=1" in msg
        check_callbacks([cb], num_stages=1)  # the whole model in every process: as under DDP
    check_callbacks([ModelCheckpoint()], num_stages=3)
    for stages in (1, 2):  # Lightning's accumulation would not hold the pipeline's updates back, one stage or more
        with pytest.raises(ConfigurationError, match=r"accumulate_grad_batches=2 is not supported.*Scheduler"):
            check_callbacks([GradientAccumulationScheduler({0: 1, 3: 2})], num_stages=stages)
    check_callbacks([GradientAccumulationScheduler({0: 1})], num_stages=2)
    pruning = ModelPruning("l1_unstructured", amount=0.3)
    with pytest.raises(ConfigurationError, match=r"ModelPruning cannot prune a model split into 3 stages.*after fit"):
        check_callbacks([pruning], num_stages=3)
    check_callbacks([pruning], num_stages=1)
    model = TinyGPT()
    trainer = dict(accumulate_grad_batches=1, gradient_clip_val=None, gradient_clip_algorithm=None,
                   precision_plugin=Precision(), sync_batchnorm=False, num_stages=2)  # fmt: skip
    config = DynPipeConfig.from_arguments(balance=[2, 3])
    with pytest.raises(ConfigurationError, match="EMAWeightAveraging cannot average"):
        check_setup(model, config=config, fitting=True, callbacks=[EMAWeightAveraging()], **trainer)  # type: ignore[arg-type]
    check_setup(model, config=config, fitting=False, callbacks=[EMAWeightAveraging()], **trainer)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("partition", "schedule", "clip", "match"),
    [
        (Partition((2, 1)), "async", None, r"cannot be trained exactly by schedule='async': pipeline.0.weight = "),
        (None, "async", None, "balance='auto' may split them"),
        (Partition((2, 1)), "sync", 1.0, "Gradient clipping by norm runs per stage with this precision plugin"),
    ],
)
def test_split_ties_are_refused_where_the_copies_could_drift(
    partition: Partition | None, schedule: str, clip: float | None, match: str
) -> None:
    ties = shared_parameters(_tied())
    with pytest.raises(ConfigurationError, match=match):
        check_ties(ties, partition, schedule=get_schedule(schedule), gradient_clip_val=clip,
                   gradient_clip_algorithm=None, pipeline_attr="pipeline")  # fmt: skip
    if clip is not None:  # clipped by the norm over every stage, one factor for both copies: accepted
        check_ties(ties, partition, schedule=get_schedule(schedule), gradient_clip_val=clip,
                   gradient_clip_algorithm=None, pipeline_attr="pipeline", pipeline_norm_clipping=True)  # fmt: skip


def test_set_up_refuses_a_tie_the_configured_balance_splits_under_async() -> None:
    """What the strategy checks before any process group, from its configuration: GPT-2 tying with the embedding
    and the head on different stages of ``balance=[2, 3]``."""
    model = TinyGPT(tie=True)
    trainer = dict(accumulate_grad_batches=1, gradient_clip_val=None, gradient_clip_algorithm=None,
                   precision_plugin=Precision(), sync_batchnorm=False, num_stages=2)  # fmt: skip
    split = DynPipeConfig.from_arguments(balance=[2, 3])
    with pytest.raises(ConfigurationError, match=r"cannot be trained exactly by schedule='async'"):
        check_setup(model, config=split, fitting=True, **trainer)  # type: ignore[arg-type]
    assert check_setup(model, config=split, fitting=False, **trainer) is model.pipeline  # type: ignore[arg-type]
    in_sync = DynPipeConfig.from_arguments(balance=[2, 3], schedule="sync")
    assert check_setup(model, config=in_sync, fitting=True, **trainer) is model.pipeline  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("partition", "schedule", "clip", "algorithm"),
    [
        (Partition((3,)), "async", 1.0, None),  # one stage holds both uses
        (Partition((2, 1)), "sync", None, None),  # the copies sum their gradients
        (Partition((2, 1)), "gpipe", 0.5, "value"),  # element-wise clipping keeps them equal
    ],
)
def test_ties_that_stay_exact_are_accepted(
    partition: Partition, schedule: str, clip: float | None, algorithm: str | None
) -> None:
    check_ties(shared_parameters(_tied()), partition, schedule=get_schedule(schedule), gradient_clip_val=clip,
               gradient_clip_algorithm=algorithm, pipeline_attr="pipeline")  # fmt: skip


def _loader(n: int, batch_size: int, drop_last: bool = False) -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(n, 2)), batch_size=batch_size, drop_last=drop_last)


def test_batches_are_checked_against_num_microbatches_before_training() -> None:
    with pytest.raises(ConfigurationError, match=r"batch_size=3 is smaller than num_microbatches=4"):
        check_batches(_loader(12, 3), num_microbatches=4, num_training_batches=4, max_steps=-1)
    with pytest.raises(ConfigurationError, match=r"last training batch of each epoch holds 2 samples \(18 samples"):
        check_batches(_loader(18, 8), num_microbatches=4, num_training_batches=3, max_steps=-1)
    check_batches(_loader(18, 8, drop_last=True), num_microbatches=4, num_training_batches=2, max_steps=-1)
    check_batches(_loader(18, 8), num_microbatches=4, num_training_batches=2, max_steps=-1)  # limit cuts it off
    check_batches(_loader(18, 8), num_microbatches=4, num_training_batches=3, max_steps=2)  # stops before it
    check_batches(_loader(20, 8), num_microbatches=4, num_training_batches=3, max_steps=-1)  # 4 left: enough


def test_a_batch_stage_0_cannot_read_names_the_hook() -> None:
    module = Model()
    assert first_stage_input(module, (torch.ones(1), 0)) is not None
    with pytest.raises(ConfigurationError, match=r"batch of type dict.*def pipeline_input\(self, batch\)"):
        first_stage_input(module, {"x": torch.ones(1)})
    module.pipeline_input = lambda batch: batch["x"]  # type: ignore[attr-defined]
    assert torch.equal(first_stage_input(module, {"x": torch.ones(1)}), torch.ones(1))


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


class _MetaNet(L.LightningModule):
    def __init__(self, outside: bool = False) -> None:
        super().__init__()
        self.pipeline = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        if outside:
            self.register_buffer("scale", torch.ones(2))


def _meta_model(strategy: DynPipeStrategy, outside: bool = False) -> _MetaNet:
    with strategy.tensor_init_context(empty_init=True):
        model = _MetaNet(outside)
    strategy.connect(model)
    return model


def test_a_model_built_on_meta_is_refused_where_its_start_cannot_be_exact() -> None:
    ok = DynPipeStrategy(balance=[1, 1], adaptive=False)
    model = _meta_model(ok)
    assert all(p.device.type == "meta" for p in model.parameters())
    ok._check_meta_start(model.pipeline)  # a list balance, no adaptation: accepted
    auto = DynPipeStrategy()  # balance="auto" and adaptation: profiled one materialised layer at a time
    auto._check_meta_start(_meta_model(auto).pipeline)
    with pytest.raises(ConfigurationError, match=r"\['scale'\] outside `pipeline` are on the meta device"):
        s = DynPipeStrategy(balance=[1, 1], adaptive=False)
        s._check_meta_start(_meta_model(s, outside=True).pipeline)
    plain = DynPipeStrategy(balance=[1, 1], adaptive=False)
    with torch.device("meta"):
        bare = _MetaNet()
    plain.connect(bare)
    with pytest.raises(ConfigurationError, match=r"was not built under trainer.init_module\(empty_init=True\)"):
        plain._check_meta_start(bare.pipeline)


def test_a_whole_checkpoint_read_after_partitioning_is_loaded_strictly() -> None:
    """checkpoint="sharded" restores after set-up; a whole (torch.save) checkpoint is then checked against the whole
    model's keys, as a strict load_state_dict would, before each stage takes its part."""
    from types import SimpleNamespace

    strategy = DynPipeStrategy(checkpoint="sharded", balance=[1, 1], adaptive=False)
    model = _MetaNet()
    strategy.connect(model)
    strategy._full_keys = list(model.state_dict())
    strategy.stage = SimpleNamespace(shard=SimpleNamespace(owned=[1]))  # type: ignore[assignment]
    whole = {k: torch.full_like(v, 7.0) for k, v in _MetaNet().state_dict().items()}
    strategy.load_model_state_dict({"state_dict": whole})
    assert torch.equal(model.pipeline[1].weight, torch.full((2, 2), 7.0))  # its own layer
    assert not torch.equal(model.pipeline[0].weight, torch.full((2, 2), 7.0))  # another stage's: left alone
    partial = {k: v for k, v in whole.items() if k != "pipeline.0.bias"}
    with pytest.raises(ConfigurationError, match=r"missing keys \['pipeline.0.bias'\]"):
        strategy.load_model_state_dict({"state_dict": partial})
    strategy.load_model_state_dict({"state_dict": partial}, strict=False)  # what the user asked for
    strategy.stage = None


def test_a_random_sampler_without_a_generator_is_refused_on_a_split_model() -> None:
    """Measured before: with balance='auto' the planner's profile on rank 0 consumed the global RNG, and
    ``DataLoader(shuffle=True)`` gave the two stages different orders from the first batch (stage 0 trained on the
    inputs of other samples than the last stage's targets). Lightning's own sampler and a seeded generator pass."""
    from torch.utils.data import DistributedSampler, SubsetRandomSampler, WeightedRandomSampler

    from lightning_dynpipe.strategy.contract import check_sample_order

    data = TensorDataset(torch.zeros(8, 2), torch.zeros(8))
    refused = [
        DataLoader(data, batch_size=4, shuffle=True),
        DataLoader(data, batch_size=4, sampler=SubsetRandomSampler(range(6))),
        DataLoader(data, batch_size=4, sampler=WeightedRandomSampler([1.0] * 8, 8)),
    ]
    for loader, name in zip(refused, ["RandomSampler", "SubsetRandomSampler", "WeightedRandomSampler"]):
        with pytest.raises(ConfigurationError) as err:
            check_sample_order(loader, num_stages=2)
        assert f"The training dataloader's {name} has no generator" in str(err.value)
        assert "the 2 stages would read different samples" in str(err.value) and "manual_seed" in str(err.value)
        check_sample_order(loader, num_stages=1)  # one stage reads inputs and targets alike
    accepted = [
        DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0)),
        DataLoader(data, batch_size=4),
        DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=True)),
    ]
    for loader in accepted:
        check_sample_order(loader, num_stages=2)
