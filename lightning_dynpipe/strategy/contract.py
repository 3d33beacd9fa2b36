"""The model contract: what a LightningModule must satisfy to be split into pipeline stages.

:func:`check_model` runs every refusal before any process group exists (so a bad set-up fails fast and on
every rank, with the rule, the values and the fix); :func:`find_pipeline` resolves the ``nn.Sequential``.
Both take plain arguments and are testable without a Trainer.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import (
    GradientAccumulationScheduler,
    ModelPruning,
    StochasticWeightAveraging,
    WeightAveraging,
)
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, RandomSampler, SubsetRandomSampler, WeightedRandomSampler

from lightning_dynpipe.engine.ties import SharedParameter, shared_parameters, split_ties
from lightning_dynpipe.errors import ConfigurationError, PartitionError
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.schedule import Schedule
from lightning_dynpipe.strategy.clipping import PipelineNormClipping
from lightning_dynpipe.strategy.config import DynPipeConfig

__all__ = [
    "find_pipeline",
    "check_model",
    "check_batch_statistics",
    "check_accumulation",
    "check_callbacks",
    "check_setup",
    "check_batches",
    "check_sample_order",
    "check_ties",
    "check_optimizers",
    "check_replica_split",
    "loss_terms_hook",
    "check_loss_terms",
]


def find_pipeline(module: LightningModule, pipeline_attr: str) -> nn.Sequential:
    """The module's ``nn.Sequential`` at ``pipeline_attr`` (dotted paths allowed).

    Raises:
        ConfigurationError: the attribute is missing or not an ``nn.Sequential``.
    """
    obj: Any = module
    for part in pipeline_attr.split("."):
        if not hasattr(obj, part):
            raise ConfigurationError(
                f"DynPipeStrategy needs the model's layers in `{type(module).__name__}.{pipeline_attr}`, an "
                f"nn.Sequential, but `{part}` does not exist. Put your layers in `self.{pipeline_attr} = "
                "nn.Sequential(...)` or pass DynPipeStrategy(pipeline_attr=...) naming where they are."
            )
        obj = getattr(obj, part)
    if not isinstance(obj, nn.Sequential):
        raise ConfigurationError(
            f"`{pipeline_attr}` must be an nn.Sequential whose elements are the pipeline's layers; got "
            f"{type(obj).__name__}. Wrap your layers: `self.{pipeline_attr} = nn.Sequential(...)`."
        )
    return obj


def check_model(
    module: LightningModule,
    *,
    pipeline_attr: str,
    fitting: bool,
    accumulate_grad_batches: int,
    precision_plugin: Precision,
    sync_batchnorm: bool,
    balance: tuple[int, ...] | None,
    num_stages: int | None,
    checkpoint_layers: frozenset[int] | None = None,
) -> nn.Sequential:
    """Refuses what the pipeline cannot run exactly; returns the pipeline.

    Args:
        module: the LightningModule.
        pipeline_attr: where its ``nn.Sequential`` lives.
        fitting: whether the run trains (optimizer-related refusals apply only then).
        accumulate_grad_batches: the Trainer's setting.
        precision_plugin: the Trainer's precision plugin.
        sync_batchnorm: whether the Trainer converts BatchNorm layers to SyncBatchNorm.
        balance: the given layers per stage, if any.
        num_stages: the number of stages that will run (``None`` when the planner chooses).
        checkpoint_layers: the layers whose activations will be recomputed in the backward.

    Raises:
        ConfigurationError: a set-up the strategy refuses (the message says why and what to do instead).
        PartitionError: a balance or stage count that does not fit the pipeline.
    """
    pipeline = find_pipeline(module, pipeline_attr)
    if fitting:
        if not module.automatic_optimization:
            raise ConfigurationError(
                "DynPipeStrategy runs the optimizer itself (one update per micro-batch on each stage), so "
                "manual optimization (automatic_optimization=False) is not supported. Remove "
                "`self.automatic_optimization = False` and return the loss from training_step."
            )
        check_accumulation(accumulate_grad_batches)
        if is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True):
            raise ConfigurationError(
                "training_step(dataloader_iter) is not supported by DynPipeStrategy: the pipeline splits each batch "
                "into micro-batches itself. Use training_step(self, batch, batch_idx)."
            )
    if isinstance(precision_plugin, MixedPrecision) and precision_plugin.scaler is not None:
        raise ConfigurationError(
            f"precision={precision_plugin.precision!r} uses a GradScaler, whose single scale cannot follow "
            "per-stage, per-micro-batch updates. Use precision='bf16-mixed' (no scaler), 'bf16-true' or "
            "'32-true' with DynPipeStrategy."
        )
    if type(precision_plugin).__name__ in ("TransformerEnginePrecision", "BitsandbytesPrecision"):
        raise ConfigurationError(
            f"{type(precision_plugin).__name__} is not supported by DynPipeStrategy; use precision="
            "'bf16-mixed', 'bf16-true' or '32-true'."
        )
    if sync_batchnorm:
        raise ConfigurationError(
            "sync_batchnorm=True is not supported by DynPipeStrategy: SyncBatchNorm all-reduces over WORLD "
            "from inside a layer, which only one stage runs. Set sync_batchnorm=False."
        )
    if getattr(module, "_compiler_ctx", None) is not None or any(
        isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in pipeline
    ):
        raise ConfigurationError(
            "A torch.compile'd model cannot be partitioned by DynPipeStrategy (the compiled graph spans all "
            "layers). Pass the uncompiled LightningModule; compile inside a layer if you need it."
        )
    if is_overridden("backward", module, LightningModule):
        rank_zero_warn(
            f"{type(module).__name__}.backward is overridden but DynPipeStrategy does not call it: the pipeline "
            "back-propagates each micro-batch itself (on_before_backward/on_after_backward still fire once per "
            "step)."
        )
    extra = [
        f"{pipeline_attr}.{name}"
        for name, m in pipeline.named_modules()
        if type(m).get_extra_state is not nn.Module.get_extra_state
    ]
    if extra:
        raise ConfigurationError(
            f"{extra[:3]} define get_extra_state(), whose value (any object) DynPipeStrategy cannot move between "
            "stages or gather into a checkpoint as tensors. Keep that state in buffers (register_buffer) instead."
        )
    pipeline_params = {id(p) for p in pipeline.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in pipeline_params]
    if outside:
        raise ConfigurationError(
            f"All trainable parameters must live in `{pipeline_attr}`, but {outside[:5]} "
            f"{'(and more) ' if len(outside) > 5 else ''}are outside it. Move those modules into the "
            "nn.Sequential or freeze them (requires_grad=False)."
        )
    for i in sorted(checkpoint_layers or ()):
        norms = [n for n, m in pipeline[i].named_modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
        if norms and fitting:
            raise ConfigurationError(
                f"Layer {i} of `{pipeline_attr}` contains BatchNorm with running statistics ({norms[:3]}), and "
                "activation checkpointing runs a layer's forward again in the backward, which would update those "
                f"statistics twice per micro-batch. Leave layer {i} out of activation_checkpointing."
            )
    if balance is not None:
        Partition.from_balance(balance, len(pipeline))
    if num_stages is not None and num_stages > len(pipeline):
        raise PartitionError(
            f"Cannot run {num_stages} stages on a pipeline of {len(pipeline)} layers: every stage needs at "
            f"least one layer. Use num_stages <= {len(pipeline)} (or fewer devices), or split the model into "
            "more layers."
        )
    return pipeline


def check_batches(
    loader: Any, *, num_microbatches: int, num_training_batches: float, max_steps: int, replicas: int = 1
) -> None:
    """Refuses, before the first step, a training dataloader whose batches cannot be split into micro-batches.

    Every micro-batch needs at least one sample, so a batch needs ``num_microbatches`` of them. Checked from the
    loader's ``batch_size``, its sampler's length (the samples of this pipeline replica) and ``drop_last``; the
    smaller last batch of an epoch only counts when the run reaches it. Loaders whose size is unknown (iterable
    datasets, custom batch samplers without ``batch_size``) are checked batch by batch as they come.

    ``replicas > 1``: the batch is a global batch split across that many replicas (``replica_split``), each of
    which needs ``num_microbatches`` samples.

    Raises:
        ConfigurationError: the batch size, or the last batch of an epoch, is smaller than ``num_microbatches``.
    """
    if not isinstance(loader, DataLoader):
        return
    M = num_microbatches
    sampler = loader.batch_sampler
    batch_size = loader.batch_size if loader.batch_size is not None else getattr(sampler, "batch_size", None)
    if not isinstance(batch_size, int):
        return
    if replicas > 1:
        _check_split_batches(loader, batch_size, M, replicas, num_training_batches, max_steps)
        return
    if batch_size < M:
        raise ConfigurationError(
            f"The training dataloader's batch_size={batch_size} is smaller than num_microbatches={M}: every "
            f"micro-batch needs at least one sample. Use batch_size >= {M} (a multiple of {M} splits evenly), or "
            f"DynPipeStrategy(num_microbatches={batch_size}) or fewer."
        )
    short = _short_last_batch(loader, batch_size, M, num_training_batches, max_steps)
    if short is None:
        return
    samples, last = short
    raise ConfigurationError(
        f"The last training batch of each epoch holds {last} samples ({samples} samples per pipeline replica, "
        f"batch_size={batch_size}), fewer than num_microbatches={M}, so it cannot be split into micro-batches. "
        f"Pass drop_last=True to the training DataLoader, or choose a batch size that leaves 0 or at least {M} "
        f"samples for the last batch, or use DynPipeStrategy(num_microbatches={last}) or fewer."
    )


def check_sample_order(loader: Any, *, num_stages: int) -> None:
    """Refuses, before the first step, a training dataloader whose order could differ between the stages.

    Stage 0 reads each batch's inputs and the last stage its targets, in their own processes, so every stage must
    draw the same samples in the same order. A random sampler without its own ``generator`` (``shuffle=True``,
    ``SubsetRandomSampler``, ``WeightedRandomSampler``) draws its order from the process's global torch RNG, which
    the stages consume differently (a dropout layer draws in its own stage's process only, for one): the inputs of
    one sample would then train against the targets of another, silently. Lightning's own sampler
    (``use_distributed_sampler=True``, the default) is seeded alike everywhere and passes.

    Raises:
        ConfigurationError: such a sampler with ``num_stages > 1``.
    """
    if num_stages < 2 or not isinstance(loader, DataLoader):
        return
    batch_sampler = loader.batch_sampler
    sampler = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else loader.sampler
    random = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
    if isinstance(sampler, random) and getattr(sampler, "generator", None) is None:
        raise ConfigurationError(
            f"The training dataloader's {type(sampler).__name__} has no generator, so it draws its order from each "
            f"process's own torch RNG, and the {num_stages} stages would read different samples: stage 0 the inputs "
            "of some, the last stage the targets of others. Give the DataLoader a seeded generator "
            "(DataLoader(..., shuffle=True, generator=torch.Generator().manual_seed(0))), or let Lightning replace "
            "the sampler (Trainer(use_distributed_sampler=True), the default)."
        )


def _short_last_batch(
    loader: DataLoader[Any], batch_size: int, need: int, num_training_batches: float, max_steps: int
) -> tuple[int, int] | None:
    """``(samples, last)`` when the epoch's last batch holds ``0 < last < need`` samples and the run reaches it;
    ``None`` when it is dropped, full enough, not reached (``max_steps`` or ``limit_train_batches`` stop the
    epoch before it), or the sampler has no length."""
    sampler = loader.batch_sampler
    drop_last = loader.drop_last if loader.batch_size is not None else getattr(sampler, "drop_last", False)
    try:
        samples = len(loader.sampler)  # type: ignore[arg-type]
    except TypeError:
        return None
    last = samples % batch_size
    if drop_last or last == 0 or last >= need:
        return None
    batches = math.ceil(samples / batch_size)
    if num_training_batches < batches or 0 <= max_steps < batches:
        return None  # the run stops (or limit_train_batches cuts the epoch) before the last batch
    return samples, last


def _check_split_batches(
    loader: DataLoader[Any], batch_size: int, M: int, replicas: int, num_training_batches: float, max_steps: int
) -> None:
    need = M * replicas
    fix = f"or lower num_microbatches (each of the {replicas} replicas takes at least num_microbatches={M} samples)"
    if batch_size < need:
        raise ConfigurationError(
            f"The training dataloader's batch_size={batch_size} is the global batch of {replicas} replicas under "
            f"replica_split, and each replica needs num_microbatches={M} samples: it needs at least {need}. Use "
            f"batch_size >= {need}, {fix}."
        )
    short = _short_last_batch(loader, batch_size, need, num_training_batches, max_steps)
    if short is None:
        return
    samples, last = short
    raise ConfigurationError(
        f"The last training batch of each epoch holds {last} samples ({samples} samples, batch_size={batch_size}), "
        f"fewer than the {need} that {replicas} replicas with num_microbatches={M} each need. Pass drop_last=True to "
        f"the training DataLoader, choose a batch size that leaves 0 or at least {need} samples for the last batch, "
        f"{fix}."
    )


def check_ties(
    ties: Sequence[SharedParameter],
    partition: Partition | None,
    *,
    schedule: Schedule,
    gradient_clip_val: float | None,
    gradient_clip_algorithm: str | None,
    pipeline_attr: str,
    pipeline_norm_clipping: bool = False,
) -> None:
    """Refuses parameters shared across stages where the copies could not stay one parameter.

    Under a schedule that accumulates a step's gradients the stages holding a copy sum their gradients before
    the one update, so the copies stay identical and equal plain tied training. Under ``"async"`` each stage
    updates after every micro-batch with its own staleness, and the two uses of the parameter would need
    different weight versions: refused. Clipping by norm scales every stage by one factor from the norm over the
    whole pipeline when ``pipeline_norm_clipping`` (:mod:`~lightning_dynpipe.strategy.clipping`, with Lightning's
    own precision plugins), which keeps the copies equal; otherwise it is per stage and the copies would be scaled
    differently: refused (clipping by value is element-wise and keeps them equal).

    ``partition=None`` (the planner will choose it) counts every shared parameter as split, so the refusal comes
    before any process group exists; a list ``balance`` that keeps the sharing layers together runs such a set-up.

    Raises:
        ConfigurationError: a shared parameter split across stages under ``"async"``, or with norm clipping.
    """
    split = list(ties) if partition is None else split_ties(ties, partition)
    if not split:
        return
    where = "balance='auto' may split them" if partition is None else f"partition {partition} splits them"
    names = "; ".join(
        f"{t.describe(pipeline_attr)} (layers {list(t.layers)}"
        + (f" on stages {list(t.stages(partition))})" if partition is not None else ")")
        for t in split[:3]
    )
    if not schedule.accumulates:
        raise ConfigurationError(
            f"Parameters shared by layers on different stages cannot be trained exactly by schedule={schedule.name!r}: "
            f"{names}; {where}. Each async stage updates after every micro-batch with its own staleness, so the two "
            "uses would read different versions of one parameter. Use schedule='sync' or 'gpipe' (the stages sum "
            "their gradients before each update, exactly like tied training on one device), or a list balance that "
            "puts those layers on one stage, or untie the weights."
        )
    if gradient_clip_val and (gradient_clip_algorithm or "norm") == "norm" and not pipeline_norm_clipping:
        raise ConfigurationError(
            f"Gradient clipping by norm runs per stage with this precision plugin (its own clip_grad_by_norm), so the "
            f"copies of a parameter shared across stages would be scaled by different factors and drift apart: "
            f"{names}; {where}. Use gradient_clip_algorithm='value', Lightning's own precision plugins (whose "
            "clipping takes the norm over every stage), a list balance that puts the sharing layers on one stage, or "
            "untie the weights."
        )


def check_setup(
    module: LightningModule,
    *,
    config: DynPipeConfig,
    fitting: bool,
    accumulate_grad_batches: int,
    gradient_clip_val: float | None,
    gradient_clip_algorithm: str | None,
    precision_plugin: Precision,
    sync_batchnorm: bool,
    num_stages: int,
    callbacks: Sequence[Callback] = (),
    num_replicas: int = 1,
) -> nn.Sequential:
    """Every refusal that needs the model and the Trainer but no process group (:func:`check_model` and, for a
    fit, :func:`check_batch_statistics`, :func:`check_callbacks`, :func:`check_loss_terms` and :func:`check_ties`
    with the partition the configuration fixes, if any); returns the pipeline. ``num_stages``: the configured
    count, or the process count when the planner will choose it; ``num_replicas``: the pipeline replicas."""
    pipeline = find_pipeline(module, config.pipeline_attr)
    stages = None if config.stages_auto else num_stages
    check_model(
        module,
        pipeline_attr=config.pipeline_attr,
        fitting=fitting,
        accumulate_grad_batches=accumulate_grad_batches,
        precision_plugin=precision_plugin,
        sync_batchnorm=sync_batchnorm,
        balance=config.balance,
        num_stages=stages,
        checkpoint_layers=config.checkpoint_layers(len(pipeline)),
    )
    if fitting:
        check_batch_statistics(
            pipeline,
            schedule=config.schedule,
            num_microbatches=config.num_microbatches,
            accepted=config.microbatch_statistics,
            pipeline_attr=config.pipeline_attr,
        )
        check_callbacks(callbacks, num_stages=num_stages)
        check_loss_terms(module, num_replicas=num_replicas)
    if fitting:  # evaluation makes no updates: the copies of a shared parameter stay as they are
        partition = (
            Partition((len(pipeline),)) if stages == 1 else (Partition(config.balance) if config.balance else None)
        )
        check_ties(
            shared_parameters(pipeline),
            partition,
            schedule=config.schedule,
            gradient_clip_val=gradient_clip_val,
            gradient_clip_algorithm=gradient_clip_algorithm,
            pipeline_attr=config.pipeline_attr,
            pipeline_norm_clipping=PipelineNormClipping.supports(precision_plugin),
        )
    return pipeline


def _batchnorm_layers(pipeline: nn.Sequential) -> list[str]:
    """The pipeline's BatchNorm modules, named ``"<layer>.<path>"`` (``"<layer>"`` for a layer that is one)."""
    return [
        f"{i}.{n}" if n else str(i)
        for i, layer in enumerate(pipeline)
        for n, m in layer.named_modules()
        if isinstance(m, _BatchNorm)
    ]


def loss_terms_hook(module: LightningModule) -> Callable[[Any], Any] | None:
    """The module's ``loss_terms(batch)`` hook, if it defines one: how many terms the training loss of a
    (micro-)batch averages, for example the targets a token-mean cross-entropy counts (those not ``ignore_index``).
    Under ``sync`` and ``gpipe`` each micro-batch's loss is then weighted by its share of the step's terms instead of
    its share of the samples (:class:`~lightning_dynpipe.engine.executor.StageExecutor`), so the update is the
    gradient of the whole batch's mean, as on one device.

    Only a method of the module's class counts: an attribute of the same name (a list of loss modules, say, which
    ``nn.Module`` makes callable) is not the hook."""
    if not inspect.isfunction(inspect.getattr_static(type(module), "loss_terms", None)):
        return None
    return cast(Callable[[Any], Any], module.loss_terms)


def check_loss_terms(module: LightningModule, *, num_replicas: int) -> None:
    """Refuses a ``loss_terms`` hook with several pipeline replicas.

    The replicas' gradients are averaged by their samples (or equally), and a stage that does not see the data
    cannot count a replica's terms, so the global batch's update would not be one device's.

    Raises:
        ConfigurationError: the module defines ``loss_terms`` and ``num_replicas > 1``.
    """
    if num_replicas > 1 and loss_terms_hook(module) is not None:
        raise ConfigurationError(
            f"{type(module).__name__}.loss_terms weights each micro-batch's loss by its share of the batch's terms, "
            f"but this fit runs {num_replicas} pipeline replicas, whose gradients are averaged by their samples: "
            "the update would not be one device's on the global batch. Run one pipeline (as many processes as "
            "stages), or remove loss_terms (each micro-batch's loss then weighs by its samples)."
        )


def check_batch_statistics(
    pipeline: nn.Sequential, *, schedule: Schedule, num_microbatches: int, accepted: bool, pipeline_attr: str
) -> None:
    """Refuses BatchNorm under a flush schedule with several micro-batches, unless the user accepted it.

    ``sync`` and ``gpipe`` promise plain training's update on the whole batch. A BatchNorm layer in training mode
    normalises by the statistics of the batch it sees, and under a pipeline that is one micro-batch (``B / M``
    samples), so the outputs, the gradients and the running statistics (updated once per micro-batch) differ from
    one device's. Under ``async`` each update is one micro-batch's by definition, and BatchNorm over that micro-batch
    is part of it: not refused.

    Raises:
        ConfigurationError: BatchNorm layers, a flush schedule, ``num_microbatches > 1`` and not ``accepted``.
    """
    if accepted or not schedule.accumulates or num_microbatches == 1:
        return
    norms = _batchnorm_layers(pipeline)
    if norms:
        raise ConfigurationError(
            f"schedule={schedule.name!r} with num_microbatches={num_microbatches} trains on the whole batch, but "
            f"`{pipeline_attr}` holds BatchNorm layers ({norms[:3]}), which in training normalise by the statistics "
            f"of what they see: one micro-batch (1/{num_microbatches} of the batch). The outputs, the gradients and "
            "the running statistics (updated once per micro-batch) would then differ from one device's. Use a "
            "per-sample normalisation (LayerNorm, GroupNorm), or num_microbatches=1 (no pipelining within a step), "
            "or DynPipeStrategy(microbatch_statistics=True) to train with each micro-batch's statistics, as "
            "GPipe-style pipelines do (also right when those layers stay in eval mode: frozen statistics)."
        )


def check_accumulation(accumulate_grad_batches: int, *, during_fit: bool = False) -> None:
    """Refuses Lightning's gradient accumulation: the pipeline updates inside each training step (once per
    micro-batch under ``async``, once per batch under ``sync``), so Lightning's skipped optimizer steps would not
    skip its updates, and the weights would differ silently from what accumulation means. Checked at set-up and,
    ``during_fit``, at every training step (a callback may change the setting between epochs).

    Raises:
        ConfigurationError: ``accumulate_grad_batches != 1``.
    """
    if accumulate_grad_batches != 1:
        changed = " (it changed during fit: a GradientAccumulationScheduler or another callback set it)"
        raise ConfigurationError(
            f"accumulate_grad_batches={accumulate_grad_batches} is not supported by DynPipeStrategy"
            f"{changed if during_fit else ''}: the pipeline already splits each batch and updates within the step, "
            "so Lightning's accumulation would not hold its updates back. Use DynPipeStrategy(num_microbatches=N) "
            "with schedule='sync' to accumulate gradients over N micro-batches, and accumulate_grad_batches=1 (no "
            "GradientAccumulationScheduler)."
        )


def check_callbacks(callbacks: Sequence[Callback], *, num_stages: int) -> None:
    """Refuses Lightning's callbacks that rewrite the whole model's weights when the model is split into stages.

    - Weight averaging (``StochasticWeightAveraging``, ``WeightAveraging`` and its ``EMAWeightAveraging``) copies
      the whole LightningModule at set-up, before the strategy leaves each process only its stage's layers, and
      then pairs the copy's parameters with the module's by position. On a stage after the first the pairs are
      different layers: a crash when the shapes differ, and when they match an averaged model whose layers hold
      other layers' averages, which is what its checkpoints and its validation use (four equal linear layers on
      two stages: checkpoints off by up to 0.48 from one device's).
    - ``ModelPruning`` prunes every module of the LightningModule it finds, which on a stage includes the other
      stages' layers (placeholders without storage): it fails on them, and a global threshold would be taken over
      one stage's weights only.

    With one stage (data parallel only) each process holds the whole model and they work as without DynPipe.
    ``GradientAccumulationScheduler`` with a factor other than 1 is refused with any number of stages
    (:func:`check_accumulation`).

    Raises:
        ConfigurationError: one of those callbacks with ``num_stages > 1``; an accumulation schedule.
    """
    for cb in callbacks:
        if isinstance(cb, GradientAccumulationScheduler):
            factors = sorted(set(cb.scheduling.values()) - {1})
            if factors:
                check_accumulation(factors[0])
    if num_stages == 1:
        return
    averaging = [type(cb).__name__ for cb in callbacks if isinstance(cb, (WeightAveraging, StochasticWeightAveraging))]
    if averaging:
        raise ConfigurationError(
            f"{', '.join(averaging)} cannot average a model split into {num_stages} stages: it copies the whole "
            "LightningModule at set-up and pairs the copy's parameters with the module's by position, while each "
            "stage's process holds only its own layers, so the averages would go to other layers or fail on their "
            "shapes. Remove the callback, or train with num_stages=1 (data parallel only), or average the weights "
            "after fit from the checkpoints (which hold the whole model)."
        )
    pruning = [type(cb).__name__ for cb in callbacks if isinstance(cb, ModelPruning)]
    if pruning:
        raise ConfigurationError(
            f"{', '.join(pruning)} cannot prune a model split into {num_stages} stages: it prunes every module of "
            "the LightningModule, while each stage's process holds only its own layers (the others are "
            "placeholders without storage), and a global threshold would be one stage's. Remove the callback and "
            "prune the trained model after fit, or train with num_stages=1 (data parallel only)."
        )


def check_optimizers(optimizers: Sequence[Any]) -> None:
    """One optimizer (with any number of parameter groups): each stage steps its share of it, from the gradients the
    pipeline computed, without a closure.

    Raises:
        ConfigurationError: several optimizers; an optimizer whose ``step`` needs a closure (``LBFGS``), which would
            re-run the forward and backward of the whole model inside the update.
    """
    if len(optimizers) > 1:
        raise ConfigurationError(
            f"configure_optimizers returned {len(optimizers)} optimizers; DynPipeStrategy supports one (with any "
            "number of parameter groups). Use parameter groups instead."
        )
    for opt in optimizers:
        closure = inspect.signature(opt.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise ConfigurationError(
                f"{type(opt).__name__}.step needs a closure that re-evaluates the loss, which a pipeline cannot give "
                "it: each stage updates its own layers from the gradients the pipeline computed once per "
                "micro-batch (or per batch under schedule='sync'), and re-running the whole model's forward and "
                "backward inside one stage's update is not possible. Use an optimizer that steps from gradients "
                "(SGD, Adam, AdamW, ...)."
            )


def check_replica_split(
    pipeline: nn.Sequential,
    mode: str,
    weights: Sequence[float] | None,
    num_replicas: int,
    pipeline_attr: str,
) -> None:
    """Refuses what a replica split cannot train exactly (every rank, at set-up, before the first step).

    An update under a replica split equals plain training's on the global batch only if each sample's
    gradient does not depend on which other samples share its replica's micro-batch. BatchNorm in training
    normalises with its micro-batch's statistics, so with shares that differ from the even run's (or from one
    another) the outputs, and the running statistics, differ: refused.
    """
    if mode == "fixed" and weights is not None and len(weights) != num_replicas:
        raise ConfigurationError(
            f"replica_split gives {len(weights)} weights ({list(weights)}) but the run has {num_replicas} pipeline "
            f"replica(s) (devices / num_stages). Give one weight per replica, e.g. {[1.0] * num_replicas}."
        )
    if num_replicas < 2:
        return
    norms = _batchnorm_layers(pipeline)
    if norms:
        raise ConfigurationError(
            f"replica_split={mode!r} splits each global batch into shares whose sizes differ from replica to replica "
            f"and change at run time, but `{pipeline_attr}` holds BatchNorm layers ({norms[:3]}): their batch "
            "statistics (and running statistics) depend on the share's size and content, so the update would no "
            "longer equal plain training's. Use a per-sample normalisation (LayerNorm, GroupNorm), or "
            "replica_split=None (each replica reads its own batches)."
        )
