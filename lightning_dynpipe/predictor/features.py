"""The forest's inputs: a named, versioned feature schema, and rows built from a window and a candidate.

Two kinds of rows, each a fixed vector of floats whose columns the :class:`FeatureSchema` names:

* a **stage row** for stage ``k`` of a candidate partition: the environment stage ``k`` was measured in
  (:class:`~lightning_dynpipe.predictor.base.StageTimes`: CPU share, steal, run-queue wait, cgroup limit, other
  processes' load on its cores, context switches, RSS, GPU utilisation / SM clock / throttling / other
  processes' memory where NVML reports them), what the stage held when measured (its profiled compute, its
  measured slowdown, how busy it was), and the candidate's layer set for stage ``k`` from the set-up profile
  (:class:`~lightning_dynpipe.plan.costs.ModelCost`: compute, parameter, activation and working-set bytes,
  layer count, micro-batches per step), with the pace the candidate's other stages set (the slowest one's prior)
  and, under a CPU limit, the stage's CPU need at that pace over its limit;
* a **boundary row** for boundary ``b`` of a candidate: the message time measured across boundary ``b``, its
  spread (jitter), the bytes that crossed it, the bytes the candidate sends across it, and the link model.

The forest predicts the **residual** over an analytic prior, as a log ratio:

* stage: ``prior = slowdown * (profiled compute of the candidate's layers + fixed)`` per micro-batch, where
  ``fixed`` is what running a layer set as a stage costs per micro-batch beyond its layers' profile, measured by the
  calibration sweep across layer sets (:func:`estimate_fixed_s`; 0 without one), and the slowdown is the stage's
  measured compute over the profile of the layers it held plus ``fixed`` (:func:`prior_slowdowns` without it), at least
  ``1/q`` under a CPU limit of ``q`` cores, and there at least all the stage's measured CPU per step over ``q``,
  with the layers it gains or gives away priced by their profile (the framework's CPU around the layers stays with
  the process, but for its messages' copies, which follow the bytes at its boundaries:
  :func:`~lightning_dynpipe.predictor.measured.cpu_limited_floors`). Where that floor applies, the
  slowdown is taken from the layers' forward+backward time, not from the CPU over the limit, which the floor
  already holds: a stage left with a small layer spends most of its CPU around it, and that CPU read as a stretch
  would multiply every layer it receives. Where the predictor has seen the
  stage quiet under the layers it holds (:class:`QuietReadings`), what it read then over the pipeline's speed is a
  fixed cost per micro-batch that stays with the stage, and only the rest of the reading stretches the candidate's
  layers, as in the measured predictor (the ``fixed_share`` column: that cost's share of the prior);
* boundary: ``prior = max(link(candidate bytes), measured message time - link(measured bytes) + link(candidate
  bytes))`` with ``link(x) = latency + x / bandwidth``: the measured extra latency (delay, jitter, contention)
  carries over and the bandwidth term follows the bytes.

Under a CPU limit the measured forward+backward time understates what the stage needs (the throttling can land in
its waits instead), so a stage's time is taken as :func:`effective_compute_s`: at least its CPU time per step over
its limit. So a forest that knows nothing predicts the prior, and the trees never have to learn the obvious. Columns
that a machine does not report (no NVML, no ``/proc``) hold :data:`MISSING`.

Pure numpy.
"""

from __future__ import annotations

import itertools
import math
import statistics
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor.base import PipelineWindow, StageTimes, check_same_pipeline, cpu_contended
from lightning_dynpipe.predictor.measured import boundary_bytes, cpu_limited_floors, measured_slowdowns, quiet_split

