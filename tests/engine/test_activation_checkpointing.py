"""Activation checkpointing: a checkpointed layer keeps only its input and recomputes in the backward, on the
weight version its forward used, so training is bit-for-bit the same and memory holds less."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.engine.inprocess import build

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategy"))
from pipeline_models import TinyGPT, gpt_loss, token_loader  # noqa: E402

M = 4


def _adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


@pytest.mark.parametrize(("schedule", "balance"), [("async", [2, 3]), ("async", [1, 2, 2]), ("sync", [2, 3])])
def test_checkpointed_training_equals_training_without_it(schedule: str, balance: list[int]) -> None:
    model = TinyGPT()
    plain, ckpt = copy.deepcopy(model.pipeline), copy.deepcopy(model.pipeline)
    batches = list(token_loader())
    kw = dict(schedule=schedule, num_microbatches=M, make_optimizer=_adam, loss_fn=gpt_loss)
    build(plain, balance, **kw).train(batches)  # type: ignore[arg-type]
    build(ckpt, balance, checkpoint=True, **kw).train(batches)  # type: ignore[arg-type]
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(a, b), name


def _saved_bytes(checkpoint: bool) -> int:
    """Bytes autograd is handed to keep for the backward during one step of a one-stage pipeline."""
    model = TinyGPT()
    pipe = build(model.pipeline, [5], schedule="async", num_microbatches=M, make_optimizer=_adam, loss_fn=gpt_loss,
                 checkpoint=checkpoint)  # fmt: skip
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pipe.executors[0].train_step(next(iter(token_loader())))
    return saved


def test_checkpointing_keeps_less_for_the_backward() -> None:
    full, ckpt = _saved_bytes(False), _saved_bytes(True)
    # what is left: each layer's input and the loss's own (logits and targets, outside the pipeline's layers)
    assert ckpt < full / 2, (ckpt, full)
