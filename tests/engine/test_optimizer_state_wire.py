"""The canonical optimizer state moves as tensors (no pickle, no all_gather_object), only to the rank that needs it,
and comes out exactly as the plain optimizer's ``state_dict`` (same bytes when saved)."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_dynpipe.engine import checkpoint
from lightning_dynpipe.engine.loopback import LoopbackCollectives, LoopbackGroup, run_stages
from lightning_dynpipe.engine.optstate import (
    MAX_STATE_ENTRIES,
    broadcast_state,
    pack_state,
    recv_state,
    send_state,
    unpack_state,
)
from lightning_dynpipe.engine.shard import OptimizerSlots, StageShard
from lightning_dynpipe.errors import CommunicationError, ConfigurationError
from lightning_dynpipe.plan.partition import Partition

CPU = torch.device("cpu")


class NoPickle(LoopbackCollectives):
    """Loopback collectives that refuse object collectives and count the bytes each member receives."""

    received: dict[int, int] = {}

    def all_gather_object(self, obj: Any) -> list[Any]:
        raise AssertionError("optimizer state must not travel as pickled objects")

    def recv(self, tensor: Tensor, src: int) -> None:
        super().recv(tensor, src)
        NoPickle.received[self.rank] = NoPickle.received.get(self.rank, 0) + tensor.numel() * tensor.element_size()

    def broadcast(self, tensor: Tensor, src: int) -> None:
        super().broadcast(tensor, src)
        if self.rank != src:
            NoPickle.received[self.rank] = NoPickle.received.get(self.rank, 0) + tensor.numel() * tensor.element_size()


def _members(ranks: list[int]) -> dict[int, NoPickle]:
    group = LoopbackGroup(ranks)
    NoPickle.received = {}
    return {r: NoPickle(group, r) for r in ranks}


def test_state_values_come_back_with_their_types_and_values() -> None:
    state = {
        "step": torch.tensor(7.0),
        "exp_avg": torch.randn(3, 2, dtype=torch.float64),
        "count": 3,
        "scale": 0.1 + 1e-17,
        "flag": True,
        "buf": None,
    }
    back = unpack_state(pack_state(state, CPU, 0))
    assert back is not None and list(back) == list(state)
    assert torch.equal(back["step"], state["step"]) and back["step"].dtype == torch.float32
    assert torch.equal(back["exp_avg"], state["exp_avg"]) and back["exp_avg"].dtype == torch.float64
    assert type(back["count"]) is int and back["count"] == 3
    assert type(back["scale"]) is float and back["scale"] == state["scale"]
    assert back["flag"] is True and back["buf"] is None
    assert unpack_state(pack_state({}, CPU, 0)) == {}  # an empty state is not "no state"
    assert unpack_state(pack_state(None, CPU, 0)) is None


def test_unsupported_state_is_refused_with_the_parameter_named() -> None:
    with pytest.raises(ConfigurationError, match="parameter 4 holds 'old_dirs' of type list"):
        pack_state({"old_dirs": [torch.zeros(1)]}, CPU, 4)
    with pytest.raises(ConfigurationError, match=f"at most {MAX_STATE_ENTRIES}"):
        pack_state({f"k{i}": torch.zeros(1) for i in range(MAX_STATE_ENTRIES + 1)}, CPU, 2)
    with pytest.raises(ConfigurationError, match="keyed by strings"):
        pack_state({0: torch.zeros(1)}, CPU, 2)


def test_a_receiver_out_of_step_fails_loudly() -> None:
    m = _members([0, 1])

    def run(r: int) -> Any:
        if r == 0:
            return send_state(m[0], {"step": torch.tensor(1.0)}, 5, dst=1, device=CPU)
        return recv_state(m[1], 6, src=0, device=CPU)

    with pytest.raises(CommunicationError, match="Expected the optimizer state of parameter 6, received"):
        run_stages(run, 2)


def test_broadcast_gives_every_member_the_state() -> None:
    m = _members([0, 1, 2])
    state = {"step": torch.tensor(2.0), "momentum_buffer": torch.arange(4.0)}
    out = run_stages(lambda r: broadcast_state(m[r], state if r == 1 else None, 3, src=1, device=CPU), 3)
    for got in out:
        assert got is not None and torch.equal(got["momentum_buffer"], state["momentum_buffer"])


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        emb = nn.Embedding(6, 4)
        head = nn.Linear(4, 6, bias=False)
        head.weight = emb.weight
        self.pipeline = nn.Sequential(emb, nn.Linear(4, 4), nn.Tanh(), head)


def _trained(model: Tied, optimizer: str) -> torch.optim.Optimizer:
    params = list(model.parameters())
    opt: torch.optim.Optimizer
    if optimizer == "adam":
        opt = torch.optim.Adam([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:]}], lr=0.01)
    else:  # momentum 0: SGD keeps an empty state per parameter, which must survive as an empty dict
        opt = torch.optim.SGD(params, lr=0.1)
    for _ in range(2):
        model.pipeline(torch.tensor([1, 2, 3])).sum().backward()
        opt.step()
        opt.zero_grad()
    return opt


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("everywhere", [False, True])
def test_gathered_optimizer_state_is_the_plain_one_byte_for_byte(optimizer: str, everywhere: bool) -> None:
    """Three stages, the tied embedding/head on stages 0 and 2; the last stage on rank 0, as the strategy places it."""
    model = Tied()
    opt = _trained(model, optimizer)
    plain = opt.state_dict()
    partition = Partition((1, 2, 1))
    rank_of_stage = {0: 1, 1: 2, 2: 0}.__getitem__
    m = _members([0, 1, 2])
    copies = [copy.deepcopy((model, opt)) for _ in range(3)]

    def run(k: int) -> dict[str, Any]:
        net, o = copies[k]
        slots = OptimizerSlots.record(net.pipeline, [o])
        shard = StageShard(net.pipeline, partition, k)
        shard.partition_module()
        slots.refilter([o], shard)
        holders = {c: rank_of_stage(s) for c, s in slots.holders(0, partition).items()}
        coll = m[rank_of_stage(k)]
        return checkpoint.gather_optimizer_state(
            o.state_dict(), slots.canonical[0], slots.group_sizes[0], holders, coll, device=CPU,
            root=None if everywhere else 0,
        )  # fmt: skip

    out = run_stages(run, 3)
    for k, got in enumerate(out):
        if everywhere or rank_of_stage(k) == 0:
            assert _saved(got) == _saved(plain), f"stage {k}"
        else:
            assert got == {}
    if not everywhere:  # only the rank that writes receives anything
        assert NoPickle.received.get(1, 0) == 0 and NoPickle.received.get(2, 0) == 0
        assert NoPickle.received[0] > 0