__all__ = [
    "FeatureSchema",
    "FEATURE_SCHEMA",
    "MISSING",
    "STAGE_FEATURES",
    "BOUNDARY_FEATURES",
    "LabelledSamples",
    "window_label",
    "effective_compute_s",
    "stage_rows",
    "stage_priors",
    "prior_slowdowns",
    "boundary_rows",
    "boundary_priors",
    "measured_message_s",
    "cpu_contended",
    "samples_from_windows",
    "QuietReadings",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

MISSING = -1.0
"""The value of a column the machine does not report (every real value of these columns is >= 0)."""

_MIB = float(1 << 20)

STAGE_FEATURES: tuple[str, ...] = (
    # the stage's environment, as measured under the window's partition
    "cpu_share",
    "steal_share",
    "run_queue_wait_share",
    "cpu_limit_cores",
    "other_cpu_load",
    "ctx_switches_per_s",
    "rss_mib",
    "gpu_util",
    "gpu_sm_clock_mhz",
    "gpu_throttled",
    "gpu_other_mem_mib",
    # what the stage held when measured
    "measured_profile_ms",
    "measured_slowdown",
    "measured_raw_ratio",
    "measured_duty",
    # the candidate's layer set for the stage
    "candidate_profile_ms",
    "candidate_param_mib",
    "candidate_activation_out_mib",
    "candidate_working_set_mib",
    "candidate_num_layers",
    "num_microbatches",
    "work_ratio",
    "candidate_duty",
    "quota_demand",
    "pace_ms",
    "quota_pressure",
    "fixed_share",
)
"""Columns of a stage row (see the module docstring)."""

BOUNDARY_FEATURES: tuple[str, ...] = (
    "measured_message_ms",
    "measured_spread_ms",
    "measured_mib",
    "candidate_mib",
    "link_latency_ms",
    "link_ms_per_mib",
    "link_measured_ms",
    "link_candidate_ms",
    "num_microbatches",
)
"""Columns of a boundary row (see the module docstring)."""


@dataclass(frozen=True)
class FeatureSchema:
    """The name, version and columns of the rows a forest was trained on; a model file records it.

    Example::

        FEATURE_SCHEMA.check(FeatureSchema.from_dict(saved["schema"]), where="model.npz")

    A model is only valid for rows built the same way, so any change to the columns or to how they are
    computed bumps :attr:`version`.
    """

    name: str
    version: int
    stage: tuple[str, ...]
    boundary: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data."""
        return {"name": self.name, "version": self.version, "stage": list(self.stage), "boundary": list(self.boundary)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FeatureSchema:
        """The inverse of :meth:`to_dict`; a malformed entry raises :class:`ConfigurationError`."""
        try:
            return cls(str(data["name"]), int(data["version"]), tuple(data["stage"]), tuple(data["boundary"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"A feature schema needs 'name', 'version', 'stage' and 'boundary'; got {data!r} ({exc})."
            ) from exc

    def check(self, other: FeatureSchema, *, where: str) -> None:
        """Raises :class:`ConfigurationError` unless ``other`` (e.g. read from a file) is this schema."""
        if other == self:
            return
        diff = sorted(set(other.stage) ^ set(self.stage)) + sorted(set(other.boundary) ^ set(self.boundary))
        raise ConfigurationError(
            f"{where} was trained on feature schema {other.name!r} version {other.version}, but this version of "
            f"lightning_dynpipe builds rows of schema {self.name!r} version {self.version}; a forest only applies "
            f"to rows of the schema it was trained on (columns that differ: {diff[:8] or 'their order'}). Re-run "
            "`python -m lightning_dynpipe calibrate` to train a forest for this version, or install the version "
            "that wrote the file."
        )


FEATURE_SCHEMA = FeatureSchema("dynpipe-interference", 8, STAGE_FEATURES, BOUNDARY_FEATURES)
"""The schema this version builds (2: the working set counts what a micro-batch keeps for the backward, not only the
layers' outputs; 3: a CPU-limited stage's prior keeps the CPU its process spends around its layers, and a boundary
beside a limited stage is measured on its other side; 4: a stage's prior carries what it read quiet as a fixed cost,
where the predictor has seen such a window, and the ``fixed_share`` column says how much of the prior that is; a
boundary beside a stage that competes for its cores, a CPU limit or not, is measured on its other side; 5: a stage
that competes for its cores under no CPU limit is floored like a limited one at the share of its core it obtained,
and a boundary beside such a stage is the lower of its two sides' readings; 6: a stage's prior, without a quiet
reading, stretches its layers' profile plus the pipeline's fixed cost per micro-batch and stage measured by the
calibration sweep, and ``fixed_share`` says how much of the prior that is; 7: where a CPU floor prices a stage, its
stretch comes from its layers' forward+backward time, not from its CPU over the limit; 8: where a CPU floor prices a
stage, the bytes its boundaries carry change its CPU at the link's ``cpu_s_per_byte``)."""


class QuietReadings(Protocol):
    """What the windows seen so far showed of the pipeline's speed and of each stage with nothing beside it:
    :class:`~lightning_dynpipe.predictor.MeasuredSlowdownPredictor` after it observed them (its
    :attr:`~lightning_dynpipe.predictor.MeasuredSlowdownPredictor.reference` and
    :meth:`~lightning_dynpipe.predictor.MeasuredSlowdownPredictor.quiet_ratio`), for one profile."""

    @property
    def reference(self) -> float | None:
        """The pipeline's speed (measured compute over profile) the windows showed, with its tolerance; ``None``
        before any window."""
        ...

    def quiet_ratio(self, stage: int, layers: range) -> float | None:
        """The stage's measured compute over profile while it held ``layers`` and showed no sign of interference;
        ``None`` where it never did."""
        ...


def _opt(value: float | None, scale: float = 1.0) -> float:
    return MISSING if value is None or math.isnan(value) else float(value) * scale


def effective_compute_s(t: StageTimes) -> float:
    """A stage's compute per step as the pipeline feels it: its forward+backward time, and under a CPU limit of
    ``q`` cores at least its CPU time per step over ``q`` (the quota allows no faster step).

    Example::

        >>> effective_compute_s(StageTimes(compute_s=0.012, step_s=0.080, cpu_share=0.2, cpu_limit=0.25))
        0.064
    """
    q = t.binding_cpu_limit
    if q is not None and t.step_s > 0:
        return max(t.compute_s, t.cpu_share * t.step_s / q)
    return t.compute_s


def _profile_s(model_cost: ModelCost, partition: Partition, k: int) -> float:
    layers = partition.stage_layers(k)
    return model_cost.compute_s(layers.start, layers.stop)


def prior_slowdowns(model_cost: ModelCost, window: PipelineWindow) -> tuple[float, ...]:
    """Per stage, measured compute over the profile of its layers (1 without either), at least ``1/q`` under a
    CPU limit of ``q < 1`` core.

    Unlike the baseline's :func:`~lightning_dynpipe.predictor.measured.measured_slowdowns` this is not taken
    relative to the least slowed stage: when every stage is slowed, the prior should say so (the trees see the
    relative slowdown as a feature too).
    """
    return _slowdowns(model_cost, window, _stretched_s(model_cost, window))


def _slowdowns(model_cost: ModelCost, window: PipelineWindow, stretched: Sequence[float]) -> tuple[float, ...]:
    """:func:`prior_slowdowns` from each stage's reading that stretches its layers (:func:`_stretched_s`)."""
    M = window.num_microbatches
    out = []
    for k, (t, c) in enumerate(zip(window.stages, stretched)):
        profile = _profile_s(model_cost, window.partition, k)
        raw = c / (M * profile) if profile > 0 and c > 0 else 1.0
        q = t.binding_cpu_limit
        floor = 1.0 / q if q is not None else 1.0
        out.append(max(raw, floor))
    return tuple(out)


def _stretched_s(model_cost: ModelCost, window: PipelineWindow) -> list[float]:
    """Per stage of the window, the reading per step that stretches its layers in the prior.

    Its :func:`effective_compute_s`, except where the CPU a stage gets is below one core and its CPU per step is
    measured (:func:`~lightning_dynpipe.predictor.measured.cpu_limited_floors` gives it a floor): there its layers'
    own forward+backward time. The floor carries all the stage's CPU over what it gets, the framework's work around
    its layers included; counted in the stretch as well, that work would multiply every layer the stage receives.
    On the CNN under a quarter-core quota, a last stage left with its classifier (0.19 ms profiled) used 4.8 ms of
    CPU per micro-batch: its CPU over the quota, 19 ms, read as a 100x stretch priced its taking back one layer of
    0.76 ms at 94 ms per micro-batch instead of about 22.
    """
    floors = cpu_limited_floors(model_cost, window, window.partition)
    return [t.compute_s if floor is not None else effective_compute_s(t) for t, floor in zip(window.stages, floors)]


def estimate_fixed_s(model_cost: ModelCost, windows: Sequence[PipelineWindow]) -> float:
    """The fixed cost per micro-batch of running a layer set as a stage, in the profile's seconds, from
    ``windows`` measured without interference under several partitions (0 where they cannot tell).

    The set-up profile times each layer alone; a stage also pays, per micro-batch, for what is not in any layer
    (taking its input, the backward's start and end). Across layer sets measured clean, a stage's compute per
    micro-batch is about ``stretch * (profile + fixed)``: a line in the profile whose intercept over its slope is
    ``fixed``. The line is the Theil-Sen estimate (medians of pairwise slopes and of intercepts), which one window
    caught by other load does not move. Fewer than three distinct layer-set profiles, or a slope that is not
    positive, give 0.

    Example::

        >>> from lightning_dynpipe.plan.costs import ModelCost
        >>> from lightning_dynpipe.plan.partition import Partition
        >>> from lightning_dynpipe.predictor import PipelineWindow, StageTimes
        >>> cost = ModelCost.from_arrays([5e-4] * 6, [5e-4] * 6)  # 1 ms per layer
        >>> def window(balance):  # measured: 1.5 x (profile + 0.4 ms) per micro-batch, M = 2
        ...     stages = [StageTimes(compute_s=2 * 1.5 * (n * 1e-3 + 4e-4), step_s=0.1) for n in balance]
        ...     return PipelineWindow(Partition(balance), tuple(stages), 2)
        >>> round(estimate_fixed_s(cost, [window((1, 5)), window((2, 4)), window((3, 3))]) * 1e3, 3)
        0.4
    """
    points = []
    for w in windows:
        M = w.num_microbatches
        for k, t in enumerate(w.stages):
            profile, c = _profile_s(model_cost, w.partition, k), effective_compute_s(t)
            if profile > 0 and c > 0:
                points.append((profile, c / M))
    if len({round(x, 12) for x, _ in points}) < 3:
        return 0.0
    slopes = [(y1 - y0) / (x1 - x0) for (x0, y0), (x1, y1) in itertools.combinations(points, 2) if x1 != x0]
    slope = statistics.median(slopes)
    if not slope > 0:
        return 0.0
    intercept = statistics.median([y - slope * x for x, y in points])
    return max(intercept / slope, 0.0)


def _stage_parts(
    model_cost: ModelCost, window: PipelineWindow, quiet: QuietReadings | None, fixed_s: float = 0.0
) -> list[tuple[float, float]]:
    """Per stage of the window, ``(stretch, fixed)``: the stage's compute per micro-batch under any layers costs
    ``stretch * (their profile + fixed)`` seconds (before a CPU limit's floor).

    Without a quiet reading the stage's whole reading stretches its layers: ``(prior slowdown, 0)``, the slowdown at
    least 1 (at least ``1/q`` under a CPU limit of ``q`` cores). Given ``fixed_s`` (the pipeline's fixed cost per
    micro-batch and stage, :func:`estimate_fixed_s`), the reading stretches the layers and that cost together,
    ``(reading / (profile + fixed_s), fixed_s)``, with no floor of 1 (across layer sets the line of clean readings
    can rise more slowly than the profile: the layers inside a stage run faster than each one alone), at least
    ``1/q`` under a CPU limit. Where ``quiet``
    holds the stage's reading under the layers it holds now, with nothing beside it and under no CPU limit below
    one core, what that reading exceeds the pipeline's speed by is a fixed cost per micro-batch that stays with the
    stage, and the rest of the reading stretches its layers and that cost together
    (:func:`~lightning_dynpipe.predictor.measured.quiet_split`, as
    :class:`~lightning_dynpipe.predictor.MeasuredSlowdownPredictor` prices it); the stage's current layers are
    priced at what it measured either way.
    """
    M = window.num_microbatches
    profiles = [_profile_s(model_cost, window.partition, k) for k in range(len(window.stages))]
    stretched = _stretched_s(model_cost, window)
    slow = _slowdowns(model_cost, window, stretched)
    out = [(s, 0.0) for s in slow]
    if fixed_s > 0:  # no floor of 1 here: the layers inside a stage may run faster than each one alone
        for k, (t, c) in enumerate(zip(window.stages, stretched)):
            if profiles[k] > 0 and c > 0:
                q = t.binding_cpu_limit
                out[k] = (max(c / (M * (profiles[k] + fixed_s)), 1.0 / q if q is not None else 0.0), fixed_s)
    if quiet is None:
        return out
    ratios = [t.compute_s / (M * p) if p > 0 and t.compute_s > 0 else None for p, t in zip(profiles, window.stages)]
    measured = [r for r in ratios if r is not None]
    if not measured:
        return out
    reference = quiet.reference
    base = min(min(measured), reference) if reference is not None and reference > 0 else min(measured)
    if not base > 0:
        return out
    for k, t in enumerate(window.stages):
        layers = window.partition.stage_layers(k)
        q = quiet.quiet_ratio(k, layers)
        if q is None or ratios[k] is None or t.binding_cpu_limit is not None:
            continue
        stretch, fixed = quiet_split(q / base, slow[k] / base, profiles[k])
        out[k] = (base * stretch, fixed)  # in seconds: the pipeline's speed times the relative stretch
    return out


def stage_priors(
    model_cost: ModelCost,
    window: PipelineWindow,
    candidate: Partition,
    quiet: QuietReadings | None = None,
    fixed_s: float = 0.0,
    message_cpu_s_per_byte: float = 0.0,
) -> FloatArray:
    """Per stage of ``candidate``, the analytic prior of its compute per micro-batch (seconds): its layers' profile
    plus ``fixed_s`` (:func:`estimate_fixed_s`), stretched as the stage's reading stretches its own, with what the
    stage read quiet carried as a fixed cost instead where ``quiet`` holds such a reading (see
    :func:`_stage_parts`), and under a CPU limit no less than all the stage's CPU per step over the limit, the layers
    it gains or gives away priced by their profile and its messages by their bytes at ``message_cpu_s_per_byte``
    (:func:`~lightning_dynpipe.predictor.measured.cpu_limited_floors`)."""
    check_same_pipeline(window, candidate)
    parts = _stage_parts(model_cost, window, quiet, fixed_s)
    return _priors(model_cost, window, candidate, parts, message_cpu_s_per_byte)


def _priors(
    model_cost: ModelCost,
    window: PipelineWindow,
    candidate: Partition,
    parts: list[tuple[float, float]],
    message_cpu_s_per_byte: float = 0.0,
) -> FloatArray:
    """:func:`stage_priors` from the window's :func:`_stage_parts`."""
    floors = cpu_limited_floors(
        model_cost, window, candidate, seconds=True, message_cpu_s_per_byte=message_cpu_s_per_byte
    )
    return np.asarray(
        [
            max(stretch * (_profile_s(model_cost, candidate, k) + fixed), floors[k] or 0.0)
            for k, (stretch, fixed) in enumerate(parts)
        ]
    )


def stage_rows(
    model_cost: ModelCost,
    window: PipelineWindow,
    candidate: Partition,
    quiet: QuietReadings | None = None,
    fixed_s: float = 0.0,
    message_cpu_s_per_byte: float = 0.0,
) -> FloatArray:
    """One row of :data:`STAGE_FEATURES` per stage of ``candidate``, shape ``(S, len(STAGE_FEATURES))``, with the
    priors of :func:`stage_priors` under the same ``quiet`` readings, ``fixed_s`` and ``message_cpu_s_per_byte``."""
    check_same_pipeline(window, candidate)
    M = window.num_microbatches
    slow = measured_slowdowns(model_cost, window.partition, window.stages, M)
    parts = _stage_parts(model_cost, window, quiet, fixed_s)
    priors = _priors(model_cost, window, candidate, parts, message_cpu_s_per_byte)
    rows = []
    for k, t in enumerate(window.stages):
        measured_profile = _profile_s(model_cost, window.partition, k)
        c = effective_compute_s(t)
        raw = c / (M * measured_profile) if measured_profile > 0 and c > 0 else 1.0
        duty = min(max(t.compute_s / t.step_s, 0.0), 1.0) if t.step_s > 0 else 0.0
        layers = candidate.stage_layers(k)
        first, stop = layers.start, layers.stop
        cand_profile = model_cost.compute_s(first, stop)
        ratio = cand_profile / measured_profile if measured_profile > 0 else 1.0
        params = model_cost.param_bytes(first, stop)
        working = (
            params
            + model_cost.optimizer_state_bytes(first, stop)
            + int(model_cost.kept_prefix[stop] - model_cost.kept_prefix[first])  # one micro-batch's saved tensors
            + max(model_cost.layers[i].workspace_bytes for i in layers)
        )
        cand_duty = min(duty * ratio, 1.0)
        limit = t.cpu_limit
        pace = max((float(priors[j]) for j in range(len(priors)) if j != k), default=0.0)
        binding = t.binding_cpu_limit
        raw_clean = min(raw, 1.0 / binding) if binding is not None else raw
        rows.append(
            [
                t.cpu_share,
                t.steal_share,
                t.run_queue_wait_share,
                _opt(limit),
                _opt(t.other_cpu_load),
                t.ctx_switches_per_s,
                t.rss_bytes / _MIB,
                _opt(t.gpu_util),
                _opt(t.gpu_sm_clock_mhz),
                _opt(t.gpu_throttled),
                _opt(t.gpu_other_mem_bytes, 1.0 / _MIB),
                measured_profile * 1e3,
                slow[k],
                raw,
                duty,
                cand_profile * 1e3,
                params / _MIB,
                model_cost.layers[stop - 1].activation_bytes / _MIB,
                working / _MIB,
                float(stop - first),
                float(M),
                ratio,
                cand_duty,
                cand_duty / limit if limit is not None and limit > 0 else 0.0,
                pace * 1e3,
                raw_clean * cand_profile / (limit * pace) if limit is not None and limit > 0 and pace > 0 else 0.0,
                parts[k][1] / (cand_profile + parts[k][1]) if cand_profile + parts[k][1] > 0 else 0.0,
            ]
        )
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(STAGE_FEATURES))


def measured_message_s(window: PipelineWindow) -> tuple[tuple[float, float], ...]:
    """Per boundary of the window's partition, ``(median, spread)`` seconds per message, from the stages' times.

    Stage ``k`` receives ``M`` activations (when ``k > 0``) and ``M`` gradients (when ``k < S-1``) per step, and
    reports the time its incoming transfers took per step; boundary ``b``'s message time is the mean of the
    per-message times of the two stages beside it (exact for two stages; an average of both sides of an
    interior stage otherwise).

    A stage whose process competes for its cores sees a message late: under a CPU limit below one core, one that
    arrives while the process is throttled only when it runs again (under a quarter core, three quarters of the
    time); beside a CPU hog, the threads that receive it wait for the core (on the CNN under a hog on stage 0, 0.3 ms
    messages measured 5.4-6.1 ms per message on average over both sides, and the link, re-fitted from that, priced
    the move off the hogged stage out). It also sends late: its main thread stamps a message and the threads that
    send it wait for the core, so the other side's receives read late too (on the GPT example after the move off a
    hogged stage 0, stage 1 read 4.5 ms per message where the link had measured 0.2-1.5 ms, and the link, re-fitted
    from it, fell to 23-60 MB/s). Neither is the link's time, and each side's reading is at least the link's time:
    where a side of a boundary competes for its cores (:func:`cpu_contended`), the boundary's time is the lower of
    the two sides' readings.
    """
    S, M = window.partition.num_stages, window.num_microbatches
    per_msg = []
    for k, t in enumerate(window.stages):
        n = M * ((k > 0) + (k < S - 1))
        per_msg.append((t.comm_s / n, t.comm_spread_s / n) if n > 0 else (0.0, 0.0))
    contended = cpu_contended(window)
    out = []
    for b in range(S - 1):
        if contended[b] or contended[b + 1]:
            out.append(min(per_msg[b], per_msg[b + 1]))
        else:
            out.append(((per_msg[b][0] + per_msg[b + 1][0]) / 2.0, (per_msg[b][1] + per_msg[b + 1][1]) / 2.0))
    return tuple(out)


def boundary_priors(model_cost: ModelCost, comm: CommModel, window: PipelineWindow, candidate: Partition) -> FloatArray:
    """Per boundary of ``candidate``, the analytic prior of its time per message (seconds)."""
    check_same_pipeline(window, candidate)
    measured = measured_message_s(window)
    old, new = boundary_bytes(model_cost, window.partition), boundary_bytes(model_cost, candidate)
    out = []
    for b in range(candidate.num_stages - 1):
        link_new = float(comm.transfer_time(new[b]))
        excess = measured[b][0] - float(comm.transfer_time(old[b])) if measured[b][0] > 0 else 0.0
        out.append(max(link_new, excess + link_new))
    return np.asarray(out, dtype=np.float64)


def boundary_rows(model_cost: ModelCost, comm: CommModel, window: PipelineWindow, candidate: Partition) -> FloatArray:
    """One row of :data:`BOUNDARY_FEATURES` per boundary of ``candidate``, shape ``(S-1, len(BOUNDARY_FEATURES))``."""
    check_same_pipeline(window, candidate)
    measured = measured_message_s(window)
    old, new = boundary_bytes(model_cost, window.partition), boundary_bytes(model_cost, candidate)
    per_mib = _MIB / comm.bandwidth_Bps if math.isfinite(comm.bandwidth_Bps) else 0.0
    rows = [
        [
            measured[b][0] * 1e3,
            measured[b][1] * 1e3,
            old[b] / _MIB,
            new[b] / _MIB,
            comm.latency_s * 1e3,
            per_mib * 1e3,
            float(comm.transfer_time(old[b])) * 1e3,
            float(comm.transfer_time(new[b])) * 1e3,
            float(window.num_microbatches),
        ]
        for b in range(candidate.num_stages - 1)
    ]
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(BOUNDARY_FEATURES))


