"""What the set-up profile tells the planner's memory model about layers under activation checkpointing."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dynpipe.strategy.config import DynPipeConfig


def test_the_docstring_examples() -> None:
    import doctest

    import lightning_dynpipe.strategy.decision

    assert doctest.testmod(lightning_dynpipe.strategy.decision).failed == 0


def test_checkpointed_layers_keep_only_their_outputs_per_micro_batch() -> None:
    """A Linear + GELU layer keeps its GELU input as well as its output; under activation checkpointing a
    micro-batch in flight keeps its output only, and the recompute's tensors count once, as workspace."""
    from lightning_dynpipe.profiling import profile_layers
    from lightning_dynpipe.strategy.decision import recomputed

    torch.manual_seed(0)
    pipeline = nn.Sequential(nn.Sequential(nn.Linear(64, 256), nn.GELU()), nn.Linear(256, 64))
    cost = profile_layers(pipeline, torch.randn(32, 64), warmup=0, repeats=1).to_model_cost()
    first = cost.layers[0]
    assert first.kept_bytes == 2 * 32 * 256 * 4  # the Linear's output (GELU's input) and GELU's output
    ckpt = recomputed(cost, DynPipeConfig.from_arguments(activation_checkpointing=[0]).checkpoint_layers(2))
    assert ckpt.layers[0].kept_bytes == 32 * 256 * 4 and ckpt.layers[0].workspace_bytes >= first.kept_bytes
    assert ckpt.layers[1] == cost.layers[1]
