"""Two published trigger rules, re-implemented as :class:`~lightning_dynpipe.repartition.policy.RepartitionPolicy`
objects on our runtime, to compare detection against :class:`~lightning_dynpipe.repartition.policy.GainOverCostPolicy`.

Both rules only decide *when* to re-plan; *where* to go is the controller's candidate (the planner's best partition
under the predictor's times, as for every policy), and a triggered rule moves there whenever it differs from the
current partition, without weighing the gain against the migration cost (neither original does). They see what
every policy sees (:class:`~lightning_dynpipe.repartition.policy.PolicyInputs`), so they run unchanged in a real
fit (``DynPipeStrategy(adaptive=VarunaRule())``) and in a replay of monitor windows
(:mod:`lightning_dynpipe.repartition.replay`).

* :class:`VarunaRule` (after Varuna, Athlur et al., EuroSys 2022): a stage more than 15% slower than the median;
  by default the median *stage* (each stage's slowdown against the set-up profile of the layers it holds, so stages
  of unequal work compare), or, with ``reference="history"``, the stage's own median over its recent checks.
  Checked at every monitor window.
* :class:`DynPipeThresholdRule` (after the original DynPipe's public code): every 50 iterations, each stage's
  forward+backward time is compared with the one measured at the last re-plan; a change by 2x either way
  triggers re-planning. A condition present from the start is never a change, so it is never detected.

Example::

    from lightning_dynpipe import DynPipeStrategy
    from lightning_dynpipe.repartition.rules import DynPipeThresholdRule, VarunaRule

    DynPipeStrategy(adaptive=VarunaRule())                       # 15% over the median stage, every window
    DynPipeStrategy(adaptive=DynPipeThresholdRule(factor=2.0, check_every_steps=50))

Pure: no torch, no Lightning.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.repartition.policy import Decision, PolicyInputs

__all__ = ["VarunaRule", "DynPipeThresholdRule"]


def _gain(inputs: PolicyInputs) -> float:
    """The lower end of the predicted saving over the remaining steps (0 when they are unknown); for the log only."""
    remaining = inputs.remaining_steps if inputs.remaining_steps is not None else 0
    return (inputs.current_step_s - inputs.candidate_step_upper_s) * max(remaining, 0)


def _act(inputs: PolicyInputs, why: str) -> Decision:
    """A triggered rule: move to the controller's candidate unless it is the current partition."""
    if inputs.candidate == inputs.current:
        return Decision(False, inputs.current, _gain(inputs), f"{why}; the planner keeps {inputs.current}", inputs)
    return Decision(True, inputs.candidate, _gain(inputs), f"{why}; re-planned", inputs)


@dataclass
class VarunaRule:
    """Re-plan when a stage is more than ``threshold`` slower than its median (Varuna's straggler rule).

    Example::

        >>> from lightning_dynpipe.plan.partition import Partition
        >>> rule = VarunaRule()
        >>> p, q = Partition((4, 4)), Partition((5, 3))
        >>> def check(step, slowdowns):
        ...     i = PolicyInputs(step, p, q, 0.1, 0.08, 0.1, 0.01, 100, slowdowns)
        ...     return rule.decide(i).repartition
        >>> check(10, (1.0, 1.3)), check(20, (1.0, 1.4))    # the median of two stages is their mean
        (False, True)

    Args:
        threshold: how much slower than the median a stage must be (0.15: 15%).
        reference: ``"stages"``: the median of the stages' slowdowns at this check
            (:attr:`PolicyInputs.slowdowns`, each stage's measured compute over the profile of its layers);
            ``"history"``: the stage's own median forward+backward time (:attr:`PolicyInputs.stage_compute_s`) over
            its last ``history_checks`` checks since the last migration (a migration changes what a stage holds, so
            its history restarts).
        history_checks: how many past checks the ``"history"`` median spans (at least 1 before it can trigger).
        cooldown_steps: steps after a migration during which it does not trigger (0: none, as in Varuna).
    """

    threshold: float = 0.15
    reference: Literal["stages", "history"] = "stages"
    history_checks: int = 10
    cooldown_steps: int = 0
    _history: list[deque[float]] = field(default_factory=list, init=False, repr=False)
    _last_migration: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.threshold <= 0 or self.history_checks < 1 or self.cooldown_steps < 0:
            raise ConfigurationError(
                f"VarunaRule needs threshold > 0, history_checks >= 1 and cooldown_steps >= 0; got {self.threshold}, "
                f"{self.history_checks}, {self.cooldown_steps}. Varuna's values are 0.15, 10 and 0."
            )
        if self.reference not in ("stages", "history"):
            raise ConfigurationError(
                f"VarunaRule(reference={self.reference!r}) is not a reference; valid: 'stages', 'history'."
            )

    def decide(self, inputs: PolicyInputs) -> Decision:
        """See the class docstring."""
        if self._last_migration is not None and inputs.step - self._last_migration < self.cooldown_steps:
            self._record(inputs)
            return Decision(False, inputs.current, _gain(inputs), "cool-down after the last move", inputs)
        if self.reference == "stages":
            values = inputs.slowdowns
            median = statistics.median(values) if values else 0.0
            slow = [k for k, s in enumerate(values) if median > 0 and s > (1.0 + self.threshold) * median]
            what = "slowdowns"
        else:
            values = inputs.stage_compute_s
            if not values:
                raise ConfigurationError(
                    "VarunaRule(reference='history') needs PolicyInputs.stage_compute_s (the measured per-stage "
                    "forward+backward times); the caller gave none. Use the AdaptiveController, which fills them, or "
                    "reference='stages'."
                )
            medians = [statistics.median(h) if h else 0.0 for h in self._history] if self._history else []
            slow = [
                k
                for k, t in enumerate(values)
                if k < len(medians) and medians[k] > 0 and t > (1.0 + self.threshold) * medians[k]
            ]
            self._record(inputs)
            median = max((medians[k] for k in slow), default=0.0)
            what = "forward+backward s/step"
        if not slow:
            return Decision(
                False,
                inputs.current,
                _gain(inputs),
                f"no stage more than {self.threshold:.0%} slower than its median",
                inputs,
            )
        k = max(slow, key=lambda i: values[i])
        why = f"stage {k} {what} {values[k]:.3g} > {1 + self.threshold:.2f} x median {median:.3g}"
        return _act(inputs, why)

    def _record(self, inputs: PolicyInputs) -> None:
        if self.reference != "history" or not inputs.stage_compute_s:
            return
        if len(self._history) != len(inputs.stage_compute_s):
            self._history = [deque(maxlen=self.history_checks) for _ in inputs.stage_compute_s]
        for h, t in zip(self._history, inputs.stage_compute_s):
            h.append(t)

    def migrated(self, step: int) -> None:
        """A migration changes what every stage holds: the histories restart, the cool-down starts."""
        self._last_migration = step
        self._history = []


