"""LinkDelay puts a DelayInjector on the send channels of one boundary, on the ranks that own them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_dynpipe.engine import p2p
from lightning_dynpipe.engine.executor import StageChannels
from lightning_dynpipe.engine.p2p import SendChannel
from lightning_dynpipe.engine.wire import MessageKind
from lightning_dynpipe.interference.base import InterferenceConfigError, InterferenceError
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


def test_a_delayed_send_waits_before_it_is_started(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []

    class _Work:
        def wait(self) -> None:
            pass

    monkeypatch.setattr(p2p.time, "sleep", lambda s: calls.append(("sleep", s)))
    monkeypatch.setattr(p2p.dist, "isend", lambda t, dst, group: calls.append(("isend", dst)) or _Work())
    s = _strategy(0)
    link = LinkDelay(0.25)
    with link.bound(s, 0):
        s.executor.channels.send_activation.send(MessageKind.ACTIVATION, 0, [torch.zeros(2)])
    s.executor.channels.send_activation.send(MessageKind.ACTIVATION, 1, [torch.zeros(2)])
    assert calls[0] == ("sleep", 0.25) and calls[1][0] == "isend"
    assert [c for c in calls if c[0] == "sleep"] == [("sleep", 0.25)]  # none once removed


def test_wrong_use_is_refused_with_the_fix() -> None:
    with pytest.raises(InterferenceConfigError, match=r"valid boundaries for 3 stage\(s\) are 0..1; got 2"):
        LinkDelay(0.01).apply(_strategy(0), boundary=2)
    with pytest.raises(InterferenceConfigError, match="a 1-stage pipeline has no boundary"):
        LinkDelay(0.01).apply(_strategy(0, num_stages=1), boundary=0)
    with pytest.raises(InterferenceError, match=r"strategy.executor is None.*on_train_batch_start"):
        LinkDelay(0.01).apply(SimpleNamespace(stage_idx=0, num_stages=2, executor=None), boundary=0)
    link = LinkDelay(0.01)
    link.apply(_strategy(0), 0)
    with pytest.raises(InterferenceError, match="already applied"):
        link.apply(_strategy(0), 0)
    with pytest.raises(InterferenceConfigError, match="would do nothing"):
        LinkDelay(0.0)
    with pytest.raises(InterferenceConfigError, match=r"delay_s must be in \[0, 3600\]; got -1"):
        LinkDelay(-1)
