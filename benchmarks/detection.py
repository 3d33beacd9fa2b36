"""Detection of interference by the adaptive loop's policies, replayed on a synthetic pipeline (cheap, deterministic).

Used by ``benchmarks/predictor.py`` (its "detection" section); importable on its own for tests. Four systems, each
an :class:`~lightning_dynpipe.repartition.AdaptiveController` with the runtime's own policy and predictor objects:

=============  =====================================================================================================
``forest``     :class:`~lightning_dynpipe.repartition.GainOverCostPolicy` (defaults) with a
               :class:`~lightning_dynpipe.predictor.ForestPredictor` calibrated on a sweep of the synthetic pipeline
               (every scenario below at every partition, another noise seed: what ``calibrate`` does on a machine),
               learning online from the replayed windows
``measured``   ``GainOverCostPolicy`` with the :class:`~lightning_dynpipe.predictor.MeasuredSlowdownPredictor`
``varuna``     :class:`~lightning_dynpipe.repartition.rules.VarunaRule` (a stage > 15% slower than the median stage,
               every window) with the measured predictor (Varuna's planner uses profiled times)
``dynpipe-2x`` :class:`~lightning_dynpipe.repartition.rules.DynPipeThresholdRule` (a stage's forward+backward time
               changed 2x, every 50 steps) with the calibrated forest scoring the cuts, as in the original
=============  =====================================================================================================

The pipeline is :class:`~lightning_dynpipe.repartition.replay.SyntheticPipeline` (10 layers, 2 stages, M=4, a
window every 10 steps, log-normal noise of 3% per window and a 5% chance per window and stage of a 1.5x spike, on
every scenario). Interference starts at ``onset`` and stays (``cycles``: on and off every 60 steps). Reported per
system and scenario over the seeds: steps from the onset to the first repartition decision, migrations (on
``none``: every one is a false alarm), and the share of the rebalancing limit reached after the onset (the mean
over the steps after the onset of the best partition's noiseless step time over the time of the partition in use;
1.0 = always on the best partition).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `benchmarks` and the package importable
    sys.path.insert(0, str(_ROOT))

from benchmarks._common import command_line, describe_machine, format_table, machine_info  # noqa: E402
from lightning_dynpipe.plan.auto import best_plan  # noqa: E402
from lightning_dynpipe.plan.convergence import ConvergenceModel  # noqa: E402
from lightning_dynpipe.plan.partition import Partition  # noqa: E402
from lightning_dynpipe.predictor import ForestPredictor, InterferencePredictor, MeasuredSlowdownPredictor  # noqa: E402
from lightning_dynpipe.predictor.features import LabelledSamples, samples_from_windows  # noqa: E402
from lightning_dynpipe.repartition import AdaptiveController, GainOverCostPolicy, RepartitionPolicy  # noqa: E402
from lightning_dynpipe.repartition.replay import (  # noqa: E402
    LINK,
    Env,
    SyntheticPipeline,
    replay,
    synthetic_model_cost,
    synthetic_window,
    two_stage_partitions,
)
from lightning_dynpipe.repartition.rules import DynPipeThresholdRule, VarunaRule  # noqa: E402

SYSTEMS: tuple[str, ...] = ("forest", "measured", "varuna", "dynpipe-2x")
NOISE = Env(noise=0.03, spike=0.05)
SCENARIOS: dict[str, Env] = {
    "none": NOISE,
    "hog": replace(NOISE, hog=(1.0, 0.0)),
    "quota50": replace(NOISE, quota=(None, 0.5)),
    "quota25": replace(NOISE, quota=(None, 0.25)),
    "delay": replace(NOISE, delay_s=5e-3, jitter_s=2e-3),
    "cycles": replace(NOISE, hog=(1.0, 0.0)),
}
M = 4


@dataclass(frozen=True)
class DetectionRun:
    """One replay: a system under a scenario with a seed."""

    system: str
    scenario: str
    seed: int
    first_move: int | None
    migrations: int
    limit_share: float
    moves: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]


def _timeline(scenario: str, onset: int, steps: int) -> list[tuple[int, Env]]:
    if scenario == "none":
        return [(0, NOISE)]
    if scenario == "cycles":
        out: list[tuple[int, Env]] = [(0, NOISE)]
        for s in range(onset, steps, 120):
            out += [(s, SCENARIOS["cycles"]), (s + 60, NOISE)]
        return out
    return [(0, NOISE), (onset, SCENARIOS[scenario])]


def calibration_samples(seed: int) -> LabelledSamples:
    """The synthetic sweep: every scenario at every 2-stage partition, each window paired with every other."""
    cost = synthetic_model_cost()
    rng = np.random.default_rng(10_000 + seed)
    parts = []
    for env in {e for e in SCENARIOS.values()}:
        wins = [synthetic_window(cost, p, env, M, rng) for p in two_stage_partitions()]
        parts += [samples_from_windows(cost, LINK, a, b) for a in wins for b in wins]
    return LabelledSamples.concat(parts)


def _system(
    name: str, calibrated: ForestPredictor, policy_options: dict[str, Any]
) -> tuple[RepartitionPolicy, InterferencePredictor]:
    def forest() -> ForestPredictor:
        return copy.deepcopy(calibrated)  # the same calibrated forest for every run of a seed, learning afresh

    if name == "forest":
        return GainOverCostPolicy(**policy_options), forest()
    if name == "measured":
        return GainOverCostPolicy(**policy_options), MeasuredSlowdownPredictor()
    if name == "varuna":
        return VarunaRule(), MeasuredSlowdownPredictor()
    if name == "dynpipe-2x":
        return DynPipeThresholdRule(), forest()
    raise ValueError(f"unknown system {name!r}; valid: {list(SYSTEMS)}")


def run_detection(
    systems: Sequence[str] = SYSTEMS,
    scenarios: Sequence[str] = tuple(SCENARIOS),
    seeds: Sequence[int] = (0, 1, 2),
    *,
    steps: int = 400,
    onset: int = 100,
    start: Partition | None = None,
    forest_options: dict[str, Any] | None = None,
    policy_options: dict[str, Any] | None = None,
    signs: bool = True,
) -> list[DetectionRun]:
    """Every system under every scenario with every seed (see the module docstring).

    ``start``: the partition at step 0; default the planner's best on the clean profile (so on ``none`` there is
    nothing to gain, and every migration is a false alarm). ``forest_options``: keyword arguments of
    :class:`~lightning_dynpipe.predictor.ForestPredictor` (e.g. a larger ``refit_every`` for a quick run).
    ``policy_options``: keyword arguments of the ``GainOverCostPolicy`` of ``forest`` and ``measured``.
    ``signs``: the controller gets each window's signs of interference, as in a fit (``False``: none, so every
    slowdown but a CPU limit looks unexplained).
    """
    cost = synthetic_model_cost()
    if start is None:
        start = Partition(best_plan(cost, 2, num_stages=2, schedule="async", num_microbatches=M).partition.balance)
    out = []
    for seed in seeds:
        calibrated = ForestPredictor(**(forest_options or {})).fit(calibration_samples(seed))
        for scenario in scenarios:
            timeline = _timeline(scenario, onset, steps)
            for name in systems:
                policy, predictor = _system(name, calibrated, policy_options or {})
                pipe = SyntheticPipeline(cost, timeline, num_microbatches=M, seed=seed)
                controller = AdaptiveController(
                    policy, model_cost=cost, comm=LINK, schedule="async", num_microbatches=M,
                    convergence=ConvergenceModel(beta=0.0), predictor=predictor,
                )  # fmt: skip
                result = replay(controller, pipe.window, start, steps=steps, signs=signs)
                cands = two_stage_partitions()
                after = range(onset + 1, steps + 1)
                share = statistics.mean(
                    pipe.best_step_s(s, cands) / pipe.step_s(s, result.partition_at(s)) for s in after
                )
                out.append(
                    DetectionRun(
                        name, scenario, seed,
                        None if scenario == "none" else result.first_move_after(onset),
                        len(result.moves), share,
                        tuple((m.step, m.old.balance, m.new.balance) for m in result.moves),
                    )
                )  # fmt: skip
    return out


def summarise(runs: Sequence[DetectionRun]) -> list[dict[str, Any]]:
    """Per system and scenario: median steps to the first decision, detections, migrations, limit share."""
    rows = []
    keys = sorted(
        {(r.system, r.scenario) for r in runs}, key=lambda k: (SYSTEMS.index(k[0]), list(SCENARIOS).index(k[1]))
    )
    for system, scenario in keys:
        rs = [r for r in runs if r.system == system and r.scenario == scenario]
        firsts = [r.first_move for r in rs if r.first_move is not None]
        rows.append(
            {
                "system": system,
                "scenario": scenario,
                "seeds": len(rs),
                "detected": len(firsts),
                "median_steps_to_decision": statistics.median(firsts) if firsts else None,
                "migrations": [r.migrations for r in rs],
                "limit_share": statistics.mean(r.limit_share for r in rs),
            }
        )
    return rows


def verdict(summary: Sequence[dict[str, Any]]) -> list[str]:
    """Lines against the issue's detection target (no migration on clean runs in any seed) and a comparison."""
    out = []
    for system in dict.fromkeys(r["system"] for r in summary):
        rows = [r for r in summary if r["system"] == system]
        clean = next((r for r in rows if r["scenario"] == "none"), None)
        hit = [r for r in rows if r["scenario"] != "none"]
        steps = [r["median_steps_to_decision"] for r in hit if r["median_steps_to_decision"] is not None]
        moves = sum(sum(r["migrations"]) for r in hit)
        false_alarms = sum(clean["migrations"]) if clean else 0
        met = "target met" if not false_alarms else "target: 0, missed"
        clean_text = f"{false_alarms} migrations on clean runs ({met})" if clean else "no clean runs"
        share = statistics.mean(r["limit_share"] for r in hit) if hit else float("nan")
        out.append(
            f"detection {system}: {clean_text}; detected {sum(r['detected'] for r in hit)}/"
            f"{sum(r['seeds'] for r in hit)} interfered runs, median steps onset->decision per scenario "
            f"{steps}, {moves} migrations on them, mean limit share {share:.3f}"
            if hit
            else f"detection {system}: {clean_text}"
        )
    return out


