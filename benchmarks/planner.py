"""Planner benchmarks: (a) the auto plan's measured throughput; (b) planning time; (c) simulation time.

(a) **Auto plan vs simple splits, measured.** The MNIST :class:`~lightning_dynpipe.demos.CNN` has layers of very
    uneven cost (one conv block is about two thirds of the compute, the linear block holds most parameters).
    Three 2-stage ``async`` systems train it through the real Lightning ``Trainer``:

    - ``auto``: ``DynPipeStrategy(balance="auto", num_stages=2)``: the strategy profiles a sample micro-batch,
      probes the link and asks the planner (``best_plan``) at set-up, as a user gets it;
    - ``parameters``: ``balance="parameters"`` (balanced parameter counts);
    - ``uniform``: equal layer counts, ``balance_by_weights([1] * n, 2)`` (5 layers -> ``[3, 2]``, the extra
      layer on the first stage, as ``numpy.array_split`` and DeepSpeed's ``partition_uniform`` do).

    All with ``adaptive=False`` (the partition a run starts with is the one measured), through the harness of
    ``benchmarks/throughput.py`` (two pre-initialised gloo workers, one compute thread each), interleaved
    (``for rep: for system rotated by rep``). Target: ``auto`` >= 1.10x the better of the other two (median of
    per-repeat paired ratios). The simulator's prediction of each split (as in ``simulator_accuracy.py``) is
    printed next to it, and the simulated timeline of the auto plan is plotted.

(b) **Planning time** for 1,000 layers x 64 stages: random per-layer costs (several seeds), a link model, the
    default convergence model; ``solve`` with S = 64 fixed, ``best_plan(num_stages=64)`` (what
    ``balance="auto", num_stages=64`` calls), the same with a binding memory cap, with ``schedule="sync"``, and
    ``best_plan`` choosing S among the divisors of 64. Target: < 1 s (median over seeds and repeats).

(c) **Simulation time** of 64 stages x 1,000 micro-batches: ``simulate("async", 64, num_microbatches=1000,
    num_steps=1)`` (the headline, 64,000 forwards and backwards plus 64,000 updates), and 64 x 250 x 4 steps,
    ``sync`` and ``gpipe`` at 64 x 1000 x 1. Target: < 5 s (median of repeats).

It prints the tables, records the machine, versions and command, writes raw results to ``benchmarks/out/`` and
the plots ``docs/img/planner_throughput.png``, ``docs/img/planner_timeline.png`` (and
``planner_timeline_uniform.png``) and ``docs/img/planner_speed.png``.

Usage (from the repository root)::

    .venv/bin/python benchmarks/planner.py                   # the documented run (a few minutes on 2 cores)
    .venv/bin/python benchmarks/planner.py --parts b,c       # only the timing parts (about a minute)
    .venv/bin/python benchmarks/planner.py --quick           # smoke run: tiny sizes (~15 s)
    .venv/bin/python benchmarks/planner.py --from-json benchmarks/out/planner-<stamp>.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `benchmarks` and the package importable
    sys.path.insert(0, str(_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import (  # noqa: E402
    command_line,
    format_table,
    machine_info,
    median,
    quartiles,
    rotated,
)
from benchmarks.simulator_accuracy import (  # noqa: E402
    Config as MeasureConfig,
)
from benchmarks.simulator_accuracy import (  # noqa: E402
    RunSpec,
    build_model,
    config_from_json,
    load_note,
    measure,
    pooled_costs,
    print_header,
    render_breakdown,
    resolved_balance,
    simulate_step,
    stage_inputs,
)
from benchmarks.simulator_accuracy import summarise as summarise_runs  # noqa: E402

TARGET_SPEEDUP = 1.10
TARGET_PLAN_S = 1.0
TARGET_SIM_S = 5.0
SYSTEMS = ("auto", "parameters", "uniform")
PARTS = ("a", "b", "c")
_IMG = _ROOT / "docs" / "img"
_DEFAULT_OUT = _ROOT / "benchmarks" / "out"


@dataclass(frozen=True)
class Config:
    """The three parts' settings; recorded in the JSON output."""

    parts: tuple[str, ...] = PARTS
    # (a) chosen once, before measuring: the CNN of simulator_accuracy.py (channels 16, micro-batches of 32)
    cnn_init_args: tuple[tuple[str, Any], ...] = (("channels", 16), ("hidden", 128))
    batch_size: int = 128
    num_microbatches: int = 4
    repeats: int = 9
    steps: int = 20
    warmup: int = 3
    # (b)
    plan_layers: int = 1000
    plan_stages: int = 64
    plan_seeds: int = 5
    plan_repeats: int = 3
    plan_microbatches: int = 64
    # (c)
    sim_stages: int = 64
    sim_microbatches: int = 1000
    sim_repeats: int = 3
    seed: int = 0


