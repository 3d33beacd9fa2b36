"""What activation checkpointing saves per stage, and what it costs: the GPT example's model, async, 2 stages.

Two measurements, both on ``lightning_dynpipe.demos.CharGPT`` (the model of ``examples/gpt_char.py``):

* **Activation memory per stage, exact.** Every stage's executor runs the async schedule in one process
  (each stage on its own thread, over loopback channels) while ``torch.autograd.graph.saved_tensors_hooks``
  account every tensor autograd keeps for a backward: the peak of the bytes alive at once, per stage, with
  and without ``activation_checkpointing=True``. A stage keeps ``S-k`` micro-batches in flight, so its peak
  is about ``S-k`` times what one micro-batch keeps; with checkpointing a layer keeps only its input.
* **The planner's memory model against it**: the same accounting counting each storage once and leaving out
  the weights (the memory those tensors take), next to what the planner predicts from the set-up profile
  (:func:`~lightning_dynpipe.plan.memory.activation_memory`).
* **A real 2-process run**: ``Trainer(devices=2, strategy=DynPipeStrategy(activation_checkpointing=...))``
  spawned as in ``benchmarks/throughput.py``, interleaved repeats of the two settings; per stage the median
  step time (what the recomputation costs) and the process's peak resident memory (``VmHWM``; every run
  starts fresh processes, so the peak belongs to that setting alone; it also holds the interpreter, torch and
  the weights, so the difference is the interesting part).

Usage (from the repository root)::

    .venv/bin/python benchmarks/activation_memory.py            # the documented run (a few minutes on 2 cores)
    .venv/bin/python benchmarks/activation_memory.py --quick    # smoke run: tiny model, 1 repeat, 1 process pair

Outputs: the tables on stdout, ``benchmarks/out/activation_memory-<stamp>.json`` (config, machine, versions,
command, every measurement) and ``docs/img/activation_memory.png`` (``--quick``: under ``benchmarks/out/``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `benchmarks` and the package importable
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks._common import (  # noqa: E402
    REPO_ROOT,
    close_group,
    command_line,
    describe_machine,
    fit_dynpipe,
    format_table,
    free_port,
    machine_info,
    median,
    workers_done,
)
from lightning_dynpipe.demos import CharGPT  # noqa: E402
from lightning_dynpipe.engine.executor import StageExecutor  # noqa: E402
from lightning_dynpipe.engine.loopback import loopback_channels, run_stages  # noqa: E402
from lightning_dynpipe.engine.shard import StageShard  # noqa: E402
from lightning_dynpipe.plan.memory import activation_memory  # noqa: E402
from lightning_dynpipe.plan.partition import Partition  # noqa: E402
from lightning_dynpipe.profiling import profile_layers  # noqa: E402
from lightning_dynpipe.strategy.decision import recomputed  # noqa: E402

WORLD_SIZE = 2


@dataclass(frozen=True)
class Config:
    block_size: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    batch_size: int = 32
    num_microbatches: int = 4
    balance: tuple[int, ...] = (3, 3)
    steps: int = 3  # steps of the schedule for the exact accounting
    run_steps: int = 30  # steps of each real run (the first warmup ones are not timed)
    warmup: int = 5
    repeats: int = 3
    seed: int = 0


QUICK = Config(block_size=16, d_model=32, n_layers=2, n_heads=2, batch_size=8, steps=2, run_steps=6, warmup=2,
               repeats=1, balance=(2, 2))  # fmt: skip


def _model(cfg: Config) -> CharGPT:
    torch.manual_seed(cfg.seed)
    return CharGPT(block_size=cfg.block_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads)


def _batches(cfg: Config, n: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    out = []
    for _ in range(n):
        w = torch.randint(0, 256, (cfg.batch_size, cfg.block_size + 1), generator=g)
        out.append((w[:, :-1], w[:, 1:]))
    return out


class _LiveBytes:
    """Bytes of the tensors autograd holds for a backward, alive now and at the peak (one per stage thread).

    ``unique_of``: count each storage once, leaving out the storages of the given module's parameters (the memory
    the saved tensors take beyond the weights); ``None``: count every saved tensor's bytes, each time it is saved.
    """

    def __init__(self, unique_of: nn.Module | None = None) -> None:
        self.now = self.peak = 0
        self._lock = threading.Lock()
        self._unique_of = unique_of
        self._refs: dict[int, int] = {}

    def _add(self, n: int) -> None:
        with self._lock:
            self.now += n
            self.peak = max(self.peak, self.now)

    def _release(self, ptr: int, n: int) -> None:
        with self._lock:
            self._refs[ptr] -= 1
            if self._refs[ptr] == 0:
                del self._refs[ptr]
                self.now -= n

    def pack(self, t: Tensor) -> Any:
        holder = _Held(t)
        if self._unique_of is None:
            n = t.numel() * t.element_size()
            self._add(n)
            weakref.finalize(holder, self._add, -n)
            return holder
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in {p.untyped_storage().data_ptr() for p in self._unique_of.parameters()}:
            return holder  # a weight version: counted by the memory model's weight versions, not here
        with self._lock:
            self._refs[ptr] = self._refs.get(ptr, 0) + 1
            first = self._refs[ptr] == 1
        if first:
            self._add(storage.nbytes())
        weakref.finalize(holder, self._release, ptr, storage.nbytes())
        return holder

    @staticmethod
    def unpack(holder: Any) -> Tensor:
        return holder.t


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: Tensor) -> None:
        self.t = t


def exact_peaks(cfg: Config, checkpoint: bool, unique: bool = False) -> list[int]:
    """Each stage's peak of bytes kept for the backward over ``cfg.steps`` async steps (one process); ``unique``:
    each storage once, the stage's weights left out (see :class:`_LiveBytes`)."""
    model = _model(cfg)
    partition = Partition(cfg.balance)
    S = partition.num_stages
    channels = loopback_channels(S, timeout=120.0)
    holder: list[StageExecutor] = []
    executors = []
    for k in range(S):
        stage = StageShard(model.pipeline, partition, k).stage_module()
        opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)

        def step(opt: torch.optim.Optimizer = opt) -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        def loss(mb: Any, slot: int) -> Tensor:
            logits = holder[0].local_forward(None)
            return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb[1].reshape(-1))

        ex = StageExecutor(
            stage_module=stage, stage_idx=k, num_stages=S, schedule="async", num_microbatches=cfg.num_microbatches,
            channels=channels[k], first_stage_input=lambda b: b[0], last_stage_loss=loss if k == S - 1 else None,
            optimizer_step=step, checkpoint=[checkpoint] * len(stage),
        )  # fmt: skip
        if k == S - 1:
            holder.append(ex)
        executors.append(ex)
    batches = _batches(cfg, cfg.steps)
    meters = [_LiveBytes(ex.stage_module if unique else None) for ex in executors]

    def run(k: int) -> None:
        with torch.autograd.graph.saved_tensors_hooks(meters[k].pack, meters[k].unpack):
            for b in batches:
                executors[k].train_step(b)
            executors[k].drain()

    run_stages(run, S, timeout=600.0)
    return [m.peak for m in meters]


