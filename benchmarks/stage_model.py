"""How the measured predictor carries a stage's reading to layers it has not held: stretch against fixed cost.

The adaptive loop prices partitions that have not run from what the current one measured. A stage's compute per
micro-batch is rarely its layers' profile times one factor: the last stage also runs the loss and the loop's work
per micro-batch, every stage dispatches its micro-batches, and a stage with little work reads several times its
profile with nothing beside it. :class:`~lightning_dynpipe.predictor.MeasuredSlowdownPredictor` carries what a
stage reads over the pipeline's speed while it shows no sign of interference as a fixed cost per micro-batch that
stays with the stage (``fixed_costs=True``, the default), and stretches every layer by the whole reading with
``fixed_costs=False``.

This script runs every 2-stage cut of the interference benchmark's model fixed, without interference
(``benchmarks/interference.py --scenarios none --cut-scenarios none``), takes each cut's per-stage medians as the
window the loop would see (a quiet window: no sign of interference on either stage), asks both variants of the
predictor for every other cut, and compares each stage's predicted compute per micro-batch with what that cut
measured: the error per stage, the error of the slowest stage (what sets the step), and how often the two
variants order two cuts by their slowest stage as the measurements do.

Usage (from the repository root)::

    .venv/bin/python benchmarks/stage_model.py --model cnn                 # 4 cuts x 80 steps, ~1 min on 2 cores
    .venv/bin/python benchmarks/stage_model.py --model mlp --cut-steps 60  # the MLP 8x1024: 8 cuts, ~3 min
    .venv/bin/python benchmarks/stage_model.py --from-json benchmarks/out/interference-<stamp>.json

Outputs: the table on stdout, the interference record of the cut runs with this analysis added
(``benchmarks/out/interference-<stamp>.json``: config, machine, versions, command) and
``docs/img/stage_model_<model>.png`` (predicted against measured compute per micro-batch, both variants).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `benchmarks` and the package importable
    sys.path.insert(0, str(_ROOT))

from benchmarks._common import describe_machine, format_table, median, save_figure  # noqa: E402

_OUT = _ROOT / "benchmarks" / "out"
_IMG = _ROOT / "docs" / "img" / "stage_model_{model}.png"
VARIANTS = ("fixed cost", "stretch", "forest prior")
"""The ways of carrying a quiet stage's reading: ``MeasuredSlowdownPredictor(fixed_costs=True)`` and
``(fixed_costs=False)``, and an untrained ``ForestPredictor`` (its prior, priced in seconds)."""
SKIP_STEPS = 15
"""Steps at the start of each cut's run left out of its medians (start-up)."""


def cut_medians(runs: Sequence[dict[str, Any]], num_microbatches: int) -> dict[tuple[int, ...], dict[str, Any]]:
    """Per fixed cut run without interference: its balance and, per stage, the medians of forward + backward per
    micro-batch and of the step (seconds), over the steps after :data:`SKIP_STEPS`."""
    out: dict[tuple[int, ...], dict[str, Any]] = {}
    for r in runs:
        if not r["system"].startswith("cut") or r["scenario"] != "none":
            continue
        stages = r["steps"]
        balance = tuple(stages[0][0]["balance"])
        compute, step = [], []
        for steps in stages:
            kept = [s for s in steps if s["step"] > SKIP_STEPS and tuple(s["balance"]) == balance]
            compute.append(median([(s["forward_s"] + s["backward_s"]) / num_microbatches for s in kept]))
            step.append(median([s["step_s"] for s in kept]))
        out[balance] = {"compute_s": compute, "step_s": step}
    return out


def _profiles(cost: Any, balance: tuple[int, ...]) -> list[float]:
    """Each stage's layers' profiled forward + backward per micro-batch under ``balance`` (seconds)."""
    from lightning_dynpipe.plan.partition import Partition

    partition = Partition(balance)
    return [cost.compute_s(r.start, r.stop) for r in (partition.stage_layers(k) for k in range(len(balance)))]


