"""Clipping by norm over every stage of a pipeline, as one device clips: for the schedules with a flush.

Lightning clips by norm through the precision plugin's ``clip_grad_by_norm(optimizer, clip_val)``, that is
``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters. On a stage those are the stage's own, so each
stage would scale its gradient by its own norm, and the update would not be one device's (whose norm is over the
whole model's gradient). Under ``sync`` and ``gpipe`` every stage updates once per step from the whole batch's
gradient, so the whole model's norm exists: :func:`clip_by_pipeline_norm` sums the squares of the stages' norms in
one all-reduce of a single number over the pipeline's stages and scales every stage by the same factor, with the
operations ``clip_grad_norm_`` runs (``tests/strategy/test_numerics.py`` compares with one device to 1e-6). A
parameter shared across stages (tied weights, whose copies hold the summed gradient by then) counts once, on the
first stage that holds it.

Under ``async`` each stage updates from one micro-batch at its own time: there is no whole-model gradient, and each
stage clips by its own norm (the strategy warns once per fit).

Every stage calls the all-reduce once per clipping call, so the calls must happen on every stage alike: Lightning's
own clipping (``gradient_clip_val``) and a ``configure_gradient_clipping`` that clips on every update or on none do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

from lightning_dynpipe.engine.collectives import Collectives

__all__ = ["clip_by_pipeline_norm", "PipelineNormClipping"]


def clip_by_pipeline_norm(
    params: list[torch.nn.Parameter],
    clip_val: float,
    collectives: Collectives,
    *,
    counted_elsewhere: set[int],
    device: torch.device,
) -> torch.Tensor:
    """Scales the gradients of ``params`` (this stage's) so that the pipeline's whole gradient has norm at most
    ``clip_val``; returns that norm. Collective over the pipeline's stages: every stage calls it.

    Args:
        params: this stage's parameters (those without a gradient are left out).
        clip_val: the largest norm, as ``torch.nn.utils.clip_grad_norm_``'s ``max_norm``.
        collectives: the pipeline's stages.
        counted_elsewhere: ids of parameters whose gradient another stage counts (copies of shared parameters).
        device: where the all-reduced number lives (the process group's device).
    """
    with_grad = [p for p in params if p.grad is not None]
    counted = [g for p in with_grad if id(p) not in counted_elsewhere and (g := p.grad) is not None]
    local = torch.nn.utils.get_total_norm(counted) if counted else torch.zeros((), device=device)
    squares = local.detach().to(device=device, dtype=torch.float64).square().reshape(1)
    collectives.all_reduce_sum(squares)
    total = squares.sqrt().reshape(())
    if with_grad:
        grad = with_grad[0].grad
        assert grad is not None
        # in the gradients' dtype, as clip_grad_norm_ computes it on one device
        torch.nn.utils.clip_grads_with_norm_(with_grad, clip_val, total.to(device=grad.device, dtype=grad.dtype))
    return total


class PipelineNormClipping:
    """Makes a precision plugin's clipping by norm use the pipeline's norm, for one fit.

    Example::

        clipping = PipelineNormClipping(precision_plugin, stage.pipeline_collectives, counted_elsewhere, device)
        clipping.install()      # precision_plugin.clip_grad_by_norm now clips by the pipeline's norm
        ...
        clipping.remove()
    """

    def __init__(
        self,
        precision: Precision,
        collectives: Callable[[], Collectives],
        counted_elsewhere: Callable[[], set[int]],
        device: torch.device,
    ) -> None:
        self.precision = precision
        self._collectives = collectives
        self._counted_elsewhere = counted_elsewhere
        self._device = device
        self.calls = 0
        """How often it clipped (every stage counts the same)."""

    @staticmethod
    def supports(precision: Precision) -> bool:
        """Whether the plugin clips by norm as Lightning's base plugin does (a plugin's own clipping is its own)."""
        return type(precision).clip_grad_by_norm is Precision.clip_grad_by_norm

    def install(self) -> None:
        """Shadows the plugin's ``clip_grad_by_norm`` on this instance."""
        self.precision.clip_grad_by_norm = self._clip  # type: ignore[method-assign]

    def remove(self) -> None:
        """Restores the plugin's own method."""
        self.precision.__dict__.pop("clip_grad_by_norm", None)

    def _clip(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.calls += 1
        params = list(self.precision.main_params(optimizer))
        clip_by_pipeline_norm(
            params,
            float(clip_val),
            self._collectives(),
            counted_elsewhere=self._counted_elsewhere(),
            device=self._device,
        )
