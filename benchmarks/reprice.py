"""Price a recorded run's checks again, offline: the same windows, another predictor, the same fixed cuts.

``benchmarks/interference.py`` keeps, for every check of an adaptive run, the window the controller saw (each stage's
readings), the partitions it priced with their predicted step times, and the controller's set-up (its profile,
link, schedule and micro-batches). Where the record also holds the 2-stage cuts run fixed under the same scenario
and seed (``quota50``, ``quota25``, ``delay``), its pricing table sets those prices against what the cuts measured
(:func:`benchmarks.interference.pricing_errors`). This script replays each adaptive run's windows, in order, through a
fresh :class:`~lightning_dynpipe.repartition.controller.AdaptiveController` with another predictor, and prints the
same table for the prices it gives: a change to a predictor is judged on a run's windows in seconds, not in a new
half-hour run.

What it cannot show: the windows are those the recorded run saw, whatever the replayed predictor would have
decided (a predictor that would have moved elsewhere would have measured other windows); the pricing is compared,
not the decisions.

**The table's noise floor** (``--cuts-from OTHER.json``): the truth each price is scored against is one run of each
cut, 60 steps in its own processes, and a second run of the same cut under the same scenario and seed measures
another time. The pseudo-predictor ``the cuts run again`` prices every partition of every check at what ``OTHER``'s run
of that cut measured (same scenario and seed; a check whose running partition ``OTHER`` did not run is left out). Its
errors are what a predictor that knew every cut's time exactly as one run measures it would score: a predictor's
error at or below that floor cannot be told from a perfect one's by this table.

Predictors (``--predictors``):

* ``measured``: :class:`~lightning_dynpipe.predictor.MeasuredSlowdownPredictor`, the default predictor;
* ``measured-nomsg``: the same with ``message_cpu=False`` (a limited stage's CPU not changed by the bytes at its
  boundaries);
* ``prior``: an untrained :class:`~lightning_dynpipe.predictor.ForestPredictor`, its analytic prior alone;
* ``forest``: a :class:`~lightning_dynpipe.predictor.ForestPredictor` learning from the replayed windows as it would
  in the run (refits in its refit process, each adopted ``adopt_after`` windows after it started);
* ``forest-cal``: the same, starting from the rows of the run's own set-up sweep, which ``interference.py`` saves
  beside its record for the calibrated forest systems (``forest_file``); the runs without such a file are skipped;
* ``forest-rel``, ``forest-cal-rel``: ``forest`` and ``forest-cal`` whose stage trees split only on
  :data:`~lightning_dynpipe.predictor.forest.RELATIVE_STAGE_FEATURES` (no column that names a layer set).

**Self-check.** Replaying a run with the predictor it ran with reproduces its recorded prices: exactly for
``measured``. A forest switches to a refit at the check the fit's ranks agreed on, which the record keeps per check
(``agreed_refit``); a record without it is replayed switching ``adopt_after`` windows after each refit started, so
the forest in use differs at some checks (on the CNN record of 2026-12-07 07:52, up to 21% on one partition's
price). For every replay of a run by its own predictor the script prints the largest relative difference between
the recorded and the replayed price of the same partition at the same check.

Usage (from the repository root)::

    .venv/bin/python benchmarks/reprice.py benchmarks/out/interference-<stamp>.json
    .venv/bin/python benchmarks/reprice.py RECORD.json --predictors measured,prior --systems forest
    .venv/bin/python benchmarks/reprice.py RECORD.json --cuts-from OTHER.json  # the noise floor

Outputs: the tables on stdout, ``benchmarks/out/reprice-<stamp>.json`` (machine, versions, commit, command, the
record replayed and its commit, the replayed prices) and ``benchmarks/out/reprice-<stamp>.png`` (predicted
against measured speed-up of every partition priced, per scenario and predictor).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `benchmarks` and the package importable
    sys.path.insert(0, str(_ROOT))

from benchmarks._common import command_line, describe_machine, machine_info, save_figure  # noqa: E402
from benchmarks.interference import LEARNING_ONLINE, cut_steps, pricing_errors, render_pricing  # noqa: E402
from lightning_dynpipe.plan.costs import CommModel, LayerCost, ModelCost  # noqa: E402
from lightning_dynpipe.plan.partition import Partition  # noqa: E402
from lightning_dynpipe.predictor import ForestPredictor, MeasuredSlowdownPredictor, StageTimes  # noqa: E402
from lightning_dynpipe.predictor.forest import RELATIVE_STAGE_FEATURES  # noqa: E402
from lightning_dynpipe.repartition.controller import AdaptiveController  # noqa: E402
from lightning_dynpipe.repartition.policy import Decision, PolicyInputs  # noqa: E402

_OUT = _ROOT / "benchmarks" / "out"


def _prior(run: dict[str, Any]) -> ForestPredictor:
    """A forest that never fits (so never starts a refit process): its prior is its answer."""
    forest = ForestPredictor(min_samples=1 << 30)
    forest.refit_in_process = False
    return forest


def _calibrated(run: dict[str, Any], **options: Any) -> ForestPredictor | None:
    """The run's own calibrated forest, from the rows its set-up sweep gave (``None`` for a run without one)."""
    path = run.get("forest_file")
    return ForestPredictor.load(path, **options) if path and Path(path).exists() else None


