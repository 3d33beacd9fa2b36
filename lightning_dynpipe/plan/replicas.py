"""Intra-stage balance: how a global batch is split across a pipeline's data-parallel replicas. Pure.

With ``D`` pipeline replicas, every replica reads the same global batch of ``n`` samples and trains on its
share of it: replica ``d`` takes the samples ``offsets[d] : offsets[d] + shares[d]``. The shares follow the
replicas' weights (their speeds), every share holds at least ``min_share`` samples (one per micro-batch), and
they add up to ``n``, so the union of the shares is the global batch whatever the weights are.

Example::

    >>> split = ReplicaSplit((3.0, 1.0))
    >>> split.shares(32, min_share=4)
    (24, 8)
    >>> split.offsets(32, min_share=4)
    (0, 24)
    >>> ReplicaSplit.even(2).shares(7, min_share=2)
    (4, 3)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_dynpipe.errors import ConfigurationError

__all__ = ["ReplicaSplit", "split_shares", "speed_weights"]


def split_shares(batch_size: int, weights: Sequence[float], min_share: int = 1) -> tuple[int, ...]:
    """Integer shares of ``batch_size`` samples in proportion to ``weights``, each at least ``min_share``.

    The rule: a replica whose proportional share would be below ``min_share`` gets ``min_share``, and the rest
    of the batch is shared among the others in proportion to their weights (repeated until no share is below
    the minimum); each of those gets the floor of its share, and the samples left over go one each to the
    largest fractional parts (ties to the lower replica index, so every rank computes the same shares).
    Every share above the minimum is then within one sample of its proportional share.

    Raises:
        ConfigurationError: a weight is not positive and finite, or ``batch_size < len(weights) * min_share``.
    """
    if not weights:
        raise ConfigurationError("A replica split needs one weight per replica; got none.")
    if any(not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0) for w in weights):
        raise ConfigurationError(
            f"Replica weights must be positive finite numbers (relative speeds); got {list(weights)}. Give every "
            "replica a weight > 0, e.g. [3, 1] for a replica three times as fast as the other."
        )
    D = len(weights)
    if batch_size < D * min_share:
        raise ConfigurationError(
            f"A global batch of {batch_size} samples cannot be split across {D} replicas with at least "
            f"{min_share} samples each (one per micro-batch): it needs {D * min_share}. Use a batch size >= "
            f"{D * min_share} (drop_last=True drops a short last batch), or lower num_microbatches."
        )
    fixed: set[int] = set()
    while True:
        free = [d for d in range(D) if d not in fixed]
        rest = batch_size - min_share * len(fixed)
        total = float(sum(weights[d] for d in free))
        ideal = {d: rest * weights[d] / total for d in free}
        low = [d for d in free if ideal[d] < min_share]
        if not low:
            break
        fixed.update(low)
    shares = [min_share] * D
    for d in free:
        shares[d] = math.floor(ideal[d])
    left = rest - sum(shares[d] for d in free)
    for d in sorted(free, key=lambda i: (-(ideal[i] - math.floor(ideal[i])), i))[:left]:
        shares[d] += 1
    return tuple(shares)


def speed_weights(samples: Sequence[float], compute_s: Sequence[float]) -> tuple[float, ...]:
    """Relative speeds (samples per second, normalised to sum 1) from each replica's samples and compute time.

    ``samples[d]`` samples took ``compute_s[d]`` seconds of compute on replica ``d`` (the slowest stage of the
    replica: it sets the replica's pace). A replica's speed is ``samples / compute_s``.
    """
    if len(samples) != len(compute_s) or not samples:
        raise ConfigurationError(
            f"speed_weights needs one sample count and one compute time per replica; got {len(samples)} and "
            f"{len(compute_s)}."
        )
    bad = [d for d, (n, t) in enumerate(zip(samples, compute_s)) if not (n > 0 and t > 0 and math.isfinite(t))]
    if bad:
        raise ConfigurationError(
            f"Replicas {bad} have no usable measurement (samples {list(samples)}, compute seconds "
            f"{list(compute_s)}): a speed needs samples > 0 and a positive, finite compute time."
        )
    speeds = [n / t for n, t in zip(samples, compute_s)]
    total = sum(speeds)
    return tuple(s / total for s in speeds)


@dataclass(frozen=True)
class ReplicaSplit:
    """The relative weights of a stage's replicas; every stage of a replica gets the same share.

    Attributes:
        weights: one positive weight per pipeline replica (its relative speed); normalised to sum 1.
    """

    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        split_shares(len(self.weights), self.weights, 1)  # validates the weights
        total = float(sum(self.weights))
        object.__setattr__(self, "weights", tuple(float(w) / total for w in self.weights))

    @classmethod
    def even(cls, num_replicas: int) -> ReplicaSplit:
        """Equal weights: the split of a plain data-parallel run."""
        if num_replicas < 1:
            raise ConfigurationError(f"A replica split needs at least one replica; got {num_replicas}.")
        return cls((1.0,) * num_replicas)

    @property
    def num_replicas(self) -> int:
        """``D``."""
        return len(self.weights)

    @property
    def is_even(self) -> bool:
        """Whether all weights are equal."""
        return max(self.weights) - min(self.weights) <= 1e-12

    def shares(self, batch_size: int, min_share: int = 1) -> tuple[int, ...]:
        """Samples of a global batch of ``batch_size`` each replica trains on (:func:`split_shares`)."""
        return split_shares(batch_size, self.weights, min_share)

    def offsets(self, batch_size: int, min_share: int = 1) -> tuple[int, ...]:
        """Where each replica's share starts in the global batch."""
        out, at = [], 0
        for s in self.shares(batch_size, min_share):
            out.append(at)
            at += s
        return tuple(out)

    def differs(self, other: ReplicaSplit, tolerance: float) -> bool:
        """Whether some replica's weight differs by more than ``tolerance`` (a fraction of the global batch)."""
        if other.num_replicas != self.num_replicas:
            return True
        return any(abs(a - b) > tolerance for a, b in zip(self.weights, other.weights))

    def __str__(self) -> str:
        return ":".join(f"{w:.3f}" for w in self.weights)
