"""Which learning-rate scale makes ``async`` updates comparable to one update per batch?

Under ``schedule="async"`` every stage updates its weights after every micro-batch, ``M`` times per Lightning
batch, where plain training (and ``sync``/``gpipe``) updates once from the whole batch. This script measures,
for the models and data of the two examples and for SGD and AdamW, how many steps (Lightning batches) each
setting needs to reach a target validation accuracy, and the accuracy it reaches after the example's budget:

* ``plain``: one update per batch (the PipeDream replay with 1 stage and ``M = 1``, which is plain training),
  at the example's learning rate times each multiplier of a small grid;
* ``async S=2`` (and ``S=4``, or as deep as the model allows) with ``M = 4``: the replay with PipeDream's
  staleness ``S-1-k``, split by parameter count as the strategy does before a plan exists, with
  ``lr_scale`` = each value of the same grid, which includes 1 (unscaled), ``1/sqrt(M)`` and ``1/M``.

The replay (:func:`lightning_dynpipe.calibration.replay_async`, through
:func:`~lightning_dynpipe.calibration.measure_profiles`) reproduces the ``async`` pipeline's updates bit for bit,
so everything runs in this one process, on one core. ``lr_scale`` multiplies the learning rate of every update,
exactly as ``DynPipeStrategy(lr_scale=...)`` does. Every setting of one seed starts from the same weights and
sees the same batches, so ratios to ``plain`` are paired per seed.

Cases (models, batch sizes, SGD learning rates and momentum of the examples; the examples have no AdamW, so
AdamW uses torch's default ``lr=1e-3``, ``weight_decay=0.01``):

* ``digits-*``: ``examples/digits_quickstart.py``'s ``Net`` (64-128-128-10, 3 units) and its split (1,400
  train, the 397 others as validation), batch 32, 5 epochs (215 steps), SGD lr 0.1 without momentum;
* ``mnist-*``: ``examples/mnist_demo.py``'s defaults: ``demos.MLP(784, width=512, depth=6)`` (7 units) on
  ``demos.MNISTDataModule`` (3,500 train / 500 validation), batch 64, 10 epochs (540 steps), SGD lr 0.01,
  momentum 0.9.

Time to target is steps-to-target times the time per step. Only the steps are measured here. The derived time
ratio divides the paired step ratio by the ``async``/``sync`` samples/s ratio measured by
``benchmarks/throughput.py`` (``--throughput-ratio``, from docs/benchmarks.md), because ``sync`` makes exactly
plain training's updates: it is a derived number, for 2 stages only, and that throughput was measured on
another model.

Usage (from the repository root)::

    .venv/bin/python benchmarks/async_lr.py            # the documented run (about 55 min on 2 shared cores)
    .venv/bin/python benchmarks/async_lr.py --quick    # smoke run: digits only, 2 seeds, 1 epoch (seconds)
    .venv/bin/python benchmarks/async_lr.py --cases digits-sgd,digits-adamw --seeds 5
    .venv/bin/python benchmarks/async_lr.py --from-json benchmarks/out/async_lr-<stamp>.json   # re-analyse

Outputs: the tables on stdout, ``benchmarks/out/async_lr-<stamp>.json`` (config, machine, versions, command,
every run with its curve; written after every run) and ``docs/img/async_lr.png`` (``--quick`` writes its plot to
``--out-dir`` instead).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `benchmarks`, `examples` and the package importable
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks._common import command_line, format_table, machine_info, quartiles, rotated  # noqa: E402
from lightning_dynpipe.calibration import measure_profiles  # noqa: E402

DIVERGED_BELOW = 0.2
"""A run whose final validation accuracy is below this (twice chance for 10 classes) has collapsed."""

# The named scales, as functions of M.
NAMED = {"1": lambda m: 1.0, "1/sqrt(M)": lambda m: 1.0 / math.sqrt(m), "1/M": lambda m: 1.0 / m}


@dataclass(frozen=True)
class Case:
    """One model, data set and optimizer, as its example trains it."""

    name: str
    dataset: str  # "digits" | "mnist"
    optimizer: str  # "sgd" | "adamw"
    lr: float
    momentum: float
    batch_size: int
    epochs: int
    target: float
    eval_every: int


def _cases(args: argparse.Namespace) -> dict[str, Case]:
    d_target, m_target = args.target_digits, args.target_mnist
    return {
        "digits-sgd": Case("digits-sgd", "digits", "sgd", 0.1, 0.0, 32, args.epochs_digits, d_target, 1),
        "digits-adamw": Case("digits-adamw", "digits", "adamw", 1e-3, 0.0, 32, args.epochs_digits, d_target, 1),
        "mnist-sgd": Case("mnist-sgd", "mnist", "sgd", 0.01, 0.9, 64, args.epochs_mnist, m_target, 3),
        "mnist-adamw": Case("mnist-adamw", "mnist", "adamw", 1e-3, 0.0, 64, args.epochs_mnist, m_target, 3),
    }


def _floats(text: str) -> list[float]:
    out = []
    for t in text.split(","):
        t = t.strip()
        if t:
            num, _, den = t.partition("/")
            out.append(float(num) / float(den) if den else float(num))
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", default="digits-sgd,digits-adamw,mnist-sgd,mnist-adamw")
    p.add_argument("--seeds", type=int, default=3, help="seeds first-seed..first-seed+N-1 (weights, batch order)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("-M", "--num-microbatches", type=int, default=4)
    p.add_argument(
        "--stages", default="2,4", help="async stage counts; a count above the model's layers is capped (digits: 3)"
    )
    p.add_argument(
        "--grid-digits",
        default="16,8,4,2,1,1/2,1/4,1/8,1/16",
        help="lr multipliers (plain) and lr_scale values (async S=2) for the digits cases",
    )
    p.add_argument("--grid-mnist", default="8,4,2,1,1/2,1/4,1/8", help="the same for the MNIST cases")
    p.add_argument(
        "--deep-grid",
        default="1,1/2,1/4",
        help="lr_scale values for the deeper async profile (default: 1, 1/sqrt(M), 1/M for M=4)",
    )
    p.add_argument("--target-digits", type=float, default=0.85, help="validation accuracy to reach (digits)")
    p.add_argument("--target-mnist", type=float, default=0.85, help="validation accuracy to reach (MNIST)")
    p.add_argument("--epochs-digits", type=int, default=5, help="budget; the example's max_epochs")
    p.add_argument("--epochs-mnist", type=int, default=10, help="budget; the example's max_epochs")
    p.add_argument(
        "--throughput-ratio",
        default="1.080,1.04,1.12",
        help="async/sync samples/s of 2 stages, median,q1,q3 (throughput.py, docs/benchmarks.md)",
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke run: digits, 2 seeds, 1 epoch, target 0.6, lr_scale 1 and 1/4"
    )
    p.add_argument("--out-dir", type=Path, default=_ROOT / "benchmarks" / "out")
    p.add_argument("--plot", type=Path, default=_ROOT / "docs" / "img" / "async_lr.png")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--from-json", type=Path, default=None, help="re-analyse a stored run (no training)")
    args = p.parse_args(argv)
    if args.quick:
        args.cases, args.seeds, args.stages = "digits-sgd,digits-adamw", 2, "2"
        args.grid_digits, args.deep_grid, args.epochs_digits, args.target_digits = "1,1/4", "", 1, 0.6
        args.plot = args.out_dir / "async_lr-quick.png"
    _derive(args)
    return args


def _derive(args: argparse.Namespace) -> None:
    known = _cases(args)
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in known]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; valid options are {list(known)}")
    args.case_list = [known[c] for c in names]
    args.stage_list = [int(s) for s in args.stages.split(",") if s]
    tr = _floats(args.throughput_ratio)
    args.tput = (tr[0], tr[1], tr[2]) if len(tr) == 3 else (tr[0], tr[0], tr[0])


# ----------------------------------------------------------------------------------------------- data, models


class _Data:
    """Training tensors, validation tensors, and seeded batch orders."""

    def __init__(self, dataset: str) -> None:
        if dataset == "digits":
            from examples.digits_quickstart import loaders

            train_dl, val_dl = loaders()  # the example's split and scaling (its test split is our validation)
            self.x_train, self.y_train = train_dl.dataset.tensors  # type: ignore[attr-defined]
            self.x_val, self.y_val = val_dl.dataset.tensors  # type: ignore[attr-defined]
        else:
            from lightning_dynpipe.demos import MNISTDataModule

            dm = MNISTDataModule(batch_size=64)
            dm.setup()
            self.x_train, self.y_train = dm.train_set.tensors
            self.x_val, self.y_val = dm.val_set.tensors

    def batches(self, seed: int, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
        """Epochs of shuffled full batches (drop_last), in an order fixed by ``seed`` (the same for every setting)."""
        g = torch.Generator().manual_seed(10_000 + seed)
        n = len(self.x_train)
        while True:
            perm = torch.randperm(n, generator=g)
            for i in range(0, n - batch_size + 1, batch_size):
                idx = perm[i : i + batch_size]
                yield self.x_train[idx], self.y_train[idx]

    def steps_per_epoch(self, batch_size: int) -> int:
        return len(self.x_train) // batch_size

    def val_accuracy(self, net: nn.Sequential) -> float:
        return float((net(self.x_val).argmax(-1) == self.y_val).float().mean())


def _model(dataset: str) -> nn.Sequential:
    if dataset == "digits":
        from examples.digits_quickstart import Net

        return Net().pipeline  # type: ignore[no-any-return]
    from lightning_dynpipe.demos import MLP

    return MLP(in_features=784, width=512, depth=6).pipeline  # examples/mnist_demo.py's defaults


def _optimizer(case: Case) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    if case.optimizer == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=case.lr, momentum=case.momentum)
    return lambda ps: torch.optim.AdamW(ps, lr=case.lr)


# -------------------------------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Setting:
    """One row: ``plain`` (1 stage, M = 1) or ``async`` with ``stages`` stages; ``scale`` multiplies the lr."""

    system: str  # "plain" | "async"
    stages: int
    num_microbatches: int
    scale: float

    @property
    def label(self) -> str:
        return "plain" if self.system == "plain" else f"async S={self.stages}"


def _settings(case: Case, args: argparse.Namespace, num_layers: int) -> list[Setting]:
    grid = _floats(args.grid_digits if case.dataset == "digits" else args.grid_mnist)
    M = args.num_microbatches
    out = [Setting("plain", 1, 1, s) for s in grid]
    stages = sorted({min(s, num_layers) for s in args.stage_list})
    for i, s in enumerate(stages):
        scales = grid if i == 0 else _floats(args.deep_grid)
        out += [Setting("async", s, M, sc) for sc in scales]
    return out


def _measure(args: argparse.Namespace, out_path: Path) -> tuple[list[dict[str, Any]], dict[str, Any], float]:
    torch.set_num_threads(1)  # a shared 2-core machine; one run per process, one core
    machine = machine_info()
    data = {ds: _Data(ds) for ds in sorted({c.dataset for c in args.case_list})}
    runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for c in args.case_list:
        d = data[c.dataset]
        print(
            f"{c.name}: batch {c.batch_size}, {c.epochs} epochs = {c.epochs * d.steps_per_epoch(c.batch_size)} "
            f"steps, {c.optimizer} lr={c.lr:g}{f' momentum={c.momentum:g}' if c.optimizer == 'sgd' else ''}, "
            f"target val acc {c.target}",
            flush=True,
        )
    for rep, seed in enumerate(range(args.first_seed, args.first_seed + args.seeds)):
        for c in args.case_list:
            d = data[c.dataset]
            max_steps = c.epochs * d.steps_per_epoch(c.batch_size)
            settings = _settings(c, args, len(_model(c.dataset)))
            for st in rotated(settings, rep):
                t = time.perf_counter()
                (r,) = measure_profiles(
                    lambda seed, c=c: _model(c.dataset),  # type: ignore[misc]
                    lambda seed, c=c, d=d: d.batches(seed, c.batch_size),  # type: ignore[misc]
                    profiles=[st.stages],
                    seeds=[seed],
                    num_microbatches=st.num_microbatches,
                    make_optimizer=_optimizer(c),
                    loss_fn=lambda out, mb: F.cross_entropy(out, mb[1]),
                    eval_fn=d.val_accuracy,
                    target=c.target,
                    eval_every=c.eval_every,
                    max_steps=max_steps,
                    stop_at_target=False,
                    lr_scale=st.scale,
                )
                wall = time.perf_counter() - t
                runs.append(
                    {
                        "case": c.name,
                        "system": st.system,
                        "stages": st.stages,
                        "num_microbatches": st.num_microbatches,
                        "scale": st.scale,
                        "seed": seed,
                        "balance": list(r.balance),
                        "staleness": list(r.staleness),
                        "steps": r.steps,
                        "final_acc": r.curve[-1][1],
                        "mean_acc": statistics.fmean(v for _, v in r.curve),
                        "curve": [list(p) for p in r.curve],
                        "wall_s": wall,
                    }
                )
                print(
                    f"  seed {seed} {c.name:12s} {st.label:10s} x{st.scale:<7.4g} steps to target {r.steps}  "
                    f"(final val {r.curve[-1][1]:.3f}; {wall:.1f} s)",
                    flush=True,
                )
                _write(out_path, args, machine, runs, time.perf_counter() - t0, None)
    return runs, machine, time.perf_counter() - t0


# -------------------------------------------------------------------------------------------------- analysis


def _frac(scale: float) -> str:
    """4, 2, 1, 1/2, 1/4, ... for powers of two; else the number."""
    if scale >= 1 and float(scale).is_integer():
        return str(int(scale))
    inv = 1 / scale
    return f"1/{int(round(inv))}" if abs(inv - round(inv)) < 1e-9 else f"{scale:.4g}"


def _stats(values: Sequence[float]) -> tuple[float, float, float]:
    """Median and quartiles (order statistics once a value is ``inf``, a run that missed the target)."""
    if not values:
        return math.nan, math.nan, math.nan
    v = sorted(values)
    if all(math.isfinite(x) for x in v):
        q1, q3 = quartiles(v)
    else:  # interpolating quantiles would turn inf into nan
        q1, q3 = v[(len(v) - 1) // 4], v[-1 - (len(v) - 1) // 4]
    return float(statistics.median(v)), float(q1), float(q3)


def _fmt(x: float, spec: str) -> str:
    if math.isnan(x):
        return "-"
    return "miss" if math.isinf(x) else format(x, spec)


def _fmt3(stat: Sequence[float] | None, spec: str) -> str:
    if stat is None or math.isnan(stat[0]):
        return "-"
    return f"{_fmt(stat[0], spec)} [{_fmt(stat[1], spec)}-{_fmt(stat[2], spec)}]"


Key = tuple[str, str, int, float]  # case, system, stages, scale


def _key(r: dict[str, Any]) -> Key:
    return r["case"], r["system"], r["stages"], r["scale"]


def _paired_ratios(runs: Sequence[dict[str, Any]], a: Key, b: Key) -> list[float]:
    """Per seed: steps of ``a`` over steps of ``b`` (same weights, same batches); ``inf`` where ``a`` missed.

    Seeds where ``b`` missed the target have no ratio and are left out.
    """
    by_seed = {r["seed"]: r for r in runs if _key(r) == b}
    out = []
    for r in runs:
        if _key(r) != a or r["seed"] not in by_seed or by_seed[r["seed"]]["steps"] is None:
            continue
        out.append(math.inf if r["steps"] is None else r["steps"] / by_seed[r["seed"]]["steps"])
    return out


def analyse(runs: Sequence[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per case and setting: steps to target, the paired ratio to plain at the example's lr, final and mean
    accuracy, the derived time ratio (2 stages); the best of each sweep; and the transfer table."""
    M = args.num_microbatches
    tput, tput_q1, tput_q3 = args.tput
    cases: dict[str, list[dict[str, Any]]] = {}
    for c in args.case_list:
        cruns = [r for r in runs if r["case"] == c.name]
        if not cruns:
            continue
        keys = sorted({_key(r) for r in cruns}, key=lambda k: (k[1] != "plain", k[2], -k[3]))
        entries = []
        for key in keys:
            rs = [r for r in cruns if _key(r) == key]
            _, system, stages, scale = key
            steps = [math.inf if r["steps"] is None else float(r["steps"]) for r in rs]
            ratio = _stats(_paired_ratios(cruns, key, (c.name, "plain", 1, 1.0)))
            time_ratio = None
            if system == "async" and stages == 2 and not math.isnan(ratio[0]):
                time_ratio = (ratio[0] / tput, ratio[1] / tput_q3, ratio[2] / tput_q1)
            entries.append(
                {
                    "system": system,
                    "stages": stages,
                    "scale": scale,
                    "label": "plain" if system == "plain" else f"async S={stages}",
                    "named": [n for n, f in NAMED.items() if system == "async" and abs(f(M) - scale) < 1e-12],
                    "balance": rs[0]["balance"],
                    "staleness": rs[0]["staleness"],
                    "seeds": [r["seed"] for r in rs],
                    "reached": sum(math.isfinite(s) for s in steps),
                    "runs": len(steps),
                    "steps": _stats(steps),
                    "ratio": ratio,
                    "time_ratio": time_ratio,
                    "final_acc": _stats([r["final_acc"] for r in rs]),
                    "mean_acc": _stats([r["mean_acc"] for r in rs]),
                    "best": False,
                }
            )
        for label in sorted({e["label"] for e in entries}):
            group = [e for e in entries if e["label"] == label and len(e["seeds"]) > 0]
            if len(group) > 1:  # a sweep: fewest median steps, then the highest median final accuracy
                min(group, key=lambda e: (e["steps"][0], -e["final_acc"][0]))["best"] = True
        cases[c.name] = entries
    return {"cases": cases, "transfer": transfer(runs, cases, args)}


