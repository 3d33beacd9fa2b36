"""The adaptive loop's decision: a measured window -> predicted costs -> re-plan -> policy -> a decision.

:class:`AdaptiveController` is given everything explicitly (the set-up profile, the link, the schedule, the
predictor and the policy) and returns a :class:`~lightning_dynpipe.repartition.policy.Decision`; the strategy
applies it (a live migration at the next step). At every check the predictor turns the window measured under
the current partition into each stage's slowdown; the planner then re-solves the partition with those
slowdowns and the measured share of communication the pipeline hides, both the current partition and the
best one are scored in predicted time to accuracy, and the policy decides. Every decision is kept with its
inputs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from lightning_dynpipe.plan.auto import best_plan
from lightning_dynpipe.plan.convergence import ConvergenceModel
from lightning_dynpipe.plan.costs import CommModel, DefaultCostModel, ModelCost
from lightning_dynpipe.plan.moves import plan_moves
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.plan.solver import evaluate
from lightning_dynpipe.predictor.base import InterferencePredictor, PipelineWindow, StageTimes
from lightning_dynpipe.predictor.measured import MeasuredSlowdownPredictor, measured_slowdowns
from lightning_dynpipe.repartition.policy import Decision, PolicyInputs, RepartitionPolicy
from lightning_dynpipe.schedule import Schedule, get_schedule

__all__ = ["AdaptiveController", "measured_slowdowns", "StageTimes"]

log = logging.getLogger(__name__)


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
        predictor: turns a measured window into per-stage slowdowns; default
            :class:`~lightning_dynpipe.predictor.MeasuredSlowdownPredictor`.
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
    ) -> None:
        self.policy = policy
        self.model_cost = model_cost
        self.comm = comm
        self.schedule = get_schedule(schedule)
        self.num_microbatches = num_microbatches
        self.replicas = replicas
        self.convergence = convergence
        self.predictor: InterferencePredictor = predictor if predictor is not None else MeasuredSlowdownPredictor()
        self.decisions: list[Decision] = []

    def check(
        self,
        step: int,
        times: Sequence[StageTimes],
        partition: Partition,
        remaining_steps: int | None,
        past_pauses_s: Sequence[float] = (),
    ) -> Decision | None:
        """One check with the window's per-stage medians; ``None`` when it cannot decide (wrong stage count).

        Args:
            step: the Lightning step of the check.
            times: one :class:`StageTimes` per stage, measured under ``partition``.
            partition: the partition in use.
            remaining_steps: steps left in the run (``None`` if unknown).
            past_pauses_s: the measured pauses of earlier migrations (the next one is priced at their mean).
        """
        if len(times) != partition.num_stages:
            return None
        cost, M, dp = self.model_cost, self.num_microbatches, self.replicas
        window = PipelineWindow(Partition(partition.balance), tuple(times), M)
        slowdowns = self.predictor.predict(cost, self.comm, window, window.partition).slowdowns
        comm = CommModel(
            latency_s=self.comm.latency_s, bandwidth_Bps=self.comm.bandwidth_Bps, overlap=window.comm_overlap
        )
        device_slowdowns = [slowdowns[k] for k in range(partition.num_stages) for _ in range(dp)]
        current = evaluate(
            cost,
            Partition(partition.balance, (dp,) * partition.num_stages),
            schedule=self.schedule,
            convergence=self.convergence,
            cost_model=DefaultCostModel(comm),
            slowdowns=device_slowdowns,
            num_microbatches=M,
        )
        candidate = best_plan(
            cost,
            partition.num_stages * dp,
            num_stages=partition.num_stages,
            schedule=self.schedule,
            convergence=self.convergence,
            comm=comm,
            num_microbatches=M,
            slowdowns=device_slowdowns,
        )
        new = Partition(candidate.partition.balance)
        inputs = PolicyInputs(
            step=step,
            current=window.partition,
            candidate=new,
            current_step_s=current.time_to_accuracy_s * M,
            candidate_step_s=candidate.time_to_accuracy_s * M,
            measured_step_s=window.step_s,
            migration_cost_s=self._migration_cost(window, new, comm, past_pauses_s),
            remaining_steps=remaining_steps,
            slowdowns=slowdowns,
        )
        decision = self.policy.decide(inputs)
        self.decisions.append(decision)
        log.debug("DynPipe adaptation: %s", decision)  # a repartition is also reported by the strategy (rank 0)
        return decision

    def migrated(self, step: int) -> None:
        """Tells the policy that the decision of ``step`` was applied (its cool-down starts)."""
        self.policy.migrated(step)

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
