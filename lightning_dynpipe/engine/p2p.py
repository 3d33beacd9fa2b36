"""Point-to-point channels between adjacent stages, on the pipeline's own process groups.

Each direction of each stage boundary is a separate two-rank process group, so that activations going
downstream and gradients going upstream never share a queue. A :class:`SendChannel` uses non-blocking sends and
only waits for them when asked to (:meth:`SendChannel.flush`) or when too many are outstanding.

On CPU (gloo) every message is one packed buffer (:func:`~lightning_dynpipe.engine.wire.pack`) and the
:class:`RecvChannel` keeps :data:`PREPOSTED` receives posted ahead, so that a message lands in a posted buffer
while the stage computes (one that arrives before its receive is posted makes gloo's loop thread poll until it
is). The stage's own thread waits on the oldest receive when it needs the message, and posts the next one:
no receiver thread, so no hand-over between threads and no competition for the GIL or the core. A receiver
thread per channel that waited, decoded and queued each message cost 4.2 / 3.5 ms of CPU per step in the
threads other than the main one on ``benchmarks/profile_step.py``'s two stages, against 1.5 / 1.3 ms without
(torch's own schedule: 1.5 / 1.6), and the layers' own arithmetic ran slower beside it
(benchmarks/results/2026-12-02-receive.md). Receives must be posted with the right size, so both ends track
the size of the next message: a sender whose message has another size first sends :data:`PREPOSTED`
``RESIZE`` messages of the old size (one per receive already posted), then the message. ``CLOSE`` and
``ABORT`` are followed by pads that complete the receives still posted, so that no receive is left pending
when the process groups are destroyed.

A message's link time (:attr:`Message.transfer_s`) is its arrival on the receiver's clock minus the sender's clock
at the send. Without a receiver thread an arrival is seen only when the stage asks for the message, so that is exact
for a message the stage waited for, and :class:`LinkTimes` estimates it for one that was already there.

On CUDA the header and each tensor are separate messages, received by a background thread per channel.

Failures: a peer's ``ABORT``, or a connection lost because the peer process died, is seen by the next receive
on that channel, which tells ``on_failure`` (the :class:`FailureHandler`) and raises
:class:`~lightning_dynpipe.errors.PeerFailure`.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dynpipe.engine.wire import (
    HEADER_BYTES,
    HEADER_LEN,
    MIN_MESSAGE,
    Header,
    MessageKind,
    decode,
    encode,
    message_size,
    not_before,
    pack,
    sent_at,
    stamp_not_before,
    unpack,
)
from lightning_dynpipe.errors import CommunicationError, PeerFailure, PipelineTimeoutError

__all__ = [
    "hold_until",
    "stamp",
    "expect",
    "Sender",
    "Receiver",
    "SendChannel",
    "RecvChannel",
    "Message",
    "LinkTimes",
    "SendDelay",
    "FailureHandler",
    "encode_text",
    "decode_text",
]

log = logging.getLogger(__name__)

_MAX_OUTSTANDING = 64
_SPARE_BUFFERS = 4
"""Buffers of completed sends a packed channel keeps for its next messages."""
PREPOSTED = 2
"""Receives a packed channel keeps posted ahead of the message being handled."""
_RECEIVERS: weakref.WeakSet[RecvChannel] = weakref.WeakSet()  # channels whose thread may still be running


def wait_for_receivers(timeout_s: float) -> int:
    """Waits up to ``timeout_s`` in all for every receiver thread (CUDA channels) to end; returns how many still run.

    A receiver thread blocked in a receive inside the communication library must not outlive the process
    groups: destroying them under it (at exit) ends the process with SIGABRT ("terminate called without an
    active exception"). After a failure the peers close their connections within moments, which ends those
    receives; this waits for that.
    """
    deadline = time.monotonic() + timeout_s
    threads = [ch._thread for ch in list(_RECEIVERS) if ch._thread is not None]
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return sum(1 for t in threads if t.is_alive())


@dataclass
class Message:
    """A received message: its header and its tensors (``None`` where the sender had no tensor).

    ``transfer_s`` is how long the payload took to arrive once its header was in (the link's share of the
    message); ``arrived_at`` is when the whole message was ready (``time.perf_counter``).
    """

    header: Header
    tensors: list[Tensor | None]
    arrived_at: float = field(default_factory=time.perf_counter)
    transfer_s: float = 0.0

    def exposed_transfer_s(self, wanted_at: float) -> float:
        """The part of the transfer the consumer waited for, having asked for the message at ``wanted_at``."""
        return min(self.transfer_s, max(0.0, self.arrived_at - wanted_at))


class SendDelay(Protocol):
    """An emulated link on one channel: when each message may be delivered (network interference in our P2P layer).

    The sender asks it for every message and stamps the answer into the message's header; it does not wait
    itself. The receiver holds the message until then, so a slow link delays delivery, as a real one does, without
    costing the sender any time. :class:`lightning_dynpipe.interference.LinkDelay` installs one on the send channels
    of a boundary.
    """

    def deliver_at(self, sent_s: float, nbytes: int) -> float:
        """The ``time.time()`` at which a message of ``nbytes`` sent at ``sent_s`` is delivered."""
        ...


def stamp(delay: SendDelay | None, payload: Sequence[Tensor], sent_s: float | None = None) -> float:
    """When the message carrying ``payload``, sent at ``sent_s`` (default: now), may be delivered under ``delay``.

    0 without one: at once. The sender stamps the same ``sent_s`` into the header as its send time, so the link time
    the receiver measures starts where the emulated link's does.
    """
    if delay is None:
        return 0.0
    when = time.time() if sent_s is None else sent_s
    return delay.deliver_at(when, sum(t.numel() * t.element_size() for t in payload))


def hold_until(when: float) -> bool:
    """Sleeps until ``time.time() >= when`` (an emulated link's delivery); whether it had to wait."""
    if when <= 0.0:  # no emulated link: nothing to read the clock for
        return False
    wait = when - time.time()
    if wait <= 0:
        return False
    time.sleep(wait)
    return True


def expect(item: Message, kind: MessageKind, mb_idx: int, channel: str) -> Message:
    """``item`` if it is ``kind`` for ``mb_idx``; else the schedules are out of step.

    Raises:
        CommunicationError: another message arrived than the schedule expects.
    """
    if item.header.kind != kind or item.header.mb_idx != mb_idx:
        raise CommunicationError(
            f"Pipeline schedules are out of step on channel {channel}: expected {kind.name.lower()} of "
            f"micro-batch {mb_idx}, received {item.header.kind.name.lower()} of micro-batch "
            f"{item.header.mb_idx}. All stages must run the same schedule and num_microbatches."
        )
    return item


class Sender(Protocol):
    """The sending end of one direction of a stage boundary (:class:`SendChannel`, or a loopback one)."""

    name: str
    delay: SendDelay | None

    def send(
        self,
        kind: MessageKind,
        mb_idx: int,
        tensors: Sequence[Tensor | None],
        aux: float = float("nan"),
        is_tuple: bool = False,
    ) -> None:
        """Queues ``tensors`` for the peer."""
        ...

    def flush(self) -> None:
        """Waits until every queued send has completed."""
        ...

    def close(self, wait: bool = True) -> None:
        """Tells the peer that nothing more will come; waits for delivery unless ``wait=False``."""
        ...


class Receiver(Protocol):
    """The receiving end of one direction of a stage boundary (:class:`RecvChannel`, or a loopback one)."""

    def get(self, kind: MessageKind, mb_idx: int) -> Message:
        """The next message, which must be ``kind`` for ``mb_idx``."""
        ...

    def join(self, timeout: float = 5.0) -> None:
        """Waits for the receiving side to stop after the peer closed the channel."""
        ...


class SendChannel:
    """Sends messages to one peer stage with non-blocking sends.

    Args:
        group: the two-rank process group of this direction of the boundary.
        peer: the peer's global rank.
        name: for messages and logs, e.g. ``"activations 0->1"``.
        device: where the tensors sent live; on CPU (the default) messages are packed (see the module
            docstring), and the receiving :class:`RecvChannel` must be on CPU too.
    """

    def __init__(self, group: Any, peer: int, name: str, device: torch.device | None = None) -> None:
        self.group = group
        self.peer = peer
        self.name = name
        self.delay: SendDelay | None = None
        self.packed = device is None or device.type == "cpu"
        self._next_size = MIN_MESSAGE  # what the receiver has posted for the next packed message
        self._pending: deque[tuple[Any, list[Tensor]]] = deque()
        self._spare: list[Tensor] = []  # packed: buffers of completed sends, reused for the next messages
        self._lock = threading.Lock()  # the failure path may send from a CUDA receiver thread
        self.bytes_sent = 0

    def send(
        self,
        kind: MessageKind,
        mb_idx: int,
        tensors: Sequence[Tensor | None],
        aux: float = float("nan"),
        is_tuple: bool = False,
    ) -> None:
        """Queues ``tensors`` for the peer; returns as soon as the transfers are started."""
        header = encode(kind, mb_idx, tensors, aux, is_tuple)
        payload = [t.detach().contiguous() for t in tensors if t is not None]
        sent = time.time()
        due = stamp(self.delay, payload, sent)
        if self.packed:
            self._send_packed(header, payload, not_before=due, sent=sent)
            return
        if due:
            stamp_not_before(header, due)
        device = payload[0].device if payload else torch.device("cpu")
        header = header.to(device)
        with self._lock:
            works = [dist.isend(header, dst=self.peer, group=self.group)]
            for t in payload:
                works.append(dist.isend(t, dst=self.peer, group=self.group))
                self.bytes_sent += t.numel() * t.element_size()
            for w in works:
                self._pending.append((w, [header, *payload]))
            while len(self._pending) > _MAX_OUTSTANDING:
                self._wait_one()

    def _send_packed(
        self, header: Tensor, payload: list[Tensor], pads: int = 0, not_before: float = 0.0, sent: float | None = None
    ) -> None:
        """One packed message (then ``pads`` padding messages), resizing the receiver's buffers first if needed.

        ``sent`` is the send time stamped into the header (default: when it is packed); :meth:`send` passes the
        time it gave the emulated link, so resizing first is not taken off the message's link time.
        """
        size = message_size(payload)
        with self._lock:
            if size != self._next_size:
                resize = encode(MessageKind.RESIZE, -1, [], aux=float(size))
                for _ in range(PREPOSTED):  # one per receive the peer has posted at the old size
                    self._isend(pack(resize, [], self._next_size, time.time()))
                self._next_size = size
                self._spare.clear()  # buffers of the old size
            self._isend(self._pack(header, payload, size, time.time() if sent is None else sent, not_before))
            self.bytes_sent += sum(t.numel() * t.element_size() for t in payload)
            if pads:
                pad = encode(MessageKind.RESIZE, -1, [], aux=float(size))
                for _ in range(pads):
                    self._isend(pack(pad, [], size, time.time()))
            while len(self._pending) > _MAX_OUTSTANDING:
                self._wait_one()

    def _isend(self, buf: Tensor) -> None:
        self._pending.append((dist.isend(buf, dst=self.peer, group=self.group), [buf]))

    def _pack(self, header: Tensor, payload: list[Tensor], size: int, sent: float, not_before: float = 0.0) -> Tensor:
        """:func:`pack` into the buffer of a send that has completed, where one of ``size`` bytes is free.

        A new buffer per message cost more than the copy into it (140 against 25 us for 512 KiB on the throughput
        benchmark's machine): it came from memory the cache had not seen, as the buffers of up to
        ``_MAX_OUTSTANDING`` sends cycled through the heap.
        """
        while self._pending and self._pending[0][0].is_completed():
            work, bufs = self._pending.popleft()
            work.wait()  # completed: raises the send's error, if any
            if len(bufs) == 1 and len(self._spare) < _SPARE_BUFFERS:
                self._spare.append(bufs[0])
        # the most recently freed buffer: the likeliest still in the cache
        i = next((i for i in range(len(self._spare) - 1, -1, -1) if self._spare[i].numel() == size), None)
        out = None if i is None else self._spare.pop(i)
        return pack(header, payload, size, sent, not_before, out=out)

    def _wait_one(self) -> None:
        work, _keepalive = self._pending.popleft()
        work.wait()

    def flush(self) -> None:
        """Waits until every queued send has completed."""
        with self._lock:
            while self._pending:
                self._wait_one()

    def abort(self, stage_idx: int, rank: int, text: str, wait_s: float = 2.0) -> None:
        """Tells the peer that ``stage_idx`` (global ``rank``) failed; waits at most ``wait_s`` for delivery."""
        try:
            with self._lock:
                if self.packed:  # the receiver's posted size: the description is cut to fit it
                    text_t = encode_text(text, limit=self._next_size - HEADER_BYTES)
                    header = encode(MessageKind.ABORT, stage_idx, [text_t], aux=float(rank))
                    pad = encode(MessageKind.RESIZE, -1, [], aux=float(self._next_size))
                    works = [
                        dist.isend(pack(h, t, self._next_size, time.time()), dst=self.peer, group=self.group)
                        for h, t in [(header, [text_t])] + [(pad, [])] * (PREPOSTED - 1)
                    ]
                else:
                    header = encode(MessageKind.ABORT, stage_idx, [encode_text(text)], aux=float(rank))
                    works = [
                        dist.isend(header, dst=self.peer, group=self.group),
                        dist.isend(encode_text(text), dst=self.peer, group=self.group),
                    ]
            for w in works:
                if w is not None:
                    w.wait(timeout=timedelta(seconds=wait_s))
        except Exception as exc:  # the peer may be gone already; nothing more to do
            log.debug("abort on %s not delivered: %r", self.name, exc)

    def close(self, wait: bool = True) -> None:
        """Tells the peer that nothing more will come; with ``wait=False`` only queues that (see :meth:`flush`)."""
        if self.packed:
            self._send_packed(encode(MessageKind.CLOSE, -1, []), [], pads=PREPOSTED - 1)
        else:
            self.send(MessageKind.CLOSE, -1, [])
        if wait:
            self.flush()


_ARRIVED_DURING_WAIT_S = 500e-6
"""A receive whose wait blocked the thread longer than this (the wait's wall time less the thread's CPU time in it)
was still in flight when asked for. Returning one that had arrived is work on the thread, CPU time (2-300 us, and
1-2 ms for the first read after the receiving thread slept 0.3 s on a shared VM: cold caches), whereas an in-flight
one blocks it (50 ms of wall time for 0.05 ms of CPU); the margin covers a thread descheduled on its way out of the
wait. Judged by wall time alone, such a slow read of an arrived message was charged its time in the buffer."""


class LinkTimes:
    """A channel's transfer time per message, when the receiving thread cannot see every arrival.

    Without a receiver thread the stage learns that a message arrived only when it asks for it (gloo completes a
    receive inside ``wait``). For a message it waited for, the end of the wait is the arrival, and the transfer time
    (arrival minus the sender's clock at the send) is exact. A message that was already there arrived at some time
    between its send and the ask: its transfer time is at most ``ask - send``, and the estimate is the mean of the
    last :attr:`window` exact times, capped by that bound (the bound itself while no exact time is known).

    Example::

        >>> link = LinkTimes()
        >>> link.was_there(0.010)            # nothing measured yet: the bound
        0.01
        >>> link.waited(0.002), link.waited(0.004)
        (0.002, 0.004)
        >>> link.was_there(0.010)            # the recent exact times' mean
        0.003
        >>> link.was_there(0.001)            # never more than the bound
        0.001
    """

    window: int = 8

    def __init__(self) -> None:
        self._exact: deque[float] = deque(maxlen=self.window)

    def waited(self, transfer_s: float) -> float:
        """Records (and returns) the exact transfer time of a message the stage waited for."""
        self._exact.append(transfer_s)
        return transfer_s

    def was_there(self, bound_s: float) -> float:
        """The estimate for a message that had arrived before the stage asked ``bound_s`` after its send."""
        if not self._exact:
            return bound_s
        return min(bound_s, sum(self._exact) / len(self._exact))


class RecvChannel:
    """Receives messages from one peer stage.

    On CPU (packed messages) the stage's own thread receives: :data:`PREPOSTED` receives are always posted, so
    gloo's loop thread lands each message while the stage computes, and :meth:`get` waits on the oldest receive,
    decodes it and posts the next one. On CUDA a background thread receives each header and then its tensors, and
    :meth:`get` takes the messages from its queue.

    Args:
        group: the two-rank process group of this direction of the boundary.
        peer: the peer's global rank.
        device: where received tensors are placed.
        timeout: seconds :meth:`get` waits for a message before raising :class:`PipelineTimeoutError`.
        name: for messages and logs, e.g. ``"gradients 1->0"``.
        peer_stage: the peer's stage index, for messages.
        on_failure: told when the peer failed (its ``ABORT``, or the connection lost), before :meth:`get` raises.
    """

    def __init__(
        self,
        group: Any,
        peer: int,
        device: torch.device,
        timeout: float,
        name: str,
        peer_stage: int = -1,
        on_failure: Callable[[PeerFailure], None] | None = None,
    ) -> None:
        self.group = group
        self.peer = peer
        self.peer_stage = peer_stage
        self.device = device
        self.timeout = timeout
        self.name = name
        self.on_failure = on_failure
        self.packed = device.type == "cpu"
        self._failure: PeerFailure | None = None
        self._closed = False
        self._size = MIN_MESSAGE  # packed: the size of the receives posted next
        self._posted: deque[tuple[Any, Tensor]] = deque()  # packed: receives posted, oldest first
        self._link = LinkTimes()  # packed: the link's time per message, from the messages waited for
        self._queue: queue.Queue[Message | BaseException | None] = queue.Queue()  # CUDA: the thread's messages
        self._thread: threading.Thread | None = None
        if self.packed:
            for _ in range(PREPOSTED):
                self._post()
            return
        self._thread = threading.Thread(target=self._run, name=f"dynpipe-recv[{name}]", daemon=True)
        self._thread.start()
        _RECEIVERS.add(self)

    def get(self, kind: MessageKind, mb_idx: int) -> Message:
        """Returns the next message, which must be ``kind`` for ``mb_idx``; waits at most ``timeout`` s.

        Raises:
            PeerFailure: the peer failed (now or before).
            PipelineTimeoutError: nothing arrived within ``timeout``.
            CommunicationError: the peer closed the channel, or sent another message than the schedule expects.
        """
        if self.packed:
            return expect(self._get_packed(kind, mb_idx), kind, mb_idx, self.name)
        try:
            item = self._queue.get(timeout=self.timeout)
        except queue.Empty:
            raise self._timeout_error(kind, mb_idx) from None
        if isinstance(item, BaseException):
            self._queue.put(item)  # every later get fails the same way
            raise item
        if item is None:
            self._closed = True
            raise self._closed_error()
        return expect(item, kind, mb_idx, self.name)

    def join(self, timeout: float = 5.0) -> None:
        """Stops receiving after the peer sent ``CLOSE``, dropping anything unread; waits at most ``timeout`` s."""
        if self.packed:
            self._drain(timeout)
            return
        self._closed = True
        assert self._thread is not None
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("Receiver thread of channel %s did not stop within %.0f s.", self.name, timeout)

    def arrived_failure(self, wait_s: float = 0.5) -> PeerFailure | None:
        """The peer's failure if this channel knows it or its next message is the peer's ``ABORT`` (waiting at most
        ``wait_s`` for that message): for a rank whose collective broke because the peer's process ended, which
        sends its ``ABORT`` first. Consumes what it reads: call it only on the way out of a failed run."""
        if self._failure is not None or not self.packed:
            return self._failure
        try:
            buf, header, *_ = self._next_packed(time.monotonic() + wait_s)
        except (RuntimeError, IndexError):  # nothing came, or the connection is gone
            return None
        if header.kind != MessageKind.ABORT:
            return None
        text = unpack(buf, header)[0]
        return _peer_abort(header, decode_text(text)) if text is not None else None

    def _timeout_error(self, kind: MessageKind, mb_idx: int) -> PipelineTimeoutError:
        return PipelineTimeoutError(
            f"Waited {self.timeout:.0f} s for {kind.name.lower()} of micro-batch {mb_idx} on channel "
            f"{self.name} (peer rank {self.peer}). Another stage probably failed first: check all ranks' "
            "logs. If a stage is just slow, raise DynPipeStrategy(timeout=...)."
        )

    def _closed_error(self) -> CommunicationError:
        return CommunicationError(f"Channel {self.name} was closed by rank {self.peer} while a message was expected.")

    # ----- CPU: packed messages, received by the caller's thread

    def _post(self) -> None:
        buf = torch.empty(self._size, dtype=torch.uint8)
        self._posted.append((dist.irecv(buf, src=self.peer, group=self.group), buf))

    def _next_packed(self, deadline: float) -> tuple[Tensor, Header, float, float, float]:
        """Waits for the oldest posted receive that is not a ``RESIZE``: its buffer and header, and when it was in
        (``perf_counter``, ``time``, and the thread's CPU time then).

        Raises gloo's ``RuntimeError`` on a timeout or a lost connection (the callers tell them apart).
        """
        while True:
            work, buf = self._posted[0]
            work.wait(timeout=timedelta(seconds=max(0.001, deadline - time.monotonic())))
            self._posted.popleft()
            now, wall, cpu = time.perf_counter(), time.time(), time.thread_time()
            header = decode(buf[:HEADER_BYTES].view(torch.int64))
            if header.kind == MessageKind.RESIZE:
                self._size = int(header.aux)
            if header.kind not in (MessageKind.CLOSE, MessageKind.ABORT):
                self._post()  # the one this message used; after CLOSE and ABORT nothing more comes
            if header.kind != MessageKind.RESIZE:
                return buf, header, now, wall, cpu

    def _get_packed(self, kind: MessageKind, mb_idx: int) -> Message:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise self._closed_error()
        deadline = time.monotonic() + self.timeout
        asked, asked_wall, asked_cpu = time.perf_counter(), time.time(), time.thread_time()
        try:
            buf, header, now, wall, cpu = self._next_packed(deadline)
        except RuntimeError as exc:
            if "timed out" in str(exc).lower():
                raise self._timeout_error(kind, mb_idx) from None
            self._posted.clear()  # the connection is gone, and every receive with it
            self._lost(exc)
            assert self._failure is not None
            raise self._failure from exc
        if header.kind in (MessageKind.CLOSE, MessageKind.ABORT):
            self._finish(deadline)
            if header.kind == MessageKind.CLOSE:
                raise self._closed_error()
            text = unpack(buf, header)[0]
            assert text is not None
            self._fail(_peer_abort(header, decode_text(text)))
            assert self._failure is not None
            raise self._failure
        values = buf[:HEADER_BYTES].view(torch.int64)
        sent = sent_at(values)  # the sender's clock: across hosts, as synchronised
        due = not_before(values)  # an emulated link's delivery time (0: none)
        if hold_until(due):
            now, wall = time.perf_counter(), time.time()
        blocked = (now - asked) - (cpu - asked_cpu)
        if blocked > _ARRIVED_DURING_WAIT_S or due > asked_wall:  # arrived while this thread waited: at `now`
            return Message(
                header, unpack(buf, header), arrived_at=now, transfer_s=self._link.waited(max(0.0, wall - sent))
            )
        transfer_s = self._link.was_there(max(0.0, asked_wall - sent))
        return Message(header, unpack(buf, header), arrived_at=asked, transfer_s=transfer_s)

    def _finish(self, deadline: float) -> None:
        """After ``CLOSE`` or ``ABORT``: completes the receives still posted (the sender pads them)."""
        try:
            for w, _ in self._posted:
                w.wait(timeout=timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except RuntimeError as exc:
            log.debug("channel %s: a padding message did not arrive: %r", self.name, exc)
        self._posted.clear()
        self._closed = True

    def _drain(self, timeout: float) -> None:
        """Reads (and drops) what the peer still sends, up to its ``CLOSE``; no receive stays posted."""
        deadline = time.monotonic() + timeout
        try:
            while self._posted:
                if self._next_packed(deadline)[1].kind in (MessageKind.CLOSE, MessageKind.ABORT):
                    self._finish(deadline)
                    return
        except Exception as exc:  # the peer is gone or never closed: nothing more to read either way
            log.warning("Channel %s did not close cleanly within %.0f s: %r", self.name, timeout, exc)
            self._posted.clear()
        self._closed = True

    # ----- CUDA: header, then tensors, received by a background thread

    def _run(self) -> None:
        torch.cuda.set_device(self.device)
        try:
            while True:
                header_t = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                dist.recv(header_t, src=self.peer, group=self.group)
                values = header_t.cpu()
                header = decode(values)
                if header.kind == MessageKind.CLOSE:
                    self._queue.put(None)
                    return
                if header.kind == MessageKind.ABORT:
                    spec = header.specs[0]
                    assert spec is not None
                    text_t = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
                    dist.recv(text_t, src=self.peer, group=self.group)
                    self._fail(_peer_abort(header, decode_text(text_t)))
                    return
                tensors: list[Tensor | None] = []
                t_header = time.perf_counter()
                for spec in header.specs:
                    if spec is None:
                        tensors.append(None)
                        continue
                    t = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
                    dist.recv(t, src=self.peer, group=self.group)
                    tensors.append(t)
                torch.cuda.current_stream(self.device).synchronize()
                hold_until(not_before(values))
                now = time.perf_counter()
                self._queue.put(Message(header, tensors, arrived_at=now, transfer_s=now - t_header))
        except BaseException as exc:  # the peer's process is gone (or the group was torn down under us)
            if self._closed:
                return
            self._lost(exc)

    def _lost(self, exc: BaseException) -> None:
        self._fail(
            PeerFailure(
                f"Lost the connection to stage {self.peer_stage} (rank {self.peer}) on channel {self.name}: that "
                f"process stopped or was killed ({type(exc).__name__}: {exc}). Check its log for the cause.",
                self.peer_stage,
                self.peer,
            )
        )

    def _fail(self, failure: PeerFailure) -> None:
        self._failure = failure
        self._queue.put(failure)
        if self.on_failure is not None:
            self.on_failure(failure)


def _peer_abort(header: Header, text: str) -> PeerFailure:
    """The failure a peer's ``ABORT`` message describes (``mb_idx``: the failed stage, ``aux``: its rank)."""
    return PeerFailure(
        f"Stage {header.mb_idx} (rank {int(header.aux)}) failed first: {text}", header.mb_idx, int(header.aux)
    )


def encode_text(text: str, limit: int = 4000) -> Tensor:
    """A UTF-8 string as a uint8 tensor (for failure messages: no pickle on the wire)."""
    data = text.encode("utf-8", errors="replace")[:limit]
    return torch.tensor(list(data) or [32], dtype=torch.uint8)


def decode_text(t: Tensor) -> str:
    """Inverse of :func:`encode_text`."""
    return bytes(t.cpu().tolist()).decode("utf-8", errors="replace")


class FailureHandler:
    """Spreads a stage failure along the pipeline and makes sure this process does not outlive it for long.

    When a receive learns that a peer failed (an ABORT message, or a lost connection), the handler
    logs it, forwards the ABORT to the other neighbours (so a failure travels the whole pipeline), and arms a
    watchdog: the main thread normally raises :class:`~lightning_dynpipe.errors.PeerFailure` from its next
    receive and exits through Lightning's error path; if it is stuck in a collective instead, the watchdog ends
    the process after ``grace_s`` seconds rather than letting it wait for the 30-minute collective timeout.
    """

    def __init__(self, stage_idx: int, rank: int, grace_s: float = 15.0) -> None:
        self.stage_idx = stage_idx
        self.rank = rank
        self.grace_s = grace_s
        self.channels: list[SendChannel] = []
        self.failure: PeerFailure | None = None
        self._lock = threading.Lock()

    def peer_failed(self, failure: PeerFailure, source: SendChannel | None = None) -> None:
        """Called by the receive that learnt of the failure (the stage's thread; a receiver thread on CUDA)."""
        if not self._record_and_pass_on(failure, source):
            return
        timer = threading.Timer(self.grace_s, self._hard_exit, args=(failure,))
        timer.daemon = True
        timer.start()

    def relay(self, failure: PeerFailure) -> None:
        """Records and passes on a peer's failure found after this rank's own error (a collective that broke when
        the peer's process ended), without the watchdog: this process is already ending through its error path."""
        self._record_and_pass_on(failure, None)

    def _record_and_pass_on(self, failure: PeerFailure, source: SendChannel | None) -> bool:
        """The first failure learnt of: logged and forwarded to the other neighbours; ``False`` if one was known."""
        with self._lock:
            if self.failure is not None:
                return False
            self.failure = failure
        log.error("DynPipe stage %d (rank %d): %s", self.stage_idx, self.rank, failure)
        for ch in self.channels:
            if ch.peer != failure.rank and ch is not source:
                ch.abort(failure.stage_idx, failure.rank, str(failure).split("failed first: ", 1)[-1])
        return True

    def local_failure(self, exc: BaseException) -> None:
        """This stage failed first: tell the neighbours (bounded wait), unless it only reacts to a peer's failure."""
        with self._lock:
            if self.failure is not None or isinstance(exc, PeerFailure):
                return
            self.failure = PeerFailure(f"{type(exc).__name__}: {exc}", self.stage_idx, self.rank)
        for ch in self.channels:
            ch.abort(self.stage_idx, self.rank, f"{type(exc).__name__}: {exc}")

    def _hard_exit(self, failure: PeerFailure) -> None:
        sys.stderr.write(
            f"DynPipe stage {self.stage_idx} (rank {self.rank}) is ending its process: {failure} "
            f"(still blocked {self.grace_s:.0f} s after the failure was detected)\n"
        )
        sys.stderr.flush()
        os._exit(1)
