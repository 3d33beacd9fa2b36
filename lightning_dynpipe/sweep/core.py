"""The calibration sweep: the user's own layer sets, measured on this machine under the injection toolkit's scenarios.

What trains the :class:`~lightning_dynpipe.predictor.ForestPredictor` without the user: ``python -m lightning_dynpipe
calibrate`` runs it from the command line, and ``DynPipeStrategy(predictor="forest", calibrate=True)`` runs it at
set-up, on global rank 0, before the first step (every rank then fits the same forest on its rows).

The sweep, in one worker process pinned to one core with one torch thread (what a stage of
``benchmarks/interference.py`` runs as; :mod:`~lightning_dynpipe.sweep.worker`):

1. for a few candidate partitions (spread around the compute-balanced one), runs each stage's layer set as a stage
   would: ``M`` forward+backward passes per step, each followed by the wait for the slowest other stage, with the
   stage monitor's sampler reading CPU share, run-queue wait, context switches, other load;
2. under each scenario (:data:`SCENARIOS`), applied to one stage: a CPU hog on the worker's core at a duty cycle, a
   CPU limit on the worker (cgroup quota where allowed, else the SIGSTOP throttle), or an emulated slower link
   across the boundaries: a delay with jitter, and a bandwidth, per message (measured over a local socket pair
   carrying the boundary's activation bytes);
3. measures the same way the partitions the planner proposes from those windows (:func:`planned_partitions`:
   under a slower link, for example, the cut at a smaller activation), which the adaptive loop's solve would
   propose under each scenario; the forest is sure only of layer sets it has measured;
4. pairs every two partitions measured under the same scenario (the environment seen under one, the times measured
   under the other: what pricing a partition that has not run needs) into the forest's labelled rows.

Each run is a few steps: the whole sweep takes tens of seconds for a small model.
"""

from __future__ import annotations

import io
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.interference import CpuHog, CpuLimit, InterferenceUnavailable, allowed_cores
from lightning_dynpipe.interference.link import DelayInjector
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor import LabelledSamples, PipelineWindow, StageTimes
from lightning_dynpipe.predictor.features import estimate_fixed_s, samples_from_windows

__all__ = [
    "Scenario",
    "SCENARIOS",
    "DEFAULT_SCENARIOS",
    "SweepSettings",
    "SweepResult",
    "CalibrationRun",
    "candidate_partitions",
    "planned_partitions",
    "run_sweep",
    "median_reading",
    "calibration_samples",
    "calibrate_pipeline",
]


@dataclass(frozen=True)
class Scenario:
    """One interference setting of the sweep, applied to ``stage`` (or to every boundary for a link scenario).

    Attributes:
        name: its name on the command line.
        kind: ``"none"``, ``"hog"`` (duty cycle ``value``), ``"limit"`` (``value`` cores) or ``"delay"``
            (``value`` seconds per message, ``jitter_s`` either way, ``bandwidth_Bps`` for its bytes).
        value: see ``kind``.
        stage: the stage it applies to (-1: the last).
        jitter_s: for ``"delay"``.
        bandwidth_Bps: for ``"delay"``: the emulated link's bandwidth (``math.inf``: unlimited).
    """

    name: str
    kind: str
    value: float = 0.0
    stage: int = -1
    jitter_s: float = 0.0
    bandwidth_Bps: float = math.inf


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("none", "none"),
        Scenario("hog100", "hog", 1.0, 0),
        Scenario("hog50", "hog", 0.5, -1),
        Scenario("quota25", "limit", 0.25, -1),
        Scenario("quota50", "limit", 0.5, 0),
        Scenario("quota75", "limit", 0.75, -1),
        Scenario("delay", "delay", 5e-3, 0, 2e-3),
        Scenario("delay1", "delay", 1e-3, 0, 0.5e-3),
        Scenario("slowlink", "delay", 1e-3, 0, 0.5e-3, 20e6),
    )
}
"""The scenarios ``--scenarios`` can name."""


