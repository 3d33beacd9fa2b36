"""Prediction error of the interference predictors: the forest against the measured-slowdown baseline.

The data are real measurements on this machine: the calibration sweep of ``python -m lightning_dynpipe calibrate``
(:mod:`lightning_dynpipe.sweep`): the model's own layer sets, each stage's layer set run as a stage runs
it (``M`` forward+backward per step, each followed by the wait for the slowest other stage) in a worker pinned to
one core, under interference scenarios applied to one stage (CPU hogs, CPU limits, link delay with jitter), for
several partitions. A "window" is one partition measured under one scenario.

Two questions, each answered for the forest and the baseline:

* **held-out scenario types**: for each scenario in turn, the forest is trained on the windows of every *other*
  scenario and asked, from the window of one partition ``A`` of the held-out scenario, for each stage's compute
  per micro-batch under every other partition ``B`` of that scenario (measured, so the truth is known);
* **partitions never run**: for each partition ``P`` in turn, the forest is trained on every window except those
  of ``P`` and asked for ``P`` from the windows of the other partitions, under every scenario.

A third, **detection**, is answered by replaying the adaptive loop on a synthetic pipeline
(:mod:`benchmarks.detection`): for the forest policy, the measured baseline and Varuna's and the original DynPipe's
rules (:mod:`lightning_dynpipe.repartition.rules`), the steps from an interference onset to the first repartition
decision, and the migrations on runs with noise only (``--no-detection`` skips it).

A fourth, **repeatability**, bounds what the first two can show: a second sweep right after the first measures the
clean windows of the same partitions again (with its own layer profile), and the stage times of the same layer
sets are compared between the two sweeps. On a shared machine that spread is the truth's own, and no predictor's
error below it means much.

Reported: the median absolute percentage error of the stage times (all stages, and the stages the interference
was on), the same for boundary message times, the share of measured values inside the forest's interval
(nominal 90%; also apart for the stages the interference was on and the others, and for the same rows with one
interval margin for both kinds, ``stratified=False``), and the forest's cost per check (pricing every candidate of
a check in one call). The forest is the default ``ForestPredictor``, each candidate priced relative to the
window's own partition; the same trees priced
without that (``anchored=False``) are reported beside it.

Usage (from the repository root)::

    .venv/bin/python benchmarks/predictor.py                          # sweep the MLP of width 384, 2 stages
    .venv/bin/python benchmarks/predictor.py --from-json runs.json    # a sweep saved by calibrate --runs-out
    .venv/bin/python benchmarks/predictor.py --from-json runs.json --repeat-json repeat.json  # with a second sweep
    .venv/bin/python benchmarks/predictor.py --quick --out-dir /tmp   # smoke run: tiny model, 3 scenarios
    .venv/bin/python benchmarks/predictor.py --from-json runs.json --detection-seeds 5   # more replay seeds

Outputs: the tables on stdout, ``benchmarks/out/predictor-<stamp>.json`` (every run and every prediction error),
and a dated report ``benchmarks/results/<date>-predictor.md`` with machine, versions, commit and command
(``--quick`` writes both into ``--out-dir``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `benchmarks` and the package importable
    sys.path.insert(0, str(_ROOT))

from benchmarks import detection as _detection  # noqa: E402
from benchmarks._common import command_line, describe_machine, format_table, machine_info  # noqa: E402
from lightning_dynpipe.plan.costs import CommModel, ModelCost  # noqa: E402
from lightning_dynpipe.predictor import ForestPredictor, LabelledSamples, MeasuredSlowdownPredictor  # noqa: E402
from lightning_dynpipe.predictor.features import effective_compute_s  # noqa: E402
from lightning_dynpipe.sweep import SCENARIOS, CalibrationRun, calibration_samples  # noqa: E402

_PROBLEM = "lightning_dynpipe.demos:MLP"


def _sweep(args: argparse.Namespace, out_dir: Path) -> Path:
    runs = out_dir / "predictor-runs.json"
    cmd = [
        sys.executable, "-m", "lightning_dynpipe", "calibrate", "--model", args.model, "--init-args", args.init_args,
        "--batch-size", str(args.batch_size), "--num-stages", "2", "--scenarios", args.scenarios,
        "--partitions", str(args.partitions), "--steps", str(args.steps), "--out", str(out_dir / "forest.npz"),
        "--runs-out", str(runs), "--no-planned",  # a fixed grid: every partition is held out in turn
    ]  # fmt: skip
    print("sweep:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=_ROOT)
    return runs


def _repeat_sweep(args: argparse.Namespace, out_dir: Path, first: Sequence[CalibrationRun]) -> Path:
    """The first sweep's clean windows once more, in a second sweep right after it (the same partitions; its own
    layer profile, which would otherwise choose them)."""
    runs = out_dir / "predictor-repeat-runs.json"
    balances = ";".join(",".join(map(str, r.window.partition.balance)) for r in first if r.scenario == "none")
    cmd = [
        sys.executable, "-m", "lightning_dynpipe", "calibrate", "--model", args.model, "--init-args", args.init_args,
        "--batch-size", str(args.batch_size), "--num-stages", "2", "--scenarios", "none",
        "--balances", balances, "--steps", str(args.steps), "--out", str(out_dir / "forest-repeat.npz"),
        "--runs-out", str(runs),
    ]  # fmt: skip
    print("repeat:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=_ROOT, stdout=subprocess.DEVNULL)
    return runs


def repeatability(first: Sequence[CalibrationRun], second: Sequence[CalibrationRun]) -> dict[str, float]:
    """How far two measurements of the same clean layer set apart: per stage of every partition both sweeps ran
    without interference, ``|second / first - 1|`` of the compute per micro-batch; median, maximum and count.

    No predictor's error can be judged below this: it is the truth's own spread on this machine at this time.
    """

    def clean(runs: Sequence[CalibrationRun]) -> dict[tuple[tuple[int, ...], int], float]:
        return {
            (r.window.partition.balance, k): effective_compute_s(t) / r.window.num_microbatches
            for r in runs
            if r.scenario == "none"
            for k, t in enumerate(r.window.stages)
        }

    a, b = clean(first), clean(second)
    errs = [abs(b[key] / a[key] - 1) for key in a if key in b and a[key] > 0]
    return {"mdape": _med(errs), "max": max(errs, default=float("nan")), "n": float(len(errs))}


def _load(path: Path) -> tuple[ModelCost, CommModel, list[CalibrationRun]]:
    data = json.loads(path.read_text())
    layers = data["layers"]
    cost = ModelCost.from_arrays(**layers)
    comm = CommModel(latency_s=data["comm"][0], bandwidth_Bps=data["comm"][1])
    return cost, comm, [CalibrationRun.from_dict(r) for r in data["runs"]]


def _interfered(run: CalibrationRun, k: int) -> bool:
    sc = SCENARIOS.get(run.scenario)
    return sc is not None and sc.kind in ("hog", "limit") and sc.stage % run.window.partition.num_stages == k


def _errors(
    cost: ModelCost, comm: CommModel, forest: ForestPredictor, pairs: Sequence[tuple[CalibrationRun, CalibrationRun]]
) -> dict[str, list[float]]:
    base = MeasuredSlowdownPredictor()
    raw = copy.copy(forest)  # the same trees, each candidate priced at its prior times its own residual alone
    raw.anchored = False
    pooled = ForestPredictor(stratified=False).fit(forest.samples)  # the same rows, one margin for every stage
    # an untrained forest answers its prior (with the fixed cost per micro-batch the trained one was given)
    prior = ForestPredictor().fit(dataclasses.replace(LabelledSamples.empty(), fixed_s=forest.fixed_s))
    names = ("forest", "base", "prior", "forest_hit", "base_hit", "prior_hit", "cover", "bforest", "bbase", "bcover")
    names += ("raw", "raw_hit", "raw_cover", "braw", "cover_hit", "cover_quiet", "pooled_cover_hit")
    names += ("pooled_cover_quiet", "width_hit", "width_quiet", "pooled_width_hit", "pooled_width_quiet")
    out: dict[str, list[float]] = {k: [] for k in names}
    for a, b in pairs:
        M = b.window.num_microbatches
        pf = forest.predict(cost, comm, a.window, b.window.partition)
        pb = base.predict(cost, comm, a.window, b.window.partition)
        pp = prior.predict(cost, comm, a.window, b.window.partition)
        pr = raw.predict(cost, comm, a.window, b.window.partition)
        po = pooled.predict(cost, comm, a.window, b.window.partition)
        for k, t in enumerate(b.window.stages):
            truth = effective_compute_s(t) / M
            ef = abs(pf.stage_compute_s[k].value / truth - 1)
            eb = abs(pb.stage_compute_s[k].value / truth - 1)
            ep = abs(pp.stage_compute_s[k].value / truth - 1)
            er = abs(pr.stage_compute_s[k].value / truth - 1)
            out["raw"].append(er)
            out["raw_cover"].append(float(pr.stage_compute_s[k].low <= truth <= pr.stage_compute_s[k].high))
            out["forest"].append(ef)
            out["base"].append(eb)
            out["prior"].append(ep)
            inside = float(pf.stage_compute_s[k].low <= truth <= pf.stage_compute_s[k].high)
            pooled_inside = float(po.stage_compute_s[k].low <= truth <= po.stage_compute_s[k].high)
            out["cover"].append(inside)
            kind = "hit" if _interfered(b, k) else "quiet"
            out[f"cover_{kind}"].append(inside)
            out[f"width_{kind}"].append(math.log(pf.stage_compute_s[k].high / pf.stage_compute_s[k].low))
            out[f"pooled_width_{kind}"].append(math.log(po.stage_compute_s[k].high / po.stage_compute_s[k].low))
            out[f"pooled_cover_{kind}"].append(pooled_inside)
            if _interfered(b, k):
                out["forest_hit"].append(ef)
                out["base_hit"].append(eb)
                out["prior_hit"].append(ep)
                out["raw_hit"].append(er)
        S = b.window.partition.num_stages
        for bd in range(S - 1):
            n0, n1 = M * ((bd > 0) + 1), M * (1 + (bd + 1 < S - 1))
            truth = (b.window.stages[bd].comm_s / n0 + b.window.stages[bd + 1].comm_s / n1) / 2
            if truth <= 0:
                continue
            out["bforest"].append(abs(pf.boundary_s[bd].value / truth - 1))
            out["bbase"].append(abs(pb.boundary_s[bd].value / truth - 1))
            out["braw"].append(abs(pr.boundary_s[bd].value / truth - 1))
            out["bcover"].append(float(pf.boundary_s[bd].low <= truth <= pf.boundary_s[bd].high))
    return out


def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _pct(x: float) -> str:
    return "-" if x != x else f"{x * 100:.1f}%"


def evaluate(cost: ModelCost, comm: CommModel, runs: Sequence[CalibrationRun]) -> dict[str, Any]:
    """Both questions of the module docstring; returns per-group error lists and the tables' rows."""
    scenarios = sorted({r.scenario for r in runs}, key=[r.scenario for r in runs].index)
    partitions = sorted({r.window.partition.balance for r in runs})
    groups: dict[str, dict[str, list[float]]] = {}
    for sc in scenarios:
        train = [r for r in runs if r.scenario != sc]
        forest = ForestPredictor().fit(calibration_samples(cost, comm, train))
        test = [r for r in runs if r.scenario == sc]
        pairs = [(a, b) for a in test for b in test if a.window.partition != b.window.partition]
        groups[f"scenario {sc}"] = _errors(cost, comm, forest, pairs)
    for p in partitions:
        train = [r for r in runs if r.window.partition.balance != p]
        forest = ForestPredictor().fit(calibration_samples(cost, comm, train))
        pairs = []
        for sc in scenarios:
            same = [r for r in runs if r.scenario == sc]
            pairs += [
                (a, b)
                for a in same
                for b in same
                if a.window.partition.balance != p and b.window.partition.balance == p
            ]
        groups[f"partition {list(p)}"] = _errors(cost, comm, forest, pairs)
    return {"scenarios": scenarios, "partitions": [list(p) for p in partitions], "groups": groups}


