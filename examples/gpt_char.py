"""A nanoGPT-style character model on the Python standard library's source: 2 async stages vs one device, on CPU.

The model is :class:`~lightning_dynpipe.demos.CharGPT` (byte-level, pre-LayerNorm blocks, causal attention with
rotary position embeddings; ``pipeline = Sequential(embedding, block x n_layers, head)``) and the data is
:class:`~lightning_dynpipe.demos.StdlibTextDataModule` (the library's own ``.py`` files as bytes; nothing is
downloaded). The script trains it twice for the same number of steps, on the same batches in the same order,
from the same initial weights:

1. in a 2-stage asynchronous pipeline (``DynPipeStrategy``, PipeDream 1F1B with weight stashing, an update
   after every micro-batch), two CPU processes, each pinned to its own core with one torch thread;
2. then, in the main process only, with a plain ``Trainer(devices=1)`` on one core with one thread.

For each run it prints the validation loss after the last step (nats per byte) and the training throughput:
the batch size over the median wall time between the ends of consecutive training steps on global rank 0,
after ``--warmup`` steps (steps that contain a validation are left out). A two-row table comes last::

    python examples/gpt_char.py                      # the defaults documented in docs/gpt-example.md
    python examples/gpt_char.py --schedule sync      # 1F1B with a flush: one update per batch, like one device
    python examples/gpt_char.py --quick              # a tiny model for a few steps (the test runs this)

The default launcher starts rank 1 by running this script again with the same arguments, so everything runs
under ``if __name__ == "__main__":`` and is seeded. Rank 1 stops after the pipeline's fit; only the main process
(global rank 0) runs the one-device comparison, after removing the launcher's rank variables from its
environment so that the second Trainer does not look for the 2-process job.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_dynpipe import DynPipeStrategy
from lightning_dynpipe.demos import CharGPT, StdlibTextDataModule
from lightning_dynpipe.interference import pin_current_process

#: What Lightning's popen launcher puts in the main process's environment for the 2-process job.
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


class StepTimer(Callback):
    """Wall time between the ends of consecutive training steps on global rank 0, and the last ``val_loss``.

    The first ``warmup`` steps are left out (start-up, the pipeline's fill, the allocator's first growth), and
    so is any step whose interval contains a validation run.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.intervals: list[float] = []
        self.balance: list[int] | None = None
        self._last: float | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        partition = getattr(trainer.strategy, "partition", None)
        self.balance = list(partition.balance) if partition is not None else None

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        now = time.perf_counter()
        if self._last is not None and trainer.global_step > self.warmup:
            self.intervals.append(now - self._last)
        self._last = now

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last = None  # the next interval would include the validation

    def samples_per_s(self, batch_size: int) -> float:
        if not self.intervals:
            return math.nan
        return batch_size / statistics.median(self.intervals)


class PinToCore(Callback):
    """Pins each stage process to its own core (rank ``r`` to the ``r``-th allowed core), with one torch thread."""

    def __init__(self, cores: list[int]) -> None:
        self.cores = cores

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        torch.set_num_threads(1)
        pin_current_process([self.cores[trainer.local_rank % len(self.cores)]])


@dataclass
class Result:
    name: str
    stages: int
    steps: int
    val_loss: float
    samples_per_s: float
    fit_s: float
    balance: list[int] | None = None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=200, help="training steps (Lightning batches) of each run")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per batch")
    p.add_argument("--block-size", type=int, default=64, help="bytes of context per sequence")
    p.add_argument("--d-model", type=int, default=128, help="width of the residual stream")
    p.add_argument("--n-layers", type=int, default=4, help="transformer blocks; the pipeline has n_layers + 2 units")
    p.add_argument("--n-heads", type=int, default=4, help="attention heads")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--num-microbatches", type=int, default=4, help="micro-batches M per batch in the pipeline")
    p.add_argument("--schedule", choices=["async", "sync", "gpipe"], default="async")
    p.add_argument("--static", action="store_true", help="keep the pipeline's partition fixed (no adaptation)")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a tiny model (d_model 32, 2 blocks, context 32) for 12 steps")
    args = p.parse_args()
    if args.quick:
        args.steps, args.batch_size, args.block_size, args.d_model, args.n_layers = 12, 16, 32, 32, 2
        args.warmup = 3
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup}) to measure a throughput")
    return args


