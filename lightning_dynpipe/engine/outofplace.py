"""Optimizer updates that write the new weights to fresh storage, so that weight stashing needs no copy.

Under ``async`` a stage updates its weights while a micro-batch whose forward used them is still waiting for its
backward. :class:`~lightning_dynpipe.engine.stash.WeightStash` keeps that micro-batch's version as an alias of
the live weights' storage, so before an in-place optimizer step the live weights must first move to a copy (one
read and one write of every weight, ``M`` times per step on the first ``S-1`` stages). An update that reads the
old weights and writes the new ones to fresh storage leaves the old storage to the stash for free: the same
arithmetic, the copy gone.

:func:`out_of_place_step` returns such an update for the optimizers whose step this module reproduces exactly,
and ``None`` for everything else (the caller then copies and runs the optimizer's own ``step``). Today that is
``torch.optim.SGD`` (momentum, dampening, Nesterov, weight decay, ``maximize``) on CPU tensors, in its default
per-tensor implementation: every tensor operation of ``torch.optim.sgd._single_tensor_sgd`` is kept, in order,
and only its last one, ``param.add_(grad, alpha=-lr)``, writes to a new tensor instead of ``param``. An
optimizer with step hooks, a subclass, a patched ``step`` (other than an LR scheduler's call counter), a tensor
learning rate, ``foreach=True``, ``fused=True``, ``differentiable=True``, sparse gradients or non-CPU parameters
gets ``None``. ``tests/engine/test_outofplace.py`` checks bit-for-bit equality with ``optimizer.step()``.

Example::

    step = stash_aware_step(optimizer, executor.update_stash, user_code_first=False)
    ...                                # gradient all-reduces, hooks that do not write the weights
    step()                             # optimizer.step(), or its out-of-place twin
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import SGD, Optimizer
from torch.optim import optimizer as _torch_optimizer

from lightning_dynpipe.engine.stash import WeightStash

__all__ = ["OUT_OF_PLACE_STEPS", "out_of_place_step", "stash_aware_step"]


def _hooks_free(optimizer: Optimizer) -> bool:
    """No step hooks anywhere, and ``step`` is the class's own (an LR scheduler's call counter aside)."""
    patched = optimizer.__dict__.get("step")
    if patched is not None and not getattr(patched, "_wrapped_by_lr_sched", False):
        return False
    return not (
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or _torch_optimizer._global_optimizer_pre_hooks
        or _torch_optimizer._global_optimizer_post_hooks
        or getattr(optimizer, "grad_scale", None) is not None
        or getattr(optimizer, "found_inf", None) is not None
    )


def _sgd_supported(optimizer: Optimizer) -> bool:
    if optimizer.defaults.get("differentiable", False):
        return False
    for group in optimizer.param_groups:
        if group.get("foreach") or group.get("fused"):
            return False
        if any(isinstance(group[k], Tensor) for k in ("lr", "weight_decay", "momentum", "dampening")):
            return False
        for p in group["params"]:
            if p.device.type != "cpu" or (p.grad is not None and (p.grad.is_sparse or p.grad.device != p.device)):
                return False
    return True


def _sgd_step(optimizer: Optimizer) -> None:
    """``SGD.step()`` with the per-tensor implementation's arithmetic; the new weights go to fresh storage."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            weight_decay, momentum, lr = group["weight_decay"], group["momentum"], group["lr"]
            dampening, nesterov, maximize = group["dampening"], group["nesterov"], group["maximize"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad if not maximize else -param.grad
                if weight_decay != 0:
                    grad = grad.add(param, alpha=weight_decay)
                if momentum != 0:
                    state = optimizer.state[param]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = grad.detach().clone()
                    else:
                        buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                    state["momentum_buffer"] = buf
                    grad = grad.add(buf, alpha=momentum) if nesterov else buf
                new = torch.empty_like(param.data)
                torch.add(param.data, grad, alpha=-lr, out=new)
                param.data = new
    if "step" in optimizer.__dict__:  # what the LR scheduler's wrapper of step records
        optimizer._opt_called = True  # type: ignore[attr-defined]


OUT_OF_PLACE_STEPS: dict[type[Optimizer], tuple[Callable[[Optimizer], bool], Callable[[Optimizer], None]]] = {
    SGD: (_sgd_supported, _sgd_step),
}
"""Per optimizer class (exact type, not subclasses): whether an instance's configuration is supported, and the
out-of-place step. Remove an entry to make that optimizer copy and run its own ``step`` again."""


def out_of_place_step(optimizer: Any) -> Callable[[], None] | None:
    """An exact out-of-place update for ``optimizer`` as configured now, or ``None`` where there is none."""
    entry = OUT_OF_PLACE_STEPS.get(type(optimizer))
    if entry is None or not _hooks_free(optimizer):
        return None
    supported, step = entry
    if not supported(optimizer):
        return None
    return lambda: step(optimizer)


def stash_aware_step(optimizer: Optimizer, stash: WeightStash | None, *, user_code_first: bool) -> Callable[[], Any]:
    """What to run in place of ``optimizer.step()`` when ``stash`` (if not ``None``) shares the live weights.

    Call it before any code that could write the weights in place runs. ``user_code_first``: whether such code
    (user hooks) runs between this call and the step. Without a stash it returns ``optimizer.step``. Otherwise,
    where the update can write fresh storage (:func:`out_of_place_step`) and no user code comes first, it returns
    that update; else it copies the live weights now (:meth:`WeightStash.before_update`) and returns
    ``optimizer.step``.
    """
    if stash is None:
        return optimizer.step
    fresh = None if user_code_first else out_of_place_step(optimizer)
    if fresh is None:
        stash.before_update()
        return optimizer.step

    def run() -> None:
        fresh()
        stash.updated_out_of_place()

    return run
