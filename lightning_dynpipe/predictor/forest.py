"""The random-forest predictor: the residual over an analytic prior, with calibrated intervals, trained here.

:class:`ForestPredictor` prices a candidate partition from a measured window (see
:mod:`~lightning_dynpipe.predictor.features` for the rows and the priors). Two small scikit-learn forests (one
for stages, one for boundaries) predict the log ratio of the measured time to the prior; the answer is
``prior * exp(residual)``. Without samples the residual is 0, so an untrained forest answers its prior: each stage
priced as the baseline :class:`~lightning_dynpipe.predictor.MeasuredSlowdownPredictor` prices it, in seconds rather
than relative to the least slowed stage. Like the baseline, the forest remembers the windows it observes: once a
stage has read quiet under the layers it holds, the excess of that reading over the pipeline's speed is a fixed cost
per micro-batch in its prior, not a stretch of the layers it would receive (the rows say how much of the prior that
is, so rows priced either way train one forest).

**Anchored to the window.** The window measured its own partition, so that partition needs no prediction: each
stage's compute per micro-batch (under a CPU limit, at least its CPU over the limit) and each boundary's message
time are known. What the forest can add is how a candidate's stage differs from it. So by default
(``anchored=True``) a fitted forest prices the window's own partition too, and shifts every candidate's residual for
stage ``k`` by what it got wrong about stage ``k`` there: a candidate's stage is priced at
``prior * exp(r_cand) * measured_own / (prior_own * exp(r_own))``, its interval shifted alike; boundaries the same.
The window's own partition is then priced at what it measured. Without it, where the forest mispriced the running
partition it mispriced every candidate by about as much, and a saving, a share of the measured step, looked smaller
or larger than it is: on the CNN under a quarter-core quota on its last stage, a forest trained by the set-up sweep
priced the running partition at 69 ms per step against 106 measured (the sweep's worker, throttled alone, ran
faster than a pipeline stage's process does under the same quota). The prior itself is not always the measurement:
its slowdown is at least 1 where the stage has a quiet reading, so a stage that ran faster than its profile could be
priced at its profile.

**Intervals.** Each tree predicts a residual; the interval starts as the trees' 5th to 95th percentile and is
widened (or narrowed) by a constant: the smallest that makes ``coverage`` of the calibration intervals hold the
measured value (split-conformal calibration: forests fitted on two of three folds of the rows give the intervals of
the third). Which constant depends on the candidate stage's layer set:

* one the training rows hold (measured under some scenario, by the sweep or in this run) gets the constant of folds
  split by measured window (:attr:`~lightning_dynpipe.predictor.features.LabelledSamples.stage_window`: the rows
  paired with one window share its noise, so they are held out together; out of bag, where a held-out row's twins
  stay in the trees, if that is larger);
* one never measured gets the larger constant of folds split by layer set, so that a partition that never ran is
  covered too.

Both constants are calibrated apart for two strata of stage rows (Mondrian conformal calibration,
``stratified=True``, the default): stages whose environment shows interference by the monitor's thresholds
(:data:`~lightning_dynpipe.monitor.stats.INTERFERENCE_SIGNS`: a CPU limit below one core, other processes' load on
its cores, its main thread waiting for a core, a throttled GPU) and quiet ones, each from its own rows' scores. One
constant for both covered the quiet stages nearly always and the interfered ones far less often than nominal (on a
CNN sweep, held-out scenario types: 100% and 64% at a nominal 90%), because an interfered stage's time is far less
certain and the trees' spread does not show how much. A stratum with fewer than :data:`MIN_STRATUM_SCORES` scores
in a calibration keeps the pooled constants.

The boundary forest does the same by message size. ``tests/predictor/test_forest.py`` checks the coverage on
held-out rows and windows, ``benchmarks/predictor.py`` on held-out scenarios (layer sets measured) and on partitions
never run.

**Determinism.** Fixed ``random_state``, one thread, and rows in the order they were observed: the same samples
give the same forest on every rank, so every rank prices candidates the same.

**Online refits.** :meth:`ForestPredictor.observe` turns each window into labelled samples (its environment
paired with the next window's times, under the same partition or, after a migration, under the new one) in a
bounded buffer. An untrained forest fits as soon as the buffer holds ``min_samples`` rows (by default
:func:`conformal_min_rows`, 9 at a coverage of 0.9); until then it answers its prior, a point. After that, every
``refit_every`` observed windows it copies the buffer and refits, unless the forest already explains the new rows:
with ``refit_on="miss"`` (the default) a fitted forest refits only when more of the rows observed since its last
refit fell outside their intervals than its nominal miss rate (``1 - coverage``) gives with probability 5% (a
binomial test). A refit costs CPU (several forest fits), and on a stage under a CPU limit the
refit process's CPU comes out of that stage's limit; ``refit_on="every"`` refits on schedule. Refits run in a child
process at the lowest CPU priority (nice 19 and ``SCHED_IDLE``; :mod:`~lightning_dynpipe.predictor.refit`: a refit
thread would share the training thread's GIL, and stalled the pipeline on a contended core; a thread is the
fallback where no process can be started), which the strategy starts at set-up and lets finish its imports before
the first step (:meth:`ForestPredictor.prepare`).
The observations are the monitor's
snapshots, identical and in the same order on every rank, so every rank starts refit number ``n`` at the same
check, from the same rows, with the same seed, and fits the same forest. The ranks then switch to it at the same
check without waiting for it:

* in a fit, each rank publishes :meth:`ForestPredictor.ready_refit` (the newest refit finished on this rank) with
  its monitor report (``StageReport.token``, part of the all-gather the monitor does anyway); every rank sees
  every rank's number, and all switch at the first snapshot whose smallest number reaches ``n``
  (``observe(..., agreed_refit=snapshot.agreed_token)``). A slow refit delays the switch; it never stalls a step;
* used alone (no ``agreed_refit``), it switches ``adopt_after`` observations after the refit started, waiting for
  the refit there if it is still running (logged).

**One rank refits** while a process of the fit runs under a CPU limit (``one_rank_refits="auto"``, the default;
``True``: always). In a fit of several processes the strategy then calls
:meth:`ForestPredictor.share_refits`: each refit runs on one rank, :attr:`ForestPredictor.refit_rank`, which the
strategy sets at every check from the snapshot (every rank sees the same snapshot, so all name the same rank;
:func:`~lightning_dynpipe.strategy.adaptation.refit_rank`; ``None``, every rank fits its own, under ``"auto"`` while no
process reports a cgroup CPU limit): within a limit a refit's CPU is taken from the limit whatever its priority (on
the CNN under a quarter-core quota on its last stage, the ten steps in which every rank refitted took 1.8-2.8x as long
as the median ten, and over 300 steps the fit ran at 56.1 ms per step against 48.0 with one rank refitting:
benchmarks/results/2026-12-08-refits-under-a-limit.md). The rank is
:func:`~lightning_dynpipe.strategy.adaptation.spare_cpu_rank`: with the refits on any core (``refit_cores="any"``,
the default), the process with the highest CPU limit, then the most spare CPU, so that a stage under a CPU limit
refits only when every stage is limited (its refit process's CPU would come out of its limit); with the refits on
their own cores, the process with the most spare CPU on its cores. The other ranks report the refit as finished, so
the switch comes when the fitting rank's is done, at the same check on every rank as before, and at the switch every
rank receives its forests in one broadcast on the monitor's CPU process group (:meth:`StageMonitor.broadcast_object
<lightning_dynpipe.monitor.callback.StageMonitor.broadcast_object>`): byte for byte the same forests everywhere.
Without a CPU limit every rank fits the same forest from the same rows (``one_rank_refits=False``: always): the same
answer for ``S x R`` times the CPU, at the lowest priority in idle time, and no broadcast; on the 2-core benchmark
machine without a limit the shared refits measured about 2% fewer samples/s than that (the cause not located).

**Files.** :meth:`ForestPredictor.save` writes the training rows, the hyperparameters, the feature schema and the
library versions to an ``.npz`` file (no pickle); :meth:`ForestPredictor.load` checks the schema and refits
from the rows (deterministic, well under a second for calibration-sized data). Nothing executable is ever
read from a file.

scikit-learn is imported on the first fit.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.monitor.stats import INTERFERENCE_SIGNS
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor.base import Interval, PartitionPrediction, PipelineWindow
from lightning_dynpipe.predictor.features import (
    BOUNDARY_FEATURES,
    FEATURE_SCHEMA,
    STAGE_FEATURES,
    FeatureSchema,
    LabelledSamples,
    QuietReadings,
    boundary_priors,
    boundary_rows,
    effective_compute_s,
    measured_message_s,
    samples_from_windows,
    stage_priors,
    stage_rows,
)
from lightning_dynpipe.predictor.measured import MeasuredSlowdownPredictor
from lightning_dynpipe.predictor.refit import RefitProcess

__all__ = ["ForestPredictor", "QuantileForest", "FILE_FORMAT", "MIN_STRATUM_SCORES", "RELATIVE_STAGE_FEATURES"]

log = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]

FILE_FORMAT = "dynpipe-forest/1"
"""The format tag of :meth:`ForestPredictor.save` files."""

_PROFILE_COL = STAGE_FEATURES.index("candidate_profile_ms")
_LAYERS_COL = STAGE_FEATURES.index("candidate_num_layers")
_BYTES_COL = BOUNDARY_FEATURES.index("candidate_mib")
_LIMIT_COL = STAGE_FEATURES.index("cpu_limit_cores")
_OTHER_COL = STAGE_FEATURES.index("other_cpu_load")
_WAIT_COL = STAGE_FEATURES.index("run_queue_wait_share")
_THROTTLED_COL = STAGE_FEATURES.index("gpu_throttled")
_SKLEARN_HINT = "The forest predictor needs scikit-learn: pip install 'scikit-learn>=1.3'"
_TREE_QUANTILES = (0.05, 0.95)
_Scores = tuple[npt.NDArray[np.intp], FloatArray]  # the rows a calibration scored, and their conformity scores
_NO_SCORES: _Scores = (np.zeros(0, dtype=np.intp), np.zeros(0))

MIN_STRATUM_SCORES = 20
"""Conformity scores a stratum needs in a calibration for its own margin (:meth:`QuantileForest.fit`); with fewer,
its rows keep the pooled one."""
RELATIVE_STAGE_FEATURES: tuple[str, ...] = tuple(
    c
    for c in STAGE_FEATURES
    if c
    not in (
        "measured_profile_ms",
        "candidate_profile_ms",
        "candidate_param_mib",
        "candidate_activation_out_mib",
        "candidate_working_set_mib",
        "candidate_num_layers",
        "pace_ms",
        "rss_mib",
    )
)
"""The stage columns without what names a layer set or a model (profiles in ms, bytes, layer counts, the other
stages' pace in ms, the process's RSS): the environment, the stage's measured stretch and duty, and the candidate's
work relative to what the stage held (``ForestPredictor(stage_features=RELATIVE_STAGE_FEATURES)``)."""
_FLOOR_S = 1e-9  # as the rows': a time of 0 (no transfer measured) has no log ratio; such a stage is not anchored


def _sklearn_forest() -> Any:
    try:
        from sklearn.ensemble import RandomForestRegressor
    except ImportError as exc:  # pragma: no cover - scikit-learn is a dependency of the package
        raise ConfigurationError(f"{_SKLEARN_HINT} ({exc}), or use predictor='measured'.") from exc
    return RandomForestRegressor


def _library_versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("lightning-dynpipe", "scikit-learn", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "unknown"
    return out


class QuantileForest:
    """A random forest regressor whose intervals are its trees' spread, calibrated out of bag.

    Example::

        forest = QuantileForest(n_estimators=32, coverage=0.9, random_state=0).fit(x, y, groups=g)
        value, low, high = forest.predict(x_new, groups=g_new)

    Attributes:
        margin: the constant added to the trees' spread for a row of a group the trees never saw (the largest of
            the calibrations; without groups, :attr:`seen_margin`).
        seen_margin: the constant for a row of a group among the training rows' (held out by window, or out of
            bag, the larger).
        stratum_margins: ``(seen_margin, margin)`` of each stratum :meth:`fit` calibrated on its own rows' scores.

    Args:
        n_estimators: trees (small: the forest is queried at every check).
        min_samples_leaf: rows per leaf at least (smooths the residual).
        coverage: the share of held-out values the intervals should contain.
        random_state: the seed (fixed: every rank must fit the same trees).
    """

    def __init__(
        self, *, n_estimators: int = 32, min_samples_leaf: int = 3, coverage: float = 0.9, random_state: int = 0
    ) -> None:
        if n_estimators < 2 or min_samples_leaf < 1 or not 0.0 < coverage < 1.0:
            raise ConfigurationError(
                f"QuantileForest needs n_estimators >= 2, min_samples_leaf >= 1 and 0 < coverage < 1; got "
                f"{n_estimators}, {min_samples_leaf}, {coverage}. The defaults are 32, 3 and 0.9."
            )
        self.n_estimators = n_estimators
        self.min_samples_leaf = min_samples_leaf
        self.coverage = coverage
        self.random_state = random_state
        self._trees: list[Any] = []
        self.margin = 0.0
        self.seen_margin = 0.0
        self.stratum_margins: dict[Any, tuple[float, float]] = {}
        self._seen: frozenset[Any] = frozenset()
        self.importances: FloatArray = np.zeros(0)
        self.fit_s = 0.0

    @property
    def fitted(self) -> bool:
        """Whether :meth:`fit` has run."""
        return bool(self._trees)

    def _score_level(self, n: int) -> float:
        return min(1.0, math.ceil((n + 1) * self.coverage) / n)

    def fit(
        self,
        x: FloatArray,
        y: FloatArray,
        groups: npt.ArrayLike | None = None,
        windows: npt.ArrayLike | None = None,
        strata: npt.ArrayLike | None = None,
    ) -> QuantileForest:
        """Fits the trees on rows ``x`` and targets ``y`` and calibrates the interval margins.

        Both margins are split-conformal: forests fitted on two of three folds of the rows give the intervals of
        the third, and the margin is the smallest that makes ``coverage`` of them hold the measured values.

        Args:
            x: rows.
            y: targets.
            groups: optional group label per row (e.g. the candidate's layer set). With three groups or more,
                rows of a group the trees never saw get :attr:`margin`, calibrated on folds split by group;
                rows of the training groups get :attr:`seen_margin` (:meth:`predict` tells them apart by the labels
                it is given).
            windows: optional label per row of the measurement its target comes from (rows of one measurement
                share its noise). With three labels or more, :attr:`seen_margin` is calibrated on folds split by
                it, scored on the held-out rows whose group the other folds hold; without, out of bag (each row
                scored by the trees that did not draw it, which may have drawn rows sharing its noise).
            strata: optional label per row of a kind of row whose errors differ from the others' (e.g. a stage
                under interference or not). Each stratum with at least :data:`MIN_STRATUM_SCORES` scores of a
                calibration gets its own margins from its own rows' scores (Mondrian conformal calibration: the
                coverage then holds within each stratum, not only over all rows); the others keep the pooled
                margins. :meth:`predict` takes the strata of the rows it prices.
        """
        t0 = time.perf_counter()
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.asarray(y, dtype=np.float64)
        trees, importances, oob = self._fit_trees(x, y, calibrate=True)
        keys = np.asarray(groups) if groups is not None else None
        held = self._fold_scores(x, y, np.asarray(windows), keys) if windows is not None else _NO_SCORES
        by_group = _NO_SCORES
        seen: frozenset[Any] = frozenset()
        if keys is not None and len(np.unique(keys)) >= 3:
            by_group = self._fold_scores(x, y, keys, None)
            seen = frozenset(keys.tolist())
        everything = np.ones(len(y), dtype=bool)
        pooled = self._margins(oob, held, by_group, everything, minimum=1, grouped=bool(seen))
        assert pooled is not None  # with minimum=1, every calibration that has scores has scores of all rows
        self.seen_margin, self.margin = pooled
        self.stratum_margins = {}
        if strata is not None:
            labels = np.asarray(strata)
            for label in np.unique(labels).tolist():
                member = labels == label
                pair = self._margins(oob, held, by_group, member, minimum=MIN_STRATUM_SCORES, grouped=bool(seen))
                if pair is not None:
                    self.stratum_margins[label] = pair
        self._trees, self.importances, self._seen = trees, importances, seen
        self.fit_s = time.perf_counter() - t0
        return self

    def _margins(
        self,
        oob: _Scores,
        held: _Scores,
        by_group: _Scores,
        member: npt.NDArray[np.bool_],
        *,
        minimum: int,
        grouped: bool,
    ) -> tuple[float, float] | None:
        """``(seen_margin, margin)`` from the scores of the rows in ``member``.

        The calibrations used are those with scores for all rows: out of bag with at least 5 (else a margin of 0),
        held out by window, and (``grouped``) held out by group, which only :attr:`margin` takes. ``None`` where
        ``member`` has fewer than ``minimum`` scores in one of them (a stratum too small for its own margins)."""
        used = [(oob, 5), (held, 1)] + ([(by_group, 1)] if grouped else [])
        found: list[float | None] = []
        for (rows, values), at_least in used:
            if len(values) < at_least:
                found.append(None)
                continue
            mine = values[member[rows]]
            if len(mine) < max(at_least, minimum):
                return None
            found.append(self._conformal(mine))
        seen_margin = max((q for q in found[:2] if q is not None), default=0.0)
        unseen = found[2] if grouped else None
        return seen_margin, max(seen_margin, unseen) if unseen is not None else seen_margin

    def _conformal(self, scores: FloatArray) -> float:
        return float(np.quantile(scores, self._score_level(len(scores)), method="higher"))

    def _fold_scores(self, x: Any, y: FloatArray, labels: Any, groups: Any) -> _Scores:
        """The rows held out three folds at a time by ``labels`` (none with fewer than three labels) and their
        conformity scores; with ``groups``, only the held-out rows whose group the training folds hold."""
        index = np.unique(labels, return_inverse=True)[1]
        if index.max(initial=0) < 2:
            return _NO_SCORES
        fold = index % 3
        rows, scores = [], []
        for f in range(3):
            out = fold == f
            if groups is not None:
                out &= np.isin(groups, groups[~out])
            if not out.any():
                continue
            held, _, _ = self._fit_trees(x[fold != f], y[fold != f], calibrate=False)
            lo, hi = np.quantile(np.stack([t.predict(x[out])[:, 0] for t in held]), _TREE_QUANTILES, axis=0)
            rows.append(np.flatnonzero(out))
            scores.append(np.maximum(lo - y[out], y[out] - hi))
        if not rows:
            return _NO_SCORES
        return np.concatenate(rows), np.concatenate(scores)

    def _fit_trees(self, x: Any, y: FloatArray, *, calibrate: bool) -> tuple[list[Any], FloatArray, _Scores]:
        """The trees, their feature importances and (with ``calibrate``) the out-of-bag rows and scores."""
        forest = _sklearn_forest()(
            n_estimators=self.n_estimators,
            min_samples_leaf=self.min_samples_leaf,
            max_features=0.6,
            random_state=self.random_state,
            n_jobs=1,
        ).fit(x, y)
        trees = [est.tree_ for est in forest.estimators_]
        importances = np.asarray(forest.feature_importances_, dtype=np.float64)
        if not calibrate:
            return trees, importances, _NO_SCORES
        per_tree = np.stack([t.predict(x)[:, 0] for t in trees])  # (T, n)
        in_bag = np.zeros_like(per_tree, dtype=bool)
        for t, rows in enumerate(forest.estimators_samples_):
            in_bag[t, rows] = True
        oob = np.where(in_bag, np.nan, per_tree)
        seen = (~in_bag).sum(axis=0) >= 2
        if not seen.any():
            return trees, importances, _NO_SCORES
        lo, hi = np.nanquantile(oob[:, seen], _TREE_QUANTILES, axis=0)
        return trees, importances, (np.flatnonzero(seen), np.maximum(lo - y[seen], y[seen] - hi))

    def predict(
        self, x: FloatArray, groups: npt.ArrayLike | None = None, strata: npt.ArrayLike | None = None
    ) -> tuple[FloatArray, FloatArray, FloatArray]:
        """``(value, low, high)`` per row; ``low <= value <= high``.

        Args:
            x: rows.
            groups: the rows' group labels, as :meth:`fit` took them: a row of a training group gets
                :attr:`seen_margin`, any other row :attr:`margin`. Without labels every row gets :attr:`margin`.
            strata: the rows' strata, as :meth:`fit` took them: a row of a stratum with its own margins
                (:attr:`stratum_margins`) gets those instead of the pooled ones.
        """
        if not self._trees:
            raise ConfigurationError("QuantileForest.predict needs a fitted forest; call fit(x, y) first.")
        x = np.ascontiguousarray(x, dtype=np.float32)
        per_tree = np.stack([t.predict(x)[:, 0] for t in self._trees])
        value = per_tree.mean(axis=0)
        lo, hi = np.quantile(per_tree, _TREE_QUANTILES, axis=0)
        known = (
            np.asarray([g in self._seen for g in np.asarray(groups).tolist()], dtype=bool)
            if groups is not None and self._seen
            else np.zeros(len(value), dtype=bool)
        )
        labels = np.asarray(strata).tolist() if strata is not None else [None] * len(value)
        margin = np.asarray(
            [
                self.stratum_margins.get(label, (self.seen_margin, self.margin))[0 if is_known else 1]
                for label, is_known in zip(labels, known.tolist())
            ],
            dtype=np.float64,
        ).reshape(len(value))
        lo, hi = lo - margin, hi + margin
        return value, np.minimum(lo, value), np.maximum(hi, value)


_Pair = tuple["QuantileForest | None", "QuantileForest | None"]


@dataclass
class _Refit:
    """A refit in flight: in the refit process (``thread`` is ``None``), or in a thread where no process starts."""

    adopt_at: int
    started: int
    number: int
    thread: threading.Thread | None = None
    result: _Pair | None = None
    done: bool = False
    remote: bool = False  # another rank fits it; this rank receives its forests at the switch
    src: int | None = None  # with shared refits, the rank that fits it; None: every rank fits its own


class ForestPredictor:
    """The :class:`~lightning_dynpipe.predictor.base.InterferencePredictor` of the random forest (see the module).

    Example::

        predictor = ForestPredictor.load("dynpipe-forest.npz")     # from `python -m lightning_dynpipe calibrate`
        DynPipeStrategy(predictor=predictor)
        # or untrained, learning from the run's own windows:
        DynPipeStrategy(predictor="forest")

    Args:
        n_estimators: trees per forest (stages and boundaries each have one).
        min_samples_leaf: rows per leaf at least.
        coverage: the nominal coverage of the intervals.
        random_state: the seed.
        min_samples: rows a forest needs before it is fitted (until then the prior is the answer, with no
            interval); ``None``: the fewest whose conformal quantile at ``coverage`` is a score
            (:func:`conformal_min_rows`: 9 at 0.9). An untrained forest fits as soon as it has them; a fitted one
            refits every ``refit_every`` windows.
        buffer_size: online rows kept (oldest dropped first); calibration rows given to :meth:`fit` are kept.
        refit_every: observed windows between two refits.
        adopt_after: observed windows from a refit's start to the switch to its forest (>= 1).
        refit_on: ``"miss"``: a fitted forest refits only when the rows observed since its last refit fall outside
            their intervals more often than ``1 - coverage`` explains (a binomial test at 5%); ``"every"``: every
            ``refit_every`` windows.
        one_rank_refits: in a fit of several processes, run each refit on one rank only, the one with the most
            CPU to spare (with ``refit_cores="any"``, the highest CPU limit first), and send its forests to the
            others (see "One rank refits" in the module): ``"auto"`` (the default) while a process of the fit runs
            under a cgroup CPU limit, whose quota a refit would spend (on the CNN under a quarter-core quota, 1.17x
            the time per step with every rank refitting: benchmarks/results/2026-12-08-refits-under-a-limit.md),
            every rank its own otherwise; ``True`` always (without a limit, on the 2-core benchmark machine, about
            2% fewer samples/s than every rank refitting: benchmarks/results/2026-12-04-one-rank-refits.md);
            ``False`` never.
        refit_cores: where the refit process may run: ``"own"``, the cores this process may use (a stage pinned
            to its core pins its refits too), or ``"any"``, every core the machine lets it use (a cgroup cpuset
            still applies). At the lowest priority a refit then runs in any core's idle time, such as what a CPU
            limit leaves of another stage's core. ``"any"`` by default: under CPU limits on the CNN's last stage,
            with ``"own"`` the refits of the unlimited stage, which keeps its core busy, waited: the forest first
            switched to a refit at step 131-261 in 9 runs of 11 and not within the other two, and answered its prior,
            a point, at the checks before; with ``"any"`` at step 71 in every run
            (benchmarks/results/2026-12-07-refit-any.md).
            Where the stages are not pinned (a plain Lightning fit pins nothing) the two are the same.
        anchored: price each candidate relative to the window's own partition (see "Anchored to the window" in
            the module): a candidate's stage carries what the forest got wrong about the same stage under the
            partition the window measured, so that partition is priced at what it measured. ``False``: each
            candidate at its prior times the forest's residual alone.
        stratified: calibrate the stage intervals separately for stages whose environment shows interference and
            for quiet ones (see "Intervals" in the module), so that each kind's intervals hold ``coverage`` of its
            values. ``False``: one margin for all stages.
        stage_features: the columns of :data:`~lightning_dynpipe.predictor.features.STAGE_FEATURES` the stage trees
            may split on (``None``: all). The rows keep every column either way (a file, the refits); e.g.
            :data:`RELATIVE_STAGE_FEATURES` leaves out what names a layer set (its profile, bytes and layer
            count), so the trees cannot learn a residual per layer set from a sweep's noisy readings of it.
    """

    def __init__(
        self,
        *,
        n_estimators: int = 32,
        min_samples_leaf: int = 3,
        coverage: float = 0.9,
        random_state: int = 0,
        min_samples: int | None = None,
        buffer_size: int = 2048,
        refit_every: int = 5,
        adopt_after: int = 2,
        refit_on: str = "miss",
        one_rank_refits: bool | Literal["auto"] = "auto",
        refit_cores: Literal["own", "any"] = "any",
        anchored: bool = True,
        stratified: bool = True,
        stage_features: Sequence[str] | None = None,
    ) -> None:
        QuantileForest(n_estimators=n_estimators, min_samples_leaf=min_samples_leaf, coverage=coverage)  # validates
        if min_samples is None:
            min_samples = conformal_min_rows(coverage)
        if min_samples < 2 or buffer_size < 1 or refit_every < 1 or adopt_after < 1:
            raise ConfigurationError(
                f"ForestPredictor needs min_samples >= 2, buffer_size >= 1, refit_every >= 1 and adopt_after >= 1; "
                f"got {min_samples}, {buffer_size}, {refit_every}, {adopt_after}."
            )
        if refit_on not in ("miss", "every"):
            raise ConfigurationError(
                f"ForestPredictor's refit_on must be 'miss' (refit when new rows fall outside their intervals more "
                f"often than 1 - coverage) or 'every' (every refit_every windows); got {refit_on!r}."
            )
        self.n_estimators = n_estimators
        self.min_samples_leaf = min_samples_leaf
        self.coverage = coverage
        self.random_state = random_state
        self.min_samples = min_samples
        self.buffer_size = buffer_size
        self.refit_every = refit_every
        self.adopt_after = adopt_after
        self.refit_on = refit_on
        if one_rank_refits not in (True, False, "auto"):
            raise ConfigurationError(
                f"ForestPredictor(one_rank_refits=...) takes True (one rank fits every refit), False (every rank fits "
                f"its own) or 'auto' (one rank while a process of the fit runs under a CPU limit); got "
                f"{one_rank_refits!r}."
            )
        self.one_rank_refits: bool | Literal["auto"] = one_rank_refits
        if refit_cores not in ("own", "any"):
            raise ConfigurationError(
                f"ForestPredictor(refit_cores=...) takes 'own' (the refit process runs on this process's cores) or "
                f"'any' (on every core the machine lets it use); got {refit_cores!r}."
            )
        self.refit_cores = refit_cores
        if not isinstance(anchored, bool):
            raise ConfigurationError(f"ForestPredictor(anchored=...) takes True or False; got {anchored!r}.")
        self.anchored = anchored
        if not isinstance(stratified, bool):
            raise ConfigurationError(f"ForestPredictor(stratified=...) takes True or False; got {stratified!r}.")
        self.stratified = stratified
        if stage_features is not None:
            unknown = sorted(set(stage_features) - set(STAGE_FEATURES))
            if unknown or not stage_features:
                raise ConfigurationError(
                    f"ForestPredictor(stage_features=...) takes a non-empty list of stage columns; got "
                    f"{list(stage_features)!r} (unknown: {unknown}). The columns: {list(STAGE_FEATURES)}."
                )
        self.stage_features: tuple[str, ...] | None = (
            tuple(c for c in STAGE_FEATURES if c in set(stage_features)) if stage_features is not None else None
        )
        self._stage_cols = (
            np.asarray([STAGE_FEATURES.index(c) for c in self.stage_features], dtype=np.intp)
            if self.stage_features is not None
            else np.arange(len(STAGE_FEATURES), dtype=np.intp)
        )
        self.schema: FeatureSchema = FEATURE_SCHEMA
        self._base = LabelledSamples.empty()
        self._online: deque[LabelledSamples] = deque()
        self._online_rows = 0
        self._stage: QuantileForest | None = None
        self._boundary: QuantileForest | None = None
        self._last: PipelineWindow | None = None
        # the quiet readings of the observed windows (the baseline's memory), for the profile they were taken under
        self._quiet = MeasuredSlowdownPredictor()
        self._quiet_cost: ModelCost | None = None
        self._observed = 0
        self._since_refit = 0
        self._rows_since_refit = 0  # stage and boundary rows observed since the last refit started
        self._misses_since_refit = 0  # of those, outside the interval of the forest in use when observed
        self.refits_skipped = 0
        """Refits not started because the forest explained the new rows (``refit_on="miss"``)."""
        self._refit: _Refit | None = None
        self._worker: RefitProcess | None = None
        self.refit_in_process = True
        """Refit in a child process (:mod:`~lightning_dynpipe.predictor.refit`); ``False``: in a thread."""
        self._refits_started = 0
        self.refits = 0
        """Refits adopted so far."""
        self.refits_fitted = 0
        """Refits started on this rank (all of them unless refits are shared: :meth:`share_refits`)."""
        self._refit_cpu_s = 0.0  # refits' CPU of closed refit processes and of refit threads
        self._rank: int | None = None  # this process's global rank when refits are shared
        self._broadcast: Callable[[Any, int], Any] | None = None
        self.refit_rank: int | None = 0
        """With shared refits (:meth:`share_refits`), the global rank that runs the next refit; ``None``: every rank
        runs its own (``one_rank_refits="auto"`` while no process of the fit runs under a CPU limit)."""
        self.share_s = 0.0
        """Seconds spent in the broadcasts of shared refits (:meth:`share_refits`), waits for the fitting rank
        included."""

    # ------------------------------------------------------------------ training
    def _forest(self) -> QuantileForest:
        return QuantileForest(
            n_estimators=self.n_estimators,
            min_samples_leaf=self.min_samples_leaf,
            coverage=self.coverage,
            random_state=self.random_state,
        )

    def fit_pair(self, samples: LabelledSamples) -> _Pair:
        """The stage and boundary forests fitted on ``samples`` (``None`` for one with too few rows); what a refit
        computes (in the refit process)."""
        stage = boundary = None
        if len(samples) >= self.min_samples:
            stage = self._forest().fit(
                samples.stage_x[:, self._stage_cols],
                samples.stage_y,
                groups=_layer_sets(samples.stage_x),
                windows=samples.windows("stage"),
                strata=_strata(samples.stage_x) if self.stratified else None,
            )
        if len(samples.boundary_y) >= self.min_samples:
            boundary = self._forest().fit(
                samples.boundary_x,
                samples.boundary_y,
                groups=_sizes(samples.boundary_x),
                windows=samples.windows("boundary"),
            )
        return stage, boundary

    def fit(self, samples: LabelledSamples) -> ForestPredictor:
        """Fits both forests now on ``samples`` (e.g. a calibration sweep's) plus the online buffer; returns self.

        These rows stay in every later refit (they are not part of the bounded online buffer). Their fixed cost
        per micro-batch and stage (:attr:`LabelledSamples.fixed_s`) becomes the one every later row and prediction
        is priced with; rows observed before under another one are dropped (their residuals are over another prior).
        """
        _check_columns(samples)
        if self._online and self._online[0].fixed_s != samples.fixed_s:
            log.info(
                "DynPipe forest: dropping %d observed rows priced with a fixed cost of %.3g ms per micro-batch; the "
                "new rows use %.3g ms.",
                self._online_rows,
                self._online[0].fixed_s * 1e3,
                samples.fixed_s * 1e3,
            )
            self._online.clear()
            self._online_rows = 0
        self._base = samples
        self._stage, self._boundary = self.fit_pair(self.samples)
        return self

    @property
    def fixed_s(self) -> float:
        """The fixed cost per micro-batch and stage this forest's priors carry (the calibration rows'; 0 without
        any, :func:`~lightning_dynpipe.predictor.features.estimate_fixed_s`)."""
        return self._base.fixed_s

    @property
    def samples(self) -> LabelledSamples:
        """Every row a refit would use: the calibration rows, then the online buffer, oldest first."""
        return LabelledSamples.concat([self._base, *self._online])

    @property
    def fitted(self) -> bool:
        """Whether the stage forest is trained (until then the prior is the answer)."""
        return self._stage is not None

    def observe(
        self, model_cost: ModelCost, comm: CommModel, window: PipelineWindow, agreed_refit: int | None = None
    ) -> None:
        """Records one monitor window (call it once per check, before :meth:`predict`, with the same window on
        every rank); see the module docstring for when refits start and are adopted.

        Args:
            model_cost: the set-up profile.
            comm: the link model.
            window: the check's window.
            agreed_refit: the smallest :meth:`ready_refit` of all ranks (from the monitor's snapshot); ``None``:
                switch ``adopt_after`` observations after a refit started.
        """
        self._observed += 1
        self._ensure_worker()  # started early: it imports scikit-learn before the first refit is due
        pending = self._refit
        if pending is not None:
            if agreed_refit is not None:
                if agreed_refit >= pending.number:  # finished on every rank: no wait
                    self._adopt(pending)
            elif self._observed >= pending.adopt_at:
                late, t0 = not self._finished(pending), time.perf_counter()
                self._adopt(pending)
                if late:
                    log.warning(
                        "DynPipe forest: the refit started at window %d was not done %d windows later; waited "
                        "%.3f s for it (use a larger adopt_after or a smaller forest).",
                        pending.started,
                        self.adopt_after,
                        time.perf_counter() - t0,
                    )
        previous, self._last = self._last, window
        if previous is not None and previous.partition.num_stages == window.partition.num_stages:
            new = samples_from_windows(model_cost, comm, previous, window, self._readings(model_cost), self.fixed_s)
            if self.refit_on == "miss":  # a prediction per window, only where it decides something
                self._count_misses(new)
            self._add(new)
        self._quiet.observe(model_cost, comm, window)  # after the labels: they price from what was known then
        self._quiet_cost = model_cost
        due = self._since_refit >= self.refit_every or (self._stage is None and not self._refits_started)
        if self._refit is None and due and len(self.samples) >= self.min_samples:
            if self._explained():
                self.refits_skipped += 1
                self._since_refit = 0
            else:
                self._start_refit()

    def _readings(self, model_cost: ModelCost) -> QuietReadings | None:
        """The quiet readings of the windows observed under ``model_cost`` (``None`` under another profile)."""
        return self._quiet if self._quiet_cost is model_cost else None

    def _count_misses(self, new: LabelledSamples) -> None:
        """Counts the new rows and those outside the current forests' intervals (an unfitted forest misses all)."""
        for forest, x, y in ((self._stage, new.stage_x, new.stage_y), (self._boundary, new.boundary_x, new.boundary_y)):
            if not len(y):
                continue
            self._rows_since_refit += len(y)
            if forest is None:
                self._misses_since_refit += len(y)
                continue
            if forest is self._stage:
                _, lo, hi = forest.predict(x[:, self._stage_cols], groups=_layer_sets(x), strata=_strata(x))
            else:
                _, lo, hi = forest.predict(x, groups=_sizes(x))
            self._misses_since_refit += int(((y < lo) | (y > hi)).sum())

    def _explained(self) -> bool:
        """Whether the rows since the last refit are explained: ``refit_on="miss"``, a fitted stage forest, and no
        more of them outside their intervals than the nominal miss rate gives with probability 5% or more.

        A binomial test, because the counts are small (a few rows per window): with 90% intervals, 2 misses in 9
        rows happen 23% of the time with a forest that is right, 4 only 0.8%.
        """
        n, k = self._rows_since_refit, self._misses_since_refit
        if self.refit_on != "miss" or self._stage is None or not n:
            return False
        return _binomial_tail(n, k, 1.0 - self.coverage) >= 0.05

    def prepare(self, timeout_s: float = 60.0) -> None:
        """Pays the start-up costs before training: imports scikit-learn here (predictions and adopted refits need
        it), starts the refit process (which imports it too) and waits up to ``timeout_s`` for its imports (``0``:
        no wait).

        The strategy calls it at set-up. Without it the first window and the first adopted refit pay them during
        training, and a stage under a CPU limit pays them several times over in wall time (on the CNN under a 25%
        quota the ten steps after the first window took twice as long: benchmarks/results/
        2026-12-03-interference-calibrate.md). Without the wait the refit process imports at the lowest priority
        beside the first steps, which then ran 6-8% slower on the throughput MLP (benchmarks/results/
        2026-12-03-refit-start.md).
        """
        _sklearn_forest()
        worker = self._ensure_worker()
        if worker is None or timeout_s <= 0:
            return
        t0 = time.perf_counter()
        try:
            ready = worker.wait_ready(timeout_s)
        except RuntimeError as exc:
            self._no_worker(exc)
            return
        if not ready:
            log.warning(
                "DynPipe forest: the refit process had not imported scikit-learn after %.0f s; training starts "
                "beside its imports.",
                time.perf_counter() - t0,
            )

    def share_refits(self, *, rank: int | None, broadcast: Callable[[Any, int], Any] | None) -> None:
        """Runs each refit on one rank, :attr:`refit_rank`, the others receiving its forests (with
        ``one_rank_refits=True`` the strategy calls it at set-up, and sets :attr:`refit_rank` at every check from the
        snapshot, the same on every rank).

        Args:
            rank: this process's global rank; ``None``: every refit runs here (one process, the default).
            broadcast: a collective that every rank calls with the same refit at the same observation,
                ``broadcast(obj, src)``: rank ``src`` passes its forests (``None`` when its refit failed), the others
                ``None``, and each gets rank ``src``'s object back.

        Raises:
            ConfigurationError: a ``rank`` without a ``broadcast``, or a refit in flight.
        """
        if rank is not None and broadcast is None:
            raise ConfigurationError(
                f"ForestPredictor.share_refits(rank={rank}) needs a broadcast that brings the fitting rank's forests; "
                "got broadcast=None. Pass rank=None to refit on this rank."
            )
        if self._refit is not None:
            raise ConfigurationError(
                f"ForestPredictor.share_refits while refit {self._refit.number} is in flight; call it before the fit "
                "(close() ends a fit's refit)."
            )
        self._rank, self._broadcast = rank, broadcast
        self.refit_rank = 0

    @property
    def fits_here(self) -> bool:
        """Whether the next refit runs on this rank (see :meth:`share_refits`)."""
        return self._rank is None or self.refit_rank is None or self._rank == self.refit_rank

    def _ensure_worker(self) -> RefitProcess | None:
        """The refit process (started if needed), or ``None`` when refits run in a thread."""
        if self.refit_in_process and self._worker is None:
            try:
                self._worker = RefitProcess(self.refit_cores)
                self._worker.start()
            except OSError as exc:
                self._no_worker(exc)
        return self._worker

    def _no_worker(self, exc: Exception) -> None:
        log.warning("DynPipe forest: no refit process (%s); refitting in a thread of this process.", exc)
        self._close_worker()
        self.refit_in_process = False

    def _close_worker(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._refit_cpu_s += self._worker.cpu_s
        self._worker = None

    @property
    def refit_cpu_s(self) -> float:
        """CPU seconds spent on the refits answered so far (in the refit process or a refit thread): what the
        online learning costs beside the checks themselves."""
        return self._refit_cpu_s + (self._worker.cpu_s if self._worker is not None else 0.0)

    def _finished(self, pending: _Refit) -> bool:
        if pending.thread is not None:
            return pending.done
        if not pending.done and self._worker is not None:
            try:
                pending.done = self._worker.done()
            except RuntimeError:  # the process is gone: adopting reports it and keeps the current forest
                pending.done = True
        return pending.done

    def _adopt(self, pending: _Refit) -> None:
        """Switches to the refit's forests (waiting for it if it is still running; with shared refits, every rank
        calls it at the same observation and receives the fitting rank's forests)."""
        if pending.thread is not None:
            pending.thread.join()
        elif self._worker is not None and not pending.remote:
            try:
                pending.result = self._worker.result()
            except RuntimeError as exc:  # keep the current forest; the next refit tries again
                log.error("DynPipe forest: a refit failed; the current forest stays in use: %s", exc)
                self._close_worker()
        if self._broadcast is not None and pending.src is not None:  # one rank fitted it: every rank receives it
            t0 = time.perf_counter()
            pending.result = self._broadcast(None if pending.remote else pending.result, pending.src)
            self.share_s += time.perf_counter() - t0
        if pending.result is not None:
            self._stage, self._boundary = pending.result
            self.refits += 1
        self._refit = None

    def ready_refit(self) -> int:
        """The number of the newest refit finished on this rank (refits are numbered 1, 2, ... as they start)."""
        pending = self._refit
        if pending is None:
            return self._refits_started
        return pending.number if self._finished(pending) else pending.number - 1

    def _add(self, samples: LabelledSamples) -> None:
        if not len(samples) and not len(samples.boundary_y):
            return
        self._online.append(samples)
        self._online_rows += len(samples)
        self._since_refit += 1
        while self._online_rows > self.buffer_size and len(self._online) > 1:
            self._online_rows -= len(self._online.popleft())

    def _start_refit(self) -> None:
        self._since_refit = self._rows_since_refit = self._misses_since_refit = 0
        self._refits_started += 1
        refit = _Refit(adopt_at=self._observed + self.adopt_after, started=self._observed, number=self._refits_started)
        refit.src = self.refit_rank if self._rank is not None else None
        self._refit = refit
        if not self.fits_here:  # another rank fits it: nothing to copy, run or wait for here
            refit.remote = refit.done = True
            return
        self.refits_fitted += 1
        rows = self.samples  # a copy: later windows do not change what this refit sees
        worker = self._ensure_worker()
        if worker is not None:
            try:
                worker.submit(self._params(), rows)
                return
            except OSError as exc:
                self._no_worker(exc)

        def run() -> None:
            # The lowest priority: a background fit must not take the core from the pipeline. In a thread it shares
            # the GIL with the training thread, which can stall behind it on a contended core (see
            # lightning_dynpipe.predictor.refit): the fallback when no process can be started.
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except (AttributeError, OSError):
                pass
            cpu0 = time.thread_time()
            try:
                refit.result = self.fit_pair(rows)
            except Exception:  # keep the current forest; the next refit tries again
                log.exception("DynPipe forest: a background refit failed; the current forest stays in use.")
            finally:
                self._refit_cpu_s += time.thread_time() - cpu0
                refit.done = True

        refit.thread = threading.Thread(target=run, name="dynpipe-forest-refit", daemon=True)
        refit.thread.start()

    def close(self) -> None:
        """Ends a fit: waits for a running refit (its result is dropped) and forgets the last window (the next
        fit's first window is not paired with it). The samples and the forest stay."""
        if self._refit is not None and self._refit.thread is not None:
            self._refit.thread.join()
        self._refit = None
        self._close_worker()
        self._last = None

    # ------------------------------------------------------------------ prediction
    def predict(
        self, model_cost: ModelCost, comm: CommModel, window: PipelineWindow, candidate: Partition
    ) -> PartitionPrediction:
        """Each stage's compute per micro-batch and each boundary's message time under ``candidate``."""
        return self.predict_many(model_cost, comm, window, [candidate])[0]

    def predict_many(
        self, model_cost: ModelCost, comm: CommModel, window: PipelineWindow, candidates: Sequence[Partition]
    ) -> list[PartitionPrediction]:
        """:meth:`predict` for several candidates with one query per forest (what a check costs)."""
        if not candidates:
            return []
        S = window.partition.num_stages
        quiet = self._readings(model_cost)
        # the window's own partition is priced too: its residuals are what the forest gets wrong about it now
        priced = [window.partition, *candidates]
        msg = comm.cpu_s_per_byte
        sx = np.concatenate([stage_rows(model_cost, window, c, quiet, self.fixed_s, msg) for c in priced])
        sp = np.concatenate([stage_priors(model_cost, window, c, quiet, self.fixed_s, msg) for c in priced])
        bx = np.concatenate([boundary_rows(model_cost, comm, window, c) for c in priced])
        bp = np.concatenate([boundary_priors(model_cost, comm, window, c) for c in priced])
        s_val, s_lo, s_hi = _residuals(self._stage, sx[:, self._stage_cols], _layer_sets(sx), _strata(sx))
        b_val, b_lo, b_hi = _residuals(self._boundary, bx, _sizes(bx))
        # see "Anchored to the window" in the module docstring (an untrained forest answers its prior)
        if self.anchored and self._stage is not None:
            s_own = np.asarray([effective_compute_s(t) / window.num_microbatches for t in window.stages])
            s_val, s_lo, s_hi = _anchor(s_val, s_lo, s_hi, s_own, sp[:S])
        if self.anchored and self._boundary is not None:
            b_own = np.asarray([m for m, _ in measured_message_s(window)])
            b_val, b_lo, b_hi = _anchor(b_val, b_lo, b_hi, b_own, bp[: S - 1])
        # drop the window's own partition (first in ``priced``)
        sp, s_val, s_lo, s_hi = (a[S:] for a in (sp, s_val, s_lo, s_hi))
        bp, b_val, b_lo, b_hi = (a[S - 1 :] for a in (bp, b_val, b_lo, b_hi))
        # How the window's environment stretches each stage's profiled work, the same for every candidate: what the
        # controller prices a stage's updates with. Not a candidate's price over its layers' profile: that holds the
        # CPU a stage spends besides its layers (under a CPU limit, all of it over the limit, its updates included),
        # which would price the updates twice, and a stage's few layers at many times their profile.
        slowdowns = self._quiet.slowdowns(model_cost, window)
        out = []
        for i, cand in enumerate(candidates):
            stages = []
            for k in range(S):
                r = i * S + k
                prior = float(sp[r])
                value = prior * math.exp(s_val[r])
                stages.append(
                    Interval(value, min(prior * math.exp(s_lo[r]), value), max(prior * math.exp(s_hi[r]), value))
                )
            bounds = []
            for b in range(S - 1):
                r = i * (S - 1) + b
                prior = float(bp[r])
                value = prior * math.exp(b_val[r])
                bounds.append(
                    Interval(value, min(prior * math.exp(b_lo[r]), value), max(prior * math.exp(b_hi[r]), value))
                )
            out.append(PartitionPrediction(cand, slowdowns, tuple(stages), tuple(bounds)))
        return out

    def top_features(self, model_cost: ModelCost, window: PipelineWindow, stage_idx: int, n: int = 3) -> list[str]:
        """The ``n`` most important stage features with their values for ``stage_idx`` of the window, for logs."""
        if self._stage is None:
            return []
        row = stage_rows(model_cost, window, window.partition, self._readings(model_cost), self.fixed_s)[stage_idx]
        order = self._stage_cols[np.argsort(-self._stage.importances, kind="stable")[:n]]
        return [f"{STAGE_FEATURES[j]}={row[j]:.3g}" for j in order]

    # ------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Writes the rows, hyperparameters, schema and library versions to ``path`` (``.npz``, no pickle)."""
        rows = self.samples
        meta = {
            "format": FILE_FORMAT,
            "schema": self.schema.to_dict(),
            "versions": _library_versions(),
            "params": self._params(),
            "fixed_s": rows.fixed_s,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        target = Path(path)
        with open(target, "wb") as fh:  # np.savez on a path would append ".npz" to any other suffix
            np.savez(
                fh,
                meta=np.asarray(json.dumps(meta)),
                stage_x=rows.stage_x,
                stage_y=rows.stage_y,
                boundary_x=rows.boundary_x,
                boundary_y=rows.boundary_y,
                stage_window=rows.windows("stage"),
                boundary_window=rows.windows("boundary"),
            )
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str], **overrides: Any) -> ForestPredictor:
        """Reads a :meth:`save` file (no pickle is ever loaded), checks its schema, and refits from its rows.

        Args:
            path: the file the user named.
            overrides: constructor arguments that replace the file's (e.g. ``refit_every``).

        Raises:
            ConfigurationError: not such a file, or one written for another feature schema.
        """
        where = str(path)
        try:
            with np.load(where, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                arrays: dict[str, Any] = {
                    k: np.asarray(data[k], dtype=np.float64) for k in ("stage_x", "stage_y", "boundary_x", "boundary_y")
                }
                for k in ("stage_window", "boundary_window"):  # absent from older files: each row its own label
                    arrays[k] = np.asarray(data[k], dtype=np.int64) if k in data.files else None
        except (OSError, KeyError, ValueError) as exc:
            raise ConfigurationError(
                f"{where} is not a forest file of lightning_dynpipe ({exc}). Give a file written by "
                "ForestPredictor.save or `python -m lightning_dynpipe calibrate --out FILE`."
            ) from exc
        if meta.get("format") != FILE_FORMAT:
            raise ConfigurationError(
                f"{where} has format {meta.get('format')!r}, this version reads {FILE_FORMAT!r}. Re-run "
                "`python -m lightning_dynpipe calibrate` to write a file for this version."
            )
        FEATURE_SCHEMA.check(FeatureSchema.from_dict(meta.get("schema", {})), where=where)
        theirs = meta.get("versions", {}).get("scikit-learn")
        ours = _library_versions()["scikit-learn"]
        if theirs != ours:
            log.info("%s was written with scikit-learn %s; refitting its rows with %s.", where, theirs, ours)
        params = {**meta.get("params", {}), **overrides}
        predictor = cls(**params)
        return predictor.fit(LabelledSamples(**arrays, fixed_s=float(meta.get("fixed_s", 0.0))))

    def _params(self) -> dict[str, Any]:
        """What fitting a forest takes (the refit process builds ``ForestPredictor(**params)`` to fit; a file keeps
        them); how candidates are priced (``anchored``) and who refits are not a fit's."""
        return {
            "n_estimators": self.n_estimators,
            "min_samples_leaf": self.min_samples_leaf,
            "coverage": self.coverage,
            "random_state": self.random_state,
            "min_samples": self.min_samples,
            "buffer_size": self.buffer_size,
            "refit_every": self.refit_every,
            "adopt_after": self.adopt_after,
            "refit_on": self.refit_on,
            "stratified": self.stratified,
            "stage_features": list(self.stage_features) if self.stage_features is not None else None,
        }

    def __repr__(self) -> str:
        return (
            f"ForestPredictor(n_estimators={self.n_estimators}, rows={len(self.samples)}, fitted={self.fitted}, "
            f"refits={self.refits})"
        )


def conformal_min_rows(coverage: float) -> int:
    """The fewest calibration scores ``n`` whose split-conformal quantile at ``coverage`` is one of the scores:
    ``ceil((n + 1) * coverage) <= n`` (9 at 0.9, 19 at 0.95). With fewer, the margin that holds ``coverage`` is
    unbounded, and the largest score covers only ``n / (n + 1)`` of new values."""
    if not 0.0 < coverage < 1.0:
        raise ConfigurationError(f"conformal_min_rows needs 0 < coverage < 1; got {coverage}.")
    n = 1
    while math.ceil((n + 1) * coverage) > n:
        n += 1
    return n


def _binomial_tail(n: int, k: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return 1.0 - sum(math.comb(n, i) * p**i * (1.0 - p) ** (n - i) for i in range(min(k, n + 1)))


def _residuals(
    forest: QuantileForest | None, x: FloatArray, groups: list[Any], strata: list[int] | None = None
) -> tuple[FloatArray, FloatArray, FloatArray]:
    if forest is None or not len(x):
        zero = np.zeros(len(x))
        return zero, zero, zero
    return forest.predict(x, groups=groups, strata=strata)


def _anchor(
    value: FloatArray, low: FloatArray, high: FloatArray, measured: FloatArray, prior: FloatArray
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Residuals of ``len(measured)`` rows per partition, the window's own partition first, shifted so that the
    window's own partition is priced at what it measured: each row's residual plus, for its stage (or boundary),
    the log ratio of the ``measured`` time to the ``prior`` less the forest's residual for it under the window's own
    partition (no shift where either time is not positive: priced as without the anchor)."""
    per = len(measured)
    if not per or not len(value):
        return value, low, high
    usable = (measured > _FLOOR_S) & (prior > _FLOOR_S)
    ratio = np.log(np.where(usable, measured, 1.0) / np.where(usable, prior, 1.0))
    shift = np.tile(np.where(usable, ratio - value[:per], 0.0), len(value) // per)
    return value + shift, low + shift, high + shift


def _layer_sets(stage_x: FloatArray) -> list[Any]:
    """Each stage row's layer set, as the stage forest groups its rows: the candidate's profile and layer count."""
    return [hash(tuple(r)) for r in stage_x[:, [_PROFILE_COL, _LAYERS_COL]].round(6).tolist()]


def _strata(stage_x: FloatArray) -> list[int]:
    """Each stage row's stratum, as the stage forest calibrates its margins: 1 where the stage's environment shows
    interference (by the monitor's thresholds, :data:`~lightning_dynpipe.monitor.stats.INTERFERENCE_SIGNS`: a CPU
    limit below one core, other processes' load on its cores, its main thread waiting for a core, a throttled GPU),
    else 0. The thresholds apply to the row's own readings, not to their excess over the least affected stage as
    in :func:`~lightning_dynpipe.predictor.base.cpu_contended`: a row carries one stage, and a sweep's row was
    measured alone. Such a stage's time is far less certain than a quiet one's; one margin for both covered the
    quiet stages nearly always and the interfered ones much less often than nominal."""
    signs = INTERFERENCE_SIGNS
    limit = stage_x[:, _LIMIT_COL]
    interfered = (
        ((limit > 0) & (limit < signs["cpu_limit"]))
        | (stage_x[:, _OTHER_COL] >= signs["other_cpu_load"])
        | (stage_x[:, _WAIT_COL] >= signs["run_queue_wait_share"])
        | (stage_x[:, _THROTTLED_COL] >= signs["gpu_throttled"])
    )
    return [int(v) for v in interfered]


def _sizes(boundary_x: FloatArray) -> list[float]:
    """Each boundary row's message size, as the boundary forest groups its rows."""
    return [float(v) for v in boundary_x[:, _BYTES_COL].round(6)]


def _check_columns(samples: LabelledSamples) -> None:
    if samples.stage_x.shape[1:] != (len(STAGE_FEATURES),) or samples.boundary_x.shape[1:] != (len(BOUNDARY_FEATURES),):
        raise ConfigurationError(
            f"Samples need {len(STAGE_FEATURES)} stage columns and {len(BOUNDARY_FEATURES)} boundary columns (the "
            f"feature schema {FEATURE_SCHEMA.name!r} v{FEATURE_SCHEMA.version}); got shapes "
            f"{samples.stage_x.shape} and {samples.boundary_x.shape}. Build them with "
            "lightning_dynpipe.predictor.features.samples_from_windows."
        )
