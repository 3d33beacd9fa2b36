"""The escalation ladder: from the cheapest response to interference to the costliest. Pure.

At every monitor check the ladder looks at each replica's measured speed and climbs only as far as it must:

1. **ignore**: an imbalance seen in fewer than ``patience`` consecutive checks is taken to be short (a
   spike) and left alone. Persistence is the prediction of how long interference lasts, weighed by its visible
   cause on the replica that would give up samples, beyond what the other replicas show: a CPU limit, another
   process on its cores, waits for a core, a throttled GPU last, so the ladder acts after
   ``explained_patience`` checks; with none of them (a noisy neighbour outside this machine's view, a passing
   hiccup) the imbalance must persist for ``unexplained_patience`` checks;
2. **resplit**: one replica is slower than the others (interference on its devices): split each global batch
   across the replicas in proportion to their speeds. No drain, no transfer: it takes effect at the next step;
3. **move_layers**: the replicas are balanced but a stage of every replica is slow: that is inter-stage
   imbalance, which only moving layers fixes; the :class:`~lightning_dynpipe.repartition.controller.
   AdaptiveController` (and its policy) decides whether the move pays;
4. **change_stages**: the planner's best plan under the measured slowdowns has another number of stages; a
   live migration cannot change ``S``, so the ladder says so, and where the user opts in
   (``DynPipeStrategy(change_stages="restart")``) the strategy checkpoints, ends the fit and
   :func:`~lightning_dynpipe.fit_with_restarts` continues from the partition-independent checkpoint under that
   number of stages.

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
        update_s: ``update_s[d][k]``: seconds per step of stage ``k``'s update on replica ``d``, the gradient
            all-reduce included (empty: not measured). The all-reduce ends at the same moment on every replica,
            so a replica that reached it early waits there longer: the difference to the stage's shortest update
            is that replica's slack, and it includes everything a replica does in a step, not only the compute
            the split moves.
        causes: per replica, the visible signs of interference on its processes beyond the other replicas'
            (:func:`~lightning_dynpipe.monitor.stats.interference_excess`; ``""``: none seen). Empty: not
            reported (no system readings), and the ladder waits ``patience`` checks.
        mean_step_s: the slowest replica's mean step time over the window without its slowest step (NaN: not
            measured). The outcome check compares it (:attr:`judged_step_s`): under a CPU quota step times are
            bimodal, and a median follows whichever kind of step is the majority.
    """

    step: int
    samples: tuple[float, ...]
    compute_s: tuple[tuple[float, ...], ...]
    split: ReplicaSplit
    step_s: float = math.nan
    update_s: tuple[tuple[float, ...], ...] = ()
    causes: tuple[str, ...] = ()
    mean_step_s: float = math.nan

    @property
    def judged_step_s(self) -> float:
        """The step time a re-split's outcome is judged by: :attr:`mean_step_s` where measured, else ``step_s``."""
        return self.mean_step_s if self.mean_step_s > 0 else self.step_s

    def __post_init__(self) -> None:
        D = len(self.samples)
        if D != len(self.compute_s) or D != self.split.num_replicas:
            raise ConfigurationError(
                f"A ReplicaWindow needs one entry per replica: samples for {D}, compute times for "
                f"{len(self.compute_s)}, a split of {self.split.num_replicas}."
            )
        if self.update_s and len(self.update_s) != D:
            raise ConfigurationError(f"A ReplicaWindow needs update times for {D} replicas; got {len(self.update_s)}.")
        if self.causes and len(self.causes) != D:
            raise ConfigurationError(f"A ReplicaWindow needs causes for {D} replicas; got {len(self.causes)}.")

    def replica_compute_s(self) -> tuple[float, ...]:
        """Per replica, the compute time of its slowest stage: the stage that sets the replica's pace."""
        return tuple(max(ks) for ks in self.compute_s)

    def replica_slack_s(self) -> tuple[float, ...] | None:
        """Per replica, how long it waited for the others at the gradient all-reduce (None: not measured).

        For each stage, a replica's update time minus the stage's shortest one over the replicas; a replica's
        slack is the smallest over its stages (the stage with the least room sets how much more it can take).
        """
        if not self.update_s or not (self.step_s > 0 and math.isfinite(self.step_s)):
            return None
        table = self.update_s
        if any(not math.isfinite(u) for row in table for u in row):
            return None
        stages = range(len(table[0]))
        shortest = [min(row[k] for row in table) for k in stages]
        return tuple(max(0.0, min(row[k] - shortest[k] for k in stages)) for row in table)


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
        patience: consecutive checks an imbalance must be seen in before the ladder acts on it, when the window
            does not say what the replicas' processes saw (:attr:`ReplicaWindow.causes` empty: no system
            readings). Once it has acted, an imbalance that persists (the split is not yet right: a replica's
            time is not proportional to its share when it has a fixed cost per step) is re-split at every check
            until the replicas are balanced.
        explained_patience: the same when the replica that would give up samples shows a sign of interference
            that lasts (a CPU quota, a co-located process, waits for a core): acting at the first check saves a
            whole window at the old split.
        unexplained_patience: the same when that replica shows no sign of interference. Two checks of the
            monitor's default windows (20 steps, every 10) share half their steps, so a one-second slowdown of
            one core, which a shared machine has without any job of its own on it, filled two of them in a row.
        min_change: ignore a new split whose weights differ from the current ones by less than this (a fraction
            of the global batch): measurement noise must not move samples back and forth.
        rollback_tolerance: the outcome check rolls a re-split back only when the step measured under it is
            slower than before by more than this fraction (a window's median step moves by a few percent on a
            shared machine; a re-split rolled back on noise would hold the split away from a better one).
        hold_checks: a rolled-back direction is held for this many checks, then tried again (0: for the rest of
            the fit). One window's median step is a noisy judge under a CPU quota (5-10% from window to window
            here): a hold that lasted for ever would keep a split that one unlucky window condemned.
        probe: once the replicas reach the all-reduce together, move this fraction of the global batch further
            from the slowest replica to the fastest and keep it if the measured step got shorter (0: never).
            Equal arrival is not always the shortest step: a throttled replica that arrives with its CPU budget
            spent also slows the all-reduce and the update that follow it.
        probe_min_speed_ratio: probe only when the fastest replica computes a sample at least this many times
            faster than the slowest (interference, not a noisy machine).
        probe_growth: after a kept probe the next one moves this many times as much of the batch (a line search
            that expands while it pays; a rolled-back probe starts again from ``probe``; 1: fixed-size probes).
            A small step near the best split gains less than a window's noise, so fixed-size probes stall short of
            it; a larger one is judged on a larger difference.

    **Where the split goes.** With the replicas' update times in the window (the strategy supplies them), the
    target is the split at which every replica reaches the gradient all-reduce at the same moment: a replica's
    wait there is the work it has room for, fixed costs included (under a CPU quota a throttled replica also
    stalls in its per-step work outside its share: reading the global batch, the framework's hooks), and the
    move is sized by the measured cost per sample, so it falls short rather than overshoots and the next check
    refines it. Without update times, shares follow the speeds (compute per sample). From the balanced split the
    ladder probes further (``probe``) while the measured step keeps getting shorter.

    **Outcome check.** The first check after a re-split compares the measured step time with the one before it;
    a re-split under which the step got slower (by more than ``rollback_tolerance``) is rolled back, and from
    that split the ladder moves no further in the same direction (it moves again when the target turns the
    other way, e.g. when the interference ends).
    """

    min_gain: float = 0.10
    patience: int = 2
    explained_patience: int = 1
    unexplained_patience: int = 4
    min_change: float = 0.02
    rollback_tolerance: float = 0.05
    hold_checks: int = 5
    probe: float = 0.05
    probe_min_speed_ratio: float = 1.5
    probe_growth: float = 2.0
    decisions: list[LadderDecision] = field(default_factory=list, init=False, repr=False)
    _streak: int = field(default=0, init=False, repr=False)
    _last: tuple[ReplicaSplit, ReplicaSplit, float, bool] | None = field(default=None, init=False, repr=False)
    _hold: tuple[ReplicaSplit, tuple[float, ...]] | None = field(default=None, init=False, repr=False)
    _held_for: int = field(default=0, init=False, repr=False)
    _probed: tuple[float, ...] | None = field(default=None, init=False, repr=False)  # direction of kept probes
    _probe_size: float = field(default=0.0, init=False, repr=False)  # the next probe's move (0: ``probe``)

    def __post_init__(self) -> None:
        if (
            not (0 <= self.min_gain < 1)
            or self.patience < 1
            or self.explained_patience < 1
            or self.unexplained_patience < 1
            or not (0 <= self.min_change < 1)
            or not (0 <= self.rollback_tolerance < 1)
            or not (0 <= self.probe < 0.5)
            or self.probe_min_speed_ratio < 1
            or self.hold_checks < 0
            or not (math.isfinite(self.probe_growth) and self.probe_growth >= 1)
        ):
            raise ConfigurationError(
                f"EscalationLadder needs 0 <= min_gain < 1, patience, explained_patience and unexplained_patience "
                f">= 1, 0 <= min_change < 1 and 0 <= rollback_tolerance < 1, 0 <= probe < 0.5, probe_min_speed_ratio "
                f">= 1, hold_checks >= 0 and probe_growth >= 1; got probe_growth={self.probe_growth}, hold_checks="
                f"{self.hold_checks}, min_gain={self.min_gain}, patience={self.patience}, explained_patience="
                f"{self.explained_patience}, unexplained_patience={self.unexplained_patience}, min_change="
                f"{self.min_change}, rollback_tolerance="
                f"{self.rollback_tolerance}, probe={self.probe}, probe_min_speed_ratio={self.probe_min_speed_ratio}."
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
        judged_s = window.judged_step_s
        if last is not None and window.split == last[1] and math.isfinite(judged_s):
            old, new, before_s, probed = last
            # a move towards the target is kept unless it cost; a probe only if it paid
            limit_s = before_s if probed else before_s * (1.0 + self.rollback_tolerance)
            if judged_s > limit_s:  # back, and no further that way
                self._hold = (old, tuple(b - a for a, b in zip(old.weights, new.weights)))
                self._probe_size = 0.0
                self._held_for = 0
                self._streak = 0
                return self.record(
                    LadderDecision(
                        window.step,
                        "resplit",
                        f"roll back: {'probe ' if probed else ''}split {new} measured {judged_s * 1e3:.1f} "
                        f"ms/step, {'not faster' if probed else 'slower'} than {before_s * 1e3:.1f} ms/step under "
                        f"{old}; no further re-split that way from {old}",
                        split=old,
                    )
                )
            if probed:  # it paid: the arrival target must not pull the split back while the interference lasts
                self._probed = tuple(b - a for a, b in zip(old.weights, new.weights))
                self._probe_size = max(abs(m) for m in self._probed) * self.probe_growth
        if self._hold is not None and self.hold_checks:
            self._held_for += 1
            if self._held_for > self.hold_checks:
                self._hold = None  # try that direction again: the window that condemned it may have been unlucky
        per_sample = [t / n for t, n in zip(replica_s, window.samples)]
        if self._probed is not None and max(per_sample) < self.probe_min_speed_ratio * min(per_sample):
            self._probed = None  # the interference that the probes answered has gone
            self._probe_size = 0.0
        slack = window.replica_slack_s()
        if slack is None:
            target, now_s, then_s = _proportional(window.samples, replica_s)
        else:
            target, now_s, then_s = _balanced_arrival(window.samples, per_sample, slack, window.step_s)
        gain = 1.0 - then_s / now_s
        speeds = [round(1.0 / p) for p in per_sample]
        waits = "" if slack is None else f", waits at the all-reduce {[round(x * 1e3, 1) for x in slack]} ms"
        numbers = (
            f"replica samples/s {speeds}{waits}, split {window.split} -> {target}, predicted step "
            f"{now_s * 1e3:.1f} -> {then_s * 1e3:.1f} ms ({gain:+.0%})"
        )
        if not target.differs(window.split, self.min_change) or gain < self.min_gain:
            self._streak = 0
            probe = self._probe(window, per_sample) if slack is not None else None
            if probe is not None:
                self._last = (window.split, probe, judged_s, True)
                return self.record(
                    LadderDecision(
                        window.step,
                        "resplit",
                        f"probe: the replicas reach the all-reduce together at {window.split}; trying {probe}, kept "
                        f"if the step measures shorter than {judged_s * 1e3:.1f} ms: {numbers}",
                        split=probe,
                    )
                )
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
        if self._probed is not None:
            move = [b - a for a, b in zip(window.split.weights, target.weights)]
            if sum(m * h for m, h in zip(move, self._probed)) < 0:
                self._streak = 0
                return self.record(
                    LadderDecision(
                        window.step,
                        "keep",
                        f"held: probes to {window.split} measured shorter steps than equal arrival at the "
                        f"all-reduce, and the replicas' speeds still differ: {numbers}",
                    )
                )
        self._streak += 1  # not reset by a re-split: a persisting imbalance is refined at the next check
        giver = min(range(len(target.weights)), key=lambda d: target.weights[d] - window.split.weights[d])
        patience, cause = self.patience, ""
        if window.causes:
            sign = window.causes[giver]
            if sign:
                patience, cause = self.explained_patience, f"; replica {giver}: {sign}"
            else:
                patience, cause = self.unexplained_patience, f"; no sign of interference on replica {giver}"
        if self._streak < patience:
            return self.record(
                LadderDecision(
                    window.step,
                    "ignore",
                    f"replica imbalance seen in {self._streak} of {patience} checks in a row, taken to be short: "
                    f"{numbers}{cause}",
                )
            )
        if math.isfinite(judged_s):
            self._last = (window.split, target, judged_s, False)
        return self.record(
            LadderDecision(
                window.step, "resplit", f"one replica is slower than the others: {numbers}{cause}", split=target
            )
        )

    def _probe(self, window: ReplicaWindow, per_sample: Sequence[float]) -> ReplicaSplit | None:
        """The split ``probe`` further from the slowest replica to the fastest, or None (no interference to speak
        of or none visible on the slow replica, a replica would be left with no sample, or a hold forbids that
        direction)."""
        if self.probe <= 0:
            return None
        slow = max(range(len(per_sample)), key=lambda d: per_sample[d])
        fast = min(range(len(per_sample)), key=lambda d: per_sample[d])
        if per_sample[slow] < self.probe_min_speed_ratio * per_sample[fast]:
            return None
        if window.causes and not window.causes[slow]:
            return None  # the slow replica shows no sign of interference: nothing to probe for
        weights = list(window.split.weights)
        size = max(self._probe_size, self.probe)
        while (weights[slow] - size) * sum(window.samples) < 1.0:  # leave the slow replica a sample at least
            size /= 2.0
            if size < self.probe:
                return None
        weights[slow] -= size
        weights[fast] += size
        if self._hold is not None and window.split == self._hold[0]:
            move = [b - a for a, b in zip(window.split.weights, weights)]
            if sum(m * h for m, h in zip(move, self._hold[1])) > 0:
                return None
        return ReplicaSplit(tuple(weights))

    def reset(self) -> None:
        """Forgets the decisions and the patience count (a new fit starts from scratch)."""
        self.decisions.clear()
        self._streak = 0
        self._last = self._hold = None
        self._probed = None
        self._probe_size = 0.0

    def record(self, decision: LadderDecision) -> LadderDecision:
        """Keeps ``decision`` (also those of rungs 3 and 4 the caller took) and returns it."""
        self.decisions.append(decision)
        return decision

    @staticmethod
    def stage_count_decision(
        step: int, current_stages: int, best_stages: int, detail: str, restart: bool = False
    ) -> LadderDecision:
        """Rung 4, when the planner's best plan has ``best_stages != current_stages`` (``restart``: the strategy
        is restarting under it, ``DynPipeStrategy(change_stages="restart")``)."""
        what = (
            f"ending the fit to continue with num_stages={best_stages}"
            if restart
            else f"restart from the checkpoint with num_stages={best_stages} to use it"
        )
        return LadderDecision(
            step,
            "change_stages",
            f"the best plan under the measured slowdowns has {best_stages} stages, the pipeline runs "
            f"{current_stages}; a live migration keeps the number of stages, so {what} ({detail})",
            num_stages=best_stages,
        )


def _proportional(samples: Sequence[float], compute_s: Sequence[float]) -> tuple[ReplicaSplit, float, float]:
    """Without update times: shares in proportion to the speeds, each replica's time taken as proportional to
    its share. Returns the target and the predicted slowest-replica compute now and under the target."""
    target = ReplicaSplit(speed_weights(samples, compute_s))
    total = sum(samples)
    then_s = max(total * w * t / n for w, t, n in zip(target.weights, compute_s, samples))
    return target, max(compute_s), then_s


def _balanced_arrival(
    samples: Sequence[float], per_sample: Sequence[float], slack_s: Sequence[float], step_s: float
) -> tuple[ReplicaSplit, float, float]:
    """With the replicas' waits at the all-reduce: the split at which every replica reaches it at once.

    A replica's work per step is ``need_d = step_s - slack_d``: everything it did, its fixed costs included
    (reading the batch, the framework's per-step work, a quota's stalls in them), which a proportional model
    leaves out. Moving one sample changes ``need_d`` by ``per_sample[d]`` (forward + backward over samples: at
    least the marginal cost, so the move falls short rather than overshoots; the next check refines it). The
    target equalises ``need_d + per_sample[d] * (n'_d - n_d)`` over the replicas with ``sum n' = sum n``; a
    replica keeps at least one sample. Returns the target and the predicted step now and under it.
    """
    need = [step_s - w for w in slack_s]
    active = list(range(len(samples)))
    new = list(samples)
    total = float(sum(samples))
    while True:  # water-filling: a replica whose share would drop below one sample is held at one
        fixed = sum(1.0 for d in range(len(samples)) if d not in active)
        level = (total - fixed + sum(need[d] / per_sample[d] - samples[d] for d in active)) / sum(
            1.0 / per_sample[d] for d in active
        )
        for d in active:
            new[d] = samples[d] + (level - need[d]) / per_sample[d]
        low = [d for d in active if new[d] < 1.0]
        if not low:
            break
        for d in low:
            new[d] = 1.0
            active.remove(d)
    then_need = max(need[d] + per_sample[d] * (new[d] - samples[d]) for d in range(len(samples)))
    shared = step_s - max(need)  # the all-reduce's own time and the update: no split changes them
    return ReplicaSplit(tuple(n / total for n in new)), step_s, then_need + shared


def replica_window(
    step: int,
    samples: Sequence[float],
    compute_s_by_rank: Sequence[tuple[int, int, float]],
    split: ReplicaSplit,
    num_stages: int,
    step_s: float = math.nan,
    update_s_by_rank: Sequence[tuple[int, int, float]] = (),
    causes_by_rank: Sequence[tuple[int, int, str]] = (),
    mean_step_s: float = math.nan,
) -> ReplicaWindow:
    """A :class:`ReplicaWindow` from ``(dp_rank, stage_idx, seconds)`` triples (one per process): the compute
    times and, optionally, the update times (the gradient all-reduce included) and each process's signs of
    interference (a replica's causes: those of its stages, joined)."""
    D = split.num_replicas
    causes: tuple[str, ...] = ()
    if causes_by_rank:
        per: list[list[str]] = [[] for _ in range(D)]
        for d, k, sign in sorted(causes_by_rank):
            if sign:
                per[d].append(f"stage {k}: {sign}" if num_stages > 1 else sign)
        causes = tuple("; ".join(p) for p in per)

    def table(triples: Sequence[tuple[int, int, float]]) -> tuple[tuple[float, ...], ...]:
        rows = [[math.nan] * num_stages for _ in range(D)]
        for d, k, t in triples:
            rows[d][k] = t
        return tuple(tuple(r) for r in rows)

    updates = table(update_s_by_rank) if update_s_by_rank else ()
    return ReplicaWindow(
        step, tuple(float(n) for n in samples), table(compute_s_by_rank), split, step_s, updates, causes, mean_step_s
    )
