"""Applying one update: the learning-rate scale around it, and clearing the gradients after it."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dynpipe.engine.updates import clear_grads, scaled_lr


def _with_grads(opt_cls: type[torch.optim.Optimizer] = torch.optim.SGD) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = opt_cls(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    return model, opt


def test_clear_grads_leaves_every_parameter_without_a_gradient_as_zero_grad_does() -> None:
    model, opt = _with_grads()
    frozen = nn.Parameter(torch.ones(2))  # in a group, never given a gradient
    opt.add_param_group({"params": [frozen]})
    assert all(p.grad is not None for p in model.parameters())
    clear_grads(opt)
    assert all(p.grad is None for p in model.parameters()) and frozen.grad is None


def test_an_optimizer_that_overrides_zero_grad_gets_its_own_call() -> None:
    calls: list[bool] = []

    class Counting(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            calls.append(set_to_none)
            super().zero_grad(set_to_none)

    model, opt = _with_grads(Counting)
    clear_grads(opt)
    assert calls == [True] and all(p.grad is None for p in model.parameters())


def test_under_the_profiler_the_real_call_keeps_its_range() -> None:
    _, opt = _with_grads()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        clear_grads(opt)
    assert any("zero_grad" in e.name for e in prof.events())


def test_scaled_lr_restores_the_configured_rate() -> None:
    _, opt = _with_grads()
    with scaled_lr(opt, 0.25):
        assert opt.param_groups[0]["lr"] == 0.025
    assert opt.param_groups[0]["lr"] == 0.1
