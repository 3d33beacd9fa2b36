"""The escalation ladder: from the cheapest response to interference to the costliest. Pure.

At every monitor check the ladder looks at each replica's measured speed and climbs only as far as it must:

1. **ignore**: an imbalance seen in fewer than ``patience`` consecutive checks is taken to be short (a
   spike) and left alone; nothing here predicts how long interference lasts, so persistence is the prediction;
2. **resplit**: one replica is slower than the others (interference on its devices): split each global batch
   across the replicas in proportion to their speeds. No drain, no transfer: it takes effect at the next step;
3. **move_layers**: the replicas are balanced but a stage of every replica is slow: that is inter-stage
   imbalance, which only moving layers fixes; the :class:`~lightning_dynpipe.repartition.controller.
   AdaptiveController` (and its policy) decides whether the move pays;
4. **change_stages**: the planner's best plan under the measured slowdowns has another number of stages; a
   live migration cannot change ``S``, so the ladder says so (a restart from the partition-independent
   checkpoint under that plan is the user's to make).

Every decision carries its rung and its reason, so a user can see why it acted or did not.

Example::

    ladder = EscalationLadder(min_gain=0.10, patience=2)
    d = ladder.decide(ReplicaWindow(step=40, samples=(16, 16), compute_s=((0.010,), (0.020,)),
                                    split=ReplicaSplit.even(2)))
    d.rung, d.reason        # 'ignore', 'seen in 1 of 2 checks ...' on the first check; 'resplit' on the next
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.replicas import ReplicaSplit, speed_weights

__all__ = ["Rung", "RUNGS", "ReplicaWindow", "LadderDecision", "EscalationLadder"]

Rung = Literal["keep", "ignore", "resplit", "move_layers", "change_stages"]
RUNGS: tuple[str, ...] = ("keep", "ignore", "resplit", "move_layers", "change_stages")


@dataclass(frozen=True)
class ReplicaWindow:
    """One check's per-replica measurements (identical on every rank: from the monitor's gather).

    Attributes:
        step: the Lightning step of the check.
        samples: samples per step each replica trained on in the window (its share of the global batch).
        compute_s: ``compute_s[d][k]``: seconds per step of stage ``k``'s layers on replica ``d``, forward and
            backward only (the update's all-reduce waits for the slowest replica: it would hide the imbalance).
        split: the replica split the window was measured under.
        step_s: the measured seconds per step (the slowest replica's median; NaN: unknown), for the outcome check.
    """

    step: int
    samples: tuple[float, ...]
    compute_s: tuple[tuple[float, ...], ...]
    split: ReplicaSplit
    step_s: float = math.nan

    def __post_init__(self) -> None:
        D = len(self.samples)
        if D != len(self.compute_s) or D != self.split.num_replicas:
            raise ConfigurationError(
                f"A ReplicaWindow needs one entry per replica: samples for {D}, compute times for "
                f"{len(self.compute_s)}, a split of {self.split.num_replicas}."
            )

    def replica_compute_s(self) -> tuple[float, ...]:
        """Per replica, the compute time of its slowest stage: the stage that sets the replica's pace."""
        return tuple(max(ks) for ks in self.compute_s)


@dataclass(frozen=True)
class LadderDecision:
    """The rung a check took, and why.

    Attributes:
        step: the check's step.
        rung: ``"keep"`` (nothing to do), ``"ignore"`` (predicted short), ``"resplit"``, ``"move_layers"`` or
            ``"change_stages"``.
        reason: why, with the numbers.
        split: the new replica split (``"resplit"`` only).
        num_stages: the number of stages the planner's best plan has (``"change_stages"`` only).
    """

    step: int
    rung: Rung
    reason: str
    split: ReplicaSplit | None = None
    num_stages: int | None = None

    def __str__(self) -> str:
        return f"step {self.step}: rung {self.rung}: {self.reason}"


@dataclass
class EscalationLadder:
    """Chooses the cheapest response to a measured imbalance (see the module docstring).

    Args:
        min_gain: act on a replica imbalance only when the re-split is predicted to shorten the step by at least
            this fraction (the predicted step is the slowest replica's share times its measured time per sample).
        patience: consecutive checks an imbalance must be seen in before the ladder acts on it. Once it has acted,
            an imbalance that persists (the split is not yet right: a replica's time is not proportional to its
            share when it has a fixed cost per step) is re-split at every check until the replicas are balanced.
        min_change: ignore a new split whose weights differ from the current ones by less than this (a fraction
            of the global batch): measurement noise must not move samples back and forth.

    **Outcome check.** The re-split assumes a replica's compute time is proportional to its share. Under a CPU
    quota it is not: a throttled replica also stalls for its per-step work outside its share (reading the global
    batch, the framework's hooks), so giving it fewer samples can stop paying. The first check after a re-split
    compares the measured step time with the one before it; a re-split that did not shorten the step is rolled
    back, and from that split the ladder moves no further in the same direction (it moves again when the target
    turns the other way, e.g. when the interference ends).
    """

    min_gain: float = 0.10
    patience: int = 2
    min_change: float = 0.02
    decisions: list[LadderDecision] = field(default_factory=list, init=False, repr=False)
    _streak: int = field(default=0, init=False, repr=False)
    _last: tuple[ReplicaSplit, ReplicaSplit, float] | None = field(default=None, init=False, repr=False)
    _hold: tuple[ReplicaSplit, tuple[float, ...]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (0 <= self.min_gain < 1) or self.patience < 1 or not (0 <= self.min_change < 1):
            raise ConfigurationError(
                f"EscalationLadder needs 0 <= min_gain < 1, patience >= 1 and 0 <= min_change < 1; got min_gain="
                f"{self.min_gain}, patience={self.patience}, min_change={self.min_change}."
            )

    def decide(self, window: ReplicaWindow) -> LadderDecision:
        """Rungs 1 and 2 (ignore, resplit), from the replicas' measured speeds.

        ``"keep"`` means the replicas are balanced for the split in use; the caller then asks the layer
        controller (rung 3) and the planner (rung 4), and records their answers with :meth:`record`.
        """
        replica_s = window.replica_compute_s()
        if any(not (t > 0 and math.isfinite(t)) for t in replica_s) or any(n <= 0 for n in window.samples):
            return self.record(
                LadderDecision(window.step, "keep", f"no usable measurement yet (compute seconds {list(replica_s)})")
            )
        last, self._last = self._last, None
        if last is not None and window.split == last[1] and math.isfinite(window.step_s):
            old, new, before_s = last
            if window.step_s >= before_s:  # the re-split did not pay: back, and no further that way
                self._hold = (old, tuple(b - a for a, b in zip(old.weights, new.weights)))
                self._streak = 0
                return self.record(
                    LadderDecision(
                        window.step,
                        "resplit",
                        f"roll back: split {new} measured {window.step_s * 1e3:.1f} ms/step, not faster than "
                        f"{before_s * 1e3:.1f} ms/step under {old}; no further re-split that way from {old}",
                        split=old,
                    )
                )
        per_sample = [t / n for t, n in zip(replica_s, window.samples)]
        target = ReplicaSplit(speed_weights(window.samples, replica_s))
        total = sum(window.samples)
        now_s = max(n * p for n, p in zip(window.samples, per_sample))
        then_s = max(total * w * p for w, p in zip(target.weights, per_sample))
        gain = 1.0 - then_s / now_s
        speeds = [round(1.0 / p) for p in per_sample]
        numbers = (
            f"replica samples/s {speeds}, split {window.split} -> {target}, predicted step "
            f"{now_s * 1e3:.1f} -> {then_s * 1e3:.1f} ms ({gain:+.0%})"
        )
        if not target.differs(window.split, self.min_change) or gain < self.min_gain:
            self._streak = 0
            return self.record(
                LadderDecision(
                    window.step,
                    "keep",
                    f"replicas balanced for the split in use (gain below {self.min_gain:.0%}): {numbers}",
                )
            )
        if self._hold is not None and window.split == self._hold[0]:
            move = [b - a for a, b in zip(window.split.weights, target.weights)]
            if sum(m * h for m, h in zip(move, self._hold[1])) > 0:
                self._streak = 0
                return self.record(
                    LadderDecision(
                        window.step,
                        "keep",
                        f"held: moving further that way from {window.split} did not shorten the step: {numbers}",
                    )
                )
            self._hold = None  # the target turned the other way: the interference changed
        self._streak += 1  # not reset by a re-split: a persisting imbalance is refined at the next check
        if self._streak < self.patience:
            return self.record(
                LadderDecision(
                    window.step,
                    "ignore",
                    f"replica imbalance seen in {self._streak} of {self.patience} checks in a row, taken to be short: "
                    f"{numbers}",
                )
            )
        if math.isfinite(window.step_s):
            self._last = (window.split, target, window.step_s)
        return self.record(
            LadderDecision(window.step, "resplit", f"one replica is slower than the others: {numbers}", split=target)
        )

    def reset(self) -> None:
        """Forgets the decisions and the patience count (a new fit starts from scratch)."""
        self.decisions.clear()
        self._streak = 0
        self._last = self._hold = None

    def record(self, decision: LadderDecision) -> LadderDecision:
        """Keeps ``decision`` (also those of rungs 3 and 4 the caller took) and returns it."""
        self.decisions.append(decision)
        return decision

    @staticmethod
    def stage_count_decision(step: int, current_stages: int, best_stages: int, detail: str) -> LadderDecision:
        """Rung 4, when the planner's best plan has ``best_stages != current_stages``."""
        return LadderDecision(
            step,
            "change_stages",
            f"the best plan under the measured slowdowns has {best_stages} stages, the pipeline runs "
            f"{current_stages}; a live migration keeps the number of stages, so restart from the checkpoint with "
            f"num_stages={best_stages} to use it ({detail})",
            num_stages=best_stages,
        )


def replica_window(
    step: int,
    samples: Sequence[float],
    compute_s_by_rank: Sequence[tuple[int, int, float]],
    split: ReplicaSplit,
    num_stages: int,
    step_s: float = math.nan,
) -> ReplicaWindow:
    """A :class:`ReplicaWindow` from ``(dp_rank, stage_idx, compute_s)`` triples (one per process)."""
    D = split.num_replicas
    table = [[math.nan] * num_stages for _ in range(D)]
    for d, k, t in compute_s_by_rank:
        table[d][k] = t
    return ReplicaWindow(step, tuple(float(n) for n in samples), tuple(tuple(r) for r in table), split, step_s)