@dataclass
class DynPipeThresholdRule:
    """Every ``check_every_steps``, re-plan when a stage's forward+backward time changed ``factor`` times.

    Example::

        >>> from lightning_dynpipe.plan.partition import Partition
        >>> rule = DynPipeThresholdRule(factor=2.0, check_every_steps=50)
        >>> p, q = Partition((4, 4)), Partition((5, 3))
        >>> def check(step, times):
        ...     i = PolicyInputs(step, p, q, 0.1, 0.08, 0.1, 0.01, 100, (1.0, 1.0), stage_compute_s=times)
        ...     return rule.decide(i).repartition
        >>> check(10, (0.1, 0.1)), check(40, (0.1, 0.3)), check(60, (0.1, 0.3))   # reference at 10; next check 60
        (False, False, True)

    Args:
        factor: the change that triggers (2.0: doubled or halved against the reference).
        check_every_steps: steps between checks (the original: every 50 iterations). The first window after the
            start, and after each migration, becomes the reference; so does the window of a trigger.
    """

    factor: float = 2.0
    check_every_steps: int = 50
    _reference: tuple[float, ...] | None = field(default=None, init=False, repr=False)
    _reference_step: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.factor <= 1.0 or self.check_every_steps < 1:
            raise ConfigurationError(
                f"DynPipeThresholdRule needs factor > 1 and check_every_steps >= 1; got {self.factor} and "
                f"{self.check_every_steps}. The original's values are 2.0 and 50."
            )

    def decide(self, inputs: PolicyInputs) -> Decision:
        """See the class docstring."""
        times = inputs.stage_compute_s
        if not times:
            raise ConfigurationError(
                "DynPipeThresholdRule needs PolicyInputs.stage_compute_s (the measured per-stage forward+backward "
                "times); the caller gave none. Use the AdaptiveController, which fills them."
            )
        if self._reference is None or len(self._reference) != len(times):
            self._reference, self._reference_step = times, inputs.step
            return Decision(False, inputs.current, _gain(inputs), "reference window for the 2x rule", inputs)
        if inputs.step - self._reference_step < self.check_every_steps:
            return Decision(
                False,
                inputs.current,
                _gain(inputs),
                f"not a check ({inputs.step - self._reference_step} < {self.check_every_steps} steps since the "
                "reference)",
                inputs,
            )
        ratios = [t / r if r > 0 else 1.0 for t, r in zip(times, self._reference)]
        changed = [k for k, x in enumerate(ratios) if x >= self.factor or x <= 1.0 / self.factor]
        self._reference_step = inputs.step
        if not changed:
            return Decision(False, inputs.current, _gain(inputs), f"no stage's time changed {self.factor:g}x", inputs)
        k = max(changed, key=lambda i: max(ratios[i], 1.0 / ratios[i]))
        why = f"stage {k} forward+backward changed {ratios[k]:.2f}x against the reference window"
        self._reference = times
        return _act(inputs, why)

    def migrated(self, step: int) -> None:
        """The next window (under the new partition) becomes the reference."""
        self._reference = None