def analyse(payload: dict[str, Any]) -> dict[str, Any]:
    """Every cut priced from every other cut's window by each variant, against its measurements."""
    from lightning_dynpipe.plan.costs import CommModel, ModelCost
    from lightning_dynpipe.plan.partition import Partition
    from lightning_dynpipe.predictor import (
        ForestPredictor,
        MeasuredSlowdownPredictor,
        PipelineWindow,
        StageTimes,
    )

    M = payload["config"]["num_microbatches"]
    lc = payload["layer_costs"]
    cost = ModelCost.from_arrays(lc["forward_s"], lc["backward_s"], activation_bytes=lc["activation_bytes"])
    cuts = cut_medians(payload["runs"], M)
    if len(cuts) < 2:
        raise SystemExit(
            "stage_model.py needs the fixed cuts run without interference (interference.py --scenarios none "
            f"--cut-scenarios none); the record has {len(cuts)}."
        )
    pairs = []
    for source, measured in cuts.items():
        # a quiet window: the cut ran without interference (readings without a sign on either stage)
        times = tuple(
            StageTimes(M * c, s, cpu_share=1.0, other_cpu_load=0.0)
            for c, s in zip(measured["compute_s"], measured["step_s"])
        )
        window = PipelineWindow(Partition(source), times, M)
        measured["profile_s"] = _profiles(cost, source)
        ratios = [c / p for c, p in zip(measured["compute_s"], measured["profile_s"])]
        speed = min(ratios)  # the predictors price at the least slowed stage's speed: seconds = value x speed
        predicted: dict[str, dict[tuple[int, ...], list[float]]] = {}
        for name in VARIANTS:
            predictor: MeasuredSlowdownPredictor | ForestPredictor
            if name == "forest prior":
                predictor, scale = ForestPredictor(), 1.0  # in seconds already
            else:
                predictor, scale = MeasuredSlowdownPredictor(fixed_costs=name == "fixed cost"), speed
            for _ in range(2):  # the loop gives the predictor every window; two of the same cut
                predictor.observe(cost, CommModel(), window)
            predicted[name] = {
                target: [
                    i.value * scale
                    for i in predictor.predict(cost, CommModel(), window, Partition(target)).stage_compute_s
                ]
                for target in cuts
            }
            if isinstance(predictor, ForestPredictor):
                predictor.close()  # its refit process, started by observe()
        for target, truth in cuts.items():
            if target == source:
                continue
            pairs.append(
                {
                    "source": list(source),
                    "target": list(target),
                    "measured_s": truth["compute_s"],
                    "predicted_s": {name: predicted[name][target] for name in VARIANTS},
                }
            )
    summary: dict[str, Any] = {}
    for name in VARIANTS:
        stage_err = [abs(p / m - 1) for x in pairs for p, m in zip(x["predicted_s"][name], x["measured_s"])]
        slowest_err = [abs(max(x["predicted_s"][name]) / max(x["measured_s"]) - 1) for x in pairs]
        agree = total = 0
        for source in cuts:
            mine = [x for x in pairs if tuple(x["source"]) == source]
            for i in range(len(mine)):
                for j in range(i + 1, len(mine)):
                    a, b = mine[i], mine[j]
                    total += 1
                    agree += (max(a["predicted_s"][name]) < max(b["predicted_s"][name])) == (
                        max(a["measured_s"]) < max(b["measured_s"])
                    )
        summary[name] = {
            "stage_error_median": median(stage_err),
            "stage_error_mean": sum(stage_err) / len(stage_err),
            "slowest_error_median": median(slowest_err),
            "slowest_error_max": max(slowest_err),
            "order_agrees": agree,
            "orders": total,
        }
    return {
        "cuts": {",".join(map(str, b)): v for b, v in cuts.items()},
        "pairs": pairs,
        "summary": summary,
    }


