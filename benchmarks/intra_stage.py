"""Intra-stage balance: time to accuracy of 2 pipeline replicas when one of them runs at half speed.

Two processes, each pinned to its own core, train one MLP as 2 data-parallel replicas of a 1-stage pipeline
(``DynPipeStrategy(num_stages=1, devices=2)``, ``schedule="sync"``), so every step all-reduces the gradients
and the slower replica sets the pace of both. Systems:

``even``    ``replica_split="even"``: each global batch split in halves
``speed``   ``replica_split="speed"``: the escalation ladder re-splits by the replicas' measured speeds
``fixed-w`` ``replica_split=[w, 1 - w]`` from the first step (with interference only): the best of these is the
            **measured limit**, what a split known in advance achieves

Scenarios:

``quota50`` a CPU quota of 50% of one core on replica 1's process, the whole run (cgroup, else a SIGSTOP
            throttle; :class:`~lightning_dynpipe.interference.quota.CpuLimit`)
``none``    no interference: the speed-weighted split must change nothing

Both systems train on the same global batches in the same order (every replica draws the same global batch and
loads only its share; only the cut between the shares differs), and a sync update equals plain training's on the
global batch, so both reach accuracy at the same step: the time to accuracy (TTA) differs only by the time per
step. The **limit** is the best a split can do with the replicas' measured speeds ``s0 >= s1`` (samples per second
of compute, from the even run): ``(s0 + s1) / (2 * s1)``, which assumes a replica's time is proportional to its
share; the **quota limit** is the same for a replica at exactly the quota's speed, 1.5x at 50%. Neither holds when
a step has work that no split moves: the gradient all-reduce and the update, the framework's per-step and per-
micro-batch work, all of it slowed on the throttled replica. The **measured limit** (even TTA over the best fixed
split's) is what is left with them. The workload (global batch 1024) is one where the split-able forward and
backward are most of the step; the smaller the global batch, the more of the step is work no split moves
(``--global-batch`` measures another).

Usage (from the repository root)::

    .venv/bin/python benchmarks/intra_stage.py                     # full: 2 seeds, 250 steps, target 0.92
    .venv/bin/python benchmarks/intra_stage.py --quick             # smoke run: quota50, 1 seed, 30 steps, tiny MLP
    .venv/bin/python benchmarks/intra_stage.py --from-json benchmarks/out/intra-stage-<stamp>.json

Outputs: the table on stdout, ``benchmarks/out/intra-stage-<stamp>.json`` (config, machine, versions, commit,
command, every run's evaluations), ``docs/img/intra_stage.png`` and the dated report
``benchmarks/results/<date>-intra-stage.md`` (``--quick`` or an explicit ``--out-dir`` write all of them there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `benchmarks` and the package importable
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._common import (  # noqa: E402
    REPO_ROOT,
    close_group,
    command_line,
    describe_machine,
    external_launch_env,
    format_table,
    free_port,
    machine_info,
    median,
    rotated,
    workers_done,
)

WORLD_SIZE = 2
SYSTEMS: tuple[str, ...] = ("even", "speed")  # plus "fixed-<w>" under interference
SCENARIOS: tuple[str, ...] = ("quota50", "none")
_IMG = REPO_ROOT / "docs" / "img"
_RESULTS = REPO_ROOT / "benchmarks" / "results"
_OUT = REPO_ROOT / "benchmarks" / "out"


@dataclass(frozen=True)
class Config:
    """One measurement's settings (recorded in the JSON)."""

    scenarios: tuple[str, ...] = SCENARIOS
    seeds: int = 2
    max_steps: int = 250
    global_batch: int = 1024
    num_microbatches: int = 4
    width: int = 512
    depth: int = 3
    target_acc: float = 0.92
    fixed_splits: tuple[float, ...] = (0.7, 0.8, 0.9, 0.95)  # replica 0's share in the fixed-split runs
    eval_every: int = 10
    monitor_every: int = 10
    quota: float = 0.5
    lr: float = 0.05


QUICK = Config(scenarios=("quota50",), seeds=1, max_steps=30, global_batch=64, width=64, depth=2, target_acc=0.25,
               eval_every=10, monitor_every=5, fixed_splits=(0.7,))  # fmt: skip


def systems(cfg: Config, scenario: str) -> list[str]:
    """The systems measured under ``scenario``: the fixed splits only where there is interference to split by."""
    fixed = [fixed_name(w) for w in cfg.fixed_splits] if scenario != "none" else []
    return [*SYSTEMS, *fixed]