# ---------------------------------------------------------------------------------------------- (a)
def specs(cfg: Config) -> tuple[RunSpec, ...]:
    """The three systems of part (a)."""
    from lightning_dynpipe.plan.partition import balance_by_weights

    base = RunSpec("auto", "CNN", cfg.cnn_init_args, cfg.batch_size, cfg.num_microbatches, balance="auto")
    n = build_model(base, MeasureConfig()).num_layers
    uniform = tuple(balance_by_weights([1.0] * n, 2).balance)
    return (
        base,
        replace(base, label="parameters", balance="parameters"),
        replace(base, label="uniform", balance=uniform),
    )


def measure_config(cfg: Config) -> MeasureConfig:
    return MeasureConfig(
        specs=specs(cfg),
        repeats=cfg.repeats,
        steps=cfg.steps,
        warmup=cfg.warmup,
        seed=cfg.seed,
        timeout_s=60.0 if cfg.repeats == 1 else 300.0,
        sim_steps=6 if cfg.repeats == 1 else 12,
        calib_iters=3 if cfg.repeats == 1 else 9,
    )


def summarise_a(payload: dict[str, Any]) -> dict[str, Any]:
    """Medians, paired ratios of auto to each baseline and to the better one, predictions, the planner's view."""
    from lightning_dynpipe.plan.auto import best_plan
    from lightning_dynpipe.plan.costs import CommModel, ModelCost

    mcfg = config_from_json(payload["config"])
    runs, calibration = payload["runs"], payload["calibration"]
    key = mcfg.specs[0].model_key
    costs = pooled_costs(calibration, key)
    by = {s.label: {r["rep"]: r for r in runs if r["system"] == s.label} for s in mcfg.specs}
    table: dict[str, Any] = {}
    for s in mcfg.specs:
        sps = [by[s.label][rep]["samples_per_s"] for rep in sorted(by[s.label])]
        q1, q3 = quartiles(sps)
        balance = resolved_balance(runs, s.label)
        sim = simulate_step(stage_inputs(costs, balance), s.num_microbatches, mcfg.sim_steps)
        table[s.label] = {
            "median": median(sps),
            "q1": q1,
            "q3": q3,
            "per_rep": sps,
            "balance": list(balance),
            "partitions_seen": sorted({str(r["balance"]) for r in by[s.label].values()}),
            "predicted": s.batch_size / sim.steady_state_step_time,
        }
    better = max(("parameters", "uniform"), key=lambda s: table[s]["median"])

    def paired(ref: str) -> dict[str, Any]:
        ratios = [
            by["auto"][rep]["samples_per_s"] / by[ref][rep]["samples_per_s"] for rep in by["auto"] if rep in by[ref]
        ]
        q1, q3 = quartiles(ratios)
        return {
            "median": median(ratios),
            "q1": q1,
            "q3": q3,
            "per_rep": ratios,
            "ratio_of_medians": table["auto"]["median"] / table[ref]["median"],
            "predicted": table["auto"]["predicted"] / table[ref]["predicted"],
        }

    ratios = {ref: paired(ref) for ref in ("parameters", "uniform")}
    layers = costs["layers"]
    cost = ModelCost.from_arrays(
        [x["forward_s"] for x in layers],
        [x["backward_s"] for x in layers],
        activation_bytes=[x["activation_bytes"] for x in layers],
        param_bytes=[x["param_bytes"] for x in layers],
    )
    link = CommModel(latency_s=costs["link"]["latency_s"], bandwidth_Bps=costs["link"]["bandwidth_Bps"])
    plan = best_plan(cost, 2, num_stages=2, comm=link, num_microbatches=mcfg.specs[0].num_microbatches)
    tables = [r["plan_table"] for r in runs if r["system"] == "auto" and r.get("plan_table")]
    return {
        "table": table,
        "better": better,
        "ratios": ratios,
        "vs_better": ratios[better],
        "pooled_plan": {"balance": list(plan.partition.balance), "table": plan.table()},
        "setup_plan_table": tables[0] if tables else None,
        "costs": costs,
        "load1": median([r["load1"] for r in runs]),
    }


