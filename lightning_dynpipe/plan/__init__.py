"""Pure planning code: partitions, costs and the convergence model (no torch.distributed, no Lightning)."""

from lightning_dynpipe.plan.partition import Partition, balance_by_weights

__all__ = ["Partition", "balance_by_weights"]