def build(args: argparse.Namespace) -> tuple[CharGPT, StdlibTextDataModule]:
    """The model and the data, seeded: every process, and both runs, start from the same weights and batches."""
    L.seed_everything(args.seed, verbose=False)
    model = CharGPT(
        block_size=args.block_size, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads, lr=args.lr
    )
    data = StdlibTextDataModule(block_size=args.block_size, batch_size=args.batch_size, seed=args.seed)
    return model, data


def trainer_kwargs(args: argparse.Namespace, timer: StepTimer) -> dict[str, Any]:
    return dict(
        accelerator="cpu",
        max_steps=args.steps,
        val_check_interval=args.steps,  # one validation, after the last step
        num_sanity_val_steps=0,
        log_every_n_steps=max(1, args.steps // 4),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[timer],
    )


def run_pipeline(args: argparse.Namespace, cores: list[int]) -> tuple[Trainer, Result]:
    model, data = build(args)
    timer = StepTimer(args.warmup)
    kwargs = trainer_kwargs(args, timer)
    kwargs["callbacks"] = [PinToCore(cores), timer]
    trainer = L.Trainer(
        devices=2,
        strategy=DynPipeStrategy(
            num_microbatches=args.num_microbatches, schedule=args.schedule, adaptive=not args.static
        ),
        # The windows are random already: keep the loader's order, the one the one-device run sees, instead of
        # the DistributedSampler's shuffle (the same in every stage either way).
        use_distributed_sampler=False,
        **kwargs,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    fit_s = time.perf_counter() - start
    val = float(trainer.callback_metrics.get("val_loss", math.nan))
    samples_per_s = timer.samples_per_s(args.batch_size)
    return trainer, Result(
        f"pipeline {args.schedule}", 2, trainer.global_step, val, samples_per_s, fit_s, timer.balance
    )


def run_one_device(args: argparse.Namespace, core: int) -> Result:
    for key in _LAUNCH_ENV:
        os.environ.pop(key, None)
    torch.set_num_threads(1)
    pin_current_process([core])  # one core, as one stage had
    model, data = build(args)
    timer = StepTimer(args.warmup)
    trainer = L.Trainer(devices=1, **trainer_kwargs(args, timer))
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    fit_s = time.perf_counter() - start
    val = float(trainer.callback_metrics.get("val_loss", math.nan))
    return Result("one device", 1, trainer.global_step, val, timer.samples_per_s(args.batch_size), fit_s)


def table(results: list[Result]) -> str:
    lines = [
        f"{'run':<16} {'stages':>6} {'steps':>6} {'val_loss':>9} {'samples/s':>10} {'fit_s':>7}",
        "-" * 59,
    ]
    for r in results:
        lines.append(
            f"{r.name:<16} {r.stages:>6} {r.steps:>6} {r.val_loss:>9.4f} {r.samples_per_s:>10.1f} {r.fit_s:>7.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    logging.basicConfig(format="%(message)s")
    logging.getLogger("lightning_dynpipe").setLevel(logging.INFO)  # the plan, adaptation decisions
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    cores = sorted(os.sched_getaffinity(0))
    trainer, pipeline = run_pipeline(args, cores)
    if trainer.global_rank != 0:
        return  # rank 1, started by the launcher: its part ends with the pipeline's fit
    strategy: Any = trainer.strategy
    print(
        f"pipeline: {args.schedule}, 2 stages, balance {pipeline.balance}, {args.num_microbatches} micro-batches, "
        f"val_loss {pipeline.val_loss:.4f}, {pipeline.samples_per_s:.1f} samples/s",
        flush=True,
    )
    for m in strategy.migrations:
        print(f"migration at step {m.step}: balance {m.old} -> {m.new}, pause {m.pause_s * 1e3:.1f} ms", flush=True)
    one = run_one_device(args, cores[0])
    print(f"one device: val_loss {one.val_loss:.4f}, {one.samples_per_s:.1f} samples/s", flush=True)
    print()
    print(table([pipeline, one]), flush=True)


if __name__ == "__main__":
    main()
