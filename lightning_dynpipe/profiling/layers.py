"""Per-layer profiler: forward/backward time, activation, parameter and optimizer-state bytes, peak memory.

Each layer of an :class:`~torch.nn.Sequential` runs on a private copy (``copy.deepcopy``), in training
mode, on the previous layer's output, so shapes are real and the model itself is left exactly as it was:
parameters, gradients, buffers (batch-norm running statistics), training mode and the RNG state.

A pipeline built on the ``meta`` device has no data to copy: pass ``layer_copies``, materialised copies made one
at a time (:func:`lightning_dynpipe.engine.materialize.materialized_copies`), and the profile holds one layer at
a time and measures the real layers.

Timing: ``warmup`` untimed iterations, then the median of ``repeats`` timed ones. One iteration runs the
layer forward on a detached input that requires grad (except layer 0, whose input is data, as in training)
and then backward with a ones-like gradient for every differentiable output, computing the gradients of
the input and of the trainable parameters with :func:`torch.autograd.grad` (so no ``.grad`` is written).
On CUDA the two phases are timed with CUDA events after a synchronize; on CPU with one intra-op thread
with :func:`time.thread_time` (CPU time, robust to other processes on the core), otherwise with
:func:`time.perf_counter`.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import statistics
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dynpipe.engine.microbatch import iter_tensors as _tensors
from lightning_dynpipe.engine.microbatch import tree_map as _tree_map
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.costs import LayerCost, ModelCost
from lightning_dynpipe.plan.memory import format_bytes

__all__ = ["LayerStats", "LayerProfile", "profile_layers", "optimizer_state_factor"]

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class LayerStats:
    """What :func:`profile_layers` measured for one layer and one micro-batch.

    Example::

        >>> from torch import nn
        >>> stats = profile_layers(nn.Sequential(nn.Linear(4, 8)), torch.randn(2, 4), repeats=1).layers[0]
        >>> stats.activation_bytes, stats.param_bytes, stats.output_shapes
        (64, 160, ((2, 8),))

    Attributes:
        layer_idx: position of the layer in the pipeline.
        name: the layer's class name, with its children's for a ``Sequential`` (``"Sequential(Linear,ReLU)"``).
        forward_s: median forward time, seconds.
        backward_s: median backward time (input and parameter gradients), seconds; 0 when the layer has
            nothing of its own to differentiate (no differentiable output, or neither an input that needs
            a gradient nor a trainable parameter).
        activation_bytes: bytes of the layer's output (summed over the tensors of a tuple, list or dict).
        output_shapes: shape of every output tensor, in order.
        param_bytes: bytes of all of the layer's parameters (one weight version).
        grad_bytes: bytes of the gradients of its trainable parameters.
        optimizer_state_bytes: trainable parameter bytes times the optimizer-state factor.
        buffer_bytes: bytes of its buffers (e.g. batch-norm running statistics), stored once.
        saved_bytes: bytes autograd keeps for the backward (the output included when it is kept, the
            parameters and the layer's input excluded), from :func:`torch.autograd.graph.saved_tensors_hooks`,
            counting each storage once. Tensors a custom ``autograd.Function`` hides in ``ctx`` attributes
            instead of ``save_for_backward`` are not seen.
        peak_bytes: peak memory of the layer's forward plus backward. On CUDA, measured:
            ``torch.cuda.max_memory_allocated`` minus the allocation before the layer ran (output, saved
            tensors, temporaries and gradients). On CPU, an estimate (there is no allocator counter): the
            saved tensors plus the output, ``saved_bytes + activation_bytes`` less what they share;
            temporaries and gradients are not included. :attr:`LayerProfile.peak_measured` says which.
        update_s: what the layer's trainable parameters add to one optimizer update, seconds (median; 0 when no
            optimizer was given, or the layer has none); see ``profile_layers(optimizer=...)``.
        held_bytes: what one micro-batch keeps for the layer until its backward: the saved tensors and the output,
            each storage once (the layer's input and parameters left out); on CPU also :attr:`peak_bytes`. 0: not
            measured.
    """

    layer_idx: int
    name: str
    forward_s: float
    backward_s: float
    activation_bytes: int
    output_shapes: tuple[tuple[int, ...], ...]
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int
    saved_bytes: int
    peak_bytes: int
    update_s: float = 0.0
    held_bytes: int = 0

    @property
    def compute_s(self) -> float:
        """Forward plus backward seconds."""
        return self.forward_s + self.backward_s

    @property
    def workspace_bytes(self) -> int:
        """Peak memory beyond what a micro-batch keeps (:attr:`held_bytes`, else the output) and the parameter
        gradients: the temporaries (what :class:`LayerCost` calls workspace)."""
        return max(0, self.peak_bytes - (self.held_bytes or self.activation_bytes) - self.grad_bytes)

    def to_layer_cost(self) -> LayerCost:
        """This layer as the planner's :class:`~lightning_dynpipe.plan.costs.LayerCost`.

        See :meth:`LayerProfile.to_model_cost`.
        """
        return LayerCost(
            forward_s=self.forward_s,
            backward_s=self.backward_s,
            activation_bytes=self.activation_bytes,
            param_bytes=self.param_bytes,
            optimizer_state_bytes=self.grad_bytes + self.optimizer_state_bytes + self.buffer_bytes,
            workspace_bytes=self.workspace_bytes,
            update_s=self.update_s,
            held_bytes=self.held_bytes,
        )


@dataclass(frozen=True)
class LayerProfile:
    """The per-layer measurements of a pipeline for one micro-batch; the planner's input.

    Example::

        import torch
        from lightning_dynpipe.demos import MLP
        from lightning_dynpipe.profiling import profile_layers

        model = MLP(width=1024, depth=8)
        profile = profile_layers(model.pipeline, model.example_input(64))
        print(profile.table())
        cost = profile.to_model_cost()          # plan.costs.ModelCost, one LayerCost per layer

    Attributes:
        layers: one :class:`LayerStats` per layer, ``layer_idx`` order.
        device: where the layers ran, e.g. ``"cpu"`` or ``"cuda:0"``.
        warmup: untimed iterations per layer.
        repeats: timed iterations per layer (the times are their medians).
        optimizer_state_factor: optimizer-state bytes per trainable parameter byte.
        peak_measured: True when ``peak_bytes`` came from the CUDA allocator, False for the CPU estimate.
    """

    layers: tuple[LayerStats, ...]
    device: str
    warmup: int
    repeats: int
    optimizer_state_factor: float
    peak_measured: bool

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.layers)

    @property
    def forward_s(self) -> tuple[float, ...]:
        """Forward seconds of every layer."""
        return tuple(s.forward_s for s in self.layers)

    @property
    def backward_s(self) -> tuple[float, ...]:
        """Backward seconds of every layer."""
        return tuple(s.backward_s for s in self.layers)

    @property
    def total_compute_s(self) -> float:
        """Forward plus backward seconds of the whole pipeline for one micro-batch."""
        return sum(s.compute_s for s in self.layers)

    def to_model_cost(self) -> ModelCost:
        """The profile as the planner's :class:`~lightning_dynpipe.plan.costs.ModelCost`.

        Mapping per layer: times and ``activation_bytes`` and ``param_bytes`` as measured;
        ``optimizer_state_bytes`` = gradient bytes + optimizer state + buffers (everything a stage stores
        once, whatever the number of weight versions; :class:`LayerCost` defines it as gradient plus
        optimizer state, and buffers are added here so that the memory caps see them);
        ``workspace_bytes`` = :attr:`LayerStats.workspace_bytes`; ``held_bytes`` as measured (what each micro-batch
        in flight keeps until its backward).
        """
        return ModelCost(tuple(s.to_layer_cost() for s in self.layers))

    def table(self) -> str:
        """A fixed-width table of the measurements, one row per layer and a total row."""
        head = ("idx", "layer", "fwd ms", "bwd ms", "upd ms", "output", "params", "optim", "peak", "output shape")
        rows: list[tuple[str, ...]] = []
        for s in self.layers:
            shapes = ", ".join("x".join(map(str, sh)) or "scalar" for sh in s.output_shapes) or "-"
            rows.append(
                (
                    str(s.layer_idx),
                    _shorten(s.name, 40),
                    f"{s.forward_s * 1e3:.3f}",
                    f"{s.backward_s * 1e3:.3f}",
                    f"{s.update_s * 1e3:.3f}",
                    format_bytes(s.activation_bytes),
                    format_bytes(s.param_bytes),
                    format_bytes(s.optimizer_state_bytes),
                    format_bytes(s.peak_bytes),
                    shapes,
                )
            )
        rows.append(
            (
                "",
                "total",
                f"{sum(self.forward_s) * 1e3:.3f}",
                f"{sum(self.backward_s) * 1e3:.3f}",
                f"{sum(s.update_s for s in self.layers) * 1e3:.3f}",
                format_bytes(sum(s.activation_bytes for s in self.layers)),
                format_bytes(sum(s.param_bytes for s in self.layers)),
                format_bytes(sum(s.optimizer_state_bytes for s in self.layers)),
                format_bytes(max(s.peak_bytes for s in self.layers)) + " max",
                "",
            )
        )
        widths = [max(len(r[c]) for r in (head, *rows)) for c in range(len(head))]
        left = {1, 9}

        def line(r: Sequence[str]) -> str:
            return "  ".join(
                v.ljust(w) if c in left else v.rjust(w) for c, (v, w) in enumerate(zip(r, widths))
            ).rstrip()

        rule = "-" * len(line(head))
        peak = "measured (CUDA allocator)" if self.peak_measured else "estimated (saved tensors + output)"
        title = (
            f"Layer profile on {self.device}: median of {self.repeats} after {self.warmup} warm-up; "
            f"optimizer state {self.optimizer_state_factor:g} x params; peak memory {peak}"
        )
        return "\n".join([title, line(head), rule, *(line(r) for r in rows[:-1]), rule, line(rows[-1])])


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


# -------------------------------------------------------------------------------------- optimizer state
def _state_factor_by_type(optimizer: torch.optim.Optimizer) -> float | None:
    d = optimizer.defaults
    optim = torch.optim
    if isinstance(optimizer, optim.SGD):
        return 1.0 if d.get("momentum", 0) else 0.0  # momentum_buffer
    if isinstance(optimizer, (optim.Adam, optim.AdamW)):
        return 3.0 if d.get("amsgrad", False) else 2.0  # exp_avg, exp_avg_sq (+ max_exp_avg_sq)
    if isinstance(optimizer, (optim.NAdam, optim.RAdam, optim.Adamax, optim.SparseAdam, optim.Adadelta, optim.Rprop)):
        return 2.0  # two running tensors each (exp_avg/exp_avg_sq, exp_inf, square_avg/acc_delta, prev/step_size)
    if isinstance(optimizer, optim.RMSprop):
        return 1.0 + (1.0 if d.get("momentum", 0) else 0.0) + (1.0 if d.get("centered", False) else 0.0)
    if isinstance(optimizer, (optim.Adagrad, optim.ASGD)):
        return 1.0  # sum; ax
    return None


def optimizer_state_factor(optimizer: torch.optim.Optimizer) -> float:
    """Optimizer-state bytes per parameter byte of ``optimizer``: 2 for Adam, 1 for SGD with momentum.

    When the optimizer already holds state (it has stepped), the factor is measured: bytes of the
    state tensors (0-dim counters such as Adam's ``step`` excluded) over the bytes of the parameters that
    have state. Otherwise it follows the
    optimizer's type and ``defaults``: SGD 0 (1 with momentum), Adam/AdamW 2 (3 with ``amsgrad``),
    NAdam/RAdam/Adamax/SparseAdam/Adadelta/Rprop 2, RMSprop 1 (+1 with momentum, +1 centered),
    Adagrad/ASGD 1.

    Example::

        >>> params = [torch.nn.Parameter(torch.zeros(3))]
        >>> sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        >>> optimizer_state_factor(torch.optim.Adam(params)), optimizer_state_factor(sgd)
        (2.0, 1.0)

    Raises:
        ConfigurationError: an optimizer type it does not know that has not stepped yet.
    """
    state_bytes = 0
    param_bytes = 0
    for param, state in optimizer.state.items():
        if not isinstance(param, Tensor) or not state:
            continue
        param_bytes += param.numel() * param.element_size()
        for value in state.values():
            if isinstance(value, Tensor) and value.dim() > 0:  # not the 0-dim ``step`` counters
                state_bytes += value.numel() * value.element_size()
    if param_bytes > 0:
        return state_bytes / param_bytes
    factor = _state_factor_by_type(optimizer)
    if factor is None:
        known = [
            "SGD",
            "Adam",
            "AdamW",
            "NAdam",
            "RAdam",
            "Adamax",
            "SparseAdam",
            "Adadelta",
            "Rprop",
            "RMSprop",
            "Adagrad",
            "ASGD",
        ]
        raise ConfigurationError(
            f"optimizer_state_factor does not know {type(optimizer).__name__} and it has no state yet to measure. "
            f"Known types: {known}. Either take one step first, or pass "
            "profile_layers(..., optimizer_state_bytes_per_param_byte=<state bytes per parameter byte>)."
        )
    return factor


# ------------------------------------------------------------------------------------------ tree helpers
def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _module_name(layer: nn.Module) -> str:
    children = [type(c).__name__ for c in layer.children()]
    return f"{type(layer).__name__}({','.join(children)})" if children else type(layer).__name__


# --------------------------------------------------------------------------------------------- timers
class _Timer:
    """Time of a region: CUDA events on GPU (synchronized); on CPU thread CPU time with one torch thread,
    else wall time."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @contextmanager
    def measure(self, out: list[float]) -> Iterator[None]:
        self.sync()
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        elif torch.get_num_threads() == 1:
            # One intra-op thread (what each stage process gets on a shared CPU): this thread's CPU time is
            # the layer's work, unaffected by other processes taking the core in between.
            t0 = time.thread_time()
            yield
            out.append(time.thread_time() - t0)
        else:
            t0 = time.perf_counter()
            yield
            out.append(time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------- runner
@dataclass
class _Iteration:
    output: Any
    saved_bytes: int = 0  # what autograd saved for the backward
    held_bytes: int = 0  # saved_bytes plus the output's storages that autograd did not save


def _prepare_input(value: Any, requires_grad: bool) -> Any:
    def leaf(t: Tensor) -> Tensor:
        t = t.detach()
        if requires_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t

    return _tree_map(leaf, value)


def _run(
    layer: nn.Module,
    x: Any,
    timer: _Timer,
    fwd: list[float] | None,
    bwd: list[float] | None,
    count_saved: bool = False,
) -> _Iteration:
    """One forward and backward of ``layer`` on ``x``; appends the two times when lists are given."""
    inputs = [t for t in _tensors(x) if t.requires_grad]
    params = [p for p in layer.parameters() if p.requires_grad]
    skip = {t.untyped_storage().data_ptr() for t in (*_tensors(x), *layer.parameters(), *layer.buffers())}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def unpack(t: Tensor) -> Tensor:
        return t

    fwd_times: list[float] = fwd if fwd is not None else []
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack) if count_saved else nullcontext()
    with hooks, timer.measure(fwd_times):
        out = layer(x)
    saved_bytes = sum(saved.values())
    held = dict(saved)
    for t in _tensors(out):  # the output is held too, unless autograd already keeps it or it views the input
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            held[ptr] = t.untyped_storage().nbytes()
    outputs = [t for t in _tensors(out) if t.requires_grad]
    targets = inputs + params
    # Without targets the output depends only on tensors outside the layer (e.g. a weight it borrows);
    # their gradients belong to another layer, and autograd.backward would write into their .grad.
    if outputs and targets:
        grads_out = [torch.ones_like(t) for t in outputs]
        bwd_times: list[float] = bwd if bwd is not None else []
        with timer.measure(bwd_times):
            torch.autograd.grad(outputs, targets, grads_out, allow_unused=True)
    elif bwd is not None:
        bwd.append(0.0)
    return _Iteration(out, saved_bytes, sum(held.values()))


def _default_device(layers: nn.Sequential, sample_input: Any) -> torch.device:
    for p in layers.parameters():
        if p.device.type != "meta":
            return p.device
    for t in _tensors(sample_input):
        return t.device
    return torch.device("cpu")


def profile_layers(
    layers: nn.Sequential,
    sample_input: Any,
    *,
    device: torch.device | None = None,
    warmup: int = 2,
    repeats: int = 5,
    optimizer_state_bytes_per_param_byte: float = 2.0,
    layer_copies: Iterable[nn.Module] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> LayerProfile:
    """Measures every layer of ``layers`` on one micro-batch, feeding each the previous layer's output.

    The model is not changed: each layer runs on a deep copy in training mode (so batch-norm statistics and
    dropout behave as in training, but only the copy's buffers move), gradients are computed with
    :func:`torch.autograd.grad` (no ``.grad`` is written), and the RNG state is restored afterwards. A
    copy of one layer at a time is held on ``device`` besides the model.

    A pipeline on the ``meta`` device is profiled from ``layer_copies`` instead of deep copies: one materialised
    copy per layer, in order, taken one at a time and dropped before the next is taken (so an iterator that
    builds each copy when asked, as :func:`~lightning_dynpipe.engine.materialize.materialized_copies` does,
    keeps one layer in memory)::

        with record_random_state() as draws:               # lightning_dynpipe.engine.materialize
            model = MyModel()                              # on meta: no memory
        copies = materialized_copies(model.pipeline, torch.device("cpu"), random_state=draws.state)
        profile = profile_layers(model.pipeline, sample, layer_copies=copies)

    Example::

        import torch
        from lightning_dynpipe.demos import CNN
        from lightning_dynpipe.profiling import optimizer_state_factor, profile_layers

        model = CNN()
        profile = profile_layers(
            model.pipeline,
            model.example_input(32),                      # one micro-batch
            optimizer_state_bytes_per_param_byte=optimizer_state_factor(model.configure_optimizers()),
        )
        print(profile.table())

    Args:
        layers: the pipeline; each element is one layer (partition unit).
        sample_input: one micro-batch of what ``layers[0]`` accepts: a tensor, or a tuple/list/dict of them.
            Moved to ``device``.
        device: where to run; default: the device of the first parameter, else of the input, else CPU.
        warmup: untimed iterations per layer before timing (``>= 0``).
        repeats: timed iterations per layer (``>= 1``); times are their medians.
        optimizer_state_bytes_per_param_byte: optimizer state per trainable parameter byte; 2 for Adam,
            1 for SGD with momentum; :func:`optimizer_state_factor` reads it off an optimizer.
        layer_copies: the layers to run, one private copy per layer of ``layers`` in order, instead of deep
            copies (needed when ``layers`` is on ``meta``). Each must be of the same kind as its layer; it is
            moved to ``device`` and run in training mode.
        optimizer: the run's optimizer, to time what each layer adds to one update (``LayerStats.update_s``): a
            new optimizer of its class with its ``defaults`` steps the copy's trainable parameters, gradients
            set, at least once untimed (the first step creates its state) and ``repeats`` times timed, less the
            median of the same on a one-element parameter (the step's fixed cost, which a stage pays once for
            all its layers). The optimizer itself is not used or changed. ``None``: updates are not timed (0).
            An optimizer whose class cannot be built that way (or steps only with a closure) is not timed
            either, with a warning.

    Returns:
        The immutable :class:`LayerProfile`.

    Raises:
        ConfigurationError: an empty pipeline, bad ``warmup``/``repeats``/factor, a layer that cannot run
            on what the previous one returned (the message names the layer and the input shapes), a pipeline on
            ``meta`` without ``layer_copies``, or ``layer_copies`` that do not match ``layers``.
    """
    if not isinstance(layers, nn.Sequential):
        raise ConfigurationError(
            f"profile_layers needs the pipeline as an nn.Sequential of layers; got {type(layers).__name__}. "
            "Wrap the layers: nn.Sequential(*layers)."
        )
    if len(layers) == 0:
        raise ConfigurationError("profile_layers got an empty nn.Sequential; the pipeline needs at least one layer.")
    if not (isinstance(warmup, int) and warmup >= 0 and isinstance(repeats, int) and repeats >= 1):
        raise ConfigurationError(
            f"warmup must be an int >= 0 and repeats an int >= 1; got warmup={warmup!r}, repeats={repeats!r}."
        )
    factor = float(optimizer_state_bytes_per_param_byte)
    if not (math.isfinite(factor) and factor >= 0):
        raise ConfigurationError(
            f"optimizer_state_bytes_per_param_byte must be finite and >= 0 (2 for Adam, 1 for SGD with momentum, "
            f"0 for plain SGD); got {optimizer_state_bytes_per_param_byte!r}."
        )
    on_meta = [i for i, layer in enumerate(layers) if any(t.is_meta for t in (*layer.parameters(), *layer.buffers()))]
    if on_meta and layer_copies is None:
        raise ConfigurationError(
            f"profile_layers got layers {on_meta[:8]} on the meta device, which have no data to run. Pass "
            "layer_copies=lightning_dynpipe.engine.materialize.materialized_copies(layers, device, "
            "random_state=...) (materialised copies, one layer at a time), or profile a model built on a real device."
        )
    _warn_if_constant(sample_input)
    device = torch.device(device) if device is not None else _default_device(layers, sample_input)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    timer = _Timer(device)
    updater = _Updater(optimizer, warmup, repeats)
    rng_devices = [device.index] if device.type == "cuda" else []
    stats: list[LayerStats] = []
    x = _tree_map(lambda t: t.to(device), sample_input)
    with torch.random.fork_rng(devices=rng_devices), torch.enable_grad():
        copies = iter(layer_copies) if layer_copies is not None else None
        for idx, original in enumerate(layers):
            layer = copy.deepcopy(original) if copies is None else _next_copy(copies, idx, original, len(layers))
            layer = layer.to(device).train()
            layer_input = _prepare_input(x, requires_grad=idx > 0)
            try:
                layer_stats, output = _profile_one(idx, layer, layer_input, timer, warmup, repeats, factor)
                layer_stats = replace(layer_stats, update_s=updater.time(layer, timer))
            except Exception as exc:
                shapes = [tuple(t.shape) for t in _tensors(layer_input)]
                raise ConfigurationError(
                    f"Profiling layer {idx} ({_module_name(original)}) failed on an input with tensor shapes "
                    f"{shapes}: {type(exc).__name__}: {exc}. sample_input must be one micro-batch of what "
                    "layers[0] accepts, and each layer must accept what the previous one returns."
                ) from exc
            stats.append(layer_stats)
            x = _tree_map(lambda t: t.detach(), output)
            del layer, output  # before the next copy is made: one layer at a time
        if copies is not None and next(copies, None) is not None:
            raise ConfigurationError(
                f"layer_copies yielded more copies than the {len(layers)} layers of the pipeline; pass one per layer."
            )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    profile = LayerProfile(tuple(stats), str(device), warmup, repeats, factor, device.type == "cuda")
    log.debug("%s", profile.table())
    return profile


def _next_copy(copies: Iterator[nn.Module], idx: int, original: nn.Module, num_layers: int) -> nn.Module:
    """The copy of layer ``idx`` from ``layer_copies``, checked to be of the same kind and shapes."""
    layer = next(copies, None)
    if layer is None:
        raise ConfigurationError(
            f"layer_copies ran out at layer {idx} of {num_layers}; it must yield one copy per layer of the pipeline."
        )
    want = [(n, tuple(t.shape), t.dtype) for n, t in (*original.named_parameters(), *original.named_buffers())]
    got = [(n, tuple(t.shape), t.dtype) for n, t in (*layer.named_parameters(), *layer.named_buffers())]
    if type(layer) is not type(original) or got != want:
        raise ConfigurationError(
            f"layer_copies yielded a {type(layer).__name__} with tensors {got[:4]} for layer {idx} "
            f"({type(original).__name__} with {want[:4]}); each copy must be the same kind of layer, with the "
            "same tensors, in pipeline order."
        )
    return layer


def _warn_if_constant(sample_input: Any) -> None:
    """Warns when every floating-point tensor of the sample is constant (all zeros, say).

    Layer times can depend on the data: the demo CNN's first stage profiled 4.7 ms per forward on zeros,
    5.8 ms on real MNIST images and 7.0 ms on standard-normal data (``benchmarks/profile_inputs.py``), so a
    constant sample can make a plan optimistic. Integer inputs (token ids) are not checked.
    """
    floats = [t for t in _tensors(sample_input) if t.is_floating_point() and t.numel() > 1]
    if floats and all(bool((t == t.reshape(-1)[0]).all()) for t in floats):
        warnings.warn(
            "profile_layers got a sample input whose floating-point tensors are constant (e.g. torch.zeros). "
            "Layer times can depend on the data (convolutions were up to 1.5x faster on zeros than on random "
            "data here), so the plan may be optimistic. Profile on a real micro-batch, or on torch.randn of the "
            "same shape.",
            UserWarning,
            stacklevel=3,
        )


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's ``defaults`` its class's constructor accepts (AdamW's name one that only Adam takes)."""
    try:
        accepted = inspect.signature(type(optimizer).__init__).parameters
    except (TypeError, ValueError):
        return dict(optimizer.defaults)
    if any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


class _Updater:
    """Times what a layer copy's trainable parameters add to one optimizer update (``profile_layers(optimizer=...)``).

    A stage runs one ``optimizer.step()`` for all of its layers, so the step's fixed cost (Python, dispatch), timed
    once on a one-element parameter, is subtracted from each layer's time: what remains moves with the layer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer | None, warmup: int, repeats: int) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the torch one
        self.optimizer = inner if isinstance(inner, torch.optim.Optimizer) else None
        self.warmup, self.repeats = max(1, warmup), repeats
        self.fixed_s: float | None = None

    def _median_step(self, params: Sequence[Tensor], timer: _Timer) -> float:
        assert self.optimizer is not None
        with torch.no_grad():
            for p in params:
                p.grad = torch.full_like(p, 1e-6)
        opt = type(self.optimizer)(params, **_constructor_defaults(self.optimizer))
        times: list[float] = []
        for _ in range(self.warmup + self.repeats):
            with timer.measure(times):
                opt.step()
        return statistics.median(times[self.warmup :])

    def time(self, layer: nn.Module, timer: _Timer) -> float:
        params = [p for p in layer.parameters() if p.requires_grad]
        if self.optimizer is None or not params:
            return 0.0
        cls = type(self.optimizer)
        try:
            if self.fixed_s is None:
                scalar = torch.zeros(1, device=params[0].device, dtype=params[0].dtype, requires_grad=True)
                self.fixed_s = self._median_step([scalar], timer)
            return max(0.0, self._median_step(params, timer) - self.fixed_s)
        except Exception as exc:  # the cost model then counts updates as free, as without an optimizer
            warnings.warn(
                f"The layer profile does not time optimizer updates: a new {cls.__name__}(params, **defaults) "
                f"could not step ({type(exc).__name__}: {exc}). The planner counts updates as free; with a schedule "
                "that updates after every micro-batch (async) it then underestimates the stages' time.",
                stacklevel=3,
            )
            self.optimizer = None
            return 0.0
        finally:
            for p in params:
                p.grad = None


def _profile_one(
    idx: int, layer: nn.Module, x: Any, timer: _Timer, warmup: int, repeats: int, factor: float
) -> tuple[LayerStats, Any]:
    """Times one layer (already a private copy on the device); returns its stats and its output."""
    for _ in range(warmup):
        _run(layer, x, timer, None, None)
    fwd: list[float] = []
    bwd: list[float] = []
    for _ in range(repeats):
        _run(layer, x, timer, fwd, bwd)
    # memory pass: saved tensors always; the CUDA allocator's peak on GPU
    if timer.cuda:
        timer.sync()
        torch.cuda.reset_peak_memory_stats(timer.device)
        base = torch.cuda.memory_allocated(timer.device)
    it = _run(layer, x, timer, None, None, count_saved=True)
    out_tensors = list(_tensors(it.output))
    activation = sum(_nbytes(t) for t in out_tensors)
    if timer.cuda:
        timer.sync()
        peak = max(0, torch.cuda.max_memory_allocated(timer.device) - base)
    else:
        peak = it.held_bytes
    params = list(layer.parameters())
    trainable = sum(_nbytes(p) for p in params if p.requires_grad)
    stats = LayerStats(
        layer_idx=idx,
        name=_module_name(layer),
        forward_s=statistics.median(fwd),
        backward_s=statistics.median(bwd),
        activation_bytes=activation,
        output_shapes=tuple(tuple(t.shape) for t in out_tensors),
        param_bytes=sum(_nbytes(p) for p in params),
        grad_bytes=trainable,
        optimizer_state_bytes=int(round(trainable * factor)),
        buffer_bytes=sum(_nbytes(b) for b in layer.buffers()),
        saved_bytes=it.saved_bytes,
        peak_bytes=peak,
        held_bytes=it.held_bytes,
    )
    return stats, it.output
