"""Whole-run planning on a fixed number of processes, and the simulated timeline of a plan.

Every process runs the Lightning loop, so a plan must use all ``world_size`` processes: ``S`` stages times
``world_size / S`` pipeline replicas. :func:`best_plan` asks the exact solver for every admissible ``S`` and
keeps the one with the least predicted time to accuracy; :func:`simulate_plan` turns a plan into per-stage
compute and per-boundary communication times for the schedule simulator.
"""

from __future__ import annotations

from lightning_dynpipe.errors import PartitionError
from lightning_dynpipe.plan.convergence import ConvergenceModel
from lightning_dynpipe.plan.costs import CommModel, DefaultCostModel, ModelCost
from lightning_dynpipe.plan.solver import Plan, solve
from lightning_dynpipe.schedule.kinds import Schedule, get_schedule
from lightning_dynpipe.schedule.simulator import SimResult, StepSync, simulate

__all__ = ["best_plan", "simulate_plan"]


def best_plan(
    model_cost: ModelCost,
    world_size: int,
    *,
    num_stages: int | None = None,
    schedule: Schedule | str = "async",
    convergence: ConvergenceModel | None = None,
    comm: CommModel | None = None,
    num_microbatches: int | None = None,
    slowdowns: list[float] | None = None,
    memory_cap: float | None = None,
) -> Plan:
    """The plan with the least predicted time to accuracy that uses all ``world_size`` processes.

    Example::

        >>> cost = ModelCost.from_arrays([1.0] * 6, [2.0] * 6, param_bytes=[4] * 6)
        >>> best_plan(cost, 2, num_stages=2).partition.balance
        (3, 3)

    Args:
        model_cost: per-layer costs (from the profiler).
        world_size: processes; ``S`` must divide it (the rest are pipeline replicas).
        num_stages: fix ``S``; default: every divisor of ``world_size`` up to the number of layers.
        schedule: a :class:`~lightning_dynpipe.schedule.Schedule` or its name.
        convergence: the staleness model.
        comm: the measured link; default: no communication charged.
        num_microbatches: ``M``.
        slowdowns: per-process slowdown factors (runtime adaptation).
        memory_cap: bytes per process.
    """
    n = model_cost.num_layers
    candidates = (
        [num_stages] if num_stages is not None else [s for s in range(1, min(world_size, n) + 1) if world_size % s == 0]
    )
    best: Plan | None = None
    reasons: list[str] = []
    for s in candidates:
        try:
            plan = solve(
                model_cost,
                num_devices=world_size,
                fixed_num_stages=s,
                dp=world_size // s,
                schedule=schedule,
                convergence=convergence,
                cost_model=DefaultCostModel(comm or CommModel()),
                num_microbatches=num_microbatches,
                slowdowns=slowdowns,
                memory_cap=memory_cap,
            )
        except PartitionError as exc:
            reasons.append(f"S={s}: {exc}")
            continue
        if best is None or plan.time_to_accuracy_s < best.time_to_accuracy_s:
            best = plan
    if best is None:
        raise PartitionError(
            f"No feasible plan of {candidates} stages on {world_size} processes: " + "; ".join(reasons)
        )
    return best


def simulate_plan(
    plan: Plan,
    model_cost: ModelCost,
    *,
    schedule: Schedule | str = "async",
    num_microbatches: int = 4,
    num_steps: int = 6,
    comm: CommModel | None = None,
    step_sync: StepSync = "none",
) -> SimResult:
    """Simulates ``num_steps`` steps of ``plan`` with its per-stage compute, update and per-boundary transfer times.

    Each boundary's time is the transfer of the activation that crosses it (gradients have the same size)
    times the part that 1F1B does not hide (``1 - comm.overlap``).
    """
    comm = comm or CommModel()
    bounds = plan.partition.boundaries
    S = plan.partition.num_stages
    fwd = [sum(model_cost.layers[i].forward_s for i in range(bounds[k], bounds[k + 1])) for k in range(S)]
    bwd = [sum(model_cost.layers[i].backward_s for i in range(bounds[k], bounds[k + 1])) for k in range(S)]
    upd = [model_cost.update_s(bounds[k], bounds[k + 1]) for k in range(S)]
    overlap: list[float] = (
        [float(v) for v in comm.overlap_per_cut(model_cost.num_layers)] if model_cost.num_layers > 1 else []
    )
    comm_time = []
    for k in range(S - 1):
        cut = bounds[k + 1] - 1  # the boundary follows this layer
        hidden = float(overlap[cut])
        comm_time.append(float(comm.transfer_time(model_cost.layers[cut].activation_bytes)) * (1.0 - hidden))
    return simulate(
        get_schedule(schedule),
        S,
        num_microbatches,
        num_steps,
        forward_time=fwd,
        backward_time=bwd,
        update_time=upd,
        comm_time=comm_time or 0.0,
        step_sync=step_sync,
    )
