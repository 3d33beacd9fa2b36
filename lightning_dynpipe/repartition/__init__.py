"""When to repartition: the policy (pure), the depth policy (pure: when to keep more micro-batches in flight), the
escalation ladder (pure: which response a measured imbalance gets) and the controller that turns a measured window
into a decision.

The strategy applies a decision at the next step; the layers move with
:meth:`lightning_dynpipe.engine.stage.PipelineStage.migrate`, along the moves of
:func:`~lightning_dynpipe.plan.moves.plan_moves`.
"""

from lightning_dynpipe.plan.moves import LayerMove, plan_moves
from lightning_dynpipe.plan.replicas import ReplicaSplit
from lightning_dynpipe.repartition.controller import AdaptiveController
from lightning_dynpipe.repartition.inflight import DepthDecision, DepthInputs, InFlightPolicy
from lightning_dynpipe.repartition.ladder import EscalationLadder, LadderDecision, ReplicaWindow
from lightning_dynpipe.repartition.policy import (
    Decision,
    GainOverCostPolicy,
    PolicyInputs,
    PricedPartition,
    RepartitionPolicy,
)

__all__ = [
    "AdaptiveController",
    "DepthDecision",
    "DepthInputs",
    "InFlightPolicy",
    "EscalationLadder",
    "LadderDecision",
    "ReplicaSplit",
    "ReplicaWindow",
    "Decision",
    "GainOverCostPolicy",
    "PolicyInputs",
    "PricedPartition",
    "RepartitionPolicy",
    "LayerMove",
    "plan_moves",
]
