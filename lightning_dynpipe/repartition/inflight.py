"""When to change how many micro-batches are in flight: a pure decision rule for the adaptive loop's depth.

Under ``async`` a round trip through stages ``a..b`` carries ``b-a+1`` micro-batches; on a slow link (latency,
jitter) the stages wait for it. ``async+d`` keeps ``d`` more in flight per boundary, which hides the link at the
price of ``d`` more updates of staleness on every stage but the last
(:class:`~lightning_dynpipe.schedule.AsyncSchedule`). Whether that pays is a question of time to accuracy, not of
step time: the planner's convergence model charges the deeper staleness, so the answer is only as good as its
``beta``. The strategy therefore lets the adaptive loop choose the depth only when the user gives a convergence
model (``DynPipeStrategy(max_extra_in_flight=d, convergence=...)``).

:class:`InFlightPolicy` gets, at a check where the partition stays, the predicted time to accuracy per step of
the current depth and of the best other depth on the current partition, and decides as
:class:`~lightning_dynpipe.repartition.GainOverCostPolicy` does for a partition: the lower end of the gain over a
horizon must pay ``margin`` times the change's cost (a drain, about one step), be at least ``min_relative_gain`` of
the step, persist ``patience`` checks (``explained_patience`` with a visible cause, such as a link measured slower
than the set-up probe), and wait ``cooldown_steps`` after any change of partition or depth.

**The waits bound the saving.** More micro-batches in flight save only time that every stage spends blocked until
a neighbour's message is there: a stage that is busy for the whole step (its layers, or framework time per
micro-batch that the profile does not hold, as on a small model) keeps the pace whatever the depth. So the policy
credits a deeper pipeline with its predicted saving per step (the predicted steps' relative difference, each without
its convergence factor, applied to the measured step) only up to the least time a stage waited per step for a
message (:attr:`~lightning_dynpipe.predictor.StageTimes.recv_wait_s`), and the rules above apply to that
(:func:`waits_bound`). Both sides are measured seconds, so the bound holds on a machine slower or faster than the
one the profile was taken on.

The first window after a change is its outcome: the measured step time weighted by each depth's convergence
factor; a change that made the pipeline slower to accuracy is undone, and that depth is refused for
``memory_steps`` steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.repartition.policy import _gain_refusal, _Streak
from lightning_dynpipe.schedule import Schedule

__all__ = ["DepthDecision", "DepthInputs", "InFlightPolicy", "waits_bound"]


@dataclass(frozen=True)
class DepthInputs:
    """What :class:`InFlightPolicy` sees at one check (identical on every rank).

    Attributes:
        step: the Lightning step (``global_step``).
        current: the running schedule.
        candidate: the schedule with the best predicted time to accuracy on the current partition.
        current_step_s: the current schedule's predicted seconds per step, weighted by its convergence factor.
        candidate_step_s: the same for ``candidate``.
        candidate_step_high_s: ``candidate``'s at the upper end of the predictor's intervals.
        measured_step_s: the window's measured seconds per step.
        convergence_factor: the convergence model's steps to accuracy for the current schedule, relative to none
            stale (what weighs the measured step in the outcome check).
        change_cost_s: what a change costs (a drain: the measured step).
        remaining_steps: steps left in the run (``None`` if unknown).
        causes: a visible, lasting cause of the slowdown (``""``: none; see
            :attr:`~lightning_dynpipe.repartition.PolicyInputs.causes`).
        details: the candidates' predicted times, for logs.
        candidate_convergence_factor: ``candidate``'s convergence factor (``None``: the same as the current's).
        waits_s: per stage, the time per step it was blocked until a neighbour's message was there, as measured
            over the window (``()``: not measured, and the saving is not bounded by them).
    """

    step: int
    current: Schedule
    candidate: Schedule
    current_step_s: float
    candidate_step_s: float
    candidate_step_high_s: float
    measured_step_s: float
    convergence_factor: float
    change_cost_s: float
    remaining_steps: int | None
    causes: str = ""
    details: str = ""
    candidate_convergence_factor: float | None = None
    waits_s: tuple[float, ...] = ()

    @property
    def measured_tta_step_s(self) -> float:
        """The measured step weighted by the convergence factor: time to accuracy per unstale step."""
        return self.measured_step_s * self.convergence_factor


@dataclass(frozen=True)
class DepthDecision:
    """The depth policy's answer, with its reason (logged at every check where the depth was considered)."""

    change: bool
    schedule: Schedule
    predicted_gain_s: float
    reason: str
    inputs: DepthInputs

    def __str__(self) -> str:
        i = self.inputs
        verb = f"reschedule {i.current.name} -> {self.schedule.name}" if self.change else f"keep {i.current.name}"
        details = f"; {i.details}" if i.details else ""
        return (
            f"step {i.step}: {verb} ({self.reason}; predicted time to accuracy per step {i.current_step_s * 1e3:.1f} "
            f"-> {i.candidate_step_s * 1e3:.1f} (up to {i.candidate_step_high_s * 1e3:.1f}) ms for "
            f"{i.candidate.name}, measured {i.measured_step_s * 1e3:.1f} ms x {i.convergence_factor:.3f}, predicted "
            f"gain (lower end) {self.predicted_gain_s:.2f} s vs change {i.change_cost_s:.2f} s{details})"
        )