@dataclass(frozen=True)
class LabelledSamples:
    """Rows with their targets (log of measured over prior), for stages and for boundaries.

    Attributes:
        stage_x: ``(n, len(STAGE_FEATURES))`` stage rows.
        stage_y: ``(n,)`` stage residuals, ``log(measured compute per micro-batch / prior)`` (the effective
            compute, :func:`effective_compute_s`).
        boundary_x: ``(m, len(BOUNDARY_FEATURES))`` boundary rows.
        boundary_y: ``(m,)`` boundary residuals, ``log(measured message time / prior)``.
        fixed_s: the fixed cost per micro-batch and stage the stage priors were built with
            (:func:`estimate_fixed_s`); rows built with different ones do not mix.
        stage_window: ``(n,)`` a label of the measured window each stage row's time comes from (rows paired with
            one window share its noise; the forest holds them out together when it calibrates its intervals).
            ``None``: unknown, each row its own label (derived from its content).
        boundary_window: the same for the boundary rows.
    """

    stage_x: FloatArray
    stage_y: FloatArray
    boundary_x: FloatArray
    boundary_y: FloatArray
    fixed_s: float = 0.0
    stage_window: IntArray | None = None
    boundary_window: IntArray | None = None

    def __post_init__(self) -> None:
        for name, x, y in (
            ("stage_window", self.stage_x, self.stage_y),
            ("boundary_window", self.boundary_x, self.boundary_y),
        ):
            labels = getattr(self, name)
            if labels is None:
                labels = [_label(np.append(row, target)) for row, target in zip(x, y)]
            labels = np.asarray(labels, dtype=np.int64).reshape(-1)
            if len(labels) != len(y):
                raise ValueError(f"LabelledSamples.{name} needs one label per row: {len(labels)} for {len(y)} rows.")
            object.__setattr__(self, name, labels)

    @classmethod
    def empty(cls) -> LabelledSamples:
        """No samples."""
        return cls(
            np.zeros((0, len(STAGE_FEATURES))),
            np.zeros(0),
            np.zeros((0, len(BOUNDARY_FEATURES))),
            np.zeros(0),
        )

    @classmethod
    def concat(cls, parts: list[LabelledSamples]) -> LabelledSamples:
        """All rows of ``parts``, in order; those without rows aside, they must share one :attr:`fixed_s`.

        Raises:
            ValueError: parts whose stage rows were built with different fixed costs.
        """
        fixed = {p.fixed_s for p in parts if len(p.stage_y) or len(p.boundary_y)}
        if len(fixed) > 1:
            raise ValueError(
                f"Labelled samples built with different fixed costs per micro-batch ({sorted(fixed)} s) cannot be "
                "mixed: their residuals are over different priors."
            )
        if not parts:
            return cls.empty()
        return cls(
            np.concatenate([p.stage_x for p in parts]),
            np.concatenate([p.stage_y for p in parts]),
            np.concatenate([p.boundary_x for p in parts]),
            np.concatenate([p.boundary_y for p in parts]),
            fixed.pop() if fixed else 0.0,
            np.concatenate([p.windows("stage") for p in parts]),
            np.concatenate([p.windows("boundary") for p in parts]),
        )

    def windows(self, kind: str) -> IntArray:
        """:attr:`stage_window` (``kind="stage"``) or :attr:`boundary_window` (``"boundary"``), never ``None``."""
        labels = self.stage_window if kind == "stage" else self.boundary_window
        assert labels is not None  # filled in by __post_init__
        return labels

    def __len__(self) -> int:
        return len(self.stage_y)


