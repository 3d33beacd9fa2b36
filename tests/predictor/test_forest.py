"""The forest predictor on a synthetic pipeline with a known truth (tests/predictor/sim.py).

Trained on some interference scenarios, judged on scenario types it never saw and on partitions the window was
not measured under: error against the truth, against the baseline, interval coverage, determinism, cost, files
(no pickle), and the online refits' rank-consistent switch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.costs import ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor import InterferencePredictor, MeasuredSlowdownPredictor, PipelineWindow, StageTimes
from lightning_dynpipe.predictor.features import (
    STAGE_FEATURES,
    LabelledSamples,
    boundary_rows,
    effective_compute_s,
    measured_message_s,
    samples_from_windows,
    stage_priors,
    stage_rows,
)
from lightning_dynpipe.predictor.forest import (
    FILE_FORMAT,
    MIN_STRATUM_SCORES,
    ForestPredictor,
    QuantileForest,
    _sizes,
    _strata,
    conformal_min_rows,
)

from . import sim

M = 4
COST = sim.model_cost()
PARTS = sim.partitions()
TRAIN = [
    sim.Env(),
    sim.Env(hog=(1.0, 0.0)),
    sim.Env(hog=(0.0, 0.5)),
    sim.Env(quota=(None, 0.25)),
    sim.Env(quota=(0.5, None)),
    sim.Env(quota=(None, 0.5)),
    sim.Env(quota=(0.25, None)),
    sim.Env(delay_s=2e-3, jitter_s=1e-3),
    sim.Env(hog=(0.5, 0.0), quota=(None, 0.3)),
]
HELD_OUT = [  # scenario types the forest never saw: other fractions, and a hog together with a quota elsewhere
    sim.Env(quota=(None, 0.35)),
    sim.Env(hog=(0.0, 1.0), quota=(0.4, None)),
    sim.Env(delay_s=5e-3, jitter_s=2e-3, hog=(0.3, 0.0)),
]


def _windows(envs: list[sim.Env], seed: int) -> list[tuple[sim.Env, dict[Partition, PipelineWindow]]]:
    rng = np.random.default_rng(seed)
    return [(env, {p: sim.window(COST, p, env, M, rng) for p in PARTS}) for env in envs]


def _training_samples() -> LabelledSamples:
    parts = []
    for _, wins in _windows(TRAIN, seed=1):
        parts += [samples_from_windows(COST, sim.LINK, a, b) for a in wins.values() for b in wins.values()]
    return LabelledSamples.concat(parts)


@pytest.fixture(scope="module")
def samples() -> LabelledSamples:
    return _training_samples()


@pytest.fixture(scope="module")
def forest(samples: LabelledSamples) -> ForestPredictor:
    return ForestPredictor().fit(samples)


def test_an_untrained_forest_answers_its_prior_and_is_an_interference_predictor() -> None:
    f = ForestPredictor()
    assert isinstance(f, InterferencePredictor) and not f.fitted
    _, wins = _windows([sim.Env(quota=(None, 0.25))], seed=2)[0]
    window, cand = wins[PARTS[4]], PARTS[2]
    p = f.predict(COST, sim.LINK, window, cand)
    assert [i.value for i in p.stage_compute_s] == pytest.approx(stage_priors(COST, window, cand).tolist())
    assert all(i.low == i.value == i.high for i in p.stage_compute_s)


def test_an_untrained_forest_prices_as_the_baseline_in_seconds_with_what_it_saw_quiet_as_a_fixed_cost() -> None:
    """The pipeline runs at 1.2x the profile's clock; the last stage's one layer reads 2.4x (2x the pipeline's
    speed) with nothing beside it. Both predictors carry that as a fixed cost and price in seconds, at the pipeline's
    speed. A move's outcome priced right is a zero residual."""
    quiet = PipelineWindow(
        Partition((8, 2)),
        (
            StageTimes(4 * 1.2 * COST.compute_s(0, 8), 0.1, cpu_share=1.0, other_cpu_load=0.0),
            StageTimes(4 * 2.4 * COST.compute_s(8, 10), 0.1, cpu_share=1.0, other_cpu_load=0.0),
        ),
        4,
    )
    forest, base = ForestPredictor(), MeasuredSlowdownPredictor()
    forest.observe(COST, sim.LINK, quiet)
    base.observe(COST, sim.LINK, quiet)
    for cand in PARTS:
        got = [i.value for i in forest.predict(COST, sim.LINK, quiet, cand).stage_compute_s]
        want = [i.value for i in base.predict(COST, sim.LINK, quiet, cand).stage_compute_s]
        assert got == pytest.approx(want)
    moved = Partition((7, 3))
    priced = forest.predict(COST, sim.LINK, quiet, moved).stage_compute_s
    after = PipelineWindow(
        moved,
        tuple(StageTimes(4 * p.value, 0.1, cpu_share=1.0, other_cpu_load=0.0) for p in priced),
        4,
    )
    forest.observe(COST, sim.LINK, after)
    assert forest.samples.stage_y.tolist() == pytest.approx([0.0, 0.0])
    fresh = ForestPredictor()  # has seen no window: the stretch of the whole reading
    stretched = fresh.predict(COST, sim.LINK, quiet, moved).stage_compute_s[1].value
    assert stretched == pytest.approx(2.4 * COST.compute_s(7, 10)) and stretched > priced[1].value
    forest.close()  # observe() started its refit process


def test_on_held_out_scenarios_and_partitions_never_run_the_forest_is_accurate_and_covered(
    forest: ForestPredictor,
) -> None:
    base = MeasuredSlowdownPredictor()
    err_f, covered = [], []
    per_env: dict[int, tuple[list[float], list[float]]] = {}
    for i, (env, wins) in enumerate(_windows(HELD_OUT, seed=3)):
        mine, theirs = per_env.setdefault(i, ([], []))
        for a in PARTS:
            for b in PARTS:
                if a == b:
                    continue
                truth, _ = sim.true_compute(COST, b, env, M)
                pf = forest.predict(COST, sim.LINK, wins[a], b)
                pb = base.predict(COST, sim.LINK, wins[a], b)
                for k in range(2):
                    t = truth[k] / M
                    ef, eb = abs(pf.stage_compute_s[k].value / t - 1), abs(pb.stage_compute_s[k].value / t - 1)
                    err_f.append(ef)
                    covered.append(pf.stage_compute_s[k].low <= t <= pf.stage_compute_s[k].high)
                    if env.hog[k] or env.quota[k] is not None:
                        mine.append(ef)
                        theirs.append(eb)
    medians = {i: (statistics.median(f), statistics.median(b)) for i, (f, b) in per_env.items()}
    assert statistics.median(err_f) <= 0.10
    # the hog beside a quota: the baseline's 1/q floor and relative slowdowns are wrong there, the forest is not
    assert medians[1][0] <= 0.5 * medians[1][1], medians
    # where the baseline is right (a quota that sets the pace: exactly 1/q), the forest stays close to it
    assert all(f <= b + 0.03 for f, b in medians.values()), medians
    assert np.mean(covered) >= 0.80


