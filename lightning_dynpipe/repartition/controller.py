"""The adaptive loop's decision: a measured window -> predicted costs of candidates -> policy -> a decision.

:class:`AdaptiveController` is given everything explicitly (the set-up profile, the link, the schedule, the
predictor and the policy) and returns a :class:`~lightning_dynpipe.repartition.policy.Decision`; the strategy
applies it (a live migration at the next step). At every check:

1. the window goes to the predictor first when it learns online (``predictor.observe``: the window's times are
   a labelled sample, and after a migration its measured outcome is one);
2. the planner re-solves the partition with the slowdowns the predictor gives the current one (a window whose
   link and slowdowns are within 10% of the last solve's reuses its plan: the solve only proposes a candidate);
   where the predictor prices a stage of the current partition above its slowdown times its layers' profile (under
   a CPU limit the measured predictor keeps the CPU the process spends around its layers), a second solve under
   each stage's multiplier as priced proposes a second candidate;
3. the candidates (the current partition, the planner's, and every shift of one boundary by one or two layers)
   are priced by the predictor: each stage's compute and each boundary's message time, with intervals; a
   candidate's predicted step time (and time to accuracy) follows from those through the planner's model of the
   schedule and its staleness, and is at least the schedule's slowest round trip through several stages
   (:meth:`~lightning_dynpipe.schedule.Schedule.round_trip_time`, which a slow link makes binding);
4. the candidate whose predicted gain has the largest lower end (the shortest predicted time at the upper ends of
   the predictor's intervals; with a point predictor, the shortest predicted time) goes to the policy with that
   lower end; a candidate priced shorter but less surely never holds back one whose lower end pays;
5. with ``max_extra_in_flight > 0`` and the partition staying, the current partition is priced under ``async+d``
   for every ``d`` up to it (the convergence model charging each depth's staleness), and the best depth goes to
   the depth policy (:class:`~lightning_dynpipe.repartition.inflight.InFlightPolicy`); its answer is in
   :attr:`AdaptiveController.depth_decision`. With ``max_extra_in_flight > 0`` a move may also come with a depth:
   each candidate is priced under every depth too, and keeps the best where it beats the current partition under
   its own best depth by the depth policy's ``min_relative_gain`` (what a change of depth alone reaches); the policy
   decides on the pair, the depth change is in :attr:`AdaptiveController.depth_decision` beside the move, and a
   roll back of the move takes its depth back.

With a ``memory_cap``, a candidate partition or depth whose predicted peak memory on some stage exceeds it
(:func:`~lightning_dynpipe.plan.memory.stage_memory`: its weight versions, optimizer state and the activations of
its micro-batches in flight) is never chosen; the current one always stays a choice.

Every decision is kept with its inputs, and its log line carries the predicted times with their intervals and
the features that weighed most.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from lightning_dynpipe.errors import PartitionError
from lightning_dynpipe.plan.auto import best_plan
from lightning_dynpipe.plan.convergence import ConvergenceModel
from lightning_dynpipe.plan.costs import CommModel, DeviceSpec, ModelCost
from lightning_dynpipe.plan.memory import format_bytes, stage_memory
from lightning_dynpipe.plan.moves import plan_moves
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.plan.solver import Plan, evaluate
from lightning_dynpipe.predictor.base import InterferencePredictor, PartitionPrediction, PipelineWindow, StageTimes
from lightning_dynpipe.predictor.link import LinkEstimate
from lightning_dynpipe.predictor.measured import MeasuredSlowdownPredictor, measured_slowdowns
from lightning_dynpipe.repartition.inflight import DepthDecision, DepthInputs, InFlightPolicy, waits_bound
from lightning_dynpipe.repartition.policy import Decision, PolicyInputs, PricedPartition, RepartitionPolicy
from lightning_dynpipe.schedule import AsyncSchedule, Schedule, get_schedule

__all__ = ["AdaptiveController", "Outcome", "neighbours", "measured_slowdowns", "StageTimes"]

log = logging.getLogger(__name__)


def _priced_multipliers(
    model_cost: ModelCost, partition: Partition, prediction: PartitionPrediction
) -> tuple[float, ...]:
    """Per stage, its predicted compute under ``partition`` over its layers' profile (else its slowdown)."""
    out = []
    for k, interval in enumerate(prediction.stage_compute_s):
        layers = partition.stage_layers(k)
        profile = model_cost.compute_s(layers.start, layers.stop)
        out.append(interval.value / profile if profile > 0 and interval.value > 0 else prediction.slowdowns[k])
    return tuple(out)


def neighbours(partition: Partition, max_shift: int = 2) -> list[Partition]:
    """Every partition that moves one boundary of ``partition`` by ``1..max_shift`` layers (stages keep >= 1).

    Example::

        >>> [p.balance for p in neighbours(Partition((2, 3)), max_shift=1)]
        [(1, 4), (3, 2)]
    """
    out = []
    bal = partition.balance
    for b in range(len(bal) - 1):
        for d in (*range(-max_shift, 0), *range(1, max_shift + 1)):
            new = list(bal)
            new[b] += d
            new[b + 1] -= d
            if new[b] >= 1 and new[b + 1] >= 1:
                out.append(Partition(tuple(new)))
    return out


