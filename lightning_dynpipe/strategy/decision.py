"""The set-up decision: which partition this run starts with, and the costs the adaptive loop re-plans from.

When fitting with ``balance="auto"`` or with adaptation on, global rank 0 profiles the layers on one
micro-batch of the first training batch, every rank joins a probe of the link between ranks 0 and 1, rank 0
plans (for ``"auto"``), and one broadcast gives every rank the same decision, per-layer costs and link model.
A failed profile or plan is not fatal: the run falls back to the given balance (or the parameter count) and
says why. The exception is a ``memory_cap`` that no partition fits: falling back could not honour it, so every
rank raises :class:`~lightning_dynpipe.errors.ConfigurationError` with the planner's reason.

With ``calibrate``, rank 0 then runs the calibration sweep (:mod:`lightning_dynpipe.sweep`) on the profiled
micro-batch, and the same broadcast carries its rows: every rank fits its predictor on the same rows, so every rank
prices candidate partitions alike. A failed sweep is not fatal either: the predictor learns from the run's own
windows only, and every rank says why.

A pipeline built on ``meta`` (``trainer.init_module(empty_init=True)``) is profiled on materialised copies of its
layers, one at a time (``layer_copies``), before any stage materialises its own layers: the profiling rank holds
one layer at a time, and the times and sizes are those of the real layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lightning_dynpipe.engine.microbatch import batch_len, split_microbatches
from lightning_dynpipe.errors import ConfigurationError, PartitionError
from lightning_dynpipe.plan.auto import best_plan
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.memory import format_bytes
from lightning_dynpipe.plan.partition import Partition, balance_by_weights
from lightning_dynpipe.plan.solver import Plan, evaluate
from lightning_dynpipe.predictor import LabelledSamples
from lightning_dynpipe.strategy.config import DynPipeConfig

__all__ = ["SetupDecision", "decide", "probe_link", "first_stage_input"]


@dataclass(frozen=True)
class SetupDecision:
    """What every rank starts the run with.

    Attributes:
        partition: the layers per stage.
        model_cost: the profiled per-layer costs (``None`` when nothing was profiled).
        comm: the measured link between stages (free when not probed).
        plan: the planner's full plan (global rank 0 only, with ``balance="auto"``).
        plan_table: the plan as a table (every rank), for logs.
        calibration: the set-up calibration sweep's summary, or why it did not run (``None``: none asked for).
        calibration_s: the sweep's wall time, the worker's start included (``None``: it did not run).
    """

    partition: Partition
    model_cost: ModelCost | None = None
    comm: CommModel = CommModel()
    plan: Plan | None = None
    plan_table: str | None = None
    calibration: str | None = None
    calibration_s: float | None = None


def first_stage_input(module: Any, batch: Any) -> Any:
    """Stage 0's input for ``batch``: the module's ``pipeline_input(batch)``, else ``batch[0]`` of a tuple or
    list, else a tensor batch itself.

    Raises:
        ConfigurationError: a batch of another kind (a dict, a custom object) and no ``pipeline_input`` hook.
    """
    user_input = getattr(module, "pipeline_input", None)
    if callable(user_input):
        return user_input(batch)
    if isinstance(batch, (tuple, list)):
        return batch[0]
    if isinstance(batch, torch.Tensor):
        return batch
    raise ConfigurationError(
        f"Stage 0 does not know what to feed the pipeline from a batch of type {type(batch).__name__}: without a "
        f"pipeline_input hook it takes batch[0] of a tuple or list, or a tensor batch itself. Define "
        f"`def pipeline_input(self, batch): return batch[...]` on {type(module).__name__}, returning what layer 0 "
        "of the pipeline takes (the batch itself if layer 0 takes the whole dict)."
    )


def probe_link(global_rank: int, world_size: int, timeout: timedelta) -> CommModel:
    """Latency and bandwidth between global ranks 0 and 1 (collective: every rank joins the group)."""
    if world_size == 1:
        return CommModel()
    from lightning_dynpipe.engine.probe import probe_p2p

    group = dist.new_group([0, 1], timeout=timeout)
    try:
        if global_rank in (0, 1):
            # device=None: the probe picks what the backend can send (CPU tensors for gloo)
            return probe_p2p(group, 1 - global_rank, initiator=global_rank == 0)
        return CommModel()
    finally:
        if global_rank in (0, 1):
            dist.destroy_process_group(group)


def _rng_devices(device: torch.device) -> list[int]:
    """The CUDA devices whose random state :func:`torch.random.fork_rng` must keep besides the CPU's."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def _profile(
    pipeline: nn.Sequential,
    sample: Any,
    device: torch.device,
    optimizer: Optimizer | None,
    layer_copies: Iterable[nn.Module] | None,
) -> ModelCost:
    from lightning_dynpipe.profiling import optimizer_state_factor, profile_layers

    factor = optimizer_state_factor(optimizer) if optimizer is not None else 0.0
    profile = profile_layers(
        pipeline,
        sample,
        device=device,
        optimizer_state_bytes_per_param_byte=factor,
        layer_copies=layer_copies,
        optimizer=optimizer,
    )
    return profile.to_model_cost()


