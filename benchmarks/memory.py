"""Peak memory per process of a model whose parameters dominate: the default paths against the sharded options.

The model is ``L`` x ``Linear(D, D)`` trained with Adam under ``schedule="sync"`` (parameters, gradients and
Adam's two moments: four times the parameters' bytes per stage, activations negligible), on ``S`` CPU processes
through Lightning's popen launcher. Two settings:

* ``default``: the model built eagerly in every process, ``checkpoint="full"``, ``gather_after_fit=True``;
* ``sharded``: built under ``trainer.init_module(empty_init=True)`` (on meta, each stage materialising its own
  layers), ``checkpoint="sharded"``, ``gather_after_fit=False``;
* ``plain``: the reference, no DynPipe: one process trains only one stage's layers (``L / S`` of them) with the
  same optimizer under Lightning's default single-device strategy, the same micro-batches as gradient
  accumulation (``accumulate_grad_batches=M``), and saves one plain checkpoint. What a process needs to train a
  stage's layers at all, temporaries of the user's optimizer included.

Per process, the peak resident memory (Linux ``VmHWM``, reset between phases through ``/proc/self/clear_refs``)
above the process's resident memory before the model is built, in four phases: set-up (building the model to
the first step), training (the steps), checkpoint (one ``trainer.save_checkpoint``) and end of fit (teardown);
in the sharded setting also *resumed*: the same processes build the model on meta again and resume that
checkpoint under another partition of as many stages (one layer moved from the first stage to the last), from
building the model to the first step, against the new stage's share (``--no-resume`` skips it).
The stage's share is four times its layers' parameter bytes; each phase is also compared with the same phase of
the ``plain`` run of as many layers. ``--adam`` passes ``foreach=True``, ``foreach=False`` or ``fused=True`` to
``torch.optim.Adam`` (default: none, PyTorch's choice, which on CPU is the single-tensor loop). The workers run with
``MALLOC_MMAP_THRESHOLD_=1048576``, so that glibc returns every freed block of 1 MiB or more to the system and
the resident set follows the live tensors; what it still keeps makes a phase's number an upper bound.

Usage (from the repository root)::

    .venv/bin/python benchmarks/memory.py                  # S=2 and S=4, D=2048, all settings (a few minutes)
    .venv/bin/python benchmarks/memory.py --dim 4096       # the issue's size (about ten minutes on 2 CPUs)
    .venv/bin/python benchmarks/memory.py --settings plain --stages 2 --adam fused   # one optimizer variant
    .venv/bin/python benchmarks/memory.py --quick          # smoke run: S=2, D=256, sharded only, no resume

Outputs: the table on stdout, ``benchmarks/out/memory-<stamp>.json`` (config, machine, versions, command, every
measurement) and ``docs/img/memory.png`` (``--quick``: under ``--out-dir``). ``--from-json <record>`` prints the
table and draws the plot of a stored record without measuring.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `benchmarks` and the package importable
    sys.path.insert(0, str(_ROOT))

from benchmarks._common import REPO_ROOT, command_line, describe_machine, format_table, machine_info  # noqa: E402

PHASES = ("setup", "train", "checkpoint", "end")
SETTINGS = ("default", "sharded", "plain")
ADAM: dict[str, dict[str, bool]] = {
    "default": {},
    "foreach": {"foreach": True},
    "single": {"foreach": False},
    "fused": {"fused": True},
}
_LAUNCH_ENV = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (this benchmark needs Linux)")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def _worker(cfg: dict[str, Any]) -> None:
    """One rank of one run (Lightning's popen launcher re-runs this command line for the other ranks)."""
    import lightning.pytorch as L
    import torch
    from torch import nn

    from lightning_dynpipe import DynPipeStrategy
    from lightning_dynpipe.engine.shard import Placeholder

    S, D, sharded, plain = cfg["stages"], cfg["dim"], cfg["setting"] == "sharded", cfg["setting"] == "plain"
    M = 2  # micro-batches per batch of 8 (plain: gradient accumulation over batches of 4)
    layers = cfg["layers"] // S if plain else cfg["layers"]
    adam_kwargs = ADAM[cfg.get("adam", "default")]

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.pipeline = nn.Sequential(*(nn.Linear(D, D) for _ in range(layers)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.pipeline(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4, **adam_kwargs)

    marks: dict[str, int] = {}

    class Phases(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            marks["setup"] = _status_kib("VmHWM")
            _reset_peak()

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            marks["train"] = _status_kib("VmHWM")
            _reset_peak()
            trainer.save_checkpoint(cfg["ckpt"])
            marks["checkpoint"] = _status_kib("VmHWM")
            _reset_peak()

    strategy: Any = "auto"
    if not plain:
        strategy = DynPipeStrategy(
            num_stages=S,
            num_microbatches=M,
            schedule="sync",
            balance=[layers // S] * S,
            adaptive=False,
            monitor_every_n_steps=None,
            checkpoint="sharded" if sharded else "full",
            gather_after_fit=not sharded,
        )

    def make_trainer(strategy: Any, max_steps: int, callback: L.Callback) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu",
            devices=1 if plain else S,
            strategy=strategy,
            accumulate_grad_batches=M if plain else 1,
            max_steps=max_steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            use_distributed_sampler=False,
            callbacks=[callback],
        )

    trainer = make_trainer(strategy, cfg["steps"], Phases())
    data = torch.utils.data.TensorDataset(torch.randn(8 * cfg["steps"], D))
    baseline = _status_kib("VmRSS")
    _reset_peak()
    if sharded:
        with trainer.init_module(empty_init=True):
            model = Net()
    else:
        model = Net()
    loader = torch.utils.data.DataLoader(data, batch_size=4 if plain else 8)
    trainer.fit(model, loader)
    marks["end"] = _status_kib("VmHWM")
    rank = trainer.global_rank
    stage = (rank + S - 1) % S  # stage k runs on rank (k + 1) % S
    layer_bytes = 4 * (D * D + D)
    own = [i for i, m in enumerate(model.pipeline) if not isinstance(m, Placeholder)]
    record = {
        "rank": rank,
        "stage": None if plain else stage,
        "baseline_kib": baseline,
        "peak_kib": marks,
        "share_bytes": 4 * layer_bytes * (cfg["layers"] // S),
        "layers_held_after_fit": len(own),
    }
    if sharded and cfg.get("resume"):
        # The checkpoint just written, read under another partition of as many stages, by a model built on meta:
        # from building the model to the first step (materialisation, then each stage reads its own entries).
        other = resume_balance(cfg["layers"], S)
        del model, trainer, strategy, own
        gc.collect()
        restored: dict[str, int] = {}

        class Restored(L.Callback):
            def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
                restored["peak"] = _status_kib("VmHWM")

        again = DynPipeStrategy(
            num_stages=S,
            num_microbatches=M,
            schedule="sync",
            balance=other,
            adaptive=False,
            monitor_every_n_steps=None,
            checkpoint="sharded",
            gather_after_fit=False,
        )
        trainer = make_trainer(again, cfg["steps"] + 1, Restored())
        base = _status_kib("VmRSS")
        _reset_peak()
        with trainer.init_module(empty_init=True):
            model = Net()
        trainer.fit(model, loader, ckpt_path=cfg["ckpt"])
        assert trainer.global_step == cfg["steps"] + 1
        share = 4 * layer_bytes * other[stage]
        record["resume"] = {"balance": other, "baseline_kib": base, "peak_kib": restored["peak"], "share_bytes": share}
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(record))


def resume_balance(layers: int, stages: int) -> list[int]:
    """The partition the sharded checkpoint is resumed under: one layer moved from the first stage to the last."""
    even = [layers // stages] * stages
    if stages > 1 and even[0] > 1:
        even[0] -= 1
        even[-1] += 1
    return even


def _run(
    setting: str, stages: int, dim: int, layers: int, steps: int, adam: str, resume: bool, work: Path
) -> list[dict[str, Any]]:
    out = work / f"{setting}-S{stages}"
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"setting": setting, "stages": stages, "dim": dim, "layers": layers, "steps": steps, "adam": adam}
    cfg["resume"] = resume
    cfg.update(out=str(out), ckpt=str(out / "last.ckpt"))
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    env["OMP_NUM_THREADS"] = "1"
    # glibc keeps freed blocks below its (self-raising) mmap threshold in the heap, so the resident set would keep
    # every tensor ever freed; from 1 MiB up, a block is mapped on its own and returned when freed.
    env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cfg)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{setting} S={stages} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    ckpt = Path(cfg["ckpt"])  # measured; at the size it is gigabytes
    if ckpt.is_dir():
        shutil.rmtree(ckpt)
    else:
        ckpt.unlink(missing_ok=True)
    return sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke run: S=2, D=256, the sharded setting, no resume")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--no-resume", action="store_true", help="sharded: do not resume under another partition")
    parser.add_argument("--adam", default="default", choices=sorted(ADAM), help="Adam's implementation (see above)")
    parser.add_argument("--dim", type=int, default=2048, help="D of each Linear(D, D) (default 2048)")
    parser.add_argument("--layers", type=int, default=8, help="number of layers (default 8)")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="values of S (default 2 4)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "benchmarks" / "out"), help="where the JSON goes")
    parser.add_argument("--from-json", help="print the table and draw the plot of a stored record, without measuring")
    parser.add_argument("--plot", help="where the plot goes (default docs/img/memory.png; --quick: under --out-dir)")
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    default_plot = REPO_ROOT / "docs" / "img" / "memory.png"
    if args.from_json:
        report(json.loads(Path(args.from_json).read_text()), Path(args.plot) if args.plot else default_plot)
        return
    if args.quick:
        args.dim, args.stages, args.steps, args.settings, args.no_resume = 256, [2], 2, ["sharded"], True
    machine = machine_info()
    work = Path(args.out_dir) / f"memory-work-{time.strftime('%Y%m%d-%H%M%S')}"
    runs: list[dict[str, Any]] = []
    for stages in args.stages:
        for setting in args.settings:
            t0 = time.perf_counter()
            for r in _run(setting, stages, args.dim, args.layers, args.steps, args.adam, not args.no_resume, work):
                runs.append({"setting": setting, "stages": stages, **r})
            print(f"# {setting} S={stages}: {time.perf_counter() - t0:.0f} s", flush=True)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    record = Path(args.out_dir) / f"memory-{time.strftime('%Y%m%d-%H%M%S')}.json"
    config = {"dim": args.dim, "layers": args.layers, "stages": args.stages, "steps": args.steps}
    config["settings"], config["adam"], config["resume"] = args.settings, args.adam, not args.no_resume
    data = {"config": config, "machine": machine, "command": command_line(), "runs": runs}
    record.write_text(json.dumps(data))
    plot = Path(args.plot) if args.plot else Path(args.out_dir) / "memory.png" if args.quick else default_plot
    report(data, plot)
    print(f"wrote {record}")


def report(data: dict[str, Any], plot: Path | None) -> None:
    """Prints the table of a record (what :func:`main` measured, or a stored JSON) and draws the plot."""
    cfg, runs = data["config"], data["runs"]
    runs = sorted(runs, key=lambda r: (r["stages"], SETTINGS.index(r["setting"]), r["stage"] or 0))
    plain = {r["stages"]: r for r in runs if r["setting"] == "plain"}

    def above(r: dict[str, Any], phase: str) -> float:
        return (r["peak_kib"][phase] - r["baseline_kib"]) / 1024.0

    rows, against = [], []
    for r in runs:
        share = r["share_bytes"] / 2**20
        stage = "-" if r["stage"] is None else str(r["stage"])
        cells = [f"{r['setting']} S={r['stages']}", stage, f"{share:.0f}"]
        cells += [f"{above(r, phase):.0f} ({above(r, phase) / share:.2f}x)" for phase in PHASES]
        res = r.get("resume")
        if res is not None:
            mib, res_share = (res["peak_kib"] - res["baseline_kib"]) / 1024.0, res["share_bytes"] / 2**20
            resumed = f"{mib:.0f} ({mib / res_share:.2f}x of {res_share:.0f})"
        else:
            resumed = "-"
        rows.append([*cells, str(r["layers_held_after_fit"]), resumed])
        ref = plain.get(r["stages"])
        if ref is not None and r is not ref:
            against.append([cells[0], stage, *(f"{above(r, p) / above(ref, p):.2f}x" for p in PHASES)])
    headers = ["run", "stage", "share MiB", *(f"{p} MiB (x share)" for p in PHASES), "layers after fit"]
    headers.append("resumed MiB (x new share)")
    print(describe_machine(data["machine"]))
    adam = cfg.get("adam", "default")
    print(
        f"model: {cfg['layers']} x Linear({cfg['dim']}, {cfg['dim']}), Adam ({adam}), schedule=sync, "
        f"{cfg['steps']} steps; plain = one process training one stage's layers alone"
    )
    print(format_table(headers, rows))
    balances = sorted({(r["stages"], str(r["resume"]["balance"])) for r in runs if r.get("resume")})
    if balances:
        print("resumed: the sharded checkpoint read under " + ", ".join(f"{b} (S={n})" for n, b in balances))
    if against:
        print("\neach phase over the same phase of the plain run of the stage's layers (same S):")
        print(format_table(["run", "stage", *PHASES], against))
    if plot is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["setting"], r["stages"]) for r in runs}, key=lambda g: (g[1], SETTINGS.index(g[0])))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(groups))
    for j, (setting, stages) in enumerate(groups):
        mine = [r for r in runs if (r["setting"], r["stages"]) == (setting, stages)]
        worst = [max((r["peak_kib"][p] - r["baseline_kib"]) * 1024.0 / r["share_bytes"] for r in mine) for p in PHASES]
        ax.bar([i + j * width for i in range(len(PHASES))], worst, width, label=f"{setting}, S={stages}")
    ax.axhline(1.1, color="k", lw=0.8, ls="--", label="1.10x the stage's share")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(PHASES))], list(PHASES))
    ax.set_ylabel("peak above start / stage's share (worst process)")
    ax.set_title(f"{cfg['layers']} x Linear({cfg['dim']}, {cfg['dim']}), Adam")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(plot, dpi=120)
    print(f"wrote {plot}")


if __name__ == "__main__":
    main()
