"""Does the schedule simulator predict measured 2-stage ``async`` throughput? Three models, within 15%?

For three demo models (the MNIST :class:`~lightning_dynpipe.demos.MLP`, the :class:`~lightning_dynpipe.demos.CNN`
and a :class:`~lightning_dynpipe.demos.HeavyLayerMLP` with one expensive hidden block), each split into a
fixed 2-stage partition (the planner's choice on a profile taken before measuring), the script

* **predicts** steady-state samples/s with :func:`lightning_dynpipe.schedule.simulate` (``"async"``,
  ``step_sync="last_stage_broadcast"``) from what the planner would know at set-up:

  - per-stage forward and backward time = the sum over the stage's layers of
    :func:`~lightning_dynpipe.profiling.profile_layers` on one sample micro-batch (wall time, one thread);
  - per-update time = one SGD ``step`` + ``zero_grad`` of the stage's parameters, timed alone, plus on
    stage 0 (staleness 1) one copy of its parameters: the copy-on-write weight stash copies the live weights
    before each update while a micro-batch still uses them;
  - transfer time per boundary = ``latency + activation bytes / bandwidth`` from
    :func:`~lightning_dynpipe.engine.probe.probe_p2p` on the workers' gloo group (the simulator lets a
    transfer overlap compute by itself, so the full transfer time is its input);
  - not included: the loss and ``training_step`` on the last stage, Lightning's loop and hooks, the
    executor's dispatch, serialising and sending messages (CPU work on the sending stage), and other load;

* **measures** the same configuration through the real Lightning ``Trainer`` with
  ``DynPipeStrategy(schedule="async", balance=<the partition>, adaptive=False)``, with the harness of
  ``benchmarks/throughput.py`` (two pre-initialised gloo workers, one compute thread each, the clock on the
  last stage around the timed steps), interleaved: ``for rep: for model in models rotated by rep``. The
  profile, the update costs and the link probe are re-measured at the start of every repeat on both workers
  at once and pooled (medians), so they see the same load as the runs.

It prints the table (model, partition, predicted samples/s, measured median, error %) and, as a diagnosis,
the prediction from the costs measured *inside* the runs (``StepStats``: isolates the schedule model from the
cost inputs), the per-stage breakdown and the CPU each stage got. Raw results go to ``benchmarks/out/``, the
plot to ``docs/img/simulator_accuracy.png``.

Usage (from the repository root)::

    .venv/bin/python benchmarks/simulator_accuracy.py             # the documented run (a few minutes on 2 cores)
    .venv/bin/python benchmarks/simulator_accuracy.py --quick     # smoke run: tiny models, 1 repeat (~15 s)
    .venv/bin/python benchmarks/simulator_accuracy.py --from-json benchmarks/out/simulator_accuracy-<stamp>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
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
from benchmarks.throughput import _costs_from_runs, _per_step, _quiet, _step_timer  # noqa: E402

NUM_STAGES = 2
WORLD_SIZE = NUM_STAGES
TARGET_ERROR = 0.15
_DEFAULT_PLOT = _ROOT / "docs" / "img" / "simulator_accuracy.png"
_DEFAULT_OUT = _ROOT / "benchmarks" / "out"


@dataclass(frozen=True)
class RunSpec:
    """One measured system: a demo model, its batch shape, and how it is split.

    Attributes:
        label: the name in tables and plots.
        model: class name in :mod:`lightning_dynpipe.demos`.
        init_args: keyword arguments of the class (as pairs, so the spec stays hashable).
        batch_size: samples per Lightning step.
        num_microbatches: ``M``.
        balance: explicit layers per stage, or ``"auto"`` / ``"parameters"`` (the strategy decides at set-up).
        framework: a null model that calibrates the framework's own costs (see :func:`null_spec`), not a
            model under test.
    """

    label: str
    model: str
    init_args: tuple[tuple[str, Any], ...]
    batch_size: int
    num_microbatches: int
    balance: tuple[int, ...] | str
    framework: bool = False

    @property
    def model_key(self) -> str:
        """Identifies the model and micro-batch shape (specs that share it share one calibration)."""
        args = ",".join(f"{k}={v}" for k, v in self.init_args)
        return f"{self.model}({args})/mb{self.batch_size // self.num_microbatches}"


@dataclass(frozen=True)
class Config:
    """Everything a worker needs; also recorded in the JSON output."""

    specs: tuple[RunSpec, ...] = ()
    repeats: int = 9
    steps: int = 20
    warmup: int = 3
    lr: float = 0.05
    seed: int = 0
    timeout_s: float = 300.0
    sim_steps: int = 12
    calib_iters: int = 9
    extra: dict[str, Any] = field(default_factory=dict)


# Chosen once, before measuring: the throughput benchmark's MLP; the CNN at a micro-batch of 32 (about 10 ms of
# compute per micro-batch on its heavier stage); the heavy-layer MLP with its defaults. Every step is tens of ms
# of arithmetic per stage on one core, so the runs are compute-bound, as pipeline parallelism assumes.
MODELS: tuple[tuple[str, str, tuple[tuple[str, Any], ...], int, int], ...] = (
    ("MLP", "MLP", (("width", 512), ("depth", 8)), 256, 4),
    ("CNN", "CNN", (("channels", 16), ("hidden", 128)), 128, 4),
    ("HeavyLayerMLP", "HeavyLayerMLP", (("width", 256), ("heavy_width", 4096), ("depth", 6)), 256, 4),
)
QUICK_MODELS: tuple[tuple[str, str, tuple[tuple[str, Any], ...], int, int], ...] = (
    ("MLP", "MLP", (("width", 64), ("depth", 3)), 32, 4),
    ("CNN", "CNN", (("channels", 4), ("hidden", 32)), 32, 4),
    ("HeavyLayerMLP", "HeavyLayerMLP", (("width", 32), ("heavy_width", 256), ("depth", 3)), 32, 4),
)


def null_spec(batch_size: int, num_microbatches: int) -> RunSpec:
    """The null model run beside the models with this batch shape: the framework's costs with almost no arithmetic.

    A 2-layer MLP of width 4 (about 3,000 multiply-adds per sample), one layer per stage, on the same input
    batches. Whatever its stages spend beyond the profile of its layers is the cost of running a micro-batch
    through Lightning and DynPipe (see :func:`framework_overhead`); nothing in it is fitted to the models.
    """
    return RunSpec(
        f"null {batch_size}/{num_microbatches}",
        "MLP",
        (("width", 4), ("depth", 1)),
        batch_size,
        num_microbatches,
        (1, 1),
        framework=True,
    )


# ---------------------------------------------------------------------------------------------- model / data
def build_model(spec: RunSpec, cfg: Config) -> Any:
    """The demo model of ``spec``, seeded: identical initial weights in every process and run."""
    from lightning_dynpipe import demos

    torch.manual_seed(cfg.seed)
    return getattr(demos, spec.model)(**dict(spec.init_args), lr=cfg.lr, optimizer="sgd")


def make_batches(spec: RunSpec, cfg: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``warmup + steps`` fixed random batches of the model's input shape (MNIST-shaped), labels 0-9."""
    shape = build_model(spec, cfg).input_shape
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return [
        (torch.randn(spec.batch_size, *shape, generator=g), torch.randint(0, 10, (spec.batch_size,), generator=g))
        for _ in range(cfg.warmup + cfg.steps)
    ]


