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


def test_a_layer_offloaded_and_moved_keeps_the_gradient_hooks_of_its_parameters() -> None:
    """Every rank builds the model with its hooks; the receiving rank's copy of a moving layer goes to ``meta`` when
    the stages are split and is materialised when the layer arrives, both of which make new ``Parameter`` objects.
    The hooks the user registered on the originals must be on them, and still removable by their handles."""
    from lightning_dynpipe.engine.shard import StageShard
    from lightning_dynpipe.plan.partition import Partition

    calls: list[str] = []
    sender, receiving_copy = _layer(), _layer()
    handles = []
    for model in (sender, receiving_copy):  # the same model, hooks included, in every process
        w = model[0].weight
        handles.append(w.register_hook(lambda g: (calls.append("tensor"), g * 0)[1]))
        w.register_post_accumulate_grad_hook(lambda p: calls.append("post"))
    pipeline = nn.Sequential(receiving_copy, nn.Linear(4, 4))
    shard = StageShard(pipeline, Partition((1, 1)), 1)  # stage 1: layer 0 belongs to stage 0
    shard.partition_module()
    skeleton = shard.skeleton(0)
    assert skeleton[0].weight.is_meta and skeleton[0].weight._backward_hooks
    opt = torch.optim.SGD(sender.parameters(), lr=0.1)
    _move(sender, opt, skeleton, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    arrived = shard.adopt(0)
    arrived(torch.ones(2, 3)).sum().backward()
    assert calls == ["tensor", "post"]
    assert torch.equal(arrived[0].weight.grad, torch.zeros(4, 3)) and arrived[0].bias.grad is not None
    handles[1].remove()  # the handle the user kept still removes the hook
    calls.clear()
    arrived(torch.ones(2, 3)).sum().backward()
    assert calls == ["post"]
