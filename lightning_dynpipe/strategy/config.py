"""The strategy's arguments, validated once and frozen: :class:`DynPipeConfig`.

Every check here runs when :class:`~lightning_dynpipe.DynPipeStrategy` is constructed, before any process
starts, and states the rule, the value and the fix. No Trainer is needed to test them.

Example::

    >>> cfg = DynPipeConfig.from_arguments(num_microbatches=8, schedule="sync", balance=[3, 2])
    >>> cfg.schedule.name, cfg.num_stages, cfg.balance_mode
    ('sync', 2, 'list')
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from lightning_dynpipe.errors import ConfigurationError, PartitionError, ScheduleError
from lightning_dynpipe.interference.schedule import InterferenceSchedule
from lightning_dynpipe.plan.convergence import ConvergenceModel
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor import InterferencePredictor, get_predictor
from lightning_dynpipe.repartition.ladder import EscalationLadder
from lightning_dynpipe.repartition.policy import GainOverCostPolicy, RepartitionPolicy
from lightning_dynpipe.schedule import SCHEDULES, AsyncSchedule, Schedule, get_schedule
from lightning_dynpipe.sweep import SweepSettings

__all__ = [
    "DynPipeConfig",
    "DEFAULT_TIMEOUT",
    "BalanceMode",
    "MicroBatchLogging",
    "MICROBATCH_LOGGING",
    "CheckpointMode",
    "CHECKPOINT_MODES",
    "ReplicaSplitMode",
    "REPLICA_SPLIT_MODES",
    "ChangeStages",
    "CHANGE_STAGES",
]

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""How long collectives and stage-to-stage receives wait by default."""

BalanceMode = Literal["list", "auto", "parameters"]
MicroBatchLogging = Literal["step", "each"]
MICROBATCH_LOGGING: tuple[str, ...] = ("step", "each")
CheckpointMode = Literal["full", "sharded"]
CHECKPOINT_MODES: tuple[str, ...] = ("full", "sharded")
ReplicaSplitMode = Literal["off", "even", "fixed", "speed"]
REPLICA_SPLIT_MODES: tuple[str, ...] = ("even", "speed")
ChangeStages = Literal["report", "restart"]
CHANGE_STAGES: tuple[str, ...] = ("report", "restart")


