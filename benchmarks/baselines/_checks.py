"""The argument checks the baselines share: one stage per rank of an initialised group, batches to time."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor


def check_stage_call(
    caller: str,
    stage_idx: int,
    num_stages: int,
    num_microbatches: int,
    batches: Sequence[tuple[Tensor, Tensor]],
    warmup_steps: int,
    group: dist.ProcessGroup | None,
) -> None:
    """Refuses a call that could not time what it promises, before any communication, on every rank.

    Raises:
        RuntimeError: when no process group is initialised.
        ValueError: for inconsistent stage/group sizes, too few batches, or batches that are not all of one size
            divisible by ``num_microbatches`` (equal micro-batches: a mean of their means is the batch's mean, and
            the stages' shapes are the same for every micro-batch).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            f"{caller} needs an initialised process group: call "
            "torch.distributed.init_process_group('gloo', rank=..., world_size=num_stages) in each rank first."
        )
    group_size, group_rank = dist.get_world_size(group), dist.get_rank(group)
    if group_size != num_stages or group_rank != stage_idx:
        raise ValueError(
            "Single-stage schedules need one stage per rank with stage_idx == rank in the group; got "
            f"num_stages={num_stages}, stage_idx={stage_idx}, group size={group_size}, group rank={group_rank}."
        )
    if not 0 <= warmup_steps < len(batches):
        raise ValueError(
            f"Need more batches than warm-up steps so that at least one step is timed; got {len(batches)} "
            f"batches and warmup_steps={warmup_steps}."
        )
    sizes = sorted({int(x.shape[0]) for x, _ in batches})
    if len(sizes) != 1 or sizes[0] % num_microbatches:
        raise ValueError(
            "Every batch must have the same size, divisible by num_microbatches (the stage shapes are inferred "
            f"once, and a split would make unequal micro-batches); got batch sizes {sizes} and "
            f"num_microbatches={num_microbatches}. Drop the last batch or change num_microbatches."
        )
