"""2-stage asynchronous pipeline training of an MLP on MNIST, on CPU: the script ``make demo`` runs.

Two processes each run one pipeline stage (``DynPipeStrategy``, PipeDream-style 1F1B with weight stashing,
an update after every micro-batch and no flush between steps), each pinned to its own core. Part-way through
(``--hog-at-step``) a CPU hog starts on stage 0's core, as a co-located job would: the stage monitor sees
stage 0 slow down, the adaptive policy re-plans and moves layers to stage 1 while training continues (the
log shows the decision with the measured step time it was based on, the old and new balance and the
pause), and the next table shows the step time under the new balance. The hog keeps running, so the step
time does not return to its value before the hog; the migration takes away the part of the slowdown that
moving layers can remove (how much that is, against the same run without adaptation, is measured by
``benchmarks/interference.py``; see docs/adaptation.md). Every
``--print-every`` steps rank 0 prints the stage monitor's latest snapshot (per-stage medians of the step
time and its parts, forwards/backwards/updates per step, the balance), which every rank already holds;
after training, rank 0 prints the migrations and the test accuracy.

Run::

    python examples/mnist_demo.py                       # the defaults of `make demo`
    python examples/mnist_demo.py --schedule sync       # 1F1B with a flush and one update per step
    python examples/mnist_demo.py --no-hog              # no interference
    python examples/mnist_demo.py --max-epochs 1 --width 64 --depth 1 --limit-train-batches 10   # tiny

The default launcher starts rank 1 by running this script again with the same arguments, so everything
below runs under ``if __name__ == "__main__":`` and is seeded: both processes build the same model and data.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

import lightning.pytorch as L
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_dynpipe import DynPipeStrategy
from lightning_dynpipe.demos import MLP, MNISTDataModule
from lightning_dynpipe.interference import pin_current_process
from lightning_dynpipe.monitor import PipelineSnapshot, StageMonitor


class StageTable(Callback):
    """Prints the stage monitor's latest pipeline snapshot as a table on rank 0, every ``every_n_steps`` steps.

    ``DynPipeStrategy`` adds a :class:`~lightning_dynpipe.monitor.StageMonitor` (``trainer.strategy.monitor``)
    that keeps a rolling window of every stage's per-step statistics and, every ``monitor_every_n_steps``
    steps (default 10), gathers them in one small collective that overlaps the next step. Every rank then
    holds the same :class:`~lightning_dynpipe.monitor.PipelineSnapshot`, and the monitor hands it to its
    listeners. This callback only registers a listener for the fit: it needs no communication of its own.
    A table is printed for the first snapshot taken at or after each multiple of ``every_n_steps``.
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        self.every_n_steps = every_n_steps
        self._monitor: StageMonitor | None = None
        self._next_step = every_n_steps

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy: Any = trainer.strategy
        self._monitor = strategy.monitor  # None with DynPipeStrategy(monitor_every_n_steps=None)
        if self._monitor is None:
            return
        self._next_step = self.every_n_steps
        self._monitor.add_listener(self._on_snapshot)
        if trainer.is_global_zero:
            # Where the stages run: the last stage (the user's training_step, loggers) is global rank 0.
            topology = strategy.topology
            placement = ", ".join(
                f"stage {k} on rank {','.join(map(str, topology.stage_ranks(k)))}" for k in range(topology.num_stages)
            )
            print(f"stage placement: {placement}", flush=True)

    def _on_snapshot(self, snapshot: PipelineSnapshot, trainer: Trainer) -> None:
        # Called on every rank with the same snapshot; only rank 0 prints.
        if snapshot.step < self._next_step:
            return
        self._next_step = (snapshot.step // self.every_n_steps + 1) * self.every_n_steps
        if trainer.is_global_zero:
            print(snapshot.table(), flush=True)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._monitor is not None:
            self._monitor.remove_listener(self._on_snapshot)
            self._monitor = None


class PinToCore(Callback):
    """Pins each stage process to its own core, so that an interfering job on one core hits one stage."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        cores = sorted(os.sched_getaffinity(0))
        pin_current_process([cores[trainer.local_rank % len(cores)]])


class EpochSummary(Callback):
    """Prints the validation metrics of every epoch on rank 0 (where the last stage and the logging run)."""

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        m = trainer.callback_metrics
        parts = [f"epoch {trainer.current_epoch}", f"step {trainer.global_step}"]
        for key in ("train_loss", "val_loss", "val_acc"):
            if key in m:
                parts.append(f"{key} {float(m[key]):.4f}")
        parts.append(f"elapsed {time.perf_counter() - self._start:.1f}s")
        print(" | ".join(parts), flush=True)


def _int_or_fraction(text: str) -> int | float:
    # As in Lightning: an int counts batches, a float is a fraction of the epoch ("10" vs "0.5").
    return float(text) if "." in text else int(text)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--max-epochs", type=int, default=10)
    p.add_argument("--num-microbatches", type=int, default=4, help="micro-batches M per Lightning batch")
    p.add_argument("--schedule", choices=["async", "sync", "gpipe"], default="async")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=512, help="features of every hidden block of the MLP")
    p.add_argument("--depth", type=int, default=6, help="hidden blocks; the pipeline has depth + 1 layers")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument(
        "--limit-train-batches",
        type=_int_or_fraction,
        default=None,
        help="batches per epoch (an int) or a fraction of the epoch (a float <= 1.0), as in Lightning",
    )
    p.add_argument(
        "--print-every",
        type=int,
        default=50,
        help="steps between per-stage tables (the stage monitor takes a snapshot every 10 steps)",
    )
    p.add_argument("--hog-at-step", type=int, default=150, help="step at which a CPU hog starts on stage 0's core")
    p.add_argument("--no-hog", action="store_true", help="run without the CPU hog")
    p.add_argument("--static", action="store_true", help="keep the partition fixed (no runtime adaptation)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    # The library logs interference start/stop and adaptation decisions through `logging` at INFO.
    logging.basicConfig(format="%(message)s")
    logging.getLogger("lightning_dynpipe").setLevel(logging.INFO)
    L.seed_everything(args.seed, verbose=False)
    # drop_last: every training batch must split into num_microbatches non-empty micro-batches.
    datamodule = MNISTDataModule(batch_size=args.batch_size, drop_last=True)
    model = MLP(in_features=784, width=args.width, depth=args.depth, lr=args.lr, momentum=args.momentum)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DynPipeStrategy(
            num_microbatches=args.num_microbatches,
            schedule=args.schedule,
            adaptive=not args.static,
            interference=None if args.no_hog else [{"kind": "cpu_hog", "stage": 0, "start_step": args.hog_at_step}],
        ),
        max_epochs=args.max_epochs,
        limit_train_batches=args.limit_train_batches,
        callbacks=[PinToCore(), StageTable(every_n_steps=args.print_every), EpochSummary()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        num_sanity_val_steps=0,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    fit_s = time.perf_counter() - start
    results = trainer.test(model, datamodule=datamodule, verbose=False)
    if trainer.is_global_zero:
        acc = results[0]["test_acc"]
        print(
            f"schedule={args.schedule} stages=2 microbatches={args.num_microbatches} "
            f"fit_time={fit_s:.1f}s steps={trainer.global_step}"
        )
        controller = trainer.strategy.controller  # type: ignore[attr-defined]
        if controller is not None and controller.decisions:
            print(f"adaptation: {len(controller.decisions)} checks; last: {controller.decisions[-1]}")
        for m in trainer.strategy.migrations:  # type: ignore[attr-defined]
            print(
                f"migration at step {m.step}: balance {m.old} -> {m.new}, moved layers {list(m.moved)}, "
                f"pause {m.pause_s * 1e3:.1f} ms"
            )
        print(f"test accuracy: {acc:.4f} ({len(datamodule.test_set)} MNIST test images)", flush=True)


if __name__ == "__main__":
    main()
