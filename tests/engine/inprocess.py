"""A whole pipeline in one process: every stage's StageExecutor on its own thread, over loopback channels.

The engine's numerics can then be checked against the single-process references without starting processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dynpipe.engine.executor import StageExecutor
from lightning_dynpipe.engine.loopback import LoopbackGroup, loopback_channels, run_stages
from lightning_dynpipe.engine.outofplace import stash_aware_step
from lightning_dynpipe.engine.shard import StageShard
from lightning_dynpipe.engine.ties import shared_parameters, split_ties, sum_shared_gradients
from lightning_dynpipe.plan.partition import Partition


@dataclass
class InProcessPipeline:
    """Executors of every stage of ``pipeline`` (edited in place: each stage holds its own layers)."""

    executors: list[StageExecutor]
    optimizers: list[Optimizer | None]
    shards: list[StageShard]

    def train(self, batches: Sequence[Any]) -> list[list[float]]:
        """Runs one ``train_step`` per batch on every stage, then drains; returns each stage's step losses."""

        def run(k: int) -> list[float]:
            losses = [self.executors[k].train_step(b) for b in batches]
            self.executors[k].drain()
            return losses

        return run_stages(run, len(self.executors))


def build(
    pipeline: nn.Sequential | Sequence[nn.Sequential],
    balance: Sequence[int],
    *,
    schedule: str,
    num_microbatches: int,
    make_optimizer: Callable[[list[nn.Parameter]], Optimizer],
    loss_fn: Callable[[Any, Any], Tensor],
    input_fn: Callable[[Any], Any] = lambda batch: batch[0],
    checkpoint: bool = False,
    fresh_storage: bool = False,
    timeout: float = 30.0,
    microbatch_statistics: bool = True,
    loss_terms: Callable[[Any], Any] | None = None,
) -> InProcessPipeline:
    """One executor per stage of a ``balance`` split of ``pipeline``.

    With one ``nn.Sequential`` the stages share its layers (no copies). With one copy of the model per stage (as
    separate processes hold), each copy is partitioned like a process's module (the layers of other stages become
    placeholders), and parameters shared by layers on different stages have their gradients summed between the
    stages before each update, as the strategy does. ``fresh_storage``: the updates that a stashed version
    shares the weights of write fresh storage where the optimizer allows it, as the strategy's do
    (:func:`~lightning_dynpipe.engine.outofplace.stash_aware_step`), instead of the executor copying first.
    ``timeout``: how long a stage waits for a message (a test of a failing stage shortens it).
    ``microbatch_statistics``: as the executor's (``False``: buffers written by a training forward are refused).
    ``loss_terms``: as the executor's (the module hook: how many terms a micro-batch's loss averages).
    """
    copies = list(pipeline) if not isinstance(pipeline, nn.Sequential) else None
    first = copies[0] if copies is not None else pipeline
    assert isinstance(first, nn.Sequential)
    partition = Partition.from_balance(balance, len(first))
    S = partition.num_stages
    channels = loopback_channels(S, timeout=timeout)
    ties = split_ties(shared_parameters(first), partition) if copies is not None else []
    group = LoopbackGroup(list(range(S)))
    executors: list[StageExecutor] = []
    optimizers: list[Optimizer | None] = []
    shards: list[StageShard] = []
    for k in range(S):
        if copies is not None:
            shard = StageShard(copies[k], partition, k)
            shard.partition_module()
        else:
            shard = StageShard(first, partition, k)  # not partitioned: all stages share the one module
        stage = shard.stage_module()
        params = list(stage.parameters())
        opt = make_optimizer(params) if params else None

        holder: list[StageExecutor] = []

        def step(opt: Optimizer | None = opt, shard: StageShard = shard, k: int = k, holder: list = holder) -> None:
            run = None
            if opt is not None:
                run = stash_aware_step(opt, holder[0].update_stash, user_code_first=False)
            sum_shared_gradients(shard.pipeline, ties, shard.owned, group.member(k))
            if opt is not None and run is not None:
                run()
                opt.zero_grad(set_to_none=True)

        def last_loss(mb: Any, slot: int, holder: list[StageExecutor] = holder) -> Tensor:
            return loss_fn(holder[0].local_forward(input_fn(mb) if S == 1 else None), mb)

        executor = StageExecutor(
            stage_module=stage,
            stage_idx=k,
            num_stages=S,
            schedule=schedule,
            num_microbatches=num_microbatches,
            channels=channels[k],
            first_stage_input=input_fn,
            last_stage_loss=last_loss if k == S - 1 else None,
            optimizer_step=step,
            checkpoint=[checkpoint] * len(stage),
            fresh_storage_updates=fresh_storage,
            microbatch_statistics=microbatch_statistics,
            first_layer=shard.owned[0] if shard.owned else 0,
            loss_terms=loss_terms,
        )
        holder.append(executor)
        executors.append(executor)
        optimizers.append(opt)
        shards.append(shard)
    return InProcessPipeline(executors, optimizers, shards)
