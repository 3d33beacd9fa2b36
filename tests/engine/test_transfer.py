"""Live migration moves a layer's optimizer state exactly: every value with its type, "no state" apart from an
empty one (the same wire format as checkpoints, engine/optstate.py). Two threads stand for the two ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dynpipe.engine.loopback import LoopbackCollectives, LoopbackGroup, run_stages
from lightning_dynpipe.engine.transfer import recv_layer, send_layer

CPU = torch.device("cpu")


def _layer() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    layer.register_buffer("mask", torch.tril(torch.ones(2, 2)), persistent=False)
    return layer


def _move(sender: nn.Module, opt: torch.optim.Optimizer, receiver: nn.Module, recv_opt: torch.optim.Optimizer) -> int:
    """Sends ``sender`` (with its state in ``opt``) from rank 0 into ``receiver`` on rank 1; the bytes sent."""
    group = LoopbackGroup([0, 1])

    def rank(k: int) -> int:
        coll = LoopbackCollectives(group, k)
        if k == 0:
            return send_layer(sender, opt, 1, coll, CPU)
        recv_layer(receiver, recv_opt, 0, coll, CPU)
        return 0

    return run_stages(rank, 2)[0]


def test_a_moved_layer_keeps_every_optimizer_state_value_with_its_type() -> None:
    sender = _layer()
    w, b, ln_w, ln_b = sender.parameters()
    opt = torch.optim.SGD(sender.parameters(), lr=0.1)
    opt.state[w] = {"step": torch.tensor(7.0), "exp_avg": torch.randn(4, 3), "count": 3, "flag": True, "buf": None}
    opt.state[b] = {}  # an empty state is not "no state"
    opt.state[ln_b] = {"momentum_buffer": torch.randn(4, dtype=torch.float64), "scale": 0.1 + 1e-17}
    receiver = _layer().to("meta")
    recv_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    assert _move(sender, opt, receiver, recv_opt) > 0
    assert torch.equal(receiver.get_buffer("mask"), sender.get_buffer("mask"))  # non-persistent buffers travel
    for (name, a), b_ in zip(sender.state_dict().items(), receiver.state_dict().values()):
        assert torch.equal(a, b_), name
    rw, rb, rln_w, rln_b = receiver.parameters()
    got = recv_opt.state[rw]
    assert list(got) == ["step", "exp_avg", "count", "flag", "buf"]
    assert torch.equal(got["step"], torch.tensor(7.0)) and torch.equal(got["exp_avg"], opt.state[w]["exp_avg"])
    assert type(got["count"]) is int and got["count"] == 3 and got["flag"] is True and got["buf"] is None
    assert rb in recv_opt.state and recv_opt.state[rb] == {}
    assert rln_w not in recv_opt.state  # no state stays no state
    moved = recv_opt.state[rln_b]
    assert moved["momentum_buffer"].dtype == torch.float64 and torch.equal(
        moved["momentum_buffer"], opt.state[ln_b]["momentum_buffer"]
    )
    assert type(moved["scale"]) is float and moved["scale"] == 0.1 + 1e-17


@pytest.mark.parametrize("kind", ["spectral", "spectral-hook", "weight-norm"])
def test_a_parametrized_layer_moves_with_its_parametrization_buffers_and_optimizer_state(kind: str) -> None:
    """Spectral norm's ``u``/``v`` buffers and weight norm's two ``original`` parameters travel under their names;
    the moved layer computes what the sender's did, and Adam's state arrives for every parameter."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        layer = nn.Linear(3, 4)
        if kind == "spectral":
            return nn.utils.parametrizations.spectral_norm(layer)
        if kind == "spectral-hook":
            return nn.utils.spectral_norm(layer)
        return nn.utils.parametrizations.weight_norm(layer)

    sender = make()
    opt = torch.optim.Adam(sender.parameters(), lr=0.1)
    for _ in range(2):  # power iterations move u; Adam gets state
        opt.zero_grad()
        sender(torch.randn(2, 3)).sum().backward()
        opt.step()
    receiver = make().to("meta")
    recv_opt = torch.optim.Adam([nn.Parameter(torch.zeros(1))], lr=0.1)
    _move(sender, opt, receiver, recv_opt)
    assert list(receiver.state_dict()) == list(sender.state_dict())
    for (name, a), b in zip(sender.state_dict().items(), receiver.state_dict().values()):
        assert torch.equal(a, b), name
    x = torch.randn(2, 3)
    sender.eval(), receiver.eval()
    assert torch.equal(receiver(x), sender(x))
    assert len(recv_opt.state) == len(list(sender.parameters()))