def render_a(s: dict[str, Any], *, markdown: bool = False) -> str:
    rows = []
    for label, row in s["table"].items():
        r = s["ratios"].get(label) if label != "auto" else None
        rows.append(
            [
                label,
                str(row["balance"]) + ("" if len(row["partitions_seen"]) == 1 else f" (seen {row['partitions_seen']})"),
                f"{row['median']:.1f}",
                f"{row['q1']:.1f}-{row['q3']:.1f}",
                "1.000x" if r is None else f"{r['median']:.3f}x [{r['q1']:.2f}-{r['q3']:.2f}]",
                f"{row['predicted']:.1f}",
                "1.000x" if r is None else f"{r['predicted']:.3f}x",
            ]
        )
    headers = [
        "system",
        "partition",
        "samples/s (median)",
        "IQR",
        "auto / this (paired)",
        "simulated samples/s",
        "simulated auto / this",
    ]
    return format_table(headers, rows, markdown=markdown)


def verdict_a(s: dict[str, Any]) -> str:
    v = s["vs_better"]
    ok = v["median"] >= TARGET_SPEEDUP
    return (
        f"target (a) auto >= {TARGET_SPEEDUP:.2f}x the better of parameters/uniform ({s['better']}): measured "
        f"{v['median']:.3f}x (paired median; ratio of medians {v['ratio_of_medians']:.3f}x) -> "
        f"{'met' if ok else 'MISSED'}"
    )


def plot_a(s: dict[str, Any], payload: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no plot was written: pip install 'lightning-dynpipe[plot]'")
        return
    mcfg, machine = config_from_json(payload["config"]), payload["machine"]
    labels = list(s["table"])
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, label in enumerate(labels):
        row = s["table"][label]
        ax.bar(i, row["median"], 0.55, color="#4C72B0" if label == "auto" else "#999999", alpha=0.8)
        pts = row["per_rep"]
        jit = [(j - (len(pts) - 1) / 2) * (0.3 / max(len(pts), 1)) for j in range(len(pts))]
        ax.scatter([i + d for d in jit], pts, color="black", s=10, zorder=3)
        ax.scatter(
            [i + 0.33],
            [row["predicted"]],
            marker="_",
            s=300,
            color="#C44E52",
            zorder=4,
            label="simulated (profile)" if i == 0 else None,
        )
        r = s["ratios"].get(label)
        text = f"{row['median']:.0f}" + (f"\nauto = {r['median']:.2f}x" if r else "")
        ax.annotate(
            text, (i, max(pts + [row["median"]])), xytext=(0, 5), textcoords="offset points", ha="center", fontsize=8
        )

    def tick(label: str) -> str:
        seen = [str(r["balance"]) for r in payload["runs"] if r["system"] == label]
        counts = ", ".join(f"{b} in {seen.count(b)}" for b in sorted(set(seen), key=seen.count, reverse=True))
        return f"{label}\n{s['table'][label]['balance']}" + (f"\n(runs: {counts})" if len(set(seen)) > 1 else "")

    ax.set_xticks(range(len(labels)), [tick(lab) for lab in labels], fontsize=9)
    ax.set_ylabel("samples/s (bars: median; points: repeats)")
    ax.set_ylim(0, max(max(r["per_rep"] + [r["predicted"]]) for r in s["table"].values()) * 1.3)
    ax.legend(fontsize=8, loc="upper right")
    spec = mcfg.specs[0]
    ax.set_title(
        f"CNN {dict(spec.init_args)}, 2-stage async, batch {spec.batch_size}, M={spec.num_microbatches}, "
        f"{mcfg.repeats} interleaved repeats x {mcfg.steps} steps\n{machine['cpu_model']}, "
        f"{machine['logical_cpus']} CPUs, torch {machine['torch']}, lightning {machine['lightning']}, "
        f"{load_note([r['load1'] for r in payload['runs']])}",
        fontsize=8,
    )
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timelines(s: dict[str, Any], payload: dict[str, Any], out: Path, suffix: str) -> list[Path]:
    """Simulated timelines (the inputs of the prediction) of the auto plan and of the uniform split."""
    from lightning_dynpipe.schedule.plot import plot_timeline

    mcfg = config_from_json(payload["config"])
    spec = mcfg.specs[0]
    paths: list[Path] = []
    for label, name in (("auto", "planner_timeline"), ("uniform", "planner_timeline_uniform")):
        balance = s["table"][label]["balance"]
        sim = simulate_step(stage_inputs(s["costs"], balance), spec.num_microbatches, 4)
        path = out / f"{name}{suffix}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            plot_timeline(
                sim,
                path,
                title=f"CNN, {label} split {balance}: simulated async, M={spec.num_microbatches}, "
                f"4 steps, step_sync=last_stage_broadcast (time in s; "
                f"step {sim.steady_state_step_time * 1e3:.1f} ms)",
            )
        except ImportError as exc:
            print(exc)
            return paths
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------- (b)
def random_model_cost(n: int, seed: int) -> Any:
    """``n`` layers with log-normally spread compute, activation and parameter sizes (uneven, like real nets)."""
    from lightning_dynpipe.plan.costs import ModelCost

    rng = np.random.default_rng(seed)
    fwd = rng.lognormal(np.log(1e-3), 0.8, n)
    bwd = fwd * rng.uniform(1.5, 2.5, n)
    act = rng.lognormal(np.log(1 << 20), 1.0, n).astype(np.int64)
    params = rng.lognormal(np.log(4 << 20), 1.0, n).astype(np.int64)
    return ModelCost.from_arrays(
        fwd.tolist(),
        bwd.tolist(),
        activation_bytes=act.tolist(),
        param_bytes=params.tolist(),
        optimizer_state_bytes=(2 * params).tolist(),
    )


