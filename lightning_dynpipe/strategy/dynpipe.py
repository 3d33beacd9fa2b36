"""DynPipeStrategy: asynchronous pipeline-parallel training inside Lightning's Trainer.

The class keeps Lightning's hooks and delegates: :mod:`.config` validates the arguments, :mod:`.contract`
checks the model, :mod:`.decision` chooses the partition, :mod:`.adaptation` wires the monitor and the
adaptive loop, :mod:`.callbacks` and :mod:`.summary` are what it adds to the Trainer; the pipeline itself is
the engine's (:class:`~lightning_dynpipe.engine.shard.StageShard`,
:class:`~lightning_dynpipe.engine.executor.StageExecutor`, :mod:`~lightning_dynpipe.engine.checkpoint`).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available, _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.distributed import ReduceOp
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dynpipe.engine import checkpoint, sharded
from lightning_dynpipe.engine.allocator import keep_freed_memory
from lightning_dynpipe.engine.executor import StageExecutor
from lightning_dynpipe.engine.groups import destroy_default_group_at_exit
from lightning_dynpipe.engine.materialize import (
    is_on_meta,
    materialize_layers,
    materialized_copies,
    record_random_state,
)
from lightning_dynpipe.engine.microbatch import batch_fingerprint, batch_len, merge_step_outputs, take_share
from lightning_dynpipe.engine.shard import Placeholder
from lightning_dynpipe.engine.shares import IssuedShare, ShareBatchSampler, share_reading_dataloader
from lightning_dynpipe.engine.stage import PipelineStage
from lightning_dynpipe.engine.ties import SharedParameter, shared_parameters
from lightning_dynpipe.engine.topology import PipelineTopology
from lightning_dynpipe.errors import ConfigurationError, PeerFailure, ScheduleError
from lightning_dynpipe.monitor.callback import StageMonitor
from lightning_dynpipe.plan.convergence import ConvergenceModel
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.moves import plan_moves
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.plan.replicas import ReplicaSplit
from lightning_dynpipe.plan.solver import Plan
from lightning_dynpipe.predictor import InterferencePredictor
from lightning_dynpipe.repartition.controller import AdaptiveController
from lightning_dynpipe.repartition.ladder import EscalationLadder
from lightning_dynpipe.repartition.policy import RepartitionPolicy
from lightning_dynpipe.schedule import Schedule, get_schedule
from lightning_dynpipe.strategy import summary
from lightning_dynpipe.strategy.adaptation import AdaptationWiring
from lightning_dynpipe.strategy.callbacks import TrainerAdditions, bind_metrics
from lightning_dynpipe.strategy.clipping import PipelineNormClipping
from lightning_dynpipe.strategy.config import DynPipeConfig
from lightning_dynpipe.strategy.contract import (
    check_accumulation,
    check_batches,
    check_loss_terms,
    check_optimizers,
    check_replica_split,
    check_sample_order,
    check_setup,
    check_ties,
    find_pipeline,
    loss_terms_hook,
)
from lightning_dynpipe.strategy.decision import decide, first_stage_input
from lightning_dynpipe.strategy.logs import StepLogs
from lightning_dynpipe.strategy.restart import RestartPlan
from lightning_dynpipe.strategy.sigterm import quiet_sigterm_handler
from lightning_dynpipe.sweep import SweepSettings

__all__ = ["DynPipeStrategy", "MigrationRecord", "ScheduleChange"]


@dataclass(frozen=True)
class MigrationRecord:
    """One live repartition: when, from which partition to which, what moved and how long training paused."""

    step: int
    old: Partition
    new: Partition
    moved: tuple[int, ...]
    bytes_sent: int
    pause_s: float


@dataclass(frozen=True)
class ScheduleChange:
    """One live change of schedule (:meth:`DynPipeStrategy.reschedule`): when, from which schedule to which, and how
    long training paused (the drain)."""

    step: int
    old: str
    new: str
    pause_s: float


_ORPHAN_POLL_S = 1.0


def _exit_when_orphaned(poll_s: float = _ORPHAN_POLL_S) -> threading.Thread:
    """In a rank process the launcher started: a daemon thread that ends the process (exit code 1, a line on stderr)
    once the launching process is gone (its parent changes: it was killed without ending its children).

    torch's spawn asks the kernel for a ``SIGINT`` to each child when its parent dies, but a process started with
    ``SIGINT`` ignored (``nohup``, a background job, many CI runners) passes that on to its children, and such a rank
    then waits for its peers' messages forever, busy; a ``SIGTERM`` only sets Lightning's flag for the end of a step
    that never comes."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                message = f"DynPipe: the launching process ({parent}) of rank process {os.getpid()} is gone; exiting\n"
                os.write(2, message.encode())
                os._exit(1)

    thread = threading.Thread(target=watch, name="dynpipe-orphan-watch", daemon=True)
    thread.start()
    return thread


