"""The stage executor: runs one stage's instruction lists, dispatching each instruction by its type.

The executor never imports Lightning. What is user code on the first and last stage (extracting the pipeline
input from a batch, running ``training_step`` to get the loss, firing optimizer hooks) reaches it as plain
callables from the strategy.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from lightning_dynpipe.engine.microbatch import (
    check_batch_size,
    microbatch_sizes,
    sample_identity,
    split_microbatches,
)
from lightning_dynpipe.engine.p2p import Message, Receiver, Sender
from lightning_dynpipe.engine.stash import WeightStash
from lightning_dynpipe.engine.wire import MessageKind
from lightning_dynpipe.errors import ConfigurationError, PeerFailure, ScheduleError
from lightning_dynpipe.schedule import (
    Backward,
    Forward,
    Instruction,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    Schedule,
    SendActivation,
    SendGrad,
    StashWeights,
    get_schedule,
)

__all__ = ["StageExecutor", "StageChannels", "StepStats"]

log = logging.getLogger(__name__)


def _flatten(value: Any, what: str) -> tuple[list[Tensor], bool]:
    if isinstance(value, Tensor):
        return [value], False
    if isinstance(value, (tuple, list)) and all(isinstance(v, Tensor) for v in value):
        return list(value), True
    got = type(value).__name__
    if isinstance(value, (tuple, list)):
        others = [f"{type(v).__name__} at position {i}" for i, v in enumerate(value) if not isinstance(v, Tensor)]
        got += f" holding {', '.join(others)}"
    raise ConfigurationError(
        f"{what} must be a Tensor or a tuple of Tensors to cross a stage boundary; got {got}. Make the layers at "
        "the partition boundary return tensors (a number as a 0-d tensor, torch.tensor(x); a flag or an option "
        "as an attribute of the next layer), or choose a balance that cuts elsewhere."
    )


def _same_input(given: Any, expected: Any) -> bool:
    """Whether the step's pipeline argument is stage 0's input: the same tensors (shape, dtype, values) in the
    same structure."""
    if isinstance(given, Tensor) or isinstance(expected, Tensor):
        return (
            isinstance(given, Tensor)
            and isinstance(expected, Tensor)
            and given.shape == expected.shape
            and given.dtype == expected.dtype
            and torch.equal(given, expected)
        )
    if isinstance(given, (tuple, list)) and isinstance(expected, (tuple, list)):
        return len(given) == len(expected) and all(_same_input(g, e) for g, e in zip(given, expected))
    return given is expected


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(_describe(v) for v in value[:3])})"
    return f"a {type(value).__name__}"


def _tensor_hooks(param: Tensor, grad: Tensor) -> Tensor:
    """``grad`` through ``param``'s gradient hooks (``param.register_hook``), in order, as autograd applies them
    to a leaf's gradient: a hook may return a replacement."""
    for hook in list((param._backward_hooks or {}).values()):
        out = hook(grad)
        if out is not None:
            if not isinstance(out, Tensor) or out.shape != grad.shape:
                raise ConfigurationError(
                    f"A gradient hook of a parameter of shape {tuple(grad.shape)} returned {_describe(out)}; a hook "
                    "registered with register_hook must return None or a tensor of the gradient's shape."
                )
            grad = out
    return grad


def _copy_received(value: Any) -> tuple[Any, list[Tensor]]:
    """``value`` (a received activation: a tensor or a tuple) with a copy of each tensor that requires grad, and
    the copies. A copy is a non-leaf: the layers may write it in place, and its backward passes the gradient to the
    received tensor unchanged."""
    if isinstance(value, Tensor):
        if not value.requires_grad:
            return value, []
        copy = value.clone()
        return copy, [copy]
    if not isinstance(value, tuple):
        return value, []
    copies: list[Tensor] = []
    out = []
    for t in value:
        if isinstance(t, Tensor) and t.requires_grad:
            t = t.clone()
            copies.append(t)
        out.append(t)
    return tuple(out), copies


@dataclass
class StageChannels:
    """The four channels a stage may have: activations in/out and gradients in/out."""

    recv_activation: Receiver | None = None
    send_activation: Sender | None = None
    recv_grad: Receiver | None = None
    send_grad: Sender | None = None

    def arrived_failure(self) -> PeerFailure | None:
        """A neighbour's failure that a receive channel knows or holds as its next message (its ``ABORT``;
        :meth:`~lightning_dynpipe.engine.p2p.RecvChannel.arrived_failure`); ``None`` if none has. For a failed
        run's way out only: it consumes what it reads."""
        for ch in (self.recv_activation, self.recv_grad):
            peek = getattr(ch, "arrived_failure", None)
            failure = peek() if callable(peek) else None
            if isinstance(failure, PeerFailure):
                return failure
        return None

    def flush(self) -> None:
        """Waits for all outstanding sends."""
        for ch in (self.send_activation, self.send_grad):
            if ch is not None:
                ch.flush()

    def close(self) -> None:
        """Tells the peers that nothing more will come, reads what they still send until they say so, then flushes.

        Every close is queued before any end waits: a peer may have sent messages this stage will never use
        (the last step of ``async`` leaves some in flight), and its sends complete only as this end receives.
        """
        senders = [ch for ch in (self.send_activation, self.send_grad) if ch is not None]
        for ch in senders:
            ch.close(wait=False)
        for rc in (self.recv_activation, self.recv_grad):
            if rc is not None:
                rc.join()
        for ch in senders:
            ch.flush()


