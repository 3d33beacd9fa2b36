"""A pipeline built on ``meta`` and materialised per stage equals the one built eagerly, stage by stage, exactly;
what cannot be exact is refused with the tensor named."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_dynpipe.engine.materialize import is_on_meta, materialize_layers, record_random_state
from lightning_dynpipe.engine.ties import shared_parameters
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.partition import Partition

CPU = torch.device("cpu")


def stack() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 3)
    )


def tied() -> nn.Sequential:
    # built in layer order: the eager build draws its random numbers in the order the replay does
    emb, mid, head = nn.Embedding(6, 4), nn.Linear(4, 4), nn.Linear(4, 6, bias=False)
    head.weight = emb.weight
    return nn.Sequential(emb, mid, nn.Tanh(), head)


class Masked(nn.Module):
    """A causal mask computed in __init__ and no reset_parameters for it: on meta, its values are lost."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4, dtype=torch.bool)), persistent=False)


def _eager_and_meta(build: object) -> tuple[nn.Sequential, nn.Sequential, torch.Tensor]:
    torch.manual_seed(3)
    eager = build()  # type: ignore[operator]
    torch.manual_seed(3)
    with record_random_state() as draws:
        meta = build()  # type: ignore[operator]
    assert is_on_meta(meta) and draws.state is not None and not draws.own_generator
    return eager, meta, draws.state


@pytest.mark.parametrize(("build", "balance"), [(stack, (2, 3, 1)), (stack, (6,)), (tied, (1, 2, 1)), (tied, (3, 1))])
def test_each_stage_materialises_its_layers_as_the_eager_build_made_them(build: object, balance: tuple) -> None:
    eager, meta, state = _eager_and_meta(build)
    partition = Partition(balance)
    before = torch.get_rng_state()
    for k in range(partition.num_stages):
        stage = copy.deepcopy(meta)
        owned = list(partition.stage_layers(k))
        materialize_layers(stage, owned, CPU, random_state=state, ties=shared_parameters(meta))
        for i, layer in enumerate(stage):
            if i in owned:
                for (name, a), b in zip(layer.state_dict().items(), eager[i].state_dict().values()):
                    assert torch.equal(a, b), (k, i, name)
            else:
                assert all(t.device.type == "meta" for t in layer.state_dict().values()), (k, i)
        if build is tied and {0, 3} <= set(owned):
            assert stage[3].weight is stage[0].weight  # tied again on the stage that holds both
    assert torch.equal(torch.get_rng_state(), before)  # the caller's random state is left alone


def test_a_tensor_the_initialisation_leaves_unset_is_refused() -> None:
    with record_random_state() as draws:
        meta = nn.Sequential(nn.Linear(4, 4), Masked())
    with pytest.raises(ConfigurationError, match=r"Layer 1 of the pipeline \(Masked\).*leaves \['mask'\]"):
        materialize_layers(meta, [0], CPU, random_state=draws.state if draws.state is not None else draws.entry_state)


def test_a_draw_from_its_own_generator_is_noticed() -> None:
    with record_random_state() as draws:
        torch.empty(3).uniform_(generator=torch.Generator().manual_seed(1))
    assert draws.own_generator


def test_gradient_hooks_registered_on_the_meta_build_stay_on_every_layer() -> None:
    """A model built on ``meta`` with a hook on a parameter (registered in ``__init__``, say): materialising an
    owned layer, or sending a layer another stage owns back to ``meta``, makes new ``Parameter`` objects; the hook
    stays with the parameter's name."""
    with record_random_state() as draws:
        meta = stack()
    assert draws.state is not None
    for i in (0, 3):
        meta[i].weight.register_hook(lambda g: g * 0)
    materialize_layers(meta, [0, 1, 2], CPU, random_state=draws.state)  # layer 3 belongs to another stage
    assert not meta[0].weight.is_meta and meta[3].weight.is_meta
    assert meta[0].weight._backward_hooks and meta[3].weight._backward_hooks
    meta[0](torch.ones(2, 8)).sum().backward()
    assert torch.equal(meta[0].weight.grad, torch.zeros(16, 8)) and meta[0].bias.grad is not None


def test_offloaded_layers_restored_after_fit_keep_their_gradient_hooks() -> None:
    """What gathering after fit does: layers another stage trained come back from ``meta`` into the module."""
    from lightning_dynpipe.engine.shard import StageShard, layer_tensors

    pipeline = stack()

    def zero_grad(p: torch.Tensor) -> None:
        assert p.grad is not None
        p.grad.zero_()

    pipeline[3].weight.register_post_accumulate_grad_hook(zero_grad)
    values = {i: {k: v.clone() for k, v in layer_tensors(pipeline[i]).items()} for i in range(len(pipeline))}
    shard = StageShard(pipeline, Partition((3, 3)), 0)
    shard.partition_module()
    shard.restore({i: values[i] for i in (3, 4, 5)}, CPU)
    assert not pipeline[3].weight.is_meta and pipeline[3].weight._post_accumulate_grad_hooks
    pipeline[3](torch.ones(2, 16)).sum().backward()
    assert torch.equal(pipeline[3].weight.grad, torch.zeros(16, 16))
