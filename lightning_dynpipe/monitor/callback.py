"""StageMonitor: the thin Lightning callback around :class:`~lightning_dynpipe.monitor.stats.StageStatsAccumulator`.

Every rank adds one :class:`~lightning_dynpipe.monitor.stats.StageSample` per training step (its executor's
``StepStats`` plus a :class:`~lightning_dynpipe.monitor.system.ProcessSampler` reading) to its own rolling
window. Every ``every_n_steps`` steps the ranks exchange their window summaries in ONE small collective
(an all-gather over WORLD of a fixed vector of floats per rank), so every rank holds the same
:class:`~lightning_dynpipe.monitor.stats.PipelineSnapshot`; listeners (the adaptive policy) run on it,
global rank 0 sends it to the loggers, and a few numbers go to the progress bar.

The gather is started at the end of step ``t`` and completed at the end of step ``t + 1`` (``overlap=True``):
it travels while the pipeline computes, so no rank waits for a slower one at the step boundary, and every
rank publishes the snapshot at the same step, which keeps decisions taken in listeners in step.

The monitor does not import the strategy (the strategy imports the monitor); it recognises a DynPipe
strategy by what it reads from it (:class:`_PipelineStrategy`).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_dynpipe.monitor.stats import (
    PipelineSnapshot,
    StageReport,
    StageSample,
    StageStatsAccumulator,
)
from lightning_dynpipe.monitor.system import ProcessSampler

__all__ = ["SnapshotListener", "StageMonitor"]

log = logging.getLogger(__name__)

SnapshotListener = Callable[[PipelineSnapshot, Trainer], None]
"""Called on every rank with each new snapshot (identical on every rank) and the trainer."""


@dataclass
class _PendingGather:
    step: int
    parts: list[torch.Tensor]
    work: Any  # the async collective's handle; None once complete (or with a single process)
    partition: Any  # the strategy's partition when the gather started
    split: Any = None  # and its replica split
    schedule: Any = None  # and its schedule's name


def _balance(partition: Any) -> tuple[int, ...] | None:
    balance = getattr(partition, "balance", None)
    return tuple(int(b) for b in balance) if balance is not None else None


@runtime_checkable
class _PipelineStrategy(Protocol):
    """What the monitor reads from the strategy (DynPipeStrategy provides it)."""

    @property
    def executor(self) -> Any: ...
    @property
    def stage_idx(self) -> int: ...
    @property
    def dp_rank(self) -> int: ...


class StageMonitor(Callback):
    """Collects per-stage step statistics on every rank and shares a pipeline snapshot every N steps.

    Example::

        monitor = StageMonitor(every_n_steps=10, window=20)
        monitor.add_listener(lambda snap, trainer: print(snap.table()) if trainer.is_global_zero else None)
        trainer = L.Trainer(strategy=DynPipeStrategy(), callbacks=[monitor], ...)
        trainer.fit(model)
        monitor.latest.stages[0].busy_s      # in the worker processes (with spawn: not in the launching one)

    A snapshot's ``step`` is the ``global_step`` at which the summaries were taken (a multiple of
    ``every_n_steps``); with ``overlap=True`` it is published (``latest``, listeners, loggers, progress bar)
    one step later, when the gather started at ``step`` has completed, and at the end of training for the
    last one. ``snapshot.balance`` is the partition it was measured under. After a repartition the window
    starts again (its samples described the old stages), and a snapshot that was travelling during the
    repartition is logged but not given to the listeners.

    Logged (global rank 0, to every logger in ``trainer.loggers``): :meth:`PipelineSnapshot.to_metrics`,
    i.e. ``dynpipe/stage{k}/step_ms``, ``.../compute_ms``, ``.../busy_ms``, ``.../recv_wait_ms``,
    ``.../idle_ms``, ``.../exposed_comm_ms``, ``.../cpu_share``, ``.../rss_mb``, ... and
    ``dynpipe/step_ms``, ``dynpipe/bottleneck_stage``, ``dynpipe/imbalance``.

    Progress bar (global rank 0): for pipelines of up to four stages ``dynpipe/s{k}_busy_ms``, stage ``k``'s
    median compute + send time per step (what differs between stages: their step times all converge to the
    slowest stage's, and the bar already shows the step rate); with more stages ``dynpipe/bottleneck_stage``
    and ``dynpipe/bottleneck_busy_ms``. They are logged with ``self.log`` (DynPipe's metrics mirror copies
    ``callback_metrics`` to the other ranks, so ModelCheckpoint or EarlyStopping may monitor them) and do not
    reach the loggers a second time.

    Under another strategy the monitor does nothing (and warns once). It keeps nothing from one fit to the
    next except its listeners; :attr:`latest` stays readable after a fit until the next one starts.

    Args:
        every_n_steps: steps between two snapshots (each costs one small collective over WORLD).
        window: steps whose medians a snapshot reports (per process).
        log: send each snapshot's metrics to the trainer's loggers.
        prog_bar: show the compact summary in the progress bar. Off by default: with it on, the 2-stage MLP of
            ``benchmarks/throughput.py`` ran at 0.87-0.89x of a run without the monitor, against 0.97-1.02x with
            it off (4 repeats each, benchmarks/results/2026-12-01-performance.md), although its own calls take 2-4
            ms per snapshot; why was not established.
        overlap: complete each gather one step after starting it (default), instead of waiting for it at once.
    """

    PROG_BAR_MAX_STAGES = 4

    def __init__(
        self, every_n_steps: int = 10, window: int = 20, log: bool = True, prog_bar: bool = False, overlap: bool = True
    ) -> None:
        for name, value in (("every_n_steps", every_n_steps), ("window", window)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"StageMonitor({name}=...) must be a positive integer; got {value!r}.")
        self.every_n_steps = every_n_steps
        self.window = window
        self.log_metrics = log
        self.prog_bar = prog_bar
        self.overlap = overlap
        self.latest: PipelineSnapshot | None = None
        self.snapshots_taken = 0
        self.overhead_s = 0.0
        """Time spent inside this callback's hooks during the current fit (collectives included)."""
        self._listeners: list[SnapshotListener] = []
        self._acc: StageStatsAccumulator | None = None
        self._sampler: ProcessSampler | None = None
        self._active = False
        self._warned = False
        self._steps = 0
        self._partition: Any = None
        self._schedule: Any = None
        self._split: Any = None
        self._pending: _PendingGather | None = None
        self._group: Any = None  # None: WORLD
        self._own_group = False
        self.report_token: Callable[[], float] | None = None
        """Called when this rank's report is made; its value travels with the report (``StageReport.token``)."""

    # ------------------------------------------------------------------ listeners
    def add_listener(self, fn: SnapshotListener) -> None:
        """Calls ``fn(snapshot, trainer)`` on every rank after each snapshot (in the order added).

        With ``start_method="spawn"`` the callback, listeners included, is pickled into the workers: use a
        module-level function or a picklable object.
        """
        self._listeners.append(fn)

    def remove_listener(self, fn: SnapshotListener) -> None:
        """Stops calling ``fn``."""
        self._listeners.remove(fn)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (pickled), over the CPU process group of the monitor's gathers.

        A collective: every rank calls it at the same point of the fit (a snapshot listener runs on every rank with
        the same snapshot). The other ranks' ``obj`` is ignored. Outside a fit of several processes it returns
        ``obj``.
        """
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self._group)
        return box[0]

    @property
    def accumulator(self) -> StageStatsAccumulator | None:
        """This process's rolling window (None outside a fit)."""
        return self._acc

    # ------------------------------------------------------------------ hooks
    def _reset(self) -> None:
        self._release()
        self._acc = None
        self._steps = 0
        self._partition = None
        self._split = None
        self._schedule = None
        self.latest = None
        self.snapshots_taken = 0
        self.overhead_s = 0.0

    def _release(self) -> None:
        """Drops what a fit held: the sampler's descriptors, an unfinished gather, our process group."""
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        self._pending = None  # after a failure a peer may never contribute: do not wait for it
        if self._own_group and self._group is not None:
            try:
                dist.destroy_process_group(self._group)
            except Exception as exc:  # the default group may already be gone
                log.debug("Could not destroy the monitor's process group: %s", exc)
        self._group, self._own_group = None, False
        self._active = False

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset()
        strategy = trainer.strategy
        executor = getattr(strategy, "executor", None)
        if not isinstance(strategy, _PipelineStrategy) or executor is None or not hasattr(executor, "stats"):
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"StageMonitor measures pipeline stages of DynPipeStrategy, but the trainer runs "
                    f"{type(strategy).__name__}; the monitor does nothing in this fit. Remove it from the "
                    "callbacks or use strategy=DynPipeStrategy(...)."
                )
            return
        self._acc = StageStatsAccumulator(self.window)
        self._sampler = ProcessSampler(getattr(strategy, "root_device", None) or pl_module.device)
        self._partition = getattr(strategy, "partition", None)
        self._split = getattr(strategy, "replica_split", None)
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_backend() != "gloo":
            # a CPU group for the gather: reading a device tensor back would synchronise the device every time
            self._group, self._own_group = dist.new_group(backend="gloo"), True
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            # the other ranks on this machine are the job's own load on shared cores, not other processes'
            ranks: list[Any] = [None] * dist.get_world_size()
            here = socket.gethostname()
            dist.all_gather_object(ranks, (here, os.getpid()), group=self._group)
            self._sampler.set_siblings([pid for host, pid in ranks if host == here])
        self._active = True

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._active:
            assert self._sampler is not None
            self._sampler.mark()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        t0 = time.perf_counter()
        assert self._acc is not None and self._sampler is not None
        strategy: Any = trainer.strategy
        executor = strategy.executor
        if executor is None:  # torn down mid-fit (failure): nothing to read
            return
        partition = getattr(strategy, "partition", None)
        split = getattr(strategy, "replica_split", None)
        if partition is not self._partition and partition != self._partition:
            self._acc.reset()  # the window described the old stage; a repartition starts a new one
            self._partition = partition
        if split != self._split:
            self._acc.reset()  # likewise a re-split across the replicas: the shares the window measured changed
            self._split = split
        schedule = getattr(strategy, "schedule", None)
        if schedule != self._schedule:
            self._acc.reset()  # and a change of schedule: another staleness, other round trips
            self._schedule = schedule
        self._acc.add(StageSample.from_step(executor.stats, self._sampler.sample()))
        self._steps += 1
        if self._pending is not None:
            self._finish(trainer, pl_module, in_loop=True)
        if self._steps % self.every_n_steps == 0:
            self._start(trainer, strategy)
            if self._pending is not None and self._pending.work is None:
                self._finish(trainer, pl_module, in_loop=True)
        self.overhead_s += time.perf_counter() - t0

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause()

    def _pause(self) -> None:
        """Work between two steps that no step repeats (a validation run, an epoch's end and the checkpoints saved
        there) stays out of the next step's CPU: a CPU limit's floor is priced from the CPU per step."""
        if self._active and self._sampler is not None:
            self._sampler.pause()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._active and self._pending is not None:
            t0 = time.perf_counter()
            self._finish(trainer, pl_module, in_loop=False)  # every rank started it: it completes
            self.overhead_s += time.perf_counter() - t0

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()

    # ------------------------------------------------------------------ snapshot
    def _start(self, trainer: Trainer, strategy: Any) -> None:
        """Starts gathering every rank's report of its window (one all-gather of a few dozen floats)."""
        assert self._acc is not None
        token = float(self.report_token()) if self.report_token is not None else 0.0
        mine = StageReport(
            dp_rank=int(strategy.dp_rank), stage_idx=int(strategy.stage_idx), summary=self._acc.summary(), token=token
        )
        vector = torch.tensor(mine.to_vector(), dtype=torch.float64)
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            parts = [torch.empty_like(vector) for _ in range(dist.get_world_size(self._group))]
            work = dist.all_gather(parts, vector, group=self._group, async_op=self.overlap)
            self._pending = _PendingGather(
                trainer.global_step, parts, work if self.overlap else None, self._partition, self._split, self._schedule
            )
        else:
            self._pending = _PendingGather(
                trainer.global_step, [vector], None, self._partition, self._split, self._schedule
            )

    def _finish(self, trainer: Trainer, pl_module: LightningModule, *, in_loop: bool) -> None:
        """Completes the pending gather and publishes the snapshot (``in_loop``: inside a batch hook)."""
        pending, self._pending = self._pending, None
        assert pending is not None
        if pending.work is not None:
            pending.work.wait()
        # the gather's order is the group's, whose ranks are the global ranks (WORLD, or a new group of every rank)
        reports = [replace(StageReport.from_vector(p.tolist()), rank=i) for i, p in enumerate(pending.parts)]
        snapshot = PipelineSnapshot.from_reports(pending.step, reports, balance=_balance(pending.partition))
        self.latest = snapshot
        self.snapshots_taken += 1
        if pending.partition is self._partition and pending.split == self._split and pending.schedule == self._schedule:
            for fn in list(self._listeners):
                fn(snapshot, trainer)
        # else: the pipeline was repartitioned (or rescheduled) while the gather travelled; the snapshot still goes to
        # the loggers (it describes the steps before), but a policy must not act on the old partition's numbers.
        if self.log_metrics and trainer.is_global_zero and trainer.loggers:
            metrics = snapshot.to_metrics()
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=snapshot.step)
        if self.prog_bar and in_loop and trainer.is_global_zero:
            for key, value in self._prog_bar_values(snapshot).items():
                if not math.isnan(value):
                    pl_module.log(
                        key,
                        value,
                        prog_bar=True,
                        logger=False,
                        on_step=True,
                        on_epoch=False,
                        batch_size=1,
                        sync_dist=False,
                        rank_zero_only=True,
                    )

    def _prog_bar_values(self, snapshot: PipelineSnapshot) -> dict[str, float]:
        # Few keys: each self.log call costs a few hundred microseconds in Lightning's result collection.
        if snapshot.num_stages <= self.PROG_BAR_MAX_STAGES:
            return {f"dynpipe/s{k}_busy_ms": s.busy_s * 1e3 for k, s in enumerate(snapshot.stages)}
        bottleneck = snapshot.bottleneck_stage
        if bottleneck is None:
            return {}
        return {
            "dynpipe/bottleneck_stage": float(bottleneck),
            "dynpipe/bottleneck_busy_ms": snapshot.stages[bottleneck].busy_s * 1e3,
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return {}  # stateless between fits: nothing to checkpoint
