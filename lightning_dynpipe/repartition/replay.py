"""Detection without a cluster: drive an :class:`~lightning_dynpipe.repartition.AdaptiveController` with monitor
windows from a synthetic pipeline (or any function of step and partition), cheaply and deterministically.

A replay is the adaptive loop with the pipeline replaced by a function ``windows(step, partition) -> window``:
at every ``every`` steps the controller checks the window, and a repartition decision switches the partition the
next windows are drawn under (the migration itself is free here; its estimated cost still enters the policy). The
same policy objects as in a fit (:class:`~lightning_dynpipe.repartition.policy.GainOverCostPolicy`,
:mod:`~lightning_dynpipe.repartition.rules`) and the same predictors are used, so a replay answers "how many steps
after the onset does this policy decide, and does it move on noise alone" in milliseconds per check, the same way
on every run. ``benchmarks/predictor.py`` reports detection this way; ``benchmarks/interference.py`` measures it in
real fits.

:class:`SyntheticPipeline` is a pipeline with a known truth, deliberately not what the baseline predictor assumes:
under a CPU quota of ``q`` cores a stage's compute stretches by ``1 + (1/q - 1) * u**2``, ``u`` its CPU demand over
what the quota gives it per step (1 at the bottleneck), and is never below ``work / q`` per step, so the stretch
depends on how much work the partition gives the stage. A CPU hog of duty ``d`` on a stage's core stretches it by
``1 + d``; a boundary's message costs latency + bytes/bandwidth + delay (+- jitter), plus ``bytes / throttle`` on a
bandwidth-throttled link. Measurement noise is log-normal per window, with optional short spikes.

Example::

    from lightning_dynpipe.repartition import AdaptiveController, GainOverCostPolicy
    from lightning_dynpipe.repartition.replay import Env, SyntheticPipeline, replay, synthetic_model_cost

    cost = synthetic_model_cost()
    pipe = SyntheticPipeline(cost, timeline=[(0, Env()), (100, Env(quota=(None, 0.25)))], seed=0)
    controller = AdaptiveController(GainOverCostPolicy(), model_cost=cost, comm=pipe.link, schedule="async",
                                    num_microbatches=4)
    result = replay(controller, pipe.window, Partition((5, 5)), steps=400, every=10)
    result.first_move_after(100)     # steps from the onset to the first repartition decision (None: never)

Pure numpy (no torch, no Lightning).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor.base import PipelineWindow, StageTimes
from lightning_dynpipe.repartition.controller import AdaptiveController

__all__ = [
    "Env",
    "LINK",
    "SyntheticPipeline",
    "Move",
    "ReplayResult",
    "replay",
    "synthetic_model_cost",
    "true_compute",
    "message_s",
    "synthetic_window",
    "two_stage_partitions",
]


@dataclass(frozen=True)
class Env:
    """Interference per stage and on every boundary, and the measurement noise.

    Attributes:
        hog: per stage, the duty of a CPU hog on its core (stretches its compute by ``1 + hog``).
        quota: per stage, a CPU quota in cores (``None``: none).
        delay_s: delay added to every message.
        jitter_s: half-width of the delay's jitter (shows up as the messages' spread).
        throttle_Bps: a bandwidth limit on the link (``inf``: none); a message also waits ``bytes / throttle_Bps``.
        noise: standard deviation of the log-normal noise of each window's times.
        spike: probability per window and stage of a short spike (one window 1.5x slower).
        name: a label, not compared.
    """

    hog: tuple[float, ...] = (0.0, 0.0)
    quota: tuple[float | None, ...] = (None, None)
    delay_s: float = 0.0
    jitter_s: float = 0.0
    noise: float = 0.02
    name: str = field(default="", compare=False)
    throttle_Bps: float = math.inf
    spike: float = 0.0


def synthetic_model_cost(num_layers: int = 10, seed: int = 0) -> ModelCost:
    """A profile of ``num_layers`` layers of uneven compute (0.5-2 ms forward, backward twice that) and activations."""
    rng = np.random.default_rng(seed)
    fwd = rng.uniform(0.5e-3, 2e-3, num_layers)
    act = (rng.integers(1, 64, num_layers) * 16384).tolist()
    return ModelCost.from_arrays(
        fwd.tolist(), (2 * fwd).tolist(), activation_bytes=act, param_bytes=[1 << 20] * num_layers
    )


LINK = CommModel(latency_s=50e-6, bandwidth_Bps=1e9)
"""The synthetic pipeline's link model (what a set-up probe would measure)."""


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