def planning_variants(cfg: Config) -> dict[str, Callable[[Any], Any]]:
    from lightning_dynpipe.plan.auto import best_plan
    from lightning_dynpipe.plan.costs import CommModel, DefaultCostModel
    from lightning_dynpipe.plan.solver import solve

    comm = CommModel(latency_s=20e-6, bandwidth_Bps=10e9)
    S, M = cfg.plan_stages, cfg.plan_microbatches

    def capped(cost: Any) -> Any:
        free = best_plan(cost, S, num_stages=S, comm=comm, num_microbatches=M)
        cap = 0.9 * max(free.stage_memory_bytes)  # binding: the unconstrained plan's fullest stage does not fit
        return best_plan(cost, S, num_stages=S, comm=comm, num_microbatches=M, memory_cap=cap)

    return {
        f"solve(fixed_num_stages={S})": lambda c: solve(
            c, num_devices=S, fixed_num_stages=S, dp=1, cost_model=DefaultCostModel(comm), num_microbatches=M
        ),
        f"best_plan(num_stages={S})": lambda c: best_plan(c, S, num_stages=S, comm=comm, num_microbatches=M),
        f"best_plan(num_stages={S}, schedule='sync')": lambda c: best_plan(
            c, S, num_stages=S, schedule="sync", comm=comm, num_microbatches=M
        ),
        f"best_plan(num_stages={S}, memory_cap)": capped,
        f"best_plan(num_stages=None): S | {S}": lambda c: best_plan(c, S, comm=comm, num_microbatches=M),
    }


