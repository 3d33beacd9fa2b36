"""lightning-dynpipe: asynchronous, interference-aware, dynamically repartitioned pipeline parallelism for Lightning.

Importing the package registers the strategy names ``"dynpipe"``, ``"dynpipe_spawn"`` and ``"dynpipe_fork"``
(idempotently), so ``Trainer(strategy="dynpipe")`` works after ``import lightning_dynpipe``.
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dynpipe.errors import (
    CommunicationError,
    ConfigurationError,
    DynPipeError,
    PartitionError,
    PeerFailure,
    PipelineTimeoutError,
    ScheduleError,
)
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.strategy import DynPipeStrategy

__version__ = "0.1.0"

__all__ = [
    "DynPipeStrategy",
    "Partition",
    "DynPipeError",
    "ConfigurationError",
    "PartitionError",
    "ScheduleError",
    "CommunicationError",
    "PipelineTimeoutError",
    "PeerFailure",
    "__version__",
]

DynPipeStrategy.register_strategies(StrategyRegistry)
