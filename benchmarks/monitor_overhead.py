"""Overhead of :class:`~lightning_dynpipe.monitor.StageMonitor`: step time of a 2-stage pipeline with and without it.

The same 2-stage MLP trains through the real Lightning ``Trainer`` under DynPipe (``async``) with three
callback set-ups, interleaved inside the same two worker processes (gloo on 127.0.0.1, one CPU thread each)::

    for rep in range(repeats):
        for system in rotated(["off", "on", "every-step", "off-again"], rep):
            fit warmup + steps batches, time the last `steps` on global rank 0 (the last stage)

* ``off``: no monitor;
* ``on``: ``StageMonitor()`` with its defaults (a snapshot, i.e. one ``all_gather_object`` on WORLD, every
  10 steps; a 20-step window), the way the strategy adds it;
* ``every-step``: ``StageMonitor(every_n_steps=1)``, the worst case: a collective after every step;
* ``off-again``: no monitor, a second time: its "overhead" against ``off`` is the measurement's noise floor
  (an A/A comparison), the resolution any end-to-end number here has.

Three measures of the overhead, as a share of the step time of ``off``:

* **paired**: ``step_ms(on) / step_ms(off) - 1`` within each repeat (back to back, same machine state),
  median over repeats. It includes everything (the collective's wait for the slower stage too), but on a
  shared machine it carries the noise of two runs: a few percent either way;
* **in-hook**: the time the monitor spent inside its hooks (its own clock, collectives included), per step,
  on each stage; the larger stage counts. Much less noisy, but blind to indirect costs;
* **extra CPU**: the stage process's CPU time per step (all threads, gloo's included) minus that of ``off``
  in the same repeat; the larger stage counts. It sees work done off the main thread, not waiting.

Before the workers start, the main process times the monitor's pieces alone (sampler, the cgroup CPU limit read
through open files and parsed afresh, sample + add, summary, snapshot + metrics). The script prints the tables,
writes the raw record (JSON, with machine, versions and command) to ``benchmarks/out/`` and the plot to
``docs/img/monitor_overhead.png``.

Usage (from the repository root)::

    .venv/bin/python benchmarks/monitor_overhead.py            # documented run (about 4 minutes on 2 cores)
    .venv/bin/python benchmarks/monitor_overhead.py --quick    # smoke run: tiny MLP, 1 repeat (~45 s)
    .venv/bin/python benchmarks/monitor_overhead.py --repeats 10 --steps 60
    .venv/bin/python benchmarks/monitor_overhead.py --from-json benchmarks/out/monitor_overhead-<stamp>.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import timeit
from collections.abc import Callable, Sequence
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

SYSTEMS: tuple[str, ...] = ("off", "on", "every-step", "off-again")
LABELS = {
    "off": "no monitor",
    "on": "StageMonitor() (every 10)",
    "every-step": "StageMonitor(every_n_steps=1)",
    "off-again": "no monitor again (A/A control)",
}
_SHORT = {
    "off": "no monitor",
    "on": "StageMonitor()\nevery 10 steps",
    "every-step": "StageMonitor\nevery step",
    "off-again": "no monitor\n(A/A control)",
}
WORLD_SIZE = 2
TARGET = 0.02

_DEFAULT_PLOT = _ROOT / "docs" / "img" / "monitor_overhead.png"
_DEFAULT_OUT = _ROOT / "benchmarks" / "out"


@dataclass(frozen=True)
class Config:
    """Everything a worker needs; recorded in the JSON output.

    The model and batch are those of ``throughput.py`` (the MNIST MLP, width 512, depth 8, batch 256 in M=4
    micro-batches, balanced [4, 5]): tens of ms of compute per stage and step on one core, so the monitor's
    microseconds per step and one small collective every 10 steps are measured against a realistic step.
    With the defaults the timed window (steps 4..43) holds 4 snapshots of ``on`` (steps 10, 20, 30, 40). The
    timing callback comes before the monitor in the callback list, so the monitor's work at the last timed
    step falls outside the clock: one sample (microseconds) for ``on``, one of 40 snapshots for ``every-step``.
    """

    repeats: int = 8
    steps: int = 40
    warmup: int = 3
    width: int = 512
    depth: int = 8
    batch_size: int = 256
    num_microbatches: int = 4
    balance: tuple[int, ...] = (4, 5)
    every_n_steps: int = 10
    window: int = 20
    seed: int = 0
    timeout_s: float = 300.0


# ---------------------------------------------------------------------------------------------- microbenchmarks
def _per_call_us(fn: Callable[[], object], number: int) -> float:
    """Median over 5 rounds of the mean time per call, in microseconds."""
    rounds = timeit.repeat(fn, number=number, repeat=5)
    return median([r / number for r in rounds]) * 1e6


def micro_costs(window: int = 20) -> dict[str, float]:
    """What each piece of the monitor costs in this process, microseconds per call."""
    from lightning_dynpipe.engine.executor import StepStats
    from lightning_dynpipe.monitor import (
        PipelineSnapshot,
        ProcessSampler,
        StageReport,
        StageSample,
        StageStatsAccumulator,
    )
    from lightning_dynpipe.monitor.cgroups import CpuLimitReader, cpu_limit_cores

    sampler = ProcessSampler()
    limit = CpuLimitReader()
    stats = StepStats(
        forward_s=0.01,
        backward_s=0.02,
        optimizer_s=0.001,
        recv_wait_s=0.005,
        send_s=0.001,
        step_s=0.04,
        in_flight=2,
        stash_depth=2,
    )
    acc = StageStatsAccumulator(window)
    for _ in range(window):
        acc.add(StageSample.from_step(stats, sampler.sample()))
    summary = acc.summary()
    reports = [StageReport(0, k, summary) for k in range(WORLD_SIZE)]
    out = {
        "sampler.mark": _per_call_us(sampler.mark, 20000),
        "sampler.sample": _per_call_us(sampler.sample, 5000),
        "cgroup CPU limit, kept open (CpuLimitReader.read; in sample)": _per_call_us(limit.read, 20000),
        "cgroup CPU limit, mount table parsed (cpu_limit_cores)": _per_call_us(cpu_limit_cores, 2000),
        "sample + add (per step)": _per_call_us(lambda: acc.add(StageSample.from_step(stats, sampler.sample())), 5000),
        f"summary (window {window})": _per_call_us(acc.summary, 500),
        "snapshot + to_metrics (2 stages)": _per_call_us(
            lambda: PipelineSnapshot.from_reports(1, reports).to_metrics(), 500
        ),
    }
    sampler.close()
    limit.close()
    return out


# ---------------------------------------------------------------------------------------------- workers
def _model(cfg: Config) -> Any:
    from lightning_dynpipe.demos import MLP

    torch.manual_seed(cfg.seed)  # identical initial weights for every run
    return MLP(in_features=784, width=cfg.width, depth=cfg.depth, num_classes=10, lr=0.05, optimizer="sgd")


def _batches(cfg: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return [
        (torch.randn(cfg.batch_size, 1, 28, 28, generator=g), torch.randint(0, 10, (cfg.batch_size,), generator=g))
        for _ in range(cfg.warmup + cfg.steps)
    ]


def _strategy_kwargs(system: str) -> dict[str, Any]:
    """Switches that keep other runtime features out of the comparison, where this version of the strategy has them.

    Adaptation is switched off in every system (its planner runs at each snapshot; we measure the monitor). A
    strategy that adds a monitor by default must be told not to in ``off``.
    """
    import inspect

    from lightning_dynpipe import DynPipeStrategy

    params = inspect.signature(DynPipeStrategy.__init__).parameters
    kw: dict[str, Any] = {}
    if "adaptive" in params:
        kw["adaptive"] = False
    if system.startswith("off") and "monitor" in params:
        kw["monitor"] = False
    return kw


def _monitor_probe(drop: bool) -> Any:
    """A callback that records the StageMonitors the trainer runs; ``drop``: takes them out of the run.

    ``drop`` is the fallback for ``off`` under a strategy that adds a monitor by default and has no switch
    for it: the strategy attaches it during set-up, and this probe (the last callback) removes it at
    ``on_train_start``, before the first training step.
    """
    from lightning.pytorch import Callback

    from lightning_dynpipe.monitor import StageMonitor

    class MonitorProbe(Callback):
        def __init__(self) -> None:
            self.monitors: list[StageMonitor] = []
            self.dropped = 0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.monitors = [c for c in trainer.callbacks if isinstance(c, StageMonitor)]
            if drop and self.monitors:
                for m in self.monitors:
                    trainer.callbacks.remove(m)  # this probe is last: the hook loop skips nothing
                self.dropped, self.monitors = len(self.monitors), []

    return MonitorProbe()


def _run(system: str, cfg: Config, batches: list[Any]) -> dict[str, Any]:
    from benchmarks.throughput import _step_timer
    from lightning_dynpipe import DynPipeStrategy
    from lightning_dynpipe.monitor import StageMonitor

    callbacks: list[Any] = []
    if system == "on":
        callbacks.append(StageMonitor(every_n_steps=cfg.every_n_steps, window=cfg.window))
    elif system == "every-step":
        callbacks.append(StageMonitor(every_n_steps=1, window=cfg.window))
    probe = _monitor_probe(drop=system.startswith("off") and "monitor" not in _strategy_kwargs(system))
    strategy = DynPipeStrategy(
        num_microbatches=cfg.num_microbatches,
        schedule="async",
        balance=list(cfg.balance),
        timeout=cfg.timeout_s,
        **_strategy_kwargs(system),
    )
    timer = _step_timer(cfg.warmup, cfg.steps)
    res = fit_dynpipe(_model(cfg), batches, strategy, timer, world_size=WORLD_SIZE, callbacks=[*callbacks, probe])
    monitors = probe.monitors
    hook = {
        "overhead_s": sum(m.overhead_s for m in monitors),
        "snapshots": float(sum(m.snapshots_taken for m in monitors)),
        "monitors": len(monitors),
        "dropped": probe.dropped,
    }
    gathered: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, {"rank": dist.get_rank(), "stage": timer.stage_idx, **hook})
    cpu = [c["cpu"].get("process_cpu_s", float("nan")) for c in sorted(res["cpu"], key=lambda c: c["stage"])]
    return {"seconds": res["seconds"], "monitor": sorted(gathered, key=lambda g: g["stage"]), "cpu_s": cpu}


def _worker(rank: int, cfg: Config, port: int, result_path: str) -> None:
    from benchmarks.throughput import _quiet

    external_launch_env(rank, WORLD_SIZE, port)
    torch.set_num_threads(1)  # one core per stage
    _quiet()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    runs: list[dict[str, Any]] = []
    try:
        batches = _batches(cfg)
        for rep in range(cfg.repeats):
            for position, system in enumerate(rotated(SYSTEMS, rep)):
                load = os.getloadavg()[0]
                dist.barrier()
                res = _run(system, cfg, batches)
                total_steps = cfg.warmup + cfg.steps
                runs.append(
                    {
                        "rep": rep,
                        "position": position,
                        "system": system,
                        "load1": load,
                        "step_ms": res["seconds"] / cfg.steps * 1e3,
                        "hook_ms_per_step": [m["overhead_s"] / total_steps * 1e3 for m in res["monitor"]],
                        "cpu_ms_per_step": [c / cfg.steps * 1e3 for c in res["cpu_s"]],
                        "snapshots": [m["snapshots"] for m in res["monitor"]],
                        "monitors": [m["monitors"] for m in res["monitor"]],
                        "dropped_default_monitor": [m["dropped"] for m in res["monitor"]],
                    }
                )
                if system.startswith("off") and any(res["monitor"][k]["monitors"] for k in range(WORLD_SIZE)):
                    raise RuntimeError(
                        "The 'off' system ran with a StageMonitor that the strategy added by itself, so there is "
                        "nothing to compare against."
                    )
                if rank == 0:
                    print(
                        f"  rep {rep + 1}/{cfg.repeats}  {system:<11} {runs[-1]['step_ms']:7.2f} ms/step  "
                        f"(load {load:.1f})",
                        flush=True,
                    )
        if rank == 0:
            Path(result_path).write_text(json.dumps(runs), encoding="utf-8")
        workers_done()
    finally:
        close_group()


# ---------------------------------------------------------------------------------------------- analysis
def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median step time per system, paired overhead against ``off`` and the in-hook share."""
    by_rep: dict[int, dict[str, dict[str, Any]]] = {}
    for r in runs:
        by_rep.setdefault(r["rep"], {})[r["system"]] = r
    out: dict[str, Any] = {}
    for system in SYSTEMS:
        steps = [r["step_ms"] for r in runs if r["system"] == system]
        paired = [
            reps[system]["step_ms"] / reps["off"]["step_ms"] - 1.0
            for reps in by_rep.values()
            if system in reps and "off" in reps
        ]
        hook = [
            max(reps[system]["hook_ms_per_step"]) / reps["off"]["step_ms"]
            for reps in by_rep.values()
            if system in reps and "off" in reps
        ]
        cpu = [
            max(a - b for a, b in zip(reps[system]["cpu_ms_per_step"], reps["off"]["cpu_ms_per_step"]))
            / reps["off"]["step_ms"]
            for reps in by_rep.values()
            if system in reps and "off" in reps
        ]
        out[system] = {
            "step_ms": median(steps),
            "step_ms_q": quartiles(steps),
            "paired": median(paired),
            "paired_q": quartiles(paired),
            "paired_all": paired,
            "hook_share": median(hook),
            "hook_share_all": hook,
            "cpu_share": median(cpu),
            "cpu_share_q": quartiles(cpu),
            "cpu_share_all": cpu,
            "hook_ms_per_step": median([max(r["hook_ms_per_step"]) for r in runs if r["system"] == system]),
        }
    return out