def run_b(cfg: Config) -> list[dict[str, Any]]:
    """Interleaved: for rep, for seed, every variant in rotated order; one timing each."""
    variants = planning_variants(cfg)
    names = list(variants)
    costs = {seed: random_model_cost(cfg.plan_layers, cfg.seed + seed) for seed in range(cfg.plan_seeds)}
    for c in costs.values():  # warm numpy and the code paths once, untimed
        variants[names[1]](c)
        break
    out = []
    for rep in range(cfg.plan_repeats):
        for seed, cost in costs.items():
            for name in rotated(names, rep + seed):
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                c0 = time.process_time()
                try:
                    plan = variants[name](cost)
                    info = {
                        "num_stages": plan.num_stages,
                        "dp": plan.dp,
                        "bottleneck_s": max(plan.stage_times_s),
                        "error": None,
                    }
                except Exception as exc:  # a variant that cannot plan is a result, not a crash
                    info = {"error": f"{type(exc).__name__}: {exc}"}
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                out.append(
                    {"variant": name, "seed": seed, "rep": rep, "wall_s": wall, "cpu_s": cpu, "load1": load, **info}
                )
        print(f"  (b) rep {rep + 1}/{cfg.plan_repeats} done (load {os.getloadavg()[0]:.1f})", flush=True)
    return out


