"""When to repartition: a pure, public decision rule, replaceable by any object with a ``decide`` method.

A repartition pays when the time it saves over the coming steps exceeds what it costs (a drain, the transfer
of the moved layers, the warm-up of the pipeline after it). Interference comes and goes, so the default
policy also wants the gain to persist over several checks (hysteresis) and waits after each migration
(cool-down) before it considers another, so a short spike does not cause churn. Predictions can be wrong
(under a CPU quota a stage's slowdown depends on how much work it holds), so the default policy also checks
each move's outcome against the measured step time and undoes a move that made the pipeline slower.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor.base import PipelineWindow

__all__ = ["PricedPartition", "PolicyInputs", "Decision", "RepartitionPolicy", "GainOverCostPolicy"]


@dataclass(frozen=True)
class PricedPartition:
    """One partition the controller priced at a check, in seconds per step as the pipeline would measure them (the
    convergence model's factor left out, unlike :attr:`PolicyInputs.current_step_s`).

    Attributes:
        partition: the partition (the running one among them).
        step_s: its predicted step time at the predictor's values.
        step_high_s: the same at the upper ends of the predictor's intervals (``step_s`` for a point predictor).
    """

    partition: Partition
    step_s: float
    step_high_s: float


@dataclass(frozen=True)
class PolicyInputs:
    """Everything a policy sees at one check (identical on every rank, so every rank decides the same).

    Attributes:
        step: the Lightning step (``global_step``).
        current: the partition in use.
        candidate: the best partition the planner found under the measured slowdowns.
        current_step_s: predicted seconds per step with ``current`` under the measured slowdowns.
        candidate_step_s: predicted seconds per step with ``candidate``.
        measured_step_s: measured seconds per step: the slowest stage's mean over the monitor's window without its
            slowest step (:attr:`~lightning_dynpipe.predictor.PipelineWindow.mean_step_s`).
        migration_cost_s: measured (or estimated) pause of one migration.
        remaining_steps: steps left in the run (``None`` if unknown).
        slowdowns: per-stage slowdown factors the prediction used.
        candidate_step_high_s: upper end of the candidate's predicted step time (``None``: no interval, the
            value itself); the lower end of the gain is ``current_step_s - candidate_step_high_s``.
        details: what the prediction rested on (predicted stage and boundary times, top features), for logs.
        stage_compute_s: per stage, the measured forward plus backward seconds per step under ``current`` (the
            window's medians; empty when the caller did not give them). Threshold rules
            (:mod:`lightning_dynpipe.repartition.rules`) trigger on these.
        convergence_factor: the steps to accuracy the convergence model charges ``current`` for its staleness,
            relative to none stale (``1 + beta * weighted staleness``; 1 without staleness). The predicted step
            times include it; :attr:`measured_tta_step_s` weighs the measured step with it, so that a move judged
            after the fact is judged in the currency it was decided in.
        causes: what the window shows as a lasting cause of a slowdown, ``""`` for none: a stage's signs of
            interference beyond the other stages' (:func:`~lightning_dynpipe.monitor.stats.interference_excess`:
            a cgroup CPU limit, other processes on its cores, its main thread waiting for a core), a CPU limit
            below one core on any stage (it floors that stage's slowdown), or the link measured slower than the
            set-up probe.
        conditions: per stage, whether it shows such a sign (``()``: not known): the environment, coarsely, for
            comparing windows measured under different partitions (:class:`GainOverCostPolicy`'s recall). The link
            is not in it: whether it measures slower than the set-up probe depends on the bytes the partition's
            boundaries carry, not only on the network.
        allowed: whether the policy may move to a partition of its own choosing (``None``: any); the controller's
            memory cap. ``candidate`` is always allowed; the recall skips a partition it refuses (a rollback returns
            to the partition that ran before the move, whatever this says).
        cause_stages: per stage, whether ``causes`` names it (its signs, or its CPU limit below one core); ``()``:
            not known. With :attr:`link_cause` it says which moves the causes explain (:attr:`explained`).
        link_cause: whether ``causes`` names the link (measured slower than the set-up probe).
        window: the window the check measured (every stage's readings: times, CPU, the signs' inputs), for logs and
            for judging a decision after the fact; ``None`` when the caller did not give it.
        cause_age_s: per stage, for how long its cause has shown: the pipeline's time over the consecutive checks
            whose windows showed it (:attr:`window_s` added up), ``math.inf`` for a CPU limit below one core
            (configuration, read at every step), 0 without a cause; ``()``: not known (every cause counts as
            lasting). See :meth:`explained_for`.
        window_s: the pipeline's time this check covers: the steps since the check before (since the start, at the
            first) at the measured step time; 0 when not known.
        link_age_s: for how long the link has measured slower than the set-up probe, at consecutive checks (the time
            they cover, as for :attr:`cause_age_s`); ``math.inf`` when not known.
        priced: every partition the controller priced at this check under the running schedule, the current one
            first (``()``: not given), for logs and for judging the predictor against partitions run later.
        agreed_refit: the newest refit of the predictor every rank had finished at this check, as the controller
            was given it (``None``: not given); with :attr:`window` it lets a check be replayed with the forest the
            fit was using (``benchmarks/reprice.py``).
    """

    step: int
    current: Partition
    candidate: Partition
    current_step_s: float
    candidate_step_s: float
    measured_step_s: float
    migration_cost_s: float
    remaining_steps: int | None
    slowdowns: tuple[float, ...]
    candidate_step_high_s: float | None = None
    details: str = ""
    stage_compute_s: tuple[float, ...] = ()
    convergence_factor: float = 1.0
    causes: str = ""
    conditions: tuple[bool, ...] = ()
    allowed: Callable[[Partition], bool] | None = None
    cause_stages: tuple[bool, ...] = ()
    link_cause: bool = False
    window: PipelineWindow | None = None
    cause_age_s: tuple[float, ...] = ()
    window_s: float = 0.0
    link_age_s: float = math.inf
    priced: tuple[PricedPartition, ...] = ()
    agreed_refit: int | None = None

    @property
    def explained(self) -> bool:
        """Whether a lasting cause the window shows explains the move to ``candidate``: the link is slower, or a
        stage that ``candidate`` gives fewer layers shows a cause (a stage slowed without one, beside a stage under a
        quota, is not explained by the quota). Where the causes' stages are not known, any cause explains it."""
        return self.explained_for(0.0)

    def explained_for(self, min_age_s: float) -> bool:
        """:attr:`explained`, where a cause counts only once it has shown for ``min_age_s`` seconds (a stage's:
        :attr:`cause_age_s`, every cause where those are not known; the link's: :attr:`link_age_s`).

        Example (a move away from stage 0, which showed another process's load in one window of 0.3 s)::

            inputs.explained            # True
            inputs.explained_for(0.5)   # False: the load has not shown for half a second yet
        """
        if not self.causes:
            return False
        if (self.link_cause and self.link_age_s >= min_age_s) or len(self.cause_stages) != self.current.num_stages:
            return True
        ages = self.cause_age_s if len(self.cause_age_s) == len(self.cause_stages) else None
        lasting = [cause and (ages is None or ages[k] >= min_age_s) for k, cause in enumerate(self.cause_stages)]
        if self.candidate.num_stages != self.current.num_stages:
            return any(lasting)
        return any(
            cause and new < old
            for cause, new, old in zip(lasting, self.candidate.balance, self.current.balance, strict=True)
        )

    @property
    def measured_tta_step_s(self) -> float:
        """The measured step weighted by the convergence model's factor: time to accuracy per unstale step."""
        return self.measured_step_s * self.convergence_factor

    @property
    def candidate_step_upper_s(self) -> float:
        """The candidate's predicted step time at the upper end of its interval."""
        return self.candidate_step_s if self.candidate_step_high_s is None else self.candidate_step_high_s


@dataclass(frozen=True)
class Decision:
    """A policy's answer, with its reason; logged for every check so a user can see why it (did not) move."""

    repartition: bool
    partition: Partition
    predicted_gain_s: float
    reason: str
    inputs: PolicyInputs

    def __str__(self) -> str:
        i = self.inputs
        verb = f"repartition {i.current} -> {self.partition}" if self.repartition else f"keep {i.current}"
        upper = i.candidate_step_upper_s
        cand = f"{i.candidate_step_s * 1e3:.1f}" + (
            f" (up to {upper * 1e3:.1f})" if upper != i.candidate_step_s else ""
        )
        details = f"; {i.details}" if i.details else ""
        return (
            f"step {i.step}: {verb} ({self.reason}; slowdowns {[round(s, 2) for s in i.slowdowns]}, predicted "
            f"step {i.current_step_s * 1e3:.1f} -> {cand} ms for {i.candidate}, measured "
            f"{i.measured_step_s * 1e3:.1f} ms, predicted gain (lower end) {self.predicted_gain_s:.2f} s vs "
            f"migration {i.migration_cost_s:.2f} s{details})"
        )


@runtime_checkable
class RepartitionPolicy(Protocol):
    """Decides whether to move to the planner's candidate partition. Called on every rank with equal inputs."""

    def decide(self, inputs: PolicyInputs) -> Decision:
        """The decision for this check."""
        ...

    def migrated(self, step: int) -> None:
        """Told when a migration happened (for cool-downs)."""
        ...

    # Optional: ``reset()``, called when a fit starts (GainOverCostPolicy forgets what it learnt in the last one).


@dataclass(frozen=True)
class _Move:
    """A move whose outcome has not been checked yet: from ``old`` to ``new``, measured ``before_s`` s/step before it,
    weighted by ``old``'s convergence factor ``before_factor``."""

    old: Partition
    new: Partition
    before_s: float
    before_factor: float = 1.0
    conditions: tuple[bool, ...] = ()


@dataclass
class _Streak:
    """Consecutive checks that agreed on one candidate: the hysteresis of :class:`GainOverCostPolicy` and of the
    depth policy (:class:`~lightning_dynpipe.repartition.inflight.InFlightPolicy`)."""

    candidate: object = None
    count: int = 0
    seconds: float = 0.0

    def agree(self, candidate: object, seconds: float = 0.0) -> int:
        """Counts this check, covering ``seconds`` of the pipeline's time, for ``candidate`` (a new candidate starts
        over); returns the checks in a row (:attr:`seconds`: the time they cover)."""
        same = candidate == self.candidate
        self.count = self.count + 1 if same else 1
        self.seconds = (self.seconds if same else 0.0) + max(seconds, 0.0)
        self.candidate = candidate
        return self.count

    def reset(self) -> None:
        self.candidate, self.count, self.seconds = None, 0, 0.0


def _gain_refusal(
    saving_s: float,
    current_step_s: float,
    horizon: int,
    cost_s: float,
    *,
    min_relative_gain: float,
    margin: float,
    cost: str,
    measured_step_s: float = 0.0,
    predicted_saving_s: float | None = None,
) -> str | None:
    """Why a saving per step does not pay (``None``: it pays): the predicted saving below ``min_relative_gain`` of
    the step, or its lower end ``saving_s`` over ``horizon`` steps not above ``margin`` times ``cost_s`` (``cost``
    names it in the reason).

    ``predicted_saving_s`` is the saving at the predictor's values where they carry intervals (``None``: a point
    prediction, whose saving is ``saving_s`` itself). The step is the predicted ``current_step_s``, or the
    ``measured_step_s`` where that is longer: the time a prediction leaves out (the framework's own per-step work,
    waits it does not model) is spent under either partition, so a saving is a share of the step the pipeline
    measures."""
    step_s = max(current_step_s, measured_step_s)
    material = saving_s if predicted_saving_s is None else predicted_saving_s
    if not (step_s > 0 and material / step_s >= min_relative_gain):
        what = "gain (lower end)" if predicted_saving_s is None else "predicted gain"
        reason = f"{what} below {min_relative_gain:.0%} of the step time"
        if measured_step_s > current_step_s > 0 and material >= min_relative_gain * current_step_s:
            # the measured step decided: say so
            reason += (
                f" ({material * 1e3:.1f} ms of the {measured_step_s * 1e3:.1f} measured; "
                f"{current_step_s * 1e3:.1f} predicted)"
            )
        return reason
    if not saving_s * max(horizon, 0) > margin * cost_s:
        return f"gain (lower end) over {horizon} steps does not pay {margin:g}x the {cost}"
    return None


def _boundaries(p: Partition) -> list[int]:
    """Index of the first layer of stages 1..S-1."""
    out, total = [], 0
    for b in p.balance[:-1]:
        total += b
        out.append(total)
    return out


@dataclass(frozen=True)
class _Backfired:
    """A move from ``old`` to ``new`` after which the measured step time was ``measured_s``, slower than before."""

    old: Partition
    new: Partition
    step: int
    measured_s: float
    conditions: tuple[bool, ...] = ()

    def refuses(self, current: Partition, candidate: Partition, conditions: tuple[bool, ...] = ()) -> bool:
        """``new`` itself, and, from ``old``, any candidate that shifts the same boundaries the same way, under the
        conditions the move was judged in (any, when either is not known).

        Step time against one boundary's position is unimodal (the slower side of it sets the pace), so if
        shifting the boundary one way was slower, shifting it further that way is slower too. Under other
        conditions (the interference that made it slower has gone, or another came) the judgement does not hold.
        """
        if self.conditions and conditions and conditions != self.conditions:
            return False
        if candidate == self.new:
            return True
        if current != self.old or len(candidate.balance) != len(self.old.balance):
            return False
        base, tried, cand = _boundaries(self.old), _boundaries(self.new), _boundaries(candidate)
        same_way = all((c - a) * (t - a) >= 0 and (t != a or c == a) for a, t, c in zip(base, tried, cand))
        return same_way and cand != base


_Conditions = tuple[bool, ...]


class _Memory:
    """What the recall remembers for ``steps`` steps: each check's conditions, and per partition and conditions the
    measured step times (weighted by the convergence factor, and as measured)."""

    KEEP = 3
    """Measurements kept per partition and conditions; their median is used (a window that straddles a change of
    conditions before its signs show is one of them)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._checks: list[tuple[int, _Conditions]] = []
        self._seen: dict[tuple[Partition, _Conditions], list[tuple[int, float, float]]] = {}

    def add(self, step: int, partition: Partition, conditions: _Conditions, tta_s: float, measured_s: float) -> None:
        self._checks = [c for c in self._checks if step - c[0] < self.steps] + [(step, conditions)]
        self._seen = {
            key: fresh
            for key, entries in self._seen.items()
            if (fresh := [e for e in entries if step - e[0] < self.steps])
        }
        entries = self._seen.setdefault((partition, conditions), [])
        entries.append((step, tta_s, measured_s))
        del entries[: -self.KEEP]

    def count(self, partition: Partition, conditions: _Conditions) -> int:
        """How many measurements of ``partition`` under ``conditions`` :meth:`measured` takes the median of."""
        return len(self._seen.get((partition, conditions), ()))

    def partitions(self) -> list[Partition]:
        return list(dict.fromkeys(p for p, _ in self._seen))

    def measured(self, partition: Partition, conditions: _Conditions) -> tuple[int, float, float] | None:
        """(latest step, median weighted seconds per step, median seconds per step) under ``conditions``."""
        entries = self._seen.get((partition, conditions))
        if not entries:
            return None
        return entries[-1][0], statistics.median(e[1] for e in entries), statistics.median(e[2] for e in entries)

    def intermittent(self, now: _Conditions) -> bool:
        """Whether conditions other than ``now`` came, went and came again within the memory (a cause that comes
        and goes), rather than once (a cause that has ended)."""
        runs = [c for i, (_, c) in enumerate(self._checks) if i == 0 or c != self._checks[i - 1][1]]
        others = [c for c in runs if c != now]
        return any(others.count(c) >= 2 for c in set(others))

    def shares(self) -> dict[_Conditions, float]:
        counts = Counter(c for _, c in self._checks)
        return {c: n / len(self._checks) for c, n in counts.items()}

    def expected(self, partition: Partition) -> float | None:
        """The weighted step time of ``partition`` averaged over the conditions by their shares of the checks;
        ``None`` unless it was measured under each of them."""
        total = 0.0
        for conditions, share in self.shares().items():
            seen = self.measured(partition, conditions)
            if seen is None:
                return None
            total += share * seen[1]
        return total

    @staticmethod
    def name(conditions: _Conditions) -> str:
        """``"clean"`` or which stages show a sign of interference (``"stage 0 slowed"``)."""
        flagged = [str(k) for k, f in enumerate(conditions) if f]
        return f"stage{'s' if len(flagged) > 1 else ''} {', '.join(flagged)} slowed" if flagged else "clean"

    def describe(self) -> str:
        return ", ".join(f"{self.name(c)} {share:.0%} of the checks" for c, share in self.shares().items())


def _settled_key(inputs: PolicyInputs) -> tuple[tuple[bool, ...], bool] | None:
    """The conditions a kept partition was kept under: each stage's signs and whether the link is slower (``None``
    where the stages' conditions are not known)."""
    return (inputs.conditions, inputs.link_cause) if inputs.conditions else None


def _overprediction(inputs: PolicyInputs) -> float | None:
    """The current partition's predicted step time (without the convergence factor) over the measured one."""
    if inputs.measured_step_s <= 0 or inputs.convergence_factor <= 0:
        return None
    return inputs.current_step_s / inputs.convergence_factor / inputs.measured_step_s


def _young_causes(inputs: PolicyInputs, min_age_s: float) -> str:
    """For a reason: the stages whose causes have not shown for ``min_age_s`` yet, with their ages."""
    young = [
        f"stage {k} for {age:.2f} s"
        for k, (cause, age) in enumerate(zip(inputs.cause_stages, inputs.cause_age_s, strict=False))
        if cause and age < min_age_s
    ]
    if inputs.link_cause and inputs.link_age_s < min_age_s:
        young.append(f"the link for {inputs.link_age_s:.2f} s")
    return f"; signs shown on {', '.join(young)}, less than {min_age_s:g} s" if young else ""


@dataclass
class GainOverCostPolicy:
    """Repartition when the predicted gain over a horizon beats the migration cost by a margin, persistently.

    Example::

        policy = GainOverCostPolicy(horizon_steps=200, margin=2.0, patience=2, cooldown_steps=50)
        DynPipeStrategy(adaptive=policy)

    The gain is ``(current_step_s - candidate_step_upper_s) * min(horizon_steps, remaining_steps)``: the lower end of
    the predicted gain, with the candidate's step time at the upper end of the predictor's interval (the value itself
    for a predictor without intervals). A move needs ``gain > margin * migration_cost_s`` and a predicted saving of
    at least ``min_relative_gain`` of the step time (the predicted ``current_step_s``, or the measured step weighted by
    the convergence factor where that is longer: what a prediction leaves out, the framework's per-step work and waits
    it does not model, is spent under either partition; on a 2-core VM an MLP's clean windows were priced at half their
    measured 32-34 ms, and savings of 10-15% of that price moved it three times in one run to partitions that measured
    no faster). The predicted saving is the one at the predictor's values (``candidate_step_s``): the interval already
    guards against a prediction the predictor is unsure of, through the lower end that must pay the migration, and
    ``min_relative_gain`` asks the same size of saving of every predictor (a point predictor's value is its lower end).
    Asked of the lower end instead, a saving of 10-20% at the values whose intervals reached +-35% never moved: a forest
    calibrated at set-up held a CNN under a half-core quota where the cut it priced 20% faster measured 12% faster.
    A move needs both at ``patience`` consecutive checks with the same candidate that cover at least ``patience_s``
    of the pipeline's time (a fast model's checks are a tenth of a second apart, and a neighbour's bursts of work kept a
    candidate ahead for two of them again and again; ``explained_patience`` checks when the window shows
    a lasting cause that explains the move, :attr:`PolicyInputs.explained`: on the link, or on a stage the move gives
    layers away from; a passing spike has none), and not within ``cooldown_steps`` of the previous migration. A
    cause explains a move only once it has shown for ``explained_min_s`` of the pipeline's time
    (:attr:`PolicyInputs.cause_age_s`, :attr:`PolicyInputs.link_age_s`; a CPU limit, read at every step, at once; a
    link reads slower also while the receiving thread waits for a busy core): the load of other
    processes is read over quarter-second spans, and a window of a fast model can hold a single reading, so a burst
    of another process's work read once would otherwise move the pipeline at one check (under a bursty neighbour,
    :class:`~lightning_dynpipe.interference.CpuBursts`, 30 of a small MLP's 57 moves over eight clean runs were made
    so, and 10 more with no cause after two checks, about a quarter second of steps; with both waits, 2). A cause
    explains a move only while it is new: once a check has kept the current partition under the same conditions
    (:attr:`PolicyInputs.conditions` and whether the link is slower; it was the best, or no move paid) as the check
    before it (the first window of new conditions may straddle their onset), the cause was already priced, and a gain
    that appears later under it comes from the measured times changing, not from the cause. Such a move waits
    ``patience`` checks and is tested like one without a cause (below). Under a 25% quota that had kept ``[7, 2]`` of an
    MLP for 200 steps, a stretch of slower steps moved it at one check to ``[8, 1]``, which ran 10% slower for the rest
    of the run.

    **A slowdown the step time does not show.** With no visible cause, a move also needs the measurement to agree
    with the prediction it rests on: the predicted step time of the current partition under the measured slowdowns
    (without the convergence factor), over the measured step time, may exceed its usual value by at most
    ``max_overprediction``. The usual value is the median of that ratio over the last five checks of the same
    partition (1 with fewer than three, or when it is below 1), so a contradiction becomes usual only when it has
    lasted several checks. A stage's compute that reads 1.5x slower while the pipeline's step time stays where it
    was is a reading the pipeline's throughput contradicts (a hiccup of the timers, work that is not on the critical
    path), and a partition priced from it is priced wrong. The predictions of clean windows mostly sit below the
    measured step time (the framework's own time per step is not in the profile); where a run's predictions sit
    above it, they do so steadily, and the usual value absorbs that. So the test passes whenever a slowdown is real
    enough to slow the pipeline. A move a cause explains is not tested: the CPU-limit floor prices a stage under a
    quota deliberately above what its current share of the work measures, and a slower link's priced round trips
    sit above the measured step too. A move towards a stage under a quota, made for a slowdown of another stage that
    shows no cause, is tested (and waits ``patience`` checks): a spike on the other stage is not the quota.

    **Outcome check.** The planner predicts a candidate's step time from slowdowns measured under the current
    partition, and those are not always transferable: under a CPU quota, a stage that gives layers away may fit
    in its quota and look fast, so the planner wants the layers back, and the pipeline oscillates. So the
    first check after a move compares the measured step time with the one measured just before it (means, not
    medians: under a CPU quota step times are bimodal and the median can rank two partitions the wrong way), each
    weighted by its partition's convergence factor (:attr:`PolicyInputs.convergence_factor`): a move to a
    partition with fewer parameters stale may be decided for although its steps are slower, and is judged the same
    way. If the move made the pipeline slower to accuracy, the policy moves straight back (``rollback``; no
    cool-down or patience, when the measured loss over the horizon pays the migration by ``margin``), and for
    ``memory_steps`` steps it refuses that partition, and, from the partition it came back to, any candidate that
    shifts the same stage boundaries further the same way, as long as the window's conditions
    (:attr:`PolicyInputs.conditions`) are those it was judged under. A rollback is not itself judged, so two moves
    cannot ping-pong. A move is judged only when the window after it shows the conditions of the window before it
    (:attr:`PolicyInputs.conditions`, where both are known): a window before the move that straddled a hog's onset
    (no sign of it yet, a step time between the two) is no measure of the old partition under the hog, and judged
    against it a move to the faster cut under the hog was rolled back.

    **Recall.** Predictions carry each stage's slowdown over to layer sets it has not run, and a small stage's fixed
    costs make it look slowed when nothing interferes; after a move made for a cause that has gone (a co-located job
    that stopped), the predictor can rank the partition left behind below the current one although it measured
    faster. So the policy remembers, for ``recall_steps`` steps, each partition's measured step time (weighted by
    its convergence factor) under each set of conditions, and when the predicted candidate does not move it, moves
    back to a partition measured faster under the same conditions as now, with the same tests of gain, cost,
    ``min_relative_gain``, cool-down and refusals, after ``explained_patience`` checks (the evidence is measured).
    Both partitions are measured alike: the median of each one's last windows under those conditions (up to three,
    this window among the current partition's), so one slow window does not outweigh another partition's median
    (windows of one clean partition measured 30-40 ms on a noisy VM, and a single 37.7 ms window against 33.5 moved
    a pipeline back and forth).
    Such a move is judged afterwards like any other. The same memory checks the predictor: a predicted move to a
    partition that measured no faster (by ``min_relative_gain``) than the current one under the same conditions, or,
    when they come and go, on average over them, is not made. Under a hog the hogged stage reads less slowed once it
    holds less work (light work gets the core when it wakes), so the predictor prices the partition the move left
    behind faster than it ran.

    Args:
        horizon_steps: how far ahead the gain is counted.
        margin: how many times the migration cost the gain must be.
        min_relative_gain: ignore predicted improvements smaller than this fraction of the step time (at the
            predictor's values; the lower end of the gain must pay the migration).
        patience: consecutive checks that must agree (hysteresis).
        patience_s: the pipeline's time (:attr:`PolicyInputs.window_s`) those checks must cover at least, for a move
            no cause explains (0: any). With checks every ten steps, the default holds on models whose steps take
            40 ms or more, and makes a faster model's evidence last as long.
        explained_patience: the same when the window shows a cause of the slowdown that lasts (a cgroup limit,
            another process on a stage's cores, a slower link) and explains the move; at most ``patience``.
        explained_min_s: how long (seconds of the pipeline's steps, at consecutive checks) a stage's sign of
            interference, or the link measured slower, must have shown before it explains a move (see above; 0: from
            its first window). The default is two of the stage monitor's quarter-second readings of other processes'
            load.
        cooldown_steps: steps after a migration during which nothing moves.
        rollback: undo a move whose measured outcome is a slower pipeline (see above).
        memory_steps: how long a partition that made the pipeline slower is refused as a candidate.
        recall_steps: how long a partition's measured step time under a set of conditions is remembered for a move
            back to it (0: never; see above).
        max_overprediction: with no visible cause explaining the move, how far the current partition's predicted
            step time over the measured one may exceed its usual value for a move (see above; ``math.inf``: no
            test).
    """

    horizon_steps: int = 200
    margin: float = 2.0
    min_relative_gain: float = 0.10
    patience: int = 2
    explained_patience: int = 1
    cooldown_steps: int = 30
    rollback: bool = True
    memory_steps: int = 200
    recall_steps: int = 200
    max_overprediction: float = 0.10
    explained_min_s: float = 0.5
    patience_s: float = 0.75
    _streak: _Streak = field(default_factory=_Streak, init=False, repr=False)
    _last_migration: int | None = field(default=None, init=False, repr=False)
    _unjudged: _Move | None = field(default=None, init=False, repr=False)
    _backfired: list[_Backfired] = field(default_factory=list, init=False, repr=False)
    _recall_streak: int = field(default=0, init=False, repr=False)
    _recall_target: Partition | None = field(default=None, init=False, repr=False)
    _memory: _Memory = field(init=False, repr=False)
    _overpredictions: deque[tuple[Partition, float]] = field(
        default_factory=lambda: deque(maxlen=20), init=False, repr=False
    )
    _usual_overprediction: float = field(default=1.0, init=False, repr=False)
    _settled: tuple[tuple[bool, ...], bool] | None = field(default=None, init=False, repr=False)
    _previous: tuple[tuple[bool, ...], bool] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._memory = _Memory(self.recall_steps)
        if (
            self.horizon_steps < 1
            or self.margin < 0
            or self.patience < 1
            or not 1 <= self.explained_patience <= self.patience
            or self.cooldown_steps < 0
            or self.memory_steps < 0
            or self.recall_steps < 0
            or not self.max_overprediction >= 0
            or not 0 <= self.explained_min_s < math.inf
            or not 0 <= self.patience_s < math.inf
        ):
            raise ConfigurationError(
                f"GainOverCostPolicy needs horizon_steps >= 1, margin >= 0, patience >= 1, 1 <= explained_patience "
                f"<= patience, cooldown_steps >= 0, memory_steps >= 0, recall_steps >= 0, max_overprediction >= 0, "
                f"0 <= explained_min_s < inf, 0 <= patience_s < inf; got {self.horizon_steps}, {self.margin}, "
                f"{self.patience}, {self.explained_patience}, {self.cooldown_steps}, {self.memory_steps}, "
                f"{self.recall_steps}, {self.max_overprediction}, {self.explained_min_s}, {self.patience_s}."
            )

    def decide(self, inputs: PolicyInputs) -> Decision:
        """See the class docstring."""
        horizon = (
            self.horizon_steps if inputs.remaining_steps is None else min(self.horizon_steps, inputs.remaining_steps)
        )
        saving = inputs.current_step_s - inputs.candidate_step_upper_s
        gain = saving * max(horizon, 0)
        self._remember(inputs)  # a window that rolls a move back is a measurement of that partition too
        # the first window of new conditions may straddle their onset (the signs show, the slowdown not yet whole):
        # a partition kept then was not kept under them
        key = _settled_key(inputs)
        repeated, self._previous = key is not None and key == self._previous, key
        usual = [r for p, r in self._overpredictions if p == inputs.current][-5:]
        self._usual_overprediction = max(1.0, statistics.median(usual)) if len(usual) >= 3 else 1.0
        overprediction = _overprediction(inputs)
        if overprediction is not None:  # recorded after the usual value is taken: a window is not its own usual
            self._overpredictions.append((inputs.current, overprediction))
        move, self._unjudged = self._unjudged, None
        after_s = inputs.measured_tta_step_s
        if move is not None and move.conditions and inputs.conditions and move.conditions != inputs.conditions:
            move = None  # measured under other conditions than the window before the move: no judgement holds
        if move is not None and inputs.current == move.new and after_s > move.before_s * move.before_factor:
            self._backfired.append(
                _Backfired(move.old, move.new, inputs.step, inputs.measured_step_s, inputs.conditions)
            )
            loss = (after_s - move.before_s * move.before_factor) * max(horizon, 0)
            if self.rollback and loss > self.margin * inputs.migration_cost_s:
                self._streak.reset()
                weighted = inputs.convergence_factor != 1.0 or move.before_factor != 1.0
                after = f"{inputs.measured_step_s * 1e3:.1f} ms/step" + (
                    f" x {inputs.convergence_factor:.3f}" if weighted else ""
                )
                before = f"{move.before_s * 1e3:.1f} ms/step" + (f" x {move.before_factor:.3f}" if weighted else "")
                return Decision(
                    True,
                    move.old,
                    loss,
                    f"roll back: {move.new} measured {after}, slower than {before} under {move.old} before the move"
                    + (" (each step weighted by the convergence model's steps to accuracy)" if weighted else ""),
                    inputs,
                )
        self._backfired = [b for b in self._backfired if inputs.step - b.step < self.memory_steps]
        predicted = self._against_measured(inputs, self._predicted(inputs, horizon, saving, gain, key, repeated))
        if predicted.repartition:
            return predicted
        recalled = self._recall(inputs, horizon)
        return recalled if recalled is not None else predicted

    def _predicted(
        self,
        inputs: PolicyInputs,
        horizon: int,
        saving: float,
        gain: float,
        key: tuple[tuple[bool, ...], bool] | None,
        repeated: bool,
    ) -> Decision:
        """The decision on the predictor's candidate (``key``: the window's conditions, :func:`_settled_key`;
        ``repeated``: the check before had the same)."""

        def no(reason: str) -> Decision:
            self._streak.reset()
            return Decision(False, inputs.current, gain, reason, inputs)

        def kept(reason: str) -> Decision:  # the current partition priced under these conditions and kept
            if repeated:
                self._settled = key
            return no(reason)

        if inputs.candidate == inputs.current:
            return kept("the current partition is already the best")
        for b in reversed(self._backfired):
            if b.refuses(inputs.current, inputs.candidate, inputs.conditions):
                return no(
                    f"moving {b.old} -> {b.new} made the pipeline slower at step {b.step} "
                    f"({b.measured_s * 1e3:.1f} ms/step); {inputs.candidate} is refused for {self.memory_steps} "
                    "steps after that"
                )
        if self._last_migration is not None and self._cooling(inputs.step):
            since = inputs.step - self._last_migration
            return no(f"cool-down: {since} < {self.cooldown_steps} steps since the last move or change of depth")
        refusal = _gain_refusal(
            saving,
            inputs.current_step_s,
            horizon,
            inputs.migration_cost_s,
            min_relative_gain=self.min_relative_gain,
            margin=self.margin,
            cost="migration cost",
            measured_step_s=inputs.measured_tta_step_s,
            predicted_saving_s=(
                None
                if inputs.candidate_step_upper_s == inputs.candidate_step_s  # a point prediction
                else inputs.current_step_s - inputs.candidate_step_s
            ),
        )
        if refusal is not None:
            return kept(refusal)
        ratio, usual = _overprediction(inputs), self._usual_overprediction
        # a cause explains a move while it is new: not once a check kept the current partition under it
        lasting = inputs.explained_for(self.explained_min_s)
        young = inputs.explained and not lasting
        explained = lasting and (key is None or key != self._settled)
        if not explained and ratio is not None and ratio > usual * (1 + self.max_overprediction):
            if young:
                where = f" that has shown for {self.explained_min_s:g} s (the link, or on the stages it relieves)"
            else:
                where = " on the stages it relieves" if inputs.causes else ""
            return no(
                f"no visible cause{where}, and the measured step time ({inputs.measured_step_s * 1e3:.1f} ms) does not "
                f"show the slowdowns: {ratio * inputs.measured_step_s * 1e3:.1f} ms predicted for {inputs.current} "
                f"under them ({ratio:.2f}x, usually {usual:.2f}x)"
            )
        agreed = self._streak.agree(inputs.candidate, inputs.window_s)
        patience = self.explained_patience if explained else self.patience
        # a move no cause explains: its checks must also cover patience_s of the pipeline's time (where known)
        short = not explained and inputs.window_s > 0 and self._streak.seconds < self.patience_s
        if agreed < patience or short:
            too_young = _young_causes(inputs, self.explained_min_s) if young else ""
            over = f" over {self.patience_s:g} s" if short else ""
            so_far = f"{agreed} so far" + (f", {self._streak.seconds:.2f} s" if short else "")
            return Decision(
                False,
                inputs.current,
                gain,
                f"waiting for {patience} checks in a row{over} ({so_far}{too_young})",
                inputs,
            )
        self._streak.reset()
        self._unjudged = _Move(
            inputs.current, inputs.candidate, inputs.measured_step_s, inputs.convergence_factor, inputs.conditions
        )
        reason = "predicted gain pays the migration"
        if explained and patience < self.patience:
            reason += f" (after {patience} check{'s' if patience > 1 else ''}: {inputs.causes})"
        return Decision(True, inputs.candidate, gain, reason, inputs)

    def _cooling(self, step: int) -> bool:
        return self._last_migration is not None and step - self._last_migration < self.cooldown_steps

    def _remember(self, inputs: PolicyInputs) -> None:
        """Adds this window's conditions and measured step time to the memory; forgets what is older."""
        if inputs.conditions and self.recall_steps > 0 and inputs.measured_step_s > 0:
            self._memory.add(
                inputs.step, inputs.current, inputs.conditions, inputs.measured_tta_step_s, inputs.measured_step_s
            )

    def _against_measured(self, inputs: PolicyInputs, predicted: Decision) -> Decision:
        """A predicted move must also pay on what the two partitions measured, where the memory holds both: under
        conditions that come and go, on the average over them; else under the same conditions as now."""
        if not predicted.repartition or not inputs.conditions:
            return predicted
        memory, target = self._memory, predicted.partition
        if memory.intermittent(inputs.conditions):
            here, there = memory.expected(inputs.current), memory.expected(target)
            measured = f"the conditions come and go ({memory.describe()}): averaged over them {target} measured"
        else:
            seen_here, seen_there = (
                memory.measured(inputs.current, inputs.conditions),
                memory.measured(target, inputs.conditions),
            )
            here = None if seen_here is None else seen_here[1]
            there = None if seen_there is None else seen_there[1]
            measured = (
                f"{target} measured under the same conditions ({memory.name(inputs.conditions)})"
                + ("" if seen_there is None else f" at step {seen_there[0]}")
                + ":"
            )
        if here is None or there is None or here - there >= self.min_relative_gain * here:
            return predicted
        self._unjudged = None
        return Decision(
            False,
            inputs.current,
            predicted.predicted_gain_s,
            f"{measured} {there * 1e3:.1f} ms/step against {here * 1e3:.1f} for {inputs.current}",
            inputs,
        )

    def _recall(self, inputs: PolicyInputs, horizon: int) -> Decision | None:
        """A move back to a partition measured faster, when it pays (class docstring): under the same conditions as
        now, or, when the conditions come and go, on average over them."""
        if not inputs.conditions or self.recall_steps == 0 or self._cooling(inputs.step):
            return None
        memory = self._memory
        average = memory.expected(inputs.current) if memory.intermittent(inputs.conditions) else None
        # conditions that come and go: averaged over them (when the current partition was measured under each of
        # them); else under the same conditions as now
        intermittent = average is not None
        # like the candidates: the median of the current partition's last windows under these conditions (this one
        # among them, remembered above), not this window alone
        here = None if intermittent else memory.measured(inputs.current, inputs.conditions)
        here_windows = 0 if intermittent else memory.count(inputs.current, inputs.conditions)
        if average is not None:
            now = average
        else:
            now = here[1] if here is not None else inputs.measured_tta_step_s
        best: tuple[Partition, float, tuple[int, float, float] | None] | None = None
        for partition in memory.partitions():
            if partition == inputs.current:
                continue
            if any(b.refuses(inputs.current, partition, inputs.conditions) for b in self._backfired):
                continue
            if inputs.allowed is not None and not inputs.allowed(partition):
                continue
            seen = None if intermittent else memory.measured(partition, inputs.conditions)
            value = memory.expected(partition) if intermittent else None if seen is None else seen[1]
            if value is not None and (best is None or value < best[1]):
                best = (partition, value, seen)
        if best is None or not now > 0:
            self._recall_streak = 0
            return None
        target, value, seen = best
        saving = now - value
        gain = saving * max(horizon, 0)
        if saving / now < self.min_relative_gain or gain <= self.margin * inputs.migration_cost_s:
            self._recall_streak = 0
            return None
        self._recall_streak = self._recall_streak + 1 if self._recall_target == target else 1
        self._recall_target = target
        if seen is None:  # averaged over conditions that come and go
            measured = (
                f"the conditions come and go ({memory.describe()}): averaged over them {target} measured "
                f"{value * 1e3:.1f} ms/step against {now * 1e3:.1f} for {inputs.current}"
            )
        else:
            step, _, measured_s = seen
            current_s = here[2] if here is not None else inputs.measured_step_s
            measured = (
                f"{target} measured {measured_s * 1e3:.1f} ms/step at step {step} under the same conditions "
                f"({memory.name(inputs.conditions)}); {inputs.current} measures {current_s * 1e3:.1f} ms/step"
                + (f" (the median of its last {here_windows} windows)" if here_windows > 1 else "")
            )
        if self._recall_streak < self.explained_patience:
            reason = f"{measured}; waiting for {self.explained_patience} checks in a row ({self._recall_streak} so far)"
            return Decision(False, inputs.current, gain, reason, inputs)
        self._recall_streak, self._recall_target = 0, None
        self._streak.reset()
        self._unjudged = _Move(
            inputs.current, target, inputs.measured_step_s, inputs.convergence_factor, inputs.conditions
        )
        return Decision(True, target, gain, f"move back: {measured}", inputs)

    def migrated(self, step: int) -> None:
        """Starts the cool-down."""
        self._last_migration = step

    def reset(self) -> None:
        """Forgets everything learnt in a fit (streaks, cool-down, the move to judge, refusals, the recall's memory):
        the strategy calls it when a fit starts, so a policy object reused for another fit starts from scratch."""
        self._streak.reset()
        self._last_migration = None
        self._unjudged = None
        self._backfired = []
        self._recall_streak, self._recall_target = 0, None
        self._memory = _Memory(self.recall_steps)
        self._overpredictions.clear()
        self._usual_overprediction = 1.0
        self._settled = self._previous = None
