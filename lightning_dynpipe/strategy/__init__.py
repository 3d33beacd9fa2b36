"""The Lightning strategy: the only part of lightning-dynpipe coupled to Lightning's Trainer.

:class:`DynPipeStrategy` keeps the Lightning hooks and delegates the rest: argument validation and the model
contract, the set-up decision (profile, probe, plan), and the callbacks it installs live in this package; the
pipeline itself (stage shard, executor, checkpoints) in :mod:`lightning_dynpipe.engine`.
"""

from __future__ import annotations

from lightning_dynpipe.strategy.dynpipe import DynPipeStrategy, MigrationRecord, ScheduleChange
from lightning_dynpipe.strategy.restart import RestartPlan, fit_with_restarts

__all__ = [
    "DynPipeStrategy",
    "MigrationRecord",
    "ScheduleChange",
    "RestartPlan",
    "fit_with_restarts",
    "register_strategy_names",
]


def register_strategy_names() -> None:
    """Registers ``"dynpipe"``, ``"dynpipe_spawn"``, ``"dynpipe_fork"`` and the class-path aliases with
    Lightning's ``StrategyRegistry`` (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    DynPipeStrategy.register_strategies(StrategyRegistry)


register_strategy_names()  # Lightning is loaded by now (dynpipe.py imports it)