@dataclass(frozen=True)
class _Change:
    old: Schedule
    new: Schedule
    before_tta_step_s: float


@dataclass
class InFlightPolicy:
    """Changes the number of micro-batches in flight when the predicted time to accuracy pays, persistently.

    Example::

        policy = InFlightPolicy(horizon_steps=200, margin=2.0, patience=2)
        decision = policy.decide(inputs)        # DepthInputs from the controller
        if decision.change:
            strategy.reschedule(decision.schedule)
            policy.changed(step)

    The rules are :class:`~lightning_dynpipe.repartition.GainOverCostPolicy`'s with a schedule for a partition (see
    the module docstring); the defaults are the same numbers.

    Args:
        horizon_steps: how far ahead the gain is counted.
        margin: how many times the change's cost the gain must be.
        min_relative_gain: ignore improvements smaller than this fraction of the step.
        patience: consecutive checks that must agree.
        explained_patience: the same with a visible cause; at most ``patience``.
        cooldown_steps: steps after any change (partition or depth) during which the depth stays.
        memory_steps: how long a depth that made the pipeline slower to accuracy is refused.
        bound_by_waits: credit a deeper pipeline with no more saving per step than the least time a stage waited
            for a message (see the module docstring); ``False``: the predicted saving as it is.
    """

    horizon_steps: int = 200
    margin: float = 2.0
    min_relative_gain: float = 0.10
    patience: int = 2
    explained_patience: int = 1
    cooldown_steps: int = 30
    memory_steps: int = 200
    bound_by_waits: bool = True
    _streak: _Streak = field(default_factory=_Streak, init=False, repr=False)
    _last_change: int | None = field(default=None, init=False, repr=False)
    _unjudged: _Change | None = field(default=None, init=False, repr=False)
    _refused: dict[Schedule, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if (
            self.horizon_steps < 1
            or self.margin < 0
            or self.patience < 1
            or not 1 <= self.explained_patience <= self.patience
            or self.cooldown_steps < 0
            or self.memory_steps < 0
            or not self.min_relative_gain >= 0
        ):
            raise ConfigurationError(
                f"InFlightPolicy needs horizon_steps >= 1, margin >= 0, min_relative_gain >= 0, patience >= 1, "
                f"1 <= explained_patience <= patience, cooldown_steps >= 0, memory_steps >= 0; "
                f"got {self.horizon_steps}, {self.margin}, {self.min_relative_gain}, {self.patience}, "
                f"{self.explained_patience}, {self.cooldown_steps}, {self.memory_steps}."
            )

    def decide(self, inputs: DepthInputs) -> DepthDecision:
        """See the class docstring."""
        horizon = max(
            0, self.horizon_steps if inputs.remaining_steps is None else min(self.horizon_steps, inputs.remaining_steps)
        )
        high, bound = self._bounded(inputs)
        saving = inputs.current_step_s - high
        gain = saving * horizon

        def no(reason: str, *, streak: bool = True) -> DepthDecision:
            if streak:
                self._streak.reset()
            return DepthDecision(False, inputs.current, gain, reason + bound, inputs)

        change, self._unjudged = self._unjudged, None
        if change is not None and inputs.current == change.new:
            after = inputs.measured_tta_step_s
            if after > change.before_tta_step_s:
                self._refused[change.new] = inputs.step
                loss = (after - change.before_tta_step_s) * horizon
                if loss > self.margin * inputs.change_cost_s:
                    self._streak.reset()
                    return DepthDecision(
                        True,
                        change.old,
                        loss,
                        f"roll back: {change.new.name} measured {inputs.measured_step_s * 1e3:.1f} ms/step x "
                        f"{inputs.convergence_factor:.3f}, slower to accuracy than {change.old.name}'s "
                        f"{change.before_tta_step_s * 1e3:.1f} ms/step (weighted) before the change",
                        inputs,
                    )
        self._refused = {s: t for s, t in self._refused.items() if inputs.step - t < self.memory_steps}
        if inputs.candidate == inputs.current:
            return no("the current depth is already the best")
        if inputs.candidate in self._refused:
            at = self._refused[inputs.candidate]
            return no(
                f"{inputs.candidate.name} made the pipeline slower to accuracy at step {at}; refused for "
                f"{self.memory_steps} steps after that"
            )
        if self._last_change is not None and inputs.step - self._last_change < self.cooldown_steps:
            since = inputs.step - self._last_change
            return no(f"cool-down: {since} < {self.cooldown_steps} steps since the last change")
        refusal = _gain_refusal(
            saving,
            inputs.current_step_s,
            horizon,
            inputs.change_cost_s,
            min_relative_gain=self.min_relative_gain,
            margin=self.margin,
            cost="change's cost",
        )
        if refusal is not None:
            return no(refusal)
        agreed = self._streak.agree(inputs.candidate)
        patience = self.explained_patience if inputs.causes else self.patience
        if agreed < patience:
            return no(f"waiting for {patience} checks in a row ({agreed} so far)", streak=False)
        self._streak.reset()
        self._unjudged = _Change(inputs.current, inputs.candidate, inputs.measured_tta_step_s)
        reason = "predicted gain in time to accuracy pays the change"
        if inputs.causes and patience < self.patience:
            reason += f" (after {patience} check{'s' if patience > 1 else ''}: {inputs.causes})"
        return DepthDecision(True, inputs.candidate, gain, reason + bound, inputs)

    def _bounded(self, inputs: DepthInputs) -> tuple[float, str]:
        """The candidate's upper step (weighted by its convergence factor) with the saving bounded by the stages'
        waits (:func:`waits_bound`), and a note for the reason where the bound binds (else ``""``)."""
        factor = inputs.convergence_factor
        cand_factor = inputs.candidate_convergence_factor or factor
        if not self.bound_by_waits or not inputs.waits_s or not factor > 0 or not cand_factor > 0:
            return inputs.candidate_step_high_s, ""
        current = inputs.current_step_s / factor
        raw = inputs.candidate_step_high_s / cand_factor
        bounded = waits_bound(current, raw, inputs.measured_step_s, inputs.waits_s)
        if bounded <= raw:
            return inputs.candidate_step_high_s, ""
        k = min(range(len(inputs.waits_s)), key=lambda i: inputs.waits_s[i])
        note = (
            f"; the saving bounded by the stages' waits: stage {k} waited {inputs.waits_s[k] * 1e3:.1f} ms per step "
            f"for a message, so {inputs.candidate.name} counts as {bounded * cand_factor * 1e3:.1f} ms/step "
            f"(weighted), not the predicted {inputs.candidate_step_high_s * 1e3:.1f}"
        )
        return bounded * cand_factor, note

    def changed(self, step: int) -> None:
        """Told when the partition or the depth changed (the cool-down starts)."""
        self._last_change = step

    def refuses(self, schedule: Schedule, step: int) -> bool:
        """Whether ``schedule`` is refused at ``step`` (it made the pipeline slower to accuracy within
        ``memory_steps``); the controller asks before it pairs a move with a depth."""
        at = self._refused.get(schedule)
        return at is not None and step - at < self.memory_steps

    def forget_change(self) -> None:
        """The change to judge is not judged (the partition moved before its first window)."""
        self._unjudged = None

    def reset(self) -> None:
        """Forgets everything learnt in a fit."""
        self._streak.reset()
        self._last_change = None
        self._unjudged = None
        self._refused = {}


def waits_bound(current_s: float, candidate_s: float, measured_step_s: float, waits_s: Sequence[float]) -> float:
    """``candidate_s`` with its saving over ``current_s`` bounded by the stages' waits: at least ``current_s`` less the
    share of the measured step that the least of ``waits_s`` (each stage's time per step blocked until a
    neighbour's message was there) makes up. Both predicted steps are without their convergence factors and in any
    one unit; without measured waits ``candidate_s`` as it is.

    Example (predicted 30 -> 21 ms, a 30% saving; the measured step 40 ms, and a stage waited 3 ms of it, 7.5%)::

        >>> round(waits_bound(0.030, 0.021, 0.040, (0.020, 0.003)), 5)
        0.02775
        >>> waits_bound(0.030, 0.021, 0.040, (0.020, 0.015))
        0.021
    """
    if not waits_s or not measured_step_s > 0:
        return candidate_s
    share = min(1.0, min(waits_s) / measured_step_s)
    return max(candidate_s, current_s * (1.0 - share))
