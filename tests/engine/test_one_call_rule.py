"""The one-call rule: a training step calls the pipeline exactly once, or gets a clear error (a second call used
to get the first call's output whatever its input)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dynpipe.errors import ConfigurationError
from tests.engine.inprocess import build


def _run(loss: Any) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    pipe = build(model, [2], schedule="async", num_microbatches=2, make_optimizer=lambda ps: torch.optim.SGD(ps, 0.1),
                 loss_fn=loss)  # fmt: skip
    executor = pipe.executors[0]
    executor._last_stage_loss = lambda mb, slot: loss(executor, mb)  # the user's step, calling the pipeline itself
    executor.train_step((torch.randn(4, 3), torch.tensor([0, 1, 0, 1])))


def test_a_second_call_in_one_step_is_refused() -> None:
    def twice(executor: Any, mb: Any) -> Tensor:
        a = executor.local_forward(mb[0])
        b = executor.local_forward(mb[0].flip(0))  # a second view: would have received a's output
        return F.cross_entropy(a, mb[1]) + F.mse_loss(a, b)

    with pytest.raises(ConfigurationError, match=r"self.pipeline\(...\) was called twice in one step"):
        _run(twice)


def test_a_step_that_never_calls_the_pipeline_is_refused() -> None:
    def never(executor: Any, mb: Any) -> Tensor:
        return torch.zeros((), requires_grad=True)

    with pytest.raises(ConfigurationError, match=r"training_step returned a loss without calling self.pipeline"):
        _run(never)


def test_one_call_per_micro_batch_trains() -> None:
    _run(lambda executor, mb: F.cross_entropy(executor.local_forward(mb[0]), mb[1]))
