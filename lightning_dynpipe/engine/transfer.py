"""Moving layers' weights, buffers and optimizer state between stages as tensors (no pickle): live migration.

Both sides hold the layer's module structure: the sender the live layer, the receiver a ``meta`` skeleton
with the same parameter and buffer shapes, so the weights travel as bare tensors in ``state_dict`` order.
The optimizer state of each parameter travels as one message of the engine's wire format: a uint8 tensor
with the state's key names, then one tensor per key (Python numbers as 0-d float64 tensors, keys marked
``#``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dynpipe.engine.p2p import decode_text, encode_text
from lightning_dynpipe.engine.shard import StageShard, layer_tensors
from lightning_dynpipe.engine.wire import HEADER_LEN, MessageKind, decode, encode
from lightning_dynpipe.plan.moves import LayerMove

__all__ = ["send_layer", "recv_layer", "move_layers"]


def _send_tensors(tensors: list[Tensor], dst: int, group: Any) -> int:
    header = encode(MessageKind.ACTIVATION, -1, tensors)
    dist.send(header, dst=dst, group=group)
    sent = 0
    for t in tensors:
        dist.send(t.contiguous(), dst=dst, group=group)
        sent += t.numel() * t.element_size()
    return sent


def _recv_tensors(src: int, group: Any, device: torch.device) -> list[Tensor]:
    header_t = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.recv(header_t, src=src, group=group)
    out = []
    for spec in decode(header_t).specs:
        assert spec is not None
        t = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        dist.recv(t, src=src, group=group)
        out.append(t)
    return out


def send_layer(layer: nn.Module, optimizer: Optimizer | None, dst: int, group: Any) -> int:
    """Sends ``layer``'s state and its parameters' optimizer state to ``dst``; returns the bytes sent."""
    sent = 0
    for t in layer_tensors(layer).values():  # non-persistent buffers too: the layer must compute on arrival
        dist.send(t.detach().contiguous(), dst=dst, group=group)
        sent += t.numel() * t.element_size()
    if optimizer is None:
        return sent
    for p in layer.parameters():
        state = optimizer.state.get(p, {})
        names, values = [], []
        for key, value in state.items():
            if isinstance(value, Tensor):
                names.append(str(key))
                values.append(value)
            else:
                names.append("#" + str(key))
                values.append(torch.tensor(float(value), dtype=torch.float64))
        sent += _send_tensors([encode_text("\n".join(names)), *values], dst, group)
    return sent


def recv_layer(skeleton: nn.Module, optimizer: Optimizer | None, src: int, group: Any, device: torch.device) -> None:
    """Materialises ``skeleton`` on ``device`` with the state ``src`` sends, and its optimizer state."""
    skeleton.to_empty(device=device)
    for t in layer_tensors(skeleton).values():
        dist.recv(t, src=src, group=group)  # these tensors share storage with the module's
    if optimizer is None:
        return
    for p in skeleton.parameters():
        names_t, *values = _recv_tensors(src, group, device)
        text = decode_text(names_t).strip()
        state: dict[str, Any] = {}
        for name, value in zip(text.split("\n") if text else [], values):
            if name.startswith("#"):
                state[name[1:]] = value.item()
            elif name == "step" and value.dim() == 0:
                state[name] = value.cpu() if value.device.type != "cpu" and not _capturable(optimizer) else value
            else:
                state[name] = value
        if state:
            optimizer.state[p] = state


def _capturable(optimizer: Optimizer) -> bool:
    return any(bool(g.get("capturable", False)) or bool(g.get("fused", False)) for g in optimizer.param_groups)


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
    sent = 0
    for move in moves:
        src, dst = rank_of_stage(move.src), rank_of_stage(move.dst)
        if rank == src:
            sent += send_layer(shard.pipeline[move.layer_idx], optimizer, dst, group)
            shard.offload(move.layer_idx, move.dst)
        elif rank == dst:
            recv_layer(shard.skeleton(move.layer_idx), optimizer, src, group, device)
            shard.adopt(move.layer_idx)
    return sent
