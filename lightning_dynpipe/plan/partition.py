"""The partition: which contiguous range of layers each pipeline stage owns.

A :class:`Partition` is plain, immutable data. The planner produces it, the engine consumes it, and a
repartition replaces it; nothing in here touches torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_dynpipe.errors import PartitionError

__all__ = ["Partition", "balance_by_weights"]


@dataclass(frozen=True)
class Partition:
    """Layers per stage of one pipeline, plus the number of data-parallel replicas of each stage.

    Example::

        >>> p = Partition.from_balance([3, 2])
        >>> p.stage_layers(1)
        range(3, 5)
        >>> str(p)
        '[3, 2]'

    Attributes:
        balance: number of consecutive layers owned by each stage, stage 0 first.
        replicas: data-parallel width of each stage (all 1 for a single pipeline).
    """

    balance: tuple[int, ...]
    replicas: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.balance:
            raise PartitionError("A partition needs at least one stage; got balance=[]. Pass e.g. balance=[2, 2].")
        bad = [b for b in self.balance if not isinstance(b, int) or b < 1]
        if bad:
            raise PartitionError(
                f"Every stage must own at least one layer; got balance={list(self.balance)}. "
                "Remove the zero entries or use fewer stages."
            )
        if not self.replicas:
            object.__setattr__(self, "replicas", (1,) * len(self.balance))
        if len(self.replicas) != len(self.balance) or any(r < 1 for r in self.replicas):
            raise PartitionError(
                f"replicas must give a positive width for each of the {len(self.balance)} stages; "
                f"got replicas={list(self.replicas)}."
            )

    @classmethod
    def from_balance(cls, balance: Sequence[int], num_layers: int | None = None) -> Partition:
        """Builds a partition from layers-per-stage, checking it against ``num_layers`` when given."""
        part = cls(tuple(int(b) for b in balance))
        if num_layers is not None and part.num_layers != num_layers:
            raise PartitionError(
                f"balance must sum to the number of layers in the pipeline: sum({list(part.balance)}) = "
                f"{part.num_layers}, but the pipeline has {num_layers} layers. Fix the balance or leave it unset."
            )
        return part

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages ``S``."""
        return len(self.balance)

    @property
    def num_layers(self) -> int:
        """Total number of layers over all stages."""
        return sum(self.balance)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """Index of the first layer of each stage, plus the total layer count at the end."""
        out = [0]
        for b in self.balance:
            out.append(out[-1] + b)
        return tuple(out)

    def stage_layers(self, stage_idx: int) -> range:
        """The ``layer_idx`` values owned by stage ``stage_idx``."""
        if not 0 <= stage_idx < self.num_stages:
            raise PartitionError(f"stage_idx must be in [0, {self.num_stages}); got {stage_idx}.")
        b = self.boundaries
        return range(b[stage_idx], b[stage_idx + 1])

    def stage_of_layer(self, layer_idx: int) -> int:
        """The stage that owns ``layer_idx``."""
        b = self.boundaries
        if not 0 <= layer_idx < b[-1]:
            raise PartitionError(f"layer_idx must be in [0, {b[-1]}); got {layer_idx}.")
        for k in range(self.num_stages):
            if layer_idx < b[k + 1]:
                return k
        raise AssertionError("unreachable")  # pragma: no cover

    def __str__(self) -> str:
        return str(list(self.balance))


def balance_by_weights(weights: Sequence[float], num_stages: int) -> Partition:
    """Splits layers into ``num_stages`` contiguous ranges minimising the heaviest stage's total weight.

    Used with parameter counts as weights until the planner chooses the partition. Exact: a binary search
    over the bottleneck value with a greedy feasibility check, ties broken towards earlier stages.

    Args:
        weights: a non-negative cost per layer (e.g. its parameter count).
        num_stages: number of stages; at most ``len(weights)``.
    """
    n = len(weights)
    if num_stages < 1:
        raise PartitionError(f"num_stages must be at least 1; got {num_stages}.")
    if num_stages > n:
        raise PartitionError(
            f"Cannot split {n} layers into {num_stages} stages: every stage needs at least one layer. "
            f"Use num_stages <= {n} or split the model into more layers."
        )
    w = [max(0.0, float(x)) + 1e-9 for x in weights]  # epsilon: an empty-cost layer still counts a little

    def stages_needed(cap: float) -> list[int] | None:
        # Greedy from the left while leaving at least one layer for each remaining stage.
        balance: list[int] = []
        i = 0
        for k in range(num_stages):
            remaining_stages = num_stages - k - 1
            total, j = 0.0, i
            while j < n - remaining_stages and (j == i or total + w[j] <= cap):
                if total + w[j] > cap and j > i:
                    break
                total += w[j]
                j += 1
            if total > cap:
                return None
            balance.append(j - i)
            i = j
        return balance if i == n else None

    lo, hi = max(w), sum(w)
    best = stages_needed(hi)
    for _ in range(100):
        mid = (lo + hi) / 2
        cand = stages_needed(mid)
        if cand is not None:
            best, hi = cand, mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * max(1.0, hi):
            break
    assert best is not None
    return Partition(tuple(best))
