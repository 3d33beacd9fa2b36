"""Baseline: time ``torch.distributed.pipelining``'s synchronous schedules on one pipeline stage.

Call :func:`time_torch_schedule` in every rank of an already initialised process group (gloo on CPU), one
stage per rank, with the same ``batches`` everywhere. Each batch is one ``schedule.step`` (split into
``num_microbatches`` equal micro-batches, gradients accumulated and averaged over them, because
``scale_grads=True``) followed by one plain SGD step on the stage's parameters, so ``K`` batches train
exactly like ``K`` full-batch SGD steps on the unsplit model, up to float reassociation.

Example (inside each of ``S`` spawned ranks)::

    dist.init_process_group("gloo", rank=rank, world_size=S, init_method=f"tcp://127.0.0.1:{port}")
    seconds = time_torch_schedule(
        "1f1b", stage_modules[rank], rank, S, num_microbatches=4, batches=batches, lr=0.05, warmup_steps=2
    )

Notes on the torch 2.13 API, read from ``torch/distributed/pipelining/``:

- ``PipelineStage(submodule, stage_index, num_stages, device, input_args=None, output_args=None, ...,
  group=None)``: the example ``input_args``/``output_args`` are optional; shapes are inferred on the first
  ``step`` (a metadata exchange between neighbours). That inference happens once, so every later batch
  must have the same shape, hence this function refuses a ragged last batch.
- The schedule splits a batch with ``torch.tensor_split``, which silently makes unequal micro-batches
  when the batch size is not divisible; their mean-of-means is then not the full-batch mean, so this
  function requires divisibility.
- ``schedule.step(x)`` on stage 0, ``step(target=y)`` on the last stage, ``step()`` in between. Gradients
  accumulate into ``.grad`` across steps: the schedule never zeroes them, the caller must.
- ``scale_grads=True`` (the default) divides the accumulated gradients by ``num_microbatches`` after the
  last backward (``perform_reduce_grad``), which matches a ``mean``-reduced loss.
- ``Schedule1F1B`` raises ``ValueError`` if ``num_microbatches < num_stages``; ``ScheduleGPipe`` accepts it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from benchmarks.baselines._checks import check_stage_call

__all__ = ["ScheduleKind", "TimedWindow", "time_torch_schedule"]

ScheduleKind = Literal["1f1b", "gpipe"]


class TimedWindow(Protocol):
    """Something told when the timed steps start and end (a profiler, say), inside the clock's window."""

    def start(self) -> None:
        """Called right after the clock starts, before the first timed step."""
        ...

    def stop(self) -> None:
        """Called right after the last timed step, before the closing barrier."""
        ...


_SCHEDULES: dict[str, type[Schedule1F1B] | type[ScheduleGPipe]] = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def time_torch_schedule(
    kind: ScheduleKind,
    stage_module: nn.Module,
    stage_idx: int,
    num_stages: int,
    num_microbatches: int,
    batches: Sequence[tuple[Tensor, Tensor]],
    *,
    lr: float,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
    warmup_steps: int = 2,
    group: dist.ProcessGroup | None = None,
    losses: list[float] | None = None,
    window: TimedWindow | None = None,
) -> float:
    """Trains ``stage_module`` as stage ``stage_idx`` on ``batches`` and returns the seconds of the timed steps.

    The first ``warmup_steps`` batches also train (they include the shape inference and the first
    communication set-up) but are not timed; the clock covers the remaining batches, between two barriers
    of ``group``, so every rank returns about the same time.

    Args:
        kind: ``"1f1b"`` (``Schedule1F1B``) or ``"gpipe"`` (``ScheduleGPipe``).
        stage_module: this rank's layers; its parameters are updated in place.
        stage_idx: this rank's stage, equal to its rank in ``group``.
        num_stages: stages in the pipeline, equal to the size of ``group``.
        num_microbatches: micro-batches per batch; must divide every batch size.
        batches: ``(x, y)`` pairs, the same on every rank (stage 0 reads ``x``, the last stage ``y``).
        lr: learning rate of the plain SGD step taken after each batch.
        loss_fn: ``loss_fn(output, target)`` on the last stage; it should reduce with ``mean``.
        warmup_steps: leading batches that train but are not timed.
        group: the pipeline's process group; ``None`` is the default (world) group.
        losses: when given, the last stage appends each batch's loss (mean over micro-batches).
        window: when given, its ``start()`` runs as the clock starts and its ``stop()`` after the last timed
            step, before the closing barrier (``benchmarks/profile_step.py`` profiles the timed steps so).

    Returns:
        Wall-clock seconds of the ``len(batches) - warmup_steps`` timed steps.

    Raises:
        ValueError: for an unknown ``kind``, inconsistent stage/group sizes, too few batches, or a batch
            size that ``num_microbatches`` does not divide.
        RuntimeError: when no process group is initialised.
    """
    if kind not in _SCHEDULES:
        raise ValueError(f"Unknown schedule kind {kind!r}; valid options are {sorted(_SCHEDULES)}.")
    check_stage_call("time_torch_schedule", stage_idx, num_stages, num_microbatches, batches, warmup_steps, group)

    is_first, is_last = stage_idx == 0, stage_idx == num_stages - 1
    device = next((p.device for p in stage_module.parameters()), torch.device("cpu"))
    stage = PipelineStage(stage_module, stage_idx, num_stages, device, group=group)
    schedule = _SCHEDULES[kind](stage, num_microbatches, loss_fn=loss_fn, scale_grads=True)
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=lr)
    mb_losses: list[Tensor] = []

    start = 0.0
    for step, (x, y) in enumerate(batches):
        if step == warmup_steps:
            dist.barrier(group=group)
            start = time.perf_counter()
            if window is not None:
                window.start()
        optimizer.zero_grad(set_to_none=True)
        args = (x.to(device),) if is_first else ()
        target = y.to(device) if is_last else None
        schedule.step(*args, target=target, losses=mb_losses if is_last else None, return_outputs=False)
        optimizer.step()
        if losses is not None and is_last:
            losses.append(float(torch.stack(mb_losses).detach().mean()))
    if window is not None:
        window.stop()
    dist.barrier(group=group)
    return time.perf_counter() - start