DETECTION_HEADERS = ["system", "scenario", "detected", "steps onset->decision (median)", "migrations per seed",
                     "limit share after onset"]  # fmt: skip


def detection_rows(summary: Sequence[dict[str, Any]]) -> list[list[str]]:
    """:func:`summarise`'s rows as table cells (:data:`DETECTION_HEADERS`)."""
    return [
        [
            r["system"], r["scenario"], "-" if r["scenario"] == "none" else f"{r['detected']}/{r['seeds']}",
            "-" if r["median_steps_to_decision"] is None else f"{r['median_steps_to_decision']:g}",
            ",".join(str(m) for m in r["migrations"]), f"{r['limit_share']:.3f}",
        ]
        for r in summary
    ]  # fmt: skip


def plot(summary: Sequence[dict[str, Any]], path: Path, title: str) -> bool:
    """Median steps from onset to decision per scenario and system, and the migrations on clean runs per system."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no plot was written: pip install 'lightning-dynpipe[plot]'")
        return False
    systems = list(dict.fromkeys(r["system"] for r in summary))
    scenarios = [s for s in dict.fromkeys(r["scenario"] for r in summary) if s != "none"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / max(len(systems), 1)
    for i, system in enumerate(systems):
        rows = {r["scenario"]: r for r in summary if r["system"] == system}
        steps = [rows[s]["median_steps_to_decision"] if s in rows else None for s in scenarios]
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(scenarios))]
        left.bar(xs, [v if v is not None else 0 for v in steps], width=width, label=system)
        for x, v in zip(xs, steps):
            if v is None:
                left.annotate("none", (x, 0), ha="center", va="bottom", fontsize=7, rotation=90)
    left.set_xticks(range(len(scenarios)), scenarios)
    left.set_ylabel("median steps, onset to first move")
    left.legend(fontsize=8)
    clean = [
        sum(sum(r["migrations"]) for r in summary if r["system"] == system and r["scenario"] == "none")
        for system in systems
    ]
    right.bar(range(len(systems)), clean, color="#d62728")
    right.set_xticks(range(len(systems)), systems, rotation=30, ha="right")
    right.set_ylabel("migrations on clean runs (all seeds)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """The detection replay on its own: a table, a plot and a dated JSON record with machine, commit and command."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--seeds", type=int, default=5, help="noise seeds 0..N-1 (default 5)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--onset", type=int, default=100)
    p.add_argument("--no-signs", action="store_true", help="the controller gets no signs of interference")
    p.add_argument(
        "--max-overprediction", type=float, default=None,
        help="GainOverCostPolicy's max_overprediction for forest and measured (default: the policy's; inf: no test)",
    )  # fmt: skip
    p.add_argument("--out-dir", type=Path, default=_ROOT / "benchmarks" / "out")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    logging.getLogger("lightning_dynpipe").setLevel(logging.ERROR)  # the forest's refit notices, once per refit
    options = {} if args.max_overprediction is None else {"max_overprediction": args.max_overprediction}
    machine = machine_info()
    print(describe_machine(machine))
    t0 = time.perf_counter()
    runs = run_detection(
        systems=tuple(args.systems.split(",")), scenarios=tuple(args.scenarios.split(",")),
        seeds=tuple(range(args.seeds)), steps=args.steps, onset=args.onset, policy_options=options,
        signs=not args.no_signs,
    )  # fmt: skip
    summary = summarise(runs)
    config = (
        f"{args.seeds} seeds x {args.steps} steps, onset {args.onset}, signs {'off' if args.no_signs else 'on'}"
        + (f", max_overprediction {args.max_overprediction:g}" if options else "")
    )
    print(f"\ndetection ({config}; {time.perf_counter() - t0:.1f} s):")
    print(format_table(DETECTION_HEADERS, detection_rows(summary)))
    lines = verdict(summary)
    print("\n" + "\n".join(lines))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    record = args.out_dir / f"detection-{stamp}.json"
    record.write_text(
        json.dumps(
            {
                "machine": machine,
                "command": command_line(),
                "config": config,
                "summary": summary,
                "runs": [vars(r) for r in runs],
                "verdict": lines,
            },
            indent=1,
        )  # fmt: skip
    )
    print(f"\nrecord: {record}")
    if not args.no_plot and plot(summary, args.out_dir / f"detection-{stamp}.png", f"detection replay: {config}"):
        print(f"plot: {args.out_dir / f'detection-{stamp}.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
