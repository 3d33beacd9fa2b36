"""The PipeDream replay reference: zero staleness is plain per-micro-batch SGD; staleness changes the result."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dynpipe.calibration import default_staleness, replay_async
from lightning_dynpipe.errors import ConfigurationError


def _setup() -> tuple[nn.Sequential, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(5)]
    return net, batches


def _loss(out: torch.Tensor, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out, mb[1])


def test_zero_staleness_is_sgd_on_micro_batches() -> None:
    net, batches = _setup()
    ref = copy.deepcopy(net)
    replay_async(net, [2, 1], lambda ps: torch.optim.SGD(ps, lr=0.1), batches, 2, _loss, staleness=[0, 0])
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches:
        for xm, ym in zip(x.split(4), y.split(4)):
            opt.zero_grad()
            F.cross_entropy(ref(xm), ym).backward()
            opt.step()
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-7)


def test_staleness_changes_the_trajectory_and_drains_reset_it() -> None:
    net, batches = _setup()
    a, b, c = copy.deepcopy(net), copy.deepcopy(net), copy.deepcopy(net)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    replay_async(a, [2, 1], opt, batches, 2, _loss)
    replay_async(b, [2, 1], opt, batches, 2, _loss, staleness=[0, 0])
    replay_async(c, [2, 1], opt, batches, 2, _loss, drain_after_steps=[1, 3])
    assert default_staleness(3) == [2, 1, 0]
    assert not torch.allclose(a[0].weight, b[0].weight)
    assert not torch.allclose(a[0].weight, c[0].weight)


def test_rejects_bad_staleness() -> None:
    net, batches = _setup()
    with pytest.raises(ConfigurationError, match="staleness needs 2 non-negative entries"):
        replay_async(net, [2, 1], lambda ps: torch.optim.SGD(ps, lr=0.1), batches, 2, _loss, staleness=[1])
    with pytest.raises(ConfigurationError, match="staleness needs 2 non-negative entries"):
        replay_async(net, [2, 1], lambda ps: torch.optim.SGD(ps, lr=0.1), batches, 2, _loss, restaleness={1: [1, -1]})


def test_a_staleness_change_drains_and_continues_with_the_new_staleness() -> None:
    """``restaleness={1: [0, 0]}``: steps 0-1 as PipeDream's staleness, a drain, then steps 2-4 with none, which is
    the two runs one after the other."""
    net, batches = _setup()
    changed, first = copy.deepcopy(net), copy.deepcopy(net)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    replay_async(changed, [2, 1], opt, batches, 2, _loss, restaleness={1: [0, 0]})
    replay_async(first, [2, 1], opt, batches[:2], 2, _loss)
    replay_async(first, [2, 1], opt, batches[2:], 2, _loss, staleness=[0, 0])
    for a, b in zip(changed.parameters(), first.parameters()):
        assert torch.equal(a, b)
