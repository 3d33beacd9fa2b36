"""Throughput of a 2-stage pipeline: DynPipe ``async`` / ``sync`` / ``gpipe`` vs torch's 1F1B and GPipe.

Every system trains the same model (the MNIST :class:`~lightning_dynpipe.demos.MLP`), split into the same
two stages, on the same fixed random batches of MNIST shape, with the same ``M`` micro-batches per batch and
the same SGD learning rate. The script launches two worker processes itself (gloo on 127.0.0.1, one CPU
thread per worker, i.e. one core per stage). Inside the workers it loops::

    for rep in range(repeats):
        for system in systems rotated by rep:    # interleaved, so slow phases of a shared machine hit all
            train warmup + steps batches, time the last `steps`

* DynPipe runs through the real Lightning ``Trainer`` (hooks, ``self.log``, the per-step WORLD broadcast
  from global rank 0), exactly what a user gets. The workers set ``LOCAL_RANK`` / ``NODE_RANK`` /
  ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``, so Lightning's ``LightningEnvironment`` treats them as
  externally launched and reuses the process group they already initialised. The clock runs on global
  rank 0 (DynPipe's last stage) from ``on_train_batch_start`` of the first timed step to
  ``on_train_batch_end`` of the last; each stage's :class:`~lightning_dynpipe.engine.executor.StepStats`
  give the compute / wait breakdown.
* torch runs ``torch.distributed.pipelining``'s ``Schedule1F1B`` and ``ScheduleGPipe`` through
  :func:`benchmarks.baselines.torch_pipelining.time_torch_schedule` (no Lightning; clock between barriers).

At the start of every repeat both workers also time their stage's forward, backward and update of one
micro-batch alone (thread CPU time: no pipeline, no Lightning, no descheduling), and each run records its
processes' CPU use and run-queue wait (how long a stage was runnable while other processes had the core).

It prints a table (median samples/s, IQR, paired ratios to ``sync`` and to torch 1F1B), the per-stage
breakdown, the CPU table, and the dry-run simulator's prediction of every system's samples/s and of the
ratios from the isolated costs (:func:`lightning_dynpipe.schedule.simulate`, no step-end wait: DynPipe has
none); it writes raw repeats (JSON + CSV, with machine, versions and the
command line) to ``benchmarks/out/`` and a plot to ``docs/img/throughput.png``.

Usage (from the repository root)::

    .venv/bin/python benchmarks/throughput.py                 # the documented run (about 2 minutes on 2 cores)
    .venv/bin/python benchmarks/throughput.py --quick         # smoke run: tiny model, 1 repeat (~30 s)
    .venv/bin/python benchmarks/throughput.py --model gpt      # the GPT example's transformer, split after block 2
    .venv/bin/python benchmarks/throughput.py --repeats 5 --steps 30 --width 1024
    .venv/bin/python benchmarks/throughput.py --from-json benchmarks/out/throughput-<stamp>.json  # re-analyse
"""

from __future__ import annotations

import argparse
import csv
import functools
import gc
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `benchmarks` and the package importable
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import (  # noqa: E402
    close_group,
    command_line,
    describe_machine,
    fit_dynpipe,
    format_table,
    free_port,
    machine_info,
    median,
    quartiles,
    workers_done,
)

SYSTEMS: tuple[str, ...] = ("async", "sync", "gpipe", "torch-1f1b", "torch-gpipe")
"""Benchmark systems: DynPipe's three schedules, then torch.distributed.pipelining's two."""
EXTRA_SYSTEMS: tuple[str, ...] = (
    "async-defaults",
    "async-defaults-50",
    "async-forest",
    "async-forest-nowait",
    "async-forest-norefit",
    "async-forest-one-rank",
    "async-bare",
    "async-copy",
    "async-spare",
    "hand-async",
)
"""Run only when named in ``--systems``: ``async`` with the strategy's defaults (stage monitor every 10 steps and
the adaptive loop on, still starting from the same balance), the same with the monitor's snapshot every 50 steps
(``monitor_every_n_steps=50``: what the snapshot's cadence costs), the defaults with ``predictor="forest"`` (the
random forest learning online from every window, its refits in a child process: what the forest costs against the
default measured predictor), the same without waiting at set-up for the refit process's imports
(``ForestPredictor.prepare(timeout_s=0)``: they then run beside the first steps) and the same never refitting (its
rows and pricing only: an untrained forest prices with its prior), the same with each refit fitted on one rank and
broadcast to the others (``ForestPredictor(one_rank_refits=True)``; by default every rank fits every refit itself),
``async`` with both off, and ``async`` whose weight stash copies the live weights before each update instead of
letting SGD write fresh storage (:mod:`lightning_dynpipe.engine.outofplace` switched off), ``async`` whose SGD
writes the new weights into a released weight version's memory or new memory, never into the gradient's
(``async-spare``: :func:`~lightning_dynpipe.engine.outofplace.private_grad` answering ``False``), and PipeDream's
asynchronous 1F1B written by hand on raw gloo messages (``hand-async``, :mod:`benchmarks.baselines.handwritten`:
the same arithmetic and updates as ``async`` with no framework around them). ``async`` itself has the monitor on and
the adaptive loop off (it compares schedules on one fixed partition)."""
ALL_SYSTEMS = SYSTEMS + EXTRA_SYSTEMS

LABELS = {
    "async": "DynPipe async",
    "sync": "DynPipe sync",
    "gpipe": "DynPipe gpipe",
    "torch-1f1b": "torch Schedule1F1B",
    "torch-gpipe": "torch ScheduleGPipe",
    "async-defaults": "DynPipe async, defaults",
    "async-defaults-50": "DynPipe async, defaults, snapshot every 50",
    "async-forest": "DynPipe async, defaults, forest predictor",
    "async-forest-nowait": "DynPipe async, defaults, forest, imports beside the first steps",
    "async-forest-norefit": "DynPipe async, defaults, forest never refitting",
    "async-forest-one-rank": "DynPipe async, defaults, forest refitting on one rank",
    "async-bare": "DynPipe async, bare",
    "async-copy": "DynPipe async, stash copies",
    "async-spare": "DynPipe async, update into spares",
    "hand-async": "hand-written async, raw gloo",
}
NUM_STAGES = 2
WORLD_SIZE = NUM_STAGES

_DEFAULT_PLOT = _ROOT / "docs" / "img" / "throughput.png"


def default_plot(model: str) -> Path:
    """Where a run's plot goes by default: ``docs/img/throughput.png`` for the MLP, ``throughput-<model>.png`` for
    another model, so that one model's run does not overwrite another's documented plot."""
    return _DEFAULT_PLOT if model == "mlp" else _DEFAULT_PLOT.with_name(f"throughput-{model}.png")


_DEFAULT_OUT = _ROOT / "benchmarks" / "out"


@dataclass(frozen=True)
class Config:
    """Everything a worker needs; also recorded in the JSON output.

    Why this model (chosen once, before measuring): the demo MLP with width 512 and depth 8 has 9 layers and
    2.25 M parameters; balancing parameter counts (DynPipe's ``balance="parameters"``) splits it [4, 5], which
    also balances compute (stage 0 owns the 784-wide first layer but skips its input gradient). The split is
    passed to every system as an explicit list, so DynPipe's planner (``balance="auto"``) plays no part. With a
    batch of 256 in M=4 micro-batches of 64, one micro-batch costs a few ms of forward and about twice that of
    backward per stage, so a step is tens of ms of compute per stage on one core, while a message between the
    stages is 128 KiB: compute-bound, as pipeline parallelism assumes, and short enough for ten interleaved
    repeats in minutes. Ten repeats put each of the five systems in each position of the rotation exactly twice.
    """

    repeats: int = 10
    steps: int = 20
    warmup: int = 3
    width: int = 512
    depth: int = 8
    batch_size: int = 256
    num_microbatches: int = 4
    lr: float = 0.05
    balance: tuple[int, ...] = ()
    systems: tuple[str, ...] = SYSTEMS
    seed: int = 0
    timeout_s: float = 300.0
    sim_steps: int = 12
    model: str = "mlp"
    block_size: int = 64
    keep_freed_cpu_memory: bool = True