def transfer(
    runs: Sequence[dict[str, Any]], cases: dict[str, list[dict[str, Any]]], args: argparse.Namespace
) -> dict[str, Any]:
    """Each named scale's paired ratio, ``async`` (the shallowest profile) against plain at the same base lr.

    A base is a learning rate a user might have tuned for plain training: every multiplier of the grid at which
    plain training reaches the target in every seed. At base ``m`` the named scale ``s`` is the ``async`` run
    at ``m * s``, compared per seed with plain at ``m`` (``-`` where ``m * s`` is not on the grid).

    The decision, per optimizer family and over all cases: a default must first be safe, that is, never make
    training collapse where plain trains (``diverged``: runs whose final validation accuracy is below
    ``DIVERGED_BELOW``, twice chance; ``misses`` counts every run that missed the target, a collapse or one
    still short of it when the budget ran out), and then be the fastest in the worst case (the highest median
    ratio over cases and bases). The worst case over only two bases, the example's lr and plain's best of the
    sweep, is reported beside it.
    """
    M = args.num_microbatches
    table: dict[str, Any] = {}
    for case, entries in cases.items():
        plain = [e for e in entries if e["system"] == "plain"]
        depths = sorted({e["stages"] for e in entries if e["system"] == "async"})
        if not plain or not depths:
            continue
        best = next((e for e in plain if e["best"]), plain[0])
        scales = {e["scale"] for e in entries if e["system"] == "async" and e["stages"] == depths[0]}
        bases: dict[float, dict[str, Any]] = {}
        for base in sorted((e["scale"] for e in plain if e["reached"] == e["runs"]), reverse=True):
            cell: dict[str, Any] = {}
            for name, f in NAMED.items():
                match = next((sc for sc in scales if abs(sc - base * f(M)) < 1e-12), None)
                if match is None:
                    cell[name] = None
                    continue
                akey: Key = (case, "async", depths[0], match)
                ratios = _paired_ratios(runs, akey, (case, "plain", 1, base))
                diverged = [r["seed"] for r in runs if _key(r) == akey and r["final_acc"] < DIVERGED_BELOW]
                cell[name] = {
                    "stats": list(_stats(ratios)),
                    "misses": sum(math.isinf(r) for r in ratios),
                    "diverged": len(diverged),
                }
            bases[base] = cell
        table[case] = {"stages": depths[0], "plain_best_scale": best["scale"], "bases": bases}
    decision: dict[str, Any] = {}
    families = {"all": list(table)} | {
        opt: [c for c in table if c.endswith("-" + opt)] for opt in sorted({c.split("-")[-1] for c in table})
    }
    for fam, members in families.items():
        every: dict[str, Any] = {}
        two: dict[str, Any] = {}
        for name in NAMED:
            cells = [(c, b, t[name]) for c in members for b, t in table[c]["bases"].items() if t[name] is not None]
            key = [(c, b) for c in members for b in (1.0, table[c]["plain_best_scale"])]
            medians = [x["stats"][0] for _, _, x in cells]
            every[name] = {
                "worst_median_ratio": max(medians, default=None),
                "median_of_medians": statistics.median(medians) if medians else None,
                "misses": sum(x["misses"] for _, _, x in cells),
                "diverged": sum(x["diverged"] for _, _, x in cells),
                "bases_measured": len(cells),
            }
            two_cells = [x for c, b, x in cells if (c, b) in key]
            two[name] = max((x["stats"][0] for x in two_cells), default=None)
        measured = {n: v for n, v in every.items() if v["worst_median_ratio"] is not None}
        choice = min(measured, key=lambda n: (measured[n]["diverged"], measured[n]["worst_median_ratio"]), default=None)
        two_finite = {n: w for n, w in two.items() if w is not None}
        decision[fam] = {
            "every_base": every,
            "choice": choice,
            "two_bases_worst_median_ratio": two,
            "two_bases_choice": min(two_finite, key=lambda n: two_finite[n], default=None),
        }
    return {"table": table, "decision": decision}