def planner_balance(spec: RunSpec, cfg: Config) -> tuple[int, ...]:
    """The planner's 2-stage partition for ``spec`` from a profile taken now (no link cost charged)."""
    from lightning_dynpipe.plan.auto import best_plan
    from lightning_dynpipe.profiling import profile_layers

    model = build_model(spec, cfg)
    mb = spec.batch_size // spec.num_microbatches
    profile = profile_layers(model.pipeline, model.example_input(mb), optimizer_state_bytes_per_param_byte=0.0)
    plan = best_plan(profile.to_model_cost(), WORLD_SIZE, num_stages=NUM_STAGES, num_microbatches=spec.num_microbatches)
    return tuple(plan.partition.balance)


# ---------------------------------------------------------------------------------------------- calibration
def _time_update(module: torch.nn.Module, lr: float, stash: bool, iters: int) -> dict[str, float]:
    """Wall seconds of one SGD step + zero_grad of ``module`` alone, and of one copy of its parameters."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    upd: list[float] = []
    cpy: list[float] = []
    for i in range(iters + 2):
        for p in params:
            p.grad = torch.randn_like(p)
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        if stash:
            for p in params:  # what WeightStash.before_update does while a micro-batch uses the live version
                p.data = p.data.clone()
        t2 = time.perf_counter()
        if i >= 2:  # the first iterations allocate
            upd.append(t1 - t0)
            cpy.append(t2 - t1)
    return {"update": statistics.median(upd), "stash": statistics.median(cpy)}


def calibrate_model(spec: RunSpec, cfg: Config) -> dict[str, Any]:
    """Profile of every layer on one micro-batch, and update/stash costs of both stages at every cut."""
    from lightning_dynpipe.profiling import profile_layers

    model = build_model(spec, cfg)
    mb = spec.batch_size // spec.num_microbatches
    profile = profile_layers(model.pipeline, model.example_input(mb), optimizer_state_bytes_per_param_byte=0.0)
    layers = [
        {
            "forward_s": s.forward_s,
            "backward_s": s.backward_s,
            "activation_bytes": s.activation_bytes,
            "param_bytes": s.param_bytes,
            "name": s.name,
        }
        for s in profile.layers
    ]
    pipeline = model.pipeline
    cuts: dict[str, Any] = {}
    for cut in range(1, len(pipeline)):
        cuts[str(cut)] = [
            _time_update(pipeline[:cut], cfg.lr, stash=True, iters=cfg.calib_iters),  # stage 0: staleness 1
            _time_update(pipeline[cut:], cfg.lr, stash=False, iters=cfg.calib_iters),
        ]
    return {"layers": layers, "cuts": cuts}


def _probe_link(rank: int) -> dict[str, float]:
    from lightning_dynpipe.engine.probe import probe_p2p

    comm = probe_p2p(dist.group.WORLD, 1 - rank, initiator=rank == 0)
    return {"latency_s": float(comm.latency_s), "bandwidth_Bps": float(comm.bandwidth_Bps)}


# ---------------------------------------------------------------------------------------------- worker
def _strategy(spec: RunSpec, cfg: Config) -> Any:
    from lightning_dynpipe import DynPipeStrategy

    balance: Any = list(spec.balance) if isinstance(spec.balance, tuple) else spec.balance
    # adaptive=False: the partition under test must stay the one the run starts with.
    return DynPipeStrategy(
        num_stages=NUM_STAGES,
        num_microbatches=spec.num_microbatches,
        schedule="async",
        balance=balance,
        adaptive=False,
        timeout=cfg.timeout_s,
    )


def _partition_recorder() -> Any:
    """A callback keeping the partition and plan table the strategy chose at set-up (teardown clears them)."""
    from lightning.pytorch import Callback

    class PartitionRecorder(Callback):
        def __init__(self) -> None:
            self.balance: list[int] = []
            self.plan_table: str | None = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.balance = list(trainer.strategy.partition.balance)
            self.plan_table = trainer.strategy.plan_table

    return PartitionRecorder()


def _worker(rank: int, cfg: Config, port: int, result_path: str) -> None:
    external_launch_env(rank, WORLD_SIZE, port)
    torch.set_num_threads(1)  # one compute thread per stage, as in throughput.py
    _quiet()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    runs: list[dict[str, Any]] = []
    calibration: list[dict[str, Any]] = []
    try:
        batches = {s.label: make_batches(s, cfg) for s in cfg.specs}
        by_key = {s.model_key: s for s in cfg.specs}
        for rep in range(cfg.repeats):
            dist.barrier()
            mine = {
                "rank": rank,
                "link": _probe_link(rank),
                "models": {key: calibrate_model(s, cfg) for key, s in by_key.items()},
            }
            gathered: list[Any] = [None] * WORLD_SIZE
            dist.all_gather_object(gathered, mine)  # both ranks calibrate at once, like the stages run
            calibration.append({"rep": rep, "ranks": gathered})
            for position, spec in enumerate(rotated(cfg.specs, rep)):
                load = os.getloadavg()[0]
                dist.barrier()
                recorder = _partition_recorder()
                res = fit_dynpipe(
                    build_model(spec, cfg),
                    batches[spec.label],
                    _strategy(spec, cfg),
                    _step_timer(cfg.warmup, cfg.steps),
                    world_size=WORLD_SIZE,
                    callbacks=[recorder],
                )
                samples = cfg.steps * spec.batch_size
                runs.append(
                    {
                        "rep": rep,
                        "position": position,
                        "system": spec.label,
                        "seconds": res["seconds"],
                        "steps": cfg.steps,
                        "samples": samples,
                        "samples_per_s": samples / res["seconds"],
                        "load1": load,
                        "balance": recorder.balance,
                        "plan_table": recorder.plan_table,
                        "stages": res["stages"],
                        "cpu": res["cpu"],
                    }
                )
                if rank == 0:
                    print(
                        f"  rep {rep + 1}/{cfg.repeats}  {spec.label:<22} balance {recorder.balance}"
                        f"  {samples / res['seconds']:8.1f} samples/s  (load {load:.1f})",
                        flush=True,
                    )
        if rank == 0:
            Path(result_path).write_text(json.dumps({"runs": runs, "calibration": calibration}), encoding="utf-8")
        workers_done()
    finally:
        close_group()


def measure(cfg: Config) -> dict[str, Any]:
    """Spawns the two workers and returns their runs and calibrations (rank 0's record)."""
    from torch.multiprocessing.spawn import spawn

    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "runs.json")
        spawn(_worker, args=(cfg, free_port(), result_path), nprocs=WORLD_SIZE, join=True)  # type: ignore[no-untyped-call]
        return dict(json.loads(Path(result_path).read_text(encoding="utf-8")))


