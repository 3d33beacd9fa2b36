"""The small MLP and batches both baselines' two-rank tests train (split after its second layer)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def model() -> nn.Sequential:
    """Four layers, the same weights on every call."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(20, 32), nn.ReLU()),
        nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
        nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
        nn.Linear(32, 5),
    )


def batches(num: int = 5, size: int = 16) -> list[tuple[Tensor, Tensor]]:
    """``num`` batches of ``size`` samples of 20 features and 5 classes, the same on every call."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 20, generator=g), torch.randint(0, 5, (size,), generator=g)) for _ in range(num)]
