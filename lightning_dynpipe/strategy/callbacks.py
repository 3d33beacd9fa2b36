"""What the strategy adds to the Trainer: the metrics mirror, and a filter for one warning that does not apply.

The user's steps run on the last stage only (global rank 0 of each pipeline), so the other ranks need the
monitored values for ``ModelCheckpoint``, ``EarlyStopping`` and ``ReduceLROnPlateau``: :class:`MetricsMirror`
copies them. The whole-pipeline model summary is in :mod:`lightning_dynpipe.strategy.summary`.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from typing_extensions import override

__all__ = ["MetricsMirror", "silence_sync_dist_advice", "restore_sync_dist_advice"]

_SYNC_DIST_ADVICE = r"It is recommended to use `self\.log\(.*sync_dist=True\)`"


def silence_sync_dist_advice() -> Any:
    """Hides Lightning's advice to pass ``sync_dist=True`` for epoch-level logs; returns the filter entry.

    Lightning gives it whenever a process group exists. With one pipeline, only the last stage logs, and
    :meth:`DynPipeStrategy.reduce` has nothing to reduce over, so the advice does not apply. With pipeline
    replicas it does (the last stages' replicas see different data), and the strategy leaves it alone.
    """
    warnings.filterwarnings("ignore", message=_SYNC_DIST_ADVICE, category=PossibleUserWarning)
    return warnings.filters[0]


def restore_sync_dist_advice(entry: Any) -> None:
    """Removes a filter installed by :func:`silence_sync_dist_advice` (no-op if it is already gone)."""
    filters = cast(list[Any], warnings.filters)
    if entry in filters:
        filters.remove(entry)
        mutated = getattr(warnings, "_filters_mutated", None)  # invalidates the registries' cached decisions
        if mutated is not None:
            mutated()


class MetricsMirror(Callback):
    """Copies the last stage's ``callback_metrics`` to every rank before monitoring callbacks read them.

    Args:
        device: where the mirrored tensors are placed on the receiving ranks.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _mirror(self, trainer: Trainer) -> None:
        if trainer.world_size == 1 or not dist.is_initialized():
            return
        payload: list[Any] = [None]
        if trainer.is_global_zero:
            payload[0] = {
                k: (v.detach().cpu() if isinstance(v, Tensor) else v) for k, v in trainer.callback_metrics.items()
            }
        dist.broadcast_object_list(payload, src=0)
        if not trainer.is_global_zero:
            trainer._logger_connector._callback_metrics.update(
                {k: (v.to(self.device) if isinstance(v, Tensor) else v) for k, v in payload[0].items()}
            )

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._mirror(trainer)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mirror(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mirror(trainer)