def recomputed(cost: ModelCost, layers: Iterable[int]) -> ModelCost:
    """``cost`` with ``layers`` under activation checkpointing: a micro-batch in flight keeps only their outputs,
    and their saved tensors come back once, for the backward's recompute (workspace).

    Example::

        >>> cost = ModelCost.from_arrays([1.0], [2.0], activation_bytes=10, held_bytes=50, workspace_bytes=5)
        >>> layer = recomputed(cost, [0]).layers[0]
        >>> layer.kept_bytes, layer.workspace_bytes
        (10, 50)
    """
    chosen = set(layers)
    if not chosen:
        return cost
    return ModelCost(
        tuple(
            replace(c, held_bytes=c.activation_bytes, workspace_bytes=max(c.workspace_bytes, c.kept_bytes))
            if i in chosen
            else c
            for i, c in enumerate(cost.layers)
        )
    )


def _one_microbatch(x: Any, num_microbatches: int) -> Any:
    n = batch_len(x)
    micro, _ = split_microbatches(x, min(num_microbatches, n if n is not None and n > 0 else 1))
    return micro[0]


def decide(
    config: DynPipeConfig,
    *,
    pipeline: nn.Sequential,
    fitting: bool,
    global_rank: int,
    world_size: int,
    num_stages: int,
    first_batch: Callable[[], Any],
    module: Any,
    optimizer: Optimizer | Callable[[], Optimizer | None] | None,
    device: torch.device,
    forward_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    layer_copies: Callable[[torch.device], Iterable[nn.Module]] | None = None,
) -> SetupDecision:
    """The partition this run starts with (collective when it profiles: every rank must call it).

    Args:
        config: the strategy's configuration.
        pipeline: the user's whole ``nn.Sequential`` (not partitioned yet).
        fitting: whether the run trains (only training runs profile and plan).
        global_rank: this rank.
        world_size: all processes.
        num_stages: the stages to plan for (ignored with ``num_stages="auto"``).
        first_batch: returns the first training batch on ``device`` (called on rank 0 only).
        module: the LightningModule (for its ``pipeline_input`` hook).
        optimizer: the optimizer built on the whole model (its state size enters the memory model), or a
            function that builds one (called on rank 0 only, when it profiles: a model on ``meta`` has its
            optimizer built after materialisation, so the profile reads the state size off one built on ``meta``).
        device: where the profile runs.
        forward_context: the precision plugin's forward context (autocast for mixed precision), so the layers
            are profiled as they will run. ``first_batch`` must already be cast like the model's inputs.
        layer_copies: for a pipeline on ``meta``, returns materialised copies of its layers on the given device,
            one at a time (:func:`~lightning_dynpipe.engine.materialize.materialized_copies`); called on rank 0
            only, when it profiles.
    """
    if fitting and (config.balance_mode == "auto" or config.policy is not None):
        comm = probe_link(global_rank, world_size, config.timeout)
        decision: list[Any] = [None]
        plan: Plan | None = None
        if global_rank == 0:
            # The user's random streams stay as they were: taking the first batch starts a DataLoader iterator, which
            # draws its seed (and a shuffling sampler's) from torch's global generator, and a run that profiles would
            # otherwise train with other dropout masks and another data order than the same run with a balance given
            with torch.random.fork_rng(devices=_rng_devices(device)):
                decision[0], plan = _profile_and_plan(
                    config,
                    pipeline=pipeline,
                    world_size=world_size,
                    num_stages=num_stages,
                    sample=lambda: _one_microbatch(first_stage_input(module, first_batch()), config.num_microbatches),
                    optimizer=optimizer,
                    device=device,
                    forward_context=forward_context,
                    layer_copies=layer_copies,
                    comm=comm,
                )
        if world_size > 1:
            dist.broadcast_object_list(decision, src=0)
        balance, table, arrays, link, error, sweep, fatal = decision[0]
        if fatal:
            raise ConfigurationError(
                f"DynPipe found no partition of the model that fits memory_cap={config.memory_cap:.0f} bytes "
                f"({format_bytes(config.memory_cap or 0)}) per process ({error}). Raise memory_cap, use more "
                "processes, or drop it."
            )
        calibration = calibration_s = None
        if sweep is not None:
            rows, calibration, calibration_s = sweep
            _fit_predictor(config, rows, calibration)
        cost_all = ModelCost.from_arrays(**arrays) if arrays is not None else None
        comm_all = (
            CommModel(latency_s=link[0], bandwidth_Bps=link[1], cpu_s_per_byte=link[2])
            if link is not None
            else CommModel()
        )
        if error is not None:
            rank_zero_warn(
                f"DynPipe could not profile/plan this run ({error}); "
                f"{'balancing by parameter count' if balance is None else 'using the given balance'}"
                f"{' and not adapting' if config.policy is not None else ''}."
            )
        if table is not None:
            rank_zero_info(f"DynPipe plan (balance='auto'):\n{table}")
        partition = (
            Partition.from_balance(balance, len(pipeline))
            if balance is not None
            else _by_parameters(pipeline, num_stages)
        )
        return SetupDecision(partition, cost_all, comm_all, plan, table, calibration, calibration_s)
    if config.balance is not None:
        return SetupDecision(Partition.from_balance(config.balance, len(pipeline)))
    return SetupDecision(_by_parameters(pipeline, num_stages))


