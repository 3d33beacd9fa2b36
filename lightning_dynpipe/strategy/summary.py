"""Lightning's model summary of the whole pipeline, taken while each process holds only its stage.

Under :class:`~lightning_dynpipe.DynPipeStrategy` a stage process keeps real tensors only for its own layers;
the others are placeholders, and the layers behind them wait on the ``meta`` device (shapes, no data). Lightning's
:class:`~lightning.pytorch.callbacks.ModelSummary` (on by default) counts ``pl_module.parameters()`` at fit start,
so without help rank 0 would report its own stage's parameters as the model's, and a module with an
``example_input_array`` would fail: the summary runs that input through the pipeline outside of a step.

:func:`install` gives each ``ModelSummary`` callback (``RichModelSummary`` too) a summary of the whole pipeline:
the placeholders are swapped back for the ``meta`` layers while Lightning builds it, an ``example_input_array``
runs through the pipeline on the ``meta`` device (every layer sees ``meta`` copies of its tensors, so no data is
touched and the In/Out sizes and FLOPs are the whole model's), and the numbers are frozen before the stage's
module is put back. :func:`uninstall` removes the override at teardown.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import summarize
from torch import nn

from lightning_dynpipe.engine.microbatch import tree_map
from lightning_dynpipe.engine.ties import SharedParameter, resolve, retie

__all__ = ["FrozenSummary", "install", "uninstall", "whole_pipeline_summary"]

_OVERRIDE = "_summary"
_MARK = "_dynpipe_whole_pipeline_summary"


@dataclass(frozen=True)
class FrozenSummary:
    """The numbers :class:`~lightning.pytorch.callbacks.ModelSummary` reads, taken from the whole pipeline."""

    summary_data: list[tuple[str, list[str]]]
    total_parameters: int
    trainable_parameters: int
    model_size: float
    """Megabytes, at the trainer's precision (Lightning's definition)."""
    total_training_modes: dict[str, int]
    total_flops: int

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        """The table's columns, under the name ``ModelSummary.on_fit_start`` calls."""
        return self.summary_data


def _meta(value: Any) -> Any:
    """``value`` with every tensor replaced by an empty ``meta`` tensor of the same shape and dtype."""
    return tree_map(lambda t: torch.empty_like(t, device="meta"), value)


def _meta_forward(pipeline: nn.Sequential) -> Callable[..., Any]:
    """A forward for ``pipeline`` that runs every layer on ``meta`` copies of its input, parameters and buffers.

    Each layer is still called through ``__call__``, so Lightning's shape hooks on it fire.
    """

    def forward(x: Any) -> Any:
        x = _meta(x)
        for layer in pipeline:
            tensors = {**dict(layer.named_parameters()), **dict(layer.named_buffers())}
            x = torch.func.functional_call(layer, _meta(tensors), (x,))
        return x

    return forward


@contextlib.contextmanager
def _whole_pipeline(
    pipeline: nn.Sequential, offloaded: Mapping[int, nn.Module], ties: Sequence[SharedParameter] = ()
) -> Iterator[None]:
    """Puts the ``meta`` layers in place of the placeholders and a ``meta`` forward on the pipeline; undoes both.

    A parameter shared by layers is one object again for the duration (the offloaded layers hold ``meta``
    copies of it), so the summary counts it once.
    """
    placeholders = {i: pipeline[i] for i in offloaded}
    routed = pipeline.__dict__.get("forward")
    entries = [(owner, leaf, owner._parameters[leaf]) for t in ties for owner, leaf in _owners(pipeline, t, offloaded)]
    try:
        for i, layer in offloaded.items():
            pipeline[i] = layer
        retie(pipeline, ties, range(len(pipeline)))
        pipeline.forward = _meta_forward(pipeline)  # type: ignore[method-assign]
        yield
    finally:
        for owner, leaf, param in entries:  # the skeletons' own meta parameters, not the stage's live ones
            owner._parameters[leaf] = param
        for i, placeholder in placeholders.items():
            pipeline[i] = placeholder
        if routed is not None:
            pipeline.forward = routed  # type: ignore[method-assign]
        else:
            del pipeline.forward