@dataclass(frozen=True)
class DynPipeConfig:
    """The validated arguments of :class:`~lightning_dynpipe.DynPipeStrategy` (see its docstring for each).

    Attributes:
        num_stages: the requested ``S``; ``None``: one stage per process (or the planner's choice when
            ``stages_auto``).
        stages_auto: ``num_stages="auto"``: the planner chooses ``S``.
        num_microbatches: ``M``.
        schedule: the :class:`~lightning_dynpipe.schedule.Schedule`.
        balance: layers per stage when given as a list, else ``None``.
        balance_mode: ``"list"``, ``"auto"`` or ``"parameters"``.
        convergence: the planner's staleness model (``None``: its default).
        policy: the repartition policy, ``None`` when adaptation is off.
        monitor_every_n_steps: how often the stage monitor gathers statistics; ``None``: no monitor.
        interference: the interference schedule, if any.
        pipeline_attr: where the ``nn.Sequential`` lives on the LightningModule.
        timeout: how long collectives and receives may wait.
        lr_scale: the factor every optimizer update's learning rate is multiplied by (``"auto"`` resolved:
            ``1/M`` for a schedule that updates after every micro-batch, whatever the optimizer, and 1 for one
            that accumulates; ``benchmarks/async_lr.py`` measured that choice, see docs/user-guide.md).
        lr_scale_requested: what was asked for (``"auto"`` or a number), for messages.
        activation_checkpointing: ``True`` (every layer), ``False``, or the pipeline's layer indices whose
            activations are recomputed in the backward.
        microbatch_logging: ``"step"``: ``self.log`` calls in ``training_step`` are reduced over the step's
            micro-batches and reach Lightning once per step; ``"each"``: once per micro-batch.
        predictor: what prices candidate partitions for the adaptive loop (a name resolved to an object).
        calibrate: the calibration sweep run at set-up to train a learning predictor (``None``: none).
        checkpoint: ``"full"`` (gather the whole model into one ``torch.save`` file on rank 0) or ``"sharded"``
            (every stage writes its own layers and optimizer state into a ``torch.distributed.checkpoint``
            directory).
        gather_after_fit: whether the end of a run puts the whole model back into the user's module in every
            process (``False``: each process keeps its stage's layers).
        replica_split_mode: ``"off"`` (every replica reads its own batches through a distributed sampler),
            ``"even"``, ``"fixed"`` (``replica_weights``) or ``"speed"`` (re-split by measured speed through the
            escalation ladder): every replica draws the same global batch and trains on (with a plain DataLoader,
            loads only) its share of it.
        replica_weights: the fixed relative weights of the replicas (``"fixed"`` only).
        ladder: the escalation ladder (``"speed"`` only).
        change_stages: what the adaptive loop does when another number of stages is predicted to reach accuracy
            sooner: ``"report"`` (a warning) or ``"restart"`` (checkpoint, end the fit, continue under that number
            with :func:`~lightning_dynpipe.strategy.restart.fit_with_restarts`).
        keep_freed_cpu_memory: whether CPU stage processes keep freed memory instead of giving it back to the
            system after every micro-batch (:mod:`lightning_dynpipe.engine.allocator`).
        max_extra_in_flight: how many more micro-batches per boundary the adaptive loop may keep in flight
            (``async+d`` with ``d`` up to it; 0: the depth stays as configured).
        memory_cap: bytes each process may hold, which the set-up plan and the adaptive loop's partitions and depths
            must fit by the planner's memory model (``None``: no cap).
        microbatch_statistics: whether a fit under a flush schedule (``sync``, ``gpipe``) with more than one
            micro-batch accepts BatchNorm layers, which then normalise each micro-batch by its own statistics
            (:func:`~lightning_dynpipe.strategy.contract.check_batch_statistics`), and layers that write buffers in
            their training forward, which then update them once per micro-batch (checked by the executor).
    """

    num_stages: int | None
    stages_auto: bool
    num_microbatches: int
    schedule: Schedule
    balance: tuple[int, ...] | None
    balance_mode: BalanceMode
    convergence: ConvergenceModel | None
    policy: RepartitionPolicy | None
    monitor_every_n_steps: int | None
    interference: InterferenceSchedule | None
    pipeline_attr: str
    timeout: timedelta
    lr_scale: float = 1.0
    lr_scale_requested: float | str = "auto"
    activation_checkpointing: bool | tuple[int, ...] = False
    microbatch_logging: MicroBatchLogging = "step"
    predictor: InterferencePredictor | None = None
    calibrate: SweepSettings | None = None
    checkpoint: CheckpointMode = "full"
    gather_after_fit: bool = True
    replica_split_mode: ReplicaSplitMode = "off"
    replica_weights: tuple[float, ...] | None = None
    ladder: EscalationLadder | None = None
    change_stages: ChangeStages = "report"
    keep_freed_cpu_memory: bool = True
    max_extra_in_flight: int = 0
    memory_cap: float | None = None
    microbatch_statistics: bool = False

    @classmethod
    def from_arguments(
        cls,
        *,
        num_stages: int | Literal["auto"] | None = None,
        num_microbatches: int = 4,
        schedule: str | Schedule = "async",
        balance: list[int] | tuple[int, ...] | Literal["auto", "parameters"] = "auto",
        convergence: ConvergenceModel | None = None,
        adaptive: bool | RepartitionPolicy = True,
        monitor_every_n_steps: int | None = 10,
        interference: list[dict[str, Any]] | str | InterferenceSchedule | None = None,
        pipeline_attr: str = "pipeline",
        timeout: float | timedelta | None = None,
        lr_scale: float | Literal["auto"] = "auto",
        activation_checkpointing: bool | Sequence[int] = False,
        microbatch_logging: MicroBatchLogging = "step",
        predictor: str | InterferencePredictor = "measured",
        calibrate: bool | SweepSettings = False,
        checkpoint: str = "full",
        gather_after_fit: bool = True,
        start_method: str = "popen",
        replica_split: str | Sequence[float] | EscalationLadder | None = None,
        change_stages: str = "report",
        keep_freed_cpu_memory: bool = True,
        max_extra_in_flight: int = 0,
        memory_cap: float | None = None,
        microbatch_statistics: bool = False,
    ) -> DynPipeConfig:
        """Validates the strategy's arguments; raises :class:`~lightning_dynpipe.errors.ConfigurationError`."""
        if not isinstance(schedule, Schedule):
            try:
                get_schedule(schedule)
            except ScheduleError:
                raise ConfigurationError(
                    f"schedule must be one of {list(SCHEDULES)}, 'async+d' (async with d more micro-batches in "
                    f"flight per boundary, e.g. 'async+1') or a Schedule object; got {schedule!r}."
                ) from None
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
        mode: BalanceMode
        if isinstance(balance, str):
            if balance not in ("auto", "parameters"):
                raise ConfigurationError(
                    f"balance must be a list of layers per stage, 'auto' or 'parameters'; got {balance!r}."
                )
            mode, fixed = balance, None
        else:
            Partition.from_balance(balance)  # validates entries early, before any process starts
            if isinstance(num_stages, int) and len(balance) != num_stages:
                raise PartitionError(
                    f"balance has {len(balance)} entries but num_stages={num_stages}; give one entry per stage."
                )
            mode, fixed = "list", tuple(balance)
        if monitor_every_n_steps is not None and monitor_every_n_steps < 1:
            raise ConfigurationError(f"monitor_every_n_steps must be >= 1 or None; got {monitor_every_n_steps}.")
        if monitor_every_n_steps is None and adaptive is not False:
            raise ConfigurationError(
                "Runtime adaptation needs the stage monitor's measurements, but monitor_every_n_steps=None turns "
                "it off. Pass adaptive=False with monitor_every_n_steps=None, or keep the monitor on."
            )
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=float(timeout))
        if isinstance(interference, InterferenceSchedule) or interference is None:
            schedule_of_interference = interference
        else:
            schedule_of_interference = InterferenceSchedule.from_config(interference)
        policy: RepartitionPolicy | None
        policy = GainOverCostPolicy() if adaptive is True else (adaptive if adaptive is not False else None)
        sched = get_schedule(schedule)
        if lr_scale == "auto":
            scale = 1.0 if sched.accumulates else 1.0 / num_microbatches
        elif isinstance(lr_scale, (int, float)) and not isinstance(lr_scale, bool) and 0 < lr_scale <= 1e6:
            scale = float(lr_scale)
        else:
            raise ConfigurationError(
                f"lr_scale must be 'auto' or a positive number; got {lr_scale!r}. 'auto' scales each per-micro-batch "
                "update of the async schedule by 1/num_microbatches; 1.0 leaves the learning rate as configured."
            )
        if isinstance(activation_checkpointing, bool):
            ckpt: bool | tuple[int, ...] = activation_checkpointing
        elif all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in activation_checkpointing):
            ckpt = tuple(sorted(set(activation_checkpointing)))
        else:
            raise ConfigurationError(
                f"activation_checkpointing must be True, False or a list of the pipeline's layer indices (ints >= 0); "
                f"got {activation_checkpointing!r}."
            )
        if microbatch_logging not in MICROBATCH_LOGGING:
            raise ConfigurationError(
                f"microbatch_logging must be one of {', '.join(repr(m) for m in MICROBATCH_LOGGING)}; got "
                f"{microbatch_logging!r}. 'step' logs each name once per step (reduced over the step's micro-batches), "
                "'each' once per micro-batch."
            )
        if checkpoint not in CHECKPOINT_MODES:
            raise ConfigurationError(
                f"checkpoint must be one of {list(CHECKPOINT_MODES)}; got {checkpoint!r}. 'full' writes one file with "
                "the whole model (gathered on rank 0); 'sharded' has every stage write its own part (a "
                "torch.distributed.checkpoint directory), for models larger than one process."
            )
        if not isinstance(gather_after_fit, bool):
            raise ConfigurationError(f"gather_after_fit must be True or False; got {gather_after_fit!r}.")
        if not isinstance(keep_freed_cpu_memory, bool):
            raise ConfigurationError(f"keep_freed_cpu_memory must be True or False; got {keep_freed_cpu_memory!r}.")
        if not isinstance(microbatch_statistics, bool):
            raise ConfigurationError(f"microbatch_statistics must be True or False; got {microbatch_statistics!r}.")
        if not gather_after_fit and start_method in ("spawn", "fork", "forkserver"):
            raise ConfigurationError(
                f"gather_after_fit=False leaves each process with its stage's layers only, but start_method="
                f"{start_method!r} copies rank 0's weights back into the main process (and would load that part "
                "alone). Use start_method='popen' (or torchrun/SLURM), or keep gather_after_fit=True."
            )
        _check_max_extra_in_flight(max_extra_in_flight, sched, convergence, policy)
        _check_memory_cap(memory_cap, balance, policy)
        mode_checkpoint: CheckpointMode = "sharded" if checkpoint == "sharded" else "full"
        split_mode, weights, ladder = _replica_split(replica_split, monitor_every_n_steps)
        _check_change_stages(change_stages, policy, split_mode)
        resolved_predictor = get_predictor(predictor)
        sweep = _calibration(calibrate, policy, resolved_predictor)
        return cls(
            num_stages=num_stages if isinstance(num_stages, int) else (len(fixed) if fixed is not None else None),
            stages_auto=num_stages == "auto",
            num_microbatches=num_microbatches,
            schedule=sched,
            balance=fixed,
            balance_mode=mode,
            convergence=convergence,
            policy=policy,
            monitor_every_n_steps=monitor_every_n_steps,
            interference=schedule_of_interference,
            pipeline_attr=pipeline_attr,
            timeout=timeout or DEFAULT_TIMEOUT,
            lr_scale=scale,
            lr_scale_requested=lr_scale,
            activation_checkpointing=ckpt,
            microbatch_logging=microbatch_logging,
            predictor=resolved_predictor,
            calibrate=sweep,
            checkpoint=mode_checkpoint,
            gather_after_fit=gather_after_fit,
            replica_split_mode=split_mode,
            replica_weights=weights,
            ladder=ladder,
            change_stages="restart" if change_stages == "restart" else "report",
            keep_freed_cpu_memory=keep_freed_cpu_memory,
            max_extra_in_flight=max_extra_in_flight,
            memory_cap=float(memory_cap) if memory_cap is not None else None,
            microbatch_statistics=microbatch_statistics,
        )

    def checkpoint_layers(self, num_layers: int) -> frozenset[int]:
        """The layer indices to checkpoint in a pipeline of ``num_layers`` layers.

        Raises:
            ConfigurationError: an index that is not a layer of the pipeline.
        """
        if self.activation_checkpointing is True:
            return frozenset(range(num_layers))
        if self.activation_checkpointing is False:
            return frozenset()
        bad = [i for i in self.activation_checkpointing if i >= num_layers]
        if bad:
            raise ConfigurationError(
                f"activation_checkpointing names layers {bad}, but the pipeline has {num_layers} layers "
                f"(0..{num_layers - 1}). Give indices of self.pipeline's elements."
            )
        return frozenset(self.activation_checkpointing)

    def describe_updates(self) -> str:
        """One line for the start of a run: what the schedule does to the user's optimizer updates."""
        M, scale, asked = self.num_microbatches, self.lr_scale, self.lr_scale_requested
        if self.schedule.accumulates:
            how = "learning rates as configured" if scale == 1.0 else f"learning rates times {scale:.4g}"
            return (
                f"DynPipe {self.schedule}: one optimizer update per batch from the gradients of its {M} "
                f"micro-batches, as on one device; {how} (lr_scale={asked!r})."
            )
        if M == 1 and scale == 1.0:
            return (
                f"DynPipe {self.schedule}: one micro-batch per batch, so one update per batch as on one device (stage "
                f"k of S computes its gradients on weights S-1-k updates old); learning rates as configured "
                f"(lr_scale={asked!r})."
            )
        head = (
            f"DynPipe {self.schedule}: every micro-batch updates the weights ({M} updates per batch; stage k of S "
            f"computes its gradients on weights S-1-k updates old)"
        )
        if scale == 1.0 / M:
            return (
                f"{head}; each update's learning rate is scaled by 1/{M}, so that a batch moves the weights about as "
                f"far as one single-device step (lr_scale={asked!r}; lr_scale=1.0 keeps the configured rate)."
            )
        if scale == 1.0:
            return (
                f"{head}; learning rates as configured, so a batch moves the weights about {M} times as far as one "
                f"single-device step (lr_scale={asked!r})."
            )
        return f"{head}; each update's learning rate is multiplied by {scale:.4g} (lr_scale={asked!r})."