def test_a_layer_set_never_measured_gets_the_by_layer_set_margin_and_one_measured_the_narrower_one() -> None:
    """Trained without partition ``P``'s windows, with a profile that prices the first layer at half its time (a
    profile is never exact): how far off a layer set's prior is depends on its layers, so ``P``'s layer sets, never
    measured, get the larger margin (calibrated on layer sets held out) and are still covered; every other
    candidate's layer sets were measured under some scenario, and get the margin of held-out windows."""
    forward, backward = [c.forward_s for c in COST.layers], [c.backward_s for c in COST.layers]
    forward[0], backward[0] = forward[0] / 2, backward[0] / 2
    profile = ModelCost.from_arrays(
        forward,
        backward,
        activation_bytes=[c.activation_bytes for c in COST.layers],
        param_bytes=[c.param_bytes for c in COST.layers],
    )
    never = PARTS[2]
    parts = []
    for _, wins in _windows(TRAIN, seed=1):
        measured = [w for p, w in wins.items() if p != never]
        parts += [samples_from_windows(profile, sim.LINK, a, b) for a in measured for b in measured]
    forest = ForestPredictor().fit(LabelledSamples.concat(parts))
    stage = forest._stage
    assert stage is not None and stage.seen_margin < stage.margin
    covered, unseen_widths, seen_widths, boundary_widths = [], [], [], []
    for env, wins in _windows(HELD_OUT, seed=3):
        truth, _ = sim.true_compute(COST, never, env, M)
        for a in PARTS:
            if a == never:
                continue
            p = forest.predict(profile, sim.LINK, wins[a], never)
            covered += [i.low <= t / M <= i.high for i, t in zip(p.stage_compute_s, truth)]
            unseen_widths += [math.log(i.high / i.low) for i in p.stage_compute_s]
            boundary_widths += [math.log(i.high / i.low) for i in p.boundary_s]
            other = PARTS[1] if a != PARTS[1] else PARTS[3]
            seen = forest.predict(profile, sim.LINK, wins[a], other).stage_compute_s
            seen_widths += [math.log(i.high / i.low) for i in seen]
    assert np.mean(covered) >= 0.80
    # the interval is the trees' 5th-95th percentile widened by the margin on each side
    assert min(unseen_widths) >= 2 * stage.margin - 1e-9
    assert min(seen_widths) < 2 * stage.margin
    # the boundary forest knows its groups by message size, the same way when it fits and when it predicts: the
    # sizes of the partitions measured are its training groups, the size at the boundary of P is not
    boundary = forest._boundary
    assert boundary is not None and min(boundary_widths) >= 2 * boundary.margin - 1e-9
    window = _windows(HELD_OUT, seed=3)[0][1][PARTS[1]]
    assert not {*_sizes(boundary_rows(profile, sim.LINK, window, never))} & boundary._seen
    assert {*_sizes(boundary_rows(profile, sim.LINK, window, PARTS[4]))} <= boundary._seen


def test_a_quantile_forest_gives_rows_of_training_groups_their_own_margin() -> None:
    """Each group has its own offset, which the trees learn from the group's rows but cannot guess for a group they
    never saw: the by-group margin is the wider, and it is the one a row of an unknown group (or with no label) gets."""
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(6), 40)
    offset = rng.normal(0.0, 0.3, 6)
    x = np.column_stack([groups * 1.0 + rng.normal(0, 0.01, len(groups)), rng.uniform(0, 1, len(groups))])
    y = offset[groups] + 0.2 * x[:, 1] + rng.normal(0, 0.02, len(groups))
    forest = QuantileForest(random_state=0).fit(x, y, groups=groups)
    assert 0.0 < forest.seen_margin < forest.margin
    value, lo, hi = forest.predict(x[:3])
    _, lo_seen, hi_seen = forest.predict(x[:3], groups=groups[:3])
    _, lo_new, hi_new = forest.predict(x[:3], groups=[99, 99, 99])
    assert np.allclose(hi - hi_seen, forest.margin - forest.seen_margin)
    assert np.allclose(lo_seen - lo, forest.margin - forest.seen_margin)
    assert np.array_equal(lo_new, lo) and np.array_equal(hi_new, hi)
    unfolded = QuantileForest(random_state=0).fit(x, y)  # no groups: one margin, out of bag
    assert unfolded.margin == unfolded.seen_margin == forest.seen_margin


def _two_noise_levels(rng: np.random.Generator, n: int) -> tuple[Any, Any, Any]:
    """Rows of two kinds: stratum 0 measured to 2%, stratum 1 (as under interference) to 30%; the trees see the
    kind as a column, but their spread does not follow the noise."""
    stratum = (rng.uniform(0, 1, n) < 0.25).astype(int)
    x = np.column_stack([stratum * 1.0, rng.uniform(0, 1, n), rng.uniform(0, 1, n)])
    y = 0.5 * x[:, 1] + rng.normal(0.0, np.where(stratum == 1, 0.3, 0.02))
    return x, y, stratum


def test_with_strata_each_kind_of_row_gets_the_margin_that_covers_its_own_values() -> None:
    """One margin for rows of very different noise covers the quiet rows always and the noisy ones far less often
    than nominal (on a CNN sweep: 100% and 64%); calibrated per stratum, each holds about ``coverage``."""
    rng = np.random.default_rng(0)
    x, y, stratum = _two_noise_levels(rng, 600)
    windows = np.arange(len(y)) // 2  # pairs of rows share a measurement
    pooled = QuantileForest(random_state=0).fit(x, y, windows=windows)
    split = QuantileForest(random_state=0).fit(x, y, windows=windows, strata=stratum)
    assert pooled.stratum_margins == {} and set(split.stratum_margins) == {0, 1}
    quiet_seen, quiet_unseen = split.stratum_margins[0]
    noisy_seen, noisy_unseen = split.stratum_margins[1]
    assert quiet_seen < pooled.seen_margin < noisy_seen
    assert (quiet_unseen, noisy_unseen) == (quiet_seen, noisy_seen)  # without groups: one margin per stratum
    xt, yt, st = _two_noise_levels(np.random.default_rng(1), 4000)
    cover: dict[str, list[float]] = {}
    for name, forest, strata in (("pooled", pooled, None), ("split", split, st)):
        _, lo, hi = forest.predict(xt, strata=strata)
        inside = (lo <= yt) & (yt <= hi)
        cover[name] = [float(inside[st == k].mean()) for k in (0, 1)]
    assert cover["pooled"][0] > 0.99 and cover["pooled"][1] < 0.80, cover
    assert all(0.85 <= c <= 0.99 for c in cover["split"]), cover
    # rows of a stratum the forest has no margins for, or without strata, get the pooled margins
    _, lo_none, hi_none = split.predict(xt[:5])
    _, lo_other, hi_other = split.predict(xt[:5], strata=[7] * 5)
    _, lo_pool, hi_pool = pooled.predict(xt[:5])
    assert np.allclose(lo_none, lo_pool) and np.allclose(hi_none, hi_pool)
    assert np.allclose(lo_other, lo_pool) and np.allclose(hi_other, hi_pool)