@dataclass
class StepStats:
    """Where one stage's time went during one step (seconds), plus pipeline state at the step's end.

    ``forward_s`` times the stage's layers only; ``user_s`` is the rest of the forward instructions: on the
    last stage the user's ``training_step`` around ``self.pipeline(...)`` (loss, ``self.log``), on stage 0
    ``pipeline_input``.
    """

    forward_s: float = 0.0
    user_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    recv_wait_s: float = 0.0
    send_s: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    step_s: float = 0.0
    num_forward: int = 0
    num_backward: int = 0
    num_updates: int = 0
    in_flight: int = 0
    stash_depth: int = 0
    max_stash_depth: int = 0

    @property
    def compute_s(self) -> float:
        """Forward plus backward plus optimizer time (the user's step code on the last stage: ``user_s``)."""
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def comm_overlap(self) -> float:
        """Measured share of incoming transfer time hidden behind compute (1: all hidden; 1 with no transfers).

        A transfer is exposed for as long as the stage waited for it after asking: the receiver thread times
        each payload from its header's arrival, and the executor knows when it asked for the message.
        """
        return 1.0 if self.comm_s <= 0 else max(0.0, 1.0 - self.exposed_comm_s / self.comm_s)


@dataclass
class _MicroBatch:
    slot: int
    batch: Any = None
    inputs: list[Tensor | None] | None = None  # received leaves (stages > 0)
    input_value: Any = None
    output: Any = None
    loss: Tensor | None = None
    loss_value: float = float("nan")
    version: int | None = None
    input_grads: list[Tensor | None] = field(default_factory=list)
    out_grads: list[Tensor | None] | None = None
    scale: float = 1.0
    calls: int = 0  # how often the user's step called the pipeline on this micro-batch (the rule: once)
    sample_id: float = math.nan  # stage 0's sample_identity of the micro-batch, carried to the last stage