def _close(a: float, b: float, rel: float) -> bool:
    """``a`` within ``rel`` (relative) of ``b``; equal infinities count as close."""
    return a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rel * max(abs(a), abs(b)))


def _close_inputs(
    a: tuple[CommModel, tuple[float, ...]], b: tuple[CommModel, tuple[float, ...]], rel: float = 0.10
) -> bool:
    """Whether two re-solves' inputs (the link, the slowdowns) differ by less than ``rel`` each (the overlap, a share:
    by less than ``rel`` in absolute terms; it is measured per window and moves by 0.05-0.15 between windows of a
    clean run)."""
    (ca, sa), (cb, sb) = a, b
    oa, ob = np.atleast_1d(ca.overlap), np.atleast_1d(cb.overlap)
    return (
        len(sa) == len(sb)
        and all(_close(x, y, rel) for x, y in zip(sa, sb))
        and _close(ca.latency_s, cb.latency_s, rel)
        and _close(ca.bandwidth_Bps, cb.bandwidth_Bps, rel)
        and oa.shape == ob.shape
        and bool(np.all(np.abs(oa - ob) <= rel))
    )


@dataclass(frozen=True)
class _PredictedStages:
    """A :class:`~lightning_dynpipe.plan.costs.CostModel` that prices one candidate with a predictor's times.

    Stage ``k`` per micro-batch: its predicted compute, plus its layers' profiled updates slowed as its compute
    is (``update``, per update, amortised over the micro-batches of one update), plus ``(1 - overlap) * 2``
    predicted messages across its outgoing boundary (activation out, gradient back), plus the replicas'
    all-reduce, over the replicas: the terms of :class:`~lightning_dynpipe.plan.costs.DefaultCostModel` with the
    predictor's numbers.

    ``link_on_stage=False`` leaves the messages out: under a schedule without a flush the stage sends and goes on,
    and the time a stage waits for a message is the wait of a round trip through the stages (the caller bounds the
    step with :meth:`~lightning_dynpipe.schedule.Schedule.round_trip_time`); the measured exposure there is that
    wait, and charging it to the stage as well would count the link twice.

    ``allreduce`` prices the replicas' gradient all-reduce (default: ``comm``). The caller gives the set-up probe's
    link: the windows measure the pipeline's boundaries, and a boundary measured slower says nothing of the
    replicas' group (a 4 ms boundary fitted as 0.03 MB/s priced TinyNet's 2 KB all-reduce at 65 ms).
    """

    compute: tuple[float, ...]
    boundary: tuple[float, ...]
    comm: CommModel
    update: tuple[float, ...] = ()
    link_on_stage: bool = True
    allreduce: CommModel | None = None

    def stage_time(
        self,
        model: ModelCost,
        first: npt.ArrayLike,
        stop: npt.ArrayLike,
        *,
        stage_idx: int,
        num_stages: int,
        replicas: int,
        device: DeviceSpec,
        microbatches_per_update: int,
    ) -> npt.NDArray[np.float64]:
        i, j = int(np.asarray(first).reshape(-1)[0]), int(np.asarray(stop).reshape(-1)[0])
        t = self.compute[stage_idx]
        if self.update:
            t += self.update[stage_idx] / microbatches_per_update
        if self.link_on_stage and stage_idx < num_stages - 1:
            overlap = float(self.comm.overlap_per_cut(model.num_layers)[j - 1])
            t += (1.0 - overlap) * 2.0 * self.boundary[stage_idx]
        reduce = self.allreduce if self.allreduce is not None else self.comm
        t += float(reduce.allreduce_time(model.param_bytes(i, j), replicas)) / microbatches_per_update
        return np.asarray([t / replicas], dtype=np.float64)


@dataclass(frozen=True)
class _Priced:
    partition: Partition
    prediction: PartitionPrediction
    value: Plan
    high: Plan
    round_trip_bound: bool = False
    """Whether a round trip through several stages, not a stage, sets the value's time per micro-batch."""

    @property
    def fits(self) -> bool:
        """Whether every stage's predicted peak memory fits the controller's ``memory_cap`` (priced with it)."""
        return self.value.fits_memory


def _peak(priced: _Priced) -> str:
    """The largest predicted peak memory of the candidate's stages."""
    return format_bytes(max(priced.value.stage_memory_bytes))


@dataclass(frozen=True)
class Outcome:
    """A migration's measured outcome next to what was predicted for it.

    Attributes:
        step: the check that measured it (the first full window under ``partition``).
        partition: the partition moved to.
        predicted_step_s: the predicted seconds per step (value, and the upper end).
        predicted_high_s: upper end of the prediction.
        measured_step_s: the measured seconds per step.
    """

    step: int
    partition: Partition
    predicted_step_s: float
    predicted_high_s: float
    measured_step_s: float

    @property
    def error(self) -> float:
        """Relative error of the prediction (``predicted / measured - 1``)."""
        return self.predicted_step_s / self.measured_step_s - 1.0 if self.measured_step_s > 0 else math.nan