def test_a_stratum_with_too_few_scores_keeps_the_pooled_margins() -> None:
    rng = np.random.default_rng(2)
    x, y, _ = _two_noise_levels(rng, 300)
    strata = np.zeros(len(y), dtype=int)
    strata[: MIN_STRATUM_SCORES // 2] = 1  # far too few rows for its own margin in any calibration
    forest = QuantileForest(random_state=0).fit(x, y, windows=np.arange(len(y)), strata=strata)
    assert set(forest.stratum_margins) == {0}
    _, lo, hi = forest.predict(x[:3], strata=[1, 1, 1])
    _, lo_pool, hi_pool = forest.predict(x[:3])
    assert np.allclose(lo, lo_pool) and np.allclose(hi, hi_pool)


def test_a_stage_row_is_in_the_interfered_stratum_by_the_monitors_thresholds() -> None:
    col = {name: STAGE_FEATURES.index(name) for name in STAGE_FEATURES}
    rows = np.zeros((7, len(STAGE_FEATURES)))
    rows[:, col["cpu_limit_cores"]] = -1.0  # not reported: no limit
    rows[:, col["other_cpu_load"]] = -1.0
    rows[:, col["gpu_throttled"]] = -1.0
    rows[1, col["cpu_limit_cores"]] = 0.5  # a limit below one core
    rows[2, col["cpu_limit_cores"]] = 2.0  # a container's limit above what the stage uses: quiet
    rows[3, col["other_cpu_load"]] = 0.3  # other processes on its cores
    rows[4, col["run_queue_wait_share"]] = 0.4  # its main thread waiting for a core
    rows[5, col["gpu_throttled"]] = 1.0
    rows[6, col["other_cpu_load"]] = 0.1  # below the threshold
    assert _strata(rows) == [0, 1, 0, 1, 1, 1, 0]


def test_the_stage_trees_split_only_on_the_columns_given_and_the_choice_travels_with_a_refit_and_a_file(
    tmp_path: Path,
) -> None:
    from lightning_dynpipe.predictor.forest import RELATIVE_STAGE_FEATURES

    samples = _training_samples()
    relative = ForestPredictor(n_estimators=8, stage_features=RELATIVE_STAGE_FEATURES).fit(samples)
    assert relative._stage is not None and len(relative._stage.importances) == len(RELATIVE_STAGE_FEATURES)
    assert "candidate_profile_ms" not in RELATIVE_STAGE_FEATURES and "work_ratio" in RELATIVE_STAGE_FEATURES
    # the same trees as a forest fitted on those columns alone (the rows keep every column)
    cols = [STAGE_FEATURES.index(c) for c in RELATIVE_STAGE_FEATURES]
    alone = QuantileForest(n_estimators=8).fit(samples.stage_x[:, cols], samples.stage_y)
    x = samples.stage_x[:, cols]
    assert np.array_equal(alone.predict(x)[0], relative._stage.predict(x)[0])
    _, wins = _windows([sim.Env(quota=(None, 0.35))], seed=6)[0]
    window = wins[PARTS[3]]
    prices = relative.predict_many(COST, sim.LINK, window, PARTS)
    assert all(i.low <= i.value <= i.high for p in prices for i in p.stage_compute_s)
    assert all(f.split("=")[0] in RELATIVE_STAGE_FEATURES for f in relative.top_features(COST, window, 1, n=5))
    refit, _ = ForestPredictor(**relative._params()).fit_pair(samples)
    assert refit is not None and len(refit.importances) == len(RELATIVE_STAGE_FEATURES)
    loaded = ForestPredictor.load(relative.save(tmp_path / "relative.npz"))
    assert (
        loaded.stage_features == RELATIVE_STAGE_FEATURES
        and loaded.predict_many(COST, sim.LINK, window, PARTS) == prices
    )
    every = ForestPredictor(n_estimators=8).fit(samples)._stage
    assert every is not None and every.importances.shape == (len(STAGE_FEATURES),)
    with pytest.raises(ConfigurationError, match="stage_features.*unknown: \\['cpu'\\]"):
        ForestPredictor(stage_features=["cpu", "work_ratio"])


def test_the_forest_calibrates_interfered_and_quiet_stages_apart_unless_told_not_to() -> None:
    parts = []
    for _, wins in _windows(TRAIN, seed=1):
        parts += [samples_from_windows(COST, sim.LINK, a, b) for a in wins.values() for b in wins.values()]
    samples = LabelledSamples.concat(parts)
    split, pooled = ForestPredictor().fit(samples), ForestPredictor(stratified=False).fit(samples)
    assert split._stage is not None and pooled._stage is not None
    assert set(split._stage.stratum_margins) == {0, 1} and pooled._stage.stratum_margins == {}
    assert split._stage.margin == pooled._stage.margin  # the pooled margins are the same either way
    # a refit (the refit process builds ForestPredictor(**params)) and a file keep the choice
    refit, _ = ForestPredictor(**pooled._params()).fit_pair(samples)
    assert refit is not None and refit.stratum_margins == {}
    # a candidate's stage is priced at the same value, with the margin of its kind (its layer sets were measured)
    _, wins = _windows([sim.Env(quota=(None, 0.35))], seed=6)[0]
    window = wins[PARTS[1]]
    kinds = _strata(stage_rows(COST, window, PARTS[3]))
    assert kinds == [0, 1]  # the quota is on the last stage
    ps, pp = split.predict(COST, sim.LINK, window, PARTS[3]), pooled.predict(COST, sim.LINK, window, PARTS[3])
    for k, kind in enumerate(kinds):
        a, b = ps.stage_compute_s[k], pp.stage_compute_s[k]
        assert a.value == pytest.approx(b.value)
        wider = math.log(a.high / a.low) - math.log(b.high / b.low)
        assert wider == pytest.approx(2 * (split._stage.stratum_margins[kind][0] - pooled._stage.seen_margin))
    with pytest.raises(ConfigurationError, match="stratified"):
        ForestPredictor(stratified="yes")  # type: ignore[arg-type]


def test_boundary_times_follow_a_delayed_link_that_the_link_model_does_not_know(forest: ForestPredictor) -> None:
    env = sim.Env(delay_s=5e-3, jitter_s=2e-3)
    _, wins = _windows([env], seed=4)[0]
    p = forest.predict(COST, sim.LINK, wins[PARTS[4]], PARTS[1])
    truth = sim.message_s(COST, PARTS[1], env, 0)
    assert p.boundary_s[0].value == pytest.approx(truth, rel=0.1)
    assert p.boundary_s[0].low <= truth <= p.boundary_s[0].high
    assert MeasuredSlowdownPredictor().predict(COST, sim.LINK, wins[PARTS[4]], PARTS[1]).boundary_s[0].value < 1e-3


def test_the_same_samples_give_the_same_answers_and_a_check_is_cheap(
    forest: ForestPredictor, samples: LabelledSamples
) -> None:
    again = ForestPredictor().fit(samples)
    _, wins = _windows([sim.Env(hog=(0.0, 1.0), quota=(0.4, None))], seed=5)[0]
    window = wins[PARTS[3]]
    assert forest.predict_many(COST, sim.LINK, window, PARTS) == again.predict_many(COST, sim.LINK, window, PARTS)
    forest.predict_many(COST, sim.LINK, window, PARTS)
    t0 = time.perf_counter()
    for _ in range(10):
        forest.predict_many(COST, sim.LINK, window, PARTS)
    per_check = (time.perf_counter() - t0) / 10
    assert per_check < 0.025, f"{per_check * 1e3:.1f} ms to price {len(PARTS)} candidates"
    top = forest.top_features(COST, window, 0)
    assert len(top) == 3 and all("=" in t for t in top)


def test_anchored_the_running_partition_is_priced_at_what_it_measured_and_a_bias_of_the_training_rows_cancels(
    samples: LabelledSamples,
) -> None:
    """Training rows whose limited stages ran a third faster than the pipeline's do (a set-up sweep's worker,
    throttled alone, against a pipeline stage's process under the same quota): the raw forest prices the running
    partition and every candidate that much low, so a saving looked a third smaller than it was. Anchored (the
    default), the running partition is priced at what the window measured, stage and boundary, and each candidate
    carries what the forest got wrong there: its limited stage is priced close to the truth."""
    limit = samples.stage_x[:, STAGE_FEATURES.index("cpu_limit_cores")]
    limited = (limit > 0) & (limit < 1)
    assert limited.sum() >= 20
    biased = dataclasses.replace(samples, stage_y=samples.stage_y + np.where(limited, math.log(2 / 3), 0.0))
    anchored, raw = ForestPredictor().fit(biased), ForestPredictor(anchored=False).fit(biased)
    assert anchored.anchored and not raw.anchored
    env = sim.Env(quota=(None, 0.25))
    _, wins = _windows([env], seed=6)[0]
    err: dict[bool, list[float]] = {True: [], False: []}
    for a in PARTS:
        window = wins[a]
        own = anchored.predict(COST, sim.LINK, window, a)
        measured = [effective_compute_s(t) / M for t in window.stages]
        assert [i.value for i in own.stage_compute_s] == pytest.approx(measured)
        assert [i.value for i in own.boundary_s] == pytest.approx([m for m, _ in measured_message_s(window)])
        assert all(i.low <= i.value <= i.high for i in (*own.stage_compute_s, *own.boundary_s))
        for b in PARTS:
            if b == a:
                continue
            t = sim.true_compute(COST, b, env, M)[0][1] / M
            for predictor in (anchored, raw):
                err[predictor.anchored].append(
                    predictor.predict(COST, sim.LINK, window, b).stage_compute_s[1].value / t - 1
                )
    assert statistics.median(err[False]) < -0.2, err[False]  # the bias: a third low
    assert abs(statistics.median(err[True])) <= 0.1, err[True]


def test_its_slowdowns_are_the_windows_stretch_for_every_candidate_not_its_price_over_the_profile(
    forest: ForestPredictor,
) -> None:
    """The controller prices a stage's optimizer updates at its slowdown times their profile. Under a CPU limit a
    stage's price holds all its CPU per step over the limit (updates included), here twice its layers' stretched
    compute: as slowdowns those prices counted the updates twice, and a candidate leaving the limited stage fewer
    layers got cheaper updates than the running partition. The forest reports the window's stretch, as the measured
    predictor does, the same for every candidate."""
    p0, p1 = COST.compute_s(0, 8), COST.compute_s(8, COST.num_layers)
    step = 2 * 4 * 4 * p1  # stage 1's CPU per step over its 25% limit: twice its layers' 4x-stretched compute
    window = PipelineWindow(
        Partition((8, 2)),
        (
            StageTimes(4 * p0, step, cpu_share=1.0, other_cpu_load=0.0),
            StageTimes(4 * 4 * p1, step, cpu_share=0.25, cpu_limit=0.25, other_cpu_load=0.0),
        ),
        4,
    )
    want = MeasuredSlowdownPredictor().predict(COST, sim.LINK, window, window.partition).slowdowns
    assert want == pytest.approx((1.0, 4.0)) and MeasuredSlowdownPredictor().slowdowns(COST, window) == want
    for predictor in (forest, ForestPredictor()):  # trained, and answering its prior
        answers = predictor.predict_many(COST, sim.LINK, window, PARTS)
        assert all(a.slowdowns == want for a in answers)
    here = ForestPredictor().predict(COST, sim.LINK, window, window.partition).stage_compute_s[1].value
    assert here / p1 == pytest.approx(8.0)  # the price over the profile: what the slowdown used to be


def test_save_and_load_round_trip_without_pickle(forest: ForestPredictor, tmp_path: Path) -> None:
    path = forest.save(tmp_path / "forest.npz")
    loaded = ForestPredictor.load(path)
    _, wins = _windows([sim.Env(quota=(None, 0.35))], seed=6)[0]
    window = wins[PARTS[5]]
    assert loaded.predict_many(COST, sim.LINK, window, PARTS) == forest.predict_many(COST, sim.LINK, window, PARTS)
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(str(data["meta"]))
    assert meta["format"] == FILE_FORMAT and "scikit-learn" in meta["versions"] and meta["schema"]["version"] >= 1
    for kind in ("stage", "boundary"):  # the rows keep the labels of the windows they were measured in
        assert np.array_equal(loaded.samples.windows(kind), forest.samples.windows(kind))
    assert len(set(forest.samples.windows("stage"))) < len(forest.samples)
    with np.load(path, allow_pickle=False) as data:  # a file written before rows had labels: each row its own
        older = {k: data[k] for k in data.files if not k.endswith("_window")}
    np.savez(tmp_path / "older.npz", **older)
    unlabelled = ForestPredictor.load(tmp_path / "older.npz")
    assert len(set(unlabelled.samples.windows("stage"))) == len(unlabelled.samples)
    # how candidates are priced is not the file's: a loaded forest is anchored unless the caller says otherwise
    assert loaded.anchored and not ForestPredictor.load(path, anchored=False).anchored
    assert "anchored" not in meta["params"]


def test_the_fixed_cost_per_micro_batch_is_kept_in_files_prices_every_row_and_old_rows_do_not_mix(
    tmp_path: Path,
) -> None:
    fixed = LabelledSamples.concat(
        [
            samples_from_windows(COST, sim.LINK, a, b, fixed_s=2e-4)
            for _, w in _windows(TRAIN[:3], seed=1)
            for a in w.values()
            for b in w.values()
        ]  # fmt: skip
    )
    forest = ForestPredictor().fit(fixed)
    assert forest.fixed_s == 2e-4
    loaded = ForestPredictor.load(forest.save(tmp_path / "fixed.npz"))
    assert loaded.fixed_s == 2e-4
    _, wins = _windows([sim.Env(quota=(None, 0.35))], seed=6)[0]
    window = wins[PARTS[5]]
    assert loaded.predict_many(COST, sim.LINK, window, PARTS) == forest.predict_many(COST, sim.LINK, window, PARTS)
    untrained = ForestPredictor().fit(dataclasses.replace(LabelledSamples.empty(), fixed_s=2e-4))
    for cand in PARTS[:3]:  # an untrained forest answers the prior with the fixed cost
        want = stage_priors(COST, window, cand, fixed_s=2e-4)
        got = [i.value for i in untrained.predict(COST, sim.LINK, window, cand).stage_compute_s]
        assert got == pytest.approx(list(want))

    learning = ForestPredictor(min_samples=1000)  # observed rows priced without a fixed cost ...
    for w in list(wins.values())[:3]:
        learning.observe(COST, sim.LINK, dataclasses.replace(w, partition=window.partition, stages=window.stages))
    assert len(learning.samples) > 0 and learning.samples.fixed_s == 0.0
    learning.fit(fixed)  # ... are dropped when rows priced with one arrive
    assert learning.samples.fixed_s == 2e-4 and len(learning.samples) == len(fixed)
    learning.close()


def _rewrite_meta(src: Path, dst: Path, **changes: object) -> Path:
    with np.load(src, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    meta = json.loads(str(arrays.pop("meta")))
    meta.update(changes)
    with open(dst, "wb") as fh:
        np.savez(fh, meta=np.asarray(json.dumps(meta)), **arrays)
    return dst


def test_a_file_of_another_schema_or_format_or_with_pickled_data_is_refused(
    forest: ForestPredictor, tmp_path: Path
) -> None:
    good = forest.save(tmp_path / "forest.npz")
    schema = dict(forest.schema.to_dict(), version=99)
    other = _rewrite_meta(good, tmp_path / "other.npz", schema=schema)
    with pytest.raises(ConfigurationError, match=r"version 99.*only applies to rows of the schema.*calibrate"):
        ForestPredictor.load(other)
    with pytest.raises(ConfigurationError, match="has format 'x'"):
        ForestPredictor.load(_rewrite_meta(good, tmp_path / "fmt.npz", format="x"))
    pickled = tmp_path / "pickled.npz"
    with open(pickled, "wb") as fh:
        np.savez(fh, meta=np.asarray([{"format": FILE_FORMAT}], dtype=object))
    with pytest.raises(ConfigurationError, match="is not a forest file"):
        ForestPredictor.load(pickled)


def test_online_refits_switch_at_the_same_window_on_every_rank() -> None:
    ranks = [
        ForestPredictor(n_estimators=8, min_samples=6, refit_every=3, adopt_after=2, buffer_size=40) for _ in range(2)
    ]
    rng = np.random.default_rng(7)
    env = sim.Env(quota=(None, 0.4))
    sequence = [PARTS[4]] * 4 + [PARTS[6]] * 4 + [PARTS[5]] * 6  # two migrations: outcomes are samples too
    answers: list[list[object]] = [[], []]
    refits_seen = []
    for p in sequence:
        window = sim.window(COST, p, env, M, rng)
        for r, f in enumerate(ranks):
            f.observe(COST, sim.LINK, window)
            answers[r].append(f.predict_many(COST, sim.LINK, window, PARTS))
            if r == 0:
                refits_seen.append(f.refits)
            else:
                time.sleep(0.01)  # the second "rank" lets its refit thread run longer: it must not switch earlier
    assert answers[0] == answers[1]
    assert ranks[0].refits == ranks[1].refits >= 2
    # the 4th window brings the 3rd sample (6 rows): a refit starts, and is adopted 2 windows later, at the 6th
    assert refits_seen[:6] == [0, 0, 0, 0, 0, 1]
    assert len(ranks[0].samples) <= 40 + 2
    for f in ranks:
        f.close()


def test_constructor_arguments_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="adopt_after >= 1"):
        ForestPredictor(adopt_after=0)
    with pytest.raises(ConfigurationError, match="0 < coverage < 1"):
        ForestPredictor(coverage=1.5)
    with pytest.raises(ConfigurationError, match="anchored"):
        ForestPredictor(anchored=1)  # type: ignore[arg-type]


def test_the_fewest_rows_is_where_the_conformal_quantile_is_a_score() -> None:
    for coverage, n in ((0.8, 4), (0.9, 9), (0.95, 19)):
        assert conformal_min_rows(coverage) == n
        assert math.ceil((n + 1) * coverage) <= n < math.ceil(n * coverage) + 1  # n - 1 scores would not do
    assert ForestPredictor().min_samples == 9
    assert ForestPredictor(coverage=0.95).min_samples == 19
    with pytest.raises(ConfigurationError, match="0 < coverage < 1"):
        conformal_min_rows(1.0)


def test_an_untrained_forest_fits_as_soon_as_it_has_its_rows_and_a_fitted_one_refits_on_schedule() -> None:
    f = ForestPredictor(n_estimators=8, refit_every=8, adopt_after=1, refit_on="every")
    f.refit_in_process = False
    rng = np.random.default_rng(4)
    env = sim.Env(quota=(None, 0.5))
    part = PARTS[4]
    started = []
    for _ in range(16):
        f.observe(COST, sim.LINK, sim.window(COST, part, env, M, rng))
        started.append(f._refits_started)
    per_window = part.num_stages  # stage rows a window adds (paired with the window before it)
    first = next(i for i in range(16) if i * per_window >= f.min_samples)  # 0-based window with enough rows
    assert first < f.refit_every  # without the rule it would wait refit_every windows of rows
    assert started[first - 1] == 0 and started[first] == 1
    # the next refits keep the schedule: refit_every windows after the one before
    assert started.index(2) == first + f.refit_every
    assert f.fitted
    f.close()


def test_with_the_ranks_finished_refits_agreed_a_slow_refit_delays_the_switch_but_never_blocks() -> None:
    ranks = [ForestPredictor(n_estimators=8, min_samples=6, refit_every=3, buffer_size=40) for _ in range(2)]
    slow_fit = ranks[1].fit_pair

    def slow(rows: LabelledSamples) -> Any:
        time.sleep(0.3)  # this rank's core is busy: its refit takes longer
        return slow_fit(rows)

    ranks[1].refit_in_process = False  # rank 0 refits in its child process, rank 1 in a slowed thread
    ranks[1].fit_pair = slow  # type: ignore[method-assign]
    rng = np.random.default_rng(8)
    env = sim.Env(quota=(0.5, None))
    longest, history = 0.0, []
    # 36 windows at least, then more until both ranks switched: the child process's start (importing scikit-learn at
    # nice 19) can take seconds on a loaded machine; the deadline only bounds a test that would otherwise hang
    deadline = time.monotonic() + 120.0
    plan = iter([PARTS[3]] * 6 + [PARTS[5]] * 30)
    while (p := next(plan, None)) is not None or (history[-1][0] < 1 and time.monotonic() < deadline):
        p = p if p is not None else PARTS[5]
        window = sim.window(COST, p, env, M, rng)
        agreed = min(f.ready_refit() for f in ranks)  # what the monitor's all-gather of the tokens gives everyone
        for f in ranks:
            t0 = time.perf_counter()
            f.observe(COST, sim.LINK, window, agreed_refit=agreed)
            longest = max(longest, time.perf_counter() - t0)
        history.append((ranks[0].refits, ranks[1].refits))
        assert ranks[0].predict_many(COST, sim.LINK, window, PARTS) == ranks[1].predict_many(
            COST, sim.LINK, window, PARTS
        )
        time.sleep(0.05)  # a monitor window
    assert all(a == b for a, b in history) and history[-1][0] >= 1, history
    assert longest < 0.25, f"an observe waited {longest:.3f} s for a refit"
    assert ranks[1].refit_cpu_s > 0.0  # the refit thread's own CPU (the sleep is not CPU)
    for f in ranks:
        f.close()


def test_with_shared_refits_one_rank_fits_and_every_rank_switches_to_its_forests() -> None:
    """In a fit of several processes each refit runs on one rank (``refit_rank``, which the strategy sets from the
    snapshot): the others spend no CPU on it, report it as finished (the switch waits for the fitting rank's), and
    receive the fitting rank's forests in the broadcast at the switch. A refit that fails there leaves every rank on
    its current forest."""
    ranks = [
        ForestPredictor(n_estimators=8, min_samples=6, refit_every=3, buffer_size=40, refit_on="every")
        for _ in range(3)
    ]
    sent: dict[int, list[object]] = {0: [], 1: []}

    def broadcast(rank: int) -> Any:
        def send(obj: object, src: int) -> object:  # the fitting rank calls first in this loop; a collective waits
            if rank == src:
                sent[src].append(obj)
            return sent[src][-1]

        return send

    for r, f in enumerate(ranks):
        f.share_refits(rank=r, broadcast=broadcast(r))
    rng = np.random.default_rng(8)
    env = sim.Env(quota=(0.5, None))
    history = []
    deadline = time.monotonic() + 120.0  # the child's start can take seconds on a loaded machine
    plan = iter([PARTS[3]] * 6 + [PARTS[5]] * 12)
    while (p := next(plan, None)) is not None or (history[-1] < 3 and time.monotonic() < deadline):
        window = sim.window(COST, p if p is not None else PARTS[5], env, M, rng)
        agreed = min(f.ready_refit() for f in ranks)
        pending = ranks[0]._refit
        src = pending.src if pending is not None else 0
        chosen = 0 if ranks[0].refits < 1 else 1  # the strategy's choice from the snapshot: rank 0, then rank 1
        for f in sorted(ranks, key=lambda f: f._rank != src):  # the fitting rank first (see broadcast)
            f.refit_rank = chosen
            f.observe(COST, sim.LINK, window, agreed_refit=agreed)
        assert len({f.refits for f in ranks}) == 1
        history.append(ranks[0].refits)
        answers = [f.predict_many(COST, sim.LINK, window, PARTS) for f in ranks]
        assert answers[0] == answers[1] == answers[2]
        time.sleep(0.05)
    assert history[-1] >= 3, history
    assert ranks[0].refit_cpu_s > 0.0 and ranks[1].refit_cpu_s > 0.0 and ranks[2].refit_cpu_s == 0.0
    assert sent[0] and sent[1] and len(sent[0]) + len(sent[1]) == ranks[0].refits
    assert all(f.share_s >= 0.0 for f in ranks)
    refits = ranks[0].refits
    for f in ranks:
        f.close()

    # a refit that fails on the fitting rank (its thread raises): it sends None and nobody switches
    def broken(rows: LabelledSamples) -> Any:
        raise RuntimeError("out of memory")

    ranks[1].refit_in_process = False
    ranks[1].fit_pair = broken  # type: ignore[method-assign]
    for f in ranks:
        f.refit_every = 1
    deadline = time.monotonic() + 60.0
    while sent[1][-1] is not None and time.monotonic() < deadline:  # a window to pair, a refit, its switch
        window = sim.window(COST, PARTS[5], env, M, rng)
        agreed = min(f.ready_refit() for f in ranks)
        for f in sorted(ranks, key=lambda f: f._rank != 1):
            f.observe(COST, sim.LINK, window, agreed_refit=agreed)
        time.sleep(0.02)
    assert sent[1][-1] is None and all(f.refits == refits for f in ranks)
    answers = [f.predict_many(COST, sim.LINK, window, PARTS) for f in ranks]
    assert answers[0] == answers[1] == answers[2]
    for f in ranks:
        f.close()
        f.share_refits(rank=None, broadcast=None)
        assert f.fits_here
    with pytest.raises(ConfigurationError, match=r"share_refits\(rank=1\) needs a broadcast"):
        ranks[1].share_refits(rank=1, broadcast=None)


def test_with_shared_refits_and_no_refitting_rank_named_every_rank_fits_its_own_and_nothing_is_broadcast() -> None:
    """``refit_rank = None`` (``one_rank_refits="auto"`` while no process runs under a CPU limit): each rank fits the
    refit itself from the same rows, and the switch needs no broadcast; a refit started while a rank was named is
    still received from it, whatever is named when it is adopted."""
    ranks = [
        ForestPredictor(n_estimators=8, min_samples=6, refit_every=3, buffer_size=40, refit_on="every")
        for _ in range(2)
    ]
    calls: list[int] = []
    sent: list[object] = []

    def broadcast(rank: int) -> Any:
        def send(obj: object, src: int) -> object:
            calls.append(src)
            if rank == src:
                sent.append(obj)
            return sent[-1]

        return send

    for r, f in enumerate(ranks):
        f.refit_in_process = False  # threads: quick, and the same fit
        f.share_refits(rank=r, broadcast=broadcast(r))
    rng = np.random.default_rng(9)
    env = sim.Env(quota=(0.5, None))

    def step(named: int | None) -> None:
        window = sim.window(COST, PARTS[3], env, M, rng)
        agreed = min(f.ready_refit() for f in ranks)
        pending = ranks[0]._refit
        first = pending.src if pending is not None and pending.src is not None else named
        for f in sorted(ranks, key=lambda f: f._rank != first):  # a fitting rank first (see broadcast)
            f.refit_rank = named
            f.observe(COST, sim.LINK, window, agreed_refit=agreed)
        time.sleep(0.02)

    deadline = time.monotonic() + 60.0
    while ranks[0].refits < 2 and time.monotonic() < deadline:
        step(None)
    assert ranks[0].refits == ranks[1].refits >= 2 and not calls
    assert ranks[0].refits_fitted >= 2 and ranks[1].refits_fitted >= 2
    window = sim.window(COST, PARTS[3], env, M, rng)
    answers = [f.predict_many(COST, sim.LINK, window, PARTS) for f in ranks]
    assert answers[0] == answers[1]
    for f in ranks:  # no new refit until the one in flight has switched
        f.refit_every = 1 << 30
    while ranks[0]._refit is not None and time.monotonic() < deadline:
        step(None)
    # rank 1 named: the next refit runs there only and is received by both at the switch
    fitted, refits = [f.refits_fitted for f in ranks], ranks[0].refits
    for f in ranks:
        f.refit_every = 1
    step(1)
    for f in ranks:
        f.refit_every = 1 << 30
    assert ranks[0]._refit is not None and ranks[0]._refit.src == 1 and ranks[1]._refit is not None
    assert ranks[0]._refit.remote and not ranks[1]._refit.remote
    while ranks[0].refits == refits and time.monotonic() < deadline:
        step(None)
    assert calls and set(calls) == {1} and ranks[0].refits == ranks[1].refits == refits + 1
    assert ranks[0].refits_fitted == fitted[0] and ranks[1].refits_fitted == fitted[1] + 1
    for f in ranks:
        f.close()


def test_refits_run_in_a_child_process_that_fits_the_same_forest_and_close_ends() -> None:
    """A refit thread shares the training thread's GIL (and stalled it on a contended core): refits run in a child
    process, which fits the same forest as this process would, and close() ends it and removes its files."""
    from lightning_dynpipe.predictor.refit import RefitProcess

    f = ForestPredictor(n_estimators=8, min_samples=6, refit_every=3, adopt_after=1)
    rng = np.random.default_rng(3)
    env = sim.Env(quota=(0.5, None))
    for p in [PARTS[3]] * 5 + [PARTS[5]] * 4:
        f.observe(COST, sim.LINK, sim.window(COST, p, env, M, rng))
    worker = f._worker
    assert worker is not None and worker._proc is not None and worker._proc.pid != os.getpid()
    assert f.refits >= 1
    # the child reports each refit's CPU: what the online learning costs, counted after the worker is gone too
    spent = f.refit_cpu_s
    assert spent > 0.0 and worker.cpu_s == spent
    proc, files = worker._proc, worker._dir
    f.close()
    assert proc.poll() is not None and files is not None and not files.exists()
    assert f.refit_cpu_s == spent

    child = RefitProcess()
    child.submit(f._params(), f.samples)
    stage, boundary = child.result()
    child.close()
    here_stage, here_boundary = f.fit_pair(f.samples)
    assert stage is not None and here_stage is not None and boundary is not None and here_boundary is not None
    x = f.samples.stage_x
    for a, b in zip(stage.predict(x), here_stage.predict(x)):
        assert np.array_equal(a, b)


def test_the_refit_child_removes_its_directory_when_its_parent_is_gone() -> None:
    """A rank killed by a failure never calls close(): the child, whose input then ends, removes the private
    directory itself (before, each killed rank left a dynpipe-refit-* directory in the temporary folder)."""
    from lightning_dynpipe.predictor.refit import RefitProcess

    child = RefitProcess()
    child.start()
    proc, files = child._proc, child._dir
    assert proc is not None and proc.stdin is not None and files is not None and files.is_dir()
    proc.stdin.close()  # what the parent's death does to the pipe
    assert proc.wait(timeout=60) == 0
    assert not files.exists()
    child.close()


def test_a_refit_child_whose_parent_never_read_its_answers_ends_quietly(tmp_path: Path) -> None:
    """A script that uses a forest and exits without close() closes the child's answer pipe unread: the child's
    ``ready`` then meets a broken pipe, and it used to print that traceback on the script's terminal."""
    import subprocess
    import sys

    files = tmp_path / "dynpipe-refit-test"
    files.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from lightning_dynpipe.predictor.refit import main; main()", str(files)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdout.close()  # the parent is gone before the child's imports are done
    proc.stdin.close()
    assert proc.stderr is not None
    with proc.stderr:
        err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert not files.exists()


def test_a_forest_that_explains_the_new_windows_skips_its_refit_and_refits_when_they_change() -> None:
    """refit_on="miss": a refit costs CPU (on a stage under a CPU limit, out of that limit), so a fitted forest
    refits only when the rows since its last refit fall outside their intervals more often than 1 - coverage."""
    # 32 trees: the 90% intervals of 8 trees are coarse quantiles, which miss more often than nominal
    f = ForestPredictor(n_estimators=32, min_samples=6, refit_every=3, adopt_after=1).fit(_training_samples())
    f.refit_in_process = False  # a thread: this test is about when refits start, not where they run
    rng = np.random.default_rng(11)
    seen = sim.Env(quota=(None, 0.25))  # a scenario of the calibration rows
    for _ in range(10):
        f.observe(COST, sim.LINK, sim.window(COST, PARTS[4], seen, M, rng))
    assert f.refits == 0 and f.refits_skipped >= 2, (f.refits, f.refits_skipped, f._misses_since_refit)
    harsher = sim.Env(quota=(None, 0.1), hog=(1.0, 0.0))  # harsher, but what its features and priors explain
    for _ in range(6):
        f.observe(COST, sim.LINK, sim.window(COST, PARTS[4], harsher, M, rng))
    assert f.refits == 0
    for i in range(6):  # every other window twice as slow, nothing in the features saying why: the intervals miss
        w, k = sim.window(COST, PARTS[4], seen, M, rng), 1 + i % 2
        slow = tuple(dataclasses.replace(t, compute_s=k * t.compute_s, step_s=k * t.step_s) for t in w.stages)
        f.observe(COST, sim.LINK, dataclasses.replace(w, stages=slow))
    assert f.refits >= 1
    f.close()
    every = ForestPredictor(n_estimators=8, min_samples=6, refit_every=3, adopt_after=1, refit_on="every")
    every.fit(_training_samples())
    every.refit_in_process = False
    for _ in range(10):
        every.observe(COST, sim.LINK, sim.window(COST, PARTS[4], seen, M, rng))
    assert every.refits >= 2 and every.refits_skipped == 0
    every.close()
    with pytest.raises(ConfigurationError, match="refit_on must be 'miss'"):
        ForestPredictor(refit_on="sometimes")
    from lightning_dynpipe.predictor.forest import _binomial_tail

    assert _binomial_tail(9, 2, 0.1) == pytest.approx(0.2252, abs=1e-4)  # what the docstring says: 23%, and 0.8%
    assert _binomial_tail(9, 4, 0.1) == pytest.approx(0.0083, abs=1e-4)
    assert _binomial_tail(9, 0, 0.1) == 1.0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs 2 cores")
def test_a_refit_child_of_a_pinned_process_runs_on_its_cores_or_on_any() -> None:
    """``refit_cores="own"`` keeps the stage's pin (the child inherits it); ``"any"``: every core the machine
    allows, so that an idle-priority refit can take another stage's idle core."""
    from lightning_dynpipe.predictor.refit import RefitProcess

    every = set(range(os.cpu_count() or 1)) & os.sched_getaffinity(0)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(every)})  # this thread, which starts the children: a stage pinned to its core
    try:
        own, anywhere = RefitProcess("own"), RefitProcess("any")
        own.start()
        anywhere.start()
    finally:
        os.sched_setaffinity(0, before)
    try:
        assert own.wait_ready(60.0) and anywhere.wait_ready(60.0)  # the child sets its cores before it says ready
        assert own._proc is not None and anywhere._proc is not None
        assert os.sched_getaffinity(own._proc.pid) == {min(every)}
        assert os.sched_getaffinity(anywhere._proc.pid) == every
    finally:
        own.close()
        anywhere.close()
    with pytest.raises(ConfigurationError, match="refit_cores=...\\) takes 'own'"):
        ForestPredictor(refit_cores="all")
    for forest, cores in ((ForestPredictor(), "any"), (ForestPredictor(refit_cores="own"), "own")):
        try:
            worker = forest._ensure_worker()
            assert worker is not None and worker.cores == cores
        finally:
            forest.close()


