"""Clipping by the norm over every stage (flush schedules): equal to one device's clip_grad_norm_, a shared
parameter counted once, and only where Lightning's own plugin clips (threads over a loopback group; the run through
Lightning and gloo is ``tests/strategy/test_numerics.py::test_sync_clips_by_the_norm_over_every_stage``)."""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, Precision
from torch import nn

from lightning_dynpipe import DynPipeStrategy
from lightning_dynpipe.engine.loopback import LoopbackGroup, run_stages
from lightning_dynpipe.engine.ties import copies_counted_elsewhere, shared_parameters, split_ties
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.strategy.clipping import PipelineNormClipping, clip_by_pipeline_norm


def _tied() -> nn.Sequential:
    torch.manual_seed(0)
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    return nn.Sequential(emb, nn.Linear(4, 4), nn.Tanh(), head)


def _grads(model: nn.Sequential) -> None:
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    model(tokens).square().sum().backward()


@pytest.mark.parametrize("clip", [0.1, 1e6], ids=["clipped", "under the limit"])
def test_the_pipeline_norm_clips_as_one_device_does_with_a_tie_counted_once(clip: float) -> None:
    whole = _tied()
    _grads(whole)
    torch.nn.utils.clip_grad_norm_(whole.parameters(), clip)  # the tied weight once

    # two stages, each with its own copy of the model (as processes hold); the tie's copies hold the summed gradient
    partition = Partition((2, 2))
    copies = [_tied(), _tied()]
    for c in copies:
        _grads(c)
    ties = split_ties(shared_parameters(copies[0]), partition)
    assert len(ties) == 1
    group = LoopbackGroup([0, 1])

    def stage(k: int) -> float:
        model = copies[k]
        owned = partition.stage_layers(k)
        params = [p for i in owned for p in model[i].parameters()]
        elsewhere = copies_counted_elsewhere(model, ties, owned, partition, k)
        assert (id(model[3].weight) in elsewhere) == (k == 1)  # the head's copy counts on stage 0, as the embedding
        total = clip_by_pipeline_norm(
            params, clip, group.member(k), counted_elsewhere=elsewhere, device=torch.device("cpu")
        )
        return float(total)

    totals = run_stages(stage, 2)
    assert totals[0] == totals[1]
    for k, layers in enumerate(([0, 1], [3])):
        for i in layers:
            for p, q in zip(copies[k][i].parameters(), whole[i].parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


def test_it_replaces_only_lightning_s_own_clipping_and_only_for_the_fit() -> None:
    plugin = Precision()
    calls: list[int] = []
    model = nn.Linear(3, 3)
    model(torch.ones(1, 3)).sum().backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    group = LoopbackGroup([0])
    clipping = PipelineNormClipping(
        plugin, lambda: group.member(0), lambda: calls.append(1) or set(), torch.device("cpu")
    )
    assert PipelineNormClipping.supports(plugin) and PipelineNormClipping.supports(DoublePrecision())

    class OwnClipping(Precision):
        def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
            pass

    assert not PipelineNormClipping.supports(OwnClipping())
    expected = copy.deepcopy(model)
    expected(torch.ones(1, 3)).sum().backward()
    torch.nn.utils.clip_grad_norm_(expected.parameters(), 0.01)
    clipping.install()
    plugin.clip_gradients(optimizer, clip_val=0.01, gradient_clip_algorithm="norm")
    assert clipping.calls == 1 and calls == [1]
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    clipping.remove()
    assert "clip_grad_by_norm" not in plugin.__dict__
    plugin.clip_gradients(optimizer, clip_val=0.01, gradient_clip_algorithm="norm")
    assert clipping.calls == 1


@pytest.mark.parametrize(("algorithm", "warns"), [(None, True), ("norm", True), ("value", False)])
def test_async_clipping_by_norm_is_per_stage_and_the_fit_is_told(algorithm: str | None, warns: bool) -> None:
    """Under async no whole-model gradient exists: each stage clips by its own norm, nothing is installed, and a
    fit that clips by norm is warned once (clipping by value is the same everywhere: no warning)."""
    strategy = DynPipeStrategy(num_stages=2, schedule="async")
    strategy.stage = object()  # type: ignore[assignment]
    trainer = SimpleNamespace(gradient_clip_val=0.5, gradient_clip_algorithm=algorithm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy._start_clipping(trainer, fitting=True)  # type: ignore[arg-type]
    told = [str(w.message) for w in caught if "clips each stage's gradient by that stage's norm" in str(w.message)]
    assert len(told) == int(warns), told
    if warns:
        assert "schedule='async'" in told[0] and "sqrt(2) x gradient_clip_val" in told[0]
    assert strategy._clipping is None
