"""Optimizer updates that write the new weights to fresh storage, so that weight stashing needs no copy; and
the same updates in place, without ``Optimizer.step``'s per-call wrapper (:func:`direct_step`).

Under ``async`` a stage updates its weights while a micro-batch whose forward used them is still waiting for its
backward. :class:`~lightning_dynpipe.engine.stash.WeightStash` keeps that micro-batch's version as an alias of
the live weights' storage, so before an in-place optimizer step the live weights must first move to a copy (one
read and one write of every weight, ``M`` times per step on the first ``S-1`` stages). An update that reads the
old weights and writes the new ones to fresh storage leaves the old storage to the stash for free: the same
arithmetic, the copy gone. The new weights go into the parameter's gradient when nothing else holds it or its
memory (:func:`private_grad`): the update reads the gradient for the last time just before, so its memory is free,
and it is in cache, having just been written by the backward. Writing a released version's memory or new memory
instead cost 1.4-2.0x as much on the throughput benchmark's MLP (stage 0 under ``async``: 2.2-2.6 against 1.3-1.6
ms of CPU per step for its four updates; an in-place update of a stage that size, 1.4), the destination having to
be read into the cache first. The update then sets that parameter's ``grad`` to ``None``: the step consumed it.

:func:`out_of_place_step` returns such an update for the optimizers whose step this module reproduces exactly,
and ``None`` for everything else (the caller then copies and runs the optimizer's own ``step``). Today those are
``torch.optim.SGD`` (momentum, dampening, Nesterov, weight decay, ``maximize``), ``torch.optim.Adam`` and
``torch.optim.AdamW`` (weight decay, AMSGrad, ``maximize``) on real CPU tensors, in their default per-tensor
implementations: every tensor operation of ``torch.optim.sgd._single_tensor_sgd`` and
``torch.optim.adam._single_tensor_adam`` is kept, in order, and only those that write the parameter
(``param.add_``; ``param.mul_`` and ``param.addcdiv_``) write a new tensor instead. An optimizer with step hooks,
a subclass, a patched ``step`` (other than an LR scheduler's call counter), tensor hyper-parameters,
``foreach=True``, ``fused=True``, ``capturable=True``, ``differentiable=True``, sparse gradients, complex or
non-CPU parameters gets ``None``, and so does every optimizer under a torch version the reproduction was not
checked against (:data:`VERIFIED_TORCH`). ``tests/engine/test_outofplace.py`` checks bit-for-bit equality with
``optimizer.step()``.

Example::

    step = stash_aware_step(optimizer, executor.update_stash, user_code_first=False)
    ...                                # gradient all-reduces, hooks that do not write the weights
    step()                             # optimizer.step(), or its out-of-place twin
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import SGD, Adam, AdamW, Optimizer
from torch.optim import optimizer as _torch_optimizer
from torch.optim.optimizer import _get_value

from lightning_dynpipe.engine.stash import WeightStash

__all__ = [
    "OUT_OF_PLACE_STEPS",
    "VERIFIED_TORCH",
    "direct_step",
    "out_of_place_step",
    "private_grad",
    "stash_aware_step",
]

_TORCH = tuple(int(x) for x in torch.__version__.split(".")[:2])


_Holders = tuple[int, int, int, int, int]


def _grad_holders(param: Tensor) -> _Holders:
    """Who holds ``param.grad``: Python references to it (this function's own included), its tensor's C++ owners
    (the parameter, its Python object, views of it), the tensors on its memory (plus the storage object read here);
    and where the gradient is a view (autograd's gradient of a transposed weight can be), the same two counts of the
    tensor it views (else zeros)."""
    grad = param.grad
    assert grad is not None
    base = grad._base
    counts = (
        sys.getrefcount(grad),
        grad._use_count(),  # type: ignore[attr-defined]
        torch._C._storage_Use_Count(grad.untyped_storage()._cdata),
    )
    if base is None:
        return (*counts, 0, 0)
    return (*counts, sys.getrefcount(base), base._use_count())  # type: ignore[attr-defined]


@functools.cache
def _alone() -> dict[bool, _Holders] | None:
    """:func:`_grad_holders` of a gradient nobody else holds, measured on this interpreter, for a gradient of its own
    (``False``) and for a view of a tensor nobody else holds (``True``); ``None`` if the counts do not tell a gradient
    held elsewhere (another reference, a view, an alias of its memory) from one that is not: :func:`private_grad`
    then finds no gradient private. ``None`` too where torch lacks one of the counters read."""
    if not (hasattr(Tensor, "_use_count") and hasattr(torch._C, "_storage_Use_Count")):
        return None
    alone: dict[bool, _Holders] = {}
    for is_view in (False, True):
        p = torch.zeros(3, 2, requires_grad=True)
        p.grad = torch.ones(2, 3).t() if is_view else torch.ones(3, 2)
        alone[is_view] = _grad_holders(p)
        held = p.grad
        referenced = _grad_holders(p)
        del held
        view = p.grad[:1]
        viewed = _grad_holders(p)
        del view
        alias = p.grad.detach()
        aliased = _grad_holders(p)
        del alias
        others = [referenced, viewed, aliased]
        if is_view:
            held_base = p.grad._base
            others.append(_grad_holders(p))
            del held_base
            base_view = p.grad._base.view(-1)  # type: ignore[union-attr]
            others.append(_grad_holders(p))
            del base_view
        if alone[is_view] != _grad_holders(p) or alone[is_view] in others:
            return None
    return alone


def private_grad(param: Tensor) -> bool:
    """Whether ``param.grad`` is a plain dense tensor laid out as ``param``, on memory of its own, that nothing but
    ``param`` holds: no other reference to it (a list a hook kept, a local), no view of it and no other tensor on its
    memory (a flat gradient buffer, ``.data``, ``detach()``). A gradient that views a tensor of exactly its size
    (autograd's gradient of a transposed weight) qualifies when nothing else holds that tensor either. Only then may
    an update write the new weights into that memory without anyone seeing the gradient change."""
    grad = param.grad
    if (
        grad is None
        or type(grad) is not Tensor
        or grad.layout != torch.strided
        or grad.requires_grad
        or grad.is_conj()
        or grad.is_neg()
        or grad.dtype != param.dtype
        or grad.device != param.device
        or grad.shape != param.shape
        or grad.stride() != param.stride()
        or grad.storage_offset() != 0
        or grad.untyped_storage().nbytes() != grad.numel() * grad.element_size()
    ):
        return False
    base = grad._base
    if base is not None and (type(base) is not Tensor or base.numel() != grad.numel() or base.storage_offset() != 0):
        return False
    is_view = base is not None
    del grad, base
    alone = _alone()
    return alone is not None and _grad_holders(param) == alone[is_view]


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


def _plain_group(group: dict[str, Any], scalars: tuple[Any, ...]) -> bool:
    """The per-tensor implementation on real, dense CPU tensors with float hyper-parameters: what the steps
    here reproduce (``foreach``, ``fused``, ``capturable`` and ``differentiable`` run other code)."""
    if any(group.get(k) for k in ("foreach", "fused", "capturable", "differentiable")):
        return False
    if any(isinstance(v, Tensor) for v in scalars):
        return False
    for p in group["params"]:
        if p.device.type != "cpu" or torch.is_complex(p):
            return False
        if p.grad is not None and (p.grad.is_sparse or p.grad.device != p.device):
            return False
    return True


def _sgd_supported(optimizer: Optimizer) -> bool:
    return all(
        _plain_group(g, (g["lr"], g["weight_decay"], g["momentum"], g["dampening"])) for g in optimizer.param_groups
    )


def _fresh(param: Tensor, stash: WeightStash | None, grad_is_free: bool) -> Tensor:
    """Where ``param``'s new value goes: its gradient's memory when ``grad_is_free`` (:func:`private_grad` said so
    before the update read it; ``param.grad`` becomes ``None``), else a released weight version's tensor, else new
    memory."""
    if grad_is_free:
        out = param.grad
        assert out is not None
        param.grad = None
        if stash is not None:
            stash.took_grad_memory(param)
        return out
    spare = stash.spare(param) if stash is not None else None
    return spare if spare is not None else torch.empty_like(param.data)


def _sgd_step(optimizer: Optimizer, stash: WeightStash | None, in_place: bool = False) -> None:
    """``SGD.step()`` with the per-tensor implementation's arithmetic; the new weights go to fresh storage (see
    :func:`_fresh`), or (``in_place``) into the parameters themselves, as ``SGD.step()`` writes them."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            weight_decay, momentum, lr = group["weight_decay"], group["momentum"], group["lr"]
            dampening, nesterov, maximize = group["dampening"], group["nesterov"], group["maximize"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad_is_free = not in_place and private_grad(param)  # before this loop holds the gradient
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
                if in_place:
                    param.add_(grad, alpha=-lr)
                    continue
                # the gradient is read for the last time here: the sum may go into its memory (elementwise, the
                # output on exactly the memory of an input, as param.add_ has it on param's)
                new = _fresh(param, stash, grad_is_free)
                torch.add(param.data, grad, alpha=-lr, out=new)
                param.data = new
    _record_step_called(optimizer)


def _record_step_called(optimizer: Optimizer) -> None:
    if "step" in optimizer.__dict__:  # what an LR scheduler's wrapper of step records
        optimizer._opt_called = True  # type: ignore[attr-defined]


def _adam_supported(optimizer: Optimizer) -> bool:
    return all(_plain_group(g, (g["lr"], *g["betas"], g["weight_decay"], g["eps"])) for g in optimizer.param_groups)


def _adam_step(optimizer: Optimizer, stash: WeightStash | None, in_place: bool = False) -> None:
    """``Adam.step()`` / ``AdamW.step()`` with the per-tensor implementation's arithmetic (real parameters, not
    capturable, not differentiable); the new weights go to fresh storage (see :func:`_fresh`), or (``in_place``)
    into the parameters themselves, as ``step()`` writes them. AdamW's decoupled weight decay is applied after the
    moments' update instead of before (neither reads what the other writes: the same bits), so that the gradient
    is read for the last time before the new weights are written."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            # before _init_group holds the gradients
            free = set() if in_place else {id(p) for p in group["params"] if private_grad(p)}
            params: list[Tensor] = []
            grads: list[Tensor] = []
            exp_avgs: list[Tensor] = []
            exp_avg_sqs: list[Tensor] = []
            max_exp_avg_sqs: list[Tensor] = []
            steps: list[Tensor] = []
            # torch's own lazy state initialisation, so that the state is what Adam.step would have created
            optimizer._init_group(  # type: ignore[attr-defined]
                group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
            )
            beta1, beta2 = group["betas"]
            lr, weight_decay, eps, amsgrad = group["lr"], group["weight_decay"], group["eps"], group["amsgrad"]
            for i, param in enumerate(params):
                grad = grads[i] if not group["maximize"] else -grads[i]
                exp_avg, exp_avg_sq, step_t = exp_avgs[i], exp_avg_sqs[i], steps[i]
                step_t += 1
                decoupled = weight_decay != 0 and group["decoupled_weight_decay"]
                if weight_decay != 0 and not decoupled:
                    grad = grad.add(param, alpha=weight_decay)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                del grad  # read for the last time: its memory may take the new weights
                new = param if in_place else None
                if decoupled:
                    if in_place:
                        param.mul_(1 - lr * weight_decay)
                    else:
                        fresh = _fresh(param, stash, id(param) in free)
                        new = torch.mul(param.data, 1 - lr * weight_decay, out=fresh)
                step = _get_value(step_t)
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                step_size = lr / bias_correction1
                bias_correction2_sqrt = bias_correction2**0.5
                if amsgrad:
                    torch.maximum(max_exp_avg_sqs[i], exp_avg_sq, out=max_exp_avg_sqs[i])
                    denom = (max_exp_avg_sqs[i].sqrt() / bias_correction2_sqrt).add_(eps)
                else:
                    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
                if new is None:
                    new = _fresh(param, stash, id(param) in free)
                    torch.addcdiv(param.data, exp_avg, denom, value=-step_size, out=new)
                else:
                    new.addcdiv_(exp_avg, denom, value=-step_size)
                if not in_place:
                    param.data = new
    _record_step_called(optimizer)


VERIFIED_TORCH: tuple[tuple[int, int], ...] = ((2, 13),)
"""The torch versions (major, minor) whose optimizers' per-tensor steps the functions here were checked against
(``tests/engine/test_outofplace.py``); under any other version :func:`out_of_place_step` answers ``None``."""

OUT_OF_PLACE_STEPS: dict[
    type[Optimizer], tuple[Callable[[Optimizer], bool], Callable[[Optimizer, WeightStash | None, bool], None]]
] = {
    SGD: (_sgd_supported, _sgd_step),
    Adam: (_adam_supported, _adam_step),
    AdamW: (_adam_supported, _adam_step),
}
"""Per optimizer class (exact type, not subclasses): whether an instance's configuration is supported, and the
step (given the weight stash whose released versions' memory a parameter's new value may go into, or ``None``,
and whether to write the parameters in place instead). Remove an entry to make that optimizer copy and run its own
``step`` again."""


def _reproduced(optimizer: Any) -> Callable[[Optimizer, WeightStash | None, bool], None] | None:
    """The step reproducing ``optimizer.step()`` as configured now, or ``None`` where there is none."""
    entry = OUT_OF_PLACE_STEPS.get(type(optimizer))
    if entry is None or _TORCH not in VERIFIED_TORCH or not _hooks_free(optimizer):
        return None
    supported, step = entry
    return step if supported(optimizer) else None


def out_of_place_step(optimizer: Any, stash: WeightStash | None = None) -> Callable[[], None] | None:
    """An exact out-of-place update for ``optimizer`` as configured now, or ``None`` where there is none.

    A parameter's new value goes into its gradient's memory where that is :func:`private_grad` (its ``grad`` is
    then ``None`` after the update), else into a released weight version of ``stash`` (:meth:`WeightStash.spare`),
    else into new memory.
    """
    step = _reproduced(optimizer)
    if step is None:
        return None
    return lambda: step(optimizer, stash, False)


def direct_step(optimizer: Any) -> Callable[[], Any]:
    """``optimizer.step``, or its exact in-place twin without the call's fixed cost where there is one.

    torch's ``Optimizer.step`` runs inside a wrapper that opens a profiler range, runs the step hooks and
    switches the autograd mode; under ``async`` a stage updates ``M`` times per step, and that wrapper cost about
    70 us an update on the throughput benchmark's last stage. Where :func:`out_of_place_step` would reproduce
    the step (no hooks, a supported configuration, a verified torch) and no profiler is recording (which would
    miss the range), the twin writes the parameters in place with the same tensor operations as the per-tensor
    implementation; otherwise this is ``optimizer.step`` itself.
    """
    step = _reproduced(optimizer)
    if step is None or torch._C._autograd._profiler_enabled():
        return optimizer.step  # type: ignore[no-any-return]
    return lambda: step(optimizer, None, True)


def stash_aware_step(optimizer: Optimizer, stash: WeightStash | None, *, user_code_first: bool) -> Callable[[], Any]:
    """What to run in place of ``optimizer.step()`` when ``stash`` (if not ``None``) shares the live weights.

    Call it before any code that could write the weights in place runs. ``user_code_first``: whether such code
    (user hooks) runs between this call and the step. Without a stash it returns :func:`direct_step`
    (``optimizer.step`` or its exact in-place twin). Otherwise, where the update can write fresh storage
    (:func:`out_of_place_step`) and no user code comes first, it returns that update; else it copies the live
    weights now (:meth:`WeightStash.before_update`) and returns :func:`direct_step`.
    """
    if stash is None:
        return direct_step(optimizer)
    fresh = None if user_code_first else out_of_place_step(optimizer, stash)
    if fresh is None:
        stash.before_update()
        return direct_step(optimizer)

    def run() -> None:
        fresh()
        stash.updated_out_of_place()

    return run
