"""LinkDelay puts an emulated link (DelayInjector) on the send channels of one boundary, on the ranks that own them;
the sender stamps each message with its delivery time and does not wait."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from lightning_dynpipe.engine import p2p
from lightning_dynpipe.engine.executor import StageChannels
from lightning_dynpipe.engine.p2p import SendChannel
from lightning_dynpipe.engine.wire import HEADER_BYTES, MessageKind, decode, not_before
from lightning_dynpipe.interference.base import InterferenceConfigError
from lightning_dynpipe.interference.link import DelayInjector, LinkDelay


def _strategy(stage_idx: int, num_stages: int = 3) -> SimpleNamespace:
    """A stand-in for a set-up DynPipeStrategy: its stage and real (unconnected) send channels."""
    channels = StageChannels(
        send_activation=SendChannel(None, 0, f"activations {stage_idx}->{stage_idx + 1}")
        if stage_idx < num_stages - 1
        else None,
        send_grad=SendChannel(None, 0, f"gradients {stage_idx}->{stage_idx - 1}") if stage_idx > 0 else None,
    )
    return SimpleNamespace(stage_idx=stage_idx, num_stages=num_stages, executor=SimpleNamespace(channels=channels))


def test_boundary_sends_are_delayed_on_both_sides_and_restored() -> None:
    s0, s1, s2 = _strategy(0), _strategy(1), _strategy(2)
    links = [LinkDelay(0.004, jitter_s=0.001, seed=3) for _ in range(3)]
    assert links[0].apply(s0, boundary=0) == ["activations 0->1"]
    assert links[1].apply(s1, boundary=0) == ["gradients 1->0"]
    assert links[2].apply(s2, boundary=0) == []  # owns neither side of boundary 0
    act, grad = s0.executor.channels.send_activation, s1.executor.channels.send_grad
    for ch in (act, grad):
        assert isinstance(ch.delay, DelayInjector)
        assert (ch.delay.delay_s, ch.delay.jitter_s) == (0.004, 0.001)
        assert 0.003 <= ch.delay.sample() <= 0.005
    assert s1.executor.channels.send_activation.delay is None  # boundary 1 untouched
    assert links[0].active and not links[2].active
    for link, s in zip(links, (s0, s1, s2)):
        link.remove(s)
        link.remove(s)  # idempotent
    assert act.delay is None and grad.delay is None


def test_remove_restores_an_earlier_injector_and_keeps_a_later_one() -> None:
    s = _strategy(0)
    ch = s.executor.channels.send_activation
    earlier = DelayInjector(0.1)
    ch.delay = earlier
    link = LinkDelay(0.002)
    link.apply(s, 0)
    link.remove(s)
    assert ch.delay is earlier
    link.apply(s, 0)
    later = DelayInjector(0.3)
    ch.delay = later  # someone else took over the channel meanwhile
    link.remove(s)
    assert ch.delay is later


def test_a_delayed_send_is_stamped_with_its_delivery_and_not_held(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[torch.Tensor] = []

    class _Work:  # a send that completed at once (its buffer may be packed into again)
        def wait(self) -> None:
            pass

        def is_completed(self) -> bool:
            return True

    monkeypatch.setattr(p2p.time, "sleep", lambda s: pytest.fail(f"the sender slept {s} s"))
    monkeypatch.setattr(p2p.dist, "isend", lambda t, dst, group: sent.append(t.clone()) or _Work())
    s = _strategy(0)
    link = LinkDelay(0.25, bandwidth_Bps=800.0)  # 8 bytes of payload take 10 ms
    with link.bound(s, 0):
        before = time.time()
        s.executor.channels.send_activation.send(MessageKind.ACTIVATION, 0, [torch.zeros(2)])
    s.executor.channels.send_activation.send(MessageKind.ACTIVATION, 1, [torch.zeros(2)])
    data = [t[:HEADER_BYTES].view(torch.int64) for t in sent if decode(t[:HEADER_BYTES].view(torch.int64)).mb_idx >= 0]
    assert [decode(h).mb_idx for h in data] == [0, 1]
    assert before + 0.26 <= not_before(data[0]) <= time.time() + 0.26
    assert not_before(data[1]) == 0.0  # none once removed


def test_the_emulated_link_queues_messages_and_delivers_them_in_order() -> None:
    link = DelayInjector(delay_s=0.010, jitter_s=0.009, seed=1, bandwidth_Bps=1000.0)
    due = [link.deliver_at(100.0 + 0.001 * i, 5) for i in range(50)]  # 5 ms of bytes each, sent 1 ms apart
    assert due == sorted(due)  # jitter never reorders
    assert due[0] >= 100.0 + 0.005 + 0.001 and due[-1] >= 100.0 + 50 * 0.005 + 0.001
    idle = DelayInjector(delay_s=0.002, bandwidth_Bps=1e6)
    assert idle.deliver_at(5.0, 1000) == pytest.approx(5.003)
    assert idle.deliver_at(6.0, 1000) == pytest.approx(6.003)  # the link was idle again


def test_link_delay_refuses_what_would_do_nothing_or_is_not_a_bandwidth() -> None:
    with pytest.raises(InterferenceConfigError, match="would do nothing"):
        LinkDelay(0.0)
    with pytest.raises(InterferenceConfigError, match="bandwidth_Bps"):
        LinkDelay(0.001, bandwidth_Bps=0.0)
    assert "bandwidth_Bps=5e+07" in repr(LinkDelay(0.0, bandwidth_Bps=50e6))