# ---------------------------------------------------------------------------------------------- prediction
def pooled_costs(calibration: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Medians over ranks and repeats: per-layer profile, per-cut update/stash costs, the link."""
    samples = [r["models"][key] for c in calibration for r in c["ranks"]]
    n = len(samples[0]["layers"])
    layers = [
        {f: median([s["layers"][i][f] for s in samples]) for f in ("forward_s", "backward_s")}
        | {
            "activation_bytes": samples[0]["layers"][i]["activation_bytes"],
            "param_bytes": samples[0]["layers"][i]["param_bytes"],
            "name": samples[0]["layers"][i]["name"],
        }
        for i in range(n)
    ]
    cuts = {
        cut: [
            {w: median([s["cuts"][cut][k][w] for s in samples]) for w in ("update", "stash")} for k in range(NUM_STAGES)
        ]
        for cut in samples[0]["cuts"]
    }
    links = [r["link"] for c in calibration for r in c["ranks"] if r["rank"] == 0]
    link = {
        "latency_s": median([x["latency_s"] for x in links]),
        "bandwidth_Bps": median([x["bandwidth_Bps"] for x in links]),
    }
    return {"layers": layers, "cuts": cuts, "link": link}


def stage_inputs(costs: dict[str, Any], balance: Sequence[int]) -> dict[str, list[float]]:
    """The simulator's per-stage inputs for a 2-stage ``balance`` (seconds)."""
    cut = int(balance[0])
    layers = costs["layers"]
    ranges = [range(0, cut), range(cut, len(layers))]
    upd = costs["cuts"][str(cut)]
    transfer = costs["link"]["latency_s"] + layers[cut - 1]["activation_bytes"] / costs["link"]["bandwidth_Bps"]
    return {
        "forward": [sum(layers[i]["forward_s"] for i in r) for r in ranges],
        "backward": [sum(layers[i]["backward_s"] for i in r) for r in ranges],
        # stage 0 has staleness 1 under async: one weight copy per update; stage 1 none
        "update": [upd[0]["update"] + upd[0]["stash"], upd[1]["update"]],
        "comm": [transfer],
    }


def simulate_step(
    inputs: dict[str, list[float]], num_microbatches: int, sim_steps: int, *, with_comm: bool = True
) -> Any:
    """The simulated ``async`` run (``step_sync="last_stage_broadcast"``) of 2 stages with these inputs.

    ``inputs`` may also hold ``step`` and ``send`` (the simulator's ``step_overhead`` and ``send_overhead``).
    """
    from lightning_dynpipe.schedule import simulate

    return simulate(
        "async",
        NUM_STAGES,
        num_microbatches,
        sim_steps,
        forward_time=inputs["forward"],
        backward_time=inputs["backward"],
        update_time=inputs["update"],
        comm_time=inputs["comm"] if with_comm else 0.0,
        step_sync="last_stage_broadcast",
        step_overhead=inputs.get("step", 0.0),
        send_overhead=inputs.get("send", 0.0),
    )


def framework_overhead(payload: dict[str, Any], null: RunSpec) -> dict[str, list[float]] | None:
    """Per stage, seconds the framework adds, measured on the null model's runs beside the models.

    * ``forward`` / ``backward`` / ``update``: per micro-batch, the null model's costs inside the runs
      (StepStats) minus its profile and its update timed alone (0 if negative): dispatch,
      ``functional_call`` on the stashed weights, ``training_step`` with ``self.log`` and the loss on the
      last stage, Lightning's optimizer wrapper and hooks;
    * ``send``: per send, StepStats ``send`` time (headers, handing the tensor to the transport);
    * ``step``: per step, the last stage's time outside the executor (Lightning's loop, hooks, the metrics
      mirror) plus each stage's own unattributed executor time. The last stage's is used for every stage
      because on the other stages that time also holds the wait for the last stage's step (the gate the
      simulator models itself).
    """
    runs = [r for r in payload["runs"] if r["system"] == null.label]
    inside = _costs_from_runs(payload["runs"], null.label)
    per_rep = [p for p in (_per_step(r["stages"]) for r in runs) if p]
    if inside is None or not per_rep:
        return None
    alone = stage_inputs(pooled_costs(payload["calibration"], null.model_key), null.balance)  # type: ignore[arg-type]
    last = NUM_STAGES - 1
    outside_last = median([p[last]["outside_s"] for p in per_rep])
    return {
        **{
            w: [max(0.0, inside[w][k] - alone[w][k]) for k in range(NUM_STAGES)]
            for w in ("forward", "backward", "update")
        },
        "send": [median([p[k]["send_s"] for p in per_rep]) / null.num_microbatches for k in range(NUM_STAGES)],
        "step": [outside_last + median([max(0.0, p[k]["other_s"]) for p in per_rep]) for k in range(NUM_STAGES)],
    }


def with_framework(inputs: dict[str, list[float]], framework: dict[str, list[float]]) -> dict[str, list[float]]:
    """The profile's simulator inputs plus the framework's costs from :func:`framework_overhead`."""
    return {
        **{w: [a + b for a, b in zip(inputs[w], framework[w])] for w in ("forward", "backward", "update")},
        "comm": inputs["comm"],
        "send": framework["send"],
        "step": framework["step"],
    }


def resolved_balance(runs: list[dict[str, Any]], label: str) -> tuple[int, ...]:
    """The partition the runs of ``label`` used (the most frequent one, if set-up decided differently)."""
    seen = [tuple(r["balance"]) for r in runs if r["system"] == label]
    return max(set(seen), key=seen.count)


def summarise(payload: dict[str, Any]) -> dict[str, Any]:
    """Per spec: measured medians, predictions (profile; costs inside the runs), errors, breakdown, CPU."""
    cfg = config_from_json(payload["config"])
    runs, calibration = payload["runs"], payload["calibration"]
    nulls = {(s.batch_size, s.num_microbatches): s for s in cfg.specs if s.framework}
    out: dict[str, Any] = {}
    for spec in cfg.specs:
        mine = [r for r in runs if r["system"] == spec.label]
        if not mine or spec.framework:
            continue
        sps = [r["samples_per_s"] for r in mine]
        q1, q3 = quartiles(sps)
        balance = resolved_balance(runs, spec.label)
        costs = pooled_costs(calibration, spec.model_key)
        inputs = stage_inputs(costs, balance)
        sim = simulate_step(inputs, spec.num_microbatches, cfg.sim_steps)
        predicted = spec.batch_size / sim.steady_state_step_time
        meas = median(sps)
        row: dict[str, Any] = {
            "label": spec.label,
            "balance": list(balance),
            "batch_size": spec.batch_size,
            "num_microbatches": spec.num_microbatches,
            "measured": meas,
            "q1": q1,
            "q3": q3,
            "n": len(sps),
            "per_rep": sps,
            "partitions_seen": sorted({str(r["balance"]) for r in mine}),
            "predicted": predicted,
            "error": predicted / meas - 1.0,
            "inputs_s": inputs,
            "bubble_fraction": list(sim.bubble_fraction),
            "predicted_without_update_comm": spec.batch_size
            / simulate_step(
                {**inputs, "update": [0.0, 0.0]}, spec.num_microbatches, cfg.sim_steps, with_comm=False
            ).steady_state_step_time,
            "load1": median([r["load1"] for r in mine]),
        }
        null = nulls.get((spec.batch_size, spec.num_microbatches))
        framework = framework_overhead(payload, null) if null is not None else None
        if framework is not None:
            full = with_framework(inputs, framework)
            row["predicted_framework"] = (
                spec.batch_size / simulate_step(full, spec.num_microbatches, cfg.sim_steps).steady_state_step_time
            )
            row["error_framework"] = row["predicted_framework"] / meas - 1.0
            row["framework_s"] = framework
            row["framework_from"] = null.label  # type: ignore[union-attr]
        inside = _costs_from_runs(runs, spec.label)
        if inside is not None:
            t = simulate_step(
                {
                    "forward": inside["forward"],
                    "backward": inside["backward"],
                    "update": inside["update"],
                    "comm": inputs["comm"],
                },
                spec.num_microbatches,
                cfg.sim_steps,
            ).steady_state_step_time
            row["predicted_inside"] = spec.batch_size / t
            row["error_inside"] = row["predicted_inside"] / meas - 1.0
            row["inside_costs_s"] = inside
        per_rep = [p for p in (_per_step(r["stages"]) for r in mine) if p]
        row["breakdown"] = (
            [
                {f: median([p[k][f] for p in per_rep]) for f in per_rep[0][k] if f != "stage"} | {"stage": k}
                for k in range(NUM_STAGES)
            ]
            if per_rep
            else []
        )
        cpu = []
        for k in range(NUM_STAGES):
            cs = [next(c["cpu"] for c in r["cpu"] if c["stage"] == k) for r in mine]
            entry = {
                "stage": k,
                "cores_used": median([c["process_cpu_s"] / c["wall_s"] for c in cs]),
                "cpu_per_step_s": median([c["process_cpu_s"] / cfg.steps for c in cs]),
            }
            if all("main_runqueue_wait_s" in c for c in cs):
                entry["runqueue_wait_share"] = median([c["main_runqueue_wait_s"] / c["wall_s"] for c in cs])
            cpu.append(entry)
        row["cpu"] = cpu
        out[spec.label] = row
    return out


# ---------------------------------------------------------------------------------------------- rendering
def load_note(loads: Sequence[float]) -> str:
    """The 1-minute load average over the runs; it counts this benchmark's own two stage processes too."""
    if not loads:
        return "load ?"
    return f"load avg {min(loads):.1f}-{max(loads):.1f} during the runs (own 2 processes included)"


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def _headline_error(row: dict[str, Any]) -> float:
    """The error of the full prediction (profile + framework), or of the profile alone in runs without a null model."""
    return float(row.get("error_framework", row["error"]))


def render_table(summary: dict[str, Any], *, markdown: bool = False) -> str:
    """model / partition / both predictions and their errors / measured, and whether |error| <= 15%."""
    rows = []
    for row in summary.values():
        fw = "predicted_framework" in row
        rows.append(
            [
                row["label"],
                str(row["balance"]),
                f"{row['batch_size']}/{row['num_microbatches']}",
                f"{row['predicted']:.1f}",
                _pct(row["error"]),
                f"{row['predicted_framework']:.1f}" if fw else "-",
                _pct(row["error_framework"]) if fw else "-",
                f"{row['measured']:.1f}",
                f"{row['q1']:.1f}-{row['q3']:.1f}",
                "yes" if abs(_headline_error(row)) <= TARGET_ERROR else "NO",
            ]
        )
    headers = [
        "model",
        "partition",
        "batch/M",
        "predicted: profile",
        "error",
        "predicted: profile + framework",
        "error",
        "measured (median)",
        "measured IQR",
        f"|error| <= {TARGET_ERROR:.0%} (full prediction)",
    ]
    return format_table(headers, rows, markdown=markdown)


def render_framework(summary: dict[str, Any], *, markdown: bool = False) -> str:
    """Per null model and stage, the framework's costs in ms (what :func:`framework_overhead` measured)."""
    rows, seen = [], set()
    for row in summary.values():
        fw, label = row.get("framework_s"), row.get("framework_from")
        if fw is None or label in seen:
            continue
        seen.add(label)
        for k in range(NUM_STAGES):
            rows.append(
                [
                    f"{label} / stage {k}",
                    *(f"{fw[w][k] * 1e3:.2f}" for w in ("forward", "backward", "update", "send", "step")),
                ]
            )
    headers = ["null model / stage", "per forward", "per backward", "per update", "per send", "per step"]
    return format_table(headers, rows, markdown=markdown)


def render_diagnosis(summary: dict[str, Any], *, markdown: bool = False) -> str:
    """The same simulator fed with the costs measured inside the runs, and without update/communication."""
    rows = []
    for row in summary.values():
        rows.append(
            [
                row["label"],
                f"{row['predicted_without_update_comm']:.1f}",
                f"{row['predicted']:.1f}",
                f"{row['predicted_inside']:.1f}" if "predicted_inside" in row else "-",
                f"{row['measured']:.1f}",
                _pct(row["error_inside"]) if "error_inside" in row else "-",
            ]
        )
    headers = [
        "model",
        "sim: profile fwd/bwd only",
        "sim: + update, stash, link (headline)",
        "sim: costs inside the runs",
        "measured",
        "error, inside costs",
    ]
    return format_table(headers, rows, markdown=markdown)


def render_inputs(summary: dict[str, Any], *, markdown: bool = False) -> str:
    """Per stage, ms per micro-batch: profiled forward/backward vs measured inside the runs; update; link."""
    rows = []
    for row in summary.values():
        ins = row["inputs_s"]
        inside = row.get("inside_costs_s")
        for k in range(NUM_STAGES):
            rows.append(
                [
                    f"{row['label']} / stage {k}",
                    f"{ins['forward'][k] * 1e3:.2f}",
                    f"{inside['forward'][k] * 1e3:.2f}" if inside else "-",
                    f"{ins['backward'][k] * 1e3:.2f}",
                    f"{inside['backward'][k] * 1e3:.2f}" if inside else "-",
                    f"{ins['update'][k] * 1e3:.2f}",
                    f"{inside['update'][k] * 1e3:.2f}" if inside else "-",
                    f"{ins['comm'][0] * 1e3:.2f}" if k == 0 else "",
                ]
            )
    headers = [
        "model / stage",
        "fwd profile",
        "fwd in run",
        "bwd profile",
        "bwd in run",
        "update alone",
        "update in run",
        "link",
    ]
    return format_table(headers, rows, markdown=markdown)


def render_breakdown(summary: dict[str, Any], *, markdown: bool = False) -> str:
    """Per stage, ms per step: the arithmetic the simulator assumed, the CPU the process used, where the wall went.

    ``arithmetic`` is ``M x (forward + backward + update)`` of the simulator's inputs; ``CPU`` is the stage
    process's CPU time (all threads) per timed step; ``fwd`` .. ``outside executor`` are StepStats medians
    (``outside executor``: the rest of the Lightning step); ``cores`` is CPU time over wall time and
    ``run-queue wait`` the share of wall time the main thread was runnable while another process had the core.
    """
    rows = []
    for row in summary.values():
        ins, m = row["inputs_s"], row["num_microbatches"]
        for st, cpu in zip(row["breakdown"], row["cpu"]):
            k = st["stage"]
            arith = m * (ins["forward"][k] + ins["backward"][k] + ins["update"][k])
            wait = cpu.get("runqueue_wait_share")
            rows.append(
                [
                    f"{row['label']} / stage {k}",
                    f"{arith * 1e3:.1f}",
                    f"{cpu['cpu_per_step_s'] * 1e3:.1f}",
                    f"{st['forward_s'] * 1e3:.1f}",
                    f"{st['backward_s'] * 1e3:.1f}",
                    f"{st['optimizer_s'] * 1e3:.1f}",
                    f"{st['recv_wait_s'] * 1e3:.1f}",
                    f"{st['send_s'] * 1e3:.1f}",
                    f"{st['other_s'] * 1e3:.1f}",
                    f"{st['outside_s'] * 1e3:.1f}",
                    f"{st['wall_per_step_s'] * 1e3:.1f}",
                    f"{cpu['cores_used']:.2f}",
                    "-" if wait is None else f"{wait * 100:.0f}%",
                ]
            )
    headers = [
        "model / stage",
        "arithmetic (sim input)",
        "CPU",
        "fwd",
        "bwd",
        "opt",
        "recv wait",
        "send",
        "other",
        "outside executor",
        "wall/step",
        "cores",
        "run-queue wait",
    ]
    return format_table(headers, rows, markdown=markdown)


def render_verdict(summary: dict[str, Any]) -> str:
    rows = list(summary.values())
    met = [r["label"] for r in rows if abs(_headline_error(r)) <= TARGET_ERROR]
    missed = [f"{r['label']} ({_pct(_headline_error(r))})" for r in rows if abs(_headline_error(r)) > TARGET_ERROR]
    verdict = "met" if not missed else "MISSED"
    what = (
        "profile + framework costs from the null model" if all("error_framework" in r for r in rows) else "profile only"
    )
    return (
        f"target |predicted/measured - 1| <= {TARGET_ERROR:.0%} on every model ({what}) -> {verdict}"
        f"  (within: {', '.join(met) or 'none'}; outside: {', '.join(missed) or 'none'})"
    )


def render_runs(paths: Sequence[Path], *, markdown: bool = False) -> str:
    """One row per stored run: when, load, and the headline error of every model."""
    rows: list[list[str]] = []
    labels: list[str] = []
    for path in paths:
        payload = json.loads(Path(path).read_text(encoding="utf-8"))
        summary = payload.get("summary") or summarise(payload)
        labels = labels or list(summary)
        loads = [r["load1"] for r in payload["runs"]]
        within = sum(abs(_headline_error(r)) <= TARGET_ERROR for r in summary.values())
        rows.append(
            [
                Path(path).name,
                payload["machine"]["date_utc"][11:16],
                f"{min(loads):.1f}-{max(loads):.1f}",
                *[_pct(summary[m]["error"]) if m in summary else "-" for m in labels],
                *[
                    _pct(summary[m]["error_framework"]) if "error_framework" in summary.get(m, {}) else "-"
                    for m in labels
                ],
                f"{within}/{len(summary)}",
            ]
        )
    headers = [
        "run",
        "UTC",
        "load (1 min)",
        *[f"{m} error (profile)" for m in labels],
        *[f"{m} error (+ framework)" for m in labels],
        f"within {TARGET_ERROR:.0%}",
    ]
    return format_table(headers, rows, markdown=markdown)


def plot(summary: dict[str, Any], payload: dict[str, Any], path: Path) -> None:
    """Grouped bars per model: predicted (profile), predicted (costs inside the runs), measured with repeats."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no plot was written: pip install 'lightning-dynpipe[plot]'")
        return
    cfg, machine = config_from_json(payload["config"]), payload["machine"]
    rows = list(summary.values())
    fig, ax = plt.subplots(figsize=(9, 4.5))
    w = 0.2
    for i, row in enumerate(rows):
        full = row.get("predicted_framework", row["predicted"])
        ax.bar(
            i - 1.5 * w,
            row["predicted"],
            w,
            color="#4C72B0",
            label="simulated from the profile alone" if i == 0 else None,
        )
        if "predicted_framework" in row:
            ax.bar(
                i - 0.5 * w,
                full,
                w,
                color="#55A868",
                label="simulated from the profile + framework costs of the null model" if i == 0 else None,
            )
        if "predicted_inside" in row:
            ax.bar(
                i + 0.5 * w,
                row["predicted_inside"],
                w,
                color="#8FAADC",
                label="simulated from F/B/U costs measured inside the runs" if i == 0 else None,
            )
        ax.bar(i + 1.5 * w, row["measured"], w, color="#DD8452", label="measured (median)" if i == 0 else None)
        x_full = i - 0.5 * w if "predicted_framework" in row else i - 1.5 * w
        ax.errorbar(
            [x_full],
            [full],
            yerr=[[full * TARGET_ERROR / (1 + TARGET_ERROR)], [full * TARGET_ERROR / (1 - TARGET_ERROR)]],
            fmt="none",
            ecolor="#333333",
            capsize=3,
            linewidth=0.8,
        )
        pts = row["per_rep"]
        jit = [(j - (len(pts) - 1) / 2) * (0.6 * w / max(len(pts), 1)) for j in range(len(pts))]
        ax.scatter([i + 1.5 * w + d for d in jit], pts, color="black", s=8, zorder=3)
        ax.annotate(
            f"error {_pct(_headline_error(row))}",
            (i, max(row["predicted"], full, row["measured"], *pts)),
            xytext=(0, 6),
            textcoords="offset points",
            ha="center",
            fontsize=8,
        )
    ax.set_xticks(
        range(len(rows)),
        [f"{r['label']}\n{r['balance']}, batch {r['batch_size']}, M={r['num_microbatches']}" for r in rows],
        fontsize=8,
    )
    ax.set_ylabel("samples/s")
    ax.set_ylim(0, max(max(r["predicted"], r["measured"], *r["per_rep"]) for r in rows) * 1.3)
    ax.legend(fontsize=7, loc="upper right")
    ax.text(
        0.01,
        0.98,
        "whiskers: measured values within 15% of the full prediction (green); points: repeats",
        transform=ax.transAxes,
        fontsize=7,
        va="top",
        color="#555555",
    )
    ax.set_title(
        f"Simulator vs measured, 2-stage async through Lightning, {cfg.repeats} interleaved repeats x "
        f"{cfg.steps} steps\n{machine['cpu_model']}, {machine['logical_cpus']} CPUs, torch {machine['torch']}, "
        f"lightning {machine['lightning']}, {load_note([r['load1'] for r in payload['runs']])}",
        fontsize=8,
    )
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- CLI / outputs
def config_from_json(d: dict[str, Any]) -> Config:
    """Rebuilds a :class:`Config` from its ``asdict`` form (lists back to tuples)."""
    specs = tuple(
        RunSpec(
            label=s["label"],
            model=s["model"],
            init_args=tuple((k, v) for k, v in s["init_args"]),
            batch_size=s["batch_size"],
            num_microbatches=s["num_microbatches"],
            balance=tuple(s["balance"]) if isinstance(s["balance"], list) else s["balance"],
            framework=s.get("framework", False),
        )
        for s in d["specs"]
    )
    rest = {k: v for k, v in d.items() if k != "specs"}
    return Config(specs=specs, **rest)


def print_header(machine: dict[str, Any], cmd: str, lines: Sequence[str]) -> None:
    """Machine, versions, code state and command, then ``lines`` describing the configuration."""
    print(describe_machine(machine))
    dirty = machine.get("git_modified_files")
    print(
        f"code: commit {(machine.get('git_commit') or '?')[:10]}"
        + (f" with uncommitted changes in {', '.join(dirty)}" if dirty else "")
    )
    print(f"command: {cmd}")
    for line in lines:
        print(line)
    sys.stdout.flush()


def _parse(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = Config()
    p.add_argument("--repeats", type=int, default=None, help=f"interleaved repeats (default {d.repeats})")
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per run (default {d.steps})")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed steps before them (default {d.warmup})")
    p.add_argument(
        "--balance",
        action="append",
        default=[],
        metavar="MODEL=A,B",
        help="fix a model's partition, e.g. CNN=2,3 (default: the planner's on a profile taken at start)",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--quick", action="store_true", help="smoke run: tiny models, 1 repeat of 3 steps; plot to --out-dir"
    )
    p.add_argument("--out-dir", type=Path, default=_DEFAULT_OUT, help="raw results (default benchmarks/out/)")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="plot path (default docs/img/simulator_accuracy.png; --quick: OUT_DIR/simulator_accuracy-quick.png)",
    )
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--from-json", type=Path, default=None, help="re-analyse a previous run's JSON without measuring")
    p.add_argument(
        "--runs",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="print one line per stored run (error per model) and stop",
    )
    a = p.parse_args(argv)
    cfg = Config()
    if a.from_json is not None or a.runs:
        return cfg, a  # the stored run's configuration is used
    if a.quick:
        cfg = replace(cfg, repeats=1, steps=3, warmup=2, timeout_s=60.0, sim_steps=6, calib_iters=3)
    overrides = {"repeats": a.repeats, "steps": a.steps, "warmup": a.warmup, "seed": a.seed}
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if min(cfg.repeats, cfg.steps, cfg.warmup) < 1:
        p.error("--repeats, --steps and --warmup must be >= 1 (the first step fills the pipeline)")
    fixed: dict[str, tuple[int, ...]] = {}
    for item in a.balance:
        name, _, value = item.partition("=")
        try:
            fixed[name] = tuple(int(x) for x in value.split(","))
        except ValueError:
            p.error(f"--balance takes MODEL=A,B, e.g. CNN=2,3; got {item!r}")
    models = QUICK_MODELS if a.quick else MODELS
    unknown = set(fixed) - {m[0] for m in models}
    if unknown:
        p.error(f"--balance names unknown models {sorted(unknown)}; valid: {[m[0] for m in models]}")
    specs = []
    for label, cls, init_args, batch, m in models:
        spec = RunSpec(label, cls, init_args, batch, m, balance="auto")
        balance = fixed.get(label) or planner_balance(spec, cfg)
        spec = replace(spec, balance=balance)
        if len(balance) != NUM_STAGES or min(balance) < 1 or sum(balance) != build_model(spec, cfg).num_layers:
            p.error(
                f"the partition of {label} needs {NUM_STAGES} positive entries summing to its layer count; "
                f"got {balance}"
            )
        specs.append(spec)
    for shape in dict.fromkeys((s.batch_size, s.num_microbatches) for s in list(specs)):
        specs.append(null_spec(*shape))
    return replace(cfg, specs=tuple(specs)), a


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    torch.set_num_threads(1)  # the planner's profile in this process: one thread, like a stage
    cfg, a = _parse(argv)
    if a.runs:
        print(render_runs(a.runs))
        return {}
    if a.from_json is not None:
        payload = json.loads(a.from_json.read_text(encoding="utf-8"))
        json_path = a.from_json
        a.quick = a.quick or payload["config"]["repeats"] == 1
        print(f"re-analysing {json_path}, measured {payload['machine']['date_utc']}:")
    else:
        payload = {"config": asdict(cfg), "machine": machine_info(), "command": command_line()}
    cfg = config_from_json(payload["config"])
    print_header(
        payload["machine"],
        payload["command"],
        [
            "models: "
            + "; ".join(
                f"{s.label} {dict(s.init_args)} batch {s.batch_size} M={s.num_microbatches} "
                f"balance {list(s.balance) if isinstance(s.balance, tuple) else s.balance}"
                for s in cfg.specs
            ),
            f"async, step_sync=last_stage_broadcast, SGD lr {cfg.lr}; {cfg.repeats} interleaved repeats x "
            f"({cfg.warmup} warm-up + {cfg.steps} timed steps) per model; simulator {cfg.sim_steps} steps",
        ],
    )
    if a.from_json is None:
        t0 = time.perf_counter()
        payload.update(measure(cfg))
        payload["machine"]["load_average_1_5_15_after"] = [round(x, 2) for x in os.getloadavg()]
        payload["elapsed_s"] = time.perf_counter() - t0
        json_path = a.out_dir / f"simulator_accuracy-{time.strftime('%Y%m%d-%H%M%S')}{'-quick' if a.quick else ''}.json"
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(payload, indent=1), encoding="utf-8")  # raw first
    summary = summarise(payload)
    print()
    print(
        "Predicted vs measured 2-stage async samples/s. 'profile': the simulator fed with the layer profile, the SGD "
        "update + stash copy timed alone and the probed link; 'profile + framework': plus the framework's costs "
        "measured on the null model of the same batch shape (below):"
    )
    print(render_table(summary))
    print()
    print(render_verdict(summary))
    print(f"({load_note([r['load1'] for r in payload['runs']])}; measured {payload['machine']['date_utc']})")
    print()
    print(
        "Diagnosis: the same simulator with fewer inputs, and with the per-micro-batch costs measured inside the "
        "runs (StepStats medians):"
    )
    print(render_diagnosis(summary))
    print()
    print("Framework costs from the null models, ms (added to the profile's inputs for 'profile + framework'):")
    print(render_framework(summary))
    print()
    print("Simulator inputs, ms per micro-batch (profile / alone vs inside the runs):")
    print(render_inputs(summary))
    print()
    print(
        "Per stage, ms per step (medians over repeats): the arithmetic the simulator assumed, the CPU the stage "
        "process used, StepStats inside the runs, and the share of a core the process got:"
    )
    print(render_breakdown(summary))
    if not a.no_plot:
        plot_path = a.plot or (json_path.parent / "simulator_accuracy-quick.png" if a.quick else _DEFAULT_PLOT)
        plot(summary, payload, plot_path)
        print(f"\nplot: {plot_path}")
    payload["summary"] = summary
    payload["markdown"] = {
        "table": render_table(summary, markdown=True),
        "diagnosis": render_diagnosis(summary, markdown=True),
        "framework": render_framework(summary, markdown=True),
        "inputs": render_inputs(summary, markdown=True),
        "breakdown": render_breakdown(summary, markdown=True),
    }
    json_path.write_text(json.dumps(payload, indent=1), encoding="utf-8")
    print(f"raw results: {json_path}")
    return summary


if __name__ == "__main__":
    main()