GPT_DEFAULTS = {"width": 128, "depth": 4, "batch_size": 32, "lr": 0.1}
"""``--model gpt``: the GPT example's transformer (CharGPT, d_model 128, 4 blocks, 64-token context, dropout
0.1), batch 32, M=4, split after the second block ([embedding + 2 blocks, 2 blocks + head]); plain SGD for every
system, as torch's runner steps SGD."""


# ---------------------------------------------------------------------------------------------- model / data
def _model(cfg: Config) -> Any:
    from lightning_dynpipe.demos import MLP, CharGPT

    torch.manual_seed(cfg.seed)  # identical initial weights for every system
    if cfg.model == "gpt":

        class SgdGPT(CharGPT):
            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=self.lr)

        return SgdGPT(block_size=cfg.block_size, d_model=cfg.width, n_layers=cfg.depth, lr=cfg.lr)
    return MLP(in_features=784, width=cfg.width, depth=cfg.depth, num_classes=10, lr=cfg.lr, optimizer="sgd")


def num_layers(cfg: Config) -> int:
    """Units of the model's pipeline: depth + 1 for the MLP, embedding + blocks + head for the GPT."""
    return cfg.depth + 2 if cfg.model == "gpt" else cfg.depth + 1


def _loss_fn(cfg: Config) -> Any:
    import torch.nn.functional as F

    if cfg.model == "gpt":
        return lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.cross_entropy


def describe_model(cfg: Config) -> str:
    """One line naming the model, for headers and plot titles."""
    if cfg.model == "gpt":
        return f"GPT d_model {cfg.width}, {cfg.depth} blocks, {cfg.block_size}-token context"
    return f"MLP width {cfg.width} depth {cfg.depth}"


def default_balance(width: int, depth: int, model: str = "mlp") -> tuple[int, ...]:
    """DynPipe's ``balance="parameters"`` split (balanced parameter counts), made explicit for every system."""
    from lightning_dynpipe.plan.partition import balance_by_weights

    if model == "gpt":  # after the middle block: [embedding + depth//2 blocks, the rest + head]
        return (1 + depth // 2, depth - depth // 2 + 1)
    cfg = Config(width=width, depth=depth)
    weights = [sum(p.numel() for p in layer.parameters()) for layer in _model(cfg).pipeline]
    return tuple(balance_by_weights(weights, NUM_STAGES).balance)


def _batches(cfg: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``warmup + steps`` fixed random batches of MNIST shape, identical in every process and system."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    if cfg.model == "gpt":  # token ids: the speed does not depend on their values
        shape = (cfg.batch_size, cfg.block_size)
        return [
            (torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g))
            for _ in range(cfg.warmup + cfg.steps)
        ]
    return [
        (torch.randn(cfg.batch_size, 1, 28, 28, generator=g), torch.randint(0, 10, (cfg.batch_size,), generator=g))
        for _ in range(cfg.warmup + cfg.steps)
    ]


# ---------------------------------------------------------------------------------------------- probes
class _CpuProbe:
    """CPU accounting of this process over a window: all threads' CPU time, the main thread's run-queue wait, and
    the time Python's cyclic garbage collector ran (wall time between its start and stop callbacks, with the
    number of collections of each generation).

    On a shared machine the run-queue wait (``/proc/self/task/<tid>/schedstat``, Linux) says how long this
    stage wanted a core but another process had it: the interference the interleaving cannot remove.
    """

    def __init__(self) -> None:
        import threading

        self._path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        self._t = self._cpu = 0.0
        self._sched: tuple[int, int] | None = None
        self._gc_s, self._gc_runs, self._gc_at = 0.0, [0, 0, 0], None  # type: tuple[float, list[int], float | None]
        self.result: dict[str, float] = {}

    def _read(self) -> tuple[int, int] | None:
        try:
            with open(self._path, encoding="ascii") as f:
                run_ns, wait_ns, _ = (int(v) for v in f.read().split())
            return run_ns, wait_ns
        except (OSError, ValueError):
            return None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # The collector runs in whichever thread allocated; CPython calls back before and after each collection.
        if phase == "start":
            self._gc_at = time.perf_counter()
        elif self._gc_at is not None:
            self._gc_s += time.perf_counter() - self._gc_at
            self._gc_runs[int(info["generation"])] += 1
            self._gc_at = None

    def start(self) -> None:
        self._gc_s, self._gc_runs, self._gc_at = 0.0, [0, 0, 0], None
        gc.callbacks.append(self._on_gc)
        self._t, self._cpu, self._sched = time.perf_counter(), time.process_time(), self._read()
        self._faults = _minor_faults()

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self._t
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self.result = {"wall_s": wall, "process_cpu_s": time.process_time() - self._cpu, "gc_s": self._gc_s}
        faults = _minor_faults()
        if faults is not None and self._faults is not None:
            self.result["minor_faults"] = float(faults - self._faults)
        self.result |= {f"gc_gen{g}_runs": float(n) for g, n in enumerate(self._gc_runs)}
        end = self._read()
        if self._sched is not None and end is not None:
            self.result["main_run_s"] = (end[0] - self._sched[0]) / 1e9
            self.result["main_runqueue_wait_s"] = (end[1] - self._sched[1]) / 1e9
        return self.result


def _minor_faults() -> int | None:
    """Minor page faults of this process so far (memory the system had to hand it again); ``None`` without
    ``resource``."""
    try:
        import resource
    except ImportError:  # not on Unix
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def _stage_module(cfg: Config, stage_idx: int) -> Any:
    pipeline = _model(cfg).pipeline
    cut = cfg.balance[0]
    return pipeline[:cut] if stage_idx == 0 else pipeline[cut:]


def _calibrate(cfg: Config, stage_idx: int, iters: int = 16) -> dict[str, float]:
    """CPU seconds of one micro-batch's forward, backward and one SGD update of ``stage_idx``, alone.

    No pipeline, no communication, no Lightning: the cost of the arithmetic itself. It is measured in the
    calling thread's CPU time (``time.thread_time``), not wall time, so that time this process spends
    descheduled by other load on a shared machine does not count; the simulator fed with these costs predicts
    what each schedule would reach with a dedicated core per stage and zero framework overhead. The last
    stage's forward includes the loss, as DynPipe's (which runs ``training_step``) does. ``stash`` is what a
    stashed weight version adds to one update under ``async`` (on a stage with staleness > 0, every update): SGD
    then writes the new weights to fresh storage (:mod:`lightning_dynpipe.engine.outofplace`), so it is that
    update's time over the in-place one's (every other update is timed each way). ``copy`` is one detached copy
    of the stage's parameters, what the stash costs with an optimizer that updates in place (``async-copy``).
    """
    import statistics

    from lightning_dynpipe.engine.outofplace import out_of_place_step

    stage = _stage_module(cfg, stage_idx)
    opt = torch.optim.SGD(stage.parameters(), lr=cfg.lr)
    mb = cfg.batch_size // cfg.num_microbatches
    g = torch.Generator().manual_seed(cfg.seed + 2)
    if cfg.model == "gpt":
        tokens = (mb, cfg.block_size)
        x = torch.randint(0, 256, tokens, generator=g)
        if stage_idx > 0:  # stage 1 starts after a block: the residual stream
            x = torch.randn(*tokens, cfg.width, generator=g).requires_grad_(True)
        y = torch.randint(0, 256, tokens, generator=g)
    elif stage_idx == 0:
        x = torch.randn(mb, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (mb,), generator=g)
    else:
        x = torch.randn(mb, cfg.width, generator=g).requires_grad_(True)  # stage 1 starts after a hidden block
        y = torch.randint(0, 10, (mb,), generator=g)
    loss_fn = _loss_fn(cfg)
    clock = time.thread_time
    fresh = out_of_place_step(opt)
    assert fresh is not None, "SGD on CPU writes fresh storage (lightning_dynpipe.engine.outofplace)"
    fwd: list[float] = []
    bwd: list[float] = []
    upd: list[float] = []
    upd_fresh: list[float] = []
    copy: list[float] = []
    for i in range(iters + 2):
        t0 = clock()
        out = stage(x)
        if stage_idx == NUM_STAGES - 1:
            out = loss_fn(out, y)
        t1 = clock()
        if stage_idx == NUM_STAGES - 1:
            out.backward()
        else:
            out.backward(torch.ones_like(out))
        t2 = clock()
        if i % 2:  # every other update writes fresh storage, as async's updates do while a version is stashed
            fresh()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = clock()
        snapshot = {n: p.detach().clone() for n, p in stage.named_parameters()}
        t4 = clock()
        del snapshot
        if i >= 2:  # the first iterations allocate
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            (upd_fresh if i % 2 else upd).append(t3 - t2)
            copy.append(t4 - t3)
    # what one stashed version costs async's update: the fresh-storage update's extra time over the in-place one
    stash = max(statistics.median(upd_fresh) - statistics.median(upd), 0.0)
    return {
        "forward": statistics.median(fwd),
        "backward": statistics.median(bwd),
        "update": statistics.median(upd),
        "stash": stash,
        "copy": statistics.median(copy),
    }


# ---------------------------------------------------------------------------------------------- runners
def _run_baseline(
    system: str, cfg: Config, rank: int, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, Any]:
    """torch's schedules and the hand-written loop: stage ``k`` on rank ``k``, the CPU probe around the timed
    steps (as DynPipe's: warm-up and set-up excluded)."""
    from benchmarks.baselines.handwritten import time_handwritten_async
    from benchmarks.baselines.torch_pipelining import time_torch_schedule

    stage = _stage_module(cfg, rank)
    args = (stage, rank, NUM_STAGES, cfg.num_microbatches, batches)
    probe = _CpuProbe()
    options: dict[str, Any] = {"lr": cfg.lr, "loss_fn": _loss_fn(cfg), "warmup_steps": cfg.warmup, "window": probe}
    ops = None
    if system == "hand-async":
        res = time_handwritten_async(*args, **options)
        seconds, n = res["seconds"], res["micro_batches"]
        ops = {f"{k}_cpu": v / n for k, v in res["op_cpu_s"].items()}
        ops |= {f"{k}_wall": v / n for k, v in res["op_wall_s"].items()}
    else:
        seconds = time_torch_schedule("1f1b" if system == "torch-1f1b" else "gpipe", *args, **options)
    cpu = probe.result
    gathered: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, {"rank": rank, "stage": rank, "cpu": cpu, "ops": ops})
    gathered.sort(key=lambda g: g["stage"])
    out = {"seconds": seconds, "stages": None, "cpu": [{k: v for k, v in g.items() if k != "ops"} for g in gathered]}
    if ops is not None:  # the hand-written loop's CPU and wall seconds per micro-batch in each kind of operation
        out["ops"] = [g["ops"] for g in gathered]
    return out


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _steal_share(start: tuple[float, float] | None, end: tuple[float, float] | None) -> float | None:
    """The share of the machine's CPU time the hypervisor gave to other guests between two readings."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return (end[0] - start[0]) / (end[1] - start[1])


def _start_peak_rss() -> int | None:
    """Resets this process's peak RSS (Linux ``clear_refs``) and returns its current RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return None
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def _peak_rss() -> int | None:
    """Peak RSS in bytes since :func:`_start_peak_rss` (``VmHWM``)."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def _step_timer(warmup: int, steps: int) -> Any:
    """A callback timing steps ``warmup .. warmup+steps-1`` and keeping this stage's StepStats of each."""
    from lightning.pytorch import Callback

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.start = self.end = float("nan")
            self.stage_idx = -1
            self.stats: list[dict[str, Any]] = []
            self.probe = _CpuProbe()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.stage_idx = int(trainer.strategy.stage_idx)
            stage = trainer.strategy.executor.stage_module
            self.param_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
            self.predicted_versions = trainer.strategy.config.schedule.max_stash(self.stage_idx, NUM_STAGES)

        def _refits(self, trainer: Any) -> tuple[float, float, float, float]:
            """A learning predictor's refits' CPU seconds (in its own process), refits adopted and skipped, and the
            seconds spent sending or receiving the fitting rank's forests (one-rank refits: a broadcast per switch)."""
            p = trainer.strategy.config.predictor
            return float(p.refit_cpu_s), float(p.refits), float(p.refits_skipped), float(getattr(p, "share_s", 0.0))

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == warmup:
                self.probe.start()
                self.start = time.perf_counter()
                if hasattr(trainer.strategy.config.predictor, "refit_cpu_s"):
                    self.refits0 = self._refits(trainer)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx >= warmup:
                self.stats.append(asdict(trainer.strategy.executor.stats))
            if batch_idx == warmup + steps - 1:
                self.end = time.perf_counter()
                self.probe.stop()
                if hasattr(trainer.strategy.config.predictor, "refit_cpu_s"):
                    cpu, adopted, skipped, share = (b - a for a, b in zip(self.refits0, self._refits(trainer)))
                    self.probe.result |= {
                        "refit_cpu_s": cpu,
                        "refits": adopted,
                        "refits_skipped": skipped,
                        "refit_share_s": share,
                    }

    return StepTimer()


