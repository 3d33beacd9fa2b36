"""The layers a repartition moves: a pure diff of two partitions (every rank executes it in the same order)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_dynpipe.errors import PartitionError
from lightning_dynpipe.plan.partition import Partition

__all__ = ["LayerMove", "plan_moves"]


@dataclass(frozen=True)
class LayerMove:
    """Layer ``layer_idx`` moves from stage ``src`` to stage ``dst``."""

    layer_idx: int
    src: int
    dst: int

    def __str__(self) -> str:
        return f"layer {self.layer_idx}: stage {self.src} -> {self.dst}"


def plan_moves(old: Partition, new: Partition) -> tuple[LayerMove, ...]:
    """The layers whose stage differs between ``old`` and ``new``, in ``layer_idx`` order.

    Every rank executes the moves in this order, each one a send from ``src`` to ``dst`` that no other rank
    takes part in; processing pairwise exchanges in one global order cannot deadlock (the smallest unfinished
    move always has both of its ranks waiting for it).

    Example::

        >>> [str(m) for m in plan_moves(Partition((3, 2)), Partition((2, 3)))]
        ['layer 2: stage 0 -> 1']
    """
    if old.num_layers != new.num_layers or old.num_stages != new.num_stages:
        raise PartitionError(
            f"A repartition keeps the layers and the number of stages: {old} has {old.num_layers} layers on "
            f"{old.num_stages} stages, {new} has {new.num_layers} on {new.num_stages}. Give a balance with "
            f"{old.num_stages} entries summing to {old.num_layers}."
        )
    moves = []
    for layer_idx in range(old.num_layers):
        src, dst = old.stage_of_layer(layer_idx), new.stage_of_layer(layer_idx)
        if src != dst:
            moves.append(LayerMove(layer_idx, src, dst))
    return tuple(moves)