def _replica_split(
    value: str | Sequence[float] | EscalationLadder | None, monitor_every_n_steps: int | None
) -> tuple[ReplicaSplitMode, tuple[float, ...] | None, EscalationLadder | None]:
    """Validates ``replica_split``: ``None``, ``"even"``, ``"speed"``, an :class:`EscalationLadder` or weights."""
    if value is None:
        return "off", None, None
    if isinstance(value, EscalationLadder) or value == "speed":
        if monitor_every_n_steps is None:
            raise ConfigurationError(
                "replica_split='speed' re-splits by the replicas' measured speeds, which the stage monitor measures, "
                "but monitor_every_n_steps=None turns it off. Keep the monitor on, or give fixed weights."
            )
        return "speed", None, value if isinstance(value, EscalationLadder) else EscalationLadder()
    if value == "even":
        return "even", None, None
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ConfigurationError(
            f"replica_split must be None, one of {list(REPLICA_SPLIT_MODES)}, an EscalationLadder or a list of "
            f"positive weights, one per pipeline replica (e.g. [3, 1]); got {value!r}."
        )
    weights: tuple[Any, ...] = tuple(value)
    if not weights or any(
        isinstance(w, bool) or not isinstance(w, (int, float)) or not (0 < w < float("inf")) for w in weights
    ):
        raise ConfigurationError(
            f"replica_split weights must be positive finite numbers, one per pipeline replica; got {list(weights)}. "
            "Use e.g. [3, 1] for a replica three times as fast as the other."
        )
    return "fixed", tuple(float(w) for w in weights), None


