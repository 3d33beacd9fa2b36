"""``self.log`` inside ``training_step`` once per step instead of once per micro-batch.

Under the strategy the user's ``training_step`` runs ``M`` times per Lightning step, once per micro-batch, and
each ``self.log`` call inside it is a call into Lightning's result collection (about 1.4 ms of CPU each in
``benchmarks/profile_step.py``, on the last stage, which is on the pipeline's critical path). With
``DynPipeStrategy(microbatch_logging="step")`` (the default) the calls of a step's first ``M - 1``
micro-batches are only recorded; at the step's last micro-batch every name is logged once, with its values
reduced as Lightning would reduce them:

* ``reduce_fx="mean"`` (the default): the mean weighted by each call's ``batch_size``, or by the micro-batch's
  sample count where no ``batch_size`` was given (by the terms its loss averages where the module defines
  ``loss_terms``, so that a token-mean loss's step value is the whole batch's; a value of weight 0 counts for
  nothing); logged with the sum of the given batch sizes (or none, so
  Lightning infers the step's batch size as before);
* ``"sum"``, ``"max"``, ``"min"``: the sum, maximum or minimum of the step's values.

So the epoch value (``on_epoch``) is what ``M`` calls gave (a batch-size-weighted mean over the epoch; for
ragged micro-batches, weighted by their true sizes), and the step value (``on_step``: the progress bar, a
logger's per-step row) is the step's mean, where ``M`` calls would have shown the last micro-batch's value
alone: for a mean loss, the value a plain single-process run logs for the whole batch.

Calls this cannot reduce exactly go through at once, as with ``microbatch_logging="each"``: a
``torchmetrics.Metric`` value (it accumulates itself), ``enable_graph=True``, and any other ``reduce_fx``.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_dynpipe.errors import ConfigurationError

__all__ = ["StepLogs"]

_REDUCERS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    # a value of weight 0 counts for nothing, NaN included (a micro-batch's mean loss over no terms)
    "mean": lambda v, w: torch.where(w > 0, v * w, 0.0).sum() / w.sum(),
    "sum": lambda v, w: v.sum(),
    "max": lambda v, w: v.max(),
    "min": lambda v, w: v.min(),
}
_LOG_SIGNATURE = inspect.signature(LightningModule.log)
_TORCH_REDUCERS = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}


@dataclass
class _Name:
    """The calls recorded for one logged name in the current step."""

    reduce_fx: str
    values: list[Tensor] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    batch_sizes: list[int | None] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)


class StepLogs:
    """Records ``module.log`` calls over a step's micro-batches and logs each name once at the end.

    Example::

        logs = StepLogs(module)
        for slot in range(M):
            with logs.capture(weight=sizes[slot], last=slot == M - 1):
                module.training_step(micro_batches[slot], batch_idx)

    Args:
        module: the LightningModule whose ``log`` is recorded while :meth:`capture` is active.
    """

    def __init__(self, module: LightningModule) -> None:
        self.module = module
        self._names: dict[str, _Name] = {}
        self._weight = 1.0

    @contextmanager
    def capture(self, weight: float, last: bool) -> Iterator[None]:
        """Records the module's ``log`` calls inside the block; after the step's ``last`` micro-batch, logs them.

        Args:
            weight: the micro-batch's weight in the step's mean (of its values without ``batch_size``): its sample
                count, or the terms its loss averages where the module defines ``loss_terms``.
            last: whether this is the step's last micro-batch: the recorded names are logged when it ends.
        """
        self._weight = float(weight)
        attrs = self.module.__dict__  # an instance attribute shadows the class's method (no Module.__setattr__)
        attrs["log"] = self._record
        try:
            yield
        finally:
            attrs.pop("log", None)  # back to the class's method
        if last:
            self.flush()

    def reset(self) -> None:
        """Forgets what was recorded (a step that failed or was interrupted)."""
        self._names.clear()

    def flush(self) -> None:
        """Logs every recorded name once, reduced as the module docstring says, then forgets them."""
        names, self._names = self._names, {}
        for name, rec in names.items():
            values = torch.stack([v.to(torch.float64) for v in rec.values])
            given = [b for b in rec.batch_sizes if b is not None]
            if len(given) == len(rec.batch_sizes):
                weights, batch_size = [float(b) for b in given], sum(given)
            else:
                weights, batch_size = rec.weights, None
            w = torch.tensor(weights, dtype=torch.float64, device=values.device)
            reduced = _REDUCERS[rec.reduce_fx](values, w)
            dtype = rec.values[-1].dtype if rec.values[-1].is_floating_point() else torch.get_default_dtype()
            type(self.module).log(
                self.module, name, reduced.to(dtype), reduce_fx=rec.reduce_fx, batch_size=batch_size, **rec.kwargs
            )

    def _record(
        self,
        name: str,
        value: Any,
        *args: Any,
        reduce_fx: Any = "mean",
        batch_size: int | None = None,
        enable_graph: bool = False,
        **kwargs: Any,
    ) -> None:
        if args:  # options given by position: name them as LightningModule.log would
            bound = _LOG_SIGNATURE.bind(self.module, name, value, *args, **kwargs)
            kwargs = {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value")}
            reduce_fx = kwargs.pop("reduce_fx", reduce_fx)
            batch_size = kwargs.pop("batch_size", batch_size)
            enable_graph = kwargs.pop("enable_graph", enable_graph)
        fx = _TORCH_REDUCERS.get(reduce_fx, reduce_fx)
        scalar = _scalar(value)
        if scalar is None or enable_graph or fx not in _REDUCERS:  # cannot be reduced exactly: goes through
            type(self.module).log(
                self.module,
                name,
                value,
                reduce_fx=reduce_fx,
                batch_size=batch_size,
                enable_graph=enable_graph,
                **kwargs,
            )
            return
        reduce_fx = fx
        call = kwargs
        rec = self._names.get(name)
        if rec is None:
            rec = self._names[name] = _Name(reduce_fx)
        elif rec.reduce_fx != reduce_fx:
            raise ConfigurationError(
                f"self.log({name!r}, ...) was called with reduce_fx={rec.reduce_fx!r} and {reduce_fx!r} in the same "
                "step. Under DynPipeStrategy(microbatch_logging='step') a name is reduced over the step's "
                "micro-batches once: log it with one reduce_fx, or pass microbatch_logging='each'."
            )
        rec.values.append(scalar)
        rec.weights.append(self._weight)
        rec.batch_sizes.append(batch_size)
        rec.kwargs = call


def _scalar(value: Any) -> Tensor | None:
    """``value`` as a detached one-element tensor, or ``None`` when it is not a plain number or tensor."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            return None  # Lightning refuses it with its own message
        return value.detach().reshape(())
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        f = float(value)  # type: ignore[arg-type]
        return torch.tensor(f, dtype=torch.get_default_dtype())
    return None