def _floored_limits(times: Sequence[StageTimes], stage_signs: Sequence[str]) -> list[str]:
    """Causes for the stages whose CPU limit below one core floors their slowdown and that show no sign already (a
    limit all stages share is no excess over the others, but it still floors each one's slowdown)."""
    return [
        f"stage {k}: cgroup CPU limit {t.cpu_limit:.2f} cores"
        for k, t in enumerate(times)
        if t.binding_cpu_limit is not None and not (stage_signs[k] if k < len(stage_signs) else "")
    ]


def _waits(window: PipelineWindow) -> tuple[float, ...]:
    """Each stage's time per step blocked until a neighbour's message was there; ``()`` where no stage has a
    reading (a window built without the monitor's waits: a deeper pipeline's saving is not bounded by waits)."""
    waits = tuple(t.recv_wait_s for t in window.stages)
    return waits if any(w > 0 for w in waits) else ()


class AdaptiveController:
    """Decides at every monitor window whether to repartition; the caller applies the decision.

    Example::

        controller = AdaptiveController(GainOverCostPolicy(), model_cost=cost, comm=link, schedule="async",
                                        num_microbatches=4)
        decision = controller.check(step, window, remaining_steps=800)
        if decision is not None and decision.repartition:
            strategy.repartition(decision.partition)
            controller.migrated(step)

    Args:
        policy: decides whether the planner's candidate is worth a migration.
        model_cost: the set-up profile (per-layer costs on an unloaded device).
        comm: the measured link between stages.
        schedule: the pipeline's schedule (its staleness enters the predicted time to accuracy).
        num_microbatches: ``M``.
        replicas: data-parallel pipeline replicas (every stage is replicated this many times).
        convergence: the planner's staleness model; ``None``: its default.
        predictor: prices candidate partitions from a measured window; default
            :class:`~lightning_dynpipe.predictor.MeasuredSlowdownPredictor`. One with an ``observe(model_cost,
            comm, window)`` method (the :class:`~lightning_dynpipe.predictor.ForestPredictor`) is given every
            window first.
        max_shift: the candidates beside the planner's: every shift of one boundary by up to this many layers.
        consider_stage_counts: also solve for every other number of stages the processes allow, and record in
            :attr:`stage_count_hint` when one is predicted to reach accuracy at least ``stage_count_gain`` sooner
            (the escalation ladder's last rung: a live migration cannot change ``S``).
        stage_count_gain: the relative time-to-accuracy improvement another ``S`` must promise to be reported.
        stage_count_every: solve for other stage counts at every this many checks (the first included): one
            solve per divisor of the process count, which on a large model costs about as much as the set-up plan.
        max_extra_in_flight: under ``async`` or ``async+d``, also consider keeping up to this many more
            micro-batches in flight per boundary on the current partition (0: the depth stays as configured). The
            choice is priced in time to accuracy, so it is only as good as ``convergence``'s ``beta``.
        depth_policy: decides whether another depth is worth a change; default :class:`InFlightPolicy`.
        memory_cap: bytes each process may hold; a candidate partition or depth predicted to need more on some
            stage is never chosen (``None``: no cap).
    """

    def __init__(
        self,
        policy: RepartitionPolicy,
        *,
        model_cost: ModelCost,
        comm: CommModel,
        schedule: Schedule | str,
        num_microbatches: int,
        replicas: int = 1,
        convergence: ConvergenceModel | None = None,
        predictor: InterferencePredictor | None = None,
        max_shift: int = 2,
        consider_stage_counts: bool = True,
        stage_count_gain: float = 0.10,
        stage_count_every: int = 10,
        max_extra_in_flight: int = 0,
        depth_policy: InFlightPolicy | None = None,
        memory_cap: float | None = None,
    ) -> None:
        self.policy = policy
        self.model_cost = model_cost
        self.comm = comm
        self.link = LinkEstimate(comm)
        """The link as the windows measure it (:class:`~lightning_dynpipe.predictor.link.LinkEstimate`): candidates
        are priced with ``self.link.model()``, which is ``comm`` until the link is measured slower."""
        self.schedule = get_schedule(schedule)
        self.num_microbatches = num_microbatches
        self.replicas = replicas
        self.convergence = convergence
        self.predictor: InterferencePredictor = predictor if predictor is not None else MeasuredSlowdownPredictor()
        self.max_shift = max_shift
        self.decisions: list[Decision] = []
        self.outcomes: list[Outcome] = []
        self._moved: tuple[Partition, float, float] | None = None
        self.consider_stage_counts = consider_stage_counts
        self.stage_count_gain = stage_count_gain
        self.stage_count_every = max(1, stage_count_every)
        self._checks = 0
        self._last_solves: dict[str, tuple[tuple[CommModel, tuple[float, ...]], Plan | None]] = {}
        self.max_extra_in_flight = max_extra_in_flight
        self.depth_policy = depth_policy if depth_policy is not None else InFlightPolicy()
        self.depth_decisions: list[DepthDecision] = []
        self.memory_cap = memory_cap
        self._paired_undo: tuple[Partition, Partition, Schedule] | None = None  # (moved to, from, depth before)
        self.depth_decision: DepthDecision | None = None
        """After a check: the depth policy's answer (``None`` when the depth was not considered: a partition move,
        ``max_extra_in_flight=0``, or a schedule that is not ``async``)."""
        self._cause_age_s: tuple[float, ...] = ()
        self._link_age_s = 0.0
        self._last_check_step: int | None = None
        self.stage_count_hint: tuple[int, float, float] | None = None
        """After a check: ``(S, its predicted time to accuracy, the current S's)`` when another number of stages
        is predicted to be better by ``stage_count_gain``; else ``None``."""

    def check(
        self,
        step: int,
        times: Sequence[StageTimes],
        partition: Partition,
        remaining_steps: int | None,
        past_pauses_s: Sequence[float] = (),
        agreed_refit: int | None = None,
        stage_signs: Sequence[str] = (),
    ) -> Decision | None:
        """One check with the window's per-stage medians; ``None`` when it cannot decide (wrong stage count).

        Args:
            step: the Lightning step of the check.
            times: one :class:`StageTimes` per stage, measured under ``partition``.
            partition: the partition in use.
            remaining_steps: steps left in the run (``None`` if unknown).
            past_pauses_s: the measured pauses of earlier migrations (the next one is priced at their mean).
            agreed_refit: for a predictor that refits in the background, the newest refit finished on every rank
                (from the monitor's snapshot); passed to its ``observe``.
            stage_signs: per stage, its signs of interference beyond the other stages' (``""``: none; see
                :func:`~lightning_dynpipe.monitor.stats.interference_excess`); with the link measured slower than
                the set-up probe and any CPU limit below one core in ``times`` (it floors that stage's slowdown)
                they are the window's ``PolicyInputs.causes``; as flags, its ``PolicyInputs.conditions`` (none
                given: the conditions are not known).
        """
        if len(times) != partition.num_stages:
            return None
        cost, M, dp = self.model_cost, self.num_microbatches, self.replicas
        window = PipelineWindow(Partition(partition.balance), tuple(times), M)
        link = self.link.observe(cost, window).model()
        observe = getattr(self.predictor, "observe", None)
        if callable(observe):  # the window is a sample (after a migration: the move's measured outcome)
            if agreed_refit is None:
                observe(cost, link, window)
            else:
                observe(cost, link, window, agreed_refit=agreed_refit)
        self._record_outcome(step, window)
        comm = CommModel(latency_s=link.latency_s, bandwidth_Bps=link.bandwidth_Bps, overlap=window.comm_overlap)
        current_prediction = self.predictor.predict(cost, link, window, window.partition)
        slowdowns = current_prediction.slowdowns
        # The planner's re-solve only proposes a candidate (every candidate is then priced by the predictor): a
        # window whose link and slowdowns are each within 10% of the last solve's reuses its plan (the neighbours of
        # the current partition are priced at every check whatever the proposal).
        planned = self._solve("slowdowns", comm, slowdowns, partition.num_stages)
        # A predictor may price a stage above its slowdown times its layers' profile (under a CPU limit, the CPU its
        # process spends around the layers stays with it), which a per-layer slowdown cannot carry into the solve:
        # a second solve under each stage's multiplier as priced now proposes the cut that moves more layers away
        # from such a stage; the predictor prices both proposals.
        priced_as = _priced_multipliers(cost, window.partition, current_prediction)
        second = (
            self._solve("priced", comm, priced_as, partition.num_stages)
            if not _close_inputs((comm, tuple(slowdowns)), (comm, priced_as))
            else None
        )
        self.stage_count_hint = None
        self._checks += 1
        if planned is not None and self.consider_stage_counts and (self._checks - 1) % self.stage_count_every == 0:
            self.stage_count_hint = self._other_stage_count(planned, partition.num_stages * dp, comm, slowdowns)
        proposal = [Partition(p.partition.balance) for p in (planned, second) if p is not None]
        others = [*proposal, *neighbours(window.partition, self.max_shift)]
        unique = [p for i, p in enumerate(others) if p != window.partition and p not in others[:i]]
        many = getattr(self.predictor, "predict_many", None)
        if callable(many):
            predictions = [current_prediction, *many(cost, link, window, unique)]
        else:
            predictions = [current_prediction, *(self.predictor.predict(cost, link, window, p) for p in unique)]
        priced = [self._price(p, pred, comm) for p, pred in zip([window.partition, *unique], predictions)]
        paired, depths_here = self._pair_depths(step, window, priced, comm)
        # The candidate the policy judges: the one whose predicted gain has the largest lower end, i.e. the shortest
        # time at the upper ends of the predictor's intervals (with a point predictor, the shortest predicted time).
        # The policy moves only when that lower end pays the migration, so no other candidate's lower end pays where
        # this one's does not; a candidate priced shorter but less surely (layers never measured together) would hold
        # back a move that pays. (The policy also asks the saving at the values to reach its minimum: a candidate
        # surer but with a smaller saving is judged before one with a larger saving whose lower end pays less.)
        # Where that is the current partition no candidate can pay, and the fastest goes to the policy, whose reason
        # then says why it does not (the lower end of its gain), not that the current partition is the fastest.
        # Ties: current, planner; a candidate over the memory cap is never chosen (the current one stays a choice).
        current = priced[0]
        allowed = [c for c in priced if c.fits or c is current]
        best = min(allowed, key=lambda c: (c.high.time_to_accuracy_s, c.value.time_to_accuracy_s))
        if best is current:
            best = min(allowed, key=lambda c: c.value.time_to_accuracy_s)
        # a plan's time to accuracy over I0 is its seconds per micro-batch with the staleness's extra steps: the
        # policy's per-step currency, whatever I0 a calibrated convergence model carries. A step is M micro-batches
        # of every replica, and the plan's time per micro-batch is the replicas' together (a stage's time / dp)
        i0 = (self.convergence or ConvergenceModel()).i0
        per_step = M * dp / i0
        # the pipeline's time this check covers: the steps since the check before at the window's step time
        since = step - self._last_check_step if self._last_check_step is not None else step
        self._last_check_step = step
        span_s = max(since, 0) * window.mean_step_s
        slower_link = link != self.comm
        cause_ages, link_age = self._age_causes(window, stage_signs, slower_link, span_s)
        inputs = PolicyInputs(
            step=step,
            current=window.partition,
            candidate=best.partition,
            current_step_s=current.value.time_to_accuracy_s * per_step,
            candidate_step_s=best.value.time_to_accuracy_s * per_step,
            measured_step_s=window.mean_step_s,
            migration_cost_s=self._migration_cost(window, best.partition, comm, past_pauses_s),
            remaining_steps=remaining_steps,
            slowdowns=slowdowns,
            candidate_step_high_s=best.high.time_to_accuracy_s * per_step,
            details=self._details(window, current, best, priced, paired.get(best.partition)),
            stage_compute_s=tuple(t.compute_s for t in window.stages),
            convergence_factor=current.value.iterations / i0,
            causes="; ".join(
                [f"stage {k}: {sign}" for k, sign in enumerate(stage_signs) if sign]
                + _floored_limits(times, stage_signs)
                + (["the link measured slower than the set-up probe"] if slower_link else [])
            ),
            conditions=tuple(bool(sign) for sign in stage_signs),
            cause_stages=tuple(
                bool(stage_signs[k] if k < len(stage_signs) else "") or t.binding_cpu_limit is not None
                for k, t in enumerate(times)
            ),
            link_cause=slower_link,
            allowed=self._fits if self.memory_cap is not None else None,
            window=window,
            cause_age_s=cause_ages,
            window_s=span_s,
            link_age_s=link_age,
            priced=tuple(
                PricedPartition(c.partition, c.value.iteration_time_s * M * dp, c.high.iteration_time_s * M * dp)
                for c in priced
            ),
            agreed_refit=agreed_refit,
        )
        decision = self.policy.decide(inputs)
        self.decisions.append(decision)
        self.depth_decision = None
        undo, self._paired_undo = self._paired_undo, None
        if decision.repartition:
            self.depth_policy.forget_change()  # the next window measures the new partition, not the depth
            with_move = paired.get(decision.partition) if decision.partition == best.partition else None
            if with_move is not None:  # the depth that made the move pay comes with it, judged with it
                self.depth_decision = self._depth_with_move(
                    window, decision, inputs, with_move, f"with the move {window.partition} -> {decision.partition}"
                )
                self._paired_undo = (decision.partition, window.partition, self.schedule)
            elif undo is not None and (window.partition, decision.partition) == undo[:2] and undo[2] != self.schedule:
                self.depth_decision = self._depth_with_move(  # a paired move rolled back takes its depth back
                    window, decision, inputs, undo[2], f"with the roll back {window.partition} -> {decision.partition}"
                )
            if self.depth_decision is not None:
                self.depth_decisions.append(self.depth_decision)
                log.debug("DynPipe adaptation: %s", self.depth_decision)
        elif self.max_extra_in_flight > 0 and isinstance(self.schedule, AsyncSchedule):
            self.depth_decision = self._depth(step, window, current, current_prediction, comm, inputs, depths_here)
            self.depth_decisions.append(self.depth_decision)
            log.debug("DynPipe adaptation: %s", self.depth_decision)
        if decision.repartition:
            chosen = best if decision.partition == best.partition else None
            self._moved = (
                decision.partition,
                chosen.value.iteration_time_s * M * dp if chosen is not None else math.nan,
                chosen.high.iteration_time_s * M * dp if chosen is not None else math.nan,
            )
        log.debug("DynPipe adaptation: %s", decision)  # a repartition is also reported by the strategy (rank 0)
        return decision

    def _age_causes(
        self, window: PipelineWindow, stage_signs: Sequence[str], slower_link: bool, span_s: float
    ) -> tuple[tuple[float, ...], float]:
        """For how long each stage's signs, and the link measured slower than the set-up probe, have shown
        (``PolicyInputs.cause_age_s``, ``PolicyInputs.link_age_s``): the time each check covers (``span_s``,
        ``PolicyInputs.window_s``) added up over the consecutive checks that showed them, 0 once one did not; a stage
        under a CPU limit below one core ``math.inf``; the stages' ``()`` without signs."""

        def aged(age: float, shown: bool) -> float:
            return age + span_s if shown else 0.0

        self._link_age_s = aged(self._link_age_s, slower_link)
        if len(stage_signs) != len(window.stages):
            self._cause_age_s = ()
        else:
            before = self._cause_age_s if len(self._cause_age_s) == len(stage_signs) else (0.0,) * len(stage_signs)
            self._cause_age_s = tuple(
                math.inf if t.binding_cpu_limit is not None else aged(age, bool(sign))
                for t, sign, age in zip(window.stages, stage_signs, before, strict=True)
            )
        return self._cause_age_s, self._link_age_s

    def _solve(self, key: str, comm: CommModel, slowdowns: Sequence[float], num_stages: int) -> Plan | None:
        """The planner's best partition under ``slowdowns`` (``None`` where none fits the memory cap); a solve whose
        inputs are within 10% of the last one under the same ``key`` reuses its plan."""
        inputs = (comm, tuple(slowdowns))
        last = self._last_solves.get(key)
        if last is not None and _close_inputs(last[0], inputs):
            return last[1]
        dp = self.replicas
        planned: Plan | None
        try:
            planned = best_plan(
                self.model_cost,
                num_stages * dp,
                num_stages=num_stages,
                schedule=self.schedule,
                convergence=self.convergence,
                comm=comm,
                num_microbatches=self.num_microbatches,
                slowdowns=[slowdowns[k] for k in range(num_stages) for _ in range(dp)],
                memory_cap=self.memory_cap,
            )
        except PartitionError as exc:  # no partition fits the memory cap: the neighbours are still priced
            log.debug("DynPipe adaptation: no plan within the memory cap: %s", exc)
            planned = None
        self._last_solves[key] = (inputs, planned)
        return planned

    def _pair_depths(
        self, step: int, window: PipelineWindow, priced: list[_Priced], comm: CommModel
    ) -> tuple[dict[Partition, Schedule], dict[Schedule, _Priced]]:
        """With a depth to choose (``max_extra_in_flight > 0`` under ``async``), a move may come with another depth:
        every candidate but the current one is also priced under every other depth the depth policy does not refuse,
        and ``priced`` keeps its best (within the memory cap) where that beats, by the depth policy's
        ``min_relative_gain``, the current partition under its own best depth (what a change of depth alone reaches
        without a migration). Returns the depth each re-priced candidate pairs with, and the current partition priced
        under the other depths (for :meth:`_depth`). No candidate pairs where the stages' measured waits for messages
        fall short of what another depth alone is predicted to save on the current partition (where the depth
        policy's :func:`~lightning_dynpipe.repartition.inflight.waits_bound` binds): the priced round trip is then
        not what sets the pace, and a candidate's price under another depth is not to be trusted either."""
        if self.max_extra_in_flight <= 0 or not isinstance(self.schedule, AsyncSchedule) or len(priced) < 2:
            return {}, {}
        depths = [AsyncSchedule(d) for d in range(self.max_extra_in_flight + 1)]
        others = [d for d in depths if d != self.schedule and not self.depth_policy.refuses(d, step)]
        current = priced[0]
        alone = [self._price(current.partition, current.prediction, comm, d) for d in others]
        known: dict[Schedule, _Priced] = dict(zip(others, alone))
        if alone and self.depth_policy.bound_by_waits:
            deepest = min(p.value.iteration_time_s for p in alone)
            now = current.value.iteration_time_s
            if waits_bound(now, deepest, window.mean_step_s, _waits(window)) > deepest:
                return {}, known
        base = min(p.value.time_to_accuracy_s for p in (current, *alone) if p.fits or p is current)
        bar = base * (1.0 - self.depth_policy.min_relative_gain)
        paired: dict[Partition, Schedule] = {}
        for idx in range(1, len(priced)):
            here = priced[idx]
            for sched in others:
                alt = self._price(here.partition, here.prediction, comm, sched)
                better = alt.value.time_to_accuracy_s < min(bar, priced[idx].value.time_to_accuracy_s)
                if alt.fits and better:
                    priced[idx], paired[here.partition] = alt, sched
        return paired, known

    def _depth_with_move(
        self, window: PipelineWindow, decision: Decision, inputs: PolicyInputs, schedule: Schedule, what: str
    ) -> DepthDecision:
        """The depth change that goes with a move (the partition policy decided on both: see :meth:`_pair_depths`)."""
        return DepthDecision(
            True,
            schedule,
            decision.predicted_gain_s,
            what,
            DepthInputs(
                step=inputs.step,
                current=self.schedule,
                candidate=schedule,
                current_step_s=inputs.current_step_s,
                candidate_step_s=inputs.candidate_step_s,
                candidate_step_high_s=inputs.candidate_step_upper_s,
                measured_step_s=inputs.measured_step_s,
                convergence_factor=inputs.convergence_factor,
                change_cost_s=window.mean_step_s,
                remaining_steps=inputs.remaining_steps,
                causes=inputs.causes,
            ),
        )

    def _fits(self, partition: Partition) -> bool:
        """Whether every stage of ``partition`` fits ``memory_cap`` under the running schedule."""
        cap = self.memory_cap if self.memory_cap is not None else math.inf
        S = partition.num_stages
        return all(
            int(stage_memory(self.model_cost, [r.start], [r.stop], stage_idx=k, num_stages=S, schedule=self.schedule,
                             num_microbatches=self.num_microbatches)[0]) <= cap
            for k, r in enumerate(partition.stage_layers(k) for k in range(S))
        )  # fmt: skip

    def _depth(
        self,
        step: int,
        window: PipelineWindow,
        current: _Priced,
        prediction: PartitionPrediction,
        comm: CommModel,
        inputs: PolicyInputs,
        known: dict[Schedule, _Priced],
    ) -> DepthDecision:
        """The current partition priced under every depth up to ``max_extra_in_flight`` (``known``: those already
        priced at this check); the policy's answer."""
        M, i0 = self.num_microbatches, (self.convergence or ConvergenceModel()).i0
        assert isinstance(self.schedule, AsyncSchedule)
        depths = sorted({*range(self.max_extra_in_flight + 1), self.schedule.extra_in_flight})
        priced: list[tuple[Schedule, _Priced]] = []
        for d in depths:
            sched = AsyncSchedule(d)
            same = sched == self.schedule
            if same:
                priced.append((sched, current))
            else:
                priced.append((sched, known.get(sched) or self._price(window.partition, prediction, comm, sched)))
        waits = _waits(window) if self.depth_policy.bound_by_waits else ()

        def counted(p: _Priced) -> float:  # time to accuracy with the saving bounded by the waits (see the policy)
            raw = waits_bound(current.value.iteration_time_s, p.value.iteration_time_s, window.mean_step_s, waits)
            return raw * p.value.iterations

        # ties: the shallowest; a depth over the memory cap is never chosen (the current one stays a choice)
        best_schedule, best = min((c for c in priced if c[1].fits or c[1] is current), key=lambda c: counted(c[1]))

        def per_step(plan: Plan) -> float:
            return plan.time_to_accuracy_s * M * self.replicas / i0

        def over_cap(p: _Priced) -> str:
            return "" if p.fits else f" (needs {_peak(p)}: over the memory cap)"

        def bounded(p: _Priced) -> str:
            n = counted(p) * M * self.replicas / i0
            return f" (bounded by the waits: {n * 1e3:.1f})" if n > per_step(p.value) * (1 + 1e-9) else ""

        details = "depths (ms/step x convergence factor): " + ", ".join(
            f"{s.name} {per_step(p.value) * 1e3:.1f}{bounded(p)}{over_cap(p)}" for s, p in priced
        )
        if waits:
            details += "; waited for messages (ms/step): " + ", ".join(f"{w * 1e3:.1f}" for w in waits)
        return self.depth_policy.decide(
            DepthInputs(
                step=step,
                current=self.schedule,
                candidate=best_schedule,
                current_step_s=per_step(current.value),
                candidate_step_s=per_step(best.value),
                candidate_step_high_s=per_step(best.high),
                measured_step_s=inputs.measured_step_s,
                convergence_factor=inputs.convergence_factor,
                change_cost_s=window.mean_step_s,
                remaining_steps=inputs.remaining_steps,
                causes=inputs.causes,
                details=details,
                candidate_convergence_factor=best.value.iterations / i0,
                waits_s=waits,
            )
        )

    def _other_stage_count(
        self, planned: Plan, world: int, comm: CommModel, slowdowns: Sequence[float]
    ) -> tuple[int, float, float] | None:
        """The planner's best plan over every number of stages, each process slowed as its stage is now."""
        S = planned.partition.num_stages
        # the measured slowdowns belong to processes, not to layers: under another S, process r keeps its own
        per_process = [float(slowdowns[k]) for k in range(S) for _ in range(world // S)]
        try:
            anywhere = best_plan(
                self.model_cost,
                world,
                schedule=self.schedule,
                convergence=self.convergence,
                comm=comm,
                num_microbatches=self.num_microbatches,
                slowdowns=per_process,
                memory_cap=self.memory_cap,
            )
        except ValueError as exc:  # no other S fits (memory, layers): nothing to report
            log.debug("DynPipe adaptation: no plan over other stage counts: %r", exc)
            return None
        other, here = anywhere.time_to_accuracy_s, planned.time_to_accuracy_s
        if anywhere.partition.num_stages != S and other < (1.0 - self.stage_count_gain) * here:
            return anywhere.partition.num_stages, other, here
        return None

    def _price(
        self, partition: Partition, prediction: PartitionPrediction, comm: CommModel, schedule: Schedule | None = None
    ) -> _Priced:
        """The candidate's predicted plan from the predictor's values, and from the upper ends of its intervals (under
        ``schedule``; default: the running one)."""
        schedule = schedule or self.schedule
        plans = []
        bound = []
        ranges = [partition.stage_layers(k) for k in range(partition.num_stages)]
        update = tuple(
            prediction.slowdowns[k] * self.model_cost.update_s(r.start, r.stop) for k, r in enumerate(ranges)
        )
        per_update = schedule.microbatches_per_update(self.num_microbatches)
        # with a flush a step's forwards and backwards end together, and a stage waits out its messages
        flush = schedule.accumulates
        points = all(i.high == i.value for i in (*prediction.stage_compute_s, *prediction.boundary_s))
        for pick in ("value",) if points else ("value", "high"):
            compute = tuple(getattr(i, pick) for i in prediction.stage_compute_s)
            messages = tuple(getattr(i, pick) for i in prediction.boundary_s)
            plan = evaluate(
                self.model_cost,
                Partition(partition.balance, (self.replicas,) * partition.num_stages),
                schedule=schedule,
                convergence=self.convergence,
                cost_model=_PredictedStages(compute, messages, comm, update, link_on_stage=flush, allreduce=self.comm),
                num_microbatches=self.num_microbatches,
                memory_cap=self.memory_cap,
            )
            # the stages' own times miss the round trips through several stages that the micro-batches in
            # flight allow: a slow link can bind there (each replica runs its own round trips). A link whose
            # bandwidth serialises the messages would bind at one message per micro-batch each way; a window
            # measured at one message size cannot tell its bandwidth from its latency, so that bound is left out
            trip = schedule.round_trip_time(compute, [u / per_update for u in update], messages) / self.replicas
            bound.append(trip > plan.iteration_time_s)
            if bound[-1]:
                plan = replace(plan, iteration_time_s=trip, time_to_accuracy_s=plan.iterations * trip)
            plans.append(plan)
        # point predictions: the upper end is the value
        return _Priced(partition, prediction, plans[0], plans[-1], bound[0])

    def _details(
        self,
        window: PipelineWindow,
        current: _Priced,
        best: _Priced,
        priced: Sequence[_Priced],
        paired: Schedule | None = None,
    ) -> str:
        """Predicted stage and boundary times of the candidate (ms, with intervals), the faster candidates left out
        for the memory cap, and the top features."""

        def fmt(xs: Sequence[object]) -> str:
            parts = []
            for i in xs:
                v, lo, hi = (getattr(i, a) * 1e3 for a in ("value", "low", "high"))
                parts.append(f"{v:.2f}" if lo == v == hi else f"{v:.2f} [{lo:.2f}, {hi:.2f}]")
            return "[" + ", ".join(parts) + "]"

        pred = best.prediction
        text = f"candidate stage ms/micro-batch {fmt(pred.stage_compute_s)}"
        if paired is not None:
            text = f"with {paired.name} (changed with the move); {text}"
        if pred.boundary_s:
            text += f", boundary ms/message {fmt(pred.boundary_s)}"
        bound = [p for p in ((current,) if best is current else (current, best)) if p.round_trip_bound]
        if bound:
            trips = ", ".join(f"{list(p.partition.balance)} {p.value.iteration_time_s * 1e3:.2f}" for p in bound)
            text += f"; round trip through the stages binds (ms/micro-batch): {trips}"
        capped = [p for p in priced if not p.fits and p.value.time_to_accuracy_s < best.value.time_to_accuracy_s]
        if capped and self.memory_cap is not None:
            needs = ", ".join(f"{list(p.partition.balance)} {_peak(p)}" for p in capped)
            text += f"; faster but over the memory cap of {format_bytes(self.memory_cap)} (needed): {needs}"
        link = self.link.model()
        if link != self.comm:
            text += f"; link as measured: {link.latency_s * 1e3:.2f} ms + {link.bandwidth_Bps / 1e6:.3g} MB/s"
        top = getattr(self.predictor, "top_features", None)
        if callable(top):
            k = max(range(len(pred.slowdowns)), key=lambda s: pred.slowdowns[s])
            features = top(self.model_cost, window, k)
            if features:
                text += f"; stage {k} features: {', '.join(features)}"
        return text

    def _record_outcome(self, step: int, window: PipelineWindow) -> None:
        """The first window under a partition the controller moved to: the move's measured outcome."""
        if self._moved is None:
            return
        target, predicted, high = self._moved
        self._moved = None
        if window.partition != target:
            return
        outcome = Outcome(step, target, predicted, high, window.mean_step_s)
        self.outcomes.append(outcome)
        log.info(
            "DynPipe adaptation: the move to %s measured %.1f ms/step, predicted %.1f ms (up to %.1f ms)",
            target,
            outcome.measured_step_s * 1e3,
            predicted * 1e3,
            high * 1e3,
        )

    def migrated(self, step: int) -> None:
        """Tells the policies that the decision of ``step`` was applied (their cool-downs start)."""
        self.policy.migrated(step)
        self.depth_policy.changed(step)

    def rescheduled(self, step: int, schedule: Schedule) -> None:
        """The depth decision of ``step`` was applied: candidates are priced under ``schedule`` from now on, and
        neither the partition nor the depth changes again before the policies' cool-downs."""
        self.schedule = schedule
        self.policy.migrated(step)
        self.depth_policy.changed(step)

    def _migration_cost(
        self, window: PipelineWindow, new: Partition, comm: CommModel, past_pauses_s: Sequence[float]
    ) -> float:
        """Measured mean pause of past migrations, else an estimate: a drain (one step) plus the transfer."""
        if past_pauses_s:
            return sum(past_pauses_s) / len(past_pauses_s)
        layers = self.model_cost.layers
        moved = sum(
            layers[m.layer_idx].param_bytes + layers[m.layer_idx].optimizer_state_bytes
            for m in plan_moves(window.partition, new)
        )
        return window.step_s + float(comm.transfer_time(moved))
