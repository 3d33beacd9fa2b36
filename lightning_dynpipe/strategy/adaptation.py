"""Wiring of the stage monitor and the adaptive loop into a fit.

:class:`AdaptationWiring` adds the :class:`~lightning_dynpipe.monitor.StageMonitor` to the Trainer (unless the
user added one), builds the :class:`~lightning_dynpipe.repartition.controller.AdaptiveController` from the
set-up profile, turns each monitor snapshot (the same on every rank) into the controller's window, and hands a
decision to move back to the strategy, which applies it at the next step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.monitor.callback import StageMonitor
from lightning_dynpipe.monitor.stats import PipelineSnapshot, StageReport, StageSummary, interference_excess
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.plan.replicas import ReplicaSplit
from lightning_dynpipe.predictor.base import StageTimes
from lightning_dynpipe.repartition.controller import AdaptiveController
from lightning_dynpipe.repartition.ladder import EscalationLadder, LadderDecision, replica_window
from lightning_dynpipe.schedule import Schedule
from lightning_dynpipe.strategy.config import DynPipeConfig

__all__ = ["AdaptationWiring", "MIN_SAMPLES"]

log = logging.getLogger(__name__)

MIN_SAMPLES = 5
"""Steps of a monitor window (under the current partition) the adaptive loop needs before it decides."""


class AdaptationWiring:
    """The monitor and the adaptive loop of one fit.

    Args:
        config: the strategy's configuration.
        partition: returns the partition in use (``None`` when torn down).
        pending: returns whether a repartition is already queued.
        repartition: queues a repartition (the strategy's :meth:`~lightning_dynpipe.DynPipeStrategy.repartition`).
        past_pauses: the measured pauses of the migrations so far.
        replica_split: returns the replica split in use (``None``: off, or one replica).
        replica_samples: returns each replica's share of the last global batch.
        resplit: queues a new replica split (the strategy's
            :meth:`~lightning_dynpipe.DynPipeStrategy.set_replica_split`).
        restart: with ``change_stages="restart"``, checkpoints and ends the fit to continue under the given
            number of stages (the strategy's ``_restart``); returns the checkpoint's path, or None when it did not.
        reschedule: queues a change of schedule (the strategy's :meth:`~lightning_dynpipe.DynPipeStrategy.reschedule`),
            for the depth the adaptive loop chooses with ``max_extra_in_flight > 0``.

    With ``replica_split="speed"`` every check climbs the escalation ladder
    (:class:`~lightning_dynpipe.repartition.ladder.EscalationLadder`): a short imbalance is ignored, a slow
    replica gets a smaller share, balanced replicas with a slow stage go to the layer controller, and a better
    number of stages is reported. Each check's rung is in :attr:`ladder_decisions`.
    """

    def __init__(
        self,
        config: DynPipeConfig,
        *,
        partition: Callable[[], Partition | None],
        pending: Callable[[], bool],
        repartition: Callable[[Partition], None],
        past_pauses: Callable[[], Sequence[float]],
        replica_split: Callable[[], ReplicaSplit | None] = lambda: None,
        replica_samples: Callable[[], Sequence[int]] = tuple,
        resplit: Callable[[ReplicaSplit], None] | None = None,
        restart: Callable[[int, str], str | None] | None = None,
        reschedule: Callable[[Schedule], None] | None = None,
    ) -> None:
        self.config = config
        self._partition = partition
        self._pending = pending
        self._repartition = repartition
        self._past_pauses = past_pauses
        self._replica_split = replica_split
        self._replica_samples = replica_samples
        self._resplit = resplit
        self._restart = restart
        self._reschedule = reschedule
        self.ladder: EscalationLadder | None = None
        self._hinted: set[int] = set()
        self.monitor: StageMonitor | None = None
        self.controller: AdaptiveController | None = None
        self._own_monitor: StageMonitor | None = None
        self._shares_refits = False  # the predictor's refits run on one rank (set at attach)

    def attach(
        self, trainer: Trainer, *, model_cost: ModelCost | None, comm: CommModel, num_stages: int, replicas: int
    ) -> None:
        """Adds the stage monitor (unless the user added one) and, with adaptation on, the adaptive loop."""
        callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
        monitor = next((c for c in callbacks if isinstance(c, StageMonitor)), None)
        if monitor is None and self.config.monitor_every_n_steps is None:
            return
        if monitor is None:
            monitor = self._own_monitor = StageMonitor(every_n_steps=self.config.monitor_every_n_steps or 10)
            callbacks.insert(1, monitor)  # after the metrics mirror, before the user's callbacks
        self.monitor = monitor
        self.controller = None
        self.ladder = self.config.ladder if self.config.replica_split_mode == "speed" and replicas > 1 else None
        self._hinted = set()
        if self.ladder is not None:
            self.ladder.reset()
        if self.config.policy is not None and model_cost is not None and num_stages > 1:
            reset = getattr(self.config.policy, "reset", None)
            if callable(reset):  # the same policy object may serve several fits: each starts from scratch
                reset()
            self.controller = AdaptiveController(
                self.config.policy,
                model_cost=model_cost,
                comm=comm,
                schedule=self.config.schedule,
                num_microbatches=self.config.num_microbatches,
                replicas=replicas,
                convergence=self.config.convergence,
                predictor=self.config.predictor,
                max_extra_in_flight=self.config.max_extra_in_flight,
                memory_cap=self.config.memory_cap,
            )
            ready = getattr(self.config.predictor, "ready_refit", None)
            if callable(ready):  # each rank's finished refit travels with its monitor report: the ranks agree
                monitor.report_token = ready
            share = getattr(self.config.predictor, "share_refits", None)
            wanted = getattr(self.config.predictor, "one_rank_refits", False) in (True, "auto")
            if callable(share) and wanted and getattr(trainer, "world_size", 1) > 1:
                # one rank refits (the one with CPU to spare at each check; "auto": only while a process runs under
                # a CPU limit), the others receive its forests
                share(rank=int(getattr(trainer, "global_rank", 0)), broadcast=monitor.broadcast_object)
                self._shares_refits = True
            prepare = getattr(self.config.predictor, "prepare", None)
            if callable(prepare):  # a learning predictor's imports and helper process start before the first step
                prepare()
        if self.controller is not None or self.ladder is not None:
            monitor.add_listener(self.on_snapshot)

    @property
    def ladder_decisions(self) -> list[LadderDecision]:
        """Every check's rung of the escalation ladder, with its reason (``replica_split="speed"``)."""
        return list(self.ladder.decisions) if self.ladder is not None else []

    def on_snapshot(self, snapshot: PipelineSnapshot, trainer: Trainer) -> None:
        """Runs on every rank with the same snapshot, so every rank takes the same decision."""
        partition = self._partition()
        if (self.controller is None and self.ladder is None) or partition is None or self._pending():
            return
        # A window restarts at every repartition: decide only on enough steps of the current partition.
        if any(st.count < MIN_SAMPLES or math.isnan(st.step_s) for st in snapshot.stages):
            return
        if self.ladder is not None and self._climb(snapshot, trainer, partition) != "keep":
            return  # rungs 1-2 answered (ignored a short spike, or re-split): layers stay where they are
        if self.controller is None:
            return
        times = [StageTimes.from_summary(st) for st in snapshot.stages]
        step = trainer.global_step
        remaining = max(0, int(trainer.estimated_stepping_batches) - step)
        agreed = int(snapshot.agreed_token) if self.monitor is not None and self.monitor.report_token else None
        if self._shares_refits:
            predictor: Any = self.config.predictor
            predictor.refit_rank = refit_rank(
                snapshot,
                one_rank_refits=getattr(predictor, "one_rank_refits", True),
                any_core=getattr(predictor, "refit_cores", "own") == "any",
            )
        decision = self.controller.check(
            step,
            times,
            partition,
            remaining,
            past_pauses_s=self._past_pauses(),
            agreed_refit=agreed,
            stage_signs=_stage_signs(snapshot),
        )
        if decision is not None and decision.repartition:
            try:  # a partition the run cannot train exactly (a shared parameter split under async) is not taken
                self._repartition(decision.partition)
            except ConfigurationError as exc:
                log.info("DynPipe adaptation: %s not taken: %s", decision, exc)
                return
            self.controller.migrated(step)
            rank_zero_info(f"DynPipe adaptation: {decision}")
        depth = getattr(self.controller, "depth_decision", None)
        if depth is not None and depth.change and self._reschedule is not None:
            try:  # a depth the run cannot train exactly (a tie the deeper staleness would split) is not taken
                self._reschedule(depth.schedule)
            except ConfigurationError as exc:
                log.info("DynPipe adaptation: %s not taken: %s", depth, exc)
            else:
                self.controller.rescheduled(step, depth.schedule)
                rank_zero_info(f"DynPipe adaptation: {depth}")
        if self.ladder is not None:
            if decision is not None and decision.repartition:
                self.ladder.record(LadderDecision(step, "move_layers", f"a stage of every replica is slow: {decision}"))
        hint = getattr(self.controller, "stage_count_hint", None)
        if hint is not None:
            best_s, other_s, here_s = hint
            detail = f"predicted time to accuracy {other_s:.3g} s vs {here_s:.3g} s with {partition.num_stages} stages"
            rung = EscalationLadder.stage_count_decision(step, partition.num_stages, best_s, detail)
            restarted = None
            if self.config.change_stages == "restart" and self._restart is not None and remaining > 0:
                restarted = self._restart(best_s, str(rung))
            if restarted is not None:
                rung = EscalationLadder.stage_count_decision(
                    step, partition.num_stages, best_s, f"{detail}; restarting from {restarted}", restart=True
                )
            if self.ladder is not None:
                self.ladder.record(rung)
            log.info("DynPipe adaptation: %s", rung)
            if best_s not in self._hinted and restarted is None:  # warn once per number of stages
                self._hinted.add(best_s)
                rank_zero_warn(f"DynPipe adaptation: {rung}")

    def _climb(self, snapshot: PipelineSnapshot, trainer: Trainer, partition: Partition) -> str:
        """Rungs 1 and 2 of the ladder from the replicas' measured compute times; returns the rung taken."""
        assert self.ladder is not None
        split, samples = self._replica_split(), tuple(self._replica_samples())
        if split is None or len(samples) != split.num_replicas:
            return "keep"
        causes = _replica_causes(snapshot)
        window = replica_window(
            trainer.global_step,
            samples,
            # forward + backward only: the update's all-reduce waits for the slowest replica, so a summary's
            # compute_s (which includes the update) makes every replica look as slow as the slowest
            [(r.dp_rank, r.stage_idx, r.summary.forward_s + r.summary.backward_s) for r in snapshot.replicas],
            split,
            partition.num_stages,
            step_s=max((r.summary.step_s for r in snapshot.replicas), default=math.nan),
            # the update includes the gradient all-reduce: a replica that reached it early waited there longer
            update_s_by_rank=[(r.dp_rank, r.stage_idx, r.summary.optimizer_s) for r in snapshot.replicas],
            # a slowdown with a visible cause is acted on sooner than one without (a passing hiccup)
            causes_by_rank=causes,
            # what a re-split's outcome is judged by (medians of quota-throttled steps mislead)
            mean_step_s=max((r.summary.mean_step_s for r in snapshot.replicas), default=math.nan),
        )
        decision = self.ladder.decide(window)
        log.info("DynPipe adaptation: %s", decision)
        if decision.rung == "resplit" and decision.split is not None and self._resplit is not None:
            self._resplit(decision.split)
            rank_zero_info(f"DynPipe adaptation: {decision}")
        return decision.rung

    def schedule_changed(self, schedule: Schedule) -> None:
        """The pipeline runs ``schedule`` from now on (:meth:`~lightning_dynpipe.DynPipeStrategy.reschedule`): the
        controller prices candidates with its staleness and round trips."""
        if self.controller is not None:
            self.controller.schedule = schedule

    def detach(self, trainer: Trainer | None) -> None:
        """Removes the listener and the monitor this wiring added; the controller stays readable (its decisions)."""
        if self.monitor is not None and self.controller is not None:
            self.monitor.remove_listener(self.on_snapshot)
            self.monitor.report_token = None
        close = getattr(self.config.predictor, "close", None)
        if callable(close):  # a background refit of a learning predictor ends with the fit
            close()
        if self._shares_refits:  # a later fit in one process refits on its own
            predictor: Any = self.config.predictor
            predictor.share_refits(rank=None, broadcast=None)
            self._shares_refits = False
        callbacks: list[Any] = trainer.callbacks if trainer is not None else []  # type: ignore[attr-defined]
        if self._own_monitor is not None and self._own_monitor in callbacks:
            callbacks.remove(self._own_monitor)
        self.monitor = self._own_monitor = None


def refit_rank(snapshot: PipelineSnapshot, *, one_rank_refits: bool | str, any_core: bool = False) -> int | None:
    """The global rank that fits a forest's next refit, ``None`` for every rank its own
    (:attr:`ForestPredictor.refit_rank <lightning_dynpipe.predictor.ForestPredictor.refit_rank>`), from the snapshot
    every rank sees: with ``one_rank_refits=True`` always :func:`spare_cpu_rank`; with ``"auto"`` that rank while any
    process of the fit runs under a cgroup CPU limit (``cpu_limit``), else ``None``. Within a limit a refit's CPU,
    at whatever priority, is taken from the limit: on the CNN under a quarter-core quota on its last stage, the ten
    steps in which both ranks refitted took 1.8-2.8x as long as the median ten."""
    if one_rank_refits == "auto" and all(math.isinf(_cpu_limit(r.summary)) for r in snapshot.replicas):
        return None
    return spare_cpu_rank(snapshot, any_core=any_core)


def _cpu_limit(summary: StageSummary) -> float:
    """The process's cgroup CPU limit in cores; ``math.inf`` where none is read."""
    limit = summary.cpu_limit
    return limit if limit is not None and math.isfinite(limit) else math.inf


def spare_cpu_rank(snapshot: PipelineSnapshot, *, any_core: bool = False) -> int:
    """The global rank of the process with the most CPU to spare in ``snapshot``: where background work (a forest
    refit at the lowest priority, in the process's cgroup and on its cores) costs the pipeline least and is done
    soonest.

    A process's spare CPU is what its cgroup limit (at most one core: a stage's training thread and its refit share
    the stage's core) leaves over the CPU the process used and other processes' load on its cores, in quarter
    cores; a tie goes to the process with the higher limit (none is highest), then to the lowest rank. A refit at
    the lowest priority gets only that spare CPU: on the process of the pipeline's slowest stage, which keeps its
    core busy, it waited for tens of seconds, while a stage under a CPU limit that waits for the others had most of
    its limit to spare. Where neither has a quarter core to spare, the refit goes where it can only wait: within a
    limit it spends the stage's quota (the priority orders threads, not the quota). Every rank sees the same
    snapshot, so every rank names the same process.

    With ``any_core`` (``ForestPredictor(refit_cores="any")``) a refit runs in the idle time of any core, such as
    what a CPU limit leaves of a limited stage's core, but within its rank's cgroup limit: the process with the
    highest limit comes first, then the order above. A limited stage with a quarter core over its use (under a
    half-core quota, waiting for the other stage) would spend its quota on the refit, where the unlimited process's
    refit can run in the idle rest of that same core outside any limit.
    """
    known = [r for r in snapshot.replicas if r.rank >= 0]
    if not known:
        return 0

    def key(r: StageReport) -> tuple[float, float, int]:
        s = r.summary
        limit = _cpu_limit(s)
        other = s.other_cpu_load if s.other_cpu_load is not None and math.isfinite(s.other_cpu_load) else 0.0
        used = s.cpu_share if math.isfinite(s.cpu_share) else 0.0
        spare = -round((min(limit, 1.0) - used - other) * 4)
        return (-limit, spare, r.rank) if any_core else (spare, -limit, r.rank)

    return min(known, key=key).rank


def _stage_signs(snapshot: PipelineSnapshot) -> list[str]:
    """Per stage, the signs of interference its processes show beyond the least affected process of the pipeline
    (every process compared with every other: a quota on one stage is a sign, the cores all stages share are not);
    empty when a process has no system readings."""
    excess = interference_excess([r.summary for r in snapshot.replicas])
    if excess is None:
        return []
    stages = sorted({r.stage_idx for r in snapshot.replicas})
    return [", ".join(s for r, s in zip(snapshot.replicas, excess) if r.stage_idx == k and s) for k in stages]


def _replica_causes(snapshot: PipelineSnapshot) -> list[tuple[int, int, str]]:
    """Each process's signs of interference beyond the other replicas of its stage, as ``(dp_rank, stage_idx,
    signs)``; empty when a process has no system readings (then every imbalance counts as explained)."""
    out: list[tuple[int, int, str]] = []
    for k in sorted({r.stage_idx for r in snapshot.replicas}):
        reports = [r for r in snapshot.replicas if r.stage_idx == k]
        excess = interference_excess([r.summary for r in reports])
        if excess is None:
            return []
        out += [(r.dp_rank, k, sign) for r, sign in zip(reports, excess)]
    return out
