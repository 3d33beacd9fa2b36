"""The collectives the engine's state movers need, behind a small protocol a single process can also provide.

Checkpoint gathering, re-assembly and the replica gradient average talk to the other ranks of a pipeline (or
of a stage's replicas) through :class:`Collectives`. :class:`DistCollectives` runs them on a
``torch.distributed`` group; :class:`~lightning_dynpipe.engine.loopback.LoopbackCollectives` runs them between
threads of one process, so the same code is unit-tested without processes.

Ranks are global ranks, as in ``torch.distributed``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist
from torch import Tensor

__all__ = ["Collectives", "DistCollectives"]


class Collectives(Protocol):
    """Point-to-point and collective operations among the members of one group."""

    @property
    def rank(self) -> int:
        """This member's global rank."""
        ...

    def send(self, tensor: Tensor, dst: int) -> None:
        """Sends ``tensor`` to ``dst`` (blocking)."""
        ...

    def recv(self, tensor: Tensor, src: int) -> None:
        """Receives into ``tensor`` from ``src`` (blocking)."""
        ...

    def broadcast(self, tensor: Tensor, src: int) -> None:
        """Every member ends with ``src``'s ``tensor`` (in place)."""
        ...

    def all_reduce_sum(self, tensor: Tensor) -> None:
        """Every member ends with the sum over members (in place)."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every member's ``obj``, in the order of the members' ranks."""
        ...


class DistCollectives:
    """:class:`Collectives` on a ``torch.distributed`` process group (``None``: the default group)."""

    def __init__(self, group: Any, rank: int) -> None:
        self.group = group
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    def send(self, tensor: Tensor, dst: int) -> None:
        dist.send(tensor.contiguous(), dst=dst, group=self.group)

    def recv(self, tensor: Tensor, src: int) -> None:
        dist.recv(tensor, src=src, group=self.group)

    def broadcast(self, tensor: Tensor, src: int) -> None:
        dist.broadcast(tensor, src=src, group=self.group)

    def all_reduce_sum(self, tensor: Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out
