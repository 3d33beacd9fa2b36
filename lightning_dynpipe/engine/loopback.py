"""Several pipeline stages in one process: channels and collectives between threads.

For tests of the engine without processes: :func:`loopback_channels` gives every stage of a pipeline its
:class:`~lightning_dynpipe.engine.executor.StageChannels` (same messages, headers and checks as the
``torch.distributed`` channels), and :class:`LoopbackGroup` hands each member a
:class:`~lightning_dynpipe.engine.collectives.Collectives`. Run each stage in its own thread.

Example::

    channels = loopback_channels(num_stages=2)
    executors = [StageExecutor(stage_module=stages[k], stage_idx=k, num_stages=2, schedule="async",
                               num_microbatches=4, channels=channels[k], ...) for k in range(2)]
    run_stages(lambda k: executors[k].train_step(batch), 2)
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch import Tensor

from lightning_dynpipe.engine.executor import StageChannels
from lightning_dynpipe.engine.p2p import Message, SendDelay, expect, hold_until, stamp
from lightning_dynpipe.engine.wire import MessageKind, decode, encode
from lightning_dynpipe.errors import CommunicationError, PipelineTimeoutError

__all__ = ["LoopbackSender", "LoopbackReceiver", "loopback_channels", "LoopbackGroup", "run_stages"]

_T = TypeVar("_T")


class LoopbackReceiver:
    """The receiving end of one direction of a boundary, in this process."""

    def __init__(self, name: str, timeout: float) -> None:
        self.name = name
        self.timeout = timeout
        self.queue: queue.Queue[tuple[Message, float] | None] = queue.Queue()  # with its delivery time (0: at once)

    def get(self, kind: MessageKind, mb_idx: int) -> Message:
        """The next message, which must be ``kind`` for ``mb_idx``."""
        try:
            item = self.queue.get(timeout=self.timeout)
        except queue.Empty:
            raise PipelineTimeoutError(
                f"Waited {self.timeout:.0f} s for {kind.name.lower()} of micro-batch {mb_idx} on loopback channel "
                f"{self.name}."
            ) from None
        if item is None:
            raise CommunicationError(f"Loopback channel {self.name} was closed while a message was expected.")
        message, due = item
        hold_until(due)
        return expect(message, kind, mb_idx, self.name)

    def join(self, timeout: float = 5.0) -> None:
        """Nothing to stop: there is no receiver thread."""


class LoopbackSender:
    """The sending end: copies the tensors (as a transfer would) into the peer's queue."""

    def __init__(self, peer: LoopbackReceiver, name: str) -> None:
        self.peer = peer
        self.name = name
        self.delay: SendDelay | None = None
        self.bytes_sent = 0

    def send(
        self,
        kind: MessageKind,
        mb_idx: int,
        tensors: Sequence[Tensor | None],
        aux: float = float("nan"),
        is_tuple: bool = False,
    ) -> None:
        header = decode(encode(kind, mb_idx, tensors, aux, is_tuple))
        copies = [None if t is None else t.detach().clone() for t in tensors]
        present = [t for t in copies if t is not None]
        self.bytes_sent += sum(t.numel() * t.element_size() for t in present)
        self.peer.queue.put((Message(header, copies), stamp(self.delay, present)))

    def flush(self) -> None:
        """Sends complete at once."""

    def close(self, wait: bool = True) -> None:
        """Tells the peer that nothing more will come (delivered at once)."""
        self.peer.queue.put(None)


def loopback_channels(num_stages: int, timeout: float = 60.0) -> list[StageChannels]:
    """The channels of every stage of one pipeline whose stages run as threads of this process."""
    out = [StageChannels() for _ in range(num_stages)]
    for b in range(num_stages - 1):
        act = LoopbackReceiver(f"activations {b}->{b + 1}", timeout)
        grad = LoopbackReceiver(f"gradients {b + 1}->{b}", timeout)
        out[b].send_activation = LoopbackSender(act, act.name)
        out[b + 1].recv_activation = act
        out[b + 1].send_grad = LoopbackSender(grad, grad.name)
        out[b].recv_grad = grad
    return out


class LoopbackGroup:
    """A group of threads that stand for ranks; :meth:`member` gives each its collectives.

    Args:
        ranks: the global ranks of the members (sorted, as in ``torch.distributed``).
        timeout: seconds a member waits for the others.
    """

    def __init__(self, ranks: Sequence[int], timeout: float = 60.0) -> None:
        self.ranks = list(ranks)
        self.timeout = timeout
        self._pairs: dict[tuple[int, int], queue.Queue[Tensor]] = {
            (a, b): queue.Queue() for a in self.ranks for b in self.ranks if a != b
        }
        self._barrier = threading.Barrier(len(self.ranks), timeout=timeout)
        self._slots: dict[int, Any] = {}

    def member(self, rank: int) -> LoopbackCollectives:
        """The collectives of member ``rank``."""
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not a member of the loopback group {self.ranks}")
        return LoopbackCollectives(self, rank)

    def _exchange(self, rank: int, value: Any) -> list[Any]:
        """Every member's ``value``, in rank order (a barrier before and after, so slots can be reused)."""
        self._barrier.wait()
        self._slots[rank] = value
        self._barrier.wait()
        out = [self._slots[r] for r in self.ranks]
        self._barrier.wait()
        return out


class LoopbackCollectives:
    """One member's :class:`~lightning_dynpipe.engine.collectives.Collectives` in a :class:`LoopbackGroup`."""

    def __init__(self, group: LoopbackGroup, rank: int) -> None:
        self._group = group
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    def send(self, tensor: Tensor, dst: int) -> None:
        self._group._pairs[(self._rank, dst)].put(tensor.detach().clone())

    def recv(self, tensor: Tensor, src: int) -> None:
        try:
            got = self._group._pairs[(src, self._rank)].get(timeout=self._group.timeout)
        except queue.Empty:
            raise PipelineTimeoutError(f"loopback recv on rank {self._rank} from {src} timed out") from None
        tensor.copy_(got)

    def broadcast(self, tensor: Tensor, src: int) -> None:
        if self._rank == src:
            for r in self._group.ranks:
                if r != src:
                    self.send(tensor, r)
        else:
            self.recv(tensor, src)

    def all_reduce_sum(self, tensor: Tensor) -> None:
        parts = self._group._exchange(self._rank, tensor.detach().clone())
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        tensor.copy_(total)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self._group._exchange(self._rank, obj)


def run_stages(fn: Callable[[int], _T], num_stages: int, timeout: float = 120.0) -> list[_T]:
    """Runs ``fn(k)`` for every stage ``k`` in its own thread; returns the results in stage order.

    Re-raises the first exception of any stage (after all threads ended or the timeout passed).
    """
    results: list[Any] = [None] * num_stages
    errors: list[BaseException | None] = [None] * num_stages

    def target(k: int) -> None:
        try:
            results[k] = fn(k)
        except BaseException as exc:  # reported to the caller below
            errors[k] = exc

    threads = [threading.Thread(target=target, args=(k,), name=f"stage-{k}", daemon=True) for k in range(num_stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    for err in errors:
        if err is not None:
            raise err
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        raise PipelineTimeoutError(f"stages {alive} did not finish within {timeout:.0f} s")
    return results