def fixed_name(w0: float) -> str:
    return f"fixed-{w0:.2f}"


def _data(cfg: Config, seed: int) -> tuple[torch.utils.data.TensorDataset, tuple[torch.Tensor, torch.Tensor]]:
    """Gaussian inputs labelled by a fixed random linear teacher (10 classes): no download. The MLP plateaus near
    90% validation accuracy on it (one draw of the task, plain training, 256 per batch: 0.84 after 100 steps,
    0.90 after 200; 1024 per batch, lr 0.05: 0.92 after 140-170 steps, plateau 0.94-0.95)."""
    g = torch.Generator().manual_seed(1000 + seed)
    teacher = torch.randn(32, 10, generator=g)
    n = cfg.max_steps * cfg.global_batch

    def label(x: torch.Tensor) -> torch.Tensor:
        return (x @ teacher).argmax(1)

    x = torch.randn(n, 32, generator=g)
    xv = torch.randn(2048, 32, generator=g)
    return torch.utils.data.TensorDataset(x, label(x)), (xv, label(xv))


def _model(cfg: Config, seed: int) -> Any:
    import lightning.pytorch as L

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            layers: list[nn.Module] = [nn.Linear(32, cfg.width), nn.ReLU()]
            for _ in range(cfg.depth - 1):
                layers += [nn.Linear(cfg.width, cfg.width), nn.ReLU()]
            self.pipeline = nn.Sequential(*layers, nn.Linear(cfg.width, 10))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.pipeline(x), y)  # the mean over the micro-batch

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=cfg.lr, momentum=0.9)

    return MLP()


def _recorder(cfg: Config, scenario: str, val: tuple[torch.Tensor, torch.Tensor]) -> Any:
    """Clocks training (evaluation excluded), evaluates on rank 0, and holds the quota on replica 1."""
    from lightning.pytorch import Callback

    from lightning_dynpipe.interference.quota import CpuLimit

    class Recorder(Callback):
        def __init__(self) -> None:
            self.evals: list[dict[str, float]] = []
            self.train_s = 0.0
            self.compute_s: list[float] = []
            self.shares: list[int] = []
            self.limit: Any = None
            self.backend = ""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if scenario == "quota50" and trainer.strategy.dp_rank == 1:
                # a short period spreads the throttling over every step instead of stalling one step in ten
                self.limit = CpuLimit(pid=0, fraction=cfg.quota, period_s=0.01)
                self.limit.start()
                self.backend = str(getattr(self.limit, "backend", ""))
            dist.barrier()
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            s = trainer.strategy
            stats = s.executor.stats
            self.compute_s.append(stats.forward_s + stats.backward_s)
            self.shares.append(s.replica_shares[s.dp_rank])
            step = trainer.global_step
            if step % cfg.eval_every == 0 or step == cfg.max_steps:
                self.train_s += time.perf_counter() - self._t
                if trainer.global_rank == 0:
                    with torch.no_grad():  # one stage holds every layer: call them past the pipeline's routing
                        out = nn.Sequential.forward(pl_module.pipeline, val[0])
                        acc = float((out.argmax(1) == val[1]).float().mean())
                    split = s.replica_split
                    self.evals.append({"step": step, "train_s": self.train_s, "acc": acc,
                                       "w0": split.weights[0] if split is not None else float("nan")})  # fmt: skip
                self._t = time.perf_counter()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if self.limit is not None:
                self.limit.stop()

    return Recorder()


def _run(system: str, scenario: str, cfg: Config, seed: int) -> dict[str, Any]:
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from lightning_dynpipe import DynPipeStrategy

    os.environ["PL_GLOBAL_SEED"] = str(seed)  # the sampler's seed: the same global batches on both replicas
    data, val = _data(cfg, seed)
    model = _model(cfg, seed)
    rec = _recorder(cfg, scenario, val)
    strategy = DynPipeStrategy(
        num_stages=1,
        balance=[len(model.pipeline)],
        num_microbatches=cfg.num_microbatches,
        schedule="sync",
        adaptive=False,
        monitor_every_n_steps=cfg.monitor_every,
        replica_split=_split_of(system),
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, max_steps=cfg.max_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[rec],
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=cfg.global_batch, shuffle=True))
    warm = len(rec.compute_s) // 4  # after the start-up steps
    mine = {
        "compute_s": median(rec.compute_s[warm:]),
        "share": median([float(x) for x in rec.shares[warm:]]),
        "quota_backend": rec.backend,
    }
    both: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(both, mine)
    reached = [e for e in rec.evals if e["acc"] >= cfg.target_acc]
    return {
        "system": system,
        "scenario": scenario,
        "seed": seed,
        "evals": rec.evals,
        "reached": bool(reached),
        "time_to_acc_s": reached[0]["train_s"] if reached else None,
        "steps_to_acc": reached[0]["step"] if reached else None,
        "train_s": rec.evals[-1]["train_s"] if rec.evals else None,
        "replicas": both,
        "resplits": [(step, str(old), str(new)) for step, old, new in strategy.resplits],
        # every check that saw an imbalance: the spikes it ignored (with the signs of interference it saw) too
        "ladder": [(d.step, d.rung, d.reason) for d in strategy.adaptation.ladder_decisions if d.rung != "keep"],
        "quota_backend": ",".join(p["quota_backend"] for p in both if p["quota_backend"]),
    }


