"""A synthetic pipeline under interference, with a known truth, for the predictor's unit tests.

The truth is deliberately not what the baseline assumes: under a CPU quota of ``q`` cores a stage's compute
stretches by ``1 + (1/q - 1) * u**2``, ``u`` its CPU demand over what the quota gives it per step (1 at the
bottleneck), and is never below ``work / q`` per step, so the stretch depends on how much work the partition gives
the stage. A CPU hog of duty ``d`` on a
stage's core stretches it by ``1 + d``; a boundary's message costs latency + bytes/bandwidth + delay (+- jitter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor.base import PipelineWindow, StageTimes


@dataclass(frozen=True)
class Env:
    """Interference per stage (hog duty, quota in cores or None) and on every boundary (delay, jitter)."""

    hog: tuple[float, ...] = (0.0, 0.0)
    quota: tuple[float | None, ...] = (None, None)
    delay_s: float = 0.0
    jitter_s: float = 0.0
    noise: float = 0.02
    name: str = field(default="", compare=False)


def model_cost(num_layers: int = 10, seed: int = 0) -> ModelCost:
    rng = np.random.default_rng(seed)
    fwd = rng.uniform(0.5e-3, 2e-3, num_layers)
    act = (rng.integers(1, 64, num_layers) * 16384).tolist()
    return ModelCost.from_arrays(
        fwd.tolist(), (2 * fwd).tolist(), activation_bytes=act, param_bytes=[1 << 20] * num_layers
    )


LINK = CommModel(latency_s=50e-6, bandwidth_Bps=1e9)


def true_compute(cost: ModelCost, partition: Partition, env: Env, M: int) -> tuple[list[float], float]:
    """Per stage, compute seconds per step, and the step time, from the truth model (no noise)."""
    S = partition.num_stages
    work = [M * cost.compute_s(r.start, r.stop) for r in (partition.stage_layers(k) for k in range(S))]
    need = [w * (1.0 + env.hog[k]) for k, w in enumerate(work)]
    step = max(need)
    compute = list(need)
    for _ in range(60):
        compute = []
        for k in range(S):
            q = env.quota[k]
            if q is None or q >= 1:
                compute.append(need[k])
                continue
            u = min(1.0, work[k] / (q * step))
            # and never faster than the quota allows: work / q per step (what effective_compute_s measures)
            compute.append(max(need[k] * (1.0 + (1.0 / q - 1.0) * u * u), work[k] / q))
        step = 0.5 * step + 0.5 * max(compute)
    return compute, max(compute)


def message_s(cost: ModelCost, partition: Partition, env: Env, b: int) -> float:
    last = partition.stage_layers(b)[-1]
    return float(LINK.transfer_time(cost.layers[last].activation_bytes)) + env.delay_s


def window(cost: ModelCost, partition: Partition, env: Env, M: int, rng: np.random.Generator) -> PipelineWindow:
    """One monitor window of the synthetic pipeline (with measurement noise)."""
    S = partition.num_stages
    compute, step = true_compute(cost, partition, env, M)
    msgs = [message_s(cost, partition, env, b) for b in range(S - 1)]
    stages = []
    for k in range(S):
        noisy = compute[k] * math.exp(rng.normal(0.0, env.noise))
        n_in = M * ((k > 0) + (k < S - 1))
        per_msg = [msgs[b] for b in (k - 1, k) if 0 <= b < S - 1]
        comm = M * sum(per_msg) * math.exp(rng.normal(0.0, env.noise))
        work = M * cost.compute_s(partition.stage_layers(k).start, partition.stage_layers(k).stop)
        step_k = step + (comm if k == S - 1 else 0.0)
        q = env.quota[k]
        stages.append(
            StageTimes(
                compute_s=noisy,
                step_s=step_k,
                comm_s=comm,
                exposed_comm_s=0.5 * comm,
                cpu_limit=q,
                comm_spread_s=2 * env.jitter_s * n_in / 2,
                cpu_share=min(work / step_k, 1.0),
                run_queue_wait_share=env.hog[k] * 0.5,
                other_cpu_load=env.hog[k],
                ctx_switches_per_s=100.0 * env.hog[k],
                rss_bytes=200e6,
            )
        )
    return PipelineWindow(partition, tuple(stages), M)


def partitions(num_layers: int = 10) -> list[Partition]:
    return [Partition((i, num_layers - i)) for i in range(1, num_layers)]