PREDICTORS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "measured": lambda run: MeasuredSlowdownPredictor(),
    "measured-nomsg": lambda run: MeasuredSlowdownPredictor(message_cpu=False),
    "prior": _prior,
    "forest": lambda run: ForestPredictor(),
    "forest-cal": _calibrated,
    "forest-rel": lambda run: ForestPredictor(stage_features=RELATIVE_STAGE_FEATURES),
    "forest-cal-rel": lambda run: _calibrated(run, stage_features=RELATIVE_STAGE_FEATURES),
}
"""What ``--predictors`` names: a fresh predictor for a replayed run, ``None`` where it does not apply to the run
(``forest-cal`` replays only the runs whose set-up sweep's rows the record kept: ``forest_file``)."""

_OWN = {
    "measured": ("measured",),
    "measured-nomsg": ("measured-nomsg",),
    "forest": LEARNING_ONLINE,
    "forest-cal": ("forest-cal", "forest-cal-gain5"),
}
"""The recorded systems each predictor is the predictor of (its replay of their runs is the self-check)."""


class _Keep:
    """A policy that never moves: the replay records what the controller priced, not what it would decide."""

    def decide(self, inputs: PolicyInputs) -> Decision:
        return Decision(False, inputs.current, 0.0, "replay", inputs)

    def migrated(self, step: int) -> None:
        pass


def controller_for(setup: dict[str, Any], predictor: Any, cpu_s_per_byte: float | None = None) -> AdaptiveController:
    """A fresh controller priced as the recorded one was (its profile, link, schedule, micro-batches, replicas);
    ``cpu_s_per_byte``: the link's CPU per message byte instead of the recorded one (a record from before the probe
    measured it has none)."""
    comm = CommModel(**setup["comm"])
    if cpu_s_per_byte is not None:
        comm = dataclasses.replace(comm, cpu_s_per_byte=cpu_s_per_byte)
    return AdaptiveController(
        _Keep(),
        model_cost=ModelCost(tuple(LayerCost(**layer) for layer in setup["layers"])),
        comm=comm,
        schedule=setup["schedule"],
        num_microbatches=int(setup["num_microbatches"]),
        replicas=int(setup["replicas"]),
        predictor=predictor,
        max_shift=int(setup["max_shift"]),
        consider_stage_counts=False,
    )


def replay(run: dict[str, Any], predictor: Any, cpu_s_per_byte: float | None = None) -> list[dict[str, Any]]:
    """Every check of ``run`` priced again by ``predictor``: per check, ``{"step", "priced"}`` shaped as the record's
    (the running partition first); ``cpu_s_per_byte``: see :func:`controller_for`."""
    controller = controller_for(run["setup"], predictor, cpu_s_per_byte)
    fields = set(StageTimes.__dataclass_fields__)
    out = []
    try:
        for d in run["decisions"]:
            if not d.get("priced") or not d.get("stages"):
                continue
            times = [StageTimes(**{k: v for k, v in s.items() if k in fields}) for s in d["stages"]]
            partition = Partition(tuple(d["priced"][0]["partition"]))  # the partition the window measured
            # the refit the fit's ranks had agreed on, where the record has it: the replayed forest switches when
            # the fit's did (without it, adopt_after windows after each refit started)
            agreed = d.get("agreed_refit")
            decision = controller.check(int(d["step"]), times, partition, remaining_steps=None, agreed_refit=agreed)
            if decision is None:
                continue
            out.append(
                {
                    "step": d["step"],
                    "priced": [
                        {"partition": list(p.partition.balance), "step_s": p.step_s, "step_high_s": p.step_high_s}
                        for p in decision.inputs.priced
                    ],
                }
            )
    finally:
        close = getattr(predictor, "close", None)
        if callable(close):
            close()
    return out