def _split_of(system: str) -> Any:
    from lightning_dynpipe.repartition.ladder import EscalationLadder

    if system == "even":
        return "even"
    if system == "speed":
        return EscalationLadder()
    w0 = float(system.removeprefix("fixed-"))
    return [w0, 1.0 - w0]


def _worker(rank: int, cfg: Config, port: int, result_path: str) -> None:
    import logging
    import warnings

    from lightning_dynpipe.interference import pin_current_process

    external_launch_env(rank, WORLD_SIZE, port)
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    pin_current_process([cores[rank % len(cores)]])  # each replica its own core
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    runs: list[dict[str, Any]] = []
    try:
        for seed in range(cfg.seeds):
            for si, scenario in enumerate(cfg.scenarios):
                for position, system in enumerate(rotated(systems(cfg, scenario), seed + si)):
                    dist.barrier()
                    r = _run(system, scenario, cfg, seed)
                    r.update(position=position, load1=os.getloadavg()[0])
                    runs.append(r)
                    if rank == 0:
                        tta = f"{r['time_to_acc_s']:.1f} s" if r["reached"] else "not reached"
                        print(f"  seed {seed} {scenario:<8} {system:<10} TTA {tta}; re-splits {r['resplits']}",
                              flush=True)  # fmt: skip
                        Path(result_path).write_text(json.dumps({"runs": runs}), encoding="utf-8")
        workers_done()
    finally:
        close_group()


def summarise(runs: Sequence[dict[str, Any]], cfg: Config) -> dict[str, dict[str, Any]]:
    """Per scenario: median TTA of each system, the median per-seed ratios even/speed and even/best fixed split
    (the measured limit), the proportional limit from the even run's speeds, and the shares of them achieved."""
    out: dict[str, dict[str, Any]] = {}
    for scenario in cfg.scenarios:
        names = systems(cfg, scenario)
        by = {s: [r for r in runs if r["scenario"] == scenario and r["system"] == s] for s in names}
        ratios, limits, measured, best_names = [], [], [], []
        for seed in sorted({r["seed"] for r in by["even"]}):
            run = {s: next((r for r in by[s] if r["seed"] == seed), None) for s in names}
            even, speed = run["even"], run["speed"]
            if even is None or speed is None:
                continue
            if even["reached"] and speed["reached"]:
                ratios.append(even["time_to_acc_s"] / speed["time_to_acc_s"])
            rates = [p["share"] / p["compute_s"] for p in even["replicas"] if p["compute_s"] > 0]
            if len(rates) == WORLD_SIZE:
                limits.append(sum(rates) / (WORLD_SIZE * min(rates)))
            fixed = [(r["time_to_acc_s"], s) for s, r in run.items() if s.startswith("fixed-") and r and r["reached"]]
            if fixed and even["reached"]:
                best_s, best = min(fixed)
                measured.append(even["time_to_acc_s"] / best_s)
                best_names.append(best)
        ratio, limit, mlimit = median(ratios), median(limits), median(measured)
        # the limit: a replica at `quota` of the other's speed, time proportional to the share
        nominal = (1 + cfg.quota) / (2 * cfg.quota) if scenario == "quota50" else 1.0

        def share(limit_x: float, ratio: float = ratio) -> float:
            return (ratio - 1) / (limit_x - 1) if limit_x > 1.05 else float("nan")  # no limit to speak of

        out[scenario] = {
            "even_tta_s": median([r["time_to_acc_s"] for r in by["even"] if r["reached"]]),
            "speed_tta_s": median([r["time_to_acc_s"] for r in by["speed"] if r["reached"]]),
            "ratio": ratio,
            "measured_limit": mlimit,
            "best_fixed": ",".join(n.removeprefix("fixed-") for n in best_names) or "-",
            "of_measured_limit": share(mlimit),
            "limit": limit,
            "of_limit": share(limit),
            "quota_limit": nominal,
            "of_quota_limit": share(nominal),
            "resplits": median([float(len(r["resplits"])) for r in by["speed"]]),
            "final_w0": median([r["evals"][-1]["w0"] for r in by["speed"] if r["evals"]]),
            "reached": f"{sum(r['reached'] for r in by['even'])}/{len(by['even'])}, "
            f"{sum(r['reached'] for r in by['speed'])}/{len(by['speed'])}",
        }
    return out