_FLOOR_S = 1e-9  # a measured time of 0 (no transfer on this machine) has no log; such rows are left out


def samples_from_windows(
    model_cost: ModelCost,
    comm: CommModel,
    before: PipelineWindow,
    after: PipelineWindow,
    quiet: QuietReadings | None = None,
    fixed_s: float = 0.0,
) -> LabelledSamples:
    """Labelled samples: the environment measured in ``before``, the layers and times measured in ``after``.

    ``after`` may run the same partition (the next window: how the environment carries forward) or another one
    (a migration's outcome, or a calibration run of another layer set under the same interference). ``quiet`` and
    ``fixed_s``: the readings and the fixed cost known when ``before`` was priced (the rows and priors are those a
    prediction from ``before`` used).
    """
    cand = after.partition
    sx = stage_rows(model_cost, before, cand, quiet, fixed_s, comm.cpu_s_per_byte)
    prior = stage_priors(model_cost, before, cand, quiet, fixed_s, comm.cpu_s_per_byte)
    measured = np.asarray([effective_compute_s(t) / after.num_microbatches for t in after.stages])
    keep = (prior > _FLOOR_S) & (measured > _FLOOR_S)
    sy = np.log(np.where(keep, measured, 1.0) / np.where(keep, prior, 1.0))
    bx = boundary_rows(model_cost, comm, before, cand)
    bprior = boundary_priors(model_cost, comm, before, cand)
    bmeasured = np.asarray([m for m, _ in measured_message_s(after)])
    bkeep = (bprior > _FLOOR_S) & (bmeasured > _FLOOR_S)
    by = np.log(np.where(bkeep, bmeasured, 1.0) / np.where(bkeep, bprior, 1.0))
    label = window_label(after)
    return LabelledSamples(
        sx[keep],
        sy[keep],
        bx[bkeep],
        by[bkeep],
        fixed_s,
        np.full(int(keep.sum()), label, dtype=np.int64),
        np.full(int(bkeep.sum()), label, dtype=np.int64),
    )


def window_label(window: PipelineWindow) -> int:
    """A label of ``window`` from what it measured: the same on every rank and in every process, and (but for a
    collision of 32-bit checksums) different for windows that measured anything differently."""
    values = [float(window.num_microbatches), *map(float, window.partition.balance)]
    for t in window.stages:
        values += [float(v) if v is not None else math.nan for v in vars(t).values()]
    return _label(np.asarray(values, dtype=np.float64))


def _label(values: FloatArray) -> int:
    return zlib.crc32(np.ascontiguousarray(values, dtype=np.float64).tobytes())
