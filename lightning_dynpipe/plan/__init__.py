"""Pure planning code: partitions, costs and the convergence model (no torch.distributed, no Lightning)."""

from lightning_dynpipe.plan.convergence import DEFAULT_BETA, ConvergenceModel, Observation, fit_beta, staleness_profile
from lightning_dynpipe.plan.costs import (
    CommModel,
    CostModel,
    DefaultCostModel,
    DeviceSpec,
    LayerCost,
    ModelCost,
    PrefixCostModel,
)
from lightning_dynpipe.plan.memory import in_flight_microbatches, stage_memory, weight_versions
from lightning_dynpipe.plan.partition import Partition, balance_by_weights
from lightning_dynpipe.plan.replicas import ReplicaSplit, speed_weights, split_shares
from lightning_dynpipe.plan.solver import Plan, assign_devices, evaluate, solve, throughput_optimal

__all__ = [
    "ReplicaSplit",
    "speed_weights",
    "split_shares",
    "Partition",
    "balance_by_weights",
    "LayerCost",
    "ModelCost",
    "CommModel",
    "DeviceSpec",
    "CostModel",
    "PrefixCostModel",
    "DefaultCostModel",
    "stage_memory",
    "weight_versions",
    "in_flight_microbatches",
    "DEFAULT_BETA",
    "ConvergenceModel",
    "Observation",
    "fit_beta",
    "staleness_profile",
    "Plan",
    "assign_devices",
    "evaluate",
    "solve",
    "throughput_optimal",
]