def _cost_per_check(cost: ModelCost, comm: CommModel, runs: Sequence[CalibrationRun]) -> dict[str, float]:
    from lightning_dynpipe.repartition.controller import neighbours

    forest = ForestPredictor().fit(calibration_samples(cost, comm, runs))
    window = runs[0].window
    cands = [window.partition, *neighbours(window.partition)]
    forest.predict_many(cost, comm, window, cands)
    t0 = time.perf_counter()
    n = 20
    for _ in range(n):
        forest.predict_many(cost, comm, window, cands)
    per_check = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    ForestPredictor().fit(calibration_samples(cost, comm, runs))
    fit_s = time.perf_counter() - t0
    return {
        "candidates": float(len(cands)),
        "per_check_s": per_check,
        "fit_s": fit_s,
        "rows": float(len(calibration_samples(cost, comm, runs))),
    }


def _tables(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["held out", "stage: forest", "prior", "baseline", "interfered stage: forest", "prior", "baseline",
               "coverage", "boundary: forest", "baseline", "coverage", "n"]  # fmt: skip
    rows = []
    for name, e in result["groups"].items():
        m = {k: _pct(_med(v)) for k, v in e.items()}
        cover = _pct(statistics.mean(e["cover"])) if e["cover"] else "-"
        bcover = _pct(statistics.mean(e["bcover"])) if e["bcover"] else "-"
        rows.append([
            name, m["forest"], m["prior"], m["base"], m["forest_hit"], m["prior_hit"], m["base_hit"], cover,
            m["bforest"], m["bbase"], bcover, str(len(e["forest"])),
        ])  # fmt: skip
    return headers, rows


def _summary(result: dict[str, Any], kind: str) -> dict[str, float]:
    sel = [e for name, e in result["groups"].items() if name.startswith(kind)]
    pool = {k: [x for e in sel for x in e[k]] for k in sel[0]} if sel else {}
    return {
        "forest": _med(pool.get("forest", [])),
        "base": _med(pool.get("base", [])),
        "prior": _med(pool.get("prior", [])),
        "prior_hit": _med(pool.get("prior_hit", [])),
        "forest_hit": _med(pool.get("forest_hit", [])),
        "base_hit": _med(pool.get("base_hit", [])),
        "cover": statistics.mean(pool["cover"]) if pool.get("cover") else float("nan"),
        "bforest": _med(pool.get("bforest", [])),
        "bbase": _med(pool.get("bbase", [])),
        "bcover": statistics.mean(pool["bcover"]) if pool.get("bcover") else float("nan"),
        "raw": _med(pool.get("raw", [])),
        "raw_hit": _med(pool.get("raw_hit", [])),
        "raw_cover": statistics.mean(pool["raw_cover"]) if pool.get("raw_cover") else float("nan"),
        "braw": _med(pool.get("braw", [])),
        **{k: _med(pool.get(k, [])) for k in ("width_hit", "width_quiet", "pooled_width_hit", "pooled_width_quiet")},
        **{
            k: statistics.mean(pool[k]) if pool.get(k) else float("nan")
            for k in ("cover_hit", "cover_quiet", "pooled_cover_hit", "pooled_cover_quiet")
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=_PROBLEM)
    p.add_argument("--init-args", default='{"width": 384}')
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="the sweep's scenarios; with --from-json, the saved windows of these scenarios only",
    )
    p.add_argument("--partitions", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--from-json", type=Path, default=None, help="a sweep saved by `calibrate --runs-out`")
    p.add_argument(
        "--repeat-json", type=Path, default=None,
        help="with --from-json: a second clean sweep (`calibrate --scenarios none --runs-out`) for the repeatability",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny model, three scenarios, three partitions")
    p.add_argument("--out-dir", type=Path, default=None, help="where --quick writes (default: a temporary folder)")
    p.add_argument("--no-detection", action="store_true", help="skip the detection replay")
    p.add_argument("--detection-seeds", type=int, default=3, help="seeds of the detection replay (default 3)")
    args = p.parse_args(argv)
    if args.quick:
        args.init_args, args.scenarios, args.partitions, args.steps = '{"width": 64}', "none,quota50,delay1", 3, 2
    out_dir = args.out_dir or (Path(tempfile.mkdtemp()) if args.quick else _ROOT / "benchmarks" / "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    print(describe_machine(machine))
    runs_path = args.from_json or _sweep(args, out_dir)
    cost, comm, runs = _load(runs_path)
    if args.from_json:
        runs = [r for r in runs if r.scenario in args.scenarios.split(",")]
    repeat_path = args.repeat_json if args.from_json else _repeat_sweep(args, out_dir, runs)
    repeat = repeatability(runs, _load(repeat_path)[2]) if repeat_path is not None else None
    result = evaluate(cost, comm, runs)
    costs = _cost_per_check(cost, comm, runs)
    headers, rows = _tables(result)
    print()
    print(format_table(headers, rows))
    held, unseen = _summary(result, "scenario"), _summary(result, "partition")
    verdict = [
        f"held-out scenario types: stage MdAPE forest {_pct(held['forest'])}, prior {_pct(held['prior'])}, baseline "
        f"{_pct(held['base'])} (interfered stages {_pct(held['forest_hit'])}, {_pct(held['prior_hit'])}, "
        f"{_pct(held['base_hit'])}), coverage {_pct(held['cover'])} at nominal 90%",
        f"partitions never run: stage MdAPE forest {_pct(unseen['forest'])}, prior {_pct(unseen['prior'])}, baseline "
        f"{_pct(unseen['base'])} (interfered stages {_pct(unseen['forest_hit'])}, {_pct(unseen['prior_hit'])}, "
        f"{_pct(unseen['base_hit'])}), coverage {_pct(unseen['cover'])}; targets: forest <= 10% and <= half the "
        "baseline's, coverage >= 80%",
        f"boundaries: MdAPE forest {_pct(held['bforest'])} vs baseline {_pct(held['bbase'])} (held-out scenarios), "
        f"{_pct(unseen['bforest'])} vs {_pct(unseen['bbase'])} (partitions never run)",
        f"the forest not anchored to the window's partition (anchored=False): stage MdAPE {_pct(held['raw'])} "
        f"(interfered {_pct(held['raw_hit'])}, coverage {_pct(held['raw_cover'])}) on held-out scenarios, "
        f"{_pct(unseen['raw'])} ({_pct(unseen['raw_hit'])}, {_pct(unseen['raw_cover'])}) on partitions never run; "
        f"boundaries {_pct(held['braw'])} and {_pct(unseen['braw'])}",
        f"coverage by kind of stage, interfered / quiet: {_pct(held['cover_hit'])} / {_pct(held['cover_quiet'])} "
        f"on held-out scenarios, {_pct(unseen['cover_hit'])} / {_pct(unseen['cover_quiet'])} on partitions never "
        f"run; with one margin for both (stratified=False) {_pct(held['pooled_cover_hit'])} / "
        f"{_pct(held['pooled_cover_quiet'])} and {_pct(unseen['pooled_cover_hit'])} / "
        f"{_pct(unseen['pooled_cover_quiet'])}; median log(high / low) {held['width_hit']:.2f} / "
        f"{held['width_quiet']:.2f} and {unseen['width_hit']:.2f} / {unseen['width_quiet']:.2f}, with one margin "
        f"{held['pooled_width_hit']:.2f} / {held['pooled_width_quiet']:.2f} and {unseen['pooled_width_hit']:.2f} / "
        f"{unseen['pooled_width_quiet']:.2f}",
        f"cost: {costs['per_check_s'] * 1e3:.2f} ms per check ({costs['candidates']:.0f} candidates in one call); a "
        f"refit on {costs['rows']:.0f} rows {costs['fit_s'] * 1e3:.0f} ms",
    ]
    if repeat is not None:
        verdict.append(
            f"repeatability: the same clean layer sets measured again in a second sweep right after differ by MdAPE "
            f"{_pct(repeat['mdape'])} (max {_pct(repeat['max'])}, {repeat['n']:.0f} stages): no prediction error "
            "below that can be measured on this machine at this time"
        )
    det_rows: list[list[str]] = []
    det: dict[str, Any] = {}
    if not args.no_detection:
        det = _run_detection(args)
        det_rows = _detection.detection_rows(det["summary"])
        verdict += det["verdict"]
    print()
    print("\n".join(verdict))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    record = {"machine": machine, "command": command_line(), "args": {k: str(v) for k, v in vars(args).items()},
              "runs": str(runs_path), "repeat_runs": str(repeat_path), "repeatability": repeat,
              "result": result, "cost": costs, "verdict": verdict,
              "detection": det}  # fmt: skip
    (out_dir / f"predictor-{stamp}.json").write_text(json.dumps(record, indent=1))
    results_dir = out_dir if args.quick else _ROOT / "benchmarks" / "results"
    report = results_dir / f"{datetime.now(timezone.utc):%Y-%m-%d}-predictor.md"
    report.write_text(
        "# Interference predictors: prediction error (forest vs measured-slowdown baseline)\n\n"
        f"Date: {machine['date_utc']}. Commit: {machine['git_commit']}"
        f"{_modified(machine)}.\n\n"
        f"{describe_machine(machine)}, scikit-learn {_version('scikit-learn')}.\n\n"
        f"Command: `{command_line()}`; data: {len(runs)} measured windows ({', '.join(result['scenarios'])}; "
        f"partitions {result['partitions']}) of `{args.model}` {args.init_args}, batch {args.batch_size}.\n\n"
        "What is measured: see the docstring of `benchmarks/predictor.py`. Truth = the stage's measured compute per "
        "micro-batch under the other partition of the same scenario.\n\n"
        + format_table(headers, rows, markdown=True)
        + "\n\n"
        + (
            "Detection (replayed on the synthetic pipeline, see `benchmarks/detection.py`; "
            f"{det['config']}):\n\n" + format_table(_detection.DETECTION_HEADERS, det_rows, markdown=True) + "\n\n"
            if det_rows
            else ""
        )
        + "\n".join(f"- {v}" for v in verdict)
        + "\n\n## How to reproduce\n\n"
        + f"From the repository root: `{command_line()}`"
        + (f" (the sweep's windows: `{runs_path}`)" if args.from_json else "; it runs the calibration sweep first")
        + ". To re-analyse without measuring: `.venv/bin/python benchmarks/predictor.py --from-json "
        + f"{runs_path}"
        + (f" --repeat-json {repeat_path}" if repeat_path is not None else "")
        + f"` (raw record: `{out_dir / f'predictor-{stamp}.json'}`). No plot: the script writes tables only.\n"
    )
    print(f"\nreport written to {report}")
    return 0


def _run_detection(args: argparse.Namespace) -> dict[str, Any]:
    """The detection replay (quick: two scenarios, one seed, a short run, no online refit in it)."""
    import logging

    logging.getLogger("lightning_dynpipe").setLevel(logging.ERROR)  # the forest's refit notices, once per refit
    if args.quick:
        kw: dict[str, Any] = dict(scenarios=("none", "quota25"), seeds=(0,), steps=120, onset=40,
                                  forest_options={"refit_every": 20, "n_estimators": 16})  # fmt: skip
    else:
        kw = dict(seeds=tuple(range(args.detection_seeds)), steps=400, onset=100)
    config = ", ".join(f"{k} {v}" for k, v in kw.items())
    t0 = time.perf_counter()
    runs = _detection.run_detection(**kw)
    summary = _detection.summarise(runs)
    print()
    print(f"detection ({config}; {time.perf_counter() - t0:.1f} s):")
    print(format_table(_detection.DETECTION_HEADERS, _detection.detection_rows(summary)))
    return {"config": config, "summary": summary, "runs": [vars(r) for r in runs],
            "verdict": _detection.verdict(summary)}  # fmt: skip


def _modified(machine: dict[str, Any]) -> str:
    files = machine.get("git_modified_files") or []
    return f" (modified: {', '.join(files)})" if files else ""


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