class _DynPipeSpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher, also sending rank 0's :class:`RestartPlan` back to the launching process (its
    strategy object is not the one that trained, so :func:`fit_with_restarts` would not see the plan otherwise),
    and ending each rank process whose launching process is gone (:func:`_exit_when_orphaned`)."""

    @override
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        _exit_when_orphaned()
        super()._wrapping_function(process_idx, *args, **kwargs)

    @override
    def get_extra_results(self, trainer: Trainer) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        plan = getattr(trainer.strategy, "restart_plan", None)
        extra["dynpipe_restart_plan"] = plan.to_dict() if plan is not None else None
        return extra

    @override
    def update_main_process_results(self, trainer: Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        plan = extra.get("dynpipe_restart_plan")
        if hasattr(trainer.strategy, "restart_plan"):
            trainer.strategy.restart_plan = RestartPlan.from_dict(plan) if plan is not None else None


class _CollectingForkLauncher(_DynPipeSpawnLauncher):
    """Lightning's fork launcher, made safe against two things a forked child inherits but cannot use.

    * Garbage: a ``ProcessGroupGloo`` left in a reference cycle by an earlier run in this process (a notebook's
      previous ``fit``, a single-device run) joins its worker threads when it is freed; in a forked child those
      threads do not exist, so the child's garbage collector blocks forever inside whatever it was doing (a
      pipeline that hangs at its first step). The parent collects before forking, where those threads live.
    * The OpenMP thread pool: a forked child can wait forever at the pool's barrier in its first parallel
      operator, for threads of the parent's pool that were not copied (GNU libgomp; seen in the test suite, where
      the forking process had run many tests before). Each forked process therefore computes with one intra-op
      thread (``torch.set_num_threads(1)``, as PyTorch's own DataLoader workers do), which never enters an
      OpenMP parallel region; use the popen or spawn launcher for more threads per stage.
    """

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        gc.collect()
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        torch.set_num_threads(1)
        super()._wrapping_function(process_idx, *args, **kwargs)


log = logging.getLogger(__name__)
_LAUNCHER_EXIT_GRACE_S = 30.0


def _let_the_launching_process_fail(children: list[Any], grace_s: float = _LAUNCHER_EXIT_GRACE_S) -> bool:
    """After an exception in the process that launched the others (popen launcher), let it end as failed Python
    programs do (traceback, exit code 1), or let the user's script go on, instead of being killed with SIGKILL.
    Returns whether Lightning's observer was found and stopped.

    Lightning's child-process observer (a thread of the launching process, polling every 5 s) sends SIGKILL to
    the launching process itself as soon as a child has exited with a non-zero code, to avoid orphans. After a
    failure the children end by design (they are told of it and raise), so a launching process still running
    then (its teardown, or the user's code after the failed ``fit``) died with exit -9 and no traceback. This
    stops the observer from acting and keeps its guarantee against orphans: ``grace_s`` after the exception, a
    child still running is killed (a child ends itself within 15 s of learning of the failure, see
    :class:`~lightning_dynpipe.engine.p2p.FailureHandler`).
    """
    if not children:
        return False
    try:  # private to Lightning; without it nothing kills this process early and there is nothing to do
        from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    except ImportError:  # pragma: no cover - another Lightning layout
        return False
    observers = [t for t in threading.enumerate() if isinstance(t, _ChildProcessObserver)]
    for observer in observers:
        observer._child_processes = []  # its next poll finds no failed child and ends the thread

    def _kill_survivors() -> None:
        for proc in children:
            if proc.poll() is None:
                log.warning("DynPipe: rank process %d still running %.0f s after the failure: killing it", proc.pid,
                            grace_s)  # fmt: skip
                proc.send_signal(signal.SIGKILL)

    timer = threading.Timer(grace_s, _kill_survivors)
    timer.daemon = True  # the process ending on its own ends the timer
    timer.start()
    return bool(observers)


class DynPipeStrategy(DDPStrategy):
    """Pipeline-parallel training of a LightningModule's ``nn.Sequential`` with asynchronous 1F1B.

    Example::

        import lightning.pytorch as L
        from lightning_dynpipe import DynPipeStrategy

        trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=200,
                            strategy=DynPipeStrategy(num_microbatches=4))
        trainer.fit(model, datamodule)      # model.pipeline is an nn.Sequential holding every trainable parameter

    The user's ``training_step`` runs on the last stage, once per micro-batch, and calls ``self.pipeline(x)``
    once; the strategy routes that call through the stages. ``schedule="async"`` (PipeDream 1F1B, weight
    stashing, an update after every micro-batch, no flush between steps) trains with staleness ``S-1-k`` on
    stage ``k``; ``"async+d"`` keeps ``d`` more micro-batches in flight over every boundary (staleness
    ``(S-1-k)(1+d)``), which hides a slow link's latency; ``"sync"`` and ``"gpipe"`` accumulate the gradients of
    the ``M`` micro-batches and update once per step, exactly like single-device training on the whole batch.

    Args:
        num_stages: number of pipeline stages ``S``; default: all devices of a node, one stage each. With more
            processes than stages, ``world_size / S`` pipeline replicas train data-parallel. ``"auto"``: the
            planner chooses ``S`` among the divisors of the process count (needs ``balance="auto"``).
        num_microbatches: micro-batches ``M`` each Lightning batch is split into (along dim 0).
        schedule: ``"async"`` (default), ``"async+d"`` (``d`` a positive int), ``"sync"``, ``"gpipe"`` or a
            :class:`~lightning_dynpipe.schedule.Schedule` object.
        balance: layers per stage, e.g. ``[5, 3]``; ``"auto"`` (default): profile the layers on a sample
            micro-batch, probe the link between ranks 0 and 1, and let the time-to-accuracy planner choose the
            partition (and, with ``num_stages="auto"``, the number of stages); ``"parameters"``: balance by
            parameter count. Evaluation-only runs (validate/test/predict) balance by parameter count unless a
            list is given.
        convergence: the planner's staleness model (iterations to accuracy vs. staleness); default
            :class:`~lightning_dynpipe.plan.convergence.ConvergenceModel` with its default ``beta``.
        adaptive: runtime adaptation: ``True`` (default) uses
            :class:`~lightning_dynpipe.repartition.policy.GainOverCostPolicy`; pass a
            :class:`~lightning_dynpipe.repartition.policy.RepartitionPolicy` to decide differently, or ``False``
            to keep the partition fixed. Every ``monitor_every_n_steps`` the stage statistics are gathered, each
            stage's slowdown is measured, the planner re-solves, and the policy decides whether to migrate.
        predictor: what prices candidate partitions for the adaptive loop: ``"measured"`` (default:
            :class:`~lightning_dynpipe.predictor.MeasuredSlowdownPredictor`, each stage's measured slowdown carried
            over, what it reads with no sign of interference as a fixed cost per micro-batch), ``"forest"``
            (:class:`~lightning_dynpipe.predictor.ForestPredictor`, untrained: it learns from
            the run's own windows and migrations), or an
            :class:`~lightning_dynpipe.predictor.InterferencePredictor` object, e.g.
            ``ForestPredictor.load("dynpipe-forest.npz")`` for a forest from ``python -m lightning_dynpipe
            calibrate``.
        calibrate: train the predictor on this machine before the first step (opt-in; CPU pipelines): ``True``
            runs :class:`~lightning_dynpipe.sweep.SweepSettings`'s default sweep, a ``SweepSettings`` names the
            scenarios, partitions and steps. Global rank 0 runs the model's own layer sets in a worker process
            pinned to one core under injected interference (a CPU hog, a CPU limit, a link delay), for a few
            candidate partitions; every rank then fits its predictor on the same rows (a forest then refits on
            those rows plus the run's own windows). Needs adaptation on and a predictor with ``fit`` (``"forest"``);
            about 10 s for the demo CNN (benchmarks/results/2026-12-03-interference-calibrate.md), while the other
            ranks wait.
        monitor_every_n_steps: how often stage statistics are gathered (one small collective) and logged as
            ``dynpipe/stage{k}/...``; ``None``: no stage monitor (and so no adaptation).
        interference: a declarative interference schedule for tests, benchmarks and what-if runs (a list of
            entries or the path of a YAML file; see :mod:`lightning_dynpipe.interference`), e.g.
            ``[{"kind": "cpu_hog", "stage": 0, "start_step": 100}]``.
        pipeline_attr: attribute of the LightningModule holding the ``nn.Sequential`` (dotted paths allowed).
        activation_checkpointing: recompute activations in the backward instead of keeping them: ``True`` for
            every layer, or a list of ``self.pipeline`` indices (they stay checkpointed wherever migrations move
            them). Trades one extra forward per checkpointed layer for the memory of its activations.
        lr_scale: multiplies the learning rate of every optimizer update (applied around the step: schedulers
            and loggers see the configured rate). ``"auto"`` (default): ``1/num_microbatches`` for ``"async"``,
            whose ``M`` updates per batch would otherwise move the weights about ``M`` times as far as one plain
            step, and 1 for ``"sync"``/``"gpipe"``; the same for every optimizer (scaling the learning rate,
            not the gradient, also works for Adam). ``1.0``: unscaled. How the default was measured:
            docs/user-guide.md, "Learning rates under async".
        microbatch_logging: ``"step"`` (default): the ``self.log`` calls of ``training_step``'s ``M`` runs per
            step reach Lightning once per step and name, reduced over the micro-batches (a mean weighted by
            batch size, or the sum/max/min); the epoch value is unchanged and the step value is the step's,
            not its last micro-batch's. ``"each"``: every call goes to Lightning (about 1.4 ms of CPU a call on
            the last stage). See docs/user-guide.md, "What Lightning features do".
        checkpoint: how checkpoints are written. ``"full"`` (default): one ``torch.save`` file holding the whole
            model and optimizer state, gathered on rank 0 (for models that fit one process). ``"sharded"``: every
            stage writes only its own layers and their optimizer state into a ``torch.distributed.checkpoint``
            directory, with the plain module's keys and the plain optimizer's canonical indices; it loads under
            any partition, number of stages and data-parallel width, and into a plain model (docs/user-guide.md,
            "Models larger than one process"). Either kind of checkpoint resumes under either setting.
        gather_after_fit: ``True`` (default): at the end of fit/validate/test/predict the whole model is put
            back into the LightningModule in every process. ``False``: each process keeps its stage's layers
            (the others stay placeholders), so no process ever holds the whole model; get the full model from a
            checkpoint (:func:`lightning_dynpipe.engine.sharded.consolidate`). Needs ``start_method="popen"``.
        start_method: how processes are launched: ``"popen"`` (default; scripts, CLI, torchrun, SLURM),
            ``"spawn"`` (tests) or ``"fork"`` (notebooks).
        timeout: how long collectives and stage-to-stage receives may wait (seconds or a ``timedelta``);
            default 30 minutes.
        process_group_backend: ``"gloo"`` / ``"nccl"``; default: chosen from the device.
        cluster_environment: Lightning's cluster environment plugin.
        replica_split: intra-stage balance across data-parallel pipeline replicas. ``None`` (default): each
            replica reads its own batches (a distributed sampler), the dataloader's ``batch_size`` is per replica.
            Otherwise every replica reads the same **global** batch (the dataloader's ``batch_size`` is the
            global batch) and trains on its share of it, with gradients averaged weighted by sample count, so an
            update equals plain training's on the global batch: ``"even"`` (equal shares), a list of relative
            weights (``[3, 1]``), or ``"speed"`` (shares follow the replicas' measured speeds, re-split at a step
            boundary by the escalation ladder; pass an
            :class:`~lightning_dynpipe.repartition.ladder.EscalationLadder` to tune it). Refuses BatchNorm. See
            docs/adaptation.md, "Intra-stage balance".
        change_stages: what the adaptive loop does when the planner, fed with the measured slowdowns, predicts
            that another number of stages reaches accuracy sooner (a live migration keeps the number of stages).
            ``"report"`` (default): a warning saying so. ``"restart"``: at the end of that step, write a
            partition-independent checkpoint under ``trainer.default_root_dir/dynpipe-restart/``, end the fit,
            and leave a :class:`~lightning_dynpipe.strategy.restart.RestartPlan` in :attr:`restart_plan`;
            :func:`~lightning_dynpipe.fit_with_restarts` continues from it under the new number of stages, with
            the same processes. Needs ``replica_split="even"`` or ``"speed"`` (the global batch stays the
            dataloader's ``batch_size`` whatever the number of replicas). See docs/adaptation.md.
        keep_freed_cpu_memory: ``True`` (default): on CPU, each stage process sets glibc's allocator to keep freed
            memory (blocks below 32 MiB from its heap, up to 256 MiB of free memory kept) instead of handing every
            micro-batch's activations back to the system and faulting them in again: a fresh process's fit ran
            about 10% faster on the throughput benchmark's MLP (:mod:`lightning_dynpipe.engine.allocator`). A
            process-wide C-library setting;
            ``False`` leaves the allocator alone. Nothing changes on GPUs or without glibc.
        max_extra_in_flight: ``0`` (default): the depth stays as configured. ``d > 0``: the adaptive loop may also
            change how many micro-batches are in flight, choosing ``"async+d'"`` for ``d'`` in ``0..d`` when the
            predicted time to accuracy pays (a slow link hidden, against the deeper staleness's extra steps), and
            undoing a change whose measured outcome is slower to accuracy
            (:class:`~lightning_dynpipe.repartition.InFlightPolicy`). Needs ``schedule="async"`` (or
            ``"async+d"``), the adaptive loop, and ``convergence`` with a ``beta`` measured on the model: the choice
            is only as good as that price of staleness. Changes are in :attr:`schedule_changes`.
        memory_cap: ``None`` (default): no cap. A number: the bytes each process may hold. The set-up plan
            (``balance="auto"``) and the adaptive loop choose only partitions and depths whose every stage fits it by
            the planner's memory model (weight versions, optimizer state, the activations of the micro-batches in
            flight, the largest layer's workspace: :func:`~lightning_dynpipe.plan.stage_memory`); a faster choice
            left out is named in the decision's log line, and a set-up plan that nothing fits raises
            :class:`~lightning_dynpipe.errors.ConfigurationError`. The model leaves out the framework's own memory
            (CUDA context, allocator caches): give the cap less than the device holds. Needs ``balance="auto"`` or
            the adaptive loop.
        microbatch_statistics: ``False`` (default): a fit under ``schedule="sync"`` or ``"gpipe"`` with
            ``num_microbatches > 1`` refuses BatchNorm layers, which would normalise each micro-batch by its own
            statistics where those schedules promise one device's update on the whole batch, and the first
            training forward of a stage refuses layers that write buffers in it (spectral norm's power iteration, a
            running average), which would run once per micro-batch. ``True``: train with each micro-batch's
            statistics (running statistics and other buffers updated once per micro-batch), as GPipe-style
            pipelines do; also right when BatchNorm layers stay in eval mode. ``async`` is not affected: each of its
            updates is one micro-batch's.
        checkpoint_io: Lightning's checkpoint IO plugin.
        precision_plugin: Lightning's precision plugin.
    """

    strategy_name = "dynpipe"

    def __init__(
        self,
        *,
        num_stages: int | Literal["auto"] | None = None,
        num_microbatches: int = 4,
        schedule: str | Schedule = "async",
        balance: list[int] | Literal["auto", "parameters"] = "auto",
        convergence: ConvergenceModel | None = None,
        adaptive: bool | RepartitionPolicy = True,
        predictor: str | InterferencePredictor = "measured",
        calibrate: bool | SweepSettings = False,
        monitor_every_n_steps: int | None = 10,
        interference: list[dict[str, Any]] | str | None = None,
        pipeline_attr: str = "pipeline",
        lr_scale: float | Literal["auto"] = "auto",
        activation_checkpointing: bool | list[int] = False,
        microbatch_logging: Literal["step", "each"] = "step",
        checkpoint: Literal["full", "sharded"] = "full",
        gather_after_fit: bool = True,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        timeout: float | timedelta | None = None,
        process_group_backend: str | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        replica_split: str | list[float] | EscalationLadder | None = None,
        change_stages: Literal["report", "restart"] = "report",
        keep_freed_cpu_memory: bool = True,
        max_extra_in_flight: int = 0,
        memory_cap: float | None = None,
        microbatch_statistics: bool = False,
    ) -> None:
        self.config = DynPipeConfig.from_arguments(
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            schedule=schedule,
            balance=balance,
            convergence=convergence,
            adaptive=adaptive,
            predictor=predictor,
            calibrate=calibrate,
            monitor_every_n_steps=monitor_every_n_steps,
            interference=interference,
            pipeline_attr=pipeline_attr,
            timeout=timeout,
            lr_scale=lr_scale,
            activation_checkpointing=activation_checkpointing,
            microbatch_logging=microbatch_logging,
            checkpoint=checkpoint,
            gather_after_fit=gather_after_fit,
            start_method=start_method,
            replica_split=replica_split,
            change_stages=change_stages,
            keep_freed_cpu_memory=keep_freed_cpu_memory,
            max_extra_in_flight=max_extra_in_flight,
            memory_cap=memory_cap,
            microbatch_statistics=microbatch_statistics,
        )
        super().__init__(
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=self.config.timeout,
            start_method=start_method,
        )
        self.model_cost: ModelCost | None = None  # per-layer costs from the set-up profile (every rank)
        self.comm: CommModel = CommModel()
        self.plan: Plan | None = None  # the planner's choice (rank 0 holds the full object)
        self.plan_table: str | None = None
        self.calibration: str | None = None  # the set-up calibration sweep's summary, or why it did not run
        self.calibration_s: float | None = None  # its wall time (None: no sweep ran)
        self.stage: PipelineStage | None = None  # this process's part of the running pipeline
        self.ties: list[SharedParameter] = []  # parameters shared by several layers of the pipeline
        self.migrations: list[MigrationRecord] = []
        self.cpu_memory_kept = False  # keep_freed_cpu_memory applied in this process (set-up, CPU, glibc)
        self._clipping: PipelineNormClipping | None = None  # a flush schedule's clipping by the pipeline's norm
        # bound methods, not lambdas: the spawn launcher pickles the strategy
        self.adaptation = AdaptationWiring(
            self.config,
            partition=self._current_partition,
            pending=self._has_pending_partition,
            repartition=self.repartition,
            past_pauses=self._migration_pauses,
            replica_split=self._current_replica_split,
            replica_samples=self._current_replica_samples,
            resplit=self.set_replica_split,
            restart=self._restart,
            reschedule=self.reschedule,
        )
        self._split: ReplicaSplit | None = None  # the split of new batches (None: replica_split off, or dp=1)
        self._pending_split: ReplicaSplit | None = None
        self._trained_split: ReplicaSplit | None = None  # the split of the batch in training
        self._share_sampler: ShareBatchSampler | None = None  # reads only this replica's share of each batch
        self._last_shares: tuple[int, ...] = ()
        self.resplits: list[tuple[int, ReplicaSplit, ReplicaSplit]] = []  # (step, old, new) of every re-split
        self._planned_num_stages: int | None = None
        self._topology: PipelineTopology | None = None
        self._full_keys: list[str] = []
        self._pending_partition: Partition | None = None
        self._running_schedule: Schedule | None = None  # the schedule of the running fit (reschedule() changes it)
        self._pending_schedule: Schedule | None = None
        self.schedule_changes: list[ScheduleChange] = []  # every live change of schedule, in order
        self.additions = TrainerAdditions()  # the metrics mirror, the summary, the interference callback
        self._init_random_state: Tensor | None = None  # where a meta-built model's random draws started
        self._init_own_generator = False
        self._loaded_sharded = False  # the checkpoint being restored was read stage by stage
        self._batch_idx = 0
        self._step_outputs: dict[int, dict[str, Any]] = {}  # training_step's other outputs, by micro-batch slot
        self._update_hooks: bool | None = None  # whether anything observes the hooks before each update (per fit)
        self._update_writers: bool | None = None  # whether user code runs before each update (per fit)
        self.restart_plan: RestartPlan | None = None  # set when the fit ended to continue under another S
        self.restart_allowed = True  # fit_with_restarts clears it for its last fit

    # ------------------------------------------------------------------ configuration, read-only
    num_microbatches = property(lambda self: self.config.num_microbatches, doc="``M``, micro-batches per batch.")
    schedule = property(
        lambda self: (self._running_schedule or self.config.schedule).name,
        doc="The schedule's name: during a fit the one it runs (:meth:`reschedule` changes it), after it the one it "
        "ended with, before any fit the configured one.",
    )
    balance_mode = property(lambda self: self.config.balance_mode, doc="``'list'``, ``'auto'`` or ``'parameters'``.")
    balance = property(
        lambda self: list(self.config.balance) if self.config.balance is not None else self.config.balance_mode,
        doc="The requested balance: layers per stage, ``'auto'`` or ``'parameters'``.",
    )
    convergence = property(lambda self: self.config.convergence, doc="The planner's staleness model.")
    adaptive_policy = property(lambda self: self.config.policy, doc="The repartition policy (``None``: off).")
    predictor = property(lambda self: self.config.predictor, doc="What prices candidate partitions.")
    monitor_every_n_steps = property(lambda self: self.config.monitor_every_n_steps, doc="Monitor period.")
    interference = property(lambda self: self.config.interference, doc="The interference schedule, if any.")
    pipeline_attr = property(lambda self: self.config.pipeline_attr, doc="Where the ``nn.Sequential`` lives.")
    checkpoint_mode = property(lambda self: self.config.checkpoint, doc="``'full'`` or ``'sharded'``.")
    max_extra_in_flight = property(
        lambda self: self.config.max_extra_in_flight,
        doc="How many more micro-batches per boundary the adaptive loop may keep in flight (0: it keeps the depth).",
    )
    memory_cap = property(
        lambda self: self.config.memory_cap,
        doc="The bytes each process may hold by the planner's memory model (``None``: no cap).",
    )

    @property
    def monitor(self) -> StageMonitor | None:
        """The stage monitor of the running fit."""
        return self.adaptation.monitor

    @property
    def controller(self) -> AdaptiveController | None:
        """The adaptive loop of the last fit (its ``decisions`` stay readable after it)."""
        return self.adaptation.controller

    @property
    def partition(self) -> Partition | None:
        """The partition in use (``None`` outside fit/validate/test/predict)."""
        return self.stage.partition if self.stage is not None else None

    @property
    def executor(self) -> StageExecutor | None:
        """This process's stage executor (``None`` outside fit/validate/test/predict)."""
        return self.stage.executor if self.stage is not None else None

    def _current_partition(self) -> Partition | None:
        return self.partition

    @property
    def replica_split(self) -> ReplicaSplit | None:
        """The split of the global batch in training across the pipeline replicas (before the first step: the
        starting split; ``None``: ``replica_split`` is off or there is one replica)."""
        return self._trained_split or self._split

    @property
    def replica_shares(self) -> tuple[int, ...]:
        """Each replica's samples of the last global batch (``()`` before the first step or without a split)."""
        return self._last_shares

    def _current_replica_split(self) -> ReplicaSplit | None:
        return self._split

    def _current_replica_samples(self) -> tuple[int, ...]:
        return self._last_shares

    def set_replica_split(self, weights: ReplicaSplit | list[float] | tuple[float, ...]) -> None:
        """Splits the global batches across the pipeline replicas by ``weights`` from the next global batch the
        dataloader draws on.

        Where each replica reads only its share (a plain ``DataLoader``, the default), the batches the dataloader
        has drawn already keep their split: without workers a call from any hook of step ``t`` splits step
        ``t + 1`` on (step ``t``'s batch is drawn before its first hook); dataloader workers draw
        ``num_workers x prefetch_factor`` batches ahead, and a dataloader without a length one more (Lightning's
        prefetch). Where every replica reads the whole global batch, the next step that starts takes it (step
        ``t`` itself from ``on_train_batch_start``). :attr:`replica_split` and :attr:`resplits` report the split
        each step trained on.

        Call it with the same ``weights`` on every rank (the adaptive loop does, from the monitor's gathered
        measurements). No drain and no restart: micro-batches in flight keep the sample counts they were split
        with, so each update's weighting stays exact, and the sample order of the epoch does not change (every
        replica draws the same global batches; only the cut between the shares moves).

        Example::

            class FavourReplicaZero(L.Callback):
                def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                    if batch_idx == 50:
                        trainer.strategy.set_replica_split([3, 1])
        """
        if self._split is None:
            raise ConfigurationError(
                "set_replica_split() needs a running fit with replica_split enabled and at least 2 pipeline replicas "
                f"(replica_split={self.config.replica_split_mode!r}, replicas "
                f"{self.topology.dp_size if self.stage is not None else 'unknown'}). Pass "
                "DynPipeStrategy(replica_split='even') (or 'speed', or weights) and train with devices = "
                "num_stages x replicas."
            )
        new = weights if isinstance(weights, ReplicaSplit) else ReplicaSplit(tuple(float(w) for w in weights))
        if new.num_replicas != self._split.num_replicas:
            raise ConfigurationError(
                f"set_replica_split() needs one weight per pipeline replica ({self._split.num_replicas}); got "
                f"{list(new.weights)}."
            )
        self._pending_split = new

    def _has_pending_partition(self) -> bool:
        return self._pending_partition is not None or self._pending_schedule is not None

    def _migration_pauses(self) -> list[float]:
        return [m.pause_s for m in self.migrations]

    # ------------------------------------------------------------------ topology
    @property
    def _lm(self) -> LightningModule:
        module = self.lightning_module
        if module is None:
            raise RuntimeError("DynPipeStrategy has no LightningModule attached yet (call trainer.fit/validate first).")
        return module

    @property
    def _step_logs(self) -> StepLogs:
        """The recorder of ``self.log`` calls over a step's micro-batches (``microbatch_logging="step"``)."""
        logs = self.__dict__.get("_step_logs_of_module")
        if logs is None or logs.module is not self._lm:
            logs = self.__dict__["_step_logs_of_module"] = StepLogs(self._lm)
        return logs

    @property
    def num_stages(self) -> int:
        """``S``: stages per pipeline."""
        if self._planned_num_stages is not None:
            return self._planned_num_stages
        return self.config.num_stages if self.config.num_stages is not None else max(1, self.num_processes)

    @property
    def topology(self) -> PipelineTopology:
        """Placement of stages and replicas on global ranks."""
        if self._topology is None:
            self._topology = PipelineTopology(self.num_stages, self.num_nodes * self.num_processes)
        return self._topology

    @property
    def stage_idx(self) -> int:
        """``k``: the stage this rank runs."""
        return self.topology.coords(self.global_rank)[1]

    @property
    def dp_rank(self) -> int:
        """Which pipeline replica this rank belongs to."""
        return self.topology.coords(self.global_rank)[0]

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank runs stage 0 (which reads the pipeline input from the batch)."""
        return self.stage_idx == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank runs the last stage (where the user's *_step code and logging run)."""
        return self.stage_idx == self.num_stages - 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Shard data across pipelines only: every stage of a pipeline must see the same batches. With a replica
        # split every replica reads the same global batches and takes its share of each (training_step).
        if self.config.replica_split_mode != "off":
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": self.topology.dp_size, "rank": self.dp_rank}

    @override
    def _configure_launcher(self) -> None:
        # Checked at Trainer construction, before any process is launched (and again in each launched process).
        if not self.config.stages_auto:
            PipelineTopology(self.num_stages, self.num_nodes * self.num_processes)
        super()._configure_launcher()
        if type(self._launcher) is _MultiProcessingLauncher:
            if self._start_method in ("fork", "forkserver"):
                self._launcher = _CollectingForkLauncher(self, start_method=self._start_method)
            else:
                self._launcher = _DynPipeSpawnLauncher(self, start_method="spawn")

    @override
    def setup_environment(self) -> None:
        # Refusals run before the process group exists, so a bad configuration fails fast on every rank.
        module = self.lightning_module
        if module is not None and module._trainer is not None:
            trainer = module._trainer
            check_setup(
                module,
                config=self.config,
                fitting=trainer.state.fn == TrainerFn.FITTING,
                accumulate_grad_batches=trainer.accumulate_grad_batches,
                gradient_clip_val=trainer.gradient_clip_val,
                gradient_clip_algorithm=trainer.gradient_clip_algorithm,
                precision_plugin=self.precision_plugin,
                sync_batchnorm=self._layer_sync is not None,
                num_stages=self.num_stages,
                callbacks=getattr(trainer, "callbacks", []),
                num_replicas=max(1, self.world_size // self.num_stages),
            )
            if trainer.state.fn == TrainerFn.FITTING and self.config.calibrate is not None:
                self._check_calibration(is_on_meta(self._pipeline()))
        super().setup_environment()
        self._topology = None
        self._planned_num_stages = None

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        # Lightning destroys the default group at exit only for NCCL; a gloo group left alive aborts the process.
        destroy_default_group_at_exit()

    # ------------------------------------------------------------------ set-up
    def _pipeline(self) -> nn.Sequential:
        return find_pipeline(self._lm, self.config.pipeline_attr)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` builds the model on ``meta``: no memory until set-up, where
        each stage materialises only its own layers, as the whole model built on the CPU would have them
        (:mod:`~lightning_dynpipe.engine.materialize`)."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with record_random_state() as draws, self.precision_plugin.tensor_init_context():
            yield
        self._init_random_state = draws.state if draws.state is not None else draws.entry_state
        self._init_own_generator = draws.own_generator

    def _check_meta_start(self, pipeline: nn.Sequential) -> None:
        """Refuses what a pipeline built on ``meta`` cannot do exactly (before anything is materialised)."""
        fix = "build the model without empty_init / the meta device"
        if not all(is_on_meta(layer) for layer in pipeline if any(True for _ in layer.parameters())):
            raise ConfigurationError(
                f"Some layers of `{self.config.pipeline_attr}` are on the meta device and others are not; build all "
                f"of them under trainer.init_module(empty_init=True), or {fix}."
            )
        outside = [
            n
            for n, t in (*self._lm.named_parameters(), *self._lm.named_buffers())
            if t.device.type == "meta" and not n.startswith(self.config.pipeline_attr + ".")
        ]
        if outside:
            raise ConfigurationError(
                f"{outside[:5]} outside `{self.config.pipeline_attr}` are on the meta device; DynPipe materialises "
                f"only the pipeline's layers. Create them on a real device (outside the meta context), or {fix}."
            )
        if self._init_random_state is None:
            raise ConfigurationError(
                "The pipeline is on the meta device but was not built under trainer.init_module(empty_init=True), so "
                "DynPipe does not know the random state its initialisation starts from. Build it under "
                f"`with trainer.init_module(empty_init=True):`, or {fix}."
            )
        if self._init_own_generator:
            raise ConfigurationError(
                "The model built on the meta device draws random numbers from its own torch.Generator; DynPipe "
                f"replays the initialisation from the global random state only. Use the global seed, or {fix}."
            )

    def _meta_layer_copies(self, device: torch.device) -> Iterator[nn.Module]:
        """The profile's layers for a pipeline on ``meta``: materialised one at a time, as the stages will have them."""
        assert self._init_random_state is not None
        return materialized_copies(self._pipeline(), device, random_state=self._init_random_state)

    def _meta_optimizer(self) -> Optimizer | None:
        """The user's first optimizer built on the model still on ``meta``, read by the profile for its state size
        (``configure_optimizers`` runs again after materialisation; this one is dropped)."""
        optimizers, _ = _init_optimizers_and_lr_schedulers(self._lm)
        return optimizers[0] if optimizers else None

    def _check_calibration(self, meta: bool) -> None:
        """``calibrate`` runs the pipeline on the CPU in another process: refused where it cannot measure the run."""
        if self.root_device.type != "cpu":
            raise ConfigurationError(
                f"calibrate runs the calibration sweep on the CPU (CPU hogs, CPU limits, a link delay), which does not "
                f"measure this run's {self.root_device.type} stages. Drop calibrate, or train the predictor from the "
                "run's own windows (predictor='forest' without calibrate)."
            )
        if meta:
            raise ConfigurationError(
                "calibrate needs the whole model's weights in one process for its sweep, but this pipeline was built "
                "on the meta device. Calibrate once with `python -m lightning_dynpipe calibrate` and pass "
                "predictor=ForestPredictor.load(...), or build the model on the CPU."
            )

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self._update_hooks = self._update_writers = None
        pipeline = self._pipeline()  # the refusals ran in setup_environment, before the process group
        self._refuse_if_left_sharded("run again")
        meta = is_on_meta(pipeline)
        if meta:
            self._check_meta_start(pipeline)
        self.accelerator.setup(trainer)
        if self.config.keep_freed_cpu_memory and self.root_device.type == "cpu" and not self.cpu_memory_kept:
            self.cpu_memory_kept = keep_freed_memory()  # before the first step's tensors
        if not meta:
            self.precision_plugin.convert_module(self.model)
            self.model_to_device()
        self._full_keys = list(self._lm.state_dict().keys())
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.restart_plan = None  # a plan describes the fit that set it
        if fitting and not meta:
            self.setup_optimizers(trainer)
            check_optimizers(self.optimizers)
        world = self.num_nodes * self.num_processes
        self.ties = shared_parameters(pipeline)  # on the whole model, before any layer is offloaded
        decision = decide(
            self.config,
            pipeline=pipeline,
            fitting=fitting,
            global_rank=self.global_rank,
            world_size=world,
            num_stages=self.num_stages,
            first_batch=lambda: self.precision_plugin.convert_input(
                self.batch_to_device(next(iter(trainer.fit_loop._data_source.dataloader())))
            ),
            module=self._lm,
            optimizer=self._meta_optimizer if meta else (self.optimizers[0] if self.optimizers else None),
            device=self.root_device,
            forward_context=self.precision_plugin.forward_context,
            layer_copies=self._meta_layer_copies if meta else None,
        )
        if decision.model_cost is not None:
            self.model_cost, self.comm = decision.model_cost, decision.comm
        self.plan, self.plan_table = decision.plan, decision.plan_table
        self.calibration, self.calibration_s = decision.calibration, decision.calibration_s
        partition = decision.partition
        self._planned_num_stages = partition.num_stages
        self._topology = PipelineTopology(partition.num_stages, world)
        if meta:  # only this stage's layers get memory; then everything as for a model built whole
            assert self._init_random_state is not None
            owned = partition.stage_layers(self._topology.coords(self.global_rank)[1])
            materialize_layers(pipeline, owned, self.root_device, random_state=self._init_random_state, ties=self.ties)
            self.precision_plugin.convert_module(self.model)
            if fitting:
                self.setup_optimizers(trainer)  # on the whole model: the other layers' parameters are on meta
                check_optimizers(self.optimizers)
        module = self._lm

        def stage_zero_input(batch: Any) -> Any:
            return first_stage_input(module, batch)

        self._running_schedule, self._pending_schedule = self.config.schedule, None
        if fitting:  # again: with num_stages="auto" the planner fixes the replicas only now
            check_loss_terms(module, num_replicas=self.topology.dp_size)
        self.stage = PipelineStage.start(
            pipeline=pipeline,
            partition=partition,
            topology=self._topology,
            rank=self.global_rank,
            backend=self._get_process_group_backend(),
            timeout=self.config.timeout,
            device=self.root_device,
            schedule=self.config.schedule,
            num_microbatches=self.num_microbatches,
            optimizers=self.optimizers if fitting else [],
            first_stage_input=stage_zero_input,
            last_stage_loss=self._last_stage_loss,
            before_update=self._before_update,
            before_update_may_write=self._before_update_may_write,
            lr_scale=self.config.lr_scale if fitting else 1.0,
            ties=self.ties,
            checkpoint_layers=self.config.checkpoint_layers(len(pipeline)) if fitting else (),
            microbatch_statistics=self.config.microbatch_statistics,
            # the step's pipeline argument is checked against batch[0] once, unless the module says what stage 0
            # feeds (a pipeline_input hook may draw random numbers: calling it again would change the run)
            step_input=None if callable(getattr(module, "pipeline_input", None)) else stage_zero_input,
            loss_terms=loss_terms_hook(module),
        )
        self._start_replica_split(pipeline, fitting)
        if meta:
            self.model_to_device()  # what is outside the pipeline (the other layers are placeholders now)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._install_callbacks(trainer, fitting)
        self._start_clipping(trainer, fitting)
        rank_zero_info(
            f"DynPipe: {self.num_stages} stages x {self.topology.dp_size} pipeline(s), balance {partition}, "
            f"schedule={self.schedule}, num_microbatches={self.num_microbatches}"
        )
        if fitting:
            rank_zero_info(self.config.describe_updates())

    def _start_clipping(self, trainer: Trainer, fitting: bool) -> None:
        """Under a flush schedule, clipping by norm takes the norm over every stage (:mod:`.clipping`); under
        ``async`` each stage clips by its own, which a fit that clips by norm is told once."""
        self._clipping = None
        if not fitting or self.num_stages < 2 or self.stage is None:
            return
        if self.config.schedule.accumulates:
            if PipelineNormClipping.supports(self.precision_plugin):
                on_device = self._get_process_group_backend() == "nccl"
                stage = self.stage
                self._clipping = PipelineNormClipping(
                    self.precision_plugin,
                    stage.pipeline_collectives,
                    stage.shared_copies_counted_elsewhere,
                    self.root_device if on_device else torch.device("cpu"),
                )
                self._clipping.install()
        elif trainer.gradient_clip_val and (trainer.gradient_clip_algorithm or "norm") == "norm":
            rank_zero_warn(
                f"gradient_clip_val={trainer.gradient_clip_val} clips each stage's gradient by that stage's norm "
                f"under schedule={self.schedule!r}: each stage updates from one micro-batch at its own time, so there "
                f"is no whole-model gradient to take the norm of, and the norm over the {self.num_stages} stages can "
                f"reach sqrt({self.num_stages}) x gradient_clip_val. schedule='sync' clips by the whole model's norm, "
                "as one device does; gradient_clip_algorithm='value' is the same everywhere."
            )

    def _start_replica_split(self, pipeline: nn.Sequential, fitting: bool) -> None:
        """Refuses what an uneven split cannot train exactly; sets the starting split (collective-free)."""
        assert self.stage is not None
        mode, dp = self.config.replica_split_mode, self.topology.dp_size
        self._split, self._pending_split, self._last_shares = None, None, ()
        self._trained_split, self._share_sampler = None, None
        self.stage.weigh_replicas = False
        if mode == "off" or not fitting:
            return
        check_replica_split(pipeline, mode, self.config.replica_weights, dp, self.config.pipeline_attr)
        if dp == 1:
            rank_zero_info(f"DynPipe: replica_split={mode!r} has no effect with one pipeline replica.")
            return
        weights = self.config.replica_weights
        self._split = ReplicaSplit(weights) if weights is not None else ReplicaSplit.even(dp)
        self.stage.weigh_replicas = True
        rank_zero_info(
            f"DynPipe: replica_split={mode!r}: every replica draws the same global batches (the dataloader's "
            f"batch_size) and trains on its share, weights {self._split}; gradients averaged by sample count."
        )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # With a replica split each replica loads only its share of every global batch (engine/shares.py).
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._split is None or trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        rebuilt, sampler, why_not = share_reading_dataloader(dataloader, self.dp_rank, _ReplicaShares(self))
        if sampler is None:
            rank_zero_info(
                f"DynPipe: replica_split: every replica loads the whole global batch and keeps its share: the "
                f"training dataloader cannot be rebuilt to load shares only ({why_not})."
            )
            return dataloader
        self._share_sampler = sampler
        return rebuilt

    def _install_callbacks(self, trainer: Trainer, fitting: bool) -> None:
        """Metrics rebinding and what the strategy adds to the Trainer; for fits the monitor and adaptive loop."""
        assert self.stage is not None
        shard, ties = self.stage.shard, self.ties
        bind_metrics(self._lm, self.stage.groups.stage_dp, self.topology.dp_size)
        self.additions.install(
            trainer,
            device=self.root_device,
            replicas=self.topology.dp_size,
            fitting=fitting,
            summary_of=lambda callbacks: summary.install(callbacks, self._pipeline, shard.offloaded, ties),
            interference=self.config.interference,
            num_stages=self.num_stages,
        )
        if fitting:
            self.adaptation.attach(
                trainer,
                model_cost=self.model_cost,
                comm=self.comm,
                num_stages=self.num_stages,
                replicas=self.topology.dp_size,
            )

    # ------------------------------------------------------------------ live repartitioning
    def repartition(self, balance: list[int] | Partition) -> None:
        """Moves layers between stages at the start of the next training step, without a restart.

        Call it with the same ``balance`` on every rank (from a callback, say); the pipeline drains, the layers
        that change stage travel with their optimizer state, and training resumes. A run that migrates equals
        a run with the same drains and no migration. The pause is recorded in :attr:`migrations`.

        Example::

            class MoveOneLayer(L.Callback):
                def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                    if batch_idx == 100:
                        trainer.strategy.repartition([3, 6])
        """
        if self.partition is None:
            raise ConfigurationError("repartition() needs a running pipeline: call it during fit.")
        new = balance if isinstance(balance, Partition) else Partition.from_balance(balance, self.partition.num_layers)
        plan_moves(self.partition, new)  # validates the shape of the new partition
        self._check_ties(new, self._running_schedule or self.config.schedule)
        self._pending_partition = new

    def reschedule(self, schedule: str | Schedule) -> None:
        """Changes the schedule at the start of the next training step, without a restart.

        Call it with the same schedule on every rank (from a callback, say); the pipeline drains with the current
        schedule and the next steps run with the new one. Between ``"async"`` and ``"async+d"`` this changes how
        many micro-batches are in flight over each boundary (and so the staleness and the weight versions kept);
        the run equals one with a drain there and the new staleness from then on
        (:func:`~lightning_dynpipe.calibration.replay_async` with ``restaleness``); between ``"sync"`` and
        ``"gpipe"`` it changes only the order of a step's forwards and backwards. The change is recorded in
        :attr:`schedule_changes`; it lasts until the fit ends (the next fit starts with the configured schedule).

        Example::

            class HideTheLink(L.Callback):
                def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                    if batch_idx == 100:
                        trainer.strategy.reschedule("async+1")

        Raises:
            ConfigurationError: no running pipeline, an unknown schedule, or a change between a schedule that
                updates after every micro-batch and one that accumulates a step (their updates and ``lr_scale``
                differ: choose that one in the strategy's arguments).
        """
        if self.partition is None or self._running_schedule is None:
            raise ConfigurationError("reschedule() needs a running pipeline: call it during fit.")
        try:
            new = get_schedule(schedule)
        except ScheduleError as exc:
            raise ConfigurationError(f"reschedule(): {exc}") from None
        old = self._pending_schedule or self._running_schedule
        if new.accumulates != old.accumulates:
            raise ConfigurationError(
                f"reschedule() changes how many micro-batches are in flight, not how updates are made: "
                f"{old.name!r} updates {'once per step' if old.accumulates else 'after every micro-batch'}, "
                f"{new.name!r} {'once per step' if new.accumulates else 'after every micro-batch'}. Pass "
                f"schedule={new.name!r} to DynPipeStrategy to train with it."
            )
        self._check_ties(self.partition, new)
        self._pending_schedule = new if new != self._running_schedule else None

    def _check_ties(self, partition: Partition, schedule: Schedule) -> None:
        """The set-up's refusal of parameters shared across stages (:func:`.contract.check_ties`), for a partition
        or a schedule the run is about to change to."""
        trainer = self._lm.trainer
        check_ties(
            self.ties,
            partition,
            schedule=schedule,
            gradient_clip_val=trainer.gradient_clip_val,
            gradient_clip_algorithm=trainer.gradient_clip_algorithm,
            pipeline_attr=self.config.pipeline_attr,
            pipeline_norm_clipping=PipelineNormClipping.supports(self.precision_plugin),
        )

    def _reschedule_now(self, new: Schedule, step: int) -> ScheduleChange:
        """Drains with the running schedule and continues with ``new`` (every rank at the same step)."""
        assert self.stage is not None and self._running_schedule is not None
        t0 = time.perf_counter()
        self.stage.reschedule(new)
        agreed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        record = ScheduleChange(step, self._running_schedule.name, new.name, float(agreed[0]))
        self._running_schedule = new
        self.schedule_changes.append(record)
        self.adaptation.schedule_changed(new)
        rank_zero_info(
            f"DynPipe schedule change at step {step}: {record.old} -> {record.new}, pause {record.pause_s * 1e3:.1f} ms"
        )
        return record

    def _restart(self, num_stages: int, reason: str) -> str | None:
        """The ladder's last rung under ``change_stages="restart"``: checkpoint at the end of this step and end
        the fit (collective: every rank takes the same decision on the same snapshot, inside the same batch hook).
        Returns the checkpoint's path, or None when this fit may not restart (its last allowed one, or done)."""
        trainer = self._lm.trainer
        if not self.restart_allowed or self.restart_plan is not None:
            return None
        step = trainer.global_step
        name = f"step{step}-stages{self.num_stages}-to-{num_stages}"
        suffix = ".ckpt" if self.checkpoint_mode == "full" else ""  # sharded: a directory
        path = os.path.join(trainer.default_root_dir, "dynpipe-restart", name + suffix)
        trainer.save_checkpoint(path)
        trainer.should_stop = True
        self.restart_plan = RestartPlan(num_stages, path, step, self.num_stages, reason)
        rank_zero_info(
            f"DynPipe: ending the fit after step {step} to continue with {num_stages} stages instead of "
            f"{self.num_stages}; checkpoint {path}. fit_with_restarts continues from it; by hand: "
            f"DynPipeStrategy(num_stages={num_stages}, ...) and trainer.fit(..., ckpt_path={path!r})."
        )
        return path

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._pending_split is not None:
            self._split, self._pending_split = self._pending_split, None
        if self._pending_schedule is not None:
            sched, self._pending_schedule = self._pending_schedule, None
            self._reschedule_now(sched, step=self._lm.trainer.global_step)
        if self._pending_partition is not None:
            new, self._pending_partition = self._pending_partition, None
            self._migrate(new, step=self._lm.trainer.global_step)

    def _migrate(self, new: Partition, step: int) -> MigrationRecord:
        """Drains, moves the layers that change stage (collective over each pipeline), rebuilds the stage."""
        stage = self.stage
        assert stage is not None
        t0 = time.perf_counter()
        old = stage.partition
        moves, sent = stage.migrate(new)
        # Every rank must see the same pause: policies use it, and ranks that decide differently deadlock.
        agreed = torch.tensor([time.perf_counter() - t0, float(sent)], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        record = MigrationRecord(step, old, new, tuple(m.layer_idx for m in moves), int(agreed[1]), float(agreed[0]))
        self.migrations.append(record)
        rank_zero_info(
            f"DynPipe repartition at step {step}: {old} -> {new}, moved layers {list(record.moved)}, "
            f"pause {record.pause_s * 1e3:.1f} ms"
        )
        return record

    # ------------------------------------------------------------------ training step take-over
    def _last_stage_loss(self, micro_batch: Any, mb_slot: int) -> Tensor:
        if self.config.microbatch_logging == "step":
            assert self.executor is not None
            weights = self.executor.microbatch_weights
            with self._step_logs.capture(weight=weights[mb_slot], last=mb_slot == len(weights) - 1):
                out = self._lm.training_step(micro_batch, self._batch_idx)
        else:
            out = self._lm.training_step(micro_batch, self._batch_idx)
        loss = out
        if isinstance(out, Mapping):
            loss = out.get("loss")
            if len(out) > 1:  # detached, as Lightning keeps a step's other outputs
                self._step_outputs[mb_slot] = {
                    k: v.detach() if isinstance(v, Tensor) else v for k, v in out.items() if k != "loss"
                }
        if not isinstance(loss, Tensor):
            raise ConfigurationError(
                f"training_step must return the loss (a Tensor, or a dict with key 'loss') on every micro-batch; "
                f"got {type(out).__name__}. DynPipeStrategy cannot skip a micro-batch: the other stages are "
                "already working on it."
            )
        return loss

    def _before_update_may_write(self) -> bool:
        # user code that runs before each update could write the weights in place; Lightning's own clipping only
        # scales gradients
        if self._update_writers is None:
            self._update_writers = _user_code_before_update(self._lm, self.precision_plugin)
        return self._update_writers

    def _before_update(self, optimizer: Optimizer) -> None:
        # on_before_optimizer_step hooks and gradient clipping, on this stage's parameters only.
        if self._update_hooks is None:  # decided at the first update of a fit: the callbacks are known by then
            self._update_hooks = _update_hooks_observed(self._lm, self.precision_plugin)
        if self._update_hooks:
            self.precision_plugin._after_closure(self._lm, optimizer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor | dict[str, Any]:
        """Runs this stage's part of the step. Returns the step's mean loss (what the last stage knows, or the loss
        that travelled upstream) and, on the last stage, what ``training_step`` returned besides the loss, merged
        over the step's micro-batches (:func:`~lightning_dynpipe.engine.microbatch.merge_step_outputs`): what
        ``on_train_batch_end`` receives as ``outputs``."""
        batch = args[0] if args else kwargs["batch"]
        self._batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        assert self.executor is not None and self.stage is not None
        self.stage.check_optimizers()  # a parameter group added since the split (a finetuning callback's)
        check_accumulation(self._lm.trainer.accumulate_grad_batches, during_fit=True)
        self._step_logs.reset()
        self._step_outputs = {}
        if self._split is not None:
            batch = self._replica_share(batch)
        with self.precision_plugin.train_step_context():
            loss = self.executor.train_step(batch)
        mean = torch.tensor(loss if not math.isnan(loss) else self.executor.last_loss, device=self.root_device)
        if not self._step_outputs:
            return mean
        sizes = self.executor.microbatch_sizes  # (kept until the next step starts: it clears them)
        return {"loss": mean, **merge_step_outputs([self._step_outputs.get(i, {}) for i in range(len(sizes))], sizes)}

    def _replica_share(self, batch: Any) -> Any:
        """This replica's share of the global batch in training; records which slice of it the step trains on."""
        assert self._split is not None and self.stage is not None
        d = self.dp_rank
        issued = self._share_sampler.pop() if self._share_sampler is not None else None
        if issued is None:  # the whole global batch was loaded: keep this replica's share
            if self._batch_idx == 0 or not self._last_shares:
                self._check_same_global_batch(batch_fingerprint(batch), "batches")
            split, shares = self._split, self._split.shares(batch_len(batch) or 0, self.num_microbatches)
            issued = IssuedShare(shares, d, split)
            batch = take_share(batch, issued.start, issued.count)
        else:  # the dataloader loaded only this replica's share
            if issued.fingerprint is not None:
                self._check_same_global_batch(issued.fingerprint, "sample indices")
            if batch_len(batch) != issued.count:
                raise RuntimeError(
                    f"The batch of training step {self._batch_idx} holds {batch_len(batch)} samples, but replica {d} "
                    f"drew {issued.count} of its global batch of {issued.total}: the batch does not come from the "
                    "training dataloader's draw in order. Do not fetch training batches outside the training loop."
                )
        if self._trained_split is not None and issued.split != self._trained_split:
            step = self._lm.trainer.global_step
            self.resplits.append((step, self._trained_split, issued.split))
            rank_zero_info(f"DynPipe re-split at step {step}: replica weights {self._trained_split} -> {issued.split}")
        self._trained_split, self._last_shares = issued.split, issued.shares
        self.stage.replica_cover = (d, issued.start, issued.count, issued.total)
        return batch

    def _check_same_global_batch(self, fp: float, what: str) -> None:
        """Refuses replicas that draw different global batches (first step of each pass; one tiny all-reduce).

        The shares of a split cover every sample once only if every replica draws the same global batch; Lightning's
        sampler gives them the same order when every process has the same seed (``PL_GLOBAL_SEED``). ``fp``: this
        replica's fingerprint of the global batch's ``what``.
        """
        assert self.stage is not None
        both = torch.tensor([fp, -fp], dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.stage.groups.stage_dp)
        if both[0].item() != -both[1].item():
            raise ConfigurationError(
                f"replica_split needs every pipeline replica to draw the same global batch, but at batch "
                f"{self._batch_idx} the replicas' {what} differ (checksums between {-both[1].item():.6g} and "
                f"{both[0].item():.6g}). Give every process the same seed (seed_everything(n) before the Trainer) "
                "and a dataloader that does not depend on the rank, or use replica_split=None."
            )

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # The executor already back-propagated every micro-batch; only fire the hooks, once per step.
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self._lm)
        return self.precision_plugin.post_backward(closure_loss, self._lm)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # Lightning's closure must run (it calls training_step); the executor already applied the updates.
        return closure()

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        return True

    def drain(self) -> None:
        """Finishes all in-flight micro-batches (a quiescent point). Collective over the pipeline."""
        if self.executor is not None:
            self.executor.drain()

    # ------------------------------------------------------------------ evaluation
    def _eval(self, hook: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        assert self.executor is not None
        batch = args[0] if args else kwargs["batch"]
        module = self._lm
        with context:
            return self.executor.eval_step(batch, lambda: getattr(module, hook)(*args, **kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval("validation_step", self.precision_plugin.val_step_context(), *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval("test_step", self.precision_plugin.test_step_context(), *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval("predict_step", self.precision_plugin.predict_step_context(), *args, **kwargs)

    @override
    def on_validation_start(self) -> None:
        self.drain()

    @override
    def on_test_start(self) -> None:
        self.drain()

    @override
    def on_predict_start(self) -> None:
        self.drain()

    @override
    def on_train_start(self) -> None:
        # Batch sizes against num_microbatches, from the dataloader, before the first step (the data is set up).
        trainer = self._lm.trainer
        check_batches(
            trainer.train_dataloader,
            num_microbatches=self.num_microbatches,
            num_training_batches=trainer.num_training_batches,
            max_steps=trainer.max_steps,
            replicas=self._split.num_replicas if self._split is not None else 1,
        )
        check_sample_order(trainer.train_dataloader, num_stages=self.num_stages)
        if self.additions.sigterm is not None:  # Lightning's handlers are installed by now
            quiet_sigterm_handler(trainer)

    @override
    def on_train_end(self) -> None:
        self.drain()
        if self.additions.sigterm is not None:  # the last batch's SIGTERM flag, still in flight
            self.additions.sigterm.finish()

    # ------------------------------------------------------------------ collectives used by user code
    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        # User logging code runs on one stage only, so the default group is that stage's replicas.
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None:
            if self.stage is None or self.topology.dp_size == 1:
                return tensor
            group = self.stage.groups.stage_dp
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if group is None and self.stage is not None:
            group = self.stage.groups.stage_dp
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # The last stage (global rank 0) is authoritative: the monitored metrics are computed there.
        t = torch.tensor(int(decision), device=self.root_device)
        if self.stage is not None and self.topology.dp_size > 1 and self.is_last_stage:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.stage.groups.last_stage_dp)
            dp = self.topology.dp_size
            t = torch.tensor(int(t.item() == dp) if all else int(t.item() > 0), device=self.root_device)
        if self.world_size > 1:
            dist.broadcast(t, src=0)
        return bool(t.item())

    # ------------------------------------------------------------------ partition-independent state
    def _refuse_if_left_sharded(self, what: str) -> None:
        placeholders = [i for i, m in enumerate(self._pipeline()) if isinstance(m, Placeholder)]
        if self.stage is None and placeholders:
            raise ConfigurationError(
                f"This process's LightningModule holds only one stage's layers (layers {placeholders} are "
                f"placeholders): the previous run ended with gather_after_fit=False, so it cannot {what}. Load the "
                "full model from the run's checkpoint (a sharded one: lightning_dynpipe.engine.sharded.consolidate), "
                "or keep gather_after_fit=True."
            )

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # A sharded checkpoint is read stage by stage, into the layers the stage owns: after partitioning.
        return self.config.checkpoint == "sharded"

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.stage is None:
            self._refuse_if_left_sharded("write the whole model's state_dict")
        if self.stage is not None and self.config.checkpoint == "sharded":
            self.drain()
            return self._lm.state_dict()  # this stage's layers only; save_checkpoint writes them as they are
        if self.stage is None or self.num_stages == 1:
            return super().lightning_module_state_dict()
        self.drain()
        layers = self.stage.layer_states(root=0)
        if self.global_rank != 0:
            return {}
        prefix = self.config.pipeline_attr + "."
        return checkpoint.full_state_dict(self._lm.state_dict(), layers, prefix, self._full_keys, self.ties)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.stage is None or self.stage.slots is None:
            return super().optimizer_state(optimizer)
        self.drain()
        if self.config.checkpoint == "sharded":
            return self.stage.optimizer_shard(optimizer)
        return self.stage.optimizer_state(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint_: Mapping[str, Any]) -> None:
        if self.stage is None or self.stage.slots is None:
            return super().load_optimizer_state_dict(checkpoint_)
        self.stage.load_optimizer_states(checkpoint_["optimizer_states"])
        _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def load_model_state_dict(self, checkpoint_: Mapping[str, Any], strict: bool = True) -> None:
        if self.stage is None:
            return super().load_model_state_dict(checkpoint_, strict=strict)
        prefix = self.config.pipeline_attr + "."
        state = checkpoint_["state_dict"]
        if strict and not self._loaded_sharded:
            # A whole checkpoint read after partitioning: the rule of a strict load_state_dict, on the whole model
            # (each stage then takes its part; a sharded checkpoint's keys were checked when it was read).
            missing = [k for k in self._full_keys if k not in state]
            unexpected = [k for k in state if k not in set(self._full_keys)]
            if missing or unexpected:
                raise ConfigurationError(
                    f"The checkpoint does not hold this model's weights: missing keys {missing[:5]}, unexpected keys "
                    f"{unexpected[:5]}. Load it into the model that wrote it (or set "
                    "LightningModule.strict_loading = False to load what matches)."
                )
        owned = checkpoint.owned_state_dict(state, prefix, self.stage.shard.owned)
        self._lm.load_state_dict(owned, strict=False)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.partition is not None:
            checkpoint["dynpipe"] = {
                "version": 1,
                "num_stages": self.num_stages,
                "balance": list(self.partition.balance),
                "schedule": self.schedule,
                "num_microbatches": self.num_microbatches,
            }
        if self.stage is not None and self.config.checkpoint == "sharded":
            self._save_sharded(checkpoint, self.broadcast(filepath))
            return
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _save_sharded(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """Every rank of the first pipeline writes its stage's entries (collective over WORLD; no gathering)."""
        stage = self.stage
        assert stage is not None
        prefix = self.config.pipeline_attr + "."
        aliases = sharded.tie_aliases(self.ties, prefix)
        entries: dict[str, Any] = {}
        if stage.dp_rank == 0:  # the other replicas hold the same state
            entries.update(
                sharded.local_model_entries(
                    checkpoint["state_dict"], prefix, stage.shard.owned, aliases, outside=self.global_rank == 0
                )
            )
            for o, opt_state in enumerate(checkpoint.get("optimizer_states", [])):
                entries.update(sharded.local_optimizer_entries(o, opt_state))
        if self.global_rank == 0:
            rest = {k: (None if k == "state_dict" else v) for k, v in checkpoint.items()}
            if "optimizer_states" in rest:
                rest["optimizer_states"] = [{"param_groups": o["param_groups"]} for o in checkpoint["optimizer_states"]]
            rest["dynpipe"] = {**(rest.get("dynpipe") or {}), "format": "sharded", "aliases": aliases,
                               "key_order": list(self._full_keys)}  # fmt: skip
            entries[sharded.REST] = rest
        sharded.save(entries, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self._loaded_sharded = self.stage is not None and sharded.is_sharded_checkpoint(checkpoint_path)
        if not sharded.is_sharded_checkpoint(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if self.stage is None:  # checkpoint="full" restores before set-up, into the whole model: read it all
            return sharded.consolidate(checkpoint_path)
        prefix = self.config.pipeline_attr + "."
        slots = self.stage.slots
        return sharded.load_stage(
            checkpoint_path,
            targets=self._lm.state_dict(),
            prefix=prefix,
            aliases=sharded.tie_aliases(self.ties, prefix),
            expected_keys=self._full_keys,
            wanted=[{c for g in canon for c in g} for canon in slots.canonical] if slots is not None else [],
        )

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Tell the other stages at once, so they end with an error naming this stage instead of waiting.
        # (Not on Ctrl-C: Lightning's launcher kills the other processes itself.)
        if self.stage is not None and not isinstance(exception, KeyboardInterrupt):
            # An error here may be the consequence of another stage's failure: a collective of Lightning's (the
            # metrics mirror, the sigterm broadcast) breaks when that stage's process ends. Its ABORT then already
            # sits in a receive channel: say so on this rank's traceback, and pass it on instead of claiming it.
            known = self.stage.failure.failure
            if known is None and _lost_connection(exception):
                known = self.stage.executor.channels.arrived_failure()
            if known is not None and not isinstance(exception, PeerFailure) and known.rank != self.global_rank:
                self.stage.failure.relay(known)
                _note(exception, f"DynPipe: this error followed another stage's failure. {known}")
            else:
                self.stage.failure.local_failure(exception)
            # the launching process ends with its traceback and exit code 1, not Lightning's SIGKILL
            _let_the_launching_process_fail(getattr(self._launcher, "procs", None) or [])
        super().on_exception(exception)

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        if self.stage is not None:
            # puts the whole model back into the user's module unless interrupted or told not to
            self.stage.close(interrupted, gather=self.config.gather_after_fit)
            if not interrupted and not self.config.gather_after_fit and self.num_stages > 1:
                rank_zero_info(
                    "DynPipe: gather_after_fit=False, so each process's LightningModule keeps its stage's layers "
                    "only. Load the whole model from the checkpoint."
                )
            if interrupted:
                rank_zero_warn(
                    "Training was interrupted: the LightningModule in this process keeps only this stage's layers "
                    "(other layers are placeholders). Load the last checkpoint for the full model."
                )
        if self._clipping is not None:
            self._clipping.remove()
            self._clipping = None
        self.additions.remove(trainer, self.lightning_module)
        self.adaptation.detach(trainer)
        self.stage = None
        self._split = self._pending_split = self._trained_split = None
        self._share_sampler = None
        self._planned_num_stages = None
        self._topology = None
        module = self.lightning_module
        if module is None or not is_on_meta(module):
            super().teardown()
            return
        # A run refused or failed before a model built on meta was materialised: Lightning's teardown moves the
        # module to the CPU, which raises for meta tensors and would hide the real error. Move what has memory.
        module.cpu = lambda: module._apply(lambda t: t if t.is_meta else t.cpu())  # type: ignore[method-assign]
        try:
            super().teardown()
        finally:
            del module.cpu

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        entries = [("dynpipe", "popen"), ("dynpipe_spawn", "spawn"), ("dynpipe_fork", "fork")]
        for name, method in entries:
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=f"DynPipe pipeline parallelism ({method} launcher)", start_method=method
                )
        # A bare class path on the command line (--trainer.strategy=lightning_dynpipe.DynPipeStrategy) reaches
        # the registry lower-cased.
        for alias in (
            "lightning_dynpipe.dynpipestrategy",
            "lightning_dynpipe.strategy.dynpipestrategy",
            "lightning_dynpipe.strategy.dynpipe.dynpipestrategy",
            "dynpipestrategy",
        ):
            if alias not in strategy_registry:
                strategy_registry.register(alias, cls, description="DynPipe pipeline parallelism")

    @override
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["stage"] = None  # process groups and threads do not travel
        return state


class _ReplicaShares:
    """The strategy as the :class:`~lightning_dynpipe.engine.shares.ShareSource` of its training dataloader."""

    def __init__(self, strategy: DynPipeStrategy) -> None:
        self._strategy = strategy

    def reads_shares(self, sampler: ShareBatchSampler) -> bool:
        # Only the sole training dataloader, as the loop holds it: with several (a CombinedLoader) every replica
        # loads whole batches and keeps its share of each, as before.
        s = self._strategy
        module = s.lightning_module
        if s._split is None or module is None or sampler is not s._share_sampler:
            return False
        current = module.trainer.train_dataloader
        return getattr(current, "batch_sampler", None) is sampler

    def next_shares(self, batch_size: int) -> tuple[tuple[int, ...], ReplicaSplit]:
        s = self._strategy
        split = s._pending_split or s._split
        assert split is not None
        return split.shares(batch_size, s.num_microbatches), split


def _lost_connection(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective's error for a peer process that went away (gloo's and NCCL's words)."""
    text = str(exception).lower()
    return isinstance(exception, RuntimeError) and any(
        words in text for words in ("connection closed", "connection reset", "broken pipe", "remote process exited")
    )


def _note(exception: BaseException, text: str) -> None:
    """Adds ``text`` to the traceback ``exception`` will print (Python >= 3.11; logged on older versions)."""
    if hasattr(exception, "add_note"):
        exception.add_note(text)
    else:
        log.error(text)


def _user_code_before_update(module: LightningModule, precision: Precision) -> bool:
    """Whether code other than Lightning's own runs before each optimizer update: an overridden
    ``on_before_optimizer_step`` (module or callback) or ``configure_gradient_clipping``, or a precision plugin's
    own ``_after_closure``. Such code could write the weights in place, so the weight stash copies them before it
    runs instead of letting the update write fresh storage (:mod:`~lightning_dynpipe.engine.outofplace`).
    """
    trainer = module.trainer
    return (
        type(precision)._after_closure is not Precision._after_closure
        or is_overridden("configure_gradient_clipping", module, LightningModule)
        or is_overridden("on_before_optimizer_step", module, LightningModule)
        or any(is_overridden("on_before_optimizer_step", cb, Callback) for cb in getattr(trainer, "callbacks", []))
    )


def _update_hooks_observed(module: LightningModule, precision: Precision) -> bool:
    """Whether anything observes what Lightning runs before each optimizer update (so it must run every time).

    That is the callbacks' and the module's ``on_before_optimizer_step``, ``configure_gradient_clipping`` and the
    clipping of ``gradient_clip_val``, and a precision plugin's own ``_after_closure``. ``async`` updates ``M`` times
    per step, and dispatching those hooks when nothing overrides them cost about 0.1 ms per update
    (``benchmarks/profile_step.py``).
    """
    return module.trainer.gradient_clip_val is not None or _user_code_before_update(module, precision)