def _owners(
    pipeline: nn.Sequential, tie: SharedParameter, offloaded: Mapping[int, nn.Module]
) -> list[tuple[nn.Module, str]]:
    layers = {i: offloaded.get(i, pipeline[i]) for i in tie.layers}
    return [resolve(layers[i], n) for i, n in tie.occurrences]


def whole_pipeline_summary(
    pl_module: LightningModule,
    pipeline: nn.Sequential,
    offloaded: Mapping[int, nn.Module],
    max_depth: int,
    ties: Sequence[SharedParameter] = (),
) -> FrozenSummary:
    """Lightning's summary of ``pl_module`` as if it held every layer of ``pipeline``.

    Args:
        pl_module: the LightningModule being fitted.
        pipeline: its ``nn.Sequential`` pipeline, with placeholders for the layers other stages own.
        offloaded: the ``meta``-device layers behind the placeholders, by layer index.
        max_depth: as in :class:`~lightning.pytorch.callbacks.ModelSummary`.
        ties: the parameters shared by several layers (counted once, as in the plain model).
    """
    with _whole_pipeline(pipeline, offloaded, ties):
        modes = {module: module.training for module in pl_module.modules()}
        try:
            return _frozen(summarize(pl_module, max_depth=max_depth))
        except Exception as exc:  # the example could not run on `meta` (e.g. `.item()` in forward)
            if pl_module.example_input_array is None:
                raise
            for module, training in modes.items():  # Lightning restores them only after a successful run
                module.training = training
            warnings.warn(
                f"The model summary could not run example_input_array through the model on the meta device "
                f"({type(exc).__name__}: {exc}); it is shown without input/output sizes and FLOPs. Under "
                "DynPipeStrategy each process holds one stage, so the example runs on meta tensors; keep "
                "forward free of data-dependent calls such as .item() to get them.",
                UserWarning,
                stacklevel=2,
            )
        example = pl_module.example_input_array
        pl_module.example_input_array = None
        try:
            return _frozen(summarize(pl_module, max_depth=max_depth))
        finally:
            pl_module.example_input_array = example


def _frozen(summary: Any) -> FrozenSummary:
    """The numbers ``ModelSummary.on_fit_start`` reads, taken now (Lightning computes them lazily)."""
    return FrozenSummary(
        summary_data=summary._get_summary_data(),
        total_parameters=summary.total_parameters,
        trainable_parameters=summary.trainable_parameters,
        model_size=summary.model_size,
        total_training_modes=summary.total_training_modes,
        total_flops=summary.total_flops,
    )


def install(
    callbacks: list[Any],
    pipeline_of: Callable[[], nn.Sequential],
    offloaded: Mapping[int, nn.Module],
    ties: Sequence[SharedParameter] = (),
) -> list[ModelSummary]:
    """Makes every :class:`~lightning.pytorch.callbacks.ModelSummary` in ``callbacks`` summarise the whole pipeline.

    Returns the callbacks changed, for :func:`uninstall`. A callback whose ``_summary`` the user replaced is
    left alone.
    """
    changed = []
    for callback in callbacks:
        if not isinstance(callback, ModelSummary) or _OVERRIDE in vars(callback):
            continue

        def _summary(trainer: Trainer, pl_module: LightningModule, *, cb: ModelSummary = callback) -> FrozenSummary:
            return whole_pipeline_summary(pl_module, pipeline_of(), offloaded, cb._max_depth, ties)

        setattr(callback, _OVERRIDE, _summary)
        setattr(callback, _MARK, True)
        changed.append(callback)
    return changed


def uninstall(callbacks: list[ModelSummary]) -> None:
    """Removes what :func:`install` added to ``callbacks``."""
    for callback in callbacks:
        if vars(callback).pop(_MARK, False):
            vars(callback).pop(_OVERRIDE, None)