def _profile_and_plan(
    config: DynPipeConfig,
    *,
    pipeline: nn.Sequential,
    world_size: int,
    num_stages: int,
    sample: Callable[[], Any],
    optimizer: Optimizer | Callable[[], Optimizer | None] | None,
    device: torch.device,
    forward_context: Callable[[], AbstractContextManager[Any]],
    layer_copies: Callable[[torch.device], Iterable[nn.Module]] | None,
    comm: CommModel,
) -> tuple[tuple[Any, ...], Plan | None]:
    """Rank 0's part of :func:`decide`: the profile, the plan, the calibration sweep, as the tuple every rank receives
    (``balance, table, cost arrays, link, error, sweep, fatal``), and the plan. A failure is reported in the tuple,
    not raised."""
    plan: Plan | None = None
    try:
        micro_batch = sample()
        opt = optimizer() if callable(optimizer) else optimizer
        copies = layer_copies(device) if layer_copies is not None else None
        with forward_context():
            cost = _profile(pipeline, micro_batch, device, opt, copies)
        cost = recomputed(cost, config.checkpoint_layers(len(pipeline)))
        del opt, copies
        balance, table = config.balance, None
        if config.balance_mode == "auto":
            plan = best_plan(
                cost,
                world_size,
                num_stages=None if config.stages_auto else num_stages,
                schedule=config.schedule,
                convergence=config.convergence,
                comm=comm,
                num_microbatches=config.num_microbatches,
                memory_cap=config.memory_cap,
            )
            balance, table = plan.partition.balance, plan.table()
        elif config.memory_cap is not None and balance is not None:
            _warn_over_cap(config, cost, balance, world_size)
        link = (comm.latency_s, comm.bandwidth_Bps, comm.cpu_s_per_byte)
        stages = len(balance) if balance is not None else num_stages
        sweep = None
        if config.calibrate is not None:
            autocast = _autocast_dtype(device, forward_context)
            sweep = _calibrate(config, pipeline, micro_batch, cost, stages, autocast)
        return (balance, table, cost.to_arrays(), link, None, sweep, False), plan
    except Exception as exc:  # the run must not die because a heuristic failed; say why
        # ... unless it is the memory cap: no fallback can honour it
        fatal = isinstance(exc, PartitionError) and config.memory_cap is not None
        return (config.balance, None, None, None, f"{type(exc).__name__}: {exc}", None, fatal), plan