def message_s(cost: ModelCost, partition: Partition, env: Env, b: int, link: CommModel = LINK) -> float:
    """Seconds per message across boundary ``b`` of ``partition`` (no noise)."""
    nbytes = cost.layers[partition.stage_layers(b)[-1]].activation_bytes
    throttled = nbytes / env.throttle_Bps if math.isfinite(env.throttle_Bps) else 0.0
    return float(link.transfer_time(nbytes)) + env.delay_s + throttled


def true_step_s(cost: ModelCost, partition: Partition, env: Env, M: int, link: CommModel = LINK) -> float:
    """The noiseless step time of ``partition``: the slowest stage's compute plus its blocking sends.

    Every send waits its message time on the sender (as the injected delay does), so stage ``k`` pays ``M``
    messages per boundary it sends across (activations forward, gradients back).
    """
    compute, _ = true_compute(cost, partition, env, M)
    S = partition.num_stages
    msgs = [message_s(cost, partition, env, b, link) for b in range(S - 1)]
    per_stage = [compute[k] + M * sum(msgs[b] for b in (k - 1, k) if 0 <= b < S - 1) for k in range(S)]
    return max(per_stage)


def synthetic_window(
    cost: ModelCost, partition: Partition, env: Env, M: int, rng: np.random.Generator, link: CommModel = LINK
) -> PipelineWindow:
    """One monitor window of the synthetic pipeline (with measurement noise)."""
    S = partition.num_stages
    compute, step = true_compute(cost, partition, env, M)
    msgs = [message_s(cost, partition, env, b, link) for b in range(S - 1)]
    stages = []
    for k in range(S):
        noisy = compute[k] * math.exp(rng.normal(0.0, env.noise))
        if env.spike > 0 and rng.random() < env.spike:
            noisy *= 1.5
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


def two_stage_partitions(num_layers: int = 10) -> list[Partition]:
    """Every 2-stage partition of ``num_layers`` layers."""
    return [Partition((i, num_layers - i)) for i in range(1, num_layers)]


class SyntheticPipeline:
    """A synthetic pipeline whose environment follows a timeline: ``(start_step, Env)`` entries, in step order.

    Args:
        cost: the layers' profile (the truth is computed from it; the controller gets the same profile).
        timeline: ``(start_step, env)`` pairs; the first must start at step 0.
        num_microbatches: ``M``.
        seed: the noise's seed (the same seed gives the same windows for the same partitions).
        link: the link model.
        window_steps: steps per monitor window; a window is drawn under the environment of its first step, so an
            onset shows in the first window that lies wholly after it (as a window's medians would).
    """

    def __init__(
        self,
        cost: ModelCost,
        timeline: Sequence[tuple[int, Env]],
        *,
        num_microbatches: int = 4,
        seed: int = 0,
        link: CommModel = LINK,
        window_steps: int = 10,
    ) -> None:
        steps = [s for s, _ in timeline]
        if not timeline or steps[0] != 0 or steps != sorted(steps):
            raise ConfigurationError(
                f"A timeline needs (start_step, Env) entries in step order, the first at step 0; got starts {steps}. "
                "Begin with (0, Env()) for a clean start."
            )
        self.cost = cost
        self.timeline = list(timeline)
        self.num_microbatches = num_microbatches
        self.link = link
        self.window_steps = window_steps
        self._rng = np.random.default_rng(seed)

    def env(self, step: int) -> Env:
        """The environment at ``step``."""
        return [e for s, e in self.timeline if s <= step][-1]

    def window(self, step: int, partition: Partition) -> PipelineWindow:
        """The window that ends at ``step`` under ``partition``."""
        env = self.env(max(step - self.window_steps + 1, 0))
        return synthetic_window(self.cost, partition, env, self.num_microbatches, self._rng, self.link)

    def step_s(self, step: int, partition: Partition) -> float:
        """The noiseless step time at ``step`` under ``partition``."""
        return true_step_s(self.cost, partition, self.env(step), self.num_microbatches, self.link)

    def best_step_s(self, step: int, candidates: Sequence[Partition]) -> float:
        """The noiseless step time of the best of ``candidates`` at ``step`` (the rebalancing limit's oracle)."""
        return min(self.step_s(step, p) for p in candidates)


