"""Data-parallel pipeline replicas: averaging a stage's gradients over its replicas before each update."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_dynpipe.engine.collectives import Collectives
from lightning_dynpipe.engine.shares import check_cover, cover_row

__all__ = ["average_replica_gradients"]


def average_replica_gradients(
    params: Sequence[nn.Parameter],
    coll: Collectives,
    num_replicas: int,
    samples: int | None = None,
    cover: tuple[int, int, int, int] | None = None,
) -> None:
    """Replaces each parameter's ``.grad`` by its mean over the stage's replicas: one all-reduce of a flat buffer.

    Collective over the stage's replicas. A parameter without a gradient contributes zeros (every replica must
    contribute the same buffer layout), so after the call every trainable parameter has a gradient.

    ``samples``: the number of samples this replica's gradient is the mean over (an uneven replica split). The
    result is then the mean weighted by sample count, ``sum_d samples_d * grad_d / sum_d samples_d``: for a loss
    that is the mean over the samples of a per-sample loss, exactly the gradient of the mean over the union of
    the replicas' samples. The sample counts travel in the same all-reduce (one extra float). Every replica must
    pass ``samples`` or none must. Half-precision gradients are weighted and summed in float32 (a sample count
    above 256 is not exact in bfloat16) and written back in their own dtype.

    ``cover``: ``(replica, start, count, total)``, the slice of the global batch this replica's step trains on;
    it travels in the same all-reduce (3 floats per replica) and :func:`~lightning_dynpipe.engine.shares.check_cover`
    raises on every replica unless the slices tile the global batch. Passed with ``samples``.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    if samples is None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        coll.all_reduce_sum(flat)
        flat /= num_replicas
    else:
        if samples < 1:
            raise ValueError(f"A replica's gradient must come from at least one sample; got samples={samples}.")
        acc = torch.float32 if grads[0].dtype in (torch.float16, torch.bfloat16) else grads[0].dtype
        count = torch.full((1,), float(samples), dtype=acc, device=grads[0].device)
        rows = [] if cover is None else [cover_row(cover[0], num_replicas, *cover[1:], like=count)]
        flat = torch.cat([*(g.reshape(-1).to(acc) * samples for g in grads), count, *rows])
        coll.all_reduce_sum(flat)
        if cover is not None:
            check_cover(flat[-3 * num_replicas :], num_replicas)
            flat = flat[: -3 * num_replicas]
        flat = flat[:-1] / flat[-1]
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n
