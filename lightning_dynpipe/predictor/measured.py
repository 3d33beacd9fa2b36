"""The baseline predictor: each stage's slowdown measured against its profile, carried over to any partition.

A stage's slowdown is its measured compute over what the set-up profile predicts for its layers, relative to
the least slowed stage (so a uniformly slower machine does not look like interference). A stage whose process
runs under a cgroup CPU limit of ``q < 1`` core is at least ``1/q`` slowed, whatever its compute looked like:
under a quota the measured stretch shrinks as the stage's share of the work shrinks (the throttling lands in
its waits too), which hid the better partition. The slowdown belongs to the stage (its device and what runs
beside it), so a candidate partition's stage ``k`` is predicted as its layers' profile times stage ``k``'s
slowdown, and a boundary's message as the link model's time for the activation that crosses it.

It has no spread model: its intervals are points.
"""

from __future__ import annotations

from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor.base import Interval, PartitionPrediction, PipelineWindow, StageTimes

__all__ = ["MeasuredSlowdownPredictor", "measured_slowdowns"]


def measured_slowdowns(
    model_cost: ModelCost, partition: Partition, times: list[StageTimes] | tuple[StageTimes, ...], num_microbatches: int
) -> tuple[float, ...]:
    """Each stage's measured compute over the profile's prediction, relative to the least slowed stage.

    A stage under a CPU limit of ``q < 1`` core (``StageTimes.cpu_limit``) counts as at least ``1/q`` slowed.

    Example::

        >>> cost = ModelCost.from_arrays([1.0] * 4, [2.0] * 4)
        >>> measured_slowdowns(cost, Partition((2, 2)), [StageTimes(12.0, 0), StageTimes(48.0, 0)], 2)
        (1.0, 4.0)
        >>> limited = [StageTimes(12.0, 0), StageTimes(18.0, 0, cpu_limit=0.25)]
        >>> measured_slowdowns(cost, Partition((2, 2)), limited, 2)
        (1.0, 4.0)
    """
    ratios = []
    for k, t in enumerate(times):
        expected = num_microbatches * sum(model_cost.layers[i].compute_s for i in partition.stage_layers(k))
        ratios.append(t.compute_s / expected if expected > 0 and t.compute_s > 0 else 1.0)
    base = min(ratios)
    return tuple(
        max(r / base, 1.0 / t.cpu_limit if t.cpu_limit is not None and 0 < t.cpu_limit < 1 else 1.0)
        for r, t in zip(ratios, times)
    )


class MeasuredSlowdownPredictor:
    """The :class:`~lightning_dynpipe.predictor.base.InterferencePredictor` of measured per-stage slowdowns.

    Example::

        >>> cost = ModelCost.from_arrays([1.0] * 4, [2.0] * 4)
        >>> window = PipelineWindow(Partition((2, 2)), (StageTimes(12.0, 30.0), StageTimes(48.0, 50.0)), 2)
        >>> p = MeasuredSlowdownPredictor().predict(cost, CommModel(), window, Partition((3, 1)))
        >>> p.slowdowns, [i.value for i in p.stage_compute_s]
        ((1.0, 4.0), [9.0, 12.0])
    """

    def predict(
        self, model_cost: ModelCost, comm: CommModel, window: PipelineWindow, candidate: Partition
    ) -> PartitionPrediction:
        """See the module docstring."""
        slowdowns = measured_slowdowns(model_cost, window.partition, window.stages, window.num_microbatches)
        compute = tuple(
            Interval.point(slowdowns[k] * sum(model_cost.layers[i].compute_s for i in candidate.stage_layers(k)))
            for k in range(candidate.num_stages)
        )
        boundaries = []
        for k in range(candidate.num_stages - 1):
            last = candidate.stage_layers(k)[-1]
            boundaries.append(Interval.point(float(comm.transfer_time(model_cost.layers[last].activation_bytes))))
        return PartitionPrediction(candidate, slowdowns, compute, tuple(boundaries))