DEFAULT_SCENARIOS: tuple[str, ...] = ("none", "hog50", "quota50", "quota25", "delay")
"""What ``calibrate=True`` runs at set-up: no interference, a half-duty hog, a half-core limit on the first stage's
layer sets and a quarter-core limit on the last stage's, a link delay. A limit on the last stage's layer sets (a
small last stage's time is mostly its fixed costs, which a limit stretches) is measured because without it the
forest priced a limited last stage from the first stage's rows, with intervals of up to +70%, and held a CNN under
a quarter-core quota in one seed of three (``benchmarks/results/2026-12-06-material-gain.md``)."""


@dataclass(frozen=True)
class SweepSettings:
    """What a calibration sweep measures: ``DynPipeStrategy(calibrate=SweepSettings(...))``.

    Attributes:
        scenarios: names from :data:`SCENARIOS`.
        partitions: candidate partitions measured under each scenario (around the compute-balanced one).
        steps: measured steps per window (one more warms up).
        balances: the partitions to measure instead (layers per stage), e.g. ``((2, 7), (3, 6))``.
        core: the core the worker runs on (default: the last one this process may use).
        clean_rounds: how many times each stage's layer set is measured without interference, in rounds over all
            of them; each keeps its median round (see :func:`run_sweep`).
        planned: then also measure, under every scenario, the partitions the planner proposes from the sweep's
            windows (:func:`planned_partitions`: what the adaptive loop's solve would propose under each scenario),
            up to ``partitions`` more; not with ``balances``. The forest's intervals are narrow only on layer sets
            it has measured, and these are the ones a decision is likely to judge.

    Raises:
        ConfigurationError: an unknown scenario, fewer than 2 partitions or steps, an empty balance list, fewer
            than 1 clean round.
    """

    scenarios: tuple[str, ...] = DEFAULT_SCENARIOS
    partitions: int = 3
    steps: int = 3
    balances: tuple[tuple[int, ...], ...] | None = None
    core: int | None = None
    clean_rounds: int = 3
    planned: bool = True

    def __post_init__(self) -> None:
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown or not self.scenarios:
            raise ConfigurationError(
                f"A calibration sweep names scenarios {list(self.scenarios)}; it needs at least one, each of "
                f"{list(SCENARIOS)} (unknown: {unknown})."
            )
        if self.partitions < 2 or self.steps < 2:
            raise ConfigurationError(
                f"A calibration sweep needs partitions >= 2 and steps >= 2 (pairs of partitions are its samples, "
                f"the first step warms up); got partitions={self.partitions}, steps={self.steps}."
            )
        if self.balances is not None and len(self.balances) < 2:
            raise ConfigurationError(f"A calibration sweep's balances name at least 2 partitions; got {self.balances}.")
        if self.clean_rounds < 1:
            raise ConfigurationError(
                f"A calibration sweep measures every layer set without interference at least once; got "
                f"clean_rounds={self.clean_rounds}."
            )