def _warn_over_cap(config: DynPipeConfig, cost: ModelCost, balance: tuple[int, ...], world_size: int) -> None:
    """Warns when the balance the user gave is predicted to exceed ``memory_cap`` on some stage (rank 0)."""
    cap = config.memory_cap
    assert cap is not None
    dp = max(1, world_size // len(balance))
    plan = evaluate(
        cost,
        Partition(balance, (dp,) * len(balance)),
        schedule=config.schedule,
        convergence=config.convergence,
        num_microbatches=config.num_microbatches,
        memory_cap=cap,
    )
    if not plan.fits_memory:
        over = [f"stage {k}: {format_bytes(m)}" for k, m in enumerate(plan.stage_memory_bytes) if m > cap]
        rank_zero_warn(
            f"balance={list(balance)} is predicted to need more than memory_cap={format_bytes(cap)} "
            f"per process ({'; '.join(over)}). It runs as given (the adaptive loop only moves to partitions within "
            "the cap); use balance='auto' to start within it."
        )


def _autocast_dtype(device: torch.device, forward_context: Callable[[], AbstractContextManager[Any]]) -> Any:
    """The CPU autocast dtype the precision plugin's forward context turns on (``None``: none)."""
    if device.type != "cpu":
        return None
    with forward_context():
        return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def _calibrate(
    config: DynPipeConfig, pipeline: nn.Sequential, sample: Any, cost: ModelCost, num_stages: int, autocast: Any
) -> tuple[dict[str, Any] | None, str, float | None]:
    """Rank 0's sweep: (the rows as arrays, a line for the logs, its seconds), or (``None``, why it did not run,
    ``None``)."""
    from lightning_dynpipe.sweep import calibrate_pipeline

    assert config.calibrate is not None
    try:
        result = calibrate_pipeline(
            pipeline,
            sample,
            cost,
            num_stages=num_stages,
            num_microbatches=config.num_microbatches,
            settings=config.calibrate,
            autocast_dtype=autocast,
        )
    except Exception as exc:  # the run goes on; the predictor learns from the run's windows only
        return None, f"{type(exc).__name__}: {exc}", None
    rows = result.samples
    keys = ("stage_x", "stage_y", "boundary_x", "boundary_y", "fixed_s", "stage_window", "boundary_window")
    arrays = {k: getattr(rows, k) for k in keys}
    return arrays, result.summary(), result.seconds


def _fit_predictor(config: DynPipeConfig, arrays: dict[str, Any] | None, text: str) -> None:
    """Every rank: fits the predictor on the sweep's rows (plus any it already had), or says why it cannot."""
    if arrays is None:
        rank_zero_warn(
            f"DynPipe's calibration sweep did not run ({text}); the predictor learns from this run's windows only."
        )
        return
    predictor: Any = config.predictor
    rows = LabelledSamples(**arrays)
    before = getattr(predictor, "samples", None)
    if isinstance(before, LabelledSamples) and (len(before) or len(before.boundary_y)):
        if before.fixed_s == rows.fixed_s:
            rows = LabelledSamples.concat([before, rows])  # a loaded forest keeps its own rows
        else:
            rank_zero_warn(
                f"DynPipe's calibration sweep measured a fixed cost of {rows.fixed_s * 1e3:.3g} ms per micro-batch "
                f"and stage, where the predictor's {len(before)} earlier stage rows were priced with "
                f"{before.fixed_s * 1e3:.3g} ms; their residuals are over another prior, so the predictor is fitted "
                "on the sweep's rows only. Calibrate once (a file or calibrate=True) to keep every row."
            )
    predictor.fit(rows)
    rank_zero_info(f"DynPipe calibration sweep: {text}; predictor fitted on {len(rows)} stage rows.")


def _by_parameters(pipeline: nn.Sequential, num_stages: int) -> Partition:
    weights = [sum(p.numel() for p in layer.parameters()) for layer in pipeline]
    return balance_by_weights(weights, num_stages)
