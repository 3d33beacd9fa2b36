"""Pure unit tests of the engine's parts: wire format, weight stash, topology, micro-batch split."""

from __future__ import annotations

import math
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.func import functional_call

from lightning_dynpipe.engine import PipelineTopology, WeightStash, split_microbatches
from lightning_dynpipe.engine.executor import StageChannels, StageExecutor
from lightning_dynpipe.engine.wire import HEADER_LEN, MAX_TENSORS, MessageKind, decode, encode
from lightning_dynpipe.errors import CommunicationError, ConfigurationError


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16])
def test_header_round_trip(dtype: torch.dtype) -> None:
    a = torch.zeros(2, 3, 4, dtype=dtype)
    b = torch.randn(5, requires_grad=True)
    h = encode(MessageKind.GRADIENT, 17, [a, None, b], aux=0.125, is_tuple=True)
    assert h.shape == (HEADER_LEN,) and h.dtype == torch.int64
    d = decode(h)
    assert (d.kind, d.mb_idx, d.aux, d.is_tuple) == (MessageKind.GRADIENT, 17, 0.125, True)
    assert d.specs[1] is None
    assert d.specs[0] is not None and d.specs[0].dtype == dtype and d.specs[0].shape == (2, 3, 4)
    assert d.specs[2] is not None and d.specs[2].requires_grad and d.specs[2].shape == (5,)


def test_headers_of_the_same_shapes_are_independent_messages() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    first = encode(MessageKind.ACTIVATION, 3, [x], aux=0.5)
    second = encode(MessageKind.ACTIVATION, 4, [x])  # same shapes: built from the cached template
    third = encode(MessageKind.ACTIVATION, 5, [x.detach()])  # another autograd flag: another template
    assert (decode(first).mb_idx, decode(first).aux) == (3, 0.5)  # not overwritten by the later messages
    assert decode(second).mb_idx == 4 and math.isnan(decode(second).aux)
    assert decode(second).specs == decode(first).specs
    spec = decode(third).specs[0]
    assert spec is not None and not spec.requires_grad
    assert torch.equal(second[5:], first[5:]) and not torch.equal(second, first)


def test_header_rejects_what_cannot_be_sent() -> None:
    with pytest.raises(CommunicationError, match="At most 12 tensors"):
        encode(MessageKind.ACTIVATION, 0, [torch.zeros(1)] * (MAX_TENSORS + 1))
    with pytest.raises(CommunicationError, match="at most 7 dimensions"):
        encode(MessageKind.ACTIVATION, 0, [torch.zeros([1] * 8)])
    bad = encode(MessageKind.ACTIVATION, 0, [])
    bad[0] = 0
    with pytest.raises(CommunicationError, match="malformed pipeline header"):
        decode(bad)


def test_what_crosses_a_boundary_is_tensors_and_the_refusal_names_what_is_not() -> None:
    from lightning_dynpipe.engine.executor import _flatten

    x = torch.zeros(2)
    assert _flatten(x, "out") == ([x], False)
    assert _flatten((x, torch.tensor(0.5)), "out")[1] is True  # a number travels as a 0-d tensor
    for value, got in [
        ((x, 3), "got tuple holding int at position 1"),
        ((x, None, "a"), "got tuple holding NoneType at position 1, str at position 2"),
        ({"h": x}, "got dict"),
    ]:
        with pytest.raises(ConfigurationError) as err:
            _flatten(value, "The output of stage 0")
        assert f"The output of stage 0 must be a Tensor or a tuple of Tensors to cross a stage boundary; {got}." in str(
            err.value
        )
        assert "torch.tensor(x)" in str(err.value)


def test_stash_keeps_the_forward_weights_for_the_backward() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    stash = WeightStash(layer)
    x = torch.randn(4, 3)
    v0 = stash.acquire()
    v0b = stash.acquire()  # two micro-batches between updates share one version
    assert v0 == v0b and stash.depth == 1
    assert stash.params(v0)["weight"].data_ptr() == layer.weight.data_ptr()  # no copy until an update
    before = layer.weight.detach().clone()
    out = functional_call(layer, stash.params(v0), (x,))
    stash.before_update()  # PipeDream updates the live weights before this micro-batch's backward
    with torch.no_grad():
        layer.weight.add_(1.0)
    stash.bump()
    assert stash.copies_made == 1
    assert stash.params(v0)["weight"].data_ptr() != layer.weight.data_ptr()
    v1 = stash.acquire()
    assert v1 == 1 and stash.depth == 2 and stash.max_depth == 2
    (g,) = torch.autograd.grad(out.sum(), [stash.params(v0)["weight"]])
    assert torch.equal(stash.params(v0)["weight"], before)
    assert torch.allclose(g, x.sum(0).expand(2, 3))
    stash.release(v0)
    stash.release(v0)
    assert stash.depth == 1
    stash.before_update()  # v1 (the live version) is still in use, so the live weights move again
    assert stash.copies_made == 2
    stash.release(v1)
    stash.reset()
    assert stash.version == 0 and stash.depth == 0