@dataclass(frozen=True)
class Move:
    """A repartition decision of a replay: at ``step``, from ``old`` to ``new``."""

    step: int
    old: Partition
    new: Partition


@dataclass(frozen=True)
class ReplayResult:
    """What a replay did: its moves, the partition at every check, and the controller's decisions.

    Attributes:
        moves: every repartition decision, in order.
        partitions: ``(step, partition)`` at every check (before the check's decision applies).
        steps: the replay's length.
    """

    moves: tuple[Move, ...]
    partitions: tuple[tuple[int, Partition], ...]
    steps: int

    def first_move_after(self, onset: int) -> int | None:
        """Steps from ``onset`` to the first repartition decision at or after it (``None``: none)."""
        return next((m.step - onset for m in self.moves if m.step >= onset), None)

    def moves_between(self, start: int, stop: int) -> int:
        """Repartition decisions in ``[start, stop)``."""
        return sum(start <= m.step < stop for m in self.moves)

    def partition_at(self, step: int) -> Partition:
        """The partition in use at ``step`` (a decision applies from the step after its check)."""
        current = self.partitions[0][1]
        for m in self.moves:
            if m.step < step:
                current = m.new
        return current


def replay(
    controller: AdaptiveController,
    windows: Callable[[int, Partition], PipelineWindow],
    start: Partition,
    *,
    steps: int,
    every: int = 10,
    signs: bool = True,
) -> ReplayResult:
    """Runs the adaptive loop on ``windows`` for ``steps`` steps, a check every ``every`` steps.

    Args:
        controller: the controller to drive (its policy and predictor decide; it keeps its decisions).
        windows: the window that ends at a step under a partition (e.g. :meth:`SyntheticPipeline.window`, or a
            lookup into recorded windows).
        start: the partition at step 0.
        steps: how long the run is (``remaining_steps`` counts down to it).
        every: steps per monitor window.
        signs: give the controller each window's signs of interference (:meth:`PipelineWindow.signs
            <lightning_dynpipe.predictor.base.PipelineWindow.signs>`), as the strategy does; ``False``: none, so
            every slowdown looks unexplained.
    """
    if steps < 1 or every < 1:
        raise ConfigurationError(f"replay needs steps >= 1 and every >= 1; got {steps} and {every}.")
    current = start
    moves: list[Move] = []
    seen: list[tuple[int, Partition]] = []
    for step in range(every, steps + 1, every):
        window = windows(step, current)
        seen.append((step, current))
        decision = controller.check(
            step, window.stages, current, remaining_steps=steps - step, stage_signs=window.signs() if signs else ()
        )
        if decision is not None and decision.repartition and decision.partition != current:
            moves.append(Move(step, current, decision.partition))
            current = Partition(decision.partition.balance)
            controller.migrated(step)
    close = getattr(controller.predictor, "close", None)
    if callable(close):  # a learning predictor's background refit ends with the replay
        close()
    return ReplayResult(tuple(moves), tuple(seen), steps)