def _check_change_stages(value: str, policy: RepartitionPolicy | None, split_mode: ReplicaSplitMode) -> None:
    """Validates ``change_stages``: a restart needs the adaptive loop, and must keep the global batch."""
    if value not in CHANGE_STAGES:
        raise ConfigurationError(
            f"change_stages must be one of {list(CHANGE_STAGES)}; got {value!r}. 'report' warns when another number "
            "of stages is predicted to reach accuracy sooner; 'restart' checkpoints and ends the fit so that "
            "fit_with_restarts continues under that number."
        )
    if value != "restart":
        return
    if policy is None:
        raise ConfigurationError(
            "change_stages='restart' acts on the adaptive loop's predictions, but adaptive=False turns the loop off. "
            "Keep adaptive on (the default), or use change_stages='report'."
        )
    if split_mode not in ("even", "speed"):
        raise ConfigurationError(
            f"change_stages='restart' changes the number of pipeline replicas along with the number of stages (the "
            f"processes stay the same). With replica_split={'None' if split_mode == 'off' else 'fixed weights'}, "
            "that changes the training: each replica reads its own batches, so the global batch would grow or shrink "
            "with the replicas (and fixed weights name one weight per replica). Use replica_split='even' or 'speed': "
            "every replica then reads the same global batch (the dataloader's batch_size) whatever their number."
        )