def _run_dynpipe(system: str, cfg: Config, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    from lightning_dynpipe import DynPipeStrategy
    from lightning_dynpipe.predictor import ForestPredictor

    schedule = system.split("-")[0]
    options: dict[str, Any] = {"adaptive": False}  # compares schedules on one fixed partition
    if system == "async-defaults":
        options = {}  # monitor every 10 steps, adaptive loop on: what DynPipeStrategy() does
    elif system == "async-defaults-50":
        options = {"monitor_every_n_steps": 50}
    elif system == "async-forest":
        options = {"predictor": "forest"}
    elif system == "async-forest-nowait":
        forest = ForestPredictor()
        forest.prepare = functools.partial(forest.prepare, timeout_s=0.0)  # type: ignore[method-assign]
        options = {"predictor": forest}
    elif system == "async-forest-norefit":
        options = {"predictor": ForestPredictor(refit_every=2**31)}
    elif system == "async-forest-one-rank":
        options = {"predictor": ForestPredictor(one_rank_refits=True)}
    elif system == "async-bare":
        options = {"adaptive": False, "monitor_every_n_steps": None}
    strategy = DynPipeStrategy(
        num_microbatches=cfg.num_microbatches,
        schedule=schedule,  # type: ignore[arg-type]
        balance=list(cfg.balance),
        timeout=cfg.timeout_s,
        keep_freed_cpu_memory=cfg.keep_freed_cpu_memory,
        **options,
    )
    # batches holds warmup + steps batches, so the fit runs exactly those steps and the timer clocks the last.
    with stash_updates(system):
        return fit_dynpipe(_model(cfg), batches, strategy, _step_timer(cfg.warmup, cfg.steps), world_size=WORLD_SIZE)


@contextmanager
def stash_updates(system: str) -> Iterator[None]:
    """For ``async-copy``, no optimizer writes fresh storage in the block: the weight stash copies the live weights
    before each update it shares them with, as it did before (:mod:`lightning_dynpipe.engine.outofplace`). For
    ``async-spare``, no update writes the new weights into the gradients' memory."""
    from lightning_dynpipe.engine import outofplace

    saved = dict(outofplace.OUT_OF_PLACE_STEPS)
    private_grad = outofplace.private_grad
    if system == "async-copy":
        outofplace.OUT_OF_PLACE_STEPS.clear()
    if system == "async-spare":
        outofplace.private_grad = lambda param: False
    try:
        yield
    finally:
        outofplace.OUT_OF_PLACE_STEPS.update(saved)
        outofplace.private_grad = private_grad


def _quiet() -> None:
    import lightning.pytorch  # noqa: F401  (it sets its loggers' levels on import; override them after)

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_dynpipe"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*Your `IterableDataset` has `__len__` defined.*")
    warnings.filterwarnings("ignore", message=r".*srun.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
    warnings.filterwarnings("ignore", message=r".*defined a `validation_step` but have no `val_dataloader`.*")


def _worker(rank: int, cfg: Config, port: int, result_path: str) -> None:
    from lightning_dynpipe.engine.allocator import keep_freed_memory
    from lightning_dynpipe.monitor.system import machine_steal_counters

    os.environ.update(
        {
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(WORLD_SIZE),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.set_num_threads(1)  # one core per stage
    if cfg.keep_freed_cpu_memory:
        # every system, torch's included, runs with the allocator DynPipe's stages set (a process-wide setting):
        # otherwise the systems before the first DynPipe fit would pay glibc's page faults and the later ones not
        keep_freed_memory()
    _quiet()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    runs: list[dict[str, Any]] = []
    calibration: list[Any] = []
    try:
        batches = _batches(cfg)
        systems = list(cfg.systems)
        for rep in range(cfg.repeats):
            shift = rep % len(systems)
            order = systems[shift:] + systems[:shift]  # rotate: every system takes every position
            dist.barrier()
            costs: list[Any] = [None] * WORLD_SIZE
            dist.all_gather_object(costs, _calibrate(cfg, rank))  # rank k calibrates stage k, both at once
            calibration.append({"rep": rep, "stages": costs})
            for position, system in enumerate(order):
                load = os.getloadavg()[0]
                dist.barrier()
                steal_start = machine_steal_counters()
                rss_start = _start_peak_rss()
                if system.startswith(("torch-", "hand-")):
                    res = _run_baseline(system, cfg, rank, batches)
                else:
                    res = _run_dynpipe(system, cfg, batches)
                steal = _steal_share(steal_start, machine_steal_counters())
                memory: list[Any] = [None] * WORLD_SIZE
                dist.all_gather_object(memory, {"rank": rank, "rss_start": rss_start, "rss_peak": _peak_rss()})
                samples = cfg.steps * cfg.batch_size
                runs.append(
                    {
                        "rep": rep,
                        "position": position,
                        "system": system,
                        "seconds": res["seconds"],
                        "steps": cfg.steps,
                        "samples": samples,
                        "samples_per_s": samples / res["seconds"],
                        "load1": load,
                        "steal": steal,
                        "stages": res["stages"],
                        "cpu": res["cpu"],
                        "memory": memory,
                        "migrations": res.get("migrations", []),
                        "decisions": res.get("decisions", []),
                        "ops": res.get("ops"),
                    }
                )
                if rank == 0:
                    moves = "".join(
                        f", moved {m['old']} -> {m['new']} at step {m['step']}" for m in res.get("migrations", [])
                    )
                    print(
                        f"  rep {rep + 1}/{cfg.repeats}  {LABELS[system]:<20} {samples / res['seconds']:8.1f} samples/s"
                        f"  (load {load:.1f}" + (f", steal {steal:.0%}" if steal is not None else "") + f"{moves})",
                        flush=True,
                    )
        if rank == 0:
            Path(result_path).write_text(json.dumps({"runs": runs, "calibration": calibration}), encoding="utf-8")
        workers_done()
    finally:
        close_group()


# ---------------------------------------------------------------------------------------------- analysis
_STAT_KEYS = (
    "forward_s",
    "backward_s",
    "optimizer_s",
    "recv_wait_s",
    "send_s",
    "step_s",
    "num_forward",
    "num_backward",
    "num_updates",
)


def _per_step(stages: list[dict[str, Any]] | None) -> list[dict[str, float]] | None:
    """Per stage: mean per step of each StepStats field over the timed steps of one run."""
    if not stages:
        return None
    out = []
    for st in stages:
        steps = st["steps"]
        mean = {k: sum(s[k] for s in steps) / len(steps) for k in _STAT_KEYS}
        mean["stage"] = st["stage"]
        mean["wall_per_step_s"] = st["wall_s"] / len(steps)
        # Derived per run, before any median over repeats (a difference of medians need not be a median).
        compute = mean["forward_s"] + mean["backward_s"] + mean["optimizer_s"]
        mean["other_s"] = mean["step_s"] - compute - mean["recv_wait_s"] - mean["send_s"]
        mean["outside_s"] = mean["wall_per_step_s"] - mean["step_s"]
        out.append(mean)
    return out


def _costs_from_runs(runs: list[dict[str, Any]], system: str) -> dict[str, list[float]] | None:
    """Median over repeats of each stage's seconds per forward, backward and update inside DynPipe's executor."""
    per_rep = [p for p in (_per_step(r["stages"]) for r in runs if r["system"] == system) if p]
    if not per_rep:
        return None
    out: dict[str, list[float]] = {"forward": [], "backward": [], "update": []}
    for k in range(NUM_STAGES):
        out["forward"].append(median([p[k]["forward_s"] / max(p[k]["num_forward"], 1) for p in per_rep]))
        out["backward"].append(median([p[k]["backward_s"] / max(p[k]["num_backward"], 1) for p in per_rep]))
        out["update"].append(median([p[k]["optimizer_s"] / max(p[k]["num_updates"], 1) for p in per_rep]))
    return out


def _framework_costs_from_runs(runs: list[dict[str, Any]], system: str, cfg: Config) -> dict[str, list[float]] | None:
    """:func:`_costs_from_runs` plus the framework's time around the schedule's operations, per stage (medians
    over repeats): ``step_overhead`` = the step's time outside forward, backward, update, receive waits and sends
    (``other_s``: the executor's dispatch, the loss, ``training_step``, hooks inside the step) plus the time
    between steps (``outside_s``: Lightning's loop, the per-step broadcast's own cost); ``send_overhead`` =
    the sender's busy time per message (``send_s`` over the step's sends)."""
    base = _costs_from_runs(runs, system)
    per_rep = [p for p in (_per_step(r["stages"]) for r in runs if r["system"] == system) if p]
    if base is None or not per_rep:
        return None
    M = cfg.num_microbatches
    sends = [M * (1 if k in (0, NUM_STAGES - 1) else 2) for k in range(NUM_STAGES)]  # activations, gradients
    base["step_overhead"] = [median([p[k]["other_s"] + p[k]["outside_s"] for p in per_rep]) for k in range(NUM_STAGES)]
    base["send_overhead"] = [median([p[k]["send_s"] / sends[k] for p in per_rep]) for k in range(NUM_STAGES)]
    return base


def _costs_from_calibration(calibration: list[dict[str, Any]]) -> dict[str, list[float]] | None:
    """Median over repeats of each stage's isolated seconds per forward, backward and update."""
    if not calibration:
        return None
    kinds = [w for w in ("forward", "backward", "update", "stash", "copy") if w in calibration[0]["stages"][0]]
    return {what: [median([c["stages"][k][what] for c in calibration]) for k in range(NUM_STAGES)] for what in kinds}


def _simulate(kind: str, costs: dict[str, list[float]], cfg: Config, step_sync: str = "none") -> float:
    """Steady-state step time (s) of schedule ``kind`` in the dry-run simulator. No system of this benchmark waits for
    the last stage at a step's end (``step_sync="none"``): DynPipe runs Lightning's SIGTERM broadcast one batch late
    and applies the metrics mirror when it is read."""
    from lightning_dynpipe.schedule import simulate

    r = simulate(
        kind,  # type: ignore[arg-type]
        NUM_STAGES,
        cfg.num_microbatches,
        cfg.sim_steps,
        forward_time=costs["forward"],
        backward_time=costs["backward"],
        update_time=costs["update"],
        step_sync=step_sync,  # type: ignore[arg-type]
        step_overhead=costs.get("step_overhead", 0.0),
        send_overhead=costs.get("send_overhead", 0.0),
    )
    return r.steady_state_step_time


# The schedule each system is in the simulator.
_SIM_MODEL = {
    "async": "async",
    "sync": "sync",
    "gpipe": "gpipe",
    "torch-1f1b": "sync",
    "torch-gpipe": "gpipe",
    "async-defaults": "async",
    "async-defaults-50": "async",
    "async-forest": "async",
    "async-forest-nowait": "async",
    "async-forest-norefit": "async",
    "async-forest-one-rank": "async",
    "async-bare": "async",
    "async-copy": "async",
    "async-spare": "async",
    "hand-async": "async",
}


_FORESTS = ("async-forest", "async-forest-nowait", "async-forest-norefit", "async-forest-one-rank")


def ratio_table(runs: list[dict[str, Any]], systems: list[str]) -> dict[str, Any]:
    """Per system: median samples/s with quartiles, and ratios to the references paired by repeat."""
    by = {s: {r["rep"]: r for r in runs if r["system"] == s} for s in systems}
    table: dict[str, Any] = {}
    for s in systems:
        sps = [by[s][rep]["samples_per_s"] for rep in sorted(by[s])]
        q1, q3 = quartiles(sps)
        row: dict[str, Any] = {"median": median(sps), "q1": q1, "q3": q3, "n": len(sps)}
        for ref in ("sync", "torch-1f1b", "async-bare", "async-copy", "async-spare", "async-defaults", "hand-async"):
            only = {
                "async-bare": ("async-defaults", "async-defaults-50", *_FORESTS),
                "async-copy": ("async",),
                "async-spare": ("async",),
                "async-defaults": _FORESTS,
                "hand-async": ("async", "async-bare", "torch-1f1b"),
            }.get(ref)
            if ref in by and ref != s and (only is None or s in only):  # extra references: only their users
                # Paired: the two systems ran back to back in the same repeat, under about the same load.
                ratios = [
                    by[s][rep]["samples_per_s"] / by[ref][rep]["samples_per_s"] for rep in by[s] if rep in by[ref]
                ]
                rq1, rq3 = quartiles(ratios)
                row[f"vs_{ref}"] = {"median": median(ratios), "q1": rq1, "q3": rq3, "per_rep": ratios}
        table[s] = row
    return table


def summarise(runs: list[dict[str, Any]], calibration: list[dict[str, Any]], cfg: Config) -> dict[str, Any]:
    """Medians, IQRs and paired ratios per system; per-stage breakdown; CPU use; simulator predictions."""
    systems = [s for s in cfg.systems if any(r["system"] == s for r in runs)]
    by = {s: {r["rep"]: r for r in runs if r["system"] == s} for s in systems}
    table = ratio_table(runs, systems)

    breakdown: dict[str, Any] = {}
    for s in systems:
        per_rep = [p for p in (_per_step(by[s][rep]["stages"]) for rep in sorted(by[s])) if p]
        if not per_rep:
            continue
        stages = []
        for k in range(NUM_STAGES):
            fields = per_rep[0][k].keys() - {"stage"}
            stages.append({f: median([p[k][f] for p in per_rep]) for f in fields} | {"stage": k})
        breakdown[s] = stages

    cpu: dict[str, Any] = {}
    for s in systems:
        stages = []
        for k in range(NUM_STAGES):
            samples = [next(c["cpu"] for c in by[s][rep]["cpu"] if c["stage"] == k) for rep in sorted(by[s])]
            per_step = cfg.steps  # every system's probe covers its timed steps only
            entry = {
                "stage": k,
                "cores_used": median([c["process_cpu_s"] / c["wall_s"] for c in samples]),
                "cpu_per_step_s": median([c["process_cpu_s"] / per_step for c in samples]),
            }
            if all("gc_s" in c for c in samples):
                entry["gc_per_step_s"] = median([c["gc_s"] / per_step for c in samples])
                entry["gc_full_runs"] = median([c["gc_gen2_runs"] for c in samples])
            if all("minor_faults" in c for c in samples):
                entry["minor_faults_per_step"] = median([c["minor_faults"] / per_step for c in samples])
            if all("refit_cpu_s" in c for c in samples):  # a learning predictor's refits, in their own process
                entry["refit_cpu_per_step_s"] = median([c["refit_cpu_s"] / per_step for c in samples])
                entry["refits"] = median([c["refits"] for c in samples])
                entry["refits_skipped"] = median([c["refits_skipped"] for c in samples])
                entry["refit_share_per_step_s"] = median([c.get("refit_share_s", 0.0) / per_step for c in samples])
            if all("main_runqueue_wait_s" in c for c in samples):
                entry["main_runqueue_wait_share"] = median([c["main_runqueue_wait_s"] / c["wall_s"] for c in samples])
                entry["main_run_share"] = median([c["main_run_s"] / c["wall_s"] for c in samples])
            stages.append(entry)
        cpu[s] = stages

    predictions: dict[str, Any] = {}
    if "async" in cpu and "sync" in cpu:
        # If the stages are CPU-starved (oversubscribed machine), throughput follows CPU work per step, and the
        # bottleneck stage's work sets the pace.
        work = {s: max(st["cpu_per_step_s"] for st in cpu[s]) for s in cpu}
        predictions["cpu_work"] = {
            "bottleneck_cpu_per_step_s": work,
            "async_vs_sync": work["sync"] / work["async"],
            "async_vs_torch_1f1b": work["torch-1f1b"] / work["async"] if "torch-1f1b" in work else None,
        }
    sources = {
        "isolated": _costs_from_calibration(calibration),
        "inside_sync": _costs_from_runs(runs, "sync"),
    }
    for name, costs in sources.items():
        if costs is None:
            continue
        step = {s: _simulate(_SIM_MODEL[s], costs, cfg) for s in _SIM_MODEL}
        pred = {
            "costs_s": costs,
            "step_time_s": step,
            "samples_per_s": {s: cfg.batch_size / t for s, t in step.items()},
        }
        pred["async_vs_sync"] = step["sync"] / step["async"]
        pred["async_vs_torch_1f1b"] = step["torch-1f1b"] / step["async"]
        predictions[name] = pred
        if "stash" in costs:
            # async's own bookkeeping on every stage with staleness > 0, once per micro-batch: the stashed
            # version's cost (a fresh-storage update; in records before it, a weight copy).
            from lightning_dynpipe.schedule import staleness

            fwd = [
                f + (costs["stash"][k] if staleness("async", k, NUM_STAGES) > 0 else 0.0)
                for k, f in enumerate(costs["forward"])
            ]
            t = _simulate("async", {**costs, "forward": fwd}, cfg)
            predictions[name + "_with_stash"] = {
                "step_time_s": {"async": t},
                "samples_per_s": {"async": cfg.batch_size / t},
                "async_vs_sync": step["sync"] / t,
                "async_vs_torch_1f1b": step["torch-1f1b"] / t,
            }
    own = {kind: c for kind in ("async", "sync", "gpipe") if (c := _costs_from_runs(runs, kind)) is not None}
    if "async" in own and "sync" in own:
        t_async = _simulate("async", own["async"], cfg)
        t_sync = _simulate("sync", own["sync"], cfg)
        predictions["own_costs"] = {
            "costs_s": own,
            "step_time_s": {"async": t_async, "sync": t_sync},
            "async_vs_sync": t_sync / t_async,
        }
    framework: dict[str, Any] = {}
    for s in systems:
        if s.startswith("torch-"):
            continue  # torch's runner has no per-operation timers: only the isolated costs predict it
        fc = _framework_costs_from_runs(runs, s, cfg)
        if fc is None:
            continue
        t = _simulate(_SIM_MODEL[s], fc, cfg)
        framework[s] = {
            "costs_s": fc,
            "step_time_s": t,
            "samples_per_s": cfg.batch_size / t,
            "measured_samples_per_s": table[s]["median"],
            "error": cfg.batch_size / t / table[s]["median"] - 1,
        }
    if framework:
        predictions["framework"] = framework
    hand = [r["ops"] for r in runs if r["system"] == "hand-async" and r.get("ops")]
    handwritten_ops = (
        [{op: median([h[k][op] for h in hand]) for op in hand[0][k]} for k in range(NUM_STAGES)] if hand else None
    )
    return {
        "table": table,
        "breakdown": breakdown,
        "cpu": cpu,
        # the hand-written loop's main-thread CPU seconds per micro-batch in each kind of operation, per stage
        "handwritten_ops": handwritten_ops,
        "memory": memory_summary(runs, systems),
        "predictions": predictions,
        "calibration": calibration,
        # live repartitions per run (DynPipe systems with the adaptive loop on); there is no interference here
        "migrations": {s: [len(by[s][rep].get("migrations", [])) for rep in sorted(by[s])] for s in systems},
    }


def memory_summary(runs: list[dict[str, Any]], systems: list[str]) -> dict[str, Any]:
    """Per system and stage: the process's peak RSS during the run and above its start (medians over repeats);
    for DynPipe, the weight versions stashed at most (bytes, measured) against ``S - k`` versions (predicted)."""
    out: dict[str, Any] = {}
    for s in systems:
        per_stage: dict[int, dict[str, list[float]]] = {}
        for r in runs:
            if r["system"] != s or not r.get("memory"):
                continue
            stage_of = {c["rank"]: c["stage"] for c in r["cpu"]}
            for m in r["memory"]:
                if m["rss_peak"] is None or m["rss_start"] is None:
                    continue
                d = per_stage.setdefault(stage_of[m["rank"]], {"peak": [], "above": [], "stash": [], "pred": []})
                d["peak"].append(m["rss_peak"])
                d["above"].append(m["rss_peak"] - m["rss_start"])
            for st in r["stages"] or []:
                if st.get("param_bytes") is None:
                    continue
                d = per_stage.setdefault(st["stage"], {"peak": [], "above": [], "stash": [], "pred": []})
                depth = max((x["max_stash_depth"] for x in st["steps"]), default=0)
                d["stash"].append(depth * st["param_bytes"])
                d["pred"].append(st["predicted_versions"] * st["param_bytes"])
        out[s] = [
            {"stage": k, **{name: (median(v) if v else None) for name, v in d.items()}}
            for k, d in sorted(per_stage.items())
        ]
    return out


def render_memory(summary: dict[str, Any], *, markdown: bool = False) -> str:
    """Peak RSS per stage process (and above its RSS at the run's start), stash bytes measured and predicted."""
    rows = []

    def mib(v: float | None) -> str:
        return "-" if v is None else f"{v / 2**20:.1f}"

    for s, stages in summary.get("memory", {}).items():
        for st in stages:
            rows.append(
                [
                    f"{LABELS[s]} / stage {st['stage']}",
                    mib(st["peak"]),
                    mib(st["above"]),
                    mib(st["stash"]),
                    mib(st["pred"]),
                ]
            )
    headers = [
        "system / stage",
        "peak RSS MiB",
        "peak above start MiB",
        "stashed weights MiB",
        "predicted (S-k versions)",
    ]
    return format_table(headers, rows, markdown=markdown)


def _ratio_cell(row: dict[str, Any], ref: str) -> str:
    r = row.get(f"vs_{ref}")
    if r is None:
        return "-"
    if r["q1"] == r["q3"]:
        return f"{r['median']:.3f}x"
    return f"{r['median']:.3f}x [{r['q1']:.2f}-{r['q3']:.2f}]"


def render_table(summary: dict[str, Any], *, markdown: bool = False) -> str:
    """The main table: system, median samples/s, IQR, paired ratios to sync and to torch 1F1B."""
    rows = []
    for s, row in summary["table"].items():
        rows.append(
            [
                LABELS[s],
                f"{row['median']:.1f}",
                f"{row['q1']:.1f}-{row['q3']:.1f}",
                _ratio_cell(row, "sync"),
                _ratio_cell(row, "torch-1f1b"),
            ]
        )
    headers = ["system", "samples/s (median)", "IQR", "vs DynPipe sync", "vs torch 1F1B"]
    if any("vs_hand-async" in row for row in summary["table"].values()):
        for cells, row in zip(rows, summary["table"].values()):
            cells.append(_ratio_cell(row, "hand-async"))
        headers.append("vs hand-written async")
    return format_table(headers, rows, markdown=markdown)


def render_breakdown(summary: dict[str, Any], *, markdown: bool = False) -> str:
    """Per stage and DynPipe schedule, milliseconds per step: compute, receive wait, send, the rest.

    Every column is a median over repeats on its own, so the columns need not add up to ``executor step``.
    ``other`` is executor time outside the timed instructions (splitting the batch, weight snapshots,
    dispatch); ``outside executor`` is the rest of the Lightning step (hooks, logging, the broadcasts).
    """
    rows = []
    for s, stages in summary["breakdown"].items():
        for st in stages:
            other, outside = st["other_s"], st["outside_s"]
            rows.append(
                [
                    f"{LABELS[s]} / stage {st['stage']}",
                    f"{st['forward_s'] * 1e3:.1f}",
                    f"{st['backward_s'] * 1e3:.1f}",
                    f"{st['optimizer_s'] * 1e3:.1f}",
                    f"{st['recv_wait_s'] * 1e3:.1f}",
                    f"{st['send_s'] * 1e3:.1f}",
                    f"{other * 1e3:.1f}",
                    f"{st['step_s'] * 1e3:.1f}",
                    f"{outside * 1e3:.1f}",
                    f"{st['wall_per_step_s'] * 1e3:.1f}",
                ]
            )
    headers = [
        "schedule / stage",
        "fwd",
        "bwd",
        "opt",
        "recv wait",
        "send",
        "other",
        "executor step",
        "outside executor",
        "wall/step",
    ]
    return format_table(headers, rows, markdown=markdown)


def render_cpu(summary: dict[str, Any], *, markdown: bool = False) -> str:
    """Per system and stage: cores the process used, the share of time its main thread sat runnable, the time
    Python's garbage collector took per step (with the median number of full collections in a run), the minor page
    faults per step (memory the system had to hand the process again) and, with a
    learning predictor, its refits' CPU per step in their own process (refits adopted, skipped; not in the
    process's CPU) and, with one-rank refits, the time per step of the broadcasts of the fitting rank's forests."""
    refits = any("refit_cpu_per_step_s" in st for stages in summary["cpu"].values() for st in stages)
    rows = []
    for s, stages in summary["cpu"].items():
        cells = [LABELS[s]]
        for st in stages:
            cells.append(f"{st['cpu_per_step_s'] * 1e3:.1f}")
            cells.append(f"{st['cores_used']:.2f}")
            w = st.get("main_runqueue_wait_share")
            cells.append("-" if w is None else f"{w * 100:.0f}%")
            g = st.get("gc_per_step_s")
            cells.append("-" if g is None else f"{g * 1e3:.2f} ({st['gc_full_runs']:g})")
            f = st.get("minor_faults_per_step")
            cells.append("-" if f is None else f"{f:.0f}")
            if refits:
                r = st.get("refit_cpu_per_step_s")
                cells.append("-" if r is None else f"{r * 1e3:.2f} ({st['refits']:g}, {st['refits_skipped']:g})")
                b = st.get("refit_share_per_step_s")
                cells.append("-" if b is None else f"{b * 1e3:.3f}")
        rows.append(cells)
    headers = ["system"]
    for k in range(NUM_STAGES):
        headers += [f"stage {k} CPU ms/step", "cores", "run-queue wait", "GC ms/step (full runs)", "page faults/step"]
        headers += ["refit process ms/step (refits, skipped)", "refit broadcast ms/step"] if refits else []
    return format_table(headers, rows, markdown=markdown)


def render_predictions(summary: dict[str, Any], *, markdown: bool = False) -> str:
    """Simulated samples/s from the isolated per-op costs, next to the measured medians, and the ratios."""
    p = summary["predictions"]
    t = summary["table"]

    def ms(xs: Sequence[float]) -> str:
        return "/".join(f"{x * 1e3:.2f}" for x in xs)

    lines = []
    iso = p.get("isolated")
    if iso is not None:
        c = iso["costs_s"]
        lines.append(
            f"isolated per-micro-batch CPU costs, stage 0/1 (ms): forward {ms(c['forward'])}, backward "
            f"{ms(c['backward'])}, update {ms(c['update'])}"
            + (f", stashed version (fresh-storage update's extra) {ms(c['stash'])}" if "copy" in c else "")
            + (f", weight copy {ms(c['copy'])}" if "copy" in c else "")
            + (f", weight snapshot {ms(c['stash'])}" if "stash" in c and "copy" not in c else "")  # older records
        )
        rows = []
        for s, row in t.items():
            pred = iso["samples_per_s"][s]
            rows.append(
                [LABELS[s], _SIM_MODEL[s], f"{pred:.1f}", f"{row['median']:.1f}", f"{row['median'] / pred:.2f}"]
            )
        lines.append(
            format_table(
                ["system", "simulated as", "predicted samples/s", "measured", "measured/predicted"],
                rows,
                markdown=markdown,
            )
        )
    hand = summary.get("handwritten_ops")
    if hand:
        for clock in ("cpu", "wall"):
            lines.append(
                f"hand-written async loop's main-thread {'CPU' if clock == 'cpu' else 'wall'} time per micro-batch "
                "inside the pipeline, stage 0/1 (ms): "
                + ", ".join(
                    f"{op.removesuffix('_' + clock).replace('_', ' ')} {ms([h[op] for h in hand])}"
                    for op in hand[0]
                    if op.endswith("_" + clock)
                )
            )
    if "inside_sync" in p:
        c = p["inside_sync"]["costs_s"]
        lines.append(
            f"costs measured inside DynPipe sync, stage 0/1 (ms): forward {ms(c['forward'])}, backward "
            f"{ms(c['backward'])}, update {ms(c['update'])}"
        )
    if "framework" in p:
        rows = []
        for s, f in p["framework"].items():
            c = f["costs_s"]
            rows.append(
                [
                    LABELS[s],
                    ms(c["forward"]),
                    ms(c["backward"]),
                    ms(c["update"]),
                    ms(c["step_overhead"]),
                    ms(c["send_overhead"]),
                    f"{f['samples_per_s']:.1f}",
                    f"{f['measured_samples_per_s']:.1f}",
                    f"{f['error']:+.1%}",
                ]  # fmt: skip
            )
        lines.append(
            "simulator fed with the framework's costs measured inside each system's runs (ms per operation, "
            "stage 0/1; step overhead per step, send overhead per message):\n"
            + format_table(
                [
                    "system",
                    "forward",
                    "backward",
                    "update",
                    "step overhead",
                    "send overhead",
                    "predicted samples/s",
                    "measured",
                    "predicted/measured - 1",
                ],
                rows,
                markdown=markdown,
            )  # fmt: skip
        )
    ratio_rows = []
    measured_vs_sync = t.get("async", {}).get("vs_sync", {}).get("median")
    measured_vs_torch = t.get("async", {}).get("vs_torch-1f1b", {}).get("median")
    for name, label in (
        ("isolated", "simulator, isolated costs"),
        ("isolated_with_stash", "simulator, isolated costs + async weight stashing"),
        ("inside_sync", "simulator, costs inside DynPipe sync"),
        ("own_costs", "simulator, each schedule's own costs"),
        ("cpu_work", "CPU work per step (bottleneck stage), if CPU-starved"),
    ):
        if name in p:
            vt = p[name].get("async_vs_torch_1f1b")  # torch's CPU work includes its set-up: a lower bound
            ratio_rows.append([label, f"{p[name]['async_vs_sync']:.3f}x", "-" if vt is None else f"{vt:.3f}x"])
    if measured_vs_sync is not None:
        ratio_rows.append(
            [
                "measured (median of paired ratios)",
                f"{measured_vs_sync:.3f}x",
                "-" if measured_vs_torch is None else f"{measured_vs_torch:.3f}x",
            ]
        )
    if ratio_rows:
        lines.append(format_table(["async ratio", "vs DynPipe sync", "vs torch 1F1B"], ratio_rows, markdown=markdown))
    return "\n\n".join(lines)


def render_targets(summary: dict[str, Any]) -> str:
    t = summary["table"]
    out = []
    a = t.get("async", {})
    for ref, target, name in (("sync", 1.10, "DynPipe sync"), ("torch-1f1b", 1.10, "torch Schedule1F1B")):
        r = a.get(f"vs_{ref}")
        if r is None:
            continue
        verdict = "met" if r["median"] >= target else "MISSED"
        out.append(f"target async >= {target:.2f}x {name}: measured {r['median']:.3f}x -> {verdict}")
    fw = summary.get("predictions", {}).get("framework", {})
    if fw:
        worst = max(abs(f["error"]) for f in fw.values())
        each = ", ".join(f"{s} {f['error']:+.1%}" for s, f in fw.items())
        verdict = "met" if worst <= 0.15 else "MISSED"
        out.append(
            f"target the simulator fed with the framework's costs predicts each DynPipe system within 15%: worst "
            f"{worst:.1%} ({each}) -> {verdict}"
        )
    c = a.get("vs_async-copy")
    if c is not None:
        out.append(
            f"async with SGD writing fresh storage against the stash copying first: {c['median']:.3f}x "
            f"[{c['q1']:.3f}-{c['q3']:.3f}]"
        )
    g = a.get("vs_async-spare")
    if g is not None:
        out.append(
            f"async with SGD writing the new weights into the gradients against other memory: {g['median']:.3f}x "
            f"[{g['q1']:.3f}-{g['q3']:.3f}]"
        )
    costs = (
        ("async-defaults", "async-bare", 0.98, "the defaults (monitor + adaptive loop) cost <= 2% against both off"),
        (
            "async-forest",
            "async-defaults",
            0.99,
            "the forest predictor costs < 1% against the default measured predictor",
        ),
    )
    for system, ref, floor, what in costs:
        r = t.get(system, {}).get(f"vs_{ref}")
        if r is not None:
            verdict = "met" if r["median"] >= floor else "MISSED"
            out.append(f"target {what}: measured {r['median']:.3f}x [{r['q1']:.3f}-{r['q3']:.3f}] -> {verdict}")
    moved = {s: n for s, n in summary.get("migrations", {}).items() if any(n)}
    if moved:  # a repartition changes what the run measures: name the runs that made one
        each = ", ".join(f"{s} {sum(1 for x in n if x)} of {len(n)}" for s, n in moved.items())
        out.append(f"runs that repartitioned (no interference is injected here): {each}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- outputs
def plot(runs: list[dict[str, Any]], summary: dict[str, Any], cfg: Config, machine: dict[str, Any], path: Path) -> None:
    """Bar chart of median samples/s per system with every repeat as a point."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no plot was written: pip install 'lightning-dynpipe[plot]'")
        return
    systems = list(summary["table"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = ["#1f77b4" if not s.startswith("torch") else "#7f7f7f" for s in systems]
    medians = [summary["table"][s]["median"] for s in systems]
    xs = list(range(len(systems)))
    ax.bar(xs, medians, color=colors, alpha=0.75, width=0.6)
    for i, s in enumerate(systems):
        pts = [r["samples_per_s"] for r in runs if r["system"] == s]
        n = len(pts)
        jitter = [(j - (n - 1) / 2) * (0.3 / max(n, 1)) for j in range(n)]
        ax.scatter([i + d for d in jitter], pts, color="black", s=12, zorder=3)
        vs = summary["table"][s].get("vs_sync")
        label = f"{medians[i]:.0f}" + (f"\n{vs['median']:.2f}x sync" if vs else "")
        ax.annotate(
            label,
            (i, max(pts + [medians[i]])),
            xytext=(0, 5),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(xs, [LABELS[s].replace(" ", "\n", 1) for s in systems], fontsize=9)
    ax.set_ylabel("samples/s (bars: median; points: repeats)")
    top = max(r["samples_per_s"] for r in runs)
    ax.set_ylim(0, top * 1.25)
    ax.text(
        0.01,
        0.98,
        "ratio: median of per-repeat ratios to DynPipe sync (paired, same repeat)",
        transform=ax.transAxes,
        fontsize=7,
        va="top",
        color="#555555",
    )
    ax.set_title(
        f"2-stage pipeline, {describe_model(cfg)}, batch {cfg.batch_size}, "
        f"M={cfg.num_microbatches}, balance {list(cfg.balance)}\n"
        f"{machine['cpu_model']}, {machine['logical_cpus']} CPUs, torch {machine['torch']}, "
        f"lightning {machine['lightning']}, {cfg.repeats} repeats x {cfg.steps} steps, "
        f"load avg {machine['load_average_1_5_15'][0] if machine.get('load_average_1_5_15') else '?'} at start",
        fontsize=9,
    )
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(payload: dict[str, Any], json_path: Path) -> Path:
    """Writes the JSON record and, next to it, a CSV with one row per run (system x repeat)."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(payload, indent=1), encoding="utf-8")
    csv_path = json_path.with_suffix(".csv")
    with csv_path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["rep", "position", "system", "steps", "samples", "seconds", "samples_per_s", "load1"])
        for r in payload["runs"]:
            w.writerow(
                [
                    r["rep"],
                    r["position"],
                    r["system"],
                    r["steps"],
                    r["samples"],
                    f"{r['seconds']:.6f}",
                    f"{r['samples_per_s']:.3f}",
                    f"{r['load1']:.2f}",
                ]
            )
    return csv_path


def _config_from_json(d: dict[str, Any]) -> Config:
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return Config(**fields)


# ---------------------------------------------------------------------------------------------- CLI
def _parse(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = Config()
    p.add_argument(
        "--repeats", type=int, default=None, help=f"interleaved repeats of every system (default {d.repeats})"
    )
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per run (default {d.steps})")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed steps before them (default {d.warmup})")
    p.add_argument("--width", type=int, default=None, help=f"MLP hidden width (default {d.width})")
    p.add_argument("--depth", type=int, default=None, help=f"MLP hidden blocks; layers = depth + 1 (default {d.depth})")
    p.add_argument("--batch-size", type=int, default=None, help=f"samples per step (default {d.batch_size})")
    p.add_argument(
        "--microbatches", "-M", type=int, default=None, help=f"micro-batches per step (default {d.num_microbatches})"
    )
    p.add_argument("--lr", type=float, default=None, help=f"SGD learning rate (default {d.lr})")
    p.add_argument(
        "--balance",
        type=str,
        default=None,
        help="layers per stage, e.g. 4,5 (default: balanced by parameter count, DynPipe's balance='parameters')",
    )
    p.add_argument(
        "--systems",
        type=str,
        default=None,
        help=f"comma-separated subset of {','.join(ALL_SYSTEMS)} (default: {','.join(SYSTEMS)})",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--free-cpu-memory",
        action="store_true",
        help="DynPipe systems with keep_freed_cpu_memory=False, and the benchmark's processes do not keep freed memory "
        "either (by default they do, for every system): the allocator gives freed memory back to the system. A "
        "process-wide setting, so compare it across invocations, each with one fit per process: --repeats 1 and one "
        "system",
    )
    p.add_argument(
        "--model",
        choices=("mlp", "gpt"),
        default="mlp",
        help="mlp: the demo MLP (default); gpt: the GPT example's transformer (see GPT_DEFAULTS)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: width 64, depth 3, batch 32, 1 repeat, 3 steps; plot goes to --out-dir",
    )
    p.add_argument("--out-dir", type=Path, default=_DEFAULT_OUT, help="raw results (default benchmarks/out/)")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="plot path (default docs/img/throughput.png, throughput-MODEL.png for --model other than mlp; with "
        "--quick: OUT_DIR/throughput-quick.png)",
    )
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="re-analyse a previous run's JSON (tables, predictions, plot) without measuring",
    )
    a = p.parse_args(argv)

    cfg = Config(model=a.model)
    if a.model == "gpt":
        cfg = replace(cfg, **GPT_DEFAULTS)  # type: ignore[arg-type]
    if a.quick:
        cfg = replace(cfg, repeats=1, steps=3, warmup=2, width=64, depth=3, batch_size=32, timeout_s=60.0, sim_steps=6)
    overrides = {
        "repeats": a.repeats,
        "steps": a.steps,
        "warmup": a.warmup,
        "width": a.width,
        "depth": a.depth,
        "batch_size": a.batch_size,
        "num_microbatches": a.microbatches,
        "lr": a.lr,
        "seed": a.seed,
    }
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if a.free_cpu_memory:
        cfg = replace(cfg, keep_freed_cpu_memory=False)
    if a.systems:
        systems = tuple(s.strip() for s in a.systems.split(",") if s.strip())
        unknown = [s for s in systems if s not in ALL_SYSTEMS]
        if unknown:
            p.error(f"unknown systems {unknown}; valid: {list(ALL_SYSTEMS)}")
        cfg = replace(cfg, systems=systems)
    if a.balance:
        balance = tuple(int(x) for x in a.balance.split(","))
    else:
        balance = default_balance(cfg.width, cfg.depth, cfg.model)
    if len(balance) != NUM_STAGES or sum(balance) != num_layers(cfg) or min(balance) < 1:
        p.error(f"--balance needs {NUM_STAGES} positive entries summing to {num_layers(cfg)} layers; got {balance}")
    cfg = replace(cfg, balance=balance)
    if cfg.batch_size % cfg.num_microbatches:
        p.error(
            f"--batch-size ({cfg.batch_size}) must be divisible by --microbatches ({cfg.num_microbatches}): "
            "torch's schedules split batches with tensor_split and infer shapes once"
        )
    if cfg.num_microbatches < NUM_STAGES:
        p.error(f"torch's Schedule1F1B needs --microbatches >= {NUM_STAGES}")
    if min(cfg.repeats, cfg.steps) < 1 or cfg.warmup < 1:
        p.error("--repeats and --steps must be >= 1 and --warmup >= 1 (the first step fills the pipeline)")
    return cfg, a


def _print_header(cfg: Config, machine: dict[str, Any], cmd: str) -> None:
    print(describe_machine(machine))
    print(
        f"model: {describe_model(cfg)} ({num_layers(cfg)} layers), balance {list(cfg.balance)}, "
        f"batch {cfg.batch_size}, M={cfg.num_microbatches}, SGD lr {cfg.lr}; {cfg.repeats} repeats x "
        f"({cfg.warmup} warm-up + {cfg.steps} timed steps) per system"
    )
    dirty = machine.get("git_modified_files")
    commit = (machine.get("git_commit") or "?")[:10]
    print(f"code: commit {commit}" + (f" with uncommitted changes in {', '.join(dirty)}" if dirty else ""))
    print(f"command: {cmd}", flush=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg, a = _parse(argv)
    if a.from_json is not None:
        payload = json.loads(a.from_json.read_text(encoding="utf-8"))
        cfg, machine = _config_from_json(payload["config"]), payload["machine"]
        json_path = a.from_json
        print(f"re-analysing {json_path}, measured {machine['date_utc']}:")
        _print_header(cfg, machine, payload["command"])
    else:
        machine = machine_info()
        cmd = command_line()
        _print_header(cfg, machine, cmd)
        from torch.multiprocessing.spawn import spawn

        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            result_path = os.path.join(tmp, "runs.json")
            spawn(_worker, args=(cfg, free_port(), result_path), nprocs=WORLD_SIZE, join=True)  # type: ignore[no-untyped-call]
            raw = json.loads(Path(result_path).read_text(encoding="utf-8"))
        machine["load_average_1_5_15_after"] = [round(x, 2) for x in os.getloadavg()]
        payload = {
            "config": asdict(cfg),
            "machine": machine,
            "command": cmd,
            "elapsed_s": time.perf_counter() - t0,
            **raw,
        }
        json_path = a.out_dir / f"throughput-{time.strftime('%Y%m%d-%H%M%S')}.json"
        write_outputs(payload, json_path)  # raw first: a failing analysis must not lose a long measurement
    runs, calibration = payload["runs"], payload["calibration"]

    summary = summarise(runs, calibration, cfg)
    print()
    print(render_table(summary))
    print()
    print(
        "DynPipe per stage, ms per step (medians over repeats; the last stage is global rank 0, whose clock "
        "times the run):"
    )
    print(render_breakdown(summary))
    print()
    print(
        "CPU per stage process: CPU time of all threads per timed step, "
        "cores used = CPU time / wall time, run-queue wait = share of wall time the main thread was runnable "
        "but another process had the core:"
    )
    print(render_cpu(summary))
    print()
    print(
        "memory per stage process: peak RSS during the run (Linux VmHWM, reset before each run), and how far it "
        "rose above the RSS at the run's start; async's stashed weight versions, measured (most versions held "
        "x the stage's parameter bytes) and predicted (S-k versions):"
    )
    print(render_memory(summary))
    print()
    print(render_predictions(summary))
    print()
    print(render_targets(summary))

    if not a.no_plot:
        quick = a.quick or payload["config"]["repeats"] == 1
        plot_path = a.plot or (json_path.parent / "throughput-quick.png" if quick else default_plot(cfg.model))
        plot(runs, summary, cfg, machine, plot_path)
        print(f"\nplot: {plot_path}")
    payload["summary"] = summary
    payload["markdown"] = {
        "table": render_table(summary, markdown=True),
        "breakdown": render_breakdown(summary, markdown=True),
        "cpu": render_cpu(summary, markdown=True),
        "memory": render_memory(summary, markdown=True),
        "predictions": render_predictions(summary, markdown=True),
    }
    csv_path = write_outputs(payload, json_path)
    print(f"raw repeats: {json_path} and {csv_path}")
    return summary


if __name__ == "__main__":
    main()