def render_table(summary: dict[str, Any], *, markdown: bool = False) -> str:
    rows = []
    for system in SYSTEMS:
        s = summary[system]
        q1, q3 = s["step_ms_q"]
        p1, p3 = s["paired_q"]
        rows.append(
            [
                LABELS[system],
                f"{s['step_ms']:.2f}",
                f"{q1:.2f}-{q3:.2f}",
                "-" if system == "off" else f"{s['paired'] * 100:+.2f}%",
                "-" if system == "off" else f"{p1 * 100:+.2f}% .. {p3 * 100:+.2f}%",
                "-" if system == "off" else f"{s['hook_ms_per_step'] * 1e3:.0f} us",
                "-" if system == "off" else f"{s['hook_share'] * 100:.2f}%",
                "-" if system == "off" else f"{s['cpu_share'] * 100:+.2f}%",
            ]
        )
    headers = (
        "system",
        "step ms (median)",
        "IQR",
        "wall overhead (paired median)",
        "paired IQR",
        "in-hook per step",
        "in-hook share",
        "extra CPU (paired)",
    )
    return format_table(headers, rows, markdown=markdown)


def render_micro(micro: dict[str, float], *, markdown: bool = False) -> str:
    return format_table(("piece", "us per call"), [[k, f"{v:.2f}"] for k, v in micro.items()], markdown=markdown)