def priced_by_cuts(
    run: dict[str, Any], cuts: dict[tuple[str, int], dict[tuple[int, ...], float]]
) -> list[dict[str, Any]] | None:
    """Every check of ``run`` with each partition priced at what ``cuts`` (another record's
    :func:`~benchmarks.interference.cut_steps`) measured for it under the run's scenario and seed, shaped as
    :func:`replay`'s; the partitions those cuts lack are left out, and so is a check whose running partition they
    lack. ``None`` where they hold nothing of the run's scenario and seed."""
    known = cuts.get((run["scenario"], run["seed"]))
    if not known:
        return None
    out = []
    for d in run["decisions"]:
        priced = d.get("priced") or []
        if not priced or tuple(priced[0]["partition"]) not in known:
            continue
        out.append(
            {
                "step": d["step"],
                "priced": [
                    {"partition": list(p["partition"]), "step_s": s, "step_high_s": s}
                    for p in priced
                    if (s := known.get(tuple(p["partition"]))) is not None
                ],
            }
        )
    return out


def self_check(recorded: Sequence[dict[str, Any]], replayed: Sequence[dict[str, Any]]) -> float:
    """The largest relative difference between a recorded and a replayed price of the same partition at the same
    check (``nan`` where no partition is in both)."""
    by_step = {d["step"]: {tuple(p["partition"]): p["step_s"] for p in d["priced"]} for d in replayed}
    worst = math.nan
    for d in recorded:
        again = by_step.get(d["step"], {})
        for p in d.get("priced") or []:
            other = again.get(tuple(p["partition"]))
            if other is not None and p["step_s"] > 0:
                diff = abs(other / p["step_s"] - 1.0)
                worst = diff if math.isnan(worst) else max(worst, diff)
    return worst


def replayable(runs: Sequence[dict[str, Any]], systems: Sequence[str] | None) -> list[dict[str, Any]]:
    """The adaptive runs with checks, a controller set-up and fixed cuts of the same scenario and seed."""
    cuts = cut_steps(runs)
    return [
        r
        for r in runs
        if not r["system"].startswith("cut")
        and r.get("decisions")
        and r.get("setup")
        and (r["scenario"], r["seed"]) in cuts
        and (systems is None or r["system"] in systems)
    ]


def speedups(runs: Sequence[dict[str, Any]]) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """Per scenario and (pseudo-)system: ``(measured, predicted)`` speed-up over the running partition of every
    partition priced that ran as a fixed cut (the pairs :func:`~benchmarks.interference.pricing_errors` scores)."""
    cut_s = cut_steps(runs)
    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in runs:
        measured = cut_s.get((r["scenario"], r["seed"]))
        if not measured or r["system"].startswith("cut"):
            continue
        for d in r.get("decisions") or []:
            priced = d.get("priced") or []
            if not priced or tuple(priced[0]["partition"]) not in measured or not priced[0]["step_s"] > 0:
                continue
            here = tuple(priced[0]["partition"])
            for p in priced[1:]:
                cut = tuple(p["partition"])
                if cut in measured:
                    pair = (measured[here] / measured[cut], priced[0]["step_s"] / p["step_s"])
                    out.setdefault((r["scenario"], r["system"]), []).append(pair)
    return out


