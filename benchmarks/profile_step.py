"""Where a training step's CPU goes, per stage: DynPipe against ``torch.distributed.pipelining``, by component.

The same two stage processes, model, split, batches and micro-batches as ``benchmarks/throughput.py``
(it reuses that script's model, data and DynPipe runner). Inside each stage process, over the timed steps
only, it measures the main thread's CPU time (``time.thread_time``) spent in named components: the stage's
layers, autograd, the optimizer, and what each framework does around them (Lightning's loop and hooks,
``self.log``, the metrics mirror, weight stashing, message headers, torch's schedule and P2P code, ...). A
component's time is *exclusive*: a component called inside another is subtracted from it, so the rows of a
stage add up to its main thread's CPU per step; ``(not in a component)`` is the rest (Lightning's loop glue,
the loss function, Python between the calls). Other threads (receiver threads, gloo's) are one row. Blocked
time (waiting for a message or a collective) is not CPU and does not appear.

Two modes:

* ``sections`` (default): the component table above. Each component is a wrapper around one function; the
  wrappers cost about a microsecond a call, which the ``wrapper calls`` line lets you bound.
* ``--cprofile``: the standard library's deterministic profiler over the same steps in each stage's main
  thread instead, printing the functions with the most own time and the most cumulative time per step. It
  is for finding what to name as a component; it inflates Python-heavy code several-fold, so use its
  shares, not its milliseconds.

Usage (from the repository root)::

    .venv/bin/python benchmarks/profile_step.py                          # async and torch 1F1B, 3 repeats
    .venv/bin/python benchmarks/profile_step.py --systems async,sync,torch-1f1b --repeats 5
    .venv/bin/python benchmarks/profile_step.py --cprofile --systems async --repeats 1
    .venv/bin/python benchmarks/profile_step.py --quick                  # smoke run (tiny model, 1 repeat)
    .venv/bin/python benchmarks/profile_step.py --from-json benchmarks/out/profile_step-A.json B.json  # pooled

It prints one table (rows: components; columns: system / stage; cells: median over repeats of CPU ms per
step) and writes ``benchmarks/out/profile_step-<stamp>.json`` with the machine, versions, commit and
command.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `benchmarks` and the package importable
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import throughput as tp  # noqa: E402
from benchmarks._common import (  # noqa: E402
    close_group,
    command_line,
    describe_machine,
    external_launch_env,
    fit_dynpipe,
    format_table,
    free_port,
    machine_info,
    median,
    rotated,
    workers_done,
)

SYSTEMS: tuple[str, ...] = (
    "async", "sync", "gpipe", "torch-1f1b", "torch-gpipe", "async-defaults", "async-forest", "async-bare"
)  # fmt: skip
"""``async-defaults``: ``async`` with the adaptive loop on as well (what ``DynPipeStrategy()`` does);
``async-forest``: the same with ``predictor="forest"`` (its refits' CPU, in their own process, is the row
``forest refit process``);
``async-bare``: ``async`` without the stage monitor (whatever ``--monitor-every-n-steps`` says). The others run
with the adaptive loop off, on one fixed partition."""
OTHER = "(not in a component)"
ARITHMETIC = (
    "layers forward",
    "autograd (backward kernels)",
    "optimizer arithmetic (sgd)",
    "optimizer arithmetic (sgd, to fresh storage)",
    "optimizer zero_grad",
)
"""The components both frameworks share: the model's own arithmetic (SGD's, written in place or, while a weight
version is stashed, to fresh storage). The rest of the main thread is framework."""
THREADS = "other threads (receivers, gloo)"
REFITS = "forest refit process (not in the process CPU)"
_DEFAULT_OUT = _ROOT / "benchmarks" / "out"


@dataclass(frozen=True)
class Options:
    """What to profile; recorded in the JSON output. The model fields mirror ``throughput.Config``."""

    systems: tuple[str, ...] = ("async", "torch-1f1b")
    repeats: int = 3
    steps: int = 20
    warmup: int = 3
    width: int = 512
    depth: int = 8
    batch_size: int = 256
    num_microbatches: int = 4
    lr: float = 0.05
    balance: tuple[int, ...] = ()
    cprofile: bool = False
    top: int = 25
    monitor_every_n_steps: int | None = 10

    def throughput_config(self) -> tp.Config:
        """The ``throughput.py`` configuration of the same model, split and batches."""
        return tp.Config(
            repeats=self.repeats,
            steps=self.steps,
            warmup=self.warmup,
            width=self.width,
            depth=self.depth,
            batch_size=self.batch_size,
            num_microbatches=self.num_microbatches,
            lr=self.lr,
            balance=self.balance,
            systems=self.systems,
        )


# ---------------------------------------------------------------------------------------------- sections
class Sections:
    """Exclusive main-thread CPU time per named component, between :meth:`start` and :meth:`stop`.

    :meth:`patch` replaces a function (an attribute of a class, module or instance) with a wrapper that
    charges the CPU time of the call to a component, minus the time of the components called inside it.
    Calls from other threads, and calls that began before :meth:`start`, pass through uncounted.

    Example::

        s = Sections()
        s.patch(torch.optim.sgd, "sgd", "optimizer arithmetic")
        s.start(); train(); s.stop()
        s.exclusive["optimizer arithmetic"], s.main_cpu_s
        s.restore()
    """

    def __init__(self) -> None:
        self.exclusive: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.enabled = False
        self.main_cpu_s = self.process_cpu_s = self.wall_s = 0.0
        self._main = threading.get_ident()
        self._stack: list[list[Any]] = []  # [component, entry time, time of components inside]
        self._generation = 0
        self._restore: list[Callable[[], None]] = []
        self._t0 = self._p0 = self._w0 = 0.0
        self._threads0: dict[int, tuple[str, float]] = {}
        self.threads_s: dict[str, float] = defaultdict(float)
        self.refit_cpu_s = 0.0  # a learning predictor's refits answered in the window, in its own process

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        """``fn`` charging its calls to component ``name``."""
        clock = time.thread_time

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled or threading.get_ident() != self._main:
                return fn(*args, **kwargs)
            generation = self._generation
            frame = [name, clock(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                if self.enabled and generation == self._generation:
                    dt = clock() - frame[1]
                    self._stack.pop()
                    self.exclusive[name] += dt - frame[2]
                    self.calls[name] += 1
                    if self._stack:
                        self._stack[-1][2] += dt

        wrapper.__dict__["_profile_step_wrapped"] = fn
        return wrapper

    def patch(self, owner: Any, attr: str, name: str) -> None:
        """Replaces ``owner.attr`` by a wrapper charging component ``name``; :meth:`restore` puts it back."""
        own = hasattr(owner, "__dict__") and attr in vars(owner)  # defined on owner itself, not inherited
        original = vars(owner)[attr] if own and isinstance(owner, type) else getattr(owner, attr)
        if isinstance(original, (staticmethod, classmethod)):
            raise TypeError(
                f"Cannot profile {owner!r}.{attr}: static and class methods are not supported; wrap the function "
                "they call instead."
            )
        setattr(owner, attr, self.wrap(original, name))
        if own:
            self._restore.append(lambda: setattr(owner, attr, original))
        else:  # shadows an inherited method or a class's method on an instance: remove the shadow again
            self._restore.append(lambda: delattr(owner, attr))

    def patch_out_of_place(self, optimizer_cls: type, fresh: str, in_place: str) -> None:
        """Charges the reproduced updates of ``optimizer_cls`` (:mod:`lightning_dynpipe.engine.outofplace`, which
        run instead of its ``step``) to ``fresh`` (to fresh storage, while a weight version is stashed) or to
        ``in_place`` (:func:`~lightning_dynpipe.engine.outofplace.direct_step`)."""
        from lightning_dynpipe.engine.outofplace import OUT_OF_PLACE_STEPS

        supported, step = OUT_OF_PLACE_STEPS[optimizer_cls]
        to_fresh, to_live = self.wrap(step, fresh), self.wrap(step, in_place)

        def charged(optimizer: Any, spare: Any, live: bool) -> None:
            (to_live if live else to_fresh)(optimizer, spare, live)

        OUT_OF_PLACE_STEPS[optimizer_cls] = (supported, charged)
        self._restore.append(lambda: OUT_OF_PLACE_STEPS.__setitem__(optimizer_cls, (supported, step)))

    def patch_instance_forward(self, module: torch.nn.Module, name: str) -> None:
        """Charges ``module``'s forward (whatever calls it, functional_call included) to ``name``."""
        module.forward = self.wrap(module.forward, name)  # type: ignore[method-assign]
        self._restore.append(lambda: delattr(module, "forward"))

    def restore(self) -> None:
        """Undoes every patch, most recent first."""
        while self._restore:
            self._restore.pop()()

    def start(self) -> None:
        """Starts counting (call on the main thread)."""
        self.exclusive.clear()
        self.calls.clear()
        self._main = threading.get_ident()
        self._stack = []
        self._generation += 1
        self._threads0 = _thread_cpu()
        self._t0, self._p0, self._w0 = time.thread_time(), time.process_time(), time.perf_counter()
        self.enabled = True

    def stop(self) -> None:
        """Stops counting; components still running are charged up to now."""
        now = time.thread_time()
        self.enabled = False
        while self._stack:
            name, t_entry, inner = self._stack.pop()
            dt = now - t_entry
            self.exclusive[name] += dt - inner
            if self._stack:
                self._stack[-1][2] += dt
        self._generation += 1
        self.main_cpu_s = now - self._t0
        self.process_cpu_s = time.process_time() - self._p0
        self.wall_s = time.perf_counter() - self._w0
        end = _thread_cpu()
        self.threads_s = defaultdict(float)
        for tid, (label, cpu) in end.items():
            if tid != threading.get_native_id():
                self.threads_s[label] += cpu - self._threads0.get(tid, (label, 0.0))[1]

    def result(self, steps: int) -> dict[str, Any]:
        """Milliseconds of CPU per step per component, the totals, and the number of wrapper calls."""
        ms = {k: v * 1e3 / steps for k, v in self.exclusive.items()}
        ms[OTHER] = (self.main_cpu_s - sum(self.exclusive.values())) * 1e3 / steps
        ms[THREADS] = (self.process_cpu_s - self.main_cpu_s) * 1e3 / steps
        return {
            "components_ms": ms,
            "main_cpu_ms": self.main_cpu_s * 1e3 / steps,
            "process_cpu_ms": self.process_cpu_s * 1e3 / steps,
            "wall_ms": self.wall_s * 1e3 / steps,
            "wrapper_calls_per_step": sum(self.calls.values()) / steps,
            "threads_ms": {k: v * 1e3 / steps for k, v in self.threads_s.items()},
            "refit_process_ms": self.refit_cpu_s * 1e3 / steps,
        }


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds so far of every thread of this process (Linux schedstat), labelled by kind.

    Python threads are labelled by their name up to the first ``[`` (``dynpipe-recv``: DynPipe's receivers);
    threads Python does not know (gloo's, OpenMP's) are ``native``. Empty where ``/proc`` is unavailable.
    """
    names = {t.native_id: t.name.split("[", 1)[0] for t in threading.enumerate() if t.native_id is not None}
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
                run_ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        label = names.get(int(tid))
        if label is None:
            try:
                with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
                    label = f"native {f.read().strip()}"
            except OSError:
                label = "native"
        out[int(tid)] = (label, run_ns / 1e9)
    return out


class CProfileWindow:
    """The standard library profiler over the timed steps of the main thread (``--cprofile``)."""

    def __init__(self) -> None:
        self.profile = cProfile.Profile()
        self.main_cpu_s = self.wall_s = 0.0
        self._t0 = self._w0 = 0.0

    def start(self) -> None:
        """Starts profiling."""
        self._t0, self._w0 = time.thread_time(), time.perf_counter()
        self.profile.enable()

    def stop(self) -> None:
        """Stops profiling."""
        self.profile.disable()
        self.main_cpu_s = time.thread_time() - self._t0
        self.wall_s = time.perf_counter() - self._w0

    def result(self, steps: int, top: int) -> dict[str, Any]:
        """The ``top`` functions by own time and by cumulative time, in ms per step (profiled, inflated)."""
        stats = pstats.Stats(self.profile, stream=io.StringIO())
        rows = []
        for (file, line, func), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
            where = f"{_short(file)}:{line}({func})" if line else func
            rows.append((where, ncalls / steps, tottime * 1e3 / steps, cumtime * 1e3 / steps))
        by_own = sorted(rows, key=lambda r: -r[2])[:top]
        by_cum = sorted(rows, key=lambda r: -r[3])[:top]
        return {
            "main_cpu_ms": self.main_cpu_s * 1e3 / steps,
            "wall_ms": self.wall_s * 1e3 / steps,
            "by_own": by_own,
            "by_cumulative": by_cum,
        }


def _short(path: str) -> str:
    for marker in ("site-packages/", "lightning_dynpipe/", "benchmarks/"):
        if marker in path:
            return path.split(marker, 1)[1] if marker == "site-packages/" else marker + path.split(marker, 1)[1]
    return os.path.basename(path)


# ---------------------------------------------------------------------------------------------- components
def _patch_common(s: Sections) -> None:
    """Components both frameworks have: autograd, the optimizer's arithmetic, zeroing gradients."""
    import importlib

    sgd_module = importlib.import_module("torch.optim.sgd")  # torch.optim's namespace hides the submodule
    s.patch(torch.autograd, "grad", "autograd (backward kernels)")
    s.patch(torch.autograd, "backward", "autograd (backward kernels)")
    s.patch(sgd_module, "sgd", "optimizer arithmetic (sgd)")
    s.patch(torch.optim.Optimizer, "zero_grad", "optimizer zero_grad")


def _patch_layers(s: Sections, stage_module: torch.nn.Module) -> None:
    for layer in stage_module.children():
        s.patch_instance_forward(layer, "layers forward")


def _patch_dynpipe(s: Sections) -> None:
    """DynPipe's and Lightning's components around the layers."""
    import lightning.pytorch as pl
    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.trainer import call
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector

    from lightning_dynpipe.engine import executor as ex
    from lightning_dynpipe.engine import p2p
    from lightning_dynpipe.engine import stage as stage_module
    from lightning_dynpipe.engine.stage import PipelineStage
    from lightning_dynpipe.engine.stash import WeightStash
    from lightning_dynpipe.monitor.callback import StageMonitor
    from lightning_dynpipe.monitor.system import ProcessSampler
    from lightning_dynpipe.predictor.forest import ForestPredictor
    from lightning_dynpipe.repartition import controller
    from lightning_dynpipe.strategy.callbacks import MetricsMirror
    from lightning_dynpipe.strategy.dynpipe import DynPipeStrategy
    from lightning_dynpipe.strategy.sigterm import LaggedSigtermCheck

    _patch_common(s)
    s.patch(pl.LightningModule, "log", "Lightning self.log")
    s.patch(_LoggerConnector, "on_batch_start", "Lightning logger connector")
    s.patch(_LoggerConnector, "on_batch_end", "Lightning logger connector")
    s.patch(_LoggerConnector, "update_train_step_metrics", "Lightning logger connector")
    s.patch(_TrainingEpochLoop, "_broadcast_sigterm_tensor", "Lightning sigterm broadcast")  # torch's runs
    s.patch(LaggedSigtermCheck, "__call__", "DynPipe sigterm flag (one batch late)")
    s.patch(_AutomaticOptimization, "run", "Lightning optimization loop")
    s.patch(_PrefetchDataFetcher, "__next__", "Lightning data fetch")
    for fn in ("_call_callback_hooks", "_call_lightning_module_hook", "_call_strategy_hook"):
        s.patch(call, fn, "Lightning hook dispatch")
    s.patch(MetricsMirror, "_mirror", "DynPipe metrics mirror")
    s.patch(stage_module, "clear_grads", "optimizer zero_grad")  # torch's zero_grad without its fixed cost
    s.patch(MetricsMirror, "resolve", "DynPipe metrics mirror")
    s.patch(controller.AdaptiveController, "check", "DynPipe adaptive check (pricing, policy)")
    s.patch(controller, "best_plan", "DynPipe adaptive check: planner solves")
    s.patch(ForestPredictor, "observe", "DynPipe forest observe (rows, misses, refit hand-over)")
    s.patch(ForestPredictor, "predict_many", "DynPipe forest predict")
    for hook in [h for h in vars(StageMonitor) if h.startswith("on_")]:
        s.patch(StageMonitor, hook, "DynPipe stage monitor")
    for fn in ("mark", "sample"):  # its readings of /proc and the cgroup, inside the monitor's hooks
        s.patch(ProcessSampler, fn, "DynPipe stage monitor: process readings")
    s.patch(DynPipeStrategy, "training_step", "DynPipe strategy.training_step")
    s.patch(DynPipeStrategy, "_before_update", "Lightning on_before_optimizer_step + clipping")
    s.patch(ex.StageExecutor, "train_step", "DynPipe executor (dispatch, stats)")
    s.patch(ex, "split_microbatches", "DynPipe split micro-batches")
    s.patch(ex.StageExecutor, "_forward", "DynPipe executor forward")
    s.patch(ex.StageExecutor, "local_forward", "DynPipe local_forward")
    s.patch(ex, "functional_call", "torch functional_call plumbing")
    s.patch(ex.StageExecutor, "_backward", "DynPipe executor backward")
    s.patch(ex.StageExecutor, "_update", "DynPipe executor update")
    s.patch(PipelineStage, "_optimizer_step", "DynPipe optimizer step (glue, optimizer.step)")
    s.patch(WeightStash, "acquire", "DynPipe weight stash acquire")
    s.patch(WeightStash, "before_update", "DynPipe weight stash copy")
    s.patch_out_of_place(torch.optim.SGD, "optimizer arithmetic (sgd, to fresh storage)", "optimizer arithmetic (sgd)")
    s.patch(WeightStash, "release", "DynPipe weight stash acquire")
    s.patch(p2p.SendChannel, "send", "DynPipe send (isend)")
    s.patch(p2p, "encode", "DynPipe header encode")
    s.patch(p2p.RecvChannel, "get", "DynPipe receive (queue)")
    s.patch(ex.StageExecutor, "_recv_activation", "DynPipe executor receive")
    s.patch(ex.StageExecutor, "_recv_grad", "DynPipe executor receive")


def _patch_torch(s: Sections) -> None:
    """torch.distributed.pipelining's components around the layers."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import _PipelineStageBase

    _patch_common(s)
    s.patch(schedules.PipelineScheduleSingle, "step", "torch schedule.step (split, merge)")
    s.patch(schedules.Schedule1F1B, "_step_microbatches", "torch schedule loop")
    s.patch(schedules.ScheduleGPipe, "_step_microbatches", "torch schedule loop")
    s.patch(_PipelineStageBase, "forward_one_chunk", "torch stage forward glue")
    s.patch(_PipelineStageBase, "backward_one_chunk", "torch stage backward glue")
    s.patch(schedules, "_batch_p2p", "torch P2P post")
    s.patch(schedules, "_wait_batch_p2p", "torch P2P wait")
    s.patch(torch.optim.SGD, "step", "torch optimizer.step (glue)")


# ---------------------------------------------------------------------------------------------- runners
class _DynPipeWindow:
    """A callback that opens the profiling window on the first timed step and closes it after the last."""

    def __new__(cls, window: Any, warmup: int, steps: int, sections: Sections | None) -> Any:
        from lightning.pytorch import Callback

        class ProfileWindow(Callback):
            refit_cpu_s = 0.0

            def _refit_cpu(self, trainer: Any) -> float:
                return float(getattr(trainer.strategy.config.predictor, "refit_cpu_s", 0.0))

            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                if sections is not None:
                    _patch_layers(sections, trainer.strategy.executor.stage_module)
                    sections.patch(pl_module, "training_step", "user training_step (loss)")

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                if batch_idx == warmup:
                    window.start()
                    self.refit_cpu_s = -self._refit_cpu(trainer)

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
                if idx == warmup + steps - 1:
                    window.stop()
                    self.refit_cpu_s += self._refit_cpu(trainer)
                    if sections is not None:
                        sections.refit_cpu_s = self.refit_cpu_s

        return ProfileWindow()


def _run(system: str, opts: Options, rank: int, batches: list[Any]) -> dict[str, Any]:
    cfg = opts.throughput_config()
    migrations: list[dict[str, Any]] = []
    moves: list[str] = []
    decisions: list[str] = []
    sections = None if opts.cprofile else Sections()
    window: Any = CProfileWindow() if opts.cprofile else sections
    try:
        if system.startswith("torch-"):
            from benchmarks.baselines.torch_pipelining import time_torch_schedule

            stage_module = tp._stage_module(cfg, rank)
            if sections is not None:
                _patch_torch(sections)
                _patch_layers(sections, stage_module)
            time_torch_schedule(
                "1f1b" if system == "torch-1f1b" else "gpipe",
                stage_module,
                rank,
                tp.NUM_STAGES,
                cfg.num_microbatches,
                batches,
                lr=cfg.lr,
                warmup_steps=cfg.warmup,
                window=window,
            )
            stage_idx = rank
        else:
            from lightning_dynpipe import DynPipeStrategy

            if sections is not None:
                _patch_dynpipe(sections)
            strategy = DynPipeStrategy(
                num_microbatches=cfg.num_microbatches,
                schedule=system.split("-")[0],  # type: ignore[arg-type]
                balance=list(cfg.balance),
                timeout=cfg.timeout_s,
                adaptive=system in ("async-defaults", "async-forest"),
                predictor="forest" if system == "async-forest" else "measured",
                monitor_every_n_steps=None if system == "async-bare" else opts.monitor_every_n_steps,
            )
            timer = tp._step_timer(cfg.warmup, cfg.steps)
            run = fit_dynpipe(
                tp._model(cfg),
                batches,
                strategy,
                timer,
                world_size=tp.WORLD_SIZE,
                callbacks=[_DynPipeWindow(window, cfg.warmup, cfg.steps, sections)],
            )
            migrations, decisions = run["migrations"], run["decisions"]
            moves = [d for d in decisions if "repartition" in d.split("(", 1)[0]]
            stage_idx = timer.stage_idx
    finally:
        if sections is not None:
            sections.restore()
    if sections is not None:
        out = sections.result(cfg.steps)
    else:
        out = window.result(cfg.steps, opts.top)
    out["stage"] = stage_idx
    out["migrations"] = migrations  # a repartition changes what each stage's rows add up
    out["moves"] = moves  # the adaptive loop's reasons for them
    out["decisions"] = decisions  # every check's
    return out


def _worker(rank: int, opts: Options, port: int, result_path: str) -> None:
    from lightning_dynpipe.engine.allocator import keep_freed_memory

    external_launch_env(rank, tp.WORLD_SIZE, port)
    torch.set_num_threads(1)  # one core per stage, as in throughput.py
    keep_freed_memory()  # every system with the allocator DynPipe's CPU stages set, as in throughput.py
    tp._quiet()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp.WORLD_SIZE)
    runs: list[dict[str, Any]] = []
    try:
        batches = tp._batches(opts.throughput_config())
        for rep in range(opts.repeats):
            for system in rotated(list(opts.systems), rep):
                dist.barrier()
                mine = _run(system, opts, rank, batches)
                gathered: list[Any] = [None] * tp.WORLD_SIZE
                dist.all_gather_object(gathered, mine)
                runs.append({"rep": rep, "system": system, "stages": sorted(gathered, key=lambda g: g["stage"])})
                if rank == 0:
                    cpu = " / ".join(f"{g['main_cpu_ms']:.1f}" for g in runs[-1]["stages"])
                    moves = "".join(
                        f", moved {m['old']} -> {m['new']} at step {m['step']}" for m in mine.get("migrations", [])
                    )
                    line = f"  rep {rep + 1}/{opts.repeats}  {system:<11} main-thread CPU ms/step {cpu}{moves}"
                    print(line, flush=True)
                    for why in mine.get("moves", []):
                        print(f"    {why}", flush=True)
        if rank == 0:
            Path(result_path).write_text(json.dumps(runs), encoding="utf-8")
        workers_done()
    finally:
        close_group()


# ---------------------------------------------------------------------------------------------- analysis
def summarise(runs: list[dict[str, Any]], opts: Options) -> dict[str, Any]:
    """Per system and stage: the median over repeats of every component's ms per step and of the totals."""
    out: dict[str, Any] = {}
    for system in opts.systems:
        mine = [r for r in runs if r["system"] == system]
        stages = []
        for k in range(tp.NUM_STAGES):
            per_rep = [r["stages"][k] for r in mine]
            names = sorted({n for p in per_rep for n in p["components_ms"]})
            stages.append(
                {
                    "components_ms": {n: median([p["components_ms"].get(n, 0.0) for p in per_rep]) for n in names},
                    **{
                        f: median([p[f] for p in per_rep])
                        for f in ("main_cpu_ms", "process_cpu_ms", "wall_ms", "wrapper_calls_per_step")
                    },
                    "refit_process_ms": median([p.get("refit_process_ms", 0.0) for p in per_rep]),
                    "threads_ms": {
                        n: median([p.get("threads_ms", {}).get(n, 0.0) for p in per_rep])
                        for n in sorted({n for p in per_rep for n in p.get("threads_ms", {})})
                    },
                }
            )
        out[system] = stages
    return out


def render(summary: dict[str, Any], *, markdown: bool = False, threshold_ms: float = 0.05) -> str:
    """Rows: components (largest first); columns: system / stage; cells: CPU ms per step (medians)."""
    columns = [(s, k) for s in summary for k in range(tp.NUM_STAGES)]
    totals: dict[str, float] = defaultdict(float)
    for s, k in columns:
        for n, v in summary[s][k]["components_ms"].items():
            totals[n] = max(totals[n], abs(v))
    fixed = {OTHER, THREADS}
    names = [n for n in sorted(totals, key=lambda n: -totals[n]) if n not in fixed and totals[n] >= threshold_ms]
    rows = []
    for n in [*names, OTHER]:
        cells = [summary[s][k]["components_ms"].get(n) for s, k in columns]
        rows.append([n, *("-" if c is None else f"{c:.2f}" for c in cells)])
    rows.append(["= main thread CPU", *(f"{summary[s][k]['main_cpu_ms']:.2f}" for s, k in columns)])
    rows.append(
        [
            "  of which framework (not the arithmetic rows)",
            *(f"{_framework_ms(summary[s][k]['components_ms']):.2f}" for s, k in columns),
        ]
    )
    rows.append([THREADS, *(f"{summary[s][k]['components_ms'][THREADS]:.2f}" for s, k in columns)])
    kinds = sorted({n for s, k in columns for n in summary[s][k].get("threads_ms", {})})
    for kind in kinds:
        cells = [summary[s][k].get("threads_ms", {}).get(kind) for s, k in columns]
        rows.append([f"  of which {kind}", *("-" if c is None else f"{c:.2f}" for c in cells)])
    rows.append(["= process CPU", *(f"{summary[s][k]['process_cpu_ms']:.2f}" for s, k in columns)])
    if any(summary[s][k].get("refit_process_ms", 0.0) for s, k in columns):
        rows.append([REFITS, *(f"{summary[s][k].get('refit_process_ms', 0.0):.2f}" for s, k in columns)])
    rows.append(["wall per step", *(f"{summary[s][k]['wall_ms']:.2f}" for s, k in columns)])
    rows.append(["wrapper calls per step", *(f"{summary[s][k]['wrapper_calls_per_step']:.0f}" for s, k in columns)])
    headers = ["component (CPU ms per step)", *(f"{s} / stage {k}" for s, k in columns)]
    return format_table(headers, rows, markdown=markdown)


def _framework_ms(components: dict[str, float]) -> float:
    """Main-thread CPU outside the model's arithmetic (:data:`ARITHMETIC`): what the framework adds."""
    return sum(v for n, v in components.items() if n not in ARITHMETIC and n != THREADS)


def render_cprofile(runs: list[dict[str, Any]]) -> str:
    """The first repeat's cProfile tables, per system and stage."""
    out = []
    seen = set()
    for r in runs:
        if r["system"] in seen:
            continue
        seen.add(r["system"])
        for k, st in enumerate(r["stages"]):
            out.append(
                f"{r['system']} / stage {k}: profiled main-thread CPU {st['main_cpu_ms']:.1f} ms per step "
                f"(wall {st['wall_ms']:.1f} ms; cProfile inflates Python code)"
            )
            for key, label in (("by_own", "own ms/step"), ("by_cumulative", "cumulative ms/step")):
                rows = [[w, f"{n:.1f}", f"{own:.2f}", f"{cum:.2f}"] for w, n, own, cum in st[key]]
                out.append(format_table([f"function (sorted by {label})", "calls/step", "own", "cum"], rows))
    return "\n\n".join(out)


# ---------------------------------------------------------------------------------------------- CLI
def _parse(argv: Sequence[str] | None) -> tuple[Options, Path, list[Path] | None]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = Options()
    p.add_argument("--systems", default=",".join(d.systems), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--width", type=int, default=d.width)
    p.add_argument("--depth", type=int, default=d.depth)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--microbatches", "-M", type=int, default=d.num_microbatches)
    p.add_argument("--balance", default=None, help="layers per stage, e.g. 4,5 (default: by parameter count)")
    p.add_argument(
        "--monitor-every-n-steps",
        type=int,
        default=d.monitor_every_n_steps,
        help="DynPipe's stage monitor period (0: off; default 10, the strategy's default)",
    )
    p.add_argument("--cprofile", action="store_true", help="cProfile's top functions instead of the components")
    p.add_argument("--top", type=int, default=d.top, help="functions per cProfile table")
    p.add_argument("--quick", action="store_true", help="smoke run: MLP width 64 depth 3, batch 32, 1 repeat")
    p.add_argument("--out-dir", type=Path, default=_DEFAULT_OUT)
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        help="re-analyse stored runs without measuring; several files of the same options are pooled",
    )
    a = p.parse_args(argv)
    systems = tuple(s.strip() for s in a.systems.split(",") if s.strip())
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown systems {unknown}; valid: {list(SYSTEMS)}")
    opts = Options(
        systems=systems,
        repeats=a.repeats,
        steps=a.steps,
        warmup=a.warmup,
        width=a.width,
        depth=a.depth,
        batch_size=a.batch_size,
        num_microbatches=a.microbatches,
        cprofile=a.cprofile,
        top=a.top,
        monitor_every_n_steps=a.monitor_every_n_steps or None,
    )
    if a.quick:
        opts = replace(opts, repeats=1, steps=3, warmup=2, width=64, depth=3, batch_size=32)
    balance = tuple(int(x) for x in a.balance.split(",")) if a.balance else tp.default_balance(opts.width, opts.depth)
    if len(balance) != tp.NUM_STAGES or sum(balance) != opts.depth + 1 or min(balance) < 1:
        p.error(f"--balance needs {tp.NUM_STAGES} positive entries summing to depth + 1 = {opts.depth + 1}")
    if opts.batch_size % opts.num_microbatches or opts.num_microbatches < tp.NUM_STAGES:
        p.error(
            f"--batch-size ({opts.batch_size}) must be divisible by --microbatches ({opts.num_microbatches}), "
            f"and --microbatches must be >= {tp.NUM_STAGES} (torch's Schedule1F1B)"
        )
    return replace(opts, balance=balance), a.out_dir, a.from_json


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measures, prints the table (or the cProfile tables) and writes the JSON record."""
    opts, out_dir, stored = _parse(argv)
    if stored:
        return _reanalyse(stored)
    machine, cmd = machine_info(), command_line()
    print(describe_machine(machine))
    print(
        f"model: MLP width {opts.width} depth {opts.depth}, balance {list(opts.balance)}, batch {opts.batch_size}, "
        f"M={opts.num_microbatches}; {opts.repeats} repeats x ({opts.warmup} warm-up + {opts.steps} profiled steps)"
    )
    print(f"code: commit {(machine.get('git_commit') or '?')[:10]}; command: {cmd}", flush=True)
    from torch.multiprocessing.spawn import spawn

    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "runs.json")
        spawn(_worker, args=(opts, free_port(), result_path), nprocs=tp.WORLD_SIZE, join=True)  # type: ignore[no-untyped-call]
        runs = json.loads(Path(result_path).read_text(encoding="utf-8"))
    machine["load_average_1_5_15_after"] = [round(x, 2) for x in os.getloadavg()]
    payload: dict[str, Any] = {"options": asdict(opts), "machine": machine, "command": cmd, "runs": runs}
    print()
    if opts.cprofile:
        text = render_cprofile(runs)
        payload["text"] = text
        print(text)
    else:
        summary = summarise(runs, opts)
        payload["summary"] = summary
        payload["markdown"] = render(summary, markdown=True)
        print(render(summary))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"profile_step-{time.strftime('%Y%m%d-%H%M%S')}{'-cprofile' if opts.cprofile else ''}.json"
    path.write_text(json.dumps(payload, indent=1), encoding="utf-8")
    print(f"\nraw: {path}")
    return payload


def _reanalyse(paths: list[Path]) -> dict[str, Any]:
    """Prints the table of stored runs; runs of several files (same options but the repeats) are pooled."""
    payloads = [json.loads(p.read_text(encoding="utf-8")) for p in paths]
    first = payloads[0]
    ignore = {"repeats"}
    for path, payload in zip(paths[1:], payloads[1:]):
        a = {k: v for k, v in first["options"].items() if k not in ignore}
        b = {k: v for k, v in payload["options"].items() if k not in ignore}
        if a != b:
            raise SystemExit(f"{path} was measured with other options than {paths[0]}: {b} != {a}")
    opts = _options_from_json(first["options"])
    runs = [r for payload in payloads for r in payload["runs"]]
    for payload, path in zip(payloads, paths):
        m = payload["machine"]
        print(f"{path}: {m['date_utc']}, load {m['load_average_1_5_15']}, commit {(m.get('git_commit') or '?')[:10]}")
    if opts.cprofile:
        print(render_cprofile(runs))
        return {"runs": runs}
    summary = summarise(runs, replace(opts, repeats=len(runs) // max(len(opts.systems), 1)))
    print(render(summary))
    return {"runs": runs, "summary": summary}


def _options_from_json(d: dict[str, Any]) -> Options:
    return Options(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


if __name__ == "__main__":
    main()
