"""What the strategy adds to the Trainer: the metrics mirror, and a filter for one warning that does not apply.

The user's steps run on the last stage only (global rank 0 of each pipeline), so the other ranks need the
monitored values for ``ModelCheckpoint``, ``EarlyStopping`` and ``ReduceLROnPlateau``: :class:`MetricsMirror`
copies them. The whole-pipeline model summary is in :mod:`lightning_dynpipe.strategy.summary`.
"""

from __future__ import annotations

import functools
import pickle
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerStatus
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
    """Copies the last stage's ``callback_metrics`` to every rank, without making any rank wait for another.

    Rank 0 (the last stage of the first pipeline, where the user's steps log) sends its ``callback_metrics`` at
    every training batch's end, at a training epoch's end and at a validation's end, on a process group of its own
    (gloo, CPU tensors). While the metric names stay the same, one float64 tensor carries the values; when the
    names change (the first step, after a validation, at an epoch's end) or a value is not a 0-dim floating-point
    tensor, the whole dict follows as a pickled object, and every rank records the new names. Either way every
    rank ends with rank 0's values and dtypes.

    Rank 0 starts its sends and goes on (``async_op=True``). Another rank posts its receive at the same point and
    goes on too; it waits for the values only when something reads ``trainer.callback_metrics`` (a
    ``ModelCheckpoint`` about to save, ``EarlyStopping``, ``ReduceLROnPlateau``, a callback of the user's), or at
    its next mirror point, which needs the names of this one. A reader therefore sees what it saw when every
    rank waited at every point, while a rank that reads nothing never waits for rank 0: in a pipeline the stages
    are at different points of a step, and a wait at every batch's end made the first stage wait for the last
    one's step, every step.

    Args:
        device: where the mirrored tensors are placed on the receiving ranks.
        group: the process group of the mirror (every rank); ``None``: the default group.
    """

    _MAX_SENDS_IN_FLIGHT = 8

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.device = device
        self.group = group
        self._schema: _Schema | None = None  # the names agreed by every rank at the last object broadcast
        self.object_broadcasts = 0  # how often the dict travelled as an object (tests and profiles read it)
        self._sends: deque[tuple[Any, list[Tensor]]] = deque()  # rank 0: sends in flight, with their buffers
        self._posted: tuple[Any, Tensor, Trainer] | None = None  # other ranks: the receive posted, not applied

    def _mirror(self, trainer: Trainer) -> None:
        if trainer.world_size == 1 or not dist.is_initialized():
            return
        if trainer.is_global_zero:
            self._send(trainer.callback_metrics)
            return
        self.resolve()  # this point's receive needs the names the last one agreed
        head = torch.empty(2 + len(self._schema or ()), dtype=torch.float64)
        self._posted = (dist.broadcast(head, src=0, group=self.group, async_op=True), head, trainer)

    def _send(self, metrics: Mapping[str, Any]) -> None:
        """Rank 0: starts the sends of one mirror point (``[1, 0, values...]``, or ``[0, nbytes]`` and the dict)."""
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()[0].wait()  # completed: reports an error, frees the buffers
        known = self._schema
        head = torch.zeros(2 + len(known or ()), dtype=torch.float64)
        bufs = [head]
        if known is not None and metrics_schema(metrics) == known:
            head[0] = 1.0
            if known:
                head[2:] = torch.stack([metrics[k].detach().to(device="cpu", dtype=torch.float64) for k, _ in known])
        else:
            payload = {k: (v.detach().cpu() if isinstance(v, Tensor) else v) for k, v in metrics.items()}
            data = torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8)
            head[1] = float(data.numel())
            bufs.append(data)
            self._schema = metrics_schema(payload)
            self.object_broadcasts += 1
        for buf in bufs:
            self._sends.append((dist.broadcast(buf, src=0, group=self.group, async_op=True), bufs))
        while len(self._sends) > self._MAX_SENDS_IN_FLIGHT:  # a receiver this far behind: wait for it
            self._sends.popleft()[0].wait()

    def resolve(self) -> None:
        """Other ranks: waits for the receive posted last, if any, and puts rank 0's values into the trainer's
        ``callback_metrics``. Reading ``trainer.callback_metrics`` calls it (:meth:`attach`)."""
        if self._posted is None:
            return
        work, head, trainer = self._posted
        self._posted = None
        work.wait()
        into = trainer._logger_connector._callback_metrics
        known = self._schema
        if head[0].item() == 1.0:
            if known:
                into.update({k: head[2 + i].to(self.device, dtype, copy=True) for i, (k, dtype) in enumerate(known)})
            return
        data = torch.empty(int(head[1].item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.group)
        payload = pickle.loads(data.numpy().tobytes())
        self.object_broadcasts += 1
        self._schema = metrics_schema(payload)
        into.update({k: (v.to(self.device) if isinstance(v, Tensor) else v) for k, v in payload.items()})

    def finish(self, wait: bool) -> None:
        """At the end of a run: applies the last receive and waits for the sends still in flight (every rank
        reached every point); with ``wait=False`` (a failed run) drops them instead."""
        if wait:
            self.resolve()
            while self._sends:
                self._sends.popleft()[0].wait()
        self._posted = None
        self._sends.clear()

    def attach(self, trainer: Trainer) -> None:
        """Makes ``trainer.callback_metrics`` apply a pending receive first, on the ranks that receive."""
        connector = trainer._logger_connector
        if trainer.is_global_zero or isinstance(connector, _MirroredConnector):
            return
        connector.__class__ = _mirrored_class(type(connector))  # type: ignore[arg-type]  # a class is hashable
        connector._dynpipe_mirror = self  # type: ignore[attr-defined]

    @staticmethod
    def detach(trainer: Trainer) -> None:
        """Undoes :meth:`attach`."""
        connector = trainer._logger_connector
        if isinstance(connector, _MirroredConnector):
            connector.__class__ = connector._dynpipe_base
            del connector._dynpipe_mirror  # type: ignore[attr-defined]

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


class _MirroredConnector:
    """Marks a logger connector whose ``callback_metrics`` first applies the mirror's pending receive."""

    _dynpipe_base: type


@functools.cache
def _mirrored_class(base: type) -> type:
    """A subclass of Lightning's logger connector class ``base`` whose ``callback_metrics`` resolves the mirror."""

    def callback_metrics(self: Any) -> Any:
        self._dynpipe_mirror.resolve()
        return base.callback_metrics.fget(self)  # type: ignore[attr-defined]

    return type(
        f"Mirrored{base.__name__}",
        (_MirroredConnector, base),
        {"callback_metrics": property(callback_metrics), "_dynpipe_base": base},
    )


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
        self._mirror_group: Any = None
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
            group = None
            if trainer.world_size > 1 and dist.is_initialized():  # collective: every rank installs at set-up
                group = self._mirror_group = dist.new_group(backend="gloo")
            self.mirror = MetricsMirror(device, group)
            self.mirror.attach(trainer)
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
        if self.mirror is not None:
            status = getattr(getattr(trainer, "state", None), "status", None)
            self.mirror.finish(wait=status != TrainerStatus.INTERRUPTED)
            if trainer is not None:
                self.mirror.detach(trainer)
            if self.mirror in callbacks:
                callbacks.remove(self.mirror)
        self.mirror = None
        if self._mirror_group is not None:
            dist.destroy_process_group(self._mirror_group)
            self._mirror_group = None
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
