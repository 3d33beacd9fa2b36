"""``python -m lightning_dynpipe calibrate``: train the interference forest here, with the model's own layers.

Example::

    python -m lightning_dynpipe calibrate --model lightning_dynpipe.demos:MLP --init-args '{"width": 384}' \\
        --batch-size 64 --num-stages 2 --out dynpipe-forest.npz

then ``DynPipeStrategy(predictor=ForestPredictor.load("dynpipe-forest.npz"))``.

The sweep, in one worker process pinned to one core with one torch thread (what a stage of
``benchmarks/interference.py`` runs as):

1. profiles the pipeline's layers (the set-up profile a run would take);
2. for a few candidate partitions (``--partitions``, spread around the balanced one), runs each stage's layer set
   as a stage would: ``M`` forward+backward passes per step, each followed by the wait for the slowest other
   stage, with the stage monitor's sampler reading CPU share, run-queue wait, context switches, other load;
3. under each scenario (``--scenarios``) of the injection toolkit, applied to one stage: a CPU hog on the
   worker's core at a duty cycle, a CPU limit on the worker (cgroup quota where allowed, else the SIGSTOP
   throttle), or an emulated slower link across the boundaries: a delay with jitter, and a bandwidth, per message
   (measured over a local socket pair carrying the boundary's activation bytes);
4. pairs every two partitions measured under the same scenario (the environment seen under one, the times
   measured under the other: what pricing a partition that has not run needs), fits the
   :class:`~lightning_dynpipe.predictor.ForestPredictor` and saves it (rows, schema, versions; no pickle).

Each run is a few steps: the whole sweep takes tens of seconds for a small model.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import socket
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.interference import CpuHog, CpuLimit, InterferenceUnavailable, allowed_cores
from lightning_dynpipe.interference.link import DelayInjector
from lightning_dynpipe.monitor.stats import StageSample, StageSummary
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor import ForestPredictor, LabelledSamples, PipelineWindow, StageTimes
from lightning_dynpipe.predictor.features import samples_from_windows

__all__ = ["main", "build_parser", "Scenario", "SCENARIOS", "CalibrationRun", "run_sweep", "calibration_samples"]


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


def build_parser() -> argparse.ArgumentParser:
    """The ``calibrate`` command's arguments."""
    p = argparse.ArgumentParser(prog="python -m lightning_dynpipe calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the LightningModule class, as 'package.module:Class'")
    p.add_argument("--init-args", default="{}", help="JSON object of keyword arguments for the class")
    p.add_argument("--pipeline-attr", default="pipeline", help="attribute holding the nn.Sequential")
    p.add_argument("--batch-size", type=int, required=True, help="the Lightning batch size")
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--num-stages", type=int, default=2)
    p.add_argument("--input-shape", default=None, help="per-sample input shape, e.g. '784'")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {list(SCENARIOS)}")
    p.add_argument("--partitions", type=int, default=5, help="candidate partitions per scenario")
    p.add_argument(
        "--balances", default=None,
        help="the partitions to measure instead, layers per stage, e.g. '2,7;3,6;4,5' (overrides --partitions)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=6, help="steps per measured window")
    p.add_argument("--core", type=int, default=None, help="the core the worker runs on (default: the last allowed)")
    p.add_argument("--out", default="dynpipe-forest.npz", help="where to save the forest")
    p.add_argument("--runs-out", default=None, help="also save every measured window as JSON (for benchmarks)")
    return p


# ---------------------------------------------------------------------------------------------- the worker
def _worker(
    conn: Connection, model: str, init_args: str, attr: str, shape: str | None, micro_batch: int, core: int
) -> None:
    """Runs layer sets as a stage would, on command; answers with a :class:`StageTimes` per window."""
    import torch

    from lightning_dynpipe.cli.plan import _load_model, _sample
    from lightning_dynpipe.interference import pin_current_process
    from lightning_dynpipe.monitor.system import ProcessSampler

    pin_current_process([core])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = _load_model(model, init_args)
    pipeline: Any = module
    for part in attr.split("."):
        pipeline = getattr(pipeline, part)
    x = _sample(module, shape, micro_batch)
    inputs = [x]
    with torch.no_grad():
        for layer in pipeline:
            inputs.append(layer(inputs[-1]))
    sampler = ProcessSampler(steal_interval_s=0.2)
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        first, stop, M, steps, other_per_mb = cmd
        sampler.refresh()  # the interference may have changed since the last window
        samples = []
        for _ in range(steps + 1):  # the first step warms up and is dropped
            sampler.mark()
            t_step = time.perf_counter()
            fwd = bwd = 0.0
            for _ in range(M):
                t0 = time.perf_counter()
                h = inputs[first].detach().requires_grad_(inputs[first].is_floating_point())
                for i in range(first, stop):
                    h = pipeline[i](h)
                t1 = time.perf_counter()
                h.float().sum().backward()
                t2 = time.perf_counter()
                fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
                wait = other_per_mb - (t2 - t0)
                if wait > 0:
                    time.sleep(wait)
            step_s = time.perf_counter() - t_step
            stats = _Step(fwd, bwd, step_s, M)
            samples.append(StageSample.from_step(stats, sampler.sample()))
        pipeline.zero_grad(set_to_none=True)
        conn.send(StageTimes.from_summary(StageSummary.of(samples[1:])))
    sampler.close()


@dataclass(frozen=True)
class _Step:
    forward_s: float
    backward_s: float
    step_s: float
    m: int
    optimizer_s: float = 0.0
    recv_wait_s: float = 0.0
    send_s: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    in_flight: int = 0
    stash_depth: int = 0

    @property
    def num_forward(self) -> int:
        return self.m

    @property
    def num_backward(self) -> int:
        return self.m

    @property
    def num_updates(self) -> int:
        return 0


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


def _parse_balances(text: str, num_stages: int, num_layers: int) -> list[Partition]:
    """``'2,7;3,6'`` -> partitions; each must have ``num_stages`` stages over ``num_layers`` layers."""
    out = []
    for item in text.split(";"):
        try:
            balance = tuple(int(x) for x in item.split(","))
        except ValueError as exc:
            raise ConfigurationError(f"--balances takes 'a,b;c,d' (layers per stage); got {text!r}.") from exc
        if len(balance) != num_stages or sum(balance) != num_layers or min(balance) < 1:
            raise ConfigurationError(
                f"--balances: {item!r} is not a split of {num_layers} layers into {num_stages} stages of at least "
                "one layer each."
            )
        out.append(Partition(balance))
    return out


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
) -> list[CalibrationRun]:
    """Measures every partition under every scenario (see the module docstring); returns the windows."""
    M = num_microbatches

    def measure(first: int, stop: int, other_per_mb: float) -> StageTimes:
        conn.send((first, stop, M, steps, other_per_mb))
        times: StageTimes = conn.recv()
        return times

    clean: dict[tuple[Partition, int], StageTimes] = {}
    for p in partitions:  # every stage's layer set without interference, at the pace of its partition
        profile = [cost.compute_s(r.start, r.stop) for r in (p.stage_layers(k) for k in range(p.num_stages))]
        for k in range(p.num_stages):
            r = p.stage_layers(k)
            clean[(p, k)] = measure(r.start, r.stop, max(profile))
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