class StageExecutor:
    """Runs one pipeline stage: its layers, its share of the schedule, and its optimizer updates.

    Example::

        executor = StageExecutor(stage_module=nn.Sequential(*my_layers), stage_idx=0, num_stages=2,
                                 schedule="async", num_microbatches=4, channels=channels,
                                 first_stage_input=lambda b: b[0], last_stage_loss=None,
                                 optimizer_step=step_fn)
        loss = executor.train_step(batch)    # one Lightning step; in-flight backwards carry over
        executor.drain()                      # before validation, checkpoints, the end of fit

    Args:
        stage_module: the layers this stage owns, in order.
        stage_idx: ``k``, position of the stage in the pipeline.
        num_stages: ``S``.
        schedule: the :class:`~lightning_dynpipe.schedule.Schedule` (or its name: ``"async"``, ``"sync"``,
            ``"gpipe"``).
        num_microbatches: ``M``, micro-batches per step.
        channels: P2P channels to the neighbouring stages.
        first_stage_input: on stage 0 (when ``S > 1``), maps a micro-batch to the pipeline input.
        last_stage_loss: on the last stage, runs the user's step on a micro-batch (its ``self.pipeline(...)``
            call reaching :meth:`local_forward`) and returns the loss.
        optimizer_step: applies one update to this stage's parameters from their ``.grad`` and clears them. While
            it runs, :attr:`update_samples` holds the number of samples whose gradient the update applies (the
            micro-batch's under async, the step's under sync/gpipe): the weight of this replica's gradient in an
            uneven replica split.
        fresh_storage_updates: whether ``optimizer_step`` takes care of the weight stash itself. When ``False``
            (the default) the executor copies the live weights before every update that a micro-batch in flight
            still needs. When ``True``, :attr:`update_stash` is set instead while ``optimizer_step`` runs, and the
            callback must either call its ``before_update()`` before anything writes the weights in place, or
            write the new weights to fresh storage and call its ``updated_out_of_place()``
            (:mod:`~lightning_dynpipe.engine.outofplace`).
        checkpoint: per layer of ``stage_module``, whether its activations are recomputed in the backward
            instead of kept (activation checkpointing); default none.
        microbatch_statistics: whether layers may update their buffers in every training forward (running
            statistics, spectral norm's power iteration) under a schedule that promises one update from the whole
            batch (``sync``, ``gpipe``) with ``num_microbatches > 1``, where such a forward runs once per
            micro-batch instead of once per batch. ``False``: the first training micro-batch's forward checks the
            stage's buffers and raises :class:`~lightning_dynpipe.errors.ConfigurationError` if it wrote any.
            Default ``True`` (the strategy passes its ``microbatch_statistics`` argument).
        first_layer: the pipeline index of the stage's first layer (errors name layers by pipeline index).
        loss_terms: on the last stage, how many terms the loss of a micro-batch averages (the module's
            ``loss_terms(batch)`` hook: the targets a token-mean loss counts, say); ``None``: its samples. A
            schedule that accumulates the step's micro-batches into one update (``sync``, ``gpipe``) weights each
            micro-batch's loss by its share of the step's terms, so that the update is the gradient of the whole
            batch's mean, as on one device; a micro-batch with no terms then adds nothing (its loss, a mean over
            nothing, is not back-propagated). Also the weights of :attr:`microbatch_weights`.
        step_input: on the last stage of several, what the user's step must pass to ``self.pipeline(...)``,
            computed from the micro-batch as stage 0 computes its input (``None``: not checked). The first call
            compares the two: a step that changed the input before the call (preprocessing that stage 0 never
            runs) raises :class:`~lightning_dynpipe.errors.ConfigurationError`.
    """

    def __init__(
        self,
        *,
        stage_module: nn.Module,
        stage_idx: int,
        num_stages: int,
        schedule: Schedule | str,
        num_microbatches: int,
        channels: StageChannels,
        first_stage_input: Callable[[Any], Any] | None,
        last_stage_loss: Callable[[Any, int], Tensor] | None,
        optimizer_step: Callable[[], None],
        checkpoint: Sequence[bool] = (),
        fresh_storage_updates: bool = False,
        microbatch_statistics: bool = True,
        first_layer: int = 0,
        step_input: Callable[[Any], Any] | None = None,
        loss_terms: Callable[[Any], Any] | None = None,
    ) -> None:
        self.stage_module = stage_module
        self._loss_terms = loss_terms
        self.first_layer = first_layer
        num_layers = len(list(stage_module.children()))
        self.checkpoint = tuple(checkpoint) or (False,) * num_layers
        self._checkpointing = any(self.checkpoint)
        if len(self.checkpoint) != num_layers:
            raise ConfigurationError(
                f"checkpoint needs one flag per layer of the stage: {num_layers} layers, got "
                f"{len(self.checkpoint)} flags."
            )
        # each layer's parameters under the stage module's names (shared ones under their first name, as a
        # stashed version holds them), so one layer can run on a stashed version by itself
        first_name = {id(p): n for n, p in stage_module.named_parameters()}
        self._layer_names = [
            [(n, first_name[id(p)]) for n, p in layer.named_parameters(remove_duplicate=False)]
            for layer in stage_module.children()
        ]
        self.stage_idx = stage_idx
        self.num_stages = num_stages
        self.schedule = get_schedule(schedule)
        self.num_microbatches = num_microbatches
        self.channels = channels
        self._first_stage_input = first_stage_input
        self._last_stage_loss = last_stage_loss
        self._optimizer_step = optimizer_step
        self.is_first = stage_idx == 0
        self.is_last = stage_idx == num_stages - 1
        self.staleness = self.schedule.staleness(stage_idx, num_stages)
        self.stash: WeightStash | None = WeightStash(stage_module) if self.staleness > 0 else None
        self._names = [n for n, _ in stage_module.named_parameters()]
        # every (module, attribute) slot holding a parameter, shared ones under every name, with the name a
        # stashed version holds it under: what _forward_on swaps in and out
        self._slots: list[tuple[nn.Module, str, str]] = [
            (module, local, first_name[id(p)])
            for _, module in stage_module.named_modules(remove_duplicate=False)
            for local, p in module.named_parameters(prefix="", recurse=False, remove_duplicate=False)
        ]
        self._live: list[Tensor] = [p for _, p in stage_module.named_parameters()]
        self._mbs: dict[int, _MicroBatch] = {}
        self._current: _MicroBatch | None = None
        self._steps_since_drain = 0
        self._step_batches: list[Any] = []
        self._step_sizes: list[int] = []
        self._step_weights: list[float] = []
        self._mb_samples: dict[int, int] = {}  # samples of every micro-batch not yet applied by an update
        self.update_samples = 0
        self._fresh_storage_updates = fresh_storage_updates
        # Whether the stage's layers get a copy of the received activation: a stage after the first receives it
        # as a leaf that requires grad, which autograd forbids writing in place, where the same layer in one
        # process writes the previous layer's output (a non-leaf) in place, legally: nn.ReLU(inplace=True) first in
        # a stage. Unknown (None) until the first micro-batch with gradients, which gets a copy; whether its version
        # counter moved says whether the layers write their input, and so whether every later one needs a copy.
        self._copy_input: bool | None = None if stage_idx > 0 else False
        self.update_stash: WeightStash | None = None  # see fresh_storage_updates
        self._step_input = step_input if self.is_last and not self.is_first else None  # checked once
        # checked once, at the first training forward (see microbatch_statistics)
        self._check_buffer_writes = not microbatch_statistics and self.schedule.accumulates and num_microbatches > 1
        self._step_base = 0
        self._step_losses: list[float] = []
        self._eval_counter = 0
        self._layers_forward_s = 0.0
        self.stats = StepStats()
        self.last_loss = float("nan")
        self._handlers: dict[type, Callable[[Any], None]] = {
            RecvActivation: self._recv_activation,
            StashWeights: self._stash_weights,
            Forward: self._forward,
            SendActivation: self._send_activation,
            RecvGrad: self._recv_grad,
            Backward: self._backward,
            SendGrad: self._send_grad,
            OptimizerStep: self._update,
        }
        if self.is_last and last_stage_loss is None:
            raise ConfigurationError("The last stage needs a last_stage_loss callable.")
        if self.is_first and not self.is_last and first_stage_input is None:
            raise ConfigurationError("Stage 0 of a multi-stage pipeline needs a first_stage_input callable.")

    # ------------------------------------------------------------------ public API
    @property
    def microbatch_sizes(self) -> list[int]:
        """Sample counts of the current step's micro-batches (the current or last step; first and last stage only)."""
        return list(self._step_sizes)

    @property
    def microbatch_weights(self) -> list[float]:
        """The weights of the current step's micro-batches in the step's mean loss (the current or last step; last
        stage only): their terms (``loss_terms``), else their sample counts."""
        return list(self._step_weights)

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded by this stage but not yet back-propagated."""
        return len(self._mbs)

    @property
    def steps_since_drain(self) -> int:
        """Steps run since the last drain (the schedule's step counter)."""
        return self._steps_since_drain

    def train_step(self, batch: Any) -> float:
        """Runs this stage's instructions for one step on ``batch``; returns the mean loss known here.

        The last stage returns the mean loss of the ``M`` micro-batches of this batch, weighted by their samples (or
        their ``loss_terms``): the batch's loss, for a loss averaged over them. Other stages return the plain mean
        of the losses of the micro-batches they back-propagated during the step (the loss travels upstream with
        the gradients), or NaN when they have not back-propagated any yet.
        """
        t0 = time.perf_counter()
        self.stats = StepStats(max_stash_depth=self.stats.max_stash_depth)
        if self.is_first or self.is_last:
            self._step_batches, self._step_sizes = split_microbatches(batch, self.num_microbatches)
            sizes = self._step_sizes
            if self.is_last:
                self._step_weights = self._weights()
        else:  # middle stages do not need the data, but must refuse the same batches as their neighbours
            sizes = microbatch_sizes(check_batch_size(batch, self.num_microbatches), self.num_microbatches)
        self._step_base = self._steps_since_drain * self.num_microbatches
        for slot, size in enumerate(sizes):  # what each update applies (weights of an uneven replica split)
            self._mb_samples[self._step_base + slot] = size
        self._step_losses = []
        program = self.schedule.step_instructions(
            self.stage_idx,
            self.num_stages,
            self.num_microbatches,
            self._steps_since_drain,
        )
        self._run(program)
        self._steps_since_drain += 1
        self._step_batches = []
        self.stats.step_s = time.perf_counter() - t0
        self.stats.in_flight = self.in_flight
        self.stats.stash_depth = self.stash.depth if self.stash is not None else 0
        if self._step_losses:
            self.last_loss = self._mean_loss(self._step_losses)
            return self.last_loss
        return float("nan")

    def _mean_loss(self, losses: list[float]) -> float:
        """The step's mean loss: on the last stage weighted as the step's micro-batches are (their samples, or their
        ``loss_terms``, a micro-batch of weight 0 left out), the batch's loss for a loss averaged over them; on
        other stages, which know neither, the plain mean of the losses that travelled upstream."""
        w = self._step_weights
        if self.is_last and len(w) == len(losses) and len(set(w)) > 1 and sum(w) > 0:
            return sum(wi * li for wi, li in zip(w, losses) if wi > 0) / sum(w)
        return sum(losses) / len(losses)  # (equal weights: the same mean)

    def drain(self) -> None:
        """Finishes every micro-batch in flight (their backwards and updates), then waits for all sends."""
        if self._steps_since_drain == 0:
            return
        program = self.schedule.drain_instructions(
            self.stage_idx,
            self.num_stages,
            self.num_microbatches,
            self._steps_since_drain,
        )
        self._run(program)
        self.channels.flush()
        if self.stash is not None:
            self.stash.drop_spares()  # no update before the next step: do not hold a released version
        if self._mbs:
            raise ScheduleError(
                f"Stage {self.stage_idx} still has micro-batches {sorted(self._mbs)} in flight after a drain; the "
                "schedule's drain is inconsistent with its steps."
            )
        self._steps_since_drain = 0

    def eval_step(self, batch: Any, step_fn: Callable[[], Any]) -> Any:
        """Forward-only pass of a whole batch through the pipeline; returns ``step_fn()`` on the last stage.

        ``step_fn`` runs the user's evaluation step; its ``self.pipeline(...)`` call reaches
        :meth:`local_forward`. Other stages return ``None``. Must be called on a drained pipeline.
        """
        if self._mbs:
            raise ScheduleError(
                f"eval_step needs a drained pipeline; stage {self.stage_idx} has {len(self._mbs)} in flight."
            )
        idx = self._eval_counter
        self._eval_counter += 1
        mb = _MicroBatch(slot=0, batch=batch)
        if not self.is_first:
            assert self.channels.recv_activation is not None
            msg = self.channels.recv_activation.get(MessageKind.EVAL_ACTIVATION, idx)
            mb.input_value = self._rebuild(msg.tensors, msg.header.is_tuple)
        if self.is_last:
            self._current = mb
            try:
                return step_fn()
            finally:
                self._current = None
        assert self._first_stage_input is not None or not self.is_first
        value = self._first_stage_input(batch) if self.is_first else mb.input_value  # type: ignore[misc]
        out = self.stage_module(value)
        tensors, is_tuple = _flatten(out, f"The output of stage {self.stage_idx}")
        assert self.channels.send_activation is not None
        self.channels.send_activation.send(MessageKind.EVAL_ACTIVATION, idx, tensors, is_tuple=is_tuple)
        return None

    def local_forward(self, x: Any) -> Any:
        """This stage's layers on the current micro-batch: the target of the redirected ``pipeline(...)`` call.

        Stage 0 uses ``x`` (what the user passed); later stages ignore it and use the received activation.
        """
        mb = self._current
        if mb is None:
            raise ConfigurationError(
                "self.pipeline(...) was called outside of a pipeline step. Under DynPipeStrategy the pipeline "
                "can only be called once, from training_step/validation_step/test_step/predict_step."
            )
        mb.calls += 1
        if mb.calls > 1:
            raise ConfigurationError(
                "self.pipeline(...) was called twice in one step. Under DynPipeStrategy each step runs the pipeline "
                "once per micro-batch: the other stages have computed one activation for it, so a second call "
                "cannot see its own input (it would silently get the first call's result). Call the pipeline once, "
                "e.g. put two views of a batch in one call with torch.cat along the batch dimension and split the "
                "output."
            )
        if self._step_input is not None and mb.batch is not None:
            expected, self._step_input = self._step_input(mb.batch), None
            if not _same_input(x, expected):
                given, fed = _describe(x), _describe(expected)
                raise ConfigurationError(
                    f"The step called self.pipeline(...) with {given}, but stage 0 feeds the pipeline "
                    f"{'the same shapes with other values' if given == fed else fed} from the same micro-batch "
                    "(batch[0] of a tuple or list batch, or a tensor batch itself). With more than one stage, stage "
                    "0 never runs your step: what the step does to the input before the call (a reshape, a "
                    "normalisation, an augmentation) is not applied. Move it into `def pipeline_input(self, batch)` "
                    "on your LightningModule and call self.pipeline(self.pipeline_input(batch)) in the step, or into "
                    "the first layer."
                )
        value = x if self.is_first else mb.input_value
        t0 = time.perf_counter()
        copies: list[Tensor] = []
        if self._copy_input is not False and torch.is_grad_enabled():
            value, copies = _copy_received(value)
        params = None
        if mb.version is not None:
            assert self.stash is not None
            params = self.stash.params(mb.version)
        buffers = None
        if self._check_buffer_writes and self.stage_module.training and torch.is_grad_enabled():
            self._check_buffer_writes = False
            buffers = [(self._pipeline_name(name), b, b._version) for name, b in self.stage_module.named_buffers()]
        try:
            if self._checkpointing and torch.is_grad_enabled():
                out = self._checkpointed_forward(value, params)
            elif params is not None:
                out = self._forward_on(params, value)
            else:
                out = self.stage_module(value)
        except RuntimeError as err:
            if "leaf Variable that requires grad is being used in an in-place operation" not in str(err):
                raise
            raise ConfigurationError(
                f"Stage {self.stage_idx}'s layers wrote their input in place, but not on the first micro-batch this "
                "stage ran. A stage after the first receives its input as a leaf tensor, which autograd does not let "
                "a layer write in place; the stage gives its layers a copy when they wrote the first micro-batch's "
                "input, and the received tensor itself otherwise. Make the layer write its input in place on every "
                "call or on none (e.g. nn.ReLU(inplace=False)), or put it after another layer of the same stage (a "
                "balance that does not cut before it)."
            ) from err
        if copies and self._copy_input is None:
            self._copy_input = any(c._version > 0 for c in copies)
        if buffers:
            self._refuse_buffer_writes([name for name, b, version in buffers if b._version != version])
        self._layers_forward_s += time.perf_counter() - t0
        mb.output = out
        return out

    def _pipeline_name(self, name: str) -> str:
        """A name in the stage module (``"0.weight"``) as the pipeline names it (``"2.weight"``)."""
        local, _, rest = name.partition(".")
        return f"{self.first_layer + int(local)}.{rest}"

    def _refuse_buffer_writes(self, written: list[str]) -> None:
        if not written:
            return
        M = self.num_microbatches
        raise ConfigurationError(
            f"Stage {self.stage_idx}'s layers update buffers in every training forward ({written[:4]}): running "
            "statistics or a power iteration such as spectral norm's. "
            f"schedule={self.schedule.name!r} promises one device's update on the whole batch, but with "
            f"num_microbatches={M} that forward runs {M} times per batch instead of once, so the buffers, and the "
            "weights that depend on them, would differ from one device's. Use num_microbatches=1, or "
            "schedule='async' (whose updates are each one micro-batch's), or "
            "DynPipeStrategy(microbatch_statistics=True) to accept one buffer update per micro-batch."
        )

    def _forward_on(self, params: dict[str, Tensor], value: Any) -> Any:
        """The stage's forward with its parameters replaced by ``params`` (a stashed version) for the call.

        What ``torch.func.functional_call(stage_module, params, (value,))`` computes, tied parameters included,
        with less per-call work: the modules' parameter slots are swapped directly and put back afterwards.
        """
        saved = [module._parameters[local] for module, local, _ in self._slots]
        try:
            for module, local, name in self._slots:
                module._parameters[local] = params[name]  # type: ignore[assignment]
            return self.stage_module(value)
        finally:
            for (module, local, _), original in zip(self._slots, saved):
                module._parameters[local] = original

    def _checkpointed_forward(self, value: Any, params: dict[str, Tensor] | None) -> Any:
        """The stage layer by layer; checkpointed layers keep only their input and recompute in the backward.

        A checkpointed layer runs as a function of its input and of the exact tensors of its weight version
        (passed to :func:`torch.utils.checkpoint.checkpoint` as inputs), so the recomputation uses the weights
        the forward used even after an update, and the random state is replayed (the same dropout masks).
        """
        live = dict(self.stage_module.named_parameters())
        tensors = params if params is not None else live
        out = value
        for layer, names, ckpt in zip(self.stage_module.children(), self._layer_names, self.checkpoint):
            local = [n for n, _ in names]
            weights = [tensors[stage_name] for _, stage_name in names]
            if ckpt:

                def run(inp: Any, *ws: Tensor, layer: nn.Module = layer, local: list[str] = local) -> Any:
                    return functional_call(layer, dict(zip(local, ws)), (inp,))

                out = torch_checkpoint(run, out, *weights, use_reentrant=False)
            elif params is not None:
                out = functional_call(layer, dict(zip(local, weights)), (out,))
            else:
                out = layer(out)
        return out

    # ------------------------------------------------------------------ dispatch
    def _run(self, program: Sequence[Instruction]) -> None:
        for instr in program:
            handler = self._handlers.get(type(instr))
            if handler is None:
                raise ScheduleError(
                    f"Stage {self.stage_idx} cannot execute instruction {instr!s} of type {type(instr).__name__}; "
                    f"known: {', '.join(t.__name__ for t in self._handlers)}."
                )
            handler(instr)

    def _mb(self, mb_idx: int) -> _MicroBatch:
        mb = self._mbs.get(mb_idx)
        if mb is None:
            mb = self._mbs[mb_idx] = _MicroBatch(slot=mb_idx - self._step_base)
        return mb

    @staticmethod
    def _rebuild(tensors: list[Tensor | None], is_tuple: bool) -> Any:
        if is_tuple:
            return tuple(tensors)
        return tensors[0]

    def _account_recv(self, msg: Message, wanted_at: float) -> None:
        self.stats.recv_wait_s += time.perf_counter() - wanted_at
        self.stats.comm_s += msg.transfer_s
        self.stats.exposed_comm_s += msg.exposed_transfer_s(wanted_at)

    def _recv_activation(self, instr: RecvActivation) -> None:
        assert self.channels.recv_activation is not None
        t0 = time.perf_counter()
        msg = self.channels.recv_activation.get(MessageKind.ACTIVATION, instr.mb_idx)
        self._account_recv(msg, t0)
        inputs: list[Tensor | None] = []
        for t in msg.tensors:
            if t is not None and t.is_floating_point() and msg.header.specs[len(inputs)].requires_grad:  # type: ignore[union-attr]
                t.requires_grad_(True)
            inputs.append(t)
        mb = self._mb(instr.mb_idx)
        mb.inputs = inputs
        mb.input_value = self._rebuild(inputs, msg.header.is_tuple)
        mb.sample_id = msg.header.aux  # stage 0's checksum of the micro-batch's samples, passed on by every stage

    def _check_stashed_weights(self) -> None:
        """Refuses live weights written in place outside an update while a micro-batch in flight uses them."""
        assert self.stash is not None
        written = self.stash.written_in_place()
        if written:
            raise ConfigurationError(
                f"Stage {self.stage_idx}'s weights {written[:3]} were written in place outside an optimizer update "
                f"(in a hook such as on_train_batch_end, or after optimizer.step() in optimizer_step) while "
                f"{self.in_flight} micro-batch(es) in flight still use them: under schedule={self.schedule.name!r} "
                "each backward must use the weights its forward saw, and these are gone. Write the weights in "
                "on_before_optimizer_step (the weight stash keeps a copy first), or use schedule='sync', where no "
                "micro-batch is in flight between steps."
            )

    def _weights(self) -> list[float]:
        """The step's micro-batch weights: ``loss_terms`` of each, checked, else the sample counts."""
        if self._loss_terms is None:
            return [float(n) for n in self._step_sizes]
        weights = []
        for slot, mb in enumerate(self._step_batches):
            value = self._loss_terms(mb)
            try:
                w = float(value.item() if isinstance(value, Tensor) else value)
                shown = repr(w)
            except (TypeError, ValueError, RuntimeError):
                w, shown = math.nan, _describe(value)
            if not (math.isfinite(w) and w >= 0):
                raise ConfigurationError(
                    f"loss_terms must return how many terms the loss of a micro-batch averages: a finite number >= "
                    f"0 (or a one-element tensor); it returned {shown} for micro-batch {slot} of this step. Count "
                    "what the loss divides by, for example (targets != ignore_index).sum()."
                )
            weights.append(w)
        if self.schedule.accumulates and not sum(weights) > 0:
            raise ConfigurationError(
                f"loss_terms returned 0 for every micro-batch of this step ({weights}): the step's mean loss averages "
                f"nothing, and schedule={self.schedule.name!r} cannot weight the micro-batches by their share of it. "
                "Leave batches without any counted target out of the data."
            )
        return weights

    def _stash_weights(self, instr: StashWeights) -> None:
        assert self.stash is not None, "StashWeights on a stage without staleness"
        self._mb(instr.mb_idx).version = self.stash.acquire()
        self.stats.max_stash_depth = max(self.stats.max_stash_depth, self.stash.depth)

    def _forward(self, instr: Forward) -> None:
        t0 = time.perf_counter()
        self._layers_forward_s = 0.0
        mb = self._mb(instr.mb_idx)
        if self.is_first or self.is_last:
            mb.batch = self._step_batches[mb.slot]
            if mb.slot == 0 and not (self.is_first and self.is_last):  # once per step
                self._check_same_samples(mb, instr.mb_idx)
        with torch.enable_grad():
            self._current = mb
            try:
                if self.is_last:
                    assert self._last_stage_loss is not None
                    if self.schedule.accumulates:  # one update for the step: weight by micro-batch size
                        mb.scale = self._step_weights[mb.slot] / sum(self._step_weights)
                    mb.loss = self._last_stage_loss(mb.batch, mb.slot)
                    if mb.calls == 0:
                        raise ConfigurationError(
                            "training_step returned a loss without calling self.pipeline(...). Under DynPipeStrategy "
                            "every training step must call the pipeline exactly once: the other stages have already "
                            "computed this micro-batch, and a loss that does not come from the pipeline's output "
                            "would train nothing they hold. Call self.pipeline(x) (or self(x)) in training_step."
                        )
                    mb.loss_value = float(mb.loss.detach())
                    self._step_losses.append(mb.loss_value)
                else:
                    x = self._first_stage_input(mb.batch) if self.is_first else None  # type: ignore[misc]
                    self.local_forward(x)
            finally:
                self._current = None
        mb.batch = None
        # forward_s is the stage's layers only; the rest (the user's step on the last stage: loss, logging;
        # reading the input on stage 0) is user_s, so a slow training_step is not mistaken for a slow stage.
        self.stats.forward_s += self._layers_forward_s
        self.stats.user_s += time.perf_counter() - t0 - self._layers_forward_s
        self.stats.num_forward += 1

    def _check_same_samples(self, mb: _MicroBatch, mb_idx: int) -> None:
        """Stage 0 records the first micro-batch's :func:`sample_identity` (its message carries it); the last stage
        compares its own with it. Each reads the batch in its own process, so a sampler or a dataset whose order
        depends on the process would pair one sample's inputs with another's targets."""
        ident = sample_identity(mb.batch)
        if self.is_first:
            mb.sample_id = ident
        elif not (math.isnan(ident) or math.isnan(mb.sample_id)) and ident != mb.sample_id:
            raise ConfigurationError(
                f"Stage 0 and the last stage read different samples for micro-batch {mb_idx}: the integer tensors of "
                f"their batches (labels, token ids) differ (checksums {mb.sample_id:.6g} and {ident:.6g}). Each "
                "stage reads the batch in its own process, so every process must draw the same batches in the same "
                "order: Lightning's sampler does (Trainer(use_distributed_sampler=True), the default); a sampler or "
                "an iterable dataset of yours must not depend on the process (its RNG, its rank): seed it with a "
                "fixed torch.Generator, and so a collate_fn or dataset that draws random numbers for integer "
                "tensors (token masking)."
            )

    def _send_activation(self, instr: SendActivation) -> None:
        t0 = time.perf_counter()
        mb = self._mbs[instr.mb_idx]
        tensors, is_tuple = _flatten(mb.output, f"The output of stage {self.stage_idx}")
        assert self.channels.send_activation is not None
        self.channels.send_activation.send(
            MessageKind.ACTIVATION, instr.mb_idx, tensors, aux=mb.sample_id, is_tuple=is_tuple
        )
        self.stats.send_s += time.perf_counter() - t0

    def _recv_grad(self, instr: RecvGrad) -> None:
        assert self.channels.recv_grad is not None
        t0 = time.perf_counter()
        msg = self.channels.recv_grad.get(MessageKind.GRADIENT, instr.mb_idx)
        self._account_recv(msg, t0)
        mb = self._mbs[instr.mb_idx]
        mb.out_grads = msg.tensors
        mb.loss_value = msg.header.aux
        if not math.isnan(msg.header.aux):
            self._step_losses.append(msg.header.aux)

    def _backward(self, instr: Backward) -> None:
        t0 = time.perf_counter()
        mb = self._mbs[instr.mb_idx]
        if self.stash is not None:  # what the last update left of the released versions: free for the gradients
            self.stash.drop_spares()
        if self.is_last:
            assert mb.loss is not None
            if not mb.loss.requires_grad:
                raise ConfigurationError(
                    "The loss returned by training_step does not require grad, so the pipeline cannot "
                    "back-propagate it. Return the loss computed from self.pipeline(...)'s output."
                )
            # a micro-batch without terms adds nothing to the step's mean (its own loss, a mean over nothing, may be
            # NaN): nothing is back-propagated, and the stages before receive no gradient for it
            outputs: list[Tensor] = [] if mb.scale == 0.0 else [mb.loss * mb.scale if mb.scale != 1.0 else mb.loss]
            grad_outputs: list[Tensor] | None = None
        else:
            outs, _ = _flatten(mb.output, "stage output")
            assert mb.out_grads is not None
            outputs, grad_outputs = [], []
            for o, g in zip(outs, mb.out_grads):
                if g is not None and o.requires_grad:
                    outputs.append(o)
                    grad_outputs.append(g)
        if mb.version is not None:
            assert self.stash is not None
            if mb.version == self.stash.version:  # its forward's weights are the live ones: still unwritten?
                self._check_stashed_weights()
            snap = self.stash.params(mb.version)
            params = [snap[n] for n in self._names]
        else:
            params = self._live
        p_idx = [i for i, p in enumerate(params) if p.requires_grad]
        in_idx = [i for i, t in enumerate(mb.inputs or []) if t is not None and t.requires_grad]
        wrt = [params[i] for i in p_idx] + [mb.inputs[i] for i in in_idx]  # type: ignore[index,misc]
        inputs: list[Tensor | None] = mb.inputs or []
        input_grads: list[Tensor | None] = [None] * len(inputs)
        received = [t for i in in_idx if (t := inputs[i]) is not None]
        if outputs and wrt and mb.version is None and all(t.is_leaf for t in received):
            # The live parameters: autograd adds each gradient into .grad as it is produced (as loss.backward()
            # does in plain training), so accumulating micro-batches holds one parameter's new gradient at a time,
            # not a second copy of the whole stage's gradients. The inputs are this micro-batch's own leaves.
            torch.autograd.backward(outputs, grad_outputs, inputs=wrt)
            for i, t in zip(in_idx, received):
                input_grads[i] = t.grad
        elif outputs and wrt:
            grads = torch.autograd.grad(outputs, wrt, grad_outputs, allow_unused=True)
            for i, g in zip(p_idx, grads[: len(p_idx)]):
                if g is None:
                    continue
                live = self._live[i]
                if mb.version is not None and live._backward_hooks:
                    # differentiated at the stashed version's tensor, which has none of the parameter's hooks: run
                    # them here, as autograd runs them on the parameter's gradient before accumulating it
                    g = _tensor_hooks(live, g)
                if live.grad is None:
                    live.grad = g
                else:
                    live.grad.add_(g)
                if live._post_accumulate_grad_hooks:  # autograd.grad accumulates nothing, so it runs none of these
                    for hook in list(live._post_accumulate_grad_hooks.values()):
                        hook(live)
            for i, g in zip(in_idx, grads[len(p_idx) :]):
                input_grads[i] = g
        mb.input_grads = input_grads
        if mb.version is not None:
            assert self.stash is not None
            self.stash.release(mb.version)
            mb.version = None
        mb.output = mb.loss = mb.out_grads = mb.input_value = mb.inputs = None
        if self.is_first:
            del self._mbs[instr.mb_idx]
        self.stats.backward_s += time.perf_counter() - t0
        self.stats.num_backward += 1

    def _send_grad(self, instr: SendGrad) -> None:
        t0 = time.perf_counter()
        mb = self._mbs.pop(instr.mb_idx)
        assert self.channels.send_grad is not None
        self.channels.send_grad.send(MessageKind.GRADIENT, instr.mb_idx, mb.input_grads, aux=mb.loss_value)
        self.stats.send_s += time.perf_counter() - t0

    def _update(self, instr: OptimizerStep) -> None:
        t0 = time.perf_counter()
        if self.stash is not None and self.stash.shares_live:
            self._check_stashed_weights()
            if self._fresh_storage_updates:
                self.update_stash = self.stash
            else:
                self.stash.before_update()
        if instr.mb_idx is not None:  # async: the update applies one micro-batch's gradient
            self.update_samples = self._mb_samples.pop(instr.mb_idx)
        else:  # one update for the step's accumulated micro-batches
            self.update_samples = sum(self._mb_samples.values())
            self._mb_samples.clear()
        try:
            self._optimizer_step()
        finally:
            self.update_stash = None
        if self.stash is not None:
            self.stash.bump()
        self.stats.optimizer_s += time.perf_counter() - t0
        self.stats.num_updates += 1
