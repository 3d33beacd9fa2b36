"""Moving layers' weights, buffers and optimizer state between stages as tensors (no pickle): live migration.

Both sides hold the layer's module structure: the sender the live layer, the receiver a ``meta`` skeleton
with the same parameter and buffer shapes, so the weights travel as bare tensors in ``state_dict`` order.
The optimizer state of each parameter travels as the checkpoints move it (:mod:`~lightning_dynpipe.engine.
optstate`): every value comes back with its type (tensors with their dtype and device placement, Python ints,
floats and bools as such, ``None``), and "no state" stays distinct from an empty one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_dynpipe.engine.collectives import Collectives, DistCollectives
from lightning_dynpipe.engine.optstate import recv_state, send_state
from lightning_dynpipe.engine.shard import StageShard, keeping_grad_hooks, layer_tensors
from lightning_dynpipe.plan.moves import LayerMove

__all__ = ["send_layer", "recv_layer", "move_layers"]


def send_layer(layer: nn.Module, optimizer: Optimizer | None, dst: int, coll: Collectives, device: torch.device) -> int:
    """Sends ``layer``'s state and its parameters' optimizer state to ``dst``; returns the bytes sent.

    ``device``: where the stage computes (the optimizer state's tensors travel from there).
    """
    sent = 0
    for t in layer_tensors(layer).values():  # non-persistent buffers too: the layer must compute on arrival
        coll.send(t.detach().contiguous(), dst)
        sent += t.numel() * t.element_size()
    if optimizer is None:
        return sent
    for i, p in enumerate(layer.parameters()):  # i: the receiver checks it walks the same parameters
        sent += send_state(coll, optimizer.state.get(p), i, dst, device)
    return sent


def recv_layer(
    skeleton: nn.Module, optimizer: Optimizer | None, src: int, coll: Collectives, device: torch.device
) -> None:
    """Materialises ``skeleton`` on ``device`` with the state ``src`` sends, and its optimizer state."""
    with keeping_grad_hooks(skeleton):
        skeleton.to_empty(device=device)
    for t in layer_tensors(skeleton).values():
        coll.recv(t, src)  # these tensors share storage with the module's
    if optimizer is None:
        return
    for i, p in enumerate(skeleton.parameters()):
        state = recv_state(coll, i, src, device)
        if state is not None:
            optimizer.state[p] = state


def move_layers(
    shard: StageShard,
    moves: Sequence[LayerMove],
    optimizer: Optimizer | None,
    *,
    rank: int,
    rank_of_stage: Callable[[int], int],
    group: Any,
    device: torch.device,
) -> int:
    """Runs ``moves`` on a drained pipeline; returns the bytes this rank sent.

    Collective over the pipeline (every rank walks the same moves in the same order; only the two ranks of a
    move take part in it). The sender's layer goes to ``meta`` behind a placeholder, the receiver materialises
    its skeleton. The caller then records the new partition on the shard and refilters the optimizer
    (:meth:`~lightning_dynpipe.engine.stage.PipelineStage.migrate` does all of it).
    """
    coll = DistCollectives(group, rank)
    sent = 0
    for move in moves:
        src, dst = rank_of_stage(move.src), rank_of_stage(move.dst)
        if rank == src:
            sent += send_layer(shard.pipeline[move.layer_idx], optimizer, dst, coll, device)
            shard.offload(move.layer_idx, move.dst)
        elif rank == dst:
            recv_layer(shard.skeleton(move.layer_idx), optimizer, src, coll, device)
            shard.adopt(move.layer_idx)
    return sent