def _calibration(
    calibrate: bool | SweepSettings, policy: RepartitionPolicy | None, predictor: InterferencePredictor
) -> SweepSettings | None:
    """The sweep to run at set-up (``None``: none); refuses one that nothing would learn from."""
    if calibrate is False:
        return None
    if calibrate is not True and not isinstance(calibrate, SweepSettings):
        raise ConfigurationError(
            f"calibrate must be True, False or a lightning_dynpipe.sweep.SweepSettings; got {calibrate!r}."
        )
    if policy is None:
        raise ConfigurationError(
            "calibrate runs a sweep at set-up to train the predictor the adaptive loop prices partitions with, but "
            "adaptive=False turns that loop off. Keep adaptive on, or drop calibrate."
        )
    if not callable(getattr(predictor, "fit", None)):
        raise ConfigurationError(
            f"calibrate trains a learning predictor on the sweep's rows, but {type(predictor).__name__} has no "
            "fit(samples) method. Use predictor='forest' (or a ForestPredictor) with calibrate."
        )
    return calibrate if isinstance(calibrate, SweepSettings) else SweepSettings()


def _check_max_extra_in_flight(
    value: object, schedule: Schedule, convergence: ConvergenceModel | None, policy: RepartitionPolicy | None
) -> None:
    """``max_extra_in_flight``: an int >= 0; above 0 it needs ``async``, the adaptive loop and a convergence model."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigurationError(
            f"max_extra_in_flight must be an int >= 0 (micro-batches per boundary the adaptive loop may add to "
            f"async's); got {value!r}. Use 0 to keep the configured schedule, 1 or 2 to let the loop choose."
        )
    if value == 0:
        return
    if not isinstance(schedule, AsyncSchedule):
        raise ConfigurationError(
            f"max_extra_in_flight={value} lets the adaptive loop choose between 'async' and 'async+d', but the "
            f"schedule is {schedule.name!r}. Use schedule='async' (or 'async+d'), or max_extra_in_flight=0."
        )
    if policy is None:
        raise ConfigurationError(
            f"max_extra_in_flight={value} is a choice of the adaptive loop, which adaptive=False turns off. Keep "
            "adaptive on, or pass schedule='async+d' to fix the depth yourself."
        )
    if convergence is None:
        raise ConfigurationError(
            f"max_extra_in_flight={value} trades staleness for hiding a slow link, and the trade is priced by the "
            "convergence model's beta, which must be measured on your model: the default beta (0.05) under-prices "
            "deeper staleness on the models measured (a CNN's calibrated beta was 0.31). Pass "
            "convergence=ConvergenceModel(beta=...) measured with lightning_dynpipe.calibration.calibrate_beta "
            "(docs/convergence.md), or max_extra_in_flight=0."
        )


def _check_memory_cap(value: object, balance: object, policy: RepartitionPolicy | None) -> None:
    """``memory_cap``: ``None`` or a finite number of bytes > 0, and something that chooses a partition."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigurationError(
            f"memory_cap must be None (no cap) or the bytes each process may hold, a finite number > 0; got "
            f"{value!r}, e.g. memory_cap=12 * 2**30 for 12 GiB."
        )
    if balance != "auto" and policy is None:
        raise ConfigurationError(
            f"memory_cap={value!r} bounds the partitions that the planner (balance='auto') and the adaptive loop "
            f"choose, but balance={balance!r} with adaptive=False chooses none. Use balance='auto' or keep the "
            "adaptive loop on, or drop memory_cap."
        )
