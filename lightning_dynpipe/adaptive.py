"""The adaptive loop: measured stage statistics -> slowdowns -> re-plan -> policy -> live migration.

:class:`AdaptiveController` listens to the stage monitor. At every snapshot (the same on every rank) it
compares each stage's measured forward+backward time with what the set-up profile predicts for its layers;
the ratio, relative to the least slowed stage, is that stage's slowdown (a co-located job, a CPU quota, a
slower device). A stage whose process runs under a cgroup CPU limit of ``q < 1`` core is at least ``1/q``
slowed, whatever its compute looked like: under a quota the measured stretch shrinks as the stage's share
of the work shrinks (the throttling lands in its waits too), which hid the better partition. The planner
then re-solves the partition with those slowdowns and the measured share of communication that the
pipeline hides, both the current partition and the best one are scored in predicted time to accuracy, and
the policy decides. Every decision is kept (and logged on rank 0) with its inputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_dynpipe.plan.auto import best_plan
from lightning_dynpipe.plan.costs import CommModel, DefaultCostModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.plan.solver import evaluate
from lightning_dynpipe.repartition.plan import plan_moves
from lightning_dynpipe.repartition.policy import Decision, PolicyInputs, RepartitionPolicy

if TYPE_CHECKING:
    from lightning_dynpipe.strategy import DynPipeStrategy

__all__ = ["AdaptiveController", "measured_slowdowns", "StageTimes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageTimes:
    """Per-step medians of one stage over the monitor's window (seconds)."""

    compute_s: float  # forward + backward
    step_s: float
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    cpu_limit: float | None = None  # cgroup CPU bandwidth limit of the stage's process, cores; None: none


def measured_slowdowns(
    model_cost: ModelCost, partition: Partition, times: list[StageTimes], num_microbatches: int
) -> tuple[float, ...]:
    """Each stage's measured compute over the profile's prediction, relative to the least slowed stage.

    A stage under a CPU limit of ``q < 1`` core (``StageTimes.cpu_limit``) counts as at least ``1/q`` slowed.

    Example::

        >>> cost = ModelCost.from_arrays([1.0] * 4, [2.0] * 4)
        >>> measured_slowdowns(cost, Partition((2, 2)), [StageTimes(12.0, 0), StageTimes(48.0, 0)], 2)
        (1.0, 4.0)
        >>> measured_slowdowns(cost, Partition((2, 2)), [StageTimes(12.0, 0), StageTimes(18.0, 0, cpu_limit=0.25)], 2)
        (1.0, 4.0)
    """
    ratios = []
    for k, t in enumerate(times):
        expected = num_microbatches * sum(model_cost.layers[i].compute_s for i in partition.stage_layers(k))
        ratios.append(t.compute_s / expected if expected > 0 and t.compute_s > 0 else 1.0)
    base = min(ratios)
    return tuple(
        max(r / base, 1.0 / t.cpu_limit if t.cpu_limit is not None and 0 < t.cpu_limit < 1 else 1.0)
        for r, t in zip(ratios, times)
    )


class AdaptiveController:
    """Re-plans at every monitor snapshot and asks the strategy to repartition when the policy says so.

    Example::

        controller = AdaptiveController(strategy, GainOverCostPolicy())
        monitor.add_listener(controller)       # the strategy wires this when adaptive=True

    Args:
        strategy: the running :class:`~lightning_dynpipe.DynPipeStrategy` (it holds the profile, the
            partition and :meth:`~lightning_dynpipe.DynPipeStrategy.repartition`).
        policy: decides whether the planner's candidate is worth a migration.
    """

    def __init__(self, strategy: DynPipeStrategy, policy: RepartitionPolicy) -> None:
        self.strategy = strategy
        self.policy = policy
        self.decisions: list[Decision] = []

    def check(self, step: int, times: list[StageTimes], remaining_steps: int | None) -> Decision | None:
        """One check with per-stage measurements; returns the decision (``None`` when it cannot decide)."""
        s = self.strategy
        cost, part = s.model_cost, s.partition
        if cost is None or part is None or s._pending_partition is not None or len(times) != part.num_stages:
            return None
        M = s.num_microbatches
        slowdowns = measured_slowdowns(cost, part, times, M)
        comm_s = sum(t.comm_s for t in times)
        overlap = 1.0 - sum(t.exposed_comm_s for t in times) / comm_s if comm_s > 0 else 0.0
        comm = CommModel(
            latency_s=s.comm.latency_s, bandwidth_Bps=s.comm.bandwidth_Bps, overlap=min(max(overlap, 0.0), 1.0)
        )
        dp = s.topology.dp_size
        device_slowdowns = [slowdowns[k] for k in range(part.num_stages) for _ in range(dp)]
        schedule: Any = "async" if s.schedule == "async" else "sync"
        current = evaluate(
            cost,
            Partition(part.balance, (dp,) * part.num_stages),
            schedule=schedule,
            convergence=s.convergence,
            cost_model=DefaultCostModel(comm),
            slowdowns=device_slowdowns,
            num_microbatches=M,
        )
        candidate = best_plan(
            cost,
            part.num_stages * dp,
            num_stages=part.num_stages,
            schedule=schedule,
            convergence=s.convergence,
            comm=comm,
            num_microbatches=M,
            slowdowns=device_slowdowns,
        )
        inputs = PolicyInputs(
            step=step,
            current=Partition(part.balance),
            candidate=Partition(candidate.partition.balance),
            current_step_s=current.time_to_accuracy_s * M,
            candidate_step_s=candidate.time_to_accuracy_s * M,
            measured_step_s=max(t.step_s for t in times),
            migration_cost_s=self._migration_cost(cost, part, Partition(candidate.partition.balance), times, comm),
            remaining_steps=remaining_steps,
            slowdowns=slowdowns,
        )
        decision = self.policy.decide(inputs)
        self.decisions.append(decision)
        log.debug("DynPipe adaptation: %s", decision)  # a repartition is also reported by the strategy (rank 0)
        if decision.repartition:
            s.repartition(decision.partition)
            self.policy.migrated(step)
        return decision

    def _migration_cost(
        self, cost: ModelCost, old: Partition, new: Partition, times: list[StageTimes], comm: CommModel
    ) -> float:
        """Measured mean pause of past migrations, else an estimate: a drain (one step) plus the transfer."""
        past = [m.pause_s for m in self.strategy.migrations]
        if past:
            return sum(past) / len(past)
        moved = sum(
            cost.layers[m.layer_idx].param_bytes + cost.layers[m.layer_idx].optimizer_state_bytes
            for m in plan_moves(old, new)
        )
        return max(t.step_s for t in times) + float(comm.transfer_time(moved))
