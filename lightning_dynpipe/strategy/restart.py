"""Restarting a fit under another number of stages: the last rung of the escalation ladder, when the user opts in.

A live migration moves layers between the stages that exist; it cannot change how many there are, because the
processes, their process groups and the data-parallel width are fixed for a fit. When the adaptive loop finds that
another number of stages reaches accuracy sooner (under the slowdowns it measured), ``DynPipeStrategy(change_stages=
"restart")`` writes a partition-independent checkpoint at the end of that step, ends the fit there, and leaves a
:class:`RestartPlan` in ``trainer.strategy.restart_plan``; :func:`fit_with_restarts` then builds the Trainer for the
new number of stages and resumes from that checkpoint, with the same processes.

Example::

    import lightning.pytorch as L
    from lightning_dynpipe import DynPipeStrategy, fit_with_restarts

    def make_trainer(num_stages):       # None for the first fit, then the restart plan's number
        strategy = DynPipeStrategy(num_stages=num_stages, replica_split="even", change_stages="restart")
        return L.Trainer(accelerator="cpu", devices=4, max_steps=2000, strategy=strategy)

    trainer = fit_with_restarts(make_trainer, model, train_loader)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from lightning.pytorch import LightningModule, Trainer

from lightning_dynpipe.errors import ConfigurationError

__all__ = ["RestartPlan", "fit_with_restarts"]


@dataclass(frozen=True)
class RestartPlan:
    """Why and how a fit ended early to continue under another number of stages.

    Attributes:
        num_stages: the number of stages to continue with.
        checkpoint: the partition-independent checkpoint written at the end of step ``step`` (a file, or a
            directory with ``checkpoint="sharded"``): pass it as ``ckpt_path``.
        step: the global step the checkpoint holds.
        old_num_stages: the number of stages the fit ran with.
        reason: the adaptive loop's decision, with its predicted times to accuracy.
    """

    num_stages: int
    checkpoint: str
    step: int
    old_num_stages: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for the spawn/fork launchers: they send rank 0's results to the launching process through
        Lightning's ``apply_to_collection``, which rebuilds dataclasses field by field and so cannot pass a frozen
        one."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RestartPlan:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)


def fit_with_restarts(
    make_trainer: Callable[[int | None], Trainer],
    model: LightningModule,
    *args: Any,
    max_restarts: int = 1,
    ckpt_path: str | None = None,
    **kwargs: Any,
) -> Trainer:
    """``trainer.fit(model, *args, **kwargs)``, continued under another number of stages whenever DynPipe asks.

    Args:
        make_trainer: builds a Trainer whose strategy is a :class:`~lightning_dynpipe.DynPipeStrategy` with
            ``num_stages`` as given (``None`` for the first fit: your choice); everything else as you like it, the
            same each time (``max_steps`` counts over all the fits: a resumed fit continues the step count).
        model: the LightningModule, passed to every fit.
        *args, **kwargs: the rest of ``Trainer.fit``'s arguments (dataloaders or a datamodule).
        max_restarts: how many restarts to make at most (the last fit runs to its end whatever it finds).
        ckpt_path: a checkpoint to resume the first fit from.

    Returns:
        The Trainer of the last fit.

    Under the default ``start_method="popen"`` every process runs your script, so every process calls this
    function: each one takes the same decision (the adaptive loop decides on the same measurements everywhere)
    and the fits continue in step, on the process group of the first one.
    """
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigurationError(f"max_restarts must be an integer >= 0; got {max_restarts!r}.")
    num_stages: int | None = None
    restarts = 0
    while True:
        trainer = make_trainer(num_stages)
        strategy = trainer.strategy
        if not hasattr(strategy, "restart_plan"):
            raise ConfigurationError(
                f"fit_with_restarts needs a Trainer with DynPipeStrategy; make_trainer returned one with "
                f"{type(strategy).__name__}."
            )
        if num_stages is not None and strategy.config.num_stages != num_stages:  # type: ignore[attr-defined]
            raise ConfigurationError(
                f"make_trainer({num_stages}) returned a DynPipeStrategy with num_stages="
                f"{strategy.config.num_stages!r}; pass the number it is given to DynPipeStrategy(num_stages=...)."  # type: ignore[attr-defined]
            )
        strategy.restart_allowed = restarts < max_restarts  # type: ignore[attr-defined]
        trainer.fit(model, *args, **{**kwargs, "ckpt_path": ckpt_path})
        plan: RestartPlan | None = strategy.restart_plan
        if plan is None or restarts >= max_restarts:
            return trainer
        restarts += 1
        num_stages, ckpt_path = plan.num_stages, plan.checkpoint
