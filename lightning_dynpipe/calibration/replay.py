"""Single-process replay of PipeDream semantics: the reference for the async pipeline, and a staleness emulator.

:func:`replay_async` trains an ``nn.Sequential`` in one process exactly as the asynchronous 1F1B pipeline
does, without any pipeline: stage ``k``'s forward of micro-batch ``i`` (counted since the last drain) uses its
weights after ``max(0, i - staleness_k)`` updates, the backward differentiates through those same weights
(weight stashing), and every update applies to the live weights in micro-batch order. With the default
staleness ``S-1-k`` it is the reference the multi-process tests compare against; with any other staleness
profile it emulates what that pipeline depth would do to convergence, which is how the planner's convergence
model is calibrated on a user's own model and data.

Example::

    replay_async(model.pipeline, balance=[2, 1], make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                 batches=batches, num_microbatches=4,
                 loss_fn=lambda out, batch: F.cross_entropy(out, batch[1]))
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.optim import Optimizer

from lightning_dynpipe.engine.microbatch import split_microbatches
from lightning_dynpipe.engine.updates import scaled_lr
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.partition import Partition

__all__ = ["replay_async", "default_staleness"]


def default_staleness(num_stages: int) -> list[int]:
    """PipeDream's staleness profile: ``S-1-k`` updates for stage ``k``."""
    return [num_stages - 1 - k for k in range(num_stages)]


def _checked(staleness: list[int], num_stages: int) -> list[int]:
    if len(staleness) != num_stages or any(s < 0 for s in staleness):
        raise ConfigurationError(f"staleness needs {num_stages} non-negative entries, one per stage; got {staleness}.")
    return staleness


def _default_input(batch: Any) -> Any:
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def replay_async(
    pipeline: nn.Sequential,
    balance: Sequence[int],
    make_optimizer: Callable[[list[nn.Parameter]], Optimizer],
    batches: Iterable[Any],
    num_microbatches: int,
    loss_fn: Callable[[Any, Any], Tensor],
    *,
    staleness: Sequence[int] | None = None,
    input_fn: Callable[[Any], Any] = _default_input,
    drain_after_steps: Collection[int] = (),
    repartitions: Mapping[int, Sequence[int]] | None = None,
    restaleness: Mapping[int, Sequence[int]] | None = None,
    on_step_end: Callable[[int, list[float]], None] | None = None,
    lr_scale: float = 1.0,
    split: Callable[[Any], Sequence[Any]] | None = None,
) -> list[float]:
    """Trains ``pipeline`` in place with PipeDream semantics; returns the loss of every micro-batch.

    Args:
        pipeline: the layers; its parameters are updated in place.
        balance: layers per stage.
        make_optimizer: builds the optimizer of a group of parameters (called once per layer; the optimizers
            of the supported kind, element-wise like SGD and Adam, then behave as one per stage).
        batches: the Lightning batches, in order.
        num_microbatches: ``M``.
        loss_fn: ``loss_fn(output, micro_batch)``, the loss of one micro-batch.
        staleness: updates between a micro-batch's forward and its update, per stage; default ``S-1-k``.
        input_fn: maps a micro-batch to the pipeline input.
        drain_after_steps: step indices (0-based) after which the pipeline drains (validation, checkpoints):
            the micro-batch counter restarts there.
        repartitions: ``{step: balance}``: after that step the pipeline drains and continues with the new
            balance (what :meth:`DynPipeStrategy.repartition` does; the optimizer state moves with the layers).
        restaleness: ``{step: staleness}``: after that step the pipeline drains and continues with that staleness
            per stage (what :meth:`DynPipeStrategy.reschedule` to another ``"async+d"`` does).
        on_step_end: called with ``(step, losses of that step)`` after each step.
        lr_scale: multiplies the learning rate of every update, as ``DynPipeStrategy(lr_scale=...)`` does.
        split: maps a batch to its ``num_microbatches`` micro-batches; default: near-equal parts along dim 0
            (:func:`~lightning_dynpipe.engine.microbatch.split_microbatches`). With data-parallel replicas and an
            uneven ``replica_split``, micro-batch ``i`` of the pipeline is the union of every replica's
            micro-batch ``i``, whose sizes differ: give them here.
    """
    part = Partition.from_balance(balance, len(pipeline))
    S = part.num_stages
    stale = _checked(list(staleness) if staleness is not None else default_staleness(S), S)
    later = {step: _checked(list(v), S) for step, v in (restaleness or {}).items()}
    layer_opts = [make_optimizer(ps) if (ps := list(layer.parameters())) else None for layer in pipeline]

    def build(
        part: Partition,
    ) -> tuple[list[nn.Sequential], list[list[str]], list[list[nn.Parameter]], list[list[Optimizer]]]:
        stages = [nn.Sequential(*[pipeline[i] for i in part.stage_layers(k)]) for k in range(S)]
        names = [[n for n, _ in st.named_parameters()] for st in stages]
        live = [[p for _, p in st.named_parameters()] for st in stages]
        opts = [[o for i in part.stage_layers(k) if (o := layer_opts[i]) is not None] for k in range(S)]
        return stages, names, live, opts

    stages, names, live, opts = build(part)

    def snapshot(k: int) -> dict[str, Tensor]:
        return {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in zip(names[k], live[k])}

    # history[k][v]: stage k's weights after v updates since the last drain (pruned to what is still needed)
    history: list[dict[int, dict[str, Tensor]]] = [{0: snapshot(k)} for k in range(S)]
    i = 0  # micro-batch index since the last drain
    losses: list[float] = []
    for step, batch in enumerate(batches):
        mbs = list(split(batch)) if split is not None else split_microbatches(batch, num_microbatches)[0]
        if len(mbs) != num_microbatches:
            raise ConfigurationError(
                f"split returned {len(mbs)} micro-batches for step {step}; the pipeline runs num_microbatches="
                f"{num_microbatches} per step."
            )
        step_losses = []
        for mb in mbs:
            used = [history[k][max(0, i - stale[k])] for k in range(S)]
            x = input_fn(mb)
            for k in range(S):
                x = functional_call(stages[k], used[k], (x,))
            loss = loss_fn(x, mb)
            wrt = [t for k in range(S) for t in used[k].values() if t.requires_grad]
            grads = iter(torch.autograd.grad(loss, wrt, allow_unused=True))
            for k in range(S):
                for p, t in zip(live[k], used[k].values()):
                    if t.requires_grad:
                        g = next(grads)
                        p.grad = None if g is None else g.clone()
                for opt in opts[k]:
                    with scaled_lr(opt, lr_scale):
                        opt.step()
                    opt.zero_grad(set_to_none=True)
                history[k][i + 1] = snapshot(k)
                for v in [v for v in history[k] if v < i + 1 - stale[k]]:
                    del history[k][v]
            step_losses.append(float(loss.detach()))
            i += 1
        losses.extend(step_losses)
        if on_step_end is not None:
            on_step_end(step, step_losses)
        if repartitions and step in repartitions:
            stages, names, live, opts = build(Partition.from_balance(repartitions[step], len(pipeline)))
        if step in later:
            stale = later[step]
        if step in drain_after_steps or (repartitions and step in repartitions) or step in later:
            i = 0
            history = [{0: snapshot(k)} for k in range(S)]
    return losses
