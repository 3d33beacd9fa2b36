"""An independent brute-force planner for small cases: enumerate every partition, score it with the public
building blocks (CostModel.stage_time, stage_memory, ConvergenceModel.iterations)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from lightning_dynpipe.plan import (
    ConvergenceModel,
    CostModel,
    DefaultCostModel,
    DeviceSpec,
    ModelCost,
    assign_devices,
    stage_memory,
    staleness_profile,
)


def compositions(n: int, num_stages: int) -> Iterator[tuple[int, ...]]:
    """Every way to split n layers into num_stages non-empty contiguous stages."""
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = (0, *cuts, n)
        yield tuple(bounds[k + 1] - bounds[k] for k in range(num_stages))


@dataclass
class BruteForce:
    objective: float  # inf when nothing fits
    num_stages: int | None
    dp: int | None
    balance: tuple[int, ...] | None
    partitions_scored: int


def score(
    model: ModelCost,
    balance: Sequence[int],
    dp: int,
    *,
    num_devices: int,
    schedule: str = "async",
    convergence: ConvergenceModel,
    cost_model: CostModel,
    slowdowns: Sequence[float] | None,
    memory_cap: float | Sequence[float] | None,
    num_microbatches: int | None,
) -> float:
    """Predicted time to accuracy of one partition; inf if a stage exceeds its memory cap."""
    S = len(balance)
    slow = list(slowdowns) if slowdowns is not None else [1.0] * num_devices
    if memory_cap is None:
        caps = [math.inf] * num_devices
    elif isinstance(memory_cap, (int, float)):
        caps = [float(memory_cap)] * num_devices
    else:
        caps = list(memory_cap)
    ids = assign_devices(slow, S, dp)
    bounds = [0, *itertools.accumulate(balance)]
    mpu = num_microbatches if schedule == "sync" else 1
    assert mpu is not None
    times = []
    for k in range(S):
        dev = DeviceSpec(min(caps[d] for d in ids[k]), max(slow[d] for d in ids[k]))
        mem = stage_memory(
            model, [bounds[k]], [bounds[k + 1]], stage_idx=k, num_stages=S, schedule=schedule,  # type: ignore[arg-type]
            num_microbatches=num_microbatches,
        )[0]  # fmt: skip
        if mem > dev.memory_cap_bytes:
            return math.inf
        t = cost_model.stage_time(
            model, np.asarray([bounds[k]]), np.asarray([bounds[k + 1]]), stage_idx=k, num_stages=S, replicas=dp,
            device=dev, microbatches_per_update=mpu,
        )  # fmt: skip
        times.append(float(np.asarray(t).reshape(-1)[0]))
    params = [model.param_bytes(bounds[k], bounds[k + 1]) for k in range(S)]
    iterations = convergence.iterations(staleness_profile(S, schedule), params)
    if schedule.startswith("async"):  # "async" or "async+d"
        iteration_time = max(times)
    else:
        iteration_time = ((mpu - 1) * max(times) + sum(times)) / mpu
    return iterations * iteration_time


def brute_force(
    model: ModelCost,
    *,
    num_devices: int,
    max_stages: int | None = None,
    fixed_num_stages: int | None = None,
    dp: int | None = 1,
    schedule: str = "async",
    convergence: ConvergenceModel | None = None,
    cost_model: CostModel | None = None,
    slowdowns: Sequence[float] | None = None,
    memory_cap: float | Sequence[float] | None = None,
    num_microbatches: int | None = None,
) -> BruteForce:
    convergence = convergence or ConvergenceModel()
    cost_model = cost_model or DefaultCostModel()
    n = model.num_layers
    if fixed_num_stages is not None:
        stage_counts = [fixed_num_stages]
    else:
        stage_counts = list(range(1, min(max_stages or num_devices, num_devices, n) + 1))
    best = BruteForce(math.inf, None, None, None, 0)
    for S in stage_counts:
        for width in [dp] if dp is not None else range(1, num_devices // S + 1):
            if S * width > num_devices:
                continue
            for balance in compositions(n, S):
                best.partitions_scored += 1
                value = score(
                    model, balance, width, num_devices=num_devices, schedule=schedule, convergence=convergence,
                    cost_model=cost_model, slowdowns=slowdowns, memory_cap=memory_cap,
                    num_microbatches=num_microbatches,
                )  # fmt: skip
                if value < best.objective:
                    best.objective, best.num_stages, best.dp, best.balance = value, S, width, balance
    return best