def render(result: dict[str, Any], *, markdown: bool = False) -> str:
    """The summary per variant, then the slowest stage of every priced cut."""
    rows = [
        [
            name,
            f"{s['stage_error_median'] * 100:.1f}%",
            f"{s['stage_error_mean'] * 100:.1f}%",
            f"{s['slowest_error_median'] * 100:.1f}%",
            f"{s['slowest_error_max'] * 100:.1f}%",
            f"{s['order_agrees']}/{s['orders']}",
        ]
        for name, s in result["summary"].items()
    ]
    head = format_table(
        [
            "variant",
            "stage error, median",
            "stage error, mean",
            "slowest stage error, median",
            "slowest stage error, max",
            "cuts ordered as measured",
        ],
        rows,
        markdown=markdown,
    )
    detail = [
        [
            str(x["source"]),
            str(x["target"]),
            f"{max(x['measured_s']) * 1e3:.2f}",
            *(f"{max(x['predicted_s'][name]) * 1e3:.2f}" for name in VARIANTS),
        ]
        for x in result["pairs"]
    ]
    body = format_table(
        ["window of", "priced", "slowest stage measured, ms", *(f"{n}, ms" for n in VARIANTS)],
        detail,
        markdown=markdown,
    )
    cuts = format_table(
        ["cut", "compute per micro-batch, ms", "profile, ms", "measured / profile"],
        [
            [
                f"[{b}]",
                " / ".join(f"{c * 1e3:.2f}" for c in v["compute_s"]),
                " / ".join(f"{p * 1e3:.2f}" for p in v["profile_s"]),
                " / ".join(f"{c / p:.2f}" for c, p in zip(v["compute_s"], v["profile_s"])),
            ]
            for b, v in result["cuts"].items()
        ],
        markdown=markdown,
    )
    return cuts + "\n\n" + head + "\n\n" + body


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for name, marker in zip(VARIANTS, ("o", "x", "+")):
        xs = [m * 1e3 for x in result["pairs"] for m in x["measured_s"]]
        ys = [p * 1e3 for x in result["pairs"] for p in x["predicted_s"][name]]
        ax.scatter(xs, ys, marker=marker, label=name, alpha=0.7)
    lo = min(m * 1e3 for x in result["pairs"] for m in x["measured_s"]) / 2
    hi = max(max(p) * 1e3 for x in result["pairs"] for p in x["predicted_s"].values()) * 1.2
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="exact")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured compute per micro-batch, ms")
    ax.set_ylabel("predicted from another cut's window, ms")
    ax.set_title(title, fontsize=9)
    ax.legend()
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
    p.add_argument("--cut-steps", type=int, default=80, help="steps each cut runs fixed")
    p.add_argument("--out-dir", type=Path, default=_OUT)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--from-json", type=Path, default=None, help="analyse a stored interference.py record")
    a = p.parse_args(argv)
    from benchmarks import interference  # torch and the runners: only to run or name the model

    if a.from_json is not None:
        json_path = a.from_json
    else:
        before = set(a.out_dir.glob("interference-*.json")) if a.out_dir.exists() else set()
        interference.main(
            [
                "--model",
                a.model,
                "--scenarios",
                "none",
                "--systems",
                "static",
                "--seeds",
                "1",
                "--max-steps",
                str(a.cut_steps),
                "--cut-scenarios",
                "none",
                "--cut-steps",
                str(a.cut_steps),
                "--no-plot",
                "--out-dir",
                str(a.out_dir),
            ]
        )
        json_path = max(set(a.out_dir.glob("interference-*.json")) - before, key=lambda q: q.stat().st_mtime)
    payload = json.loads(json_path.read_text(encoding="utf-8"))
    result = analyse(payload)
    cfg = payload["config"]
    model = interference._model_name(interference._config_from_json(cfg))
    print()
    print(describe_machine(payload["machine"]))
    print(
        f"{model}, batch {cfg['batch_size']}, M={cfg['num_microbatches']}: every 2-stage cut fixed for "
        f"{cfg['cut_steps']} steps without interference; each cut's window priced every other cut:"
    )
    print(render(result))
    payload["stage_model"] = result
    payload["stage_model_markdown"] = render(result, markdown=True)
    json_path.write_text(json.dumps(payload), encoding="utf-8")
    print(f"record: {json_path}")
    if not a.no_plot:
        img = Path(str(_IMG).format(model=cfg["model"]))
        plot(result, img, f"{model}: each cut priced from every other cut's window")
        print(f"plot: {img}")
    return result


if __name__ == "__main__":
    main()