def plot(recorded: Sequence[dict[str, Any]], replayed: Sequence[dict[str, Any]], path: Path) -> None:
    """Priced against measured speed-up per scenario: one colour per replayed predictor (all the runs it replayed
    together), and the recorded prices per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for runs, name in ((recorded, lambda s: f"recorded: {s}"), (replayed, lambda s: s.split(" (")[0])):
        for (scenario, system), xy in speedups(runs).items():
            groups.setdefault((scenario, name(system)), []).extend(xy)
    scenarios = sorted({s for s, _ in groups})
    labels = sorted({label for _, label in groups})
    colours = {label: plt.get_cmap("tab10")(i % 10) for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, max(1, len(scenarios)), figsize=(4.2 * max(1, len(scenarios)), 4.0), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        for label in labels:
            xy = groups.get((scenario, label))
            if xy:
                ax.scatter([x for x, _ in xy], [y for _, y in xy], s=10, alpha=0.5, color=colours[label], label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_minor_formatter(NullFormatter())
        lo, hi = ax.get_xlim()
        ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8)
        ax.set_title(scenario)
        ax.set_xlabel("measured speed-up (fixed cuts)")
        ax.set_ylabel("priced speed-up")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("record", type=Path, help="an interference.py result file (benchmarks/out/interference-*.json)")
    parser.add_argument(
        "--predictors", default="measured,prior,forest", help=f"comma-separated, of {', '.join(PREDICTORS)}"
    )
    parser.add_argument("--systems", default=None, help="replay only these recorded systems' runs (comma-separated)")
    parser.add_argument("--out", type=Path, default=_OUT, help="folder of the result file and the plot")
    parser.add_argument(
        "--cpu-ns-per-byte",
        type=float,
        default=None,
        help="price with this CPU per message byte (ns) instead of the link's recorded cpu_s_per_byte (records from "
        "before the probe measured it have 0)",
    )
    parser.add_argument(
        "--cuts-from",
        type=Path,
        default=None,
        help="another interference.py result file with the same scenarios' cuts: also price every check at what its "
        "runs of the cuts measured (the pseudo-predictor 'the cuts run again': the table's noise floor)",
    )
    args = parser.parse_args(argv)
    names = [n for n in args.predictors.split(",") if n]
    unknown = [n for n in names if n not in PREDICTORS]
    if unknown:
        parser.error(f"unknown predictors {unknown}; choose from {sorted(PREDICTORS)}")
    record = json.loads(args.record.read_text(encoding="utf-8"))
    runs = record["runs"]
    systems = args.systems.split(",") if args.systems else None
    todo = replayable(runs, systems)
    machine = machine_info()
    print(describe_machine(machine))
    print(
        f"code: commit {(machine['git_commit'] or 'unknown')[:10]}; record: {args.record} (commit "
        f"{(record.get('machine', {}).get('git_commit') or 'unknown')[:10]})"
    )
    print(f"command: {command_line()}")
    if not todo:
        print(
            "No run to replay: the record needs adaptive runs with their checks and controller set-up (written by "
            "interference.py since it keeps them) and the fixed cuts of the same scenarios and seeds."
        )
        return {}
    t0 = time.perf_counter()
    pseudo: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    for run in todo:
        for name in names:
            predictor = PREDICTORS[name](run)
            if predictor is None:
                continue
            again = replay(run, predictor, None if args.cpu_ns_per_byte is None else args.cpu_ns_per_byte * 1e-9)
            label = f"{name} ({run['system']} run)"
            pseudo.append({**run, "system": label, "decisions": again})
            if run["system"] in _OWN.get(name, ()):
                checks.append(
                    {
                        "system": run["system"],
                        "scenario": run["scenario"],
                        "seed": run["seed"],
                        "max_rel_diff": self_check(run["decisions"], again),
                    }
                )
    if args.cuts_from is not None:
        again_cuts = cut_steps(json.loads(args.cuts_from.read_text(encoding="utf-8"))["runs"])
        for run in todo:
            priced = priced_by_cuts(run, again_cuts)
            if priced is not None:
                pseudo.append({**run, "system": f"the cuts run again ({run['system']} run)", "decisions": priced})
    cuts = [r for r in runs if r["system"].startswith("cut")]
    print(f"\nReplayed {len(todo)} runs x {len(names)} predictors in {time.perf_counter() - t0:.1f} s.\n")
    print("As recorded:")
    print(render_pricing([*todo, *cuts]))
    print("\nPriced again on the same windows:")
    print(render_pricing([*pseudo, *cuts]))
    if checks:
        print("\nSelf-check (a run replayed by its own predictor), largest relative price difference:")
        for c in checks:
            print(f"  {c['scenario']:<8} {c['system']:<9} seed {c['seed']}: {c['max_rel_diff'] * 100:.3g}%")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": machine,
        "command": command_line(),
        "record": str(args.record),
        "record_commit": record.get("machine", {}).get("git_commit"),
        "cuts_from": None if args.cuts_from is None else str(args.cuts_from),
        "cpu_ns_per_byte": args.cpu_ns_per_byte,
        "predictors": names,
        "self_check": checks,
        "pricing": {f"{s}|{p}": e for (s, p), e in pricing_errors([*pseudo, *cuts]).items()},
        "recorded_pricing": {f"{s}|{p}": e for (s, p), e in pricing_errors([*todo, *cuts]).items()},
        "replayed": [
            {"system": r["system"], "scenario": r["scenario"], "seed": r["seed"], "decisions": r["decisions"]}
            for r in pseudo
        ],
        "markdown": {"pricing": render_pricing([*pseudo, *cuts], markdown=True)},
    }
    path = args.out / f"reprice-{stamp}.json"
    path.write_text(json.dumps(result), encoding="utf-8")
    plot([*todo, *cuts], [*pseudo, *cuts], args.out / f"reprice-{stamp}.png")
    print(f"\nwrote {path} and {path.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