def test_stash_without_users_copies_nothing() -> None:
    layer = nn.Linear(3, 2)
    stash = WeightStash(layer)
    v = stash.acquire()
    stash.release(v)
    stash.before_update()
    stash.bump()
    assert stash.copies_made == 0


def test_topology_places_the_last_stage_on_rank_zero() -> None:
    t = PipelineTopology(num_stages=4, world_size=8)
    assert t.dp_size == 2
    assert t.rank_of(0, 3) == 0 and t.rank_of(1, 3) == 4
    assert all(t.coords(t.rank_of(d, k)) == (d, k) for d in range(2) for k in range(4))
    assert t.pipeline_ranks(0) == [1, 2, 3, 0]
    assert t.stage_ranks(0) == [1, 5]
    with pytest.raises(ConfigurationError, match="must be divisible by num_stages=3"):
        PipelineTopology(num_stages=3, world_size=4)


def test_split_microbatches_handles_collections() -> None:
    Pair = namedtuple("Pair", "x y")
    batch = {"x": torch.arange(10), "meta": "keep", "pair": Pair(torch.ones(10, 2), [torch.zeros(10)])}
    mbs, sizes = split_microbatches(batch, 4)
    assert sizes == [3, 3, 2, 2]
    assert [mb["x"].tolist() for mb in mbs][0] == [0, 1, 2]
    assert all(mb["meta"] == "keep" for mb in mbs)
    assert isinstance(mbs[1]["pair"], Pair) and mbs[3]["pair"].x.shape == (2, 2)
    assert mbs[2]["pair"].y[0].shape == (2,)


def test_split_microbatches_refuses_small_batches() -> None:
    with pytest.raises(ConfigurationError, match="batch of size 3 cannot be split into num_microbatches=4"):
        split_microbatches((torch.zeros(3, 2), torch.zeros(3)), 4)
    with pytest.raises(ConfigurationError, match="no tensor with a batch dimension"):
        split_microbatches({"a": 1}, 2)


def test_exposed_transfer_and_measured_overlap() -> None:
    from lightning_dynpipe.engine.executor import StepStats
    from lightning_dynpipe.engine.p2p import Message
    from lightning_dynpipe.engine.wire import Header

    msg = Message(Header(MessageKind.ACTIVATION, 0, (), 0.0), [], arrived_at=10.0, transfer_s=2.0)
    assert msg.exposed_transfer_s(wanted_at=11.0) == 0.0  # ready before it was asked for: hidden
    assert msg.exposed_transfer_s(wanted_at=9.5) == 0.5  # asked mid-transfer: the rest was waited for
    assert msg.exposed_transfer_s(wanted_at=5.0) == 2.0  # asked before it started: all exposed
    stats = StepStats(comm_s=4.0, exposed_comm_s=1.0)
    assert stats.comm_overlap == 0.75 and StepStats().comm_overlap == 1.0


class _Tied(nn.Module):
    """Two linear layers sharing one weight, and a nested module: every kind of parameter slot."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Sequential(nn.Linear(4, 4, bias=False))
        self.b[0].weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _executor(stage: nn.Module) -> StageExecutor:
    return StageExecutor(
        stage_module=stage,
        stage_idx=0,
        num_stages=1,
        schedule="sync",
        num_microbatches=1,
        channels=StageChannels(),
        first_stage_input=None,
        last_stage_loss=lambda mb, slot: torch.zeros(()),  # never called: the tests call _forward_on
        optimizer_step=lambda: None,
    )


def test_forward_on_a_version_equals_functional_call_and_restores_the_parameters() -> None:
    torch.manual_seed(0)
    stage = nn.Sequential(_Tied(), nn.Linear(4, 3))
    executor = _executor(stage)
    live = {n: p for n, p in stage.named_parameters()}
    version = {n: (p.detach() * 0.5 + 0.1).requires_grad_(True) for n, p in live.items()}
    x = torch.randn(5, 4)
    got = executor._forward_on(version, x)
    want = functional_call(stage, version, (x,))
    assert torch.equal(got, want)
    # the gradient reaches the version's tensors (both uses of the tied weight), not the live parameters
    got.sum().backward()
    assert all(p.grad is None for p in live.values())
    assert all(t.grad is not None for t in version.values())
    assert dict(stage.named_parameters()) == live and stage[0].b[0].weight is stage[0].a.weight


def test_forward_on_a_version_restores_the_parameters_after_an_error() -> None:
    stage = nn.Sequential(nn.Linear(4, 4))
    executor = _executor(stage)
    live = dict(stage.named_parameters())
    version = {n: p.detach().clone() for n, p in live.items()}
    with pytest.raises(RuntimeError):
        executor._forward_on(version, torch.randn(2, 5))  # wrong width
    assert dict(stage.named_parameters()) == live