def calibration_samples(cost: ModelCost, comm: CommModel, runs: Sequence[CalibrationRun]) -> LabelledSamples:
    """Every ordered pair of windows of the same scenario: the environment of one, the times of the other."""
    by_scenario: dict[str, list[PipelineWindow]] = {}
    for r in runs:
        by_scenario.setdefault(r.scenario, []).append(r.window)
    parts = [
        samples_from_windows(cost, comm, a, b) for windows in by_scenario.values() for a in windows for b in windows
    ]
    return LabelledSamples.concat(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``calibrate`` command; returns the exit status."""
    import torch

    from lightning_dynpipe.cli.plan import _load_model, _sample
    from lightning_dynpipe.profiling import optimizer_state_factor, profile_layers

    a = build_parser().parse_args(argv)
    unknown = [s for s in a.scenarios.split(",") if s and s not in SCENARIOS]
    if unknown:
        raise ConfigurationError(f"--scenarios names {unknown}; the known scenarios are {list(SCENARIOS)}.")
    scenarios = [SCENARIOS[s] for s in a.scenarios.split(",") if s]
    if a.num_stages < 2 or a.partitions < 2 or a.steps < 2:
        raise ConfigurationError(
            f"calibrate needs --num-stages >= 2, --partitions >= 2 and --steps >= 2; got {a.num_stages}, "
            f"{a.partitions}, {a.steps}."
        )
    cores = allowed_cores()
    core = a.core if a.core is not None else cores[-1]
    torch.set_num_threads(1)
    module = _load_model(a.model, a.init_args)
    pipeline: Any = module
    for part in a.pipeline_attr.split("."):
        pipeline = getattr(pipeline, part)
    micro_batch = max(1, a.batch_size // a.num_microbatches)
    optimizer = module.configure_optimizers() if hasattr(module, "configure_optimizers") else None
    if isinstance(optimizer, dict):
        optimizer = optimizer.get("optimizer")
    factor = optimizer_state_factor(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else 2.0
    cost = profile_layers(
        pipeline, _sample(module, a.input_shape, micro_batch), optimizer_state_bytes_per_param_byte=factor
    ).to_model_cost()
    partitions = (
        _parse_balances(a.balances, a.num_stages, cost.num_layers)
        if a.balances
        else candidate_partitions(cost, a.num_stages, a.partitions)
    )
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_worker,
        args=(child, a.model, a.init_args, a.pipeline_attr, a.input_shape, micro_batch, core),
        daemon=True,
    )
    t0 = time.perf_counter()
    proc.start()
    link = _SocketLink()
    try:
        if parent.recv() != "ready":
            raise ConfigurationError("The calibration worker did not start.")
        comm = link.comm_model()
        runs = run_sweep(
            cost,
            parent,
            proc.pid or 0,
            core,
            scenarios=scenarios,
            partitions=partitions,
            num_microbatches=a.num_microbatches,
            steps=a.steps,
            link=link,
        )
    finally:
        parent.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
        link.close()
    samples = calibration_samples(cost, comm, runs)
    forest = ForestPredictor().fit(samples)
    path = forest.save(a.out)
    print(
        f"calibrated on {len(runs)} windows ({len(scenarios)} scenarios x {len(partitions)} partitions, core {core}) "
        f"in {time.perf_counter() - t0:.1f} s: {len(samples)} stage rows, {len(samples.boundary_y)} boundary rows; "
        f"link {comm.latency_s * 1e6:.0f} us + {_gbps(comm.bandwidth_Bps)} GB/s"
    )
    print(f"forest saved to {path} (load it with ForestPredictor.load({str(path)!r}))")
    if a.runs_out:
        with open(a.runs_out, "w") as fh:
            json.dump({"layers": cost.to_arrays(), "comm": [comm.latency_s, comm.bandwidth_Bps],
                       "runs": [r.to_dict() for r in runs]}, fh)  # fmt: skip
        print(f"windows saved to {a.runs_out}")
    return 0


def _gbps(bps: float) -> str:
    return "inf" if math.isinf(bps) else f"{bps / 1e9:.2f}"