# ---------------------------------------------------------------------------------------------- the link
class _SocketLink:
    """A local socket pair with a reader thread: the time of one message, from before its delay to its arrival."""

    def __init__(self) -> None:
        self.a, self.b = socket.socketpair()
        self._go = threading.Event()
        self._got = threading.Event()
        self._need = 0
        self._stop = False
        self._thread = threading.Thread(target=self._read, name="dynpipe-calibrate-link", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._stop:
                return
            left = self._need
            while left > 0:
                chunk = self.b.recv(min(left, 1 << 20))
                if not chunk:
                    return
                left -= len(chunk)
            self._got.set()

    def message_s(self, nbytes: int, delay: DelayInjector | None) -> float:
        payload = b"\0" * max(1, nbytes)
        self._got.clear()
        self._need = len(payload)
        self._go.set()
        t0 = time.perf_counter()
        if delay is not None:
            time.sleep(delay.sample(nbytes))
        self.a.sendall(payload)
        if not self._got.wait(10.0):
            raise ConfigurationError("A calibration message over the local socket pair did not arrive in 10 s.")
        return time.perf_counter() - t0

    def comm_model(self) -> CommModel:
        """Latency and bandwidth of the pair, from a small and a large message (medians of 5)."""
        small = statistics.median(self.message_s(64, None) for _ in range(5))
        large = statistics.median(self.message_s(4 << 20, None) for _ in range(5))
        return CommModel(latency_s=small, bandwidth_Bps=(4 << 20) / max(large - small, 1e-9))

    def close(self) -> None:
        self._stop = True
        self._go.set()
        self._thread.join(1.0)
        self.a.close()
        self.b.close()


# ---------------------------------------------------------------------------------------------- the sweep
@dataclass(frozen=True)
class CalibrationRun:
    """One measured window: a scenario, a partition, and what every stage measured under it."""

    scenario: str
    window: PipelineWindow

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data."""
        return {
            "scenario": self.scenario,
            "balance": list(self.window.partition.balance),
            "num_microbatches": self.window.num_microbatches,
            "stages": [vars(t) for t in self.window.stages],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CalibrationRun:
        """The inverse of :meth:`to_dict`."""
        stages = tuple(StageTimes(**s) for s in data["stages"])
        return cls(
            data["scenario"], PipelineWindow(Partition(tuple(data["balance"])), stages, int(data["num_microbatches"]))
        )


def candidate_partitions(cost: ModelCost, num_stages: int, count: int) -> list[Partition]:
    """``count`` partitions around the compute-balanced one: each boundary moved together by a few layers."""
    from lightning_dynpipe.plan.auto import best_plan

    balanced = best_plan(cost, num_stages, num_stages=num_stages).partition.balance
    out: list[Partition] = [Partition(balanced)]
    shift = 1
    while len(out) < count and shift < cost.num_layers:
        for sign in (1, -1):
            bal = list(balanced)
            bal[0] += sign * shift
            bal[-1] -= sign * shift
            if min(bal) >= 1 and Partition(tuple(bal)) not in out and len(out) < count:
                out.append(Partition(tuple(bal)))
        shift += 1
    return out


def planned_partitions(
    cost: ModelCost, comm: CommModel, runs: Sequence[CalibrationRun], known: Sequence[Partition], limit: int
) -> list[Partition]:
    """The partitions the planner proposes from the windows of ``runs`` that are not in ``known``, at most ``limit``,
    in the order first proposed.

    For each window: the link as its messages measured it (:class:`~lightning_dynpipe.predictor.link.LinkEstimate`
    over ``comm``), each stage's slowdown as the measured predictor reads it, and the planner's best partition of as
    many stages under them (what the adaptive loop's solve proposes from such a window). The planner prices the
    default ``async`` schedule without a convergence model: the sweep does not know the run's, and a proposal only
    chooses what to measure; the run's own loop prices every candidate with its schedule.
    """
    from lightning_dynpipe.plan.auto import best_plan
    from lightning_dynpipe.predictor import MeasuredSlowdownPredictor
    from lightning_dynpipe.predictor.link import LinkEstimate

    seen, out = set(known), list[Partition]()
    for run in runs:
        if len(out) >= limit:
            break
        window = run.window
        link = LinkEstimate(comm).observe(cost, window).model()
        slowdowns = MeasuredSlowdownPredictor().predict(cost, link, window, window.partition).slowdowns
        S = window.partition.num_stages
        proposed = best_plan(
            cost,
            S,
            num_stages=S,
            comm=CommModel(latency_s=link.latency_s, bandwidth_Bps=link.bandwidth_Bps, overlap=window.comm_overlap),
            num_microbatches=window.num_microbatches,
            slowdowns=list(slowdowns),
        ).partition
        if proposed not in seen:
            seen.add(proposed)
            out.append(Partition(proposed.balance))
    return out


def _apply(scenario: Scenario, pid: int, core: int) -> Any:
    if scenario.kind == "hog":
        return CpuHog([core], duty_cycle=scenario.value)
    if scenario.kind == "limit":
        return CpuLimit(pid, scenario.value)
    return None


def run_sweep(
    cost: ModelCost,
    conn: Connection,
    pid: int,
    core: int,
    *,
    scenarios: Sequence[Scenario],
    partitions: Sequence[Partition],
    num_microbatches: int,
    steps: int,
    link: _SocketLink,
    clean_rounds: int = 1,
) -> list[CalibrationRun]:
    """Measures every partition under every scenario (see the module docstring); returns the windows.

    Every stage's layer set is measured without interference ``clean_rounds`` times, in rounds over all of them,
    and keeps its median round by compute time. Those readings are every scenario's stages that the scenario does
    not touch, so one window caught by a burst of other load on the machine (a window is a few steps, tens of
    milliseconds) would otherwise be the clean reading of its layer set under every scenario.
    """
    M = num_microbatches

    def measure(first: int, stop: int, other_per_mb: float) -> StageTimes:
        conn.send((first, stop, M, steps, other_per_mb))
        times: StageTimes = conn.recv()
        return times

    readings: dict[tuple[Partition, int], list[StageTimes]] = {}
    for _ in range(clean_rounds):
        for p in partitions:  # every stage's layer set without interference, at the pace of its partition
            profile = [cost.compute_s(r.start, r.stop) for r in (p.stage_layers(k) for k in range(p.num_stages))]
            for k in range(p.num_stages):
                r = p.stage_layers(k)
                readings.setdefault((p, k), []).append(measure(r.start, r.stop, max(profile)))
    clean = {key: median_reading(times) for key, times in readings.items()}
    runs: list[CalibrationRun] = []
    for sc in scenarios:
        for p in partitions:
            S = p.num_stages
            target = sc.stage % S
            stages = [clean[(p, k)] for k in range(S)]
            if sc.kind in ("hog", "limit"):
                source = _apply(sc, pid, core)
                try:
                    source.start()
                except InterferenceUnavailable as exc:
                    raise ConfigurationError(f"Scenario {sc.name!r} cannot run on this machine: {exc}") from exc
                try:
                    r = p.stage_layers(target)
                    others = max((stages[k].compute_s / M for k in range(S) if k != target), default=0.0)
                    stages[target] = measure(r.start, r.stop, others)
                finally:
                    source.stop()
            step = max(t.step_s for t in stages)
            delay = DelayInjector(sc.value, sc.jitter_s, len(runs), sc.bandwidth_Bps) if sc.kind == "delay" else None
            per_boundary = []
            for b in range(S - 1):
                nbytes = cost.layers[p.stage_layers(b)[-1]].activation_bytes
                per_step = [sum(link.message_s(nbytes, delay) for _ in range(M)) for _ in range(steps)]
                per_boundary.append(per_step)
            final = []
            for k, t in enumerate(stages):
                incoming = [per_boundary[b] for b in (k - 1, k) if 0 <= b < S - 1]
                comm = [sum(x) for x in zip(*incoming)] if incoming else [0.0]
                ordered = sorted(comm)
                spread = ordered[round(0.9 * (len(ordered) - 1))] - ordered[round(0.1 * (len(ordered) - 1))]
                median = statistics.median(comm)
                final.append(
                    StageTimes(
                        **{
                            **vars(t),
                            "step_s": step + median,
                            "comm_s": median,
                            "exposed_comm_s": median,
                            "comm_spread_s": spread,
                        }  # fmt: skip
                    )
                )
            runs.append(CalibrationRun(sc.name, PipelineWindow(p, tuple(final), M)))
    return runs


def median_reading(readings: Sequence[StageTimes]) -> StageTimes:
    """The reading of median compute time (the lower middle one of an even number), kept whole so that its
    fields (compute, step, CPU share) stay those of one window.

    Example::

        >>> slow, fast, mid = (StageTimes(compute_s=c, step_s=0.1) for c in (0.09, 0.02, 0.03))
        >>> median_reading([slow, fast, mid]).compute_s
        0.03
    """
    ordered = sorted(readings, key=lambda t: t.compute_s)
    return ordered[(len(ordered) - 1) // 2]


def calibration_samples(cost: ModelCost, comm: CommModel, runs: Sequence[CalibrationRun]) -> LabelledSamples:
    """Every ordered pair of windows of the same scenario: the environment of one, the times of the other.

    The stage priors carry the fixed cost per micro-batch and stage that the sweep's clean readings show across
    layer sets (:func:`~lightning_dynpipe.predictor.features.estimate_fixed_s`, from the windows of no interference,
    or of a link scenario, whose stages are the clean readings too; 0 without either).
    """
    by_scenario: dict[str, list[PipelineWindow]] = {}
    for r in runs:
        by_scenario.setdefault(r.scenario, []).append(r.window)
    clean = [r.window for r in runs if r.scenario in SCENARIOS and SCENARIOS[r.scenario].kind == "none"]
    if not clean:
        clean = [r.window for r in runs if r.scenario in SCENARIOS and SCENARIOS[r.scenario].kind == "delay"]
    fixed_s = estimate_fixed_s(cost, clean)
    parts = [
        samples_from_windows(cost, comm, a, b, fixed_s=fixed_s)
        for windows in by_scenario.values()
        for a in windows
        for b in windows
    ]
    return LabelledSamples.concat(parts)


@dataclass(frozen=True)
class SweepResult:
    """What :func:`calibrate_pipeline` measured.

    Attributes:
        runs: every measured window.
        comm: the local link's latency and bandwidth (the prior of the boundary rows).
        samples: the forest's labelled rows (:func:`calibration_samples`).
        seconds: the sweep's wall time, the worker's start included.
        core: the core the worker ran on.
        partitions: the partitions measured.
    """

    runs: list[CalibrationRun]
    comm: CommModel
    samples: LabelledSamples
    seconds: float
    core: int
    partitions: list[Partition] = field(default_factory=list)

    def summary(self) -> str:
        """One line for logs."""
        scenarios = len({r.scenario for r in self.runs})
        return (
            f"calibrated on {len(self.runs)} windows ({scenarios} scenarios x {len(self.partitions)} partitions, core "
            f"{self.core}) in {self.seconds:.1f} s: {len(self.samples)} stage rows, {len(self.samples.boundary_y)} "
            f"boundary rows; link {self.comm.latency_s * 1e6:.0f} us + {_gbps(self.comm.bandwidth_Bps)} GB/s"
        )


def calibrate_pipeline(
    pipeline: Any,
    sample: Any,
    cost: ModelCost,
    *,
    num_stages: int,
    num_microbatches: int,
    settings: SweepSettings | None = None,
    autocast_dtype: Any = None,
) -> SweepResult:
    """Runs the sweep on ``pipeline`` in a spawned worker; returns the windows and the forest's rows.

    Args:
        pipeline: the whole ``nn.Sequential``, on the CPU with real weights (it is pickled to the worker).
        sample: one micro-batch of what ``pipeline[0]`` takes (on the CPU).
        cost: the pipeline's profiled per-layer costs (the prior the rows are residuals over).
        num_stages: stages per candidate partition.
        num_microbatches: ``M``, micro-batches per step.
        settings: what to measure (default :class:`SweepSettings()`).
        autocast_dtype: the forwards run under CPU autocast to this dtype (a mixed-precision run).

    Raises:
        ConfigurationError: fewer than 2 stages, a balance that does not split the pipeline, a scenario this
            machine cannot run, a worker that does not start.
    """
    s = settings or SweepSettings()
    if num_stages < 2:
        raise ConfigurationError(f"A calibration sweep needs at least 2 stages (boundaries); got {num_stages}.")
    if s.balances is not None:
        partitions = [Partition(tuple(b)) for b in s.balances]
        bad = [p.balance for p in partitions if p.num_stages != num_stages or p.num_layers != cost.num_layers]
        if bad or any(min(p.balance) < 1 for p in partitions):
            raise ConfigurationError(
                f"A calibration sweep's balances {[p.balance for p in partitions]} must each split {cost.num_layers} "
                f"layers into {num_stages} stages of at least one layer."
            )
    else:
        partitions = candidate_partitions(cost, num_stages, s.partitions)
    core = s.core if s.core is not None else allowed_cores()[-1]
    t0 = time.perf_counter()
    conn, proc = _start_worker(pipeline, sample, core, autocast_dtype)
    link = _SocketLink()
    try:
        _wait_ready(conn, proc)
        comm = link.comm_model()
        scenarios = [SCENARIOS[n] for n in s.scenarios]

        def sweep(measured: list[Partition]) -> list[CalibrationRun]:
            return run_sweep(
                cost, conn, proc.pid, core, scenarios=scenarios, partitions=measured,
                num_microbatches=num_microbatches, steps=s.steps, link=link, clean_rounds=s.clean_rounds,
            )  # fmt: skip

        runs = sweep(partitions)
        more = planned_partitions(cost, comm, runs, partitions, s.partitions) if s.planned and not s.balances else []
        if more:
            runs += sweep(more)
            partitions = [*partitions, *more]
    except (EOFError, ConnectionError) as exc:
        raise ConfigurationError(f"The calibration worker ended early (exit code {proc.poll()}).") from exc
    finally:
        try:
            conn.send(None)
        except OSError:
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        link.close()
        conn.close()
    samples = calibration_samples(cost, comm, runs)
    return SweepResult(runs, comm, samples, time.perf_counter() - t0, core, partitions)


def _start_worker(
    pipeline: Any, sample: Any, core: int, autocast_dtype: Any
) -> tuple[Connection, subprocess.Popen[bytes]]:
    """Starts :mod:`~lightning_dynpipe.sweep.worker` in a fresh interpreter and sends it the pipeline.

    A fresh interpreter, not a ``multiprocessing`` spawn: spawn would import the user's script again in the worker
    (and a script without a ``__main__`` guard would start training there). So the pipeline's classes must be
    importable from a module; the worker gets this process's ``sys.path``.

    Raises:
        ConfigurationError: a layer whose class is defined in the script itself.
    """
    import torch

    in_script = sorted({type(m).__name__ for m in pipeline.modules() if type(m).__module__ == "__main__"})
    if in_script:
        raise ConfigurationError(
            f"The calibration sweep runs the pipeline in a fresh process, which cannot import classes defined in the "
            f"script being run (__main__): {in_script}. Move them into a module the script imports, or calibrate "
            "with `python -m lightning_dynpipe calibrate --model package.module:Class` and pass the saved forest."
        )
    payload = io.BytesIO()
    torch.save((pipeline, sample, core, autocast_dtype), payload)
    ours, theirs = socket.socketpair()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_dynpipe.sweep.worker", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
        )
    finally:
        theirs.close()
    conn = Connection(ours.detach())
    conn.send_bytes(payload.getbuffer())
    return conn, proc


def _wait_ready(conn: Connection, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    """Waits for the worker's "ready" (it imports torch and runs the pipeline once first)."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.5):
        if proc.poll() is not None:
            raise ConfigurationError(f"The calibration worker exited with code {proc.returncode} before it was ready.")
        if time.monotonic() > deadline:
            raise ConfigurationError(f"The calibration worker was not ready within {timeout_s:.0f} s.")
    if conn.recv() != "ready":
        raise ConfigurationError("The calibration worker did not start.")


def _gbps(bps: float) -> str:
    return "inf" if math.isinf(bps) else f"{bps / 1e9:.2f}"
