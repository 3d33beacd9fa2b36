"""The packed point-to-point protocol between two real gloo processes (no Lightning): messages of changing
sizes arrive intact and in order, a peer's failure description arrives, both ends close with messages still
unread, a message read long after it arrived is not charged its time in the buffer, an emulated slow link delays
delivery but not the sender, and no receive is left posted."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_dynpipe.engine import p2p, wire
from lightning_dynpipe.engine.executor import StageChannels
from lightning_dynpipe.engine.p2p import PREPOSTED, RecvChannel, SendChannel
from lightning_dynpipe.engine.wire import MIN_MESSAGE, MessageKind, decode, encode, message_size, pack, unpack
from lightning_dynpipe.errors import PeerFailure


def _messages() -> list[tuple[MessageKind, int, list[Any]]]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 700, generator=g)  # larger than the first messages: the receiver resizes up
    return [
        (MessageKind.ACTIVATION, 0, [torch.randn(8, 16, generator=g)]),
        (MessageKind.ACTIVATION, 1, [torch.randn(8, 16, generator=g)]),  # same size: no resize
        (MessageKind.ACTIVATION, 2, [torch.randn(2, 3, generator=g), torch.arange(5), None]),
        (MessageKind.EVAL_ACTIVATION, 0, [big.to(torch.bfloat16), torch.tensor([True, False])]),
        (MessageKind.GRADIENT, 3, [torch.randn(1, generator=g, dtype=torch.float64)]),  # and down again
        (MessageKind.GRADIENT, 4, []),
    ]


def _messages_mode(rank: int, group: Any) -> str:
    msgs = _messages()
    if rank == 0:
        ch = SendChannel(group, 1, "activations 0->1")
        for kind, mb, tensors in msgs:
            ch.send(kind, mb, tensors, aux=float(mb) / 2, is_tuple=len(tensors) > 1)
        ch.close()
        return "ok"
    rc = RecvChannel(group, 0, torch.device("cpu"), 30.0, "activations 0->1", peer_stage=0)
    for kind, mb, tensors in msgs:
        m = rc.get(kind, mb)
        assert m.header.aux == mb / 2 and m.header.is_tuple == (len(tensors) > 1)
        assert len(m.tensors) == len(tensors)
        for got, want in zip(m.tensors, tensors):
            assert (got is None and want is None) or (got.dtype == want.dtype and torch.equal(got, want))
        assert m.transfer_s >= 0.0
    rc.join()
    assert not rc._posted, "no receive may stay posted after CLOSE"
    return "ok"


def _abort_mode(rank: int, group: Any) -> str:
    msgs = _messages()
    if rank == 0:
        ch = SendChannel(group, 1, "activations 0->1")
        ch.send(*msgs[0])
        ch.abort(0, 0, "boom: a RuntimeError on stage 0")
        ch.flush()
        return "ok"
    rc = RecvChannel(group, 0, torch.device("cpu"), 30.0, "activations 0->1", peer_stage=0)
    first = rc.get(*msgs[0][:2])
    assert torch.equal(first.tensors[0], msgs[0][2][0])
    try:
        rc.get(MessageKind.ACTIVATION, 1)
    except PeerFailure as exc:
        rc.join()
        return str(exc)
    return "no failure raised"


def _unread_mode(rank: int, group: Any) -> str:
    """Both ends send more than the other has posted and read none of it, then close: used to deadlock."""
    down, up = dist.new_group([0, 1]), dist.new_group([0, 1])
    peer = 1 - rank
    channels = StageChannels()
    if rank == 0:
        channels.send_activation = SendChannel(down, peer, "activations 0->1")
        channels.recv_grad = RecvChannel(up, peer, torch.device("cpu"), 30.0, "gradients 1->0", peer_stage=1)
        sender = channels.send_activation
    else:
        channels.recv_activation = RecvChannel(down, peer, torch.device("cpu"), 30.0, "activations 0->1", peer_stage=0)
        channels.send_grad = SendChannel(up, peer, "gradients 1->0")
        sender = channels.send_grad
    for mb in range(PREPOSTED + 3):
        sender.send(MessageKind.ACTIVATION if rank == 0 else MessageKind.GRADIENT, mb, [torch.randn(64, 64)])
    channels.close()
    receiver = channels.recv_grad if rank == 0 else channels.recv_activation
    assert isinstance(receiver, RecvChannel) and not receiver._posted, "no receive may stay posted after close"
    return "ok"


def _late_mode(rank: int, group: Any) -> str:
    """A message read long after it arrived is not charged the time it sat in its buffer as link time."""
    dist.barrier(group=group)  # both here: the receiver waits for the first message
    if rank == 0:
        ch = SendChannel(group, 1, "activations 0->1")
        time.sleep(0.3)  # the receiver waits for the first message: an exact transfer time
        for mb in range(3):
            ch.send(MessageKind.ACTIVATION, mb, [torch.randn(32, 32)])
        ch.close()
        return "ok"
    rc = RecvChannel(group, 0, torch.device("cpu"), 30.0, "activations 0->1", peer_stage=0)
    first = rc.get(MessageKind.ACTIVATION, 0)
    time.sleep(0.3)  # the next two arrive meanwhile
    later = [rc.get(MessageKind.ACTIVATION, mb) for mb in (1, 2)]
    rc.join()
    if not first.transfer_s < 0.1 or not all(m.transfer_s <= first.transfer_s + 1e-9 for m in later):
        return f"transfer times {first.transfer_s}, {[m.transfer_s for m in later]}"
    return "ok"


def _link_mode(rank: int, group: Any) -> str:
    """An emulated link (10 ms + 100 KB at 10 MB/s per message) holds each message at the receiver, not the sender."""
    from lightning_dynpipe.interference.link import DelayInjector

    dist.barrier(group=group)
    start = torch.tensor([time.time()], dtype=torch.float64)
    dist.broadcast(start, src=0, group=group)  # both ranks measure from the sender's start
    t0 = float(start)
    if rank == 0:
        ch = SendChannel(group, 1, "activations 0->1")
        ch.delay = DelayInjector(delay_s=0.010, bandwidth_Bps=10e6)
        for mb in range(3):
            ch.send(MessageKind.ACTIVATION, mb, [torch.zeros(25_000)])  # 100 KB
        sent_in = time.time() - t0
        ch.close()
        # held back by the link, the sends would take >= 30 ms (three messages' delay, or their bytes' time)
        return "ok" if sent_in < 0.025 else f"the sender was held back: 3 sends took {sent_in * 1e3:.1f} ms"
    rc = RecvChannel(group, 0, torch.device("cpu"), 30.0, "activations 0->1", peer_stage=0)
    got = []
    for mb in range(3):
        m = rc.get(MessageKind.ACTIVATION, mb)
        got.append((time.time() - t0, m.transfer_s))
    rc.join()
    # message i leaves the link at (i + 1) * 10 ms (they queue) and arrives 10 ms later; its transfer time, from its
    # own send, is at least its bytes' time plus the delay
    for i, (at, transfer) in enumerate(got):
        due = 0.010 * (i + 2)
        if not (due - 1e-3 <= at < due + 0.015 and 0.020 - 1e-3 <= transfer <= at + 1e-3):
            return f"message {i}: delivered at {at * 1e3:.1f} ms, transfer {transfer * 1e3:.1f} ms, due {due * 1e3:.0f}"
    return "ok"


def _worker(rank: int, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for mode, run in (
            ("messages", _messages_mode),
            ("abort", _abort_mode),
            ("unread", _unread_mode),
            ("late", _late_mode),
            ("link", _link_mode),
        ):
            try:
                out.put((mode, rank, run(rank, dist.new_group([0, 1]))))
            except BaseException as exc:  # reported to the test, not swallowed
                out.put((mode, rank, f"FAILED {type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.multiprocess
def test_two_processes_messages_abort_and_close_with_unread_messages() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    results = {(mode, rank): text for mode, rank, text in (out.get(timeout=5) for _ in range(10))}
    assert all(p.exitcode == 0 for p in procs), results
    assert results[("messages", 0)] == results[("messages", 1)] == "ok", results
    assert results[("abort", 0)] == "ok", results
    assert results[("unread", 0)] == results[("unread", 1)] == "ok", results
    assert results[("late", 0)] == results[("late", 1)] == "ok", results
    assert results[("link", 0)] == results[("link", 1)] == "ok", results
    assert "Stage 0 (rank 0) failed first: boom: a RuntimeError on stage 0" in results[("abort", 1)], results


def test_packing_roundtrip_and_sizes() -> None:
    tensors = [torch.randn(3, 5), torch.arange(7), torch.randn(2, dtype=torch.complex128), torch.ones(0)]
    header = encode(MessageKind.ACTIVATION, 9, [*tensors, None], aux=0.25, is_tuple=True)
    size = message_size(tensors)
    assert size == MIN_MESSAGE  # small messages are padded to the minimum
    buf = pack(header, tensors, size, sent_at=12.5)
    decoded = decode(buf[: header.numel() * 8].view(torch.int64))
    assert (decoded.kind, decoded.mb_idx, decoded.aux, decoded.is_tuple) == (MessageKind.ACTIVATION, 9, 0.25, True)
    got = unpack(buf, decoded)
    assert got[-1] is None and all(torch.equal(a, b) for a, b in zip(got, tensors))
    assert got[0].requires_grad_().is_leaf  # received activations become the stage's leaf inputs
    assert message_size([torch.zeros(1000)]) == MIN_MESSAGE - 1024 + 4000
    assert PREPOSTED >= 2


def test_the_header_carries_the_send_time_the_emulated_link_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first message of a new size is sent after the resize messages: its link time still starts at the send."""
    from lightning_dynpipe.engine import wire
    from lightning_dynpipe.interference.link import DelayInjector

    clock = iter(float(t) for t in range(100, 200))
    monkeypatch.setattr(time, "time", lambda: next(clock))  # every reading of the clock is one second later
    ch = SendChannel(None, 1, "activations 0->1")
    ch.delay = DelayInjector(delay_s=0.5)
    sent: list[torch.Tensor] = []
    monkeypatch.setattr(ch, "_isend", sent.append)
    ch.send(MessageKind.ACTIVATION, 0, [torch.zeros(25_000)])  # larger than the posted size: resizes first
    assert len(sent) == PREPOSTED + 1
    header = sent[-1][: wire.HEADER_BYTES].view(torch.int64)
    assert wire.sent_at(header) == 100.0  # the clock's first reading, the one the link was given
    assert wire.not_before(header) == 100.5


