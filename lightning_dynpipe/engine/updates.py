"""How one optimizer update is applied: the learning-rate scale of per-micro-batch updates, and clearing the
gradients after it.

An asynchronous pipeline updates the weights after every micro-batch, ``M`` times per Lightning batch, where
plain training updates once with the mean gradient of the whole batch. Each micro-batch gradient estimates the
same mean, so ``M`` updates at the same learning rate move the weights about ``M`` times as far (for SGD, and
for Adam-like optimizers, whose step size does not depend on the gradient's scale at all). Scaling the learning
rate of each update by ``1/M`` makes a batch move them about as far as one plain step. The scale is applied
around the optimizer's step, so the learning rate that schedulers set and loggers show stays the user's.

Example::

    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.4)
    >>> opt.param_groups[0]["params"][0].grad = torch.ones(1)
    >>> with scaled_lr(opt, 0.25):
    ...     opt.step()
    >>> opt.param_groups[0]["params"][0].item(), opt.param_groups[0]["lr"]
    (0.9, 0.4)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.optim import Optimizer

__all__ = ["clear_grads", "scaled_lr"]


@contextmanager
def scaled_lr(optimizer: Optimizer, scale: float) -> Iterator[None]:
    """Multiplies every group's ``lr`` by ``scale`` for the duration of the block, then restores it."""
    if scale == 1.0:
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr


def clear_grads(optimizer: Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``, without its fixed cost where it is torch's own.

    Under ``async`` a stage clears its gradients after every micro-batch's update, ``M`` times per step. torch's
    ``Optimizer.zero_grad`` sets each parameter's ``grad`` to ``None`` inside a profiler range, with some
    bookkeeping around it: about 80 us a call on the throughput benchmark's 4-layer stage, 36 us of which is freeing
    the gradients. An optimizer whose class overrides ``zero_grad``, or a run under the autograd profiler (which
    would lose the range), gets the real call.
    """
    if type(optimizer).zero_grad is not Optimizer.zero_grad or torch._C._autograd._profiler_enabled():
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