def verdict(summary: dict[str, Any]) -> str:
    on = summary["on"]
    ok_hook = on["hook_share"] < TARGET
    ok_paired = on["paired"] < TARGET
    aa = summary["off-again"]
    return (
        f"target: StageMonitor() overhead < {TARGET:.0%} of step time: in-hook {on['hook_share']:.2%} "
        f"({'met' if ok_hook else 'MISSED'}); paired end-to-end {on['paired']:+.2%} "
        f"({'met' if ok_paired else 'MISSED'}; paired IQR {on['paired_q'][0]:+.2%} .. {on['paired_q'][1]:+.2%}); "
        f"extra CPU {on['cpu_share']:+.2%} of the step.\n"
        f"noise floor (A/A, no monitor twice): paired {aa['paired']:+.2%} (IQR {aa['paired_q'][0]:+.2%} .. "
        f"{aa['paired_q'][1]:+.2%}), extra CPU {aa['cpu_share']:+.2%} (IQR {aa['cpu_share_q'][0]:+.2%} .. "
        f"{aa['cpu_share_q'][1]:+.2%}): end-to-end differences inside these ranges are not resolved"
    )


def plot(
    runs: list[dict[str, Any]],
    summary: dict[str, Any],
    micro: dict[str, float],
    cfg: Config,
    machine: dict[str, Any],
    path: Path,
) -> None:
    """Left: step time of every run by system. Right: paired and in-hook overhead per repeat, with the target."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no plot was written: pip install 'lightning-dynpipe[plot]'")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [1, 1.2]})
    for i, system in enumerate(SYSTEMS):
        pts = [r["step_ms"] for r in runs if r["system"] == system]
        ax1.bar(
            i,
            summary[system]["step_ms"],
            color="#7f7f7f" if system.startswith("off") else "#1f77b4",
            alpha=0.7,
            width=0.6,
        )
        n = len(pts)
        ax1.scatter([i + (j - (n - 1) / 2) * 0.3 / max(n, 1) for j in range(n)], pts, color="black", s=10, zorder=3)
    ax1.set_xticks(range(len(SYSTEMS)), [_SHORT[s] for s in SYSTEMS], fontsize=8)
    ax1.set_ylabel("ms per step (bars: median; points: repeats)")
    ax1.grid(axis="y", alpha=0.3)
    width = 0.26
    for i, system in enumerate(SYSTEMS[1:]):
        s = summary[system]
        for offset, key, color, label in (
            (-width, "paired", "#1f77b4", "wall, paired"),
            (0.0, "hook_share", "#ff7f0e", "in-hook time"),
            (width, "cpu_share", "#2ca02c", "extra CPU, paired"),
        ):
            ax2.bar(
                i + offset,
                100 * s[key],
                width=width,
                color=color,
                alpha=0.5,
                label=f"{label} (bar: median; points: repeats)" if i == 0 else None,
            )
            pts = [100 * v for v in s[f"{key}_all"]]
            ax2.scatter([i + offset] * len(pts), pts, color=color, s=10, zorder=3)
    ax2.axhline(100 * TARGET, color="red", linestyle="--", linewidth=1, label=f"target {TARGET:.0%}")
    ax2.axhline(0, color="black", linewidth=0.5)
    ax2.set_xticks(range(len(SYSTEMS) - 1), [_SHORT[s] for s in SYSTEMS[1:]], fontsize=8)
    ax2.set_ylabel("overhead, % of step time without monitor")
    ax2.legend(fontsize=7, loc="upper left")
    ax2.grid(axis="y", alpha=0.3)
    sample_us = micro.get("sample + add (per step)", float("nan"))
    fig.suptitle(
        f"StageMonitor overhead: 2-stage MLP width {cfg.width} depth {cfg.depth}, batch {cfg.batch_size}, "
        f"M={cfg.num_microbatches}, balance {list(cfg.balance)}, {cfg.repeats} repeats x {cfg.steps} steps; "
        f"sample + add {sample_us:.1f} us/step\n{machine['cpu_model']}, {machine['logical_cpus']} CPUs, "
        f"torch {machine['torch']}, lightning {machine['lightning']}, load avg "
        f"{machine['load_average_1_5_15'][0] if machine.get('load_average_1_5_15') else '?'} at start",
        fontsize=8,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- CLI
def _parse(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    d = Config()
    p.add_argument("--repeats", type=int, default=None, help=f"interleaved repeats (default {d.repeats})")
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per run (default {d.steps})")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed steps before them (default {d.warmup})")
    p.add_argument(
        "--every-n-steps",
        type=int,
        default=None,
        help=f"the 'on' monitor's snapshot interval (default {d.every_n_steps})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: width 64, depth 3, batch 32, 1 repeat, 12 steps; plot goes to --out-dir",
    )
    p.add_argument("--out-dir", type=Path, default=_DEFAULT_OUT, help="raw results (default benchmarks/out/)")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="plot path (default docs/img/monitor_overhead.png; with --quick: OUT_DIR/monitor_overhead-quick.png)",
    )
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="re-analyse a previous run's record (tables, verdict, plot) without measuring",
    )
    a = p.parse_args(argv)
    cfg = d
    if a.quick:
        cfg = replace(
            cfg,
            repeats=1,
            steps=12,
            warmup=2,
            width=64,
            depth=3,
            batch_size=32,
            balance=(2, 2),
            every_n_steps=4,
            window=4,
            timeout_s=60.0,
        )
    overrides = {"repeats": a.repeats, "steps": a.steps, "warmup": a.warmup, "every_n_steps": a.every_n_steps}
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if min(cfg.repeats, cfg.steps, cfg.warmup, cfg.every_n_steps) < 1:
        p.error("--repeats, --steps, --warmup and --every-n-steps must be >= 1")
    return cfg, a


def _print_header(cfg: Config, machine: dict[str, Any], cmd: str) -> None:
    print(describe_machine(machine))
    print(
        f"model: MLP width {cfg.width} depth {cfg.depth}, balance {list(cfg.balance)}, batch {cfg.batch_size}, "
        f"M={cfg.num_microbatches}, async; {cfg.repeats} repeats x ({cfg.warmup} warm-up + {cfg.steps} timed steps)"
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
        old = json.loads(a.from_json.read_text(encoding="utf-8"))
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in old["config"].items()}
        cfg, machine, cmd = Config(**fields), old["machine"], old["command"]
        micro, runs = old["micro_us"], old["runs"]
        print(f"re-analysing {a.from_json}, measured {machine['date_utc']}:")
        _print_header(cfg, machine, cmd)
        elapsed = old.get("elapsed_s")
    else:
        machine = machine_info()
        cmd = command_line()
        _print_header(cfg, machine, cmd)
        micro = micro_costs(cfg.window)
    print("\nmonitor pieces alone, in this process:")
    print(render_micro(micro), flush=True)
    print()

    if a.from_json is None:
        from torch.multiprocessing.spawn import spawn

        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            result_path = os.path.join(tmp, "runs.json")
            spawn(_worker, args=(cfg, free_port(), result_path), nprocs=WORLD_SIZE, join=True)  # type: ignore[no-untyped-call,unused-ignore]
            runs = json.loads(Path(result_path).read_text(encoding="utf-8"))
        machine["load_average_1_5_15_after"] = [round(x, 2) for x in os.getloadavg()]
        elapsed = time.perf_counter() - t0
    summary = summarise(runs)
    print()
    print(render_table(summary))
    print()
    print(verdict(summary))

    quick = a.quick or cfg.repeats == 1
    payload = {
        "config": asdict(cfg),
        "machine": machine,
        "command": cmd,
        "elapsed_s": elapsed,
        "micro_us": micro,
        "runs": runs,
        "summary": summary,
        "markdown": {"table": render_table(summary, markdown=True), "micro": render_micro(micro, markdown=True)},
    }
    if a.from_json is not None:
        json_path = a.from_json
    else:
        a.out_dir.mkdir(parents=True, exist_ok=True)
        json_path = a.out_dir / f"monitor_overhead-{time.strftime('%Y%m%d-%H%M%S')}{'-quick' if quick else ''}.json"
    json_path.write_text(json.dumps(payload, indent=1), encoding="utf-8")
    if not a.no_plot:
        plot_path = a.plot or (json_path.parent / "monitor_overhead-quick.png" if quick else _DEFAULT_PLOT)
        plot(runs, summary, micro, cfg, machine, plot_path)
        print(f"\nplot: {plot_path}")
    print(f"raw record: {json_path}")
    return summary


if __name__ == "__main__":
    main()
