"""The convergence cost of each 2-stage cut of the interference benchmark's model, and ``beta`` fitted on it.

A live migration changes which layers sit on the stale stage: under ``async`` stage 0 of two is one update stale,
so moving a layer that holds most of the parameters onto it makes most of the model stale. The planner prices
that with :class:`~lightning_dynpipe.plan.ConvergenceModel`, ``I = I0 * (1 + beta * sum_k w_k * staleness_k)``,
whose default ``beta`` was measured on MLPs. This script measures, with the single-process staleness emulator
(:func:`lightning_dynpipe.calibration.measure_profiles`), the steps to the target of the one-stage model and of
every 2-stage cut (each a :class:`~lightning_dynpipe.plan.Partition` profile, PipeDream's staleness ``(1, 0)``),
on the interference benchmark's own model, data order, optimizer and learning-rate scale (``benchmarks/
interference.py``'s ``_model`` and ``_data``), for seeds that the benchmark does not run by default (100 on), and
fits ``I0`` and ``beta`` on the medians. ``interference.py --systems measured-beta --beta B`` then plans with it.

Usage (from the repository root)::

    .venv/bin/python benchmarks/beta_cuts.py --model cnn --target-acc 0.97      # 6 seeds, ~6 min on 2 cores
    .venv/bin/python benchmarks/beta_cuts.py --model cnn --seeds 2 --quick     # smoke run
    .venv/bin/python benchmarks/beta_cuts.py --from-json benchmarks/out/beta_cuts-<stamp>.json

Outputs: the table on stdout, ``benchmarks/out/beta_cuts-<stamp>.json`` (config, machine, versions, command, every
run with its curve, the fit) and ``docs/img/beta_cuts.png`` (steps to target against the weighted staleness, with
the fitted line and the default's). The runs are spread over the machine's cores, one torch thread each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `benchmarks` and the package importable
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks._common import (  # noqa: E402
    command_line,
    describe_machine,
    format_table,
    machine_info,
    median,
    save_figure,
)
from benchmarks.interference import Config, _data, _model, cut_systems, num_layers  # noqa: E402

_OUT = _ROOT / "benchmarks" / "out"
_IMG = _ROOT / "docs" / "img" / "beta_cuts.png"


def profiles(cfg: Config) -> list[tuple[int, ...]]:
    """The balances measured: the whole model on one stage, then every 2-stage cut."""
    n = num_layers(cfg)
    return [(n,), *(tuple(int(x) for x in c[3:].split(",")) for c in cut_systems(cfg))]


def _one(cfg: Config, seed: int, balance: tuple[int, ...], eval_every: int) -> dict[str, Any]:
    """One (seed, balance) run of the emulator, in a worker process with one torch thread."""
    import torch.nn.functional as F

    from lightning_dynpipe.calibration import measure_profiles
    from lightning_dynpipe.plan import Partition

    torch.set_num_threads(1)
    batches, val = _data(cfg, seed)
    xt, yt = val[0]

    def accuracy(pipeline: torch.nn.Sequential) -> float:
        return float((pipeline(xt).argmax(-1) == yt).float().mean())

    t0 = time.perf_counter()
    (run,) = measure_profiles(
        lambda s: _model(cfg, s).pipeline,
        lambda s: batches,
        profiles=[Partition(balance)],
        seeds=[seed],
        num_microbatches=cfg.num_microbatches,
        make_optimizer=lambda ps: torch.optim.SGD(ps, lr=cfg.lr, momentum=cfg.momentum),
        loss_fn=lambda out, mb: F.cross_entropy(out, mb[1]),
        eval_fn=accuracy,
        target=cfg.target_acc,
        eval_every=eval_every,
        max_steps=cfg.max_steps,
        lr_scale=cfg.lr_scale,
    )
    return {
        "seed": seed,
        "balance": list(run.balance),
        "staleness": list(run.staleness),
        "stage_parameters": list(run.stage_parameters),
        "steps": run.steps,
        "curve": [list(p) for p in run.curve],
        "seconds": time.perf_counter() - t0,
    }


def weighted_staleness(run: dict[str, Any]) -> float:
    """``x = sum_k w_k * staleness_k`` with ``w_k`` the stage's share of the parameters."""
    total = sum(run["stage_parameters"])
    return sum(p * s for p, s in zip(run["stage_parameters"], run["staleness"])) / total