def predicted_peaks(cfg: Config, checkpoint: bool) -> list[int]:
    """Each stage's activation memory by the planner's model (:func:`~lightning_dynpipe.plan.memory.activation_memory`)
    from the set-up profile of one micro-batch, as the strategy takes it (checkpointed layers keep their outputs)."""
    model = _model(cfg)
    micro = _batches(cfg, 1)[0][0][: cfg.batch_size // cfg.num_microbatches]
    cost = profile_layers(model.pipeline, micro, warmup=0, repeats=1).to_model_cost()
    cost = recomputed(cost, range(cost.num_layers) if checkpoint else ())
    partition = Partition(cfg.balance)
    S = partition.num_stages
    return [
        int(activation_memory(cost, [r.start], [r.stop], stage_idx=k, num_stages=S, schedule="async")[0])
        for k, r in enumerate(partition.stage_layers(k) for k in range(S))
    ]


def _peak_rss_bytes() -> int:
    """This process's resident-memory high-water mark."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _worker(rank: int, cfg: Config, settings: tuple[bool, ...], port: int, result_dir: str) -> None:
    """One fit per setting in this pair of processes. The documented run gives each setting fresh processes, so
    each peak belongs to that setting alone; ``--quick`` runs both in one pair (the peak is reset between them
    through ``/proc/self/clear_refs``, but the allocator keeps what the first fit freed)."""
    from benchmarks.throughput import _quiet, _start_peak_rss, _step_timer
    from lightning_dynpipe import DynPipeStrategy

    os.environ.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(WORLD_SIZE),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    torch.set_num_threads(1)  # one core per stage
    _quiet()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        for checkpoint in settings:
            _start_peak_rss()
            strategy = DynPipeStrategy(num_microbatches=cfg.num_microbatches, balance=list(cfg.balance),
                                       adaptive=False, activation_checkpointing=checkpoint)  # fmt: skip
            timer = _step_timer(cfg.warmup, cfg.run_steps - cfg.warmup)
            res = fit_dynpipe(_model(cfg), _batches(cfg, cfg.run_steps), strategy, timer, world_size=WORLD_SIZE)
            peaks: list[Any] = [None] * WORLD_SIZE
            dist.all_gather_object(peaks, (timer.stage_idx, _peak_rss_bytes()))
            if rank == 0:
                steps = [median([s["step_s"] for s in st["steps"]]) for st in res["stages"]]
                rss = {str(stage): peak for stage, peak in peaks}
                path = Path(result_dir) / f"run-{checkpoint}.json"
                path.write_text(json.dumps({"checkpoint": checkpoint, "step_s": steps, "rss": rss}))
        workers_done()
    finally:
        close_group()


def real_runs(cfg: Config, *, fresh_processes: bool = True) -> list[dict[str, Any]]:
    """Interleaved repeats of the two settings, each run in its own fresh process pair (``fresh_processes``;
    otherwise each repeat runs both settings in one pair)."""
    from torch.multiprocessing import spawn

    runs = []
    for rep in range(cfg.repeats):
        order = (False, True) if rep % 2 == 0 else (True, False)  # each first half the time
        groups = [(c,) for c in order] if fresh_processes else [order]
        for settings in groups:
            with tempfile.TemporaryDirectory() as tmp:
                spawn(_worker, args=(cfg, settings, free_port(), tmp), nprocs=WORLD_SIZE, join=True)  # type: ignore[no-untyped-call]
                for checkpoint in settings:
                    record = json.loads((Path(tmp) / f"run-{checkpoint}.json").read_text())
                    runs.append({"rep": rep, "load_1m": os.getloadavg()[0], **record})
    return runs


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, one repeat, one process pair (the smoke test)")
    p.add_argument("--out-dir", default=None, help="where the JSON and (for --quick) the plot go")
    a = p.parse_args(argv)
    cfg = QUICK if a.quick else Config()
    out_dir = Path(a.out_dir) if a.out_dir else REPO_ROOT / "benchmarks" / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    t0 = time.time()
    exact = {str(c): exact_peaks(cfg, c) for c in (False, True)}
    storages = {str(c): exact_peaks(cfg, c, unique=True) for c in (False, True)}
    predicted = {str(c): predicted_peaks(cfg, c) for c in (False, True)}
    runs = real_runs(cfg, fresh_processes=not a.quick)
    S = len(cfg.balance)
    print(f"CharGPT d={cfg.d_model}, {cfg.n_layers} blocks, batch {cfg.batch_size} x {cfg.block_size} tokens, "
          f"M={cfg.num_microbatches}, async, balance {list(cfg.balance)}")  # fmt: skip
    print(describe_machine(machine) + "\n")
    rows = []
    for k in range(S):
        off, on = exact["False"][k], exact["True"][k]
        step_off = median([r["step_s"][k] for r in runs if not r["checkpoint"]])
        step_on = median([r["step_s"][k] for r in runs if r["checkpoint"]])
        rss_off = median([r["rss"][str(k)] for r in runs if not r["checkpoint"]])
        rss_on = median([r["rss"][str(k)] for r in runs if r["checkpoint"]])
        rows.append([str(k), str(S - k), _mib(off), _mib(on), f"{on / off:.2f}" if off else "-",
                     f"{step_off * 1e3:.1f}", f"{step_on * 1e3:.1f}", f"{step_on / step_off:.2f}",
                     _mib(rss_off), _mib(rss_on)])  # fmt: skip
    print(format_table(["stage", "in flight", "activations MiB", "checkpointed MiB", "ratio", "step ms",
                        "checkpointed ms", "time ratio", "peak RSS MiB", "checkpointed RSS MiB"], rows))  # fmt: skip
    model_rows = []
    for k in range(S):
        row = [str(k)]
        for c in ("False", "True"):
            got, pred = storages[c][k], predicted[c][k]
            row += [_mib(got), _mib(pred), f"{pred / got:.2f}" if got else "-"]
        model_rows.append(row)
    print("\nthe planner's memory model against what the stages kept (each storage once, weights left out):")
    print(format_table(["stage", "kept MiB", "predicted MiB", "predicted/kept", "checkpointed: kept MiB",
                        "predicted MiB", "predicted/kept"], model_rows))  # fmt: skip
    print("\nactivations: peak bytes kept for the backward (exact, one process); step and RSS: medians of "
          f"{cfg.repeats} interleaved real 2-process runs ({cfg.run_steps - cfg.warmup} timed steps each), each in "
          "fresh processes; RSS is each process's high-water mark (interpreter, torch, weights included).")  # fmt: skip
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(t0))
    record = {"config": asdict(cfg), "machine": machine, "command": command_line(), "exact_peak_bytes": exact,
              "storage_peak_bytes": storages, "predicted_bytes": predicted, "runs": runs,
              "elapsed_s": time.time() - t0}  # fmt: skip
    path = out_dir / f"activation_memory-{stamp}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"\nresults: {path}")
    _plot(exact, S, (out_dir if a.quick else REPO_ROOT / "docs" / "img") / "activation_memory.png")
    return 0


def _plot(exact: dict[str, list[int]], S: int, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot not written: matplotlib is not installed (pip install 'lightning-dynpipe[plot]')")
        return
    fig, ax = plt.subplots(figsize=(5, 3))
    width = 0.35
    xs = list(range(S))
    ax.bar([x - width / 2 for x in xs], [b / 2**20 for b in exact["False"]], width, label="without")
    ax.bar([x + width / 2 for x in xs], [b / 2**20 for b in exact["True"]], width, label="activation_checkpointing")
    ax.set_xticks(xs, [f"stage {k}" for k in xs])
    ax.set_ylabel("peak MiB kept for backward")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
