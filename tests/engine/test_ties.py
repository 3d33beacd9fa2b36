"""Parameters shared by layers on different stages (tied embeddings): one logical parameter.

Each stage holds a copy; under sync and gpipe the copies' gradients are summed before the one update per step,
so the copies stay identical and equal plain tied training on one device. Stages run as threads of this
process, each with its own copy of the model, as separate processes would have them.
"""

from __future__ import annotations

import copy
import doctest
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_dynpipe.engine.ties
from lightning_dynpipe.engine.shard import OptimizerSlots, StageShard
from lightning_dynpipe.engine.ties import retie, shared_parameters, split_ties
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.partition import Partition
from tests.engine.inprocess import build

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategy"))
from pipeline_models import TinyGPT, gpt_loss, token_loader  # noqa: E402

M = 4


def _adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def test_docstring_examples() -> None:
    assert doctest.testmod(lightning_dynpipe.engine.ties).failed == 0


def test_ties_are_found_and_split_by_a_partition() -> None:
    model = TinyGPT(tie=True).pipeline
    (tie,) = shared_parameters(model)
    assert tie.occurrences == ((0, "tok.weight"), (4, "out.weight")) and tie.layers == (0, 4)
    assert split_ties([tie], Partition((2, 3))) == [tie] and split_ties([tie], Partition((5,))) == []
    assert tie.describe() == "pipeline.0.tok.weight = pipeline.4.out.weight"
    assert shared_parameters(TinyGPT().pipeline) == []


@pytest.mark.parametrize("schedule", ["sync", "gpipe"])
def test_split_tied_weights_train_like_plain_tied_training(schedule: str) -> None:
    model = TinyGPT(tie=True)
    plain = copy.deepcopy(model)
    batches = list(token_loader())
    copies = [copy.deepcopy(model.pipeline) for _ in range(2)]
    pipe = build(copies, [2, 3], schedule=schedule, num_microbatches=M, make_optimizer=_adam, loss_fn=gpt_loss)
    pipe.train(batches)

    opt = _adam(list(plain.parameters()))
    for x, y in batches:
        opt.zero_grad()
        gpt_loss(plain.pipeline(x), (x, y)).backward()
        opt.step()
    emb, head = copies[0][0].tok.weight, copies[1][4].out.weight
    assert torch.equal(emb, head)  # the two copies are one parameter
    torch.testing.assert_close(emb, plain.pipeline[0].tok.weight, rtol=1e-5, atol=1e-6)
    for k, shard in enumerate(pipe.shards):
        for i in shard.owned:
            for (name, p), q in zip(copies[k][i].named_parameters(), plain.pipeline[i].parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"layer {i} {name}")


def test_untied_copies_would_drift_apart() -> None:
    """The same run without the gradient sum: each copy learns from its own use only (the silent bug)."""
    model = TinyGPT(tie=True)
    copies = [copy.deepcopy(model.pipeline) for _ in range(2)]
    for c in copies:  # hide the tie from the harness: separate Parameter objects in each copy
        c[4].out.weight = nn.Parameter(c[4].out.weight.detach().clone())
    build(copies, [2, 3], schedule="sync", num_microbatches=M, make_optimizer=_adam, loss_fn=gpt_loss).train(
        list(token_loader())
    )
    assert (copies[0][0].tok.weight - copies[1][4].out.weight).abs().max() > 1e-3


def test_optimizer_slots_give_a_shared_parameter_one_slot_on_every_stage_that_holds_it() -> None:
    model = TinyGPT(tie=True)
    opt = _adam(list(model.parameters()))
    n = len(opt.param_groups[0]["params"])
    slots = OptimizerSlots.record(model.pipeline, [opt])
    assert slots.slots[0][(0, "tok.weight")] == slots.slots[0][(4, "out.weight")] == (0, 0)
    for k, owned_ids in ((0, {0}), (1, {0})):
        m = copy.deepcopy(model)
        o = _adam(list(m.parameters()))
        shard = StageShard(m.pipeline, Partition((2, 3)), k)
        sl = OptimizerSlots.record(m.pipeline, [o])
        shard.partition_module()
        sl.refilter([o], shard)
        assert owned_ids <= {c for g in sl.canonical[0] for c in g}  # the tied weight is canonical 0 on both
    assert n == len(list(model.parameters()))


def test_retie_makes_materialised_copies_one_parameter_again() -> None:
    model = TinyGPT(tie=True).pipeline
    model[4].out.weight = nn.Parameter(model[0].tok.weight.detach().clone())  # as after a re-assembly
    retie(model, [shared_parameters(TinyGPT(tie=True).pipeline)[0]], range(5))
    assert model[4].out.weight is model[0].tok.weight


@pytest.mark.parametrize("kind", ["tensor", "post_accumulate"])
def test_a_gradient_hook_on_a_tied_parameter_split_across_stages_is_refused(kind: str) -> None:
    """Each stage's copy would run the hook on its part of the gradient, not on the sum as plain training does."""
    model = TinyGPT(tie=True)
    copies = [copy.deepcopy(model.pipeline) for _ in range(2)]
    for c in copies:  # every process builds the model, and with it the hook
        if kind == "tensor":
            c[0].tok.weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
        else:
            c[0].tok.weight.register_post_accumulate_grad_hook(lambda p: None)
    pipe = build(copies, [2, 3], schedule="sync", num_microbatches=M, make_optimizer=_adam, loss_fn=gpt_loss)
    with pytest.raises(
        ConfigurationError, match=r"pipeline\.0\.tok\.weight = pipeline\.4\.out\.weight .* gradient hook"
    ):
        pipe.train(list(token_loader())[:1])