def analyse(runs: list[dict[str, Any]], num_microbatches: int) -> dict[str, Any]:
    """Median steps per balance, the fit of ``I0`` and ``beta`` on the medians, and each balance's predicted cost."""
    from lightning_dynpipe.calibration import ProfileRun, median_observations
    from lightning_dynpipe.plan import DEFAULT_BETA, fit_beta

    by: dict[tuple[int, ...], list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(tuple(r["balance"]), []).append(r)
    rows = []
    for balance, rs in by.items():
        steps = [r["steps"] for r in rs]
        rows.append(
            {
                "balance": list(balance),
                "x": weighted_staleness(rs[0]),
                "steps": steps,
                "median": median([s for s in steps if s is not None]) if all(s is not None for s in steps) else None,
            }
        )
    fitted = [row for row in rows if row["median"] is not None]  # a balance that missed the target is not fitted
    reached = [
        ProfileRun(
            profile=tuple(r["balance"]),
            seed=r["seed"],
            balance=tuple(r["balance"]),
            staleness=tuple(r["staleness"]),
            stage_parameters=tuple(r["stage_parameters"]),
            steps=r["steps"],
            num_microbatches=num_microbatches,
        )
        for row in fitted
        for r in by[tuple(row["balance"])]
    ]
    distinct = len({round(row["x"], 9) for row in fitted}) >= 2
    model = fit_beta(median_observations(reached)) if distinct else None
    base = next((row["median"] for row in rows if len(row["balance"]) == 1), None)
    for row in rows:
        row["relative"] = row["median"] / base if row["median"] is not None and base else None
        row["fit"] = 1 + model.beta * row["x"] if model else None
        row["default"] = 1 + DEFAULT_BETA * row["x"]
    return {
        "rows": rows,
        "i0_steps": model.i0 / num_microbatches if model else None,
        "beta": model.beta if model else None,
        "default_beta": DEFAULT_BETA,
    }


def render(result: dict[str, Any], *, markdown: bool = False) -> str:
    def f(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    rows = [
        [
            str(row["balance"]),
            f"{row['x']:.3f}",
            " / ".join("-" if s is None else str(s) for s in row["steps"]),
            f(row["median"], ".0f"),
            f(row["relative"], ".2f"),
            f(row["fit"], ".3f"),
            f"{row['default']:.3f}",
        ]
        for row in result["rows"]
    ]
    headers = ["balance", "weighted staleness x", "steps per seed", "median", "/ one stage", "fit 1+beta*x", "default"]
    return format_table(headers, rows, markdown=markdown)


def plot(result: dict[str, Any], runs: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        if r["steps"] is not None:
            ax.scatter(weighted_staleness(r), r["steps"], color="tab:gray", s=12)
    for row in result["rows"]:
        if row["median"] is not None:
            ax.scatter(row["x"], row["median"], color="tab:blue", s=40, marker="D")
            ax.annotate(str(row["balance"]), (row["x"], row["median"]), fontsize=7, xytext=(4, 4),
                        textcoords="offset points")  # fmt: skip
    if result["beta"] is not None:
        xs = [0.0, 1.0]
        i0 = result["i0_steps"]
        ax.plot(xs, [i0 * (1 + result["beta"] * x) for x in xs], label=f"fit: beta = {result['beta']:.3f}")
        ax.plot(xs, [i0 * (1 + result["default_beta"] * x) for x in xs], "--",
                label=f"default beta = {result['default_beta']}")  # fmt: skip
    ax.set_xlabel("weighted staleness x (share of parameters one update stale)")
    ax.set_ylabel("steps to target")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
    p.add_argument("--target-acc", type=float, default=0.97)
    p.add_argument("--max-steps", type=int, default=600)
    p.add_argument("--eval-every", type=int, default=5, help="steps between evaluations (the answer's grain)")
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--first-seed", type=int, default=100, help="apart from the benchmark's seeds 0..N-1")
    p.add_argument("--workers", type=int, default=2, help="processes, one torch thread each")
    p.add_argument("--quick", action="store_true", help="smoke run: target 0.9, 100 steps")
    p.add_argument("--out-dir", type=Path, default=_OUT)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--from-json", type=Path, default=None, help="re-analyse a stored run")
    a = p.parse_args(argv)
    if a.from_json is not None:
        payload = json.loads(a.from_json.read_text(encoding="utf-8"))
        json_path = a.from_json
    else:
        cfg = replace(Config(), model=a.model, target_acc=a.target_acc, max_steps=a.max_steps)
        if a.quick:
            cfg = replace(cfg, target_acc=0.9, max_steps=100)
        machine, cmd = machine_info(), command_line()
        print(describe_machine(machine))
        seeds = range(a.first_seed, a.first_seed + a.seeds)
        jobs = [(seed, b) for seed in seeds for b in profiles(cfg)]
        t0 = time.perf_counter()
        with ProcessPoolExecutor(max_workers=a.workers) as pool:
            futures = [pool.submit(_one, cfg, seed, b, a.eval_every) for seed, b in jobs]
            runs = []
            for fut in futures:
                runs.append(fut.result())
                r = runs[-1]
                print(f"  seed {r['seed']} {r['balance']}: {r['steps']} steps ({r['seconds']:.0f} s)", flush=True)
        payload = {
            "config": asdict(cfg),
            "eval_every": a.eval_every,
            "machine": machine,
            "command": cmd,
            "elapsed_s": time.perf_counter() - t0,
            "runs": runs,
        }
        json_path = a.out_dir / f"beta_cuts-{time.strftime('%Y%m%d-%H%M%S')}.json"
    cfg = Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in payload["config"].items()})
    result = analyse(payload["runs"], cfg.num_microbatches)
    print(
        f"\n{cfg.model}, {cfg.optimizer} lr {cfg.lr} momentum {cfg.momentum}, batch {cfg.batch_size}, "
        f"M={cfg.num_microbatches}, lr_scale {cfg.lr_scale}; steps to {cfg.target_acc} test accuracy, evaluated "
        f"every {payload['eval_every']} steps, emulated async staleness (1, 0) on 2 stages:"
    )
    print(render(result))
    if result["beta"] is not None:
        print(f"fitted on the medians: I0 = {result['i0_steps']:.1f} steps, beta = {result['beta']:.3f}")
    payload["result"] = result
    payload["markdown"] = render(result, markdown=True)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(payload), encoding="utf-8")
    print(f"raw runs: {json_path}")
    if not a.no_plot:
        path = a.out_dir / "beta_cuts.png" if a.quick else _IMG
        plot(result, payload["runs"], path, f"steps to {cfg.target_acc}, {cfg.model}, emulated async staleness")
        print(f"plot: {path}")
    return result


if __name__ == "__main__":
    main()
