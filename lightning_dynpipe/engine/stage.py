"""One process's part of a running pipeline: its process groups, stage shard, optimizer slots and executor.

:class:`PipelineStage` is what the strategy builds at set-up and tears down at the end of a run. It owns the
engine objects and the operations on them that need several of them at once: moving layers between stages,
gathering a partition-independent state, and putting the whole model back into the user's module. It knows
nothing of Lightning: user code reaches it as plain callables (stage 0's input, the last stage's loss, the
hooks to run before each optimizer update).

Example::

    stage = PipelineStage.start(pipeline=model.pipeline, partition=Partition((2, 1)), topology=topo, rank=rank,
                                backend="gloo", timeout=timedelta(minutes=30), device=torch.device("cpu"),
                                schedule="async", num_microbatches=4, optimizers=[opt],
                                first_stage_input=lambda b: b[0], last_stage_loss=loss_fn,
                                before_update=lambda opt: None)
    loss = stage.executor.train_step(batch)
    stage.close(interrupted=False)      # drains, restores every layer, destroys the groups
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dynpipe.engine import checkpoint
from lightning_dynpipe.engine.collectives import DistCollectives
from lightning_dynpipe.engine.executor import StageExecutor
from lightning_dynpipe.engine.groups import PipelineGroups, build_channels, build_groups
from lightning_dynpipe.engine.outofplace import stash_aware_step
from lightning_dynpipe.engine.p2p import FailureHandler
from lightning_dynpipe.engine.replica import average_replica_gradients
from lightning_dynpipe.engine.shard import OptimizerSlots, StageShard
from lightning_dynpipe.engine.ties import (
    SharedParameter,
    copies_counted_elsewhere,
    retie,
    split_ties,
    sum_shared_gradients,
)
from lightning_dynpipe.engine.topology import PipelineTopology
from lightning_dynpipe.engine.transfer import move_layers
from lightning_dynpipe.engine.updates import clear_grads, scaled_lr
from lightning_dynpipe.plan.moves import LayerMove, plan_moves
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.schedule import Schedule

__all__ = ["PipelineStage"]


class PipelineStage:
    """The running stage of this process (build it with :meth:`start`).

    Attributes:
        shard: the stage's layers inside the user's pipeline.
        slots: where each parameter sits in the optimizers built on the whole model (``None`` outside fit).
        executor: runs the stage's instructions.
        groups: the process groups of this rank.
        topology: stages and replicas on global ranks.
        rank: this process's global rank.
        failure: spreads a failure to the neighbouring stages.
        weigh_replicas: average the replicas' gradients weighted by their sample counts (set by the strategy
            when the global batch is split across the replicas, ``replica_split``) instead of by ``1/D``.
        replica_cover: ``(replica, start, count, total)``: the slice of the global batch this replica's current
            step trains on (set by the strategy with ``weigh_replicas``); every update's all-reduce checks that
            the replicas' slices tile the global batch.
    """

    def __init__(
        self,
        *,
        shard: StageShard,
        slots: OptimizerSlots | None,
        groups: PipelineGroups,
        topology: PipelineTopology,
        rank: int,
        device: torch.device,
        timeout_s: float,
        schedule: Schedule | str,
        num_microbatches: int,
        optimizers: Sequence[Optimizer],
        first_stage_input: Callable[[Any], Any],
        last_stage_loss: Callable[[Any, int], Tensor],
        before_update: Callable[[Optimizer], None],
        lr_scale: float = 1.0,
        ties: Sequence[SharedParameter] = (),
        checkpoint_layers: Collection[int] = (),
        before_update_may_write: Callable[[], bool] | None = None,
        microbatch_statistics: bool = True,
        step_input: Callable[[Any], Any] | None = None,
        loss_terms: Callable[[Any], Any] | None = None,
    ) -> None:
        self.shard = shard
        self.checkpoint_layers = frozenset(checkpoint_layers)
        self.lr_scale = lr_scale
        self.weigh_replicas = False
        self.replica_cover: tuple[int, int, int, int] | None = None
        self.ties = tuple(ties)
        self.split_ties = split_ties(self.ties, shard.partition)
        self.slots = slots
        self.groups = groups
        self.topology = topology
        self.rank = rank
        self.device = device
        self.optimizers = list(optimizers)
        self._schedule = schedule
        self._num_microbatches = num_microbatches
        self._first_stage_input = first_stage_input
        self._last_stage_loss = last_stage_loss
        self._before_update = before_update
        self._before_update_may_write = before_update_may_write or (lambda: True)
        self.microbatch_statistics = microbatch_statistics
        self._step_input = step_input
        self._loss_terms = loss_terms
        self.failure = FailureHandler(self.stage_idx, rank)
        self.executor = self._executor(build_channels(groups, device, timeout_s, self.failure))

    @classmethod
    def start(
        cls,
        *,
        pipeline: nn.Sequential,
        partition: Partition,
        topology: PipelineTopology,
        rank: int,
        backend: str | None,
        timeout: timedelta,
        device: torch.device,
        schedule: Schedule | str,
        num_microbatches: int,
        optimizers: Sequence[Optimizer],
        first_stage_input: Callable[[Any], Any],
        last_stage_loss: Callable[[Any, int], Tensor],
        before_update: Callable[[Optimizer], None],
        lr_scale: float = 1.0,
        ties: Sequence[SharedParameter] = (),
        checkpoint_layers: Collection[int] = (),
        before_update_may_write: Callable[[], bool] | None = None,
        microbatch_statistics: bool = True,
        step_input: Callable[[Any], Any] | None = None,
        loss_terms: Callable[[Any], Any] | None = None,
    ) -> PipelineStage:
        """Creates the process groups (collective over WORLD), partitions the module and opens the channels.

        ``optimizers`` must have been built on the whole model (their groups fix the canonical order); they are
        refiltered in place to this stage's parameters. Pass ``[]`` outside fit. ``lr_scale`` multiplies the
        learning rate of every update (:func:`~lightning_dynpipe.engine.updates.scaled_lr`). ``ties``: the
        parameters shared by several layers (:func:`~lightning_dynpipe.engine.ties.shared_parameters` of the
        whole model); those split across stages have their gradients summed before every update.
        ``checkpoint_layers``: the pipeline's layer indices whose activations are recomputed in the backward
        (wherever those layers are, after migrations too). ``before_update_may_write``: whether ``before_update``
        may run code that writes the weights in place (user hooks); ``None`` assumes it may. Where it may not,
        an update that a stashed weight version still shares the storage of writes the new weights to fresh
        storage instead of copying the old ones first, for the optimizers that
        :mod:`~lightning_dynpipe.engine.outofplace` reproduces exactly. ``microbatch_statistics``: whether layers
        may update buffers once per micro-batch under a flush schedule, ``step_input`` what the last stage's
        step must pass to the pipeline, and ``loss_terms`` how many terms a micro-batch's loss averages (see
        :class:`StageExecutor`).
        """
        groups = build_groups(topology, rank, backend, timeout)
        # record the optimizer slots before partitioning: offloading may replace Parameter objects
        slots = OptimizerSlots.record(pipeline, optimizers) if optimizers else None
        shard = StageShard(pipeline, partition, topology.coords(rank)[1])
        shard.partition_module()
        if slots is not None:
            slots.refilter(optimizers, shard)
        return cls(
            shard=shard,
            slots=slots,
            groups=groups,
            topology=topology,
            rank=rank,
            device=device,
            timeout_s=timeout.total_seconds(),
            schedule=schedule,
            num_microbatches=num_microbatches,
            optimizers=optimizers,
            first_stage_input=first_stage_input,
            last_stage_loss=last_stage_loss,
            before_update=before_update,
            lr_scale=lr_scale,
            ties=ties,
            checkpoint_layers=checkpoint_layers,
            before_update_may_write=before_update_may_write,
            microbatch_statistics=microbatch_statistics,
            step_input=step_input,
            loss_terms=loss_terms,
        )

    # ------------------------------------------------------------------ where this stage sits
    @property
    def stage_idx(self) -> int:
        """``k``: the stage this process runs."""
        return self.topology.coords(self.rank)[1]

    @property
    def dp_rank(self) -> int:
        """The pipeline replica this process belongs to."""
        return self.topology.coords(self.rank)[0]

    @property
    def partition(self) -> Partition:
        """The partition in use."""
        return self.shard.partition

    def rank_of_stage(self, stage_idx: int) -> int:
        """The global rank of stage ``stage_idx`` in this process's pipeline."""
        return self.topology.rank_of(self.dp_rank, stage_idx)

    def pipeline_collectives(self) -> DistCollectives:
        """Collectives over this pipeline's stages (every stage of the replica takes part)."""
        return DistCollectives(self.groups.pipeline, self.rank)

    # ------------------------------------------------------------------ running
    def _executor(self, channels: Any) -> StageExecutor:
        executor = StageExecutor(
            stage_module=self.shard.stage_module(),
            stage_idx=self.stage_idx,
            num_stages=self.topology.num_stages,
            schedule=self._schedule,
            num_microbatches=self._num_microbatches,
            channels=channels,
            first_stage_input=self._first_stage_input,
            last_stage_loss=self._last_stage_loss,
            optimizer_step=self._optimizer_step,
            checkpoint=[i in self.checkpoint_layers for i in self.shard.owned],
            fresh_storage_updates=True,
            microbatch_statistics=self.microbatch_statistics,
            first_layer=self.shard.owned[0] if self.shard.owned else 0,
            step_input=self._step_input,
            loss_terms=self._loss_terms,
        )
        # The user's self.pipeline(x) call is this stage's part of the pipeline.
        self.shard.pipeline.forward = lambda *args, **kwargs: executor.local_forward(args[0] if args else None)  # type: ignore[method-assign]
        return executor

    def _optimizer_step(self) -> None:
        if not self.optimizers:
            return
        opt = self.optimizers[0]
        stash = self.executor.update_stash  # set when a micro-batch in flight uses the live weights' storage
        step = stash_aware_step(opt, stash, user_code_first=stash is not None and self._before_update_may_write())
        if self.topology.dp_size > 1:
            params = [p for g in opt.param_groups for p in g["params"]]
            # an uneven replica split weighs each replica's gradient by its samples; an even one by 1/D
            samples = self.executor.update_samples if self.weigh_replicas else None
            cover = self.replica_cover if self.weigh_replicas else None
            average_replica_gradients(
                params,
                DistCollectives(self.groups.stage_dp, self.rank),
                self.topology.dp_size,
                samples=samples,
                cover=cover,
            )
        if self.split_ties:  # every stage of the pipeline takes part, holder of a copy or not
            sum_shared_gradients(self.shard.pipeline, self.split_ties, self.shard.owned, self.pipeline_collectives())
        self._before_update(opt)
        with scaled_lr(opt, self.lr_scale):
            step()
        clear_grads(opt)

    def check_optimizers(self) -> None:
        """Refuses parameters added to the optimizer since the split (:meth:`OptimizerSlots.check_unchanged`). The
        strategy calls it at the start of every training step, where a neighbour waiting for this stage's message
        learns of the refusal; a re-split (:meth:`migrate`) and a checkpoint check it too, since both use the
        split."""
        if self.slots is not None and self.optimizers:
            self.slots.check_unchanged(self.optimizers, self.stage_idx)

    def shared_copies_counted_elsewhere(self) -> set[int]:
        """The ids of this stage's copies of parameters shared across stages that an earlier stage also holds: a
        norm over the whole pipeline counts each shared parameter once, on the first stage that holds it."""
        return copies_counted_elsewhere(
            self.shard.pipeline, self.split_ties, self.shard.owned, self.partition, self.stage_idx
        )

    def reschedule(self, schedule: Schedule) -> None:
        """Drains with the current schedule, then runs the next steps with ``schedule`` (every rank of the pipeline
        calls it at the same step with the same schedule; nothing is sent)."""
        self.executor.drain()
        self._schedule = schedule
        self.executor = self._executor(self.executor.channels)

    def migrate(self, new: Partition) -> tuple[tuple[LayerMove, ...], int]:
        """Drains, moves the layers that change stage, rebuilds the stage; returns the moves and the bytes sent.

        Collective over the pipeline: every rank calls it with the same ``new``. The layers travel with their
        buffers and optimizer state; the optimizer groups are refiltered in place.
        """
        moves = plan_moves(self.shard.partition, new)
        self.executor.drain()
        sent = move_layers(
            self.shard,
            moves,
            self.optimizers[0] if self.optimizers else None,
            rank=self.rank,
            rank_of_stage=self.rank_of_stage,
            group=self.groups.pipeline,
            device=self.device,
        )
        self.shard.set_partition(new)
        retie(self.shard.pipeline, self.ties, self.shard.owned)  # a layer that arrived shares what is here
        self.split_ties = split_ties(self.ties, new)
        if self.slots is not None:
            self.slots.refilter(self.optimizers, self.shard)
        self.executor = self._executor(self.executor.channels)
        return moves, sent

    # ------------------------------------------------------------------ partition-independent state
    def layer_states(self, root: int | None, everything: bool = False) -> dict[int, dict[str, Tensor]]:
        """Every layer's ``state_dict`` (``everything``: all its tensors) on ``root`` (``None``: on every rank of
        the pipeline). Collective."""
        if root is not None and self.dp_rank != 0:
            return {}  # one pipeline replica writes the checkpoint
        return checkpoint.gather_layer_states(
            self.shard,
            self.pipeline_collectives(),
            rank_of_stage=self.rank_of_stage,
            device=self.device,
            root=root,
            everything=everything,
        )

    def optimizer_state(self, optimizer: Optimizer, everywhere: bool = False) -> dict[str, Any]:
        """The plain optimizer's ``state_dict`` on global rank 0 (``everywhere``: on every rank), ``{}``
        elsewhere. Collective over the pipeline; each parameter's state travels as tensors, to rank 0 only
        unless ``everywhere``."""
        assert self.slots is not None
        self.check_optimizers()
        if not everywhere and self.dp_rank != 0:
            return {}  # one pipeline replica writes the checkpoint; the others hold the same state
        idx = self.optimizers.index(optimizer)
        holders = {c: self.rank_of_stage(k) for c, k in self.slots.holders(idx, self.partition).items()}
        return checkpoint.gather_optimizer_state(
            optimizer.state_dict(),
            self.slots.canonical[idx],
            self.slots.group_sizes[idx],
            holders,
            self.pipeline_collectives(),
            device=self.device,
            root=self.rank if self.topology.num_stages == 1 else (None if everywhere else 0),
        )

    def optimizer_shard(self, optimizer: Optimizer) -> dict[str, Any]:
        """This stage's part of the plain optimizer's ``state_dict``: the state of the parameters it speaks for
        (:meth:`~lightning_dynpipe.engine.shard.OptimizerSlots.holders`), by canonical index, and the whole
        model's ``param_groups``. Local: nothing is gathered. ``{}`` on pipeline replicas other than the first."""
        assert self.slots is not None
        self.check_optimizers()
        if self.dp_rank != 0:
            return {}
        idx = self.optimizers.index(optimizer)
        mine = {c for c, k in self.slots.holders(idx, self.partition).items() if k == self.stage_idx}
        local = optimizer.state_dict()
        flat = [c for g in self.slots.canonical[idx] for c in g]
        state = {flat[i]: st for i, st in local["state"].items() if flat[i] in mine}
        groups, base = [], 0
        for g, n in zip(local["param_groups"], self.slots.group_sizes[idx]):
            groups.append({**g, "params": list(range(base, base + n))})
            base += n
        return {"state": {c: state[c] for c in sorted(state)}, "param_groups": groups}

    def load_optimizer_states(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Loads plain optimizer ``state_dict``\\ s: each optimizer takes its own parameters' entries."""
        assert self.slots is not None
        for opt, full, canon in zip(self.optimizers, states, self.slots.canonical):
            checkpoint.load_optimizer_state(opt, full, canon)

    # ------------------------------------------------------------------ the end
    def close(self, interrupted: bool, gather: bool = True) -> None:
        """Ends the stage: drains, puts every layer back into the user's pipeline and every parameter (with its
        state) back into the optimizers, in the plain model's order, and destroys the groups.

        With ``gather=False`` nothing is put back: the module keeps this stage's layers (placeholders for the
        others) and the optimizers this stage's parameters, so no process ever holds the whole model.

        After an interruption (a failure, Ctrl-C) nothing collective runs: the module keeps only this stage's
        layers, and the groups are left to the process's exit.
        """
        pipeline = self.shard.pipeline
        if "forward" in pipeline.__dict__:
            del pipeline.forward
        if interrupted:
            return
        self.executor.drain()
        self.executor.channels.close()
        if gather:
            states = [self.optimizer_state(opt, everywhere=True) for opt in self.optimizers] if self.slots else []
            if self.shard.offloaded:
                self.shard.restore(self.layer_states(root=None, everything=True), self.device)
            retie(self.shard.pipeline, self.ties, range(len(self.shard.pipeline)))
            if self.slots is not None:
                self.slots.unfilter(self.optimizers, self.shard.pipeline, states)
        # No rank may tear its channel groups down while a peer is still completing sends on them.
        if self.groups.pipeline is not None and self.topology.num_stages > 1:
            dist.barrier(group=self.groups.pipeline)
        self.groups.destroy()
