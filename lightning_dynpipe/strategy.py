"""DynPipeStrategy: asynchronous pipeline-parallel training inside Lightning's Trainer.

This module is the only heavy coupling to Lightning. It partitions the LightningModule's ``nn.Sequential``
pipeline, builds one :class:`~lightning_dynpipe.engine.executor.StageExecutor` per rank, takes over the
training step (micro-batching, per-micro-batch updates, weight stashing), routes evaluation through the
pipeline, and keeps checkpoints partition-independent.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available, _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor, nn
from torch.distributed import ReduceOp
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dynpipe.adaptive import AdaptiveController, StageTimes
from lightning_dynpipe.engine.executor import StageChannels, StageExecutor, _batch_len, split_microbatches
from lightning_dynpipe.engine.groups import (
    PipelineGroups,
    build_channels,
    build_groups,
    destroy_default_group_at_exit,
)
from lightning_dynpipe.engine.p2p import FailureHandler
from lightning_dynpipe.engine.topology import PipelineTopology
from lightning_dynpipe.errors import ConfigurationError, PartitionError
from lightning_dynpipe.interference.schedule import InterferenceSchedule
from lightning_dynpipe.monitor.callback import StageMonitor
from lightning_dynpipe.monitor.stats import PipelineSnapshot
from lightning_dynpipe.plan.auto import best_plan
from lightning_dynpipe.plan.convergence import ConvergenceModel
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition, balance_by_weights
from lightning_dynpipe.plan.solver import Plan
from lightning_dynpipe.repartition.migrate import recv_layer, send_layer
from lightning_dynpipe.repartition.plan import plan_moves
from lightning_dynpipe.repartition.policy import GainOverCostPolicy, RepartitionPolicy
from lightning_dynpipe.schedule import SCHEDULES
from lightning_dynpipe.summary import install as install_whole_pipeline_summary
from lightning_dynpipe.summary import uninstall as uninstall_whole_pipeline_summary

__all__ = ["DynPipeStrategy", "MigrationRecord"]

log = logging.getLogger(__name__)

_DEFAULT_TIMEOUT = timedelta(minutes=30)
_MIN_SAMPLES = 5  # steps of a monitor window the adaptive loop needs before it decides


def _batch_len_or_one(x: Any) -> int:
    n = _batch_len(x)
    return n if n is not None and n > 0 else 1


@dataclass(frozen=True)
class MigrationRecord:
    """One live repartition: when, from which partition to which, what moved and how long training paused."""

    step: int
    old: Partition
    new: Partition
    moved: tuple[int, ...]
    bytes_sent: int
    pause_s: float


class _Placeholder(nn.Module):
    """Stands in for a layer that another stage owns."""

    def __init__(self, layer_idx: int, stage_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.owner_stage = stage_idx

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"Layer {self.layer_idx} of the pipeline lives on stage {self.owner_stage}, not on this process. Under "
            "DynPipeStrategy call the whole pipeline once (self.pipeline(x)) from a *_step method; single layers "
            "cannot be called during fit/validate/test/predict."
        )

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, owner_stage={self.owner_stage}"


_SYNC_DIST_ADVICE = r"It is recommended to use `self\.log\(.*sync_dist=True\)`"


def _silence_sync_dist_advice() -> Any:
    """Hides Lightning's advice to pass ``sync_dist=True`` for epoch-level logs; returns the filter entry.

    Lightning gives it whenever a process group exists. With one pipeline, only the last stage logs, and
    :meth:`DynPipeStrategy.reduce` has nothing to reduce over, so the advice does not apply. With pipeline
    replicas it does (the last stages' replicas see different data), and the strategy leaves it alone.
    """
    warnings.filterwarnings("ignore", message=_SYNC_DIST_ADVICE, category=PossibleUserWarning)
    return warnings.filters[0]


def _restore_sync_dist_advice(entry: Any) -> None:
    """Removes a filter installed by :func:`_silence_sync_dist_advice` (no-op if it is already gone)."""
    filters = cast(list[Any], warnings.filters)
    if entry in filters:
        filters.remove(entry)
        mutated = getattr(warnings, "_filters_mutated", None)  # invalidates the registries' cached decisions
        if mutated is not None:
            mutated()


class _MetricsMirror(Callback):
    """Copies the last stage's ``callback_metrics`` to every rank before monitoring callbacks read them.

    The user's steps run on the last stage only (global rank 0 of each pipeline), so ModelCheckpoint,
    EarlyStopping and ReduceLROnPlateau on the other ranks would not see the monitored values otherwise.
    """

    def __init__(self, strategy: DynPipeStrategy) -> None:
        self._strategy = strategy

    def _mirror(self, trainer: Trainer) -> None:
        if trainer.world_size == 1 or not dist.is_initialized():
            return
        payload: list[Any] = [None]
        if trainer.is_global_zero:
            payload[0] = {
                k: (v.detach().cpu() if isinstance(v, Tensor) else v) for k, v in trainer.callback_metrics.items()
            }
        dist.broadcast_object_list(payload, src=0)
        if not trainer.is_global_zero:
            device = self._strategy.root_device
            trainer._logger_connector._callback_metrics.update(
                {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in payload[0].items()}
            )

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._mirror(trainer)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mirror(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mirror(trainer)


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
    stage ``k``; ``"sync"`` and ``"gpipe"`` accumulate the gradients of the ``M`` micro-batches and update once
    per step, exactly like single-device training on the whole batch.

    Args:
        num_stages: number of pipeline stages ``S``; default: all devices of a node, one stage each. With more
            processes than stages, ``world_size / S`` pipeline replicas train data-parallel. ``"auto"``: the
            planner chooses ``S`` among the divisors of the process count (needs ``balance="auto"``).
        num_microbatches: micro-batches ``M`` each Lightning batch is split into (along dim 0).
        schedule: ``"async"`` (default), ``"sync"`` or ``"gpipe"``.
        balance: layers per stage, e.g. ``[5, 3]``; ``"auto"`` (default): profile the layers on a sample
            micro-batch, probe the link between ranks 0 and 1, and let the time-to-accuracy planner choose the
            partition (and, with ``num_stages="auto"``, the number of stages); ``"parameters"``: balance by
            parameter count.
            Evaluation-only runs (validate/test/predict) balance by parameter count unless a list is given.
        convergence: the planner's staleness model (iterations to accuracy vs. staleness); default
            :class:`~lightning_dynpipe.plan.convergence.ConvergenceModel` with its default ``beta``.
        adaptive: runtime adaptation: ``True`` (default) uses
            :class:`~lightning_dynpipe.repartition.policy.GainOverCostPolicy`; pass a
            :class:`~lightning_dynpipe.repartition.policy.RepartitionPolicy` to decide differently, or ``False``
            to keep the partition fixed. Every ``monitor_every_n_steps`` the stage statistics are gathered, each
            stage's slowdown is measured, the planner re-solves, and the policy decides whether to migrate.
        monitor_every_n_steps: how often stage statistics are gathered (one small collective) and logged as
            ``dynpipe/stage{k}/...``; ``None``: no stage monitor (and so no adaptation).
        interference: a declarative interference schedule for tests, benchmarks and what-if runs (a list of
            entries or the path of a YAML file; see :mod:`lightning_dynpipe.interference`), e.g.
            ``[{"kind": "cpu_hog", "stage": 0, "start_step": 100}]``.
        pipeline_attr: attribute of the LightningModule holding the ``nn.Sequential`` (dotted paths allowed).
        start_method: how processes are launched: ``"popen"`` (default; scripts, CLI, torchrun, SLURM),
            ``"spawn"`` (tests) or ``"fork"`` (notebooks).
        timeout: how long collectives and stage-to-stage receives may wait (seconds or a ``timedelta``);
            default 30 minutes.
        process_group_backend: ``"gloo"`` / ``"nccl"``; default: chosen from the device.
        cluster_environment: Lightning's cluster environment plugin.
        checkpoint_io: Lightning's checkpoint IO plugin.
        precision_plugin: Lightning's precision plugin.
    """

    strategy_name = "dynpipe"

    def __init__(
        self,
        *,
        num_stages: int | Literal["auto"] | None = None,
        num_microbatches: int = 4,
        schedule: Literal["async", "sync", "gpipe"] = "async",
        balance: list[int] | Literal["auto", "parameters"] = "auto",
        convergence: ConvergenceModel | None = None,
        adaptive: bool | RepartitionPolicy = True,
        monitor_every_n_steps: int | None = 10,
        interference: list[dict[str, Any]] | str | None = None,
        pipeline_attr: str = "pipeline",
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        timeout: float | timedelta | None = None,
        process_group_backend: str | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ConfigurationError(f"schedule must be one of {list(SCHEDULES)}; got {schedule!r}.")
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ConfigurationError(
                f"num_microbatches must be a positive integer; got {num_microbatches!r}. Use e.g. num_microbatches=4."
            )
        if num_stages is not None and num_stages != "auto" and (not isinstance(num_stages, int) or num_stages < 1):
            raise ConfigurationError(f"num_stages must be a positive integer, 'auto' or None; got {num_stages!r}.")
        if num_stages == "auto" and balance != "auto":
            raise ConfigurationError(
                f"num_stages='auto' lets the planner choose the number of stages, which needs balance='auto'; got "
                f"balance={balance!r}. Use balance='auto' or give num_stages as a number."
            )
        if isinstance(balance, str):
            if balance not in ("auto", "parameters"):
                raise ConfigurationError(
                    f"balance must be a list of layers per stage, 'auto' or 'parameters'; got {balance!r}."
                )
        else:
            Partition.from_balance(balance)  # validates entries early, before any process starts
            if isinstance(num_stages, int) and len(balance) != num_stages:
                raise PartitionError(
                    f"balance has {len(balance)} entries but num_stages={num_stages}; give one entry per stage."
                )
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=float(timeout))
        super().__init__(
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout or _DEFAULT_TIMEOUT,
            start_method=start_method,
        )
        self._stages_auto = num_stages == "auto"
        self._requested_num_stages: int | None = num_stages if isinstance(num_stages, int) else None
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self._balance: list[int] | None = list(balance) if not isinstance(balance, str) else None
        self.balance_mode: str = "list" if self._balance is not None else str(balance)
        self.convergence = convergence
        if monitor_every_n_steps is not None and monitor_every_n_steps < 1:
            raise ConfigurationError(f"monitor_every_n_steps must be >= 1 or None; got {monitor_every_n_steps}.")
        if monitor_every_n_steps is None and adaptive is not False:
            raise ConfigurationError(
                "Runtime adaptation needs the stage monitor's measurements, but monitor_every_n_steps=None turns "
                "it off. Pass adaptive=False with monitor_every_n_steps=None, or keep the monitor on."
            )
        self.monitor_every_n_steps = monitor_every_n_steps
        self.interference = InterferenceSchedule.from_config(interference) if interference is not None else None
        self._interference_cb: Callback | None = None
        self.adaptive_policy: RepartitionPolicy | None = (
            GainOverCostPolicy() if adaptive is True else (adaptive if adaptive is not False else None)
        )
        self.model_cost: ModelCost | None = None  # per-layer costs from the set-up profile (every rank)
        self.monitor: StageMonitor | None = None
        self._own_monitor: StageMonitor | None = None
        self.controller: AdaptiveController | None = None
        self.comm: CommModel = CommModel()
        self.plan: Plan | None = None  # the planner's choice (rank 0 holds the full object)
        self.plan_table: str | None = None
        self._planned_num_stages: int | None = None
        self.pipeline_attr = pipeline_attr
        self._topology: PipelineTopology | None = None
        self._groups: PipelineGroups | None = None
        self.partition: Partition | None = None
        self.executor: StageExecutor | None = None
        self._offloaded: dict[int, nn.Module] = {}
        self._summaries: list[Any] = []  # ModelSummary callbacks told to summarise the whole pipeline
        self._owned: list[int] = []
        self._full_keys: list[str] = []
        self._canonical: list[list[list[int]]] = []  # [optimizer][group] -> canonical index of each local param
        self._param_slots: list[dict[tuple[int, str], tuple[int, int]]] = []  # (layer, name) -> (group, canonical)
        self._pending_partition: Partition | None = None
        self.migrations: list[MigrationRecord] = []
        self._full_group_sizes: list[list[int]] = []
        self._mirror: _MetricsMirror | None = None
        self._sync_dist_filter: Any = None
        self._failure: FailureHandler | None = None
        self._batch_idx = 0

    # ------------------------------------------------------------------ topology
    @property
    def _lm(self) -> LightningModule:
        module = self.lightning_module
        if module is None:
            raise RuntimeError("DynPipeStrategy has no LightningModule attached yet (call trainer.fit/validate first).")
        return module

    @property
    def num_stages(self) -> int:
        """``S``: stages per pipeline."""
        if self._planned_num_stages is not None:
            return self._planned_num_stages
        if self._requested_num_stages is not None:
            return self._requested_num_stages
        if self._balance is not None:
            return len(self._balance)
        return max(1, self.num_processes)

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
        # Shard data across pipelines only: every stage of a pipeline must see the same batches.
        return {"num_replicas": self.topology.dp_size, "rank": self.dp_rank}

    @property
    def _timeout_s(self) -> float:
        return float(self._timeout.total_seconds()) if self._timeout is not None else 1800.0

    @override
    def _configure_launcher(self) -> None:
        # Checked at Trainer construction, before any process is launched (and again in each launched process).
        if not self._stages_auto:
            PipelineTopology(self.num_stages, self.num_nodes * self.num_processes)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        # Refusals run before the process group exists, so a bad configuration fails fast on every rank.
        module = self.lightning_module
        if module is not None and module._trainer is not None:
            self._check_model(module._trainer)
        super().setup_environment()
        self._topology = None
        self._planned_num_stages = None

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        # Lightning destroys the default group at exit only for NCCL; a gloo group left alive aborts the process.
        destroy_default_group_at_exit()

    # ------------------------------------------------------------------ set-up
    def _pipeline(self, module: LightningModule | None = None) -> nn.Sequential:
        module = module if module is not None else self.lightning_module
        obj: Any = module
        for part in self.pipeline_attr.split("."):
            if not hasattr(obj, part):
                raise ConfigurationError(
                    f"DynPipeStrategy needs the model's layers in `{type(module).__name__}.{self.pipeline_attr}`, an "
                    f"nn.Sequential, but `{part}` does not exist. Put your layers in `self.{self.pipeline_attr} = "
                    "nn.Sequential(...)` or pass DynPipeStrategy(pipeline_attr=...) naming where they are."
                )
            obj = getattr(obj, part)
        if not isinstance(obj, nn.Sequential):
            raise ConfigurationError(
                f"`{self.pipeline_attr}` must be an nn.Sequential whose elements are the pipeline's layers; got "
                f"{type(obj).__name__}. Wrap your layers: `self.{self.pipeline_attr} = nn.Sequential(...)`."
            )
        return obj

    def _check_model(self, trainer: Trainer) -> nn.Sequential:
        module = self.lightning_module
        assert module is not None
        pipeline = self._pipeline(module)
        if trainer.state.fn == TrainerFn.FITTING:
            if not module.automatic_optimization:
                raise ConfigurationError(
                    "DynPipeStrategy runs the optimizer itself (one update per micro-batch on each stage), so "
                    "manual optimization (automatic_optimization=False) is not supported. Remove "
                    "`self.automatic_optimization = False` and return the loss from training_step."
                )
            if trainer.accumulate_grad_batches != 1:
                raise ConfigurationError(
                    f"accumulate_grad_batches={trainer.accumulate_grad_batches} is not supported by DynPipeStrategy: "
                    "the pipeline already splits each batch. Use DynPipeStrategy(num_microbatches=N) with "
                    "schedule='sync' to accumulate gradients over N micro-batches, and accumulate_grad_batches=1."
                )
        if trainer.state.fn == TrainerFn.FITTING and is_param_in_hook_signature(
            module.training_step, "dataloader_iter", explicit=True
        ):
            raise ConfigurationError(
                "training_step(dataloader_iter) is not supported by DynPipeStrategy: the pipeline splits each batch "
                "into micro-batches itself. Use training_step(self, batch, batch_idx)."
            )
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise ConfigurationError(
                f"precision={self.precision_plugin.precision!r} uses a GradScaler, whose single scale cannot follow "
                "per-stage, per-micro-batch updates. Use precision='bf16-mixed' (no scaler), 'bf16-true' or "
                "'32-true' with DynPipeStrategy."
            )
        if type(self.precision_plugin).__name__ in ("TransformerEnginePrecision", "BitsandbytesPrecision"):
            raise ConfigurationError(
                f"{type(self.precision_plugin).__name__} is not supported by DynPipeStrategy; use precision="
                "'bf16-mixed', 'bf16-true' or '32-true'."
            )
        if self._layer_sync is not None:
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
        pipeline_params = {id(p) for p in pipeline.parameters()}
        outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in pipeline_params]
        if outside:
            raise ConfigurationError(
                f"All trainable parameters must live in `{self.pipeline_attr}`, but {outside[:5]} "
                f"{'(and more) ' if len(outside) > 5 else ''}are outside it. Move those modules into the "
                "nn.Sequential or freeze them (requires_grad=False)."
            )
        if self._balance is not None:
            Partition.from_balance(self._balance, len(pipeline))
        if not self._stages_auto and self.num_stages > len(pipeline):
            raise PartitionError(
                f"Cannot run {self.num_stages} stages on a pipeline of {len(pipeline)} layers: every stage needs at "
                f"least one layer. Use num_stages <= {len(pipeline)} (or fewer devices), or split the model into "
                "more layers."
            )
        return pipeline

    def _choose_partition(self, trainer: Trainer, pipeline: nn.Sequential) -> Partition:
        """The partition for this run.

        When fitting with ``balance="auto"`` or with adaptation on, rank 0 profiles the layers on a sample
        micro-batch (and plans, for ``"auto"``); the per-layer costs, the measured link and the decision are
        broadcast so that every rank holds the same :attr:`model_cost` and :attr:`comm` for re-planning.
        """
        world = self.num_nodes * self.num_processes
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and (self.balance_mode == "auto" or self.adaptive_policy is not None):
            comm = self._probe_link()
            decision: list[Any] = [None]
            if self.global_rank == 0:
                try:
                    cost = self._profile(trainer, pipeline)
                    balance, table = self._balance, None
                    if self.balance_mode == "auto":
                        self.plan = self._plan(cost, comm, world)
                        balance, table = list(self.plan.partition.balance), self.plan.table()
                    decision[0] = (balance, table, cost.to_arrays(), (comm.latency_s, comm.bandwidth_Bps), None)
                except Exception as exc:  # the run must not die because a heuristic failed; say why
                    decision[0] = (self._balance, None, None, None, f"{type(exc).__name__}: {exc}")
            if world > 1:
                dist.broadcast_object_list(decision, src=0)
            balance, table, arrays, link, error = decision[0]
            if arrays is not None:
                self.model_cost = ModelCost.from_arrays(**arrays)
                self.comm = CommModel(latency_s=link[0], bandwidth_Bps=link[1])
            if error is not None:
                rank_zero_warn(
                    f"DynPipe could not profile/plan this run ({error}); "
                    f"{'balancing by parameter count' if balance is None else 'using the given balance'}"
                    f"{' and not adapting' if self.adaptive_policy is not None else ''}."
                )
            if table is not None:
                self.plan_table = table
                rank_zero_info(f"DynPipe plan (balance='auto'):\n{table}")
            if balance is not None:
                return Partition.from_balance(balance, len(pipeline))
        if self._balance is not None:
            return Partition.from_balance(self._balance, len(pipeline))
        weights = [sum(p.numel() for p in layer.parameters()) for layer in pipeline]
        return balance_by_weights(weights, self.num_stages)

    def _probe_link(self) -> CommModel:
        """Latency and bandwidth between global ranks 0 and 1 (collective: every rank joins the group)."""
        world = self.num_nodes * self.num_processes
        if world == 1:
            return CommModel()
        from lightning_dynpipe.engine.probe import probe_p2p

        group = dist.new_group([0, 1], timeout=self._timeout or _DEFAULT_TIMEOUT)
        try:
            if self.global_rank in (0, 1):
                # device=None: the probe picks what the backend can send (CPU tensors for gloo)
                return probe_p2p(group, 1 - self.global_rank, initiator=self.global_rank == 0)
            return CommModel()
        finally:
            if self.global_rank in (0, 1):
                dist.destroy_process_group(group)

    def _profile(self, trainer: Trainer, pipeline: nn.Sequential) -> ModelCost:
        """Per-layer costs measured on one micro-batch of the first training batch (rank 0 only)."""
        from lightning_dynpipe.profiling import optimizer_state_factor, profile_layers

        factor = optimizer_state_factor(self.optimizers[0]) if self.optimizers else 0.0
        profile = profile_layers(
            pipeline,
            self._sample_microbatch(trainer),
            device=self.root_device,
            optimizer_state_bytes_per_param_byte=factor,
        )
        return profile.to_model_cost()

    def _plan(self, cost: ModelCost, comm: CommModel, world: int) -> Plan:
        """The time-to-accuracy plan for this run."""
        schedule: Literal["async", "sync"] = "async" if self.schedule == "async" else "sync"
        num_stages = None if self._stages_auto else self.num_stages
        return best_plan(
            cost,
            world,
            num_stages=num_stages,
            schedule=schedule,
            convergence=self.convergence,
            comm=comm,
            num_microbatches=self.num_microbatches,
        )

    def _sample_microbatch(self, trainer: Trainer) -> Any:
        """Stage 0's input for one micro-batch of the first training batch."""
        loader = trainer.fit_loop._data_source.dataloader()
        batch = self.batch_to_device(next(iter(cast(Any, loader))))
        module = self._lm
        user_input = getattr(module, "pipeline_input", None)
        x = user_input(batch) if callable(user_input) else (batch[0] if isinstance(batch, (tuple, list)) else batch)
        micro, _ = split_microbatches(x, min(self.num_microbatches, _batch_len_or_one(x)))
        return micro[0]

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        pipeline = self._pipeline()  # the refusals ran in setup_environment, before the process group
        self.accelerator.setup(trainer)
        assert self.model is not None
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._full_keys = list(self._lm.state_dict().keys())
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
            if len(self.optimizers) > 1:
                raise ConfigurationError(
                    f"configure_optimizers returned {len(self.optimizers)} optimizers; DynPipeStrategy supports "
                    "one (with any number of parameter groups). Use parameter groups instead."
                )
        self.partition = self._choose_partition(trainer, pipeline)
        self._planned_num_stages = self.partition.num_stages
        self._topology = PipelineTopology(self.partition.num_stages, self.num_nodes * self.num_processes)
        self._groups = build_groups(
            self._topology, self.global_rank, self._get_process_group_backend(), self._timeout or _DEFAULT_TIMEOUT
        )
        if fitting:
            self._record_param_slots(pipeline)  # before partitioning: offloading may replace Parameter objects
        self._partition_module(pipeline)
        if fitting:
            self._refilter_optimizers()
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._bind_metrics()
        if self.topology.dp_size == 1 and self._sync_dist_filter is None:
            self._sync_dist_filter = _silence_sync_dist_advice()
        if self._mirror is None:
            self._mirror = _MetricsMirror(self)
            cast(Any, trainer).callbacks.insert(0, self._mirror)
        if fitting:
            self._attach_monitor(trainer)
            if not self._summaries:
                self._summaries = install_whole_pipeline_summary(
                    cast(Any, trainer).callbacks, self._pipeline, self._offloaded
                )
            if self.interference is not None and self._interference_cb is None:
                from lightning_dynpipe.interference.callback import InterferenceCallback

                self.interference.validate(self.num_stages)
                self._interference_cb = InterferenceCallback(self.interference)
                cast(Any, trainer).callbacks.append(self._interference_cb)
        self._build_executor(pipeline)
        rank_zero_info(
            f"DynPipe: {self.num_stages} stages x {self.topology.dp_size} pipeline(s), balance {self.partition}, "
            f"schedule={self.schedule}, num_microbatches={self.num_microbatches}"
        )

    def _partition_module(self, pipeline: nn.Sequential) -> None:
        assert self.partition is not None
        owned = list(self.partition.stage_layers(self.stage_idx))
        self._owned = owned
        for layer_idx in range(len(pipeline)):
            if layer_idx in owned:
                continue
            layer = pipeline[layer_idx]
            layer.to("meta")
            self._offloaded[layer_idx] = layer
            pipeline[layer_idx] = _Placeholder(layer_idx, self.partition.stage_of_layer(layer_idx))

    def _record_param_slots(self, pipeline: nn.Sequential) -> None:
        """Records every pipeline parameter's (group, canonical index) in the optimizers built on the full model."""
        names = {id(p): (i, n) for i in range(len(pipeline)) for n, p in pipeline[i].named_parameters()}
        self._param_slots = []
        self._full_group_sizes = []
        for opt in self.optimizers:
            slots, sizes, base = {}, [], 0
            for g, group in enumerate(opt.param_groups):
                for j, p in enumerate(group["params"]):
                    if id(p) in names:
                        slots[names[id(p)]] = (g, base + j)
                sizes.append(len(group["params"]))
                base += len(group["params"])
            self._param_slots.append(slots)
            self._full_group_sizes.append(sizes)

    def _refilter_optimizers(self) -> None:
        """Puts exactly the owned layers' parameters in the optimizer groups, in canonical order.

        Groups are edited in place and never removed, so LR schedulers and ``LightningOptimizer`` wrappers keep
        working; the state of parameters that left this stage is dropped (they travelled with their layer).
        """
        pipeline = self._pipeline()
        self._canonical = []
        for opt, slots in zip(self.optimizers, self._param_slots):
            per_group: list[list[tuple[int, nn.Parameter]]] = [[] for _ in opt.param_groups]
            for i in self._owned:
                for n, p in pipeline[i].named_parameters():
                    if (i, n) in slots:
                        g, c = slots[(i, n)]
                        per_group[g].append((c, p))
            canon = []
            for group, items in zip(opt.param_groups, per_group):
                items.sort(key=lambda item: item[0])
                group["params"] = [p for _, p in items]
                canon.append([c for c, _ in items])
            live = {id(q) for group in opt.param_groups for q in group["params"]}
            for stale in [q for q in opt.state if id(q) not in live]:
                del opt.state[stale]
            self._canonical.append(canon)

    def _bind_metrics(self) -> None:
        try:
            from torchmetrics import Metric
        except ImportError:  # pragma: no cover - torchmetrics ships with lightning
            return
        groups = self._groups
        for m in self._lm.modules():
            if isinstance(m, Metric):
                # Only the last stage updates metrics; syncing over WORLD would wait for the other stages forever.
                if self.topology.dp_size == 1 or groups is None:
                    m.distributed_available_fn = lambda: False
                else:
                    m.process_group = groups.stage_dp

    def _attach_monitor(self, trainer: Trainer) -> None:
        """Adds the stage monitor (unless the user added one) and, with adaptation on, the adaptive loop."""
        callbacks = cast(Any, trainer).callbacks
        monitor = next((c for c in callbacks if isinstance(c, StageMonitor)), None)
        if monitor is None and self.monitor_every_n_steps is None:
            return
        if monitor is None:
            monitor = self._own_monitor = StageMonitor(every_n_steps=self.monitor_every_n_steps or 10)
            callbacks.insert(1, monitor)  # after the metrics mirror, before the user's callbacks
        self.monitor = monitor
        self.controller = None
        if self.adaptive_policy is not None and self.model_cost is not None and self.num_stages > 1:
            self.controller = AdaptiveController(self, self.adaptive_policy)
            monitor.add_listener(self._on_snapshot)

    def _on_snapshot(self, snapshot: PipelineSnapshot, trainer: Trainer) -> None:
        """Runs on every rank with the same snapshot, so every rank takes the same decision."""
        # A window restarts at every repartition: decide only on enough steps of the current partition.
        if self.controller is None or any(st.count < _MIN_SAMPLES or math.isnan(st.step_s) for st in snapshot.stages):
            return
        times = [
            StageTimes(
                compute_s=st.forward_s + st.backward_s,
                step_s=st.step_s,
                comm_s=st.comm_s,
                exposed_comm_s=st.exposed_comm_s,
                cpu_limit=st.cpu_limit,
            )
            for st in snapshot.stages
        ]
        remaining = max(0, int(trainer.estimated_stepping_batches) - trainer.global_step)
        decision = self.controller.check(trainer.global_step, times, remaining)
        if decision is not None and decision.repartition:
            rank_zero_info(f"DynPipe adaptation: {decision}")

    def _detach_monitor(self, trainer: Trainer | None) -> None:
        if self.monitor is not None and self.controller is not None:
            self.monitor.remove_listener(self._on_snapshot)
        if trainer is not None and self._own_monitor is not None and self._own_monitor in cast(Any, trainer).callbacks:
            cast(Any, trainer).callbacks.remove(self._own_monitor)
        self.monitor = self._own_monitor = None  # the controller stays readable (its decisions) until the next fit

    def _build_executor(self, pipeline: nn.Sequential) -> None:
        assert self._groups is not None
        self._failure = FailureHandler(self.stage_idx, self.global_rank)
        channels = build_channels(self._groups, self.root_device, self._timeout_s, self._failure)
        self._make_executor(pipeline, channels)

    def _make_executor(self, pipeline: nn.Sequential, channels: StageChannels) -> None:
        stage_module = nn.Sequential(*[pipeline[i] for i in self._owned])
        user_input = getattr(self.lightning_module, "pipeline_input", None)

        def first_stage_input(batch: Any) -> Any:
            if callable(user_input):
                return user_input(batch)
            return batch[0] if isinstance(batch, (tuple, list)) else batch

        self.executor = StageExecutor(
            stage_module=stage_module,
            stage_idx=self.stage_idx,
            num_stages=self.num_stages,
            schedule=self.schedule,
            num_microbatches=self.num_microbatches,
            channels=channels,
            first_stage_input=first_stage_input,
            last_stage_loss=self._last_stage_loss,
            optimizer_step=self._stage_optimizer_step,
        )
        executor = self.executor
        pipeline.forward = lambda *args, **kwargs: executor.local_forward(args[0] if args else None)  # type: ignore[method-assign]

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
        self._pending_partition = new

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._pending_partition is not None:
            new, self._pending_partition = self._pending_partition, None
            self._migrate(new, step=self._lm.trainer.global_step)

    def _migrate(self, new: Partition, step: int) -> MigrationRecord:
        """Drains, moves the layers that change stage (collective over each pipeline), rebuilds the stage."""
        assert self.partition is not None and self._groups is not None and self.executor is not None
        t0 = time.perf_counter()
        old = self.partition
        moves = plan_moves(old, new)
        self.drain()
        pipeline = self._pipeline()
        optimizer = self.optimizers[0] if self.optimizers else None
        sent = 0
        for move in moves:
            src = self.topology.rank_of(self.dp_rank, move.src)
            dst = self.topology.rank_of(self.dp_rank, move.dst)
            if self.global_rank == src:
                layer = pipeline[move.layer_idx]
                sent += send_layer(layer, optimizer, dst, self._groups.pipeline)
                layer.to("meta")
                self._offloaded[move.layer_idx] = layer
                pipeline[move.layer_idx] = _Placeholder(move.layer_idx, move.dst)
            elif self.global_rank == dst:
                skeleton = self._offloaded.pop(move.layer_idx)
                recv_layer(skeleton, optimizer, src, self._groups.pipeline, self.root_device)
                pipeline[move.layer_idx] = skeleton
        for i, layer in enumerate(pipeline):
            if isinstance(layer, _Placeholder):
                layer.owner_stage = new.stage_of_layer(i)
        self.partition = new
        self._owned = list(new.stage_layers(self.stage_idx))
        if self.optimizers:
            self._refilter_optimizers()
        self._make_executor(pipeline, self.executor.channels)
        # Every rank must see the same pause: policies use it, and ranks that decide differently deadlock.
        agreed = torch.tensor([time.perf_counter() - t0, float(sent)], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        record = MigrationRecord(
            step=step,
            old=old,
            new=new,
            moved=tuple(m.layer_idx for m in moves),
            bytes_sent=int(agreed[1]),
            pause_s=float(agreed[0]),
        )
        self.migrations.append(record)
        rank_zero_info(
            f"DynPipe repartition at step {step}: {old} -> {new}, moved layers {list(record.moved)}, "
            f"pause {record.pause_s * 1e3:.1f} ms"
        )
        return record

    def _last_stage_loss(self, micro_batch: Any, mb_slot: int) -> Tensor:
        out = self._lm.training_step(micro_batch, self._batch_idx)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor):
            raise ConfigurationError(
                f"training_step must return the loss (a Tensor, or a dict with key 'loss') on every micro-batch; "
                f"got {type(out).__name__}. DynPipeStrategy cannot skip a micro-batch: the other stages are "
                "already working on it."
            )
        return loss

    def _stage_optimizer_step(self) -> None:
        if not self.optimizers:
            return
        opt = self.optimizers[0]
        if self.topology.dp_size > 1:
            self._average_replica_grads(opt)
        # on_before_optimizer_step hooks and gradient clipping, on this stage's parameters only.
        self.precision_plugin._after_closure(self._lm, opt)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def _average_replica_grads(self, opt: Optimizer) -> None:
        """Averages this stage's gradients over its data-parallel replicas: one all-reduce of a flat buffer."""
        assert self._groups is not None
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        if not params:
            return
        for p in params:  # every replica must contribute the same buffer layout, even without a gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self._groups.stage_dp)
        flat /= self.topology.dp_size
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n

    # ------------------------------------------------------------------ training step take-over
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        batch = args[0] if args else kwargs["batch"]
        self._batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        assert self.executor is not None
        with self.precision_plugin.train_step_context():
            loss = self.executor.train_step(batch)
        return torch.tensor(loss if not math.isnan(loss) else self.executor.last_loss, device=self.root_device)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # The executor already back-propagated every micro-batch; only fire the hooks, once per step.
        module = self._lm
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        return self.precision_plugin.post_backward(closure_loss, module)

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
    def _eval(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        assert self.executor is not None
        batch = args[0] if args else kwargs["batch"]
        module = self.lightning_module
        return self.executor.eval_step(batch, lambda: getattr(module, hook)(*args, **kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._eval("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._eval("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._eval("predict_step", *args, **kwargs)

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
    def on_train_end(self) -> None:
        self.drain()

    # ------------------------------------------------------------------ collectives used by user code
    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        # User logging code runs on one stage only, so the default group is that stage's replicas.
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None:
            if self._groups is None or self.topology.dp_size == 1:
                return tensor
            group = self._groups.stage_dp
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if group is None and self._groups is not None:
            group = self._groups.stage_dp
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # The last stage (global rank 0) is authoritative: the monitored metrics are computed there.
        t = torch.tensor(int(decision), device=self.root_device)
        if self._groups is not None and self.topology.dp_size > 1 and self.is_last_stage:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._groups.last_stage_dp)
            dp = self.topology.dp_size
            t = torch.tensor(int(t.item() == dp) if all else int(t.item() > 0), device=self.root_device)
        if self.world_size > 1:
            dist.broadcast(t, src=0)
        return bool(t.item())

    # ------------------------------------------------------------------ partition-independent state
    def _layer_state_dicts(self) -> dict[int, dict[str, Tensor]]:
        pipeline = self._pipeline()
        return {i: pipeline[i].state_dict() for i in self._owned}

    def _gather_layers(self, to_all: bool) -> dict[int, dict[str, Tensor]]:
        """Collects every layer's state. ``to_all``: every rank of the pipeline gets it; else only rank 0.

        Tensors move with plain sends/broadcasts; receivers allocate from the layers' meta skeletons, so no
        shapes or pickles travel.
        """
        assert self.partition is not None and self._groups is not None
        topo = self.topology
        dp_rank = self.dp_rank
        out: dict[int, dict[str, Tensor]] = {}
        own = self._layer_state_dicts()
        for layer_idx in range(self.partition.num_layers):
            owner_stage = self.partition.stage_of_layer(layer_idx)
            if to_all:
                owner = topo.rank_of(dp_rank, owner_stage)
                if layer_idx in own:
                    sd = own[layer_idx]
                else:
                    sd = self._empty_state(layer_idx)
                if self.num_stages > 1:
                    for t in sd.values():
                        dist.broadcast(t, src=owner, group=self._groups.pipeline)
                out[layer_idx] = sd
            else:
                if dp_rank != 0:
                    continue
                owner = topo.rank_of(0, owner_stage)
                if self.global_rank == 0:
                    if owner == 0:
                        out[layer_idx] = own[layer_idx]
                    else:
                        sd = self._empty_state(layer_idx)
                        for t in sd.values():
                            dist.recv(t, src=owner, group=self._groups.pipeline)
                        out[layer_idx] = sd
                elif owner == self.global_rank:
                    for t in own[layer_idx].values():
                        dist.send(t.contiguous(), dst=0, group=self._groups.pipeline)
        return out

    def _empty_state(self, layer_idx: int) -> dict[str, Tensor]:
        """Buffers shaped like an offloaded layer's state (from its meta skeleton), to receive it into."""
        return {
            k: torch.empty_like(v, device=self.root_device) for k, v in self._offloaded[layer_idx].state_dict().items()
        }

    def _full_state_dict(self, layers: dict[int, dict[str, Tensor]]) -> dict[str, Any]:
        local = self._lm.state_dict()
        prefix = self.pipeline_attr + "."
        merged: dict[str, Any] = {k: v for k, v in local.items() if not k.startswith(prefix)}
        for layer_idx, sd in layers.items():
            for k, v in sd.items():
                merged[f"{prefix}{layer_idx}.{k}"] = v
        return {k: merged[k] for k in self._full_keys if k in merged}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.partition is None or self.num_stages == 1:
            return super().lightning_module_state_dict()
        self.drain()
        layers = self._gather_layers(to_all=False)
        return self._full_state_dict(layers) if self.global_rank == 0 else {}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.partition is None or not self._canonical:
            return super().optimizer_state(optimizer)
        self.drain()
        opt_idx = self.optimizers.index(optimizer)
        local = optimizer.state_dict()
        canon_flat = [c for g in self._canonical[opt_idx] for c in g]
        mine = {canon_flat[i]: st for i, st in local["state"].items()}
        gathered: list[Any] = [None] * self.num_stages
        if self.num_stages > 1:
            dist.all_gather_object(gathered, mine, group=self._groups.pipeline if self._groups else None)
        else:
            gathered = [mine]
        if self.global_rank != 0:
            return {}
        state: dict[int, Any] = {}
        for part in gathered:
            state.update(part)
        groups, base = [], 0
        for g, n in zip(local["param_groups"], self._full_group_sizes[opt_idx]):
            groups.append({**g, "params": list(range(base, base + n))})
            base += n
        return {"state": {k: state[k] for k in sorted(state)}, "param_groups": groups}

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._canonical:
            return super().load_optimizer_state_dict(checkpoint)
        for opt_idx, (opt, full) in enumerate(zip(self.optimizers, checkpoint["optimizer_states"])):
            canon = self._canonical[opt_idx]
            if len(full["param_groups"]) != len(canon):
                raise ConfigurationError(
                    f"The checkpoint's optimizer has {len(full['param_groups'])} parameter groups but "
                    f"configure_optimizers built {len(canon)}; resume with the same optimizer set-up."
                )
            state, groups, local_i = {}, [], 0
            for g_saved, g_canon in zip(full["param_groups"], canon):
                idx = []
                for c in g_canon:
                    if c in full["state"]:
                        state[local_i] = full["state"][c]
                    idx.append(local_i)
                    local_i += 1
                groups.append({**g_saved, "params": idx})
            opt.load_state_dict({"state": state, "param_groups": groups})
            _optimizers_to_device([opt], self.root_device)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.partition is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        prefix = self.pipeline_attr + "."
        owned = tuple(f"{prefix}{i}." for i in self._owned)
        sd = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(prefix) or k.startswith(owned)}
        self._lm.load_state_dict(sd, strict=False)

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
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Tell the other stages at once, so they end with an error naming this stage instead of waiting.
        # (Not on Ctrl-C: Lightning's launcher kills the other processes itself.)
        if self._failure is not None and not isinstance(exception, KeyboardInterrupt):
            self._failure.local_failure(exception)
        super().on_exception(exception)

    # ------------------------------------------------------------------ teardown
    def _reassemble(self) -> None:
        """Puts every layer back into the user's pipeline on every rank (collective over the pipeline)."""
        pipeline = self._pipeline()
        layers = self._gather_layers(to_all=True)
        for layer_idx, layer in sorted(self._offloaded.items()):
            layer.to_empty(device=self.root_device)
            layer.load_state_dict(layers[layer_idx])
            pipeline[layer_idx] = layer
        self._offloaded.clear()

    @override
    def teardown(self) -> None:
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        if self.lightning_module is not None and self.partition is not None:
            pipeline = self._pipeline()
            if "forward" in pipeline.__dict__:
                del pipeline.forward
            if self.executor is not None and not interrupted:
                self.executor.drain()
                self.executor.channels.close()
            if not interrupted:
                if self._offloaded:
                    self._reassemble()
            else:
                rank_zero_warn(
                    "Training was interrupted: the LightningModule in this process keeps only this stage's layers "
                    "(other layers are placeholders). Load the last checkpoint for the full model."
                )
        callbacks = cast(Any, trainer).callbacks if trainer is not None else []
        if self._mirror is not None and self._mirror in callbacks:
            callbacks.remove(self._mirror)
        self._detach_monitor(trainer)
        uninstall_whole_pipeline_summary(self._summaries)
        self._summaries = []
        if self._interference_cb is not None and self._interference_cb in callbacks:
            self._interference_cb.teardown(cast(Trainer, trainer), self._lm, "fit")  # stops what is still running
            callbacks.remove(self._interference_cb)
        self._interference_cb = None
        self._mirror = None
        if self._sync_dist_filter is not None:
            _restore_sync_dist_advice(self._sync_dist_filter)
            self._sync_dist_filter = None
        self.executor = None
        self.partition = None
        self._planned_num_stages = None
        self._topology = None
        if self._groups is not None:
            if not interrupted:
                # No rank may tear its channel groups down while a peer is still completing sends on them.
                if self._groups.pipeline is not None and self.num_stages > 1:
                    dist.barrier(group=self._groups.pipeline)
                self._groups.destroy()
            self._groups = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        entries = [
            ("dynpipe", "popen"),
            ("dynpipe_spawn", "spawn"),
            ("dynpipe_fork", "fork"),
        ]
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
            "dynpipestrategy",
        ):
            if alias not in strategy_registry:
                strategy_registry.register(alias, cls, description="DynPipe pipeline parallelism")

    @override
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_groups"] = None
        state["executor"] = None
        state["_failure"] = None
        return state