def test_the_refit_child_runs_at_the_lowest_priority() -> None:
    """Nice 19, and on Linux SCHED_IDLE: a stage thread woken by a message takes its core from a refit at once (under
    nice 19 alone a refit cost the throughput benchmark's MLP 19% of its samples/s in a short run, 8% with it)."""
    from lightning_dynpipe.predictor.refit import RefitProcess

    child = RefitProcess()
    child.start()
    proc = child._proc
    assert proc is not None
    idle = getattr(os, "SCHED_IDLE", None)
    deadline = time.monotonic() + 60.0  # the child sets its priority first thing, before importing scikit-learn
    try:
        while time.monotonic() < deadline:
            niced = os.getpriority(os.PRIO_PROCESS, proc.pid) == 19
            if niced and (idle is None or os.sched_getscheduler(proc.pid) == idle):
                break
            time.sleep(0.05)
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == 19
        if idle is not None:
            assert os.sched_getscheduler(proc.pid) == idle
    finally:
        child.close()


def test_prepare_waits_for_the_refit_process_imports_and_both_of_its_lines_are_seen() -> None:
    """prepare() returns once the child has imported scikit-learn (imports beside the first steps slowed them), and
    a child that said "ready" and "done" before the parent looked is seen done: the first line read must not hide
    the second from select() in a read buffer."""
    from lightning_dynpipe.predictor.refit import RefitProcess

    f = ForestPredictor(n_estimators=8, min_samples=6)
    f.prepare()
    assert f._worker is not None and f._worker._ready
    f.close()

    rng = np.random.default_rng(5)
    env = sim.Env(quota=(0.5, None))
    g = ForestPredictor(n_estimators=8, min_samples=6, refit_every=100)  # rows only: no refit here
    g.refit_in_process = False
    for p in [PARTS[3]] * 5 + [PARTS[5]] * 4:
        g.observe(COST, sim.LINK, sim.window(COST, p, env, M, rng))
    child = RefitProcess()
    child.submit(g._params(), g.samples)  # at once: the child is still importing
    deadline = time.monotonic() + 120.0
    assert child._dir is not None
    while not list(child._dir.glob("*.out")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # both lines are in the pipe before the parent looks
    assert child.done() and child.cpu_s > 0.0
    stage, _ = child.result()
    assert stage is not None
    child.close()


def test_rows_that_share_a_windows_noise_are_held_out_together_when_the_margin_is_calibrated() -> None:
    """Every layer set measured under every scenario, one window each, several rows per window (priced from several
    other windows): the rows of one window share its noise, and the trees, which can tell the window by its layer
    set and scenario, learn that noise. Out of bag, a row is scored by trees that drew its window's other rows, so
    the margin leaves out the noise a new window brings; held out by window, it is wider and covers new windows
    better."""
    rng = np.random.default_rng(0)
    offset = rng.normal(0.0, 0.3, 6)

    def measure(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        r = np.random.default_rng(seed)
        g, s = np.meshgrid(np.arange(6), np.arange(5), indexing="ij")
        g, s = np.repeat(g.ravel(), 6), np.repeat(s.ravel(), 6)
        window = g * 5 + s + 100 * seed
        noise = r.normal(0.0, 0.1, 30)[window % 100]
        x = np.column_stack([g * 1.0, s * 1.0, r.uniform(0, 1, len(g))])
        return x, offset[g] + 0.1 * s + noise + r.normal(0, 0.01, len(g)), g, window

    x, y, g, window = measure(1)
    held_out = QuantileForest(random_state=0).fit(x, y, groups=g, windows=window)
    out_of_bag = QuantileForest(random_state=0).fit(x, y, groups=g)
    assert held_out.seen_margin > out_of_bag.seen_margin
    new_x, new_y, new_g, _ = measure(2)  # the same layer sets and scenarios, new windows
    covered = {}
    for name, forest in (("held out", held_out), ("out of bag", out_of_bag)):
        _, lo, hi = forest.predict(new_x, groups=new_g)
        covered[name] = float(np.mean((lo <= new_y) & (new_y <= hi)))
    assert covered["held out"] >= 0.80 and covered["held out"] > covered["out of bag"], covered