HEADERS = ("scenario", "even TTA s", "speed TTA s", "even/speed", "measured limit", "best w0", "of measured limit",
           "prop. limit", "quota limit", "of quota limit", "re-splits", "final w0", "reached")  # fmt: skip


def _pct(x: float) -> str:
    return f"{x:.0%}" if x == x else "-"


def _x(x: float) -> str:
    return f"{x:.2f}x" if x == x else "-"


def render_table(summary: dict[str, dict[str, Any]], *, markdown: bool = False) -> str:
    rows = [
        [
            scenario,
            f"{s['even_tta_s']:.2f}",
            f"{s['speed_tta_s']:.2f}",
            _x(s["ratio"]),
            _x(s["measured_limit"]),
            s["best_fixed"],
            _pct(s["of_measured_limit"]),
            _x(s["limit"]),
            _x(s["quota_limit"]),
            _pct(s["of_quota_limit"]),
            f"{s['resplits']:.0f}",
            f"{s['final_w0']:.3f}",
            s["reached"],
        ]
        for scenario, s in summary.items()
    ]
    return format_table(HEADERS, rows, markdown=markdown)


def plot(runs: Sequence[dict[str, Any]], cfg: Config, machine: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - optional
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, len(cfg.scenarios), figsize=(5 * len(cfg.scenarios), 3.6), squeeze=False)
    for ax, scenario in zip(axes[0], cfg.scenarios):
        for r in runs:
            if r["scenario"] == scenario and r["seed"] == 0:
                ax.plot([e["train_s"] for e in r["evals"]], [e["acc"] for e in r["evals"]], label=r["system"])
        ax.axhline(cfg.target_acc, color="grey", lw=0.8, ls="--")
        ax.set(title=scenario, xlabel="training seconds", ylabel="validation accuracy")
        ax.legend()
    fig.suptitle(f"2 replicas x 1 stage, {machine['cpu_model']}, seed 0", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(path: Path, payload: dict[str, Any], json_path: Path, plot_path: Path) -> None:
    """The dated report (benchmarks/results/README.md: date, machine, versions, commit, command, table, plot)."""
    m = payload["machine"]
    text = f"""# Intra-stage balance ({m["date_utc"][:10]})

2 pipeline replicas x 1 stage on 2 processes, each pinned to its own core; {payload["config"]["quota"]:.0%} CPU
quota on replica 1 (`quota50`) or none; sync schedule; global batch {payload["config"]["global_batch"]}, MLP
{payload["config"]["depth"]}x{payload["config"]["width"]}, {payload["config"]["num_microbatches"]} micro-batches;
TTA = training seconds to the first evaluation at or above {payload["config"]["target_acc"]}. `even/speed`: median
of per-seed TTA ratios. `measured limit`: median per-seed ratio of the even run's TTA to the best fixed split's
(`replica_split=[w0, 1 - w0]` from the first step, w0 in {list(payload["config"].get("fixed_splits", []))};
`best w0` per seed): what a split known in advance achieves, with the work no split moves (all-reduce, update,
the framework's per-step work) slowed on the throttled replica. `prop. limit`: the best
split's speed-up from the even run's replica speeds if each replica's time were proportional to its share,
`(s0 + s1) / (2 min(s0, s1))`; `quota limit`: the same for a replica at exactly the quota's speed, `(1 + q) / (2 q)`
(1.5x at 50%). `of X`: `(ratio - 1) / (X - 1)`. `final w0`: replica 0's share at the end of the speed run.

- **date**: {m["date_utc"]}
- **machine**: {m["cpu_model"]}, {m["logical_cpus"]} logical CPUs, load {m["load_average_1_5_15"]} before,
  {m.get("load_average_1_5_15_after")} after
- **versions**: {m["os"]}, Python {m["python"]}, torch {m["torch"]}, Lightning {m["lightning"]}
- **commit**: {m["git_commit"]} (modified files: {m["git_modified_files"]})
- **command**: `{payload["command"]}`
- **quota backend**: {sorted({r["quota_backend"] for r in payload["runs"] if r["quota_backend"]})}

{payload["markdown"]["table"]}

![time to accuracy]({os.path.relpath(plot_path, path.parent)})

Reproduce: `{payload["command"]}`; re-analyse without measuring: `.venv/bin/python benchmarks/intra_stage.py
--from-json {json_path.name}`.
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _parse(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: quota50 only, 1 seed, 30 steps, MLP 2x64 (~20 s)")
    p.add_argument("--seeds", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--target-acc", type=float, default=None)
    p.add_argument("--global-batch", type=int, default=None, help="samples per step over both replicas")
    p.add_argument("--fixed-splits", default=None, help="comma-separated shares of replica 0 for the fixed runs")
    p.add_argument("--scenarios", default=None, help=f"comma-separated, from {list(SCENARIOS)}")
    p.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="where everything goes (default: JSON to benchmarks/out, plot to docs/img, report to benchmarks/results)",
    )
    p.add_argument("--from-json", type=Path, default=None, help="re-analyse a raw record without measuring")
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args(argv)
    cfg = QUICK if a.quick else Config()
    changes: dict[str, Any] = {}
    if a.seeds is not None:
        changes["seeds"] = a.seeds
    if a.max_steps is not None:
        changes["max_steps"] = a.max_steps
    if a.target_acc is not None:
        changes["target_acc"] = a.target_acc
    if a.global_batch is not None:
        changes["global_batch"] = a.global_batch
    if a.fixed_splits is not None:
        changes["fixed_splits"] = tuple(float(w) for w in a.fixed_splits.split(","))
    if a.scenarios is not None:
        bad = [s for s in a.scenarios.split(",") if s not in SCENARIOS]
        if bad:
            p.error(f"unknown scenarios {bad}; choose from {list(SCENARIOS)}")
        changes["scenarios"] = tuple(a.scenarios.split(","))
    return Config(**{**asdict(cfg), **changes}), a


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg, a = _parse(argv)
    out_dir = a.out_dir or (Path(tempfile.gettempdir()) / "intra-stage-quick" if a.quick else _OUT)
    if a.from_json is not None:
        payload = json.loads(a.from_json.read_text(encoding="utf-8"))
        c = payload["config"]
        cfg = Config(**{**c, "scenarios": tuple(c["scenarios"]), "fixed_splits": tuple(c.get("fixed_splits", ()))})
        json_path = a.from_json
    else:
        machine, cmd = machine_info(), command_line()
        print(describe_machine(machine))
        print(f"command: {cmd}")
        from torch.multiprocessing.spawn import spawn

        json_path = out_dir / f"intra-stage-{time.strftime('%Y%m%d-%H%M%S')}.json"
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            result_path = os.path.join(tmp, "runs.json")
            try:
                spawn(_worker, args=(cfg, free_port(), result_path), nprocs=WORLD_SIZE, join=True)
            finally:
                raw = json.loads(Path(result_path).read_text(encoding="utf-8")) if os.path.exists(result_path) else {}
                machine["load_average_1_5_15_after"] = [round(x, 2) for x in os.getloadavg()]
                payload = {"config": asdict(cfg), "machine": machine, "command": cmd,
                           "elapsed_s": time.perf_counter() - t0, "runs": [], **raw}  # fmt: skip
                json_path.parent.mkdir(parents=True, exist_ok=True)
                json_path.write_text(json.dumps(payload), encoding="utf-8")
    summary = summarise(payload["runs"], cfg)
    print()
    print(
        "time to accuracy (median over seeds); even/speed: median per-seed ratio; measured limit: even over the "
        "best fixed split; prop. limit: from the even run's replica speeds; of X: (ratio - 1) / (X - 1):"
    )
    print(render_table(summary))
    payload["summary"] = summary
    payload["markdown"] = {"table": render_table(summary, markdown=True)}
    apart = a.quick or a.out_dir is not None  # an explicit --out-dir takes everything, as --quick does
    plot_path = (out_dir if apart else _IMG) / "intra_stage.png"
    if not a.no_plot and payload["runs"]:
        plot(payload["runs"], cfg, payload["machine"], plot_path)
        print(f"plot: {plot_path}")
    report = (out_dir if apart else _RESULTS) / f"{payload['machine']['date_utc'][:10]}-intra-stage.md"
    write_report(report, payload, json_path, plot_path)
    print(f"report: {report}")
    json_path.write_text(json.dumps(payload), encoding="utf-8")
    print(f"raw runs: {json_path}")
    return summary


if __name__ == "__main__":
    main()