# ---------------------------------------------------------------------------------------------- (c)
def simulation_variants(cfg: Config) -> dict[str, dict[str, Any]]:
    S, M = cfg.sim_stages, cfg.sim_microbatches
    return {
        f"async {S} x {M} x 1 step": {"kind": "async", "M": M, "steps": 1},
        f"async {S} x {M // 4} x 4 steps": {"kind": "async", "M": M // 4, "steps": 4},
        f"sync {S} x {M} x 1 step": {"kind": "sync", "M": M, "steps": 1},
        f"gpipe {S} x {M} x 1 step": {"kind": "gpipe", "M": M, "steps": 1},
    }


def run_c(cfg: Config) -> list[dict[str, Any]]:
    from lightning_dynpipe.schedule import simulate

    rng = np.random.default_rng(cfg.seed)
    S = cfg.sim_stages
    fwd = rng.uniform(0.5, 1.5, S).tolist()
    bwd = [2 * f for f in fwd]
    variants = simulation_variants(cfg)
    names = list(variants)
    out = []
    for rep in range(cfg.sim_repeats):
        for name in rotated(names, rep):
            v = variants[name]
            load = os.getloadavg()[0]
            t0, c0 = time.perf_counter(), time.process_time()
            r = simulate(
                v["kind"],
                S,
                v["M"],
                v["steps"],
                forward_time=fwd,
                backward_time=bwd,
                update_time=0.05,
                comm_time=0.1,
                step_sync="last_stage_broadcast",
            )
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            events = sum(len(e) for e in r.events)
            out.append(
                {
                    "variant": name,
                    "rep": rep,
                    "wall_s": wall,
                    "cpu_s": cpu,
                    "load1": load,
                    "events": events,
                    "makespan": r.makespan,
                }
            )
        print(f"  (c) rep {rep + 1}/{cfg.sim_repeats} done (load {os.getloadavg()[0]:.1f})", flush=True)
    return out


def summarise_times(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r["variant"] for r in records):
        rs = [r for r in records if r["variant"] == name]
        walls = [r["wall_s"] for r in rs]
        q1, q3 = quartiles(walls)
        out[name] = {
            "median": median(walls),
            "q1": q1,
            "q3": q3,
            "max": max(walls),
            "n": len(walls),
            "cpu_median": median([r["cpu_s"] for r in rs]),
            "errors": sorted({r["error"] for r in rs if r.get("error")}),
            "stages_chosen": sorted({r["num_stages"] for r in rs if r.get("num_stages") is not None}),
            "events": rs[0].get("events"),
        }
    return out


def render_times(s: dict[str, Any], target: float, *, markdown: bool = False) -> str:
    rows = []
    for name, row in s.items():
        extra = ""
        if row["errors"]:
            extra = "; ".join(row["errors"])[:60]
        elif row["events"]:
            extra = f"{row['events']:,} events"
        elif row["stages_chosen"]:
            extra = f"S chosen: {row['stages_chosen']}"
        label = name.replace("|", "\\|") if markdown else name  # a bare | would split a markdown cell
        rows.append(
            [
                label,
                f"{row['median']:.3f}",
                f"{row['q1']:.3f}-{row['q3']:.3f}",
                f"{row['max']:.3f}",
                f"{row['cpu_median']:.3f}",
                str(row["n"]),
                "yes" if row["median"] < target else "NO",
                extra,
            ]
        )
    headers = ["variant", "wall s (median)", "IQR", "max", "CPU s (median)", "n", f"< {target:g} s", "notes"]
    return format_table(headers, rows, markdown=markdown)


def plot_speed(sb: dict[str, Any] | None, sc: dict[str, Any] | None, payload: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no plot was written: pip install 'lightning-dynpipe[plot]'")
        return
    cfg = config_from_dict(payload["config"])
    panels = [
        (
            sb,
            TARGET_PLAN_S,
            f"(b) planning, {cfg.plan_layers} layers x {cfg.plan_stages} stages, "
            f"{cfg.plan_seeds} seeds x {cfg.plan_repeats}",
        ),
        (sc, TARGET_SIM_S, f"(c) simulate, {cfg.sim_stages} stages, {cfg.sim_repeats} repeats"),
    ]
    panels = [p for p in panels if p[0]]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.6), squeeze=False)
    for ax, (s, target, title) in zip(axes[0], panels):
        assert s is not None
        names = list(s)
        ys = range(len(names))
        ax.barh(
            ys,
            [s[n]["median"] for n in names],
            color="#4C72B0",
            alpha=0.8,
            xerr=[[s[n]["median"] - s[n]["q1"] for n in names], [s[n]["q3"] - s[n]["median"] for n in names]],
        )
        ax.axvline(target, color="#C44E52", linestyle="--", label=f"target < {target:g} s")
        for y, n in zip(ys, names):
            ax.annotate(
                f"{s[n]['median']:.3f} s (max {s[n]['max']:.2f})",
                (s[n]["q3"], y),
                xytext=(6, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
            )
        ax.set_yticks(list(ys), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("wall seconds (median, IQR)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8, loc="lower right")
    m = payload["machine"]
    loads = [r["load1"] for part in ("b", "c") for r in payload.get(part, [])]
    fig.suptitle(
        f"{m['cpu_model']}, {m['logical_cpus']} CPUs, python {m['python']}, numpy {np.__version__}, one "
        f"process; load avg {min(loads):.1f}-{max(loads):.1f} during the timings",
        fontsize=8,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- CLI
def config_from_dict(d: dict[str, Any]) -> Config:
    """Rebuilds a :class:`Config` from its JSON form (lists back to tuples)."""
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    fields["cnn_init_args"] = tuple((k, v) for k, v in d["cnn_init_args"])
    return Config(**fields)


def _parse(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = Config()
    p.add_argument("--parts", default=",".join(PARTS), help="which parts to run, e.g. a or b,c (default a,b,c)")
    p.add_argument("--repeats", type=int, default=None, help=f"(a) interleaved repeats (default {d.repeats})")
    p.add_argument("--steps", type=int, default=None, help=f"(a) timed steps per run (default {d.steps})")
    p.add_argument("--seeds", type=int, default=None, help=f"(b) random models (default {d.plan_seeds})")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: tiny CNN, 1 repeat of 3 steps; 100 layers x 8 stages; 8 stages x 50 micro-batches",
    )
    p.add_argument("--out-dir", type=Path, default=_DEFAULT_OUT, help="raw results (default benchmarks/out/)")
    p.add_argument("--img-dir", type=Path, default=None, help="plots (default docs/img/; --quick: OUT_DIR)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--from-json", type=Path, default=None, help="re-analyse a previous run's JSON without measuring")
    p.add_argument(
        "--runs",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="print one line per stored run of part (a), and all their repeats pooled, then stop",
    )
    a = p.parse_args(argv)
    parts = tuple(x.strip() for x in a.parts.split(",") if x.strip())
    if not parts or set(parts) - set(PARTS):
        p.error(f"--parts takes a comma-separated subset of {list(PARTS)}; got {a.parts!r}")
    cfg = replace(Config(), parts=parts)
    if a.quick:
        cfg = replace(
            cfg,
            cnn_init_args=(("channels", 4), ("hidden", 32)),
            batch_size=32,
            repeats=1,
            steps=3,
            warmup=2,
            plan_layers=100,
            plan_stages=8,
            plan_seeds=2,
            plan_repeats=1,
            sim_stages=8,
            sim_microbatches=48,
            sim_repeats=1,
        )
    overrides = {"repeats": a.repeats, "steps": a.steps, "plan_seeds": a.seeds}
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if min(cfg.repeats, cfg.steps, cfg.plan_seeds) < 1:
        p.error("--repeats, --steps and --seeds must be >= 1")
    return cfg, a


def render_runs(paths: Sequence[Path], *, markdown: bool = False) -> str:
    """Part (a) of several stored runs: one row each, then every repeat's paired ratio pooled."""
    rows = []
    pooled: dict[str, list[float]] = {"parameters": [], "uniform": [], "better": []}
    for path in paths:
        payload = json.loads(Path(path).read_text(encoding="utf-8"))
        if "a" not in payload:
            continue
        s = summarise_a(payload["a"])
        loads = [r["load1"] for r in payload["a"]["runs"]]
        seen = [str(r["balance"]) for r in payload["a"]["runs"] if r["system"] == "auto"]
        for ref in ("parameters", "uniform"):
            pooled[ref] += s["ratios"][ref]["per_rep"]
        pooled["better"] += s["vs_better"]["per_rep"]
        v = s["vs_better"]
        rows.append(
            [
                Path(path).name,
                payload["machine"]["date_utc"][11:16],
                f"{min(loads):.1f}-{max(loads):.1f}",
                ", ".join(f"{b} x{seen.count(b)}" for b in sorted(set(seen))),
                *[f"{s['table'][k]['median']:.0f}" for k in SYSTEMS],
                f"{v['median']:.3f}x [{v['q1']:.2f}-{v['q3']:.2f}]",
                "met" if v["median"] >= TARGET_SPEEDUP else "MISSED",
            ]
        )
    if len(rows) > 1:
        v = pooled["better"]
        q1, q3 = quartiles(v)
        rows.append(
            [
                f"pooled ({len(v)} pairs)",
                "",
                "",
                "",
                "",
                "",
                "",
                f"{median(v):.3f}x [{q1:.2f}-{q3:.2f}]",
                "met" if median(v) >= TARGET_SPEEDUP else "MISSED",
            ]
        )
    headers = [
        "run",
        "UTC",
        "load (1 min)",
        "auto chose",
        *[f"{k} samples/s" for k in SYSTEMS],
        "auto / better (paired)",
        f">= {TARGET_SPEEDUP:.2f}x",
    ]
    return format_table(headers, rows, markdown=markdown)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg, a = _parse(argv)
    if a.runs:
        print(render_runs(a.runs))
        return {}
    if a.from_json is not None:
        payload = json.loads(a.from_json.read_text(encoding="utf-8"))
        json_path = a.from_json
        quick = "-quick" in json_path.name
        print(f"re-analysing {json_path}, measured {payload['machine']['date_utc']}:")
    else:
        torch.set_num_threads(1)
        payload = {"config": asdict(cfg), "machine": machine_info(), "command": command_line()}
        quick = a.quick
        json_path = a.out_dir / f"planner-{time.strftime('%Y%m%d-%H%M%S')}{'-quick' if quick else ''}.json"
    cfg = config_from_dict(payload["config"])
    img = a.img_dir or (json_path.parent if quick else _IMG)
    suffix = "-quick" if quick else ""
    print_header(
        payload["machine"],
        payload["command"],
        [
            f"parts: {','.join(cfg.parts)}",
            f"(a) CNN {dict(cfg.cnn_init_args)}, batch {cfg.batch_size}, M={cfg.num_microbatches}, async, 2 stages; "
            f"{cfg.repeats} interleaved repeats x ({cfg.warmup} warm-up + {cfg.steps} timed steps)",
            f"(b) {cfg.plan_layers} layers x {cfg.plan_stages} stages, "
            f"{cfg.plan_seeds} seeds x {cfg.plan_repeats} repeats; "
            f"(c) {cfg.sim_stages} stages x {cfg.sim_microbatches} micro-batches, {cfg.sim_repeats} repeats",
        ],
    )
    if a.from_json is None:
        t0 = time.perf_counter()
        if "a" in cfg.parts:
            mcfg = measure_config(cfg)
            print(f"(a) systems: {[(s.label, s.balance) for s in mcfg.specs]}", flush=True)
            payload["a"] = {"config": asdict(mcfg), "machine": payload["machine"], **measure(mcfg)}
        if "b" in cfg.parts:
            payload["b"] = run_b(cfg)
        if "c" in cfg.parts:
            payload["c"] = run_c(cfg)
        payload["machine"]["load_average_1_5_15_after"] = [round(x, 2) for x in os.getloadavg()]
        payload["elapsed_s"] = time.perf_counter() - t0
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(payload, indent=1), encoding="utf-8")  # raw first
    summary: dict[str, Any] = {}
    markdown: dict[str, str] = {}
    plots: list[Path] = []
    if "a" in payload:
        sa = summarise_a(payload["a"])
        summary["a"] = {k: v for k, v in sa.items() if k != "costs"}
        print(
            "\n(a) measured 2-stage async throughput of the CNN by partition (paired ratio: median over repeats "
            "[IQR]); simulated from the pooled profile:"
        )
        print(render_a(sa))
        print(f"\nthe planner on the pooled profile and probed link chooses {sa['pooled_plan']['balance']}:")
        print(sa["pooled_plan"]["table"])
        if sa["setup_plan_table"]:
            print("\nthe plan the strategy logged at set-up (first auto run, rank 0):")
            print(sa["setup_plan_table"])
        print(
            "\nper stage, ms per step (medians over repeats; auto's row mixes its partitions if set-up chose "
            "differently): the simulator's arithmetic, the CPU the stage process used, StepStats, share of a core:"
        )
        print(render_breakdown(summarise_runs(payload["a"])))
        print()
        print(verdict_a(sa))
        print(f"({load_note([r['load1'] for r in payload['a']['runs']])}; measured {payload['machine']['date_utc']})")
        markdown["a"] = render_a(sa, markdown=True)
        markdown["a_breakdown"] = render_breakdown(summarise_runs(payload["a"]), markdown=True)
        if not a.no_plot:
            plot_a(sa, payload["a"], img / f"planner_throughput{suffix}.png")
            plots.append(img / f"planner_throughput{suffix}.png")
            plots += plot_timelines(sa, payload["a"], img, suffix)
    sb = sc = None
    if "b" in payload:
        sb = summarise_times(payload["b"])
        summary["b"] = sb
        print(
            f"\n(b) planning time, {cfg.plan_layers} layers x {cfg.plan_stages} stages (random costs, "
            f"{cfg.plan_seeds} seeds x {cfg.plan_repeats} interleaved repeats):"
        )
        print(render_times(sb, TARGET_PLAN_S))
        head = sb[next(iter(n for n in sb if n.startswith("best_plan")))]
        print(
            f"\ntarget (b) planning < {TARGET_PLAN_S:g} s: best_plan(num_stages={cfg.plan_stages}) median "
            f"{head['median']:.3f} s, slowest variant median {max(r['median'] for r in sb.values()):.3f} s -> "
            f"{'met' if all(r['median'] < TARGET_PLAN_S for r in sb.values()) else 'MISSED'}"
        )
        markdown["b"] = render_times(sb, TARGET_PLAN_S, markdown=True)
    if "c" in payload:
        sc = summarise_times(payload["c"])
        summary["c"] = sc
        print(
            f"\n(c) simulation time, {cfg.sim_stages} stages (step_sync=last_stage_broadcast), "
            f"{cfg.sim_repeats} interleaved repeats:"
        )
        print(render_times(sc, TARGET_SIM_S))
        head = next(iter(sc.values()))
        print(
            f"\ntarget (c) simulate < {TARGET_SIM_S:g} s: {next(iter(sc))} median {head['median']:.3f} s; slowest "
            f"variant median {max(r['median'] for r in sc.values()):.3f} s -> "
            f"{'met' if all(r['median'] < TARGET_SIM_S for r in sc.values()) else 'MISSED'}"
        )
        markdown["c"] = render_times(sc, TARGET_SIM_S, markdown=True)
    if not a.no_plot and (sb or sc):
        plot_speed(sb, sc, payload, img / f"planner_speed{suffix}.png")
        plots.append(img / f"planner_speed{suffix}.png")
    if plots:
        print("\nplots: " + ", ".join(str(p) for p in plots))
    payload["summary"] = summary
    payload["markdown"] = markdown
    json_path.write_text(json.dumps(payload, indent=1), encoding="utf-8")
    print(f"raw results: {json_path}")
    return summary


if __name__ == "__main__":
    main()
