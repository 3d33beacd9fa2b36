"""Live repartitioning: which layers move (pure), and moving them between stages without a restart."""

from lightning_dynpipe.repartition.plan import LayerMove, plan_moves

__all__ = ["LayerMove", "plan_moves"]