# ---------------------------------------------------------------------------------------------------- tables


def headline(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Plain at the example's lr (and its best), and async at 1, 1/sqrt(M), 1/M and the best of its sweep."""
    headers = [
        "case",
        "setting",
        "lr_scale",
        "reached",
        "steps to target",
        "steps / plain",
        "time / plain (derived)",
        "final val acc",
        "mean val acc",
    ]
    rows = []
    for case, entries in result["cases"].items():
        for e in entries:
            plain_ref = e["system"] == "plain" and e["scale"] == 1.0
            if not (plain_ref or e["best"] or e["named"]):
                continue
            tags = list(e["named"]) + (["best of sweep"] if e["best"] else [])
            setting = ("plain, example's lr" if plain_ref else e["label"]) + (f" ({', '.join(tags)})" if tags else "")
            rows.append(_row(case, setting, e))
    return headers, rows


def full(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["case", "setting", "lr_scale", "reached", "steps to target", "steps / plain", "final val acc"]
    rows = []
    for case, entries in result["cases"].items():
        for e in entries:
            rows.append(_row(case, e["label"] + (" *" if e["best"] else ""), e)[:6] + [_fmt3(e["final_acc"], ".3f")])
    return headers, rows


def _row(case: str, setting: str, e: dict[str, Any]) -> list[str]:
    return [
        case,
        setting,
        _frac(e["scale"]),
        f"{e['reached']}/{e['runs']}",
        _fmt3(e["steps"], ".0f"),
        _fmt3(e["ratio"], ".2f"),
        "" if e["time_ratio"] is None else _fmt3(e["time_ratio"], ".2f"),
        _fmt3(e["final_acc"], ".3f"),
        _fmt3(e["mean_acc"], ".3f"),
    ]


def transfer_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["case", "base: plain's lr x", "plain steps", *(f"lr_scale {n}" for n in NAMED)]
    rows = []
    for case, t in result["transfer"]["table"].items():
        plain = {e["scale"]: e for e in result["cases"][case] if e["system"] == "plain"}
        for base, cell in t["bases"].items():
            tags = [
                tag for tag, hit in (("example", base == 1.0), ("plain best", base == t["plain_best_scale"])) if hit
            ]
            rows.append(
                [case, _frac(base) + (f" ({', '.join(tags)})" if tags else ""), _fmt(plain[base]["steps"][0], ".0f")]
                + ["-" if cell[n] is None else _fmt3(cell[n]["stats"], ".2f") + _misses(cell[n]) for n in NAMED]
            )
    return headers, rows


def _misses(cell: dict[str, Any]) -> str:
    n, div = cell["misses"], cell["diverged"]
    if not n:
        return ""
    return f" ({n} miss{'es' if n > 1 else ''}" + (f", {div} diverged)" if div else ")")


def decision_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for fam, d in result["transfer"]["decision"].items():
        every = "; ".join(
            f"{n}: worst {'-' if v['worst_median_ratio'] is None else _fmt(v['worst_median_ratio'], '.2f')}, "
            f"median {'-' if v['median_of_medians'] is None else _fmt(v['median_of_medians'], '.2f')}, "
            f"{v['diverged']} diverged / {v['misses']} missed runs, {v['bases_measured']} bases"
            for n, v in d["every_base"].items()
        )
        two = ", ".join(
            f"{n}: {'-' if w is None else _fmt(w, '.2f')}" for n, w in d["two_bases_worst_median_ratio"].items()
        )
        lines.append(f"[{fam}] every base where plain reaches the target: {every}  -> choice: {d['choice']}")
        lines.append(f"[{fam}] only the example's lr and plain's best: worst {two}  -> lowest: {d['two_bases_choice']}")
    return lines


# ---------------------------------------------------------------------------------------------------- output


def plot(runs: Sequence[dict[str, Any]], result: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    """Top: median validation curves; bottom: median paired steps ratio against plain, over the lr_scale grid."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib); no plot")
        return
    cases = list(result["cases"])
    fig, axes = plt.subplots(2, len(cases), figsize=(4.2 * len(cases), 7.6), squeeze=False)
    M = args.num_microbatches
    for j, case in enumerate(cases):
        target = next(c.target for c in args.case_list if c.name == case)
        ax = axes[0][j]
        entries = result["cases"][case]
        shown = [
            e
            for e in entries
            if (e["system"] == "plain" and e["scale"] == 1.0) or (e["stages"] == 2 and (e["named"] or e["best"]))
        ]
        for i, e in enumerate(shown):
            rs = [r for r in runs if _key(r) == (case, e["system"], e["stages"], e["scale"])]
            steps = [s for s, _ in rs[0]["curve"]]
            med = [statistics.median(col) for col in zip(*([v for _, v in r["curve"]] for r in rs))]
            tags = ", ".join(e["named"] + (["best"] if e["best"] else []))
            label = (
                "plain"
                if e["system"] == "plain"
                else f"S={e['stages']} x{_frac(e['scale'])}" + (f" ({tags})" if tags else "")
            )
            ax.plot(
                steps,
                med,
                color="k" if e["system"] == "plain" else f"C{i}",
                lw=1.6 if e["system"] == "plain" else 1.1,
                label=label,
            )
        ax.axhline(target, color="k", lw=0.7, ls="--")
        ax.set_ylim(0.0, 1.0)
        ax.set_title(f"{case}: median of {args.seeds} seeds", fontsize=9)
        ax.set_xlabel("step (Lightning batch)")
        if j == 0:
            ax.set_ylabel("validation accuracy")
        ax.legend(fontsize=7, loc="lower right")
        ax = axes[1][j]
        for label, color in (
            ("plain", "k"),
            *((f"async S={d}", f"C{d}") for d in sorted({e["stages"] for e in entries if e["system"] == "async"})),
        ):
            group = sorted((e for e in entries if e["label"] == label), key=lambda e: e["scale"])
            xs = [e["scale"] for e in group]
            ys = [min(e["ratio"][0], 4.0) for e in group]  # a missed target is drawn at the top
            ax.plot(
                xs, ys, "o-", color=color, ms=4, label=label + (" (lr x grid)" if label == "plain" else " (lr_scale)")
            )
        ax.axhline(1.0, color="k", lw=0.7, ls=":")
        for name, f in NAMED.items():
            ax.axvline(f(M), color="0.8", lw=0.8, zorder=0)
            ax.text(f(M), 3.9, name, fontsize=7, ha="center", va="top", color="0.4")
        ax.set_xscale("log", base=2)
        ticks = sorted({e["scale"] for e in entries})
        ax.set_xticks(ticks, [_frac(t) for t in ticks], fontsize=7)
        ax.minorticks_off()
        ax.set_ylim(0.0, 4.1)
        ax.set_xlabel("lr_scale (plain: lr multiplier)")
        if j == 0:
            ax.set_ylabel("steps to target / plain at the example's lr\n(median of paired seeds; 4 = missed)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path.relative_to(_ROOT) if path.is_relative_to(_ROOT) else path}")


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k not in ("case_list", "stage_list", "tput")
    }


def _write(
    path: Path,
    args: argparse.Namespace,
    machine: dict[str, Any],
    runs: list[dict[str, Any]],
    total: float,
    result: dict[str, Any] | None,
) -> None:
    """The raw record; written after every run (an interrupted measurement keeps its data) and at the end."""
    payload: dict[str, Any] = {
        "config": _config(args),
        "cases": {c.name: vars(c) for c in args.case_list},
        "machine": machine,
        "machine_at_end": machine_info() if result is not None else None,
        "command": command_line(),
        "total_s": total,
        "runs": runs,
    }
    if result is not None:
        payload["result"] = result
        payload["text_tables"] = {
            "headline": format_table(*headline(result), markdown=True),
            "transfer": format_table(*transfer_rows(result), markdown=True),
            "full": format_table(*full(result), markdown=True),
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str))


def report(
    runs: list[dict[str, Any]], total: float, args: argparse.Namespace, out: Path | None, machine: dict[str, Any]
) -> int:
    result = analyse(runs, args)
    M = args.num_microbatches
    print()
    print(f"Steps to target against plain (paired per seed; medians [IQR] over seeds; M={M})")
    print(format_table(*headline(result)))
    tput = args.tput
    print(
        f"  measured: steps, ratios, accuracies (the replay). derived: time / plain = (steps / plain) / "
        f"{tput[0]:g}, the async/sync samples/s of 2 stages from throughput.py (IQR {tput[1]:g}-{tput[2]:g}); "
        "sync makes plain training's updates"
    )
    print()
    print(
        "Transfer: async (shallowest profile) at base x lr_scale against plain at the same base, at every base where "
        "plain reaches the target; median [IQR] of steps / plain (miss: a seed that missed the target)"
    )
    print(format_table(*transfer_rows(result)))
    print()
    print(
        "Decision (safe first: no collapse where plain trains, final val acc < "
        f"{DIVERGED_BELOW:g}; then the lowest worst-case median ratio over cases and bases)"
    )
    for line in decision_lines(result):
        print("  " + line)
    print()
    print("Every setting (* = best of its sweep)")
    print(format_table(*full(result)))
    print(f"total {total:.0f} s for {len(runs)} runs")
    if out is not None:
        _write(out, args, machine, runs, total, result)
        print(f"raw: {out.relative_to(_ROOT) if out.is_relative_to(_ROOT) else out}")
    if not args.no_plot:
        plot(runs, result, args, args.plot)
    return 0


def _load(path: Path, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any], float]:
    stored = json.loads(path.read_text())
    for key, value in stored["config"].items():
        if key not in ("plot", "out_dir", "from_json", "no_plot"):
            setattr(args, key, value)
    _derive(args)
    print(f"re-analysing {path} (measured {stored['machine']['date_utc']}: {stored['command']})")
    return stored["runs"], stored["machine"], float(stored["total_s"])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.from_json is not None:
        runs, machine, total = _load(args.from_json, args)
        return report(runs, total, args, None, machine)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out_dir / f"async_lr-{stamp}{'-quick' if args.quick else ''}.json"
    runs, machine, total = _measure(args, out)
    return report(runs, total, args, out, machine)


if __name__ == "__main__":
    sys.exit(main())
