"""What the strategy adds to the Trainer: the metrics mirror, and a filter for one warning that does not apply.

The user's steps run on the last stage only (global rank 0 of each pipeline), so the other ranks need the
monitored values for ``ModelCheckpoint``, ``EarlyStopping`` and ``ReduceLROnPlateau``: :class:`MetricsMirror`
copies them. The whole-pipeline model summary is in :mod:`lightning_dynpipe.strategy.summary`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from typing_extensions import override

from lightning_dynpipe.strategy.sigterm import (
    LaggedSigtermCheck,
    install_lagged_sigterm_check,
    remove_lagged_sigterm_check,
)

__all__ = [
    "MetricsMirror",
    "TrainerAdditions",
    "bind_metrics",
    "metrics_schema",
    "restore_sync_dist_advice",
    "silence_sync_dist_advice",
]

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


_Schema = tuple[tuple[str, torch.dtype], ...]
"""The names and dtypes of a ``callback_metrics`` dict whose every value is a 0-dim floating-point tensor."""


def metrics_schema(metrics: Mapping[str, Any]) -> _Schema | None:
    """``(name, dtype)`` of every metric, in order, if all are 0-dim floating-point tensors; else ``None``.

    Such metrics travel as one float64 tensor (float64 holds every float16, bfloat16 and float32 value exactly).
    """
    schema = []
    for k, v in metrics.items():
        if not (isinstance(v, Tensor) and v.dim() == 0 and v.is_floating_point()):
            return None
        schema.append((k, v.dtype))
    return tuple(schema)


class MetricsMirror(Callback):
    """Copies the last stage's ``callback_metrics`` to every rank before monitoring callbacks read them.

    While the metric names stay the same (training steps log the same values each step), one broadcast of a
    float64 tensor carries the values; when the names change (the first step, after a validation, at an
    epoch's end) or a value is not a 0-dim floating-point tensor, the whole dict follows as a pickled object,
    and every rank records the new names. Either way every rank ends with rank 0's values and dtypes.

    Args:
        device: where the mirrored tensors are placed on the receiving ranks.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._schema: _Schema | None = None  # the names agreed by every rank at the last object broadcast
        self.object_broadcasts = 0  # how often the dict travelled as an object (tests and profiles read it)

    def _mirror(self, trainer: Trainer) -> None:
        if trainer.world_size == 1 or not dist.is_initialized():
            return
        src = trainer.is_global_zero
        metrics = trainer.callback_metrics if src else {}
        known = self._schema
        wire = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        values = torch.zeros(1 + len(known or ()), dtype=torch.float64, device=wire)
        if src and known is not None and metrics_schema(metrics) == known:
            values[0] = 1.0
            if known:
                values[1:] = torch.stack([metrics[k].detach().to(device=wire, dtype=torch.float64) for k, _ in known])
        dist.broadcast(values, src=0)
        if values[0].item() == 1.0:
            if not src and known:
                host = values[1:].to(self.device)
                trainer._logger_connector._callback_metrics.update(
                    {k: host[i].to(dtype, copy=True) for i, (k, dtype) in enumerate(known)}  # own tensors
                )
            return
        payload: list[Any] = [None]
        if src:
            payload[0] = {k: (v.detach().cpu() if isinstance(v, Tensor) else v) for k, v in metrics.items()}
        dist.broadcast_object_list(payload, src=0)
        self.object_broadcasts += 1
        self._schema = metrics_schema(payload[0])
        if not src:
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


def bind_metrics(module: LightningModule, stage_dp_group: Any, replicas: int) -> None:
    """Points the torchmetrics in ``module`` at the last stage's replicas (only the last stage updates them;
    syncing over all ranks would wait for the other stages forever)."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics ships with lightning
        return
    for m in module.modules():
        if isinstance(m, Metric):
            if replicas == 1 or stage_dp_group is None:
                m.distributed_available_fn = lambda: False
            else:
                m.process_group = stage_dp_group


class TrainerAdditions:
    """What the strategy adds to a Trainer for one run, and takes away at teardown.

    The metrics mirror (every run), the ``sync_dist`` advice filter (one pipeline), and for a fit the
    whole-pipeline model summary, the interference callback and, with more than one process, the SIGTERM flag's
    broadcast one batch late (:class:`~lightning_dynpipe.strategy.sigterm.LaggedSigtermCheck`; the monitor and the
    adaptive loop are :class:`~lightning_dynpipe.strategy.adaptation.AdaptationWiring`'s).
    """

    def __init__(self) -> None:
        self.mirror: MetricsMirror | None = None
        self.sigterm: LaggedSigtermCheck | None = None
        self.summaries: list[Any] = []
        self.interference: Callback | None = None
        self._filter: Any = None

    def install(
        self,
        trainer: Trainer,
        *,
        device: torch.device,
        replicas: int,
        fitting: bool,
        summary_of: Callable[[list[Any]], list[Any]] | None,
        interference: Any = None,
        num_stages: int = 1,
    ) -> None:
        """Adds the mirror and the filter; for a fit, the whole-pipeline summary and the interference schedule.

        Args:
            trainer: the Trainer.
            device: where mirrored metrics go.
            replicas: pipeline replicas (the filter only applies to one).
            fitting: whether the run trains.
            summary_of: installs the whole-pipeline summary on the callbacks and returns those changed.
            interference: the interference schedule, if any.
            num_stages: ``S``, to validate the interference schedule.
        """
        callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
        if replicas == 1 and self._filter is None:
            self._filter = silence_sync_dist_advice()
        if self.mirror is None:
            self.mirror = MetricsMirror(device)
            callbacks.insert(0, self.mirror)
        if not fitting:
            return
        if not self.summaries and summary_of is not None:
            self.summaries = summary_of(callbacks)
        if self.sigterm is None and trainer.world_size > 1:
            self.sigterm = install_lagged_sigterm_check(trainer, device)
        if interference is not None and self.interference is None:
            from lightning_dynpipe.interference.callback import InterferenceCallback

            interference.validate(num_stages)
            self.interference = InterferenceCallback(interference)
            callbacks.append(self.interference)

    def remove(self, trainer: Trainer | None, module: LightningModule | None) -> None:
        """Takes away everything :meth:`install` added (interference sources still running are stopped)."""
        from lightning_dynpipe.strategy import summary

        callbacks: list[Any] = trainer.callbacks if trainer is not None else []  # type: ignore[attr-defined]
        if self.mirror is not None and self.mirror in callbacks:
            callbacks.remove(self.mirror)
        self.mirror = None
        remove_lagged_sigterm_check(trainer, self.sigterm)
        self.sigterm = None
        summary.uninstall(self.summaries)
        self.summaries = []
        if self.interference is not None and self.interference in callbacks:
            self.interference.teardown(cast(Trainer, trainer), cast(LightningModule, module), "fit")
            callbacks.remove(self.interference)
        self.interference = None
        if self._filter is not None:
            restore_sync_dist_advice(self._filter)
            self._filter = None
