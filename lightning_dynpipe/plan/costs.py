"""Per-layer costs, the communication model, devices, and the stage cost model the planner minimises.

Everything here is plain data plus arithmetic on prefix sums: no torch. The profiler fills
:class:`LayerCost` values; the planner asks a :class:`CostModel` how long a stage owning a contiguous range
of layers takes per micro-batch.

Ranges are half-open everywhere: a stage owning layers ``first .. stop-1`` is the range ``[first, stop)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import ArrayLike, NDArray

from lightning_dynpipe.errors import ConfigurationError

__all__ = [
    "LayerCost",
    "ModelCost",
    "CommModel",
    "DeviceSpec",
    "CostModel",
    "PrefixCostModel",
    "DefaultCostModel",
]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]


def _check_non_negative(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ConfigurationError(
                f"{owner}.{name} must be a finite number >= 0; got {name}={value!r}. "
                "Costs are measured durations and byte counts, so pass the profiled value (0 if unknown)."
            )


@dataclass(frozen=True)
class LayerCost:
    """The measured cost of one pipeline layer for one micro-batch.

    Example::

        >>> cost = LayerCost(forward_s=0.002, backward_s=0.004, activation_bytes=1 << 20, param_bytes=4096)
        >>> cost.compute_s
        0.006

    Attributes:
        forward_s: forward time of the layer, seconds per micro-batch, on an unloaded reference device.
        backward_s: backward time, seconds per micro-batch.
        activation_bytes: bytes of the layer's output for one micro-batch. When the layer is the last of a
            stage this is what crosses the boundary (and its gradient, of the same size, comes back); every
            micro-batch in flight on a stage keeps this much per layer of the stage until its backward.
        param_bytes: bytes of the layer's parameters (one weight version).
        optimizer_state_bytes: bytes of the gradient buffer plus optimizer state of the layer's parameters
            (e.g. ``3 * param_bytes`` for Adam: gradient, ``exp_avg``, ``exp_avg_sq``).
        workspace_bytes: transient peak memory while the layer runs forward or backward, beyond what is
            stored above; freed afterwards, so a stage needs the largest of its layers', once.
        update_s: what the layer's parameters add to one optimizer update, seconds (0: not measured). A schedule
            without a flush updates after every micro-batch, so this is part of every micro-batch's cost there;
            with a flush it is paid once per ``M`` micro-batches.
        held_bytes: bytes one micro-batch keeps for the layer from its forward to its backward: what autograd saves
            (a transformer block's attention weights and intermediate tensors) and the output, each storage once,
            the layer's input and parameters left out (0: not measured; ``activation_bytes`` stands in). Every
            micro-batch in flight on a stage keeps this much per layer of the stage (:attr:`kept_bytes`).
    """

    forward_s: float
    backward_s: float
    activation_bytes: int = 0
    param_bytes: int = 0
    optimizer_state_bytes: int = 0
    workspace_bytes: int = 0
    update_s: float = 0.0
    held_bytes: int = 0

    def __post_init__(self) -> None:
        _check_non_negative(
            "LayerCost",
            forward_s=self.forward_s,
            backward_s=self.backward_s,
            update_s=self.update_s,
            activation_bytes=self.activation_bytes,
            param_bytes=self.param_bytes,
            optimizer_state_bytes=self.optimizer_state_bytes,
            workspace_bytes=self.workspace_bytes,
            held_bytes=self.held_bytes,
        )
        for name in ("activation_bytes", "param_bytes", "optimizer_state_bytes", "workspace_bytes", "held_bytes"):
            value = getattr(self, name)
            if value != int(value):
                raise ConfigurationError(
                    f"LayerCost.{name} counts bytes and must be a whole number; got {value!r}. Round it."
                )
            object.__setattr__(self, name, int(value))

    @property
    def compute_s(self) -> float:
        """Forward plus backward time, seconds per micro-batch."""
        return self.forward_s + self.backward_s

    @property
    def kept_bytes(self) -> int:
        """Bytes one micro-batch in flight keeps for this layer: ``held_bytes``, or ``activation_bytes`` when not
        measured."""
        return self.held_bytes or self.activation_bytes


def _prefix_float(values: Sequence[float]) -> FloatArray:
    out = np.zeros(len(values) + 1, dtype=np.float64)
    np.cumsum(np.asarray(values, dtype=np.float64), out=out[1:])
    out.flags.writeable = False
    return out


def _prefix_int(values: Sequence[int]) -> IntArray:
    out = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(np.asarray(values, dtype=np.int64), out=out[1:])
    out.flags.writeable = False
    return out


@dataclass(frozen=True)
class ModelCost:
    """The costs of all layers of a pipeline, with prefix sums for O(1) range queries.

    Example::

        >>> model = ModelCost.from_arrays(forward_s=[1.0, 2.0, 3.0], backward_s=[2.0, 4.0, 6.0],
        ...                               param_bytes=[10, 0, 30])
        >>> model.compute_s(1, 3), model.param_bytes(0, 2)
        (15.0, 10)

    Attributes:
        layers: one :class:`LayerCost` per layer, ``layer_idx`` order.
    """

    layers: tuple[LayerCost, ...]
    _compute: FloatArray = field(init=False, repr=False, compare=False)
    _update: FloatArray = field(init=False, repr=False, compare=False)
    _params: IntArray = field(init=False, repr=False, compare=False)
    _activations: IntArray = field(init=False, repr=False, compare=False)
    _kept: IntArray = field(init=False, repr=False, compare=False)
    _optimizer: IntArray = field(init=False, repr=False, compare=False)
    _workspace_table: IntArray = field(init=False, repr=False, compare=False)
    _log2: IntArray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        if not layers:
            raise ConfigurationError("ModelCost needs at least one layer; got an empty list of LayerCost.")
        bad = [i for i, layer in enumerate(layers) if not isinstance(layer, LayerCost)]
        if bad:
            raise ConfigurationError(
                f"ModelCost.layers must hold LayerCost values; entries {bad[:5]} are not. "
                "Build them with LayerCost(...) or ModelCost.from_arrays(...)."
            )
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "_compute", _prefix_float([c.compute_s for c in layers]))
        object.__setattr__(self, "_update", _prefix_float([c.update_s for c in layers]))
        object.__setattr__(self, "_params", _prefix_int([c.param_bytes for c in layers]))
        object.__setattr__(self, "_activations", _prefix_int([c.activation_bytes for c in layers]))
        # Each layer is charged at least what its output adds over its input: a stage keeps the message it
        # received besides its layers' kept bytes (plan.memory.activation_memory), so with this floor a stage's
        # memory never shrinks as it takes a layer on its left (the solver's searches over starts need that). Only
        # a layer whose output is not in its held bytes and outweighs its input (one returning a buffer, say) is
        # charged more than measured.
        acts = [c.activation_bytes for c in layers]
        floors = [acts[0], *(a - b for a, b in zip(acts[1:], acts[:-1], strict=True))]
        object.__setattr__(
            self, "_kept", _prefix_int([max(c.kept_bytes, f) for c, f in zip(layers, floors, strict=True)])
        )
        object.__setattr__(self, "_optimizer", _prefix_int([c.optimizer_state_bytes for c in layers]))
        # Sparse table: row l holds max(workspace[i : i + 2**l]); any range max is two lookups.
        work = np.asarray([c.workspace_bytes for c in layers], dtype=np.int64)
        n = len(layers)
        levels = max(1, n.bit_length())
        table = np.zeros((levels, n), dtype=np.int64)
        table[0] = work
        for lev in range(1, levels):
            half = 1 << (lev - 1)
            width = n - (1 << lev) + 1
            if width <= 0:
                break
            table[lev, :width] = np.maximum(table[lev - 1, :width], table[lev - 1, half : half + width])
        table.flags.writeable = False
        object.__setattr__(self, "_workspace_table", table)
        log2 = np.zeros(n + 1, dtype=np.int64)  # floor(log2(length)) for range lengths 1..n
        for length in range(2, n + 1):
            log2[length] = log2[length // 2] + 1
        log2.flags.writeable = False
        object.__setattr__(self, "_log2", log2)

    def to_arrays(self) -> dict[str, list[Any]]:
        """The per-layer columns, as :meth:`from_arrays` takes them (plain lists: cheap to broadcast).

        Example::

            >>> m = ModelCost.from_arrays([1.0, 2.0], [2.0, 4.0], param_bytes=[8, 0])
            >>> ModelCost.from_arrays(**m.to_arrays()) == m
            True
        """
        return {
            "forward_s": [c.forward_s for c in self.layers],
            "backward_s": [c.backward_s for c in self.layers],
            "activation_bytes": [c.activation_bytes for c in self.layers],
            "param_bytes": [c.param_bytes for c in self.layers],
            "optimizer_state_bytes": [c.optimizer_state_bytes for c in self.layers],
            "workspace_bytes": [c.workspace_bytes for c in self.layers],
            "update_s": [c.update_s for c in self.layers],
            "held_bytes": [c.held_bytes for c in self.layers],
        }

    @classmethod
    def from_arrays(
        cls,
        forward_s: Sequence[float],
        backward_s: Sequence[float],
        *,
        activation_bytes: Sequence[int] | int = 0,
        param_bytes: Sequence[int] | int = 0,
        optimizer_state_bytes: Sequence[int] | int = 0,
        workspace_bytes: Sequence[int] | int = 0,
        update_s: Sequence[float] | float = 0.0,
        held_bytes: Sequence[int] | int = 0,
    ) -> ModelCost:
        """Builds a model from per-layer columns; a scalar byte count or update time applies to every layer."""
        n = len(forward_s)

        def column(name: str, values: Sequence[Any] | float) -> list[Any]:
            if isinstance(values, (int, float, np.number)):
                return [values] * n
            if len(values) != n:
                raise ConfigurationError(
                    f"{name} must have one entry per layer: len(forward_s) = {n}, len({name}) = {len(values)}."
                )
            return list(values)  # LayerCost validates (and rejects fractional byte counts)

        if len(backward_s) != n:
            raise ConfigurationError(
                f"backward_s must have one entry per layer: len(forward_s) = {n}, len(backward_s) = {len(backward_s)}."
            )
        cols = (
            column("activation_bytes", activation_bytes),
            column("param_bytes", param_bytes),
            column("optimizer_state_bytes", optimizer_state_bytes),
            column("workspace_bytes", workspace_bytes),
        )
        updates = [float(u) for u in column("update_s", update_s)]
        held = column("held_bytes", held_bytes)
        return cls(
            tuple(
                LayerCost(float(f), float(b), a, p, o, w, u, h)
                for f, b, a, p, o, w, u, h in zip(forward_s, backward_s, *cols, updates, held, strict=True)
            )
        )

    @property
    def num_layers(self) -> int:
        """Number of layers ``n``."""
        return len(self.layers)

    @property
    def compute_prefix(self) -> FloatArray:
        """``compute_prefix[i]`` = forward + backward seconds of layers ``[0, i)`` (read-only, length n+1)."""
        return self._compute

    @property
    def update_prefix(self) -> FloatArray:
        """``update_prefix[i]`` = seconds layers ``[0, i)`` add to one optimizer update (read-only, length n+1)."""
        return self._update

    @property
    def param_prefix(self) -> IntArray:
        """``param_prefix[i]`` = parameter bytes of layers ``[0, i)`` (read-only, length n+1)."""
        return self._params

    @property
    def activation_prefix(self) -> IntArray:
        """``activation_prefix[i]`` = output activation bytes of layers ``[0, i)`` (read-only)."""
        return self._activations

    @property
    def kept_prefix(self) -> IntArray:
        """``kept_prefix[i]`` = bytes one micro-batch in flight keeps for layers ``[0, i)`` (read-only):
        :attr:`LayerCost.kept_bytes` per layer, and at least what the layer's output adds over its input
        (``activation_bytes[l] - activation_bytes[l - 1]``), a floor that binds only for a layer whose output its
        held bytes leave out."""
        return self._kept

    @property
    def optimizer_prefix(self) -> IntArray:
        """``optimizer_prefix[i]`` = gradient + optimizer-state bytes of layers ``[0, i)`` (read-only)."""
        return self._optimizer

    @property
    def total_param_bytes(self) -> int:
        """Parameter bytes of the whole model."""
        return int(self._params[-1])

    def compute_s(self, first: int, stop: int) -> float:
        """Forward + backward seconds of layers ``[first, stop)``."""
        return float(self._compute[stop] - self._compute[first])

    def update_s(self, first: int, stop: int) -> float:
        """Seconds layers ``[first, stop)`` add to one optimizer update."""
        return float(self._update[stop] - self._update[first])

    def param_bytes(self, first: int, stop: int) -> int:
        """Parameter bytes of layers ``[first, stop)``."""
        return int(self._params[stop] - self._params[first])

    def activation_bytes(self, first: int, stop: int) -> int:
        """Output activation bytes of layers ``[first, stop)`` for one micro-batch."""
        return int(self._activations[stop] - self._activations[first])

    def optimizer_state_bytes(self, first: int, stop: int) -> int:
        """Gradient + optimizer-state bytes of layers ``[first, stop)``."""
        return int(self._optimizer[stop] - self._optimizer[first])

    def workspace_max(self, first: ArrayLike, stop: ArrayLike) -> IntArray:
        """Largest ``workspace_bytes`` over layers ``[first, stop)``, vectorised; 0 for an empty range."""
        lo = np.asarray(first, dtype=np.int64)
        hi = np.asarray(stop, dtype=np.int64)
        if not self._workspace_table.any():
            return np.zeros(np.broadcast(lo, hi).shape, dtype=np.int64)
        lev = self._log2[np.clip(hi - lo, 1, self.num_layers)]
        lo_c = np.clip(lo, 0, self.num_layers - 1)
        right = np.clip(hi - (np.int64(1) << lev), 0, self.num_layers - 1)
        out = np.maximum(self._workspace_table[lev, lo_c], self._workspace_table[lev, right])
        return np.where(hi > lo, out, 0).astype(np.int64)


@dataclass(frozen=True)
class CommModel:
    """Point-to-point transfer time between adjacent stages, and how much of it 1F1B hides.

    Example::

        >>> comm = CommModel(latency_s=1e-5, bandwidth_Bps=1e9, overlap=0.25)
        >>> round(float(comm.transfer_time(1_000_000)), 6)
        0.00101

    The default charges nothing (zero latency, infinite bandwidth): communication costs must be measured by
    the set-up probe before they can shape a plan.

    Attributes:
        latency_s: fixed cost of one transfer, seconds.
        bandwidth_Bps: bytes per second of one transfer (also used for the replicas' all-reduce).
        overlap: fraction in ``[0, 1]`` of a boundary's transfer time that the 1F1B schedule hides behind
            compute, as measured by the runtime. Either one number for every boundary, or a tuple with one
            entry per possible cut (``num_layers - 1`` entries; entry ``l`` is the cut after layer ``l``).
            The default 0 charges every transfer in full: overlap must be measured, not assumed.
        cpu_s_per_byte: CPU seconds a process spends per byte of a message it sends or receives (its side of the
            copies through the transport), measured by the set-up probe where the messages go through the CPU
            (gloo); 0: not measured. A stage under a CPU limit pays it out of its limit, so a cut with a larger
            activation at the limited stage's boundary costs it more
            (:func:`~lightning_dynpipe.predictor.measured.cpu_limited_floors`).
    """

    latency_s: float = 0.0
    bandwidth_Bps: float = math.inf
    overlap: float | tuple[float, ...] = 0.0
    cpu_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ConfigurationError(f"CommModel.latency_s must be finite and >= 0; got {self.latency_s!r}.")
        if not (math.isfinite(self.cpu_s_per_byte) and self.cpu_s_per_byte >= 0):
            raise ConfigurationError(
                f"CommModel.cpu_s_per_byte must be finite and >= 0 (0: not measured); got {self.cpu_s_per_byte!r}."
            )
        if not self.bandwidth_Bps > 0:
            raise ConfigurationError(
                f"CommModel.bandwidth_Bps must be > 0 (math.inf for free transfers); got {self.bandwidth_Bps!r}."
            )
        if isinstance(self.overlap, (list, tuple)):
            object.__setattr__(self, "overlap", tuple(float(v) for v in self.overlap))
        values = self.overlap if isinstance(self.overlap, tuple) else (self.overlap,)
        bad = [v for v in values if not 0.0 <= float(v) <= 1.0]
        if bad:
            raise ConfigurationError(
                f"CommModel.overlap is the measured fraction of a transfer hidden by compute and must lie in "
                f"[0, 1]; got {bad[:5]}. Clip the measurement or leave the default 0."
            )

    def transfer_time(self, num_bytes: ArrayLike) -> FloatArray:
        """Seconds to move ``num_bytes`` across one boundary (vectorised): ``latency + bytes / bandwidth``."""
        return np.asarray(self.latency_s + np.asarray(num_bytes, dtype=np.float64) / self.bandwidth_Bps)

    def overlap_per_cut(self, num_layers: int) -> FloatArray:
        """The overlap fraction of every possible cut ``0 .. num_layers-2`` (cut ``l`` follows layer ``l``)."""
        if isinstance(self.overlap, tuple):
            if len(self.overlap) != num_layers - 1:
                raise ConfigurationError(
                    f"CommModel.overlap has {len(self.overlap)} entries, but a model with {num_layers} layers "
                    f"has {num_layers - 1} possible cuts. Give one fraction per cut, or a single number."
                )
            return np.asarray(self.overlap, dtype=np.float64)
        return np.full(max(num_layers - 1, 0), float(self.overlap))

    def allreduce_time(self, num_bytes: ArrayLike, replicas: int) -> FloatArray:
        """Ring all-reduce among ``replicas`` devices: ``2 (r-1) latency + 2 (r-1)/r * bytes / bandwidth``."""
        b = np.asarray(num_bytes, dtype=np.float64)
        if replicas <= 1:
            return np.zeros_like(b)
        r = float(replicas)
        return np.asarray(2.0 * (r - 1.0) * self.latency_s + 2.0 * (r - 1.0) / r * b / self.bandwidth_Bps)


@dataclass(frozen=True)
class DeviceSpec:
    """One device as the planner sees it.

    Example::

        >>> DeviceSpec(memory_cap_bytes=16 * 2**30, slowdown=1.5).slowdown
        1.5

    Attributes:
        memory_cap_bytes: bytes the stage may use on this device (``math.inf``: unlimited).
        slowdown: factor on compute time, ``>= 1`` when the device is shared with other jobs. This is the
            hook the runtime adaptation uses: it feeds predicted per-device slowdowns back to the planner.
    """

    memory_cap_bytes: float = math.inf
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        if not self.memory_cap_bytes > 0:
            raise ConfigurationError(f"DeviceSpec.memory_cap_bytes must be > 0; got {self.memory_cap_bytes!r}.")
        if not (math.isfinite(self.slowdown) and self.slowdown > 0):
            raise ConfigurationError(
                f"DeviceSpec.slowdown scales compute time and must be finite and > 0; got {self.slowdown!r}."
            )


@runtime_checkable
class CostModel(Protocol):
    """How long a stage takes per micro-batch: the planner's extension point.

    Implement :meth:`stage_time` to plug in another model. The planner evaluates it on arrays of ranges
    and is exact for any implementation (it enumerates the ranges densely, ``O(S n^2)``); a model that also
    implements :class:`PrefixCostModel` gets the fast ``O(S n log n)`` path per solver step.

    Example::

        >>> model = ModelCost.from_arrays([1.0, 1.0], [2.0, 2.0])
        >>> DefaultCostModel().stage_time(model, [0], [2], stage_idx=0, num_stages=1, replicas=1,
        ...                               device=DeviceSpec(), microbatches_per_update=1)
        array([6.])
    """

    def stage_time(
        self,
        model: ModelCost,
        first: ArrayLike,
        stop: ArrayLike,
        *,
        stage_idx: int,
        num_stages: int,
        replicas: int,
        device: DeviceSpec,
        microbatches_per_update: int,
    ) -> FloatArray:
        """Seconds per micro-batch of the stage owning layers ``[first, stop)``, vectorised over ranges.

        Args:
            model: the layer costs.
            first: first layer of each range (array).
            stop: one past the last layer of each range (array, same shape).
            stage_idx: position ``k`` of the stage in the pipeline.
            num_stages: ``S``.
            replicas: data-parallel width of the stage; the time is per micro-batch over all replicas.
            device: the (slowest) device the stage runs on.
            microbatches_per_update: micro-batches each replica processes per optimizer update (1 for
                ``schedule="async"``, ``M`` for ``"sync"``): replicas all-reduce once per update.
        """
        ...


@runtime_checkable
class PrefixCostModel(Protocol):
    """A cost model whose stage time is ``(q[stop] - q[first]) + r[stop]`` for two prefix arrays.

    With ``q`` non-decreasing this makes a stage no slower when it gains layers at its start, which is what
    lets the solver find the feasible ranges by binary search instead of enumerating them. ``stage_time``
    must compute exactly that expression, so that the solver and the plan agree to the last bit.

    Example::

        >>> model = ModelCost.from_arrays([1.0, 2.0], [1.0, 2.0])
        >>> q, r = DefaultCostModel().prefix_form(model, replicas=1, device=DeviceSpec(), microbatches_per_update=1)
        >>> q.tolist(), r.tolist()
        ([0.0, 2.0, 6.0], [0.0, 0.0, 0.0])
    """

    def prefix_form(
        self, model: ModelCost, *, replicas: int, device: DeviceSpec, microbatches_per_update: int
    ) -> tuple[FloatArray, FloatArray]:
        """Returns ``(q, r)``, each of length ``num_layers + 1``; ``q`` must be non-decreasing."""
        ...


@dataclass(frozen=True)
class DefaultCostModel:
    """The planner's default stage time: slowed compute and updates plus the communication 1F1B does not hide.

    For a stage owning layers ``[i, j)`` with ``r`` replicas on a device with slowdown ``s``::

        T = ( s * sum(forward + backward of layers i..j-1)
              + s * sum(update of layers i..j-1) / microbatches_per_update
              + (1 - overlap[j-1]) * 2 * transfer(activation_bytes[j-1])    # activation out, gradient in
              + allreduce(param_bytes of the stage, r) / microbatches_per_update
            ) / r

    Each boundary is charged once, to the stage before it (the last stage has none). The all-reduce of a
    replicated stage is charged in full (no overlap assumed) and amortised over the micro-batches of one
    update. Stage time does not depend on the stage's position, only on its layers, replicas and device.

    Example::

        >>> model = ModelCost.from_arrays([1.0, 1.0], [2.0, 2.0], activation_bytes=[100, 100])
        >>> cost = DefaultCostModel(CommModel(latency_s=0.0, bandwidth_Bps=100.0))
        >>> cost.stage_time(model, [0, 1], [1, 2], stage_idx=0, num_stages=2, replicas=1, device=DeviceSpec(),
        ...                 microbatches_per_update=1).tolist()
        [5.0, 3.0]

    Attributes:
        comm: the measured point-to-point and all-reduce costs.
    """

    comm: CommModel = field(default_factory=CommModel)

    def prefix_form(
        self, model: ModelCost, *, replicas: int, device: DeviceSpec, microbatches_per_update: int
    ) -> tuple[FloatArray, FloatArray]:
        """Returns ``(q, r)`` with ``T(i, j) = (q[j] - q[i]) + r[j]``; see :class:`PrefixCostModel`."""
        if replicas < 1 or microbatches_per_update < 1:
            raise ConfigurationError(
                f"replicas and microbatches_per_update must be >= 1; got {replicas} and {microbatches_per_update}."
            )
        n = model.num_layers
        r = float(replicas)
        # all-reduce seconds per parameter byte, and its fixed part, per micro-batch
        per_byte = float(self.comm.allreduce_time(1.0, replicas)) - float(self.comm.allreduce_time(0.0, replicas))
        fixed = float(self.comm.allreduce_time(0.0, replicas))
        per_byte /= microbatches_per_update
        fixed /= microbatches_per_update
        params = model.param_prefix.astype(np.float64)
        slowed = model.compute_prefix + model.update_prefix / microbatches_per_update
        q = (device.slowdown * slowed + per_byte * params) / r
        rest = np.zeros(n + 1, dtype=np.float64)
        if n > 1:
            act = np.asarray([c.activation_bytes for c in model.layers[:-1]], dtype=np.float64)
            rest[1:n] = (1.0 - self.comm.overlap_per_cut(n)) * 2.0 * self.comm.transfer_time(act)
        rest = (rest + fixed) / r
        # q must be non-decreasing for the solver's binary searches; rounding cannot break that, but a
        # negative slowdown or byte count could, and those are rejected at construction.
        return q, rest

    def stage_time(
        self,
        model: ModelCost,
        first: ArrayLike,
        stop: ArrayLike,
        *,
        stage_idx: int = 0,
        num_stages: int = 1,
        replicas: int = 1,
        device: DeviceSpec | None = None,
        microbatches_per_update: int = 1,
    ) -> FloatArray:
        """Seconds per micro-batch of the stage owning ``[first, stop)``; see the class docstring."""
        q, rest = self.prefix_form(
            model, replicas=replicas, device=device or DeviceSpec(), microbatches_per_update=microbatches_per_update
        )
        i = np.asarray(first, dtype=np.int64)
        j = np.asarray(stop, dtype=np.int64)
        return np.asarray((q[j] - q[i]) + rest[j], dtype=np.float64)