class _FakeReceive:
    """A posted receive whose ``wait`` lands the next scripted message: blocking the thread (``"in flight"``, the
    message arrives during the wait) or keeping it busy (``"arrived"``, a slow read of a message already there)."""

    script: list[tuple[str, float]] = []  # (how, seconds before the wait the message was sent)

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf

    def wait(self, timeout: Any = None) -> bool:
        how, sent_ago = _FakeReceive.script.pop(0)
        tensors = [torch.zeros(8)]
        header = encode(MessageKind.ACTIVATION, 0, tensors)
        self.buf.copy_(pack(header, tensors, self.buf.numel(), sent_at=time.time() - sent_ago))
        end = time.perf_counter() + 0.003
        if how == "in flight":
            time.sleep(0.003)
        else:
            while time.perf_counter() < end:  # the thread's own work: cold caches after a long sleep
                pass
        return True


def test_a_slow_read_of_an_arrived_message_is_not_charged_its_time_in_the_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whether a message was in flight when the stage asked is told by the time the wait blocked the thread, not by
    its wall time: a message the stage waited 3 ms for is charged its link time exactly, one that sat a second in
    its buffer and took 3 ms of the thread's CPU to return is charged the recent exact times (the wall time alone
    charged it the second)."""
    from lightning_dynpipe.engine import p2p

    monkeypatch.setattr(p2p.dist, "irecv", lambda buf, src, group: _FakeReceive(buf))
    _FakeReceive.script = [("in flight", 0.0), ("arrived", 1.0)]
    rc = RecvChannel(None, 0, torch.device("cpu"), 30.0, "activations 0->1", peer_stage=0)
    waited = rc.get(MessageKind.ACTIVATION, 0)
    assert 0.002 <= waited.transfer_s < 0.1  # arrived during the 3 ms wait: from the send to then
    sat = rc.get(MessageKind.ACTIVATION, 0)
    assert sat.transfer_s == pytest.approx(waited.transfer_s)  # not the second it sat in the buffer


class _Work:
    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: Any = None) -> bool:
        return True


def test_a_packed_channel_reuses_the_buffer_of_a_completed_send_and_never_one_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[tuple[torch.Tensor, _Work]] = []

    def isend(buf: torch.Tensor, dst: int, group: Any) -> _Work:
        sent.append((buf, _Work(done=False)))
        return sent[-1][1]

    monkeypatch.setattr(p2p.dist, "isend", isend)
    ch = p2p.SendChannel(group=None, peer=1, name="activations 0->1")
    x = torch.randn(8, 16)
    ch.send(MessageKind.ACTIVATION, 0, [x])  # resizes the peer's receives first: 2 RESIZE messages, then this one
    first = sent[-1][0]
    ch.send(MessageKind.ACTIVATION, 1, [x])
    assert sent[-1][0].data_ptr() != first.data_ptr()  # the first send is still in flight: a new buffer
    for _, work in sent:
        work.done = True
    ch.send(MessageKind.ACTIVATION, 2, [x * 2])
    reused = sent[-1][0]
    assert reused.data_ptr() in {first.data_ptr(), sent[-2][0].data_ptr()}
    header = wire.decode(reused[: wire.HEADER_BYTES].view(torch.int64))
    assert header.mb_idx == 2 and torch.equal(wire.unpack(reused, header)[0], x * 2)
