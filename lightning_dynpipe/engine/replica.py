"""Data-parallel pipeline replicas: averaging a stage's gradients over its replicas before each update."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_dynpipe.engine.collectives import Collectives

__all__ = ["average_replica_gradients"]


def average_replica_gradients(params: Sequence[nn.Parameter], coll: Collectives, num_replicas: int) -> None:
    """Replaces each parameter's ``.grad`` by its mean over the stage's replicas: one all-reduce of a flat buffer.

    Collective over the stage's replicas. A parameter without a gradient contributes zeros (every replica must
    contribute the same buffer layout), so after the call every trainable parameter has a gradient.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    coll.all_reduce_sum(flat)
    flat /= num_replicas
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n
