"""The adaptive loop in a fit: decisions are taken from the monitor's snapshots, and a partition the run could
not train exactly (the strategy refuses it) is skipped, not a crash in the middle of training."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.monitor.stats import StageReport, StageSample, StageSummary
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.strategy.adaptation import MIN_SAMPLES, AdaptationWiring, refit_rank, spare_cpu_rank
from lightning_dynpipe.strategy.config import DynPipeConfig


class _Controller:
    def __init__(self) -> None:
        self.migrated_at: list[int] = []

    def check(self, step: int, *args: Any, **kwargs: Any) -> Any:
        return SimpleNamespace(repartition=True, partition=Partition((3, 1)))

    def migrated(self, step: int) -> None:
        self.migrated_at.append(step)


def _snapshot(count: int) -> Any:
    stage = StageSummary.of([StageSample(step_s=0.1, forward_s=0.02, backward_s=0.04)] * count)
    return SimpleNamespace(stages=[stage, stage], replicas=[StageReport(0, 0, stage), StageReport(0, 1, stage)])


def _attached(cfg: DynPipeConfig, **trainer: Any) -> tuple[AdaptationWiring, Any]:
    """A wiring of ``cfg`` attached to a (fake) trainer with a stage monitor, for a 4-layer model in 2 stages
    (``trainer``: more attributes of the fake trainer, e.g. ``world_size``)."""
    from lightning_dynpipe.monitor.callback import StageMonitor
    from lightning_dynpipe.plan.costs import CommModel, ModelCost

    wiring = AdaptationWiring(
        cfg, partition=lambda: Partition((2, 2)), pending=lambda: False, repartition=print, past_pauses=lambda: []
    )
    fake = SimpleNamespace(callbacks=[StageMonitor(every_n_steps=10)], **trainer)
    wiring.attach(
        fake, model_cost=ModelCost.from_arrays([1.0] * 4, [2.0] * 4), comm=CommModel(), num_stages=2, replicas=1
    )  # type: ignore[arg-type]
    return wiring, fake


def _wiring(repartition: Any) -> tuple[AdaptationWiring, _Controller]:
    wiring = AdaptationWiring(
        DynPipeConfig.from_arguments(),
        partition=lambda: Partition((2, 2)),
        pending=lambda: False,
        repartition=repartition,
        past_pauses=lambda: [],
    )
    controller = _Controller()
    wiring.controller = controller  # type: ignore[assignment]
    return wiring, controller


TRAINER = SimpleNamespace(global_step=40, estimated_stepping_batches=100)


def test_a_decision_to_move_is_applied_and_starts_the_cool_down() -> None:
    moved: list[Partition] = []
    wiring, controller = _wiring(moved.append)
    wiring.on_snapshot(_snapshot(MIN_SAMPLES), TRAINER)  # type: ignore[arg-type]
    assert moved == [Partition((3, 1))] and controller.migrated_at == [40]


def test_too_short_a_window_decides_nothing() -> None:
    moved: list[Partition] = []
    wiring, controller = _wiring(moved.append)
    wiring.on_snapshot(_snapshot(MIN_SAMPLES - 1), TRAINER)  # type: ignore[arg-type]
    assert moved == [] and controller.migrated_at == []


def test_a_refused_partition_is_skipped() -> None:
    def refuse(p: Partition) -> None:
        raise ConfigurationError("Parameters shared by layers on different stages cannot be trained exactly")

    wiring, controller = _wiring(refuse)
    wiring.on_snapshot(_snapshot(MIN_SAMPLES), TRAINER)  # type: ignore[arg-type]
    assert controller.migrated_at == []


def test_the_predictor_argument_takes_a_name_or_an_object_and_reaches_the_controller() -> None:
    from lightning_dynpipe.plan.costs import CommModel, ModelCost
    from lightning_dynpipe.predictor import ForestPredictor, MeasuredSlowdownPredictor

    assert isinstance(DynPipeConfig.from_arguments().predictor, MeasuredSlowdownPredictor)  # the default
    assert isinstance(DynPipeConfig.from_arguments(predictor="forest").predictor, ForestPredictor)
    mine = ForestPredictor(n_estimators=8)
    cfg = DynPipeConfig.from_arguments(predictor=mine)
    assert cfg.predictor is mine
    with pytest.raises(ConfigurationError, match=r"one of \['measured', 'forest'\] .*got 'oracle'"):
        DynPipeConfig.from_arguments(predictor="oracle")
    with pytest.raises(ConfigurationError, match=r"an object with a predict\(model_cost, comm, window, candidate\)"):
        DynPipeConfig.from_arguments(predictor=object())  # type: ignore[arg-type]
    wiring = AdaptationWiring(
        cfg, partition=lambda: Partition((2, 2)), pending=lambda: False, repartition=print, past_pauses=lambda: []
    )
    from lightning_dynpipe.monitor.callback import StageMonitor

    trainer = SimpleNamespace(callbacks=[StageMonitor(every_n_steps=10)])
    cost = ModelCost.from_arrays([1.0] * 4, [2.0] * 4)
    wiring.attach(trainer, model_cost=cost, comm=CommModel(), num_stages=2, replicas=1)  # type: ignore[arg-type]
    assert wiring.controller is not None and wiring.controller.predictor is mine


def test_the_ranks_agreed_refit_reaches_the_controller_and_the_token_is_published() -> None:
    from lightning_dynpipe.monitor.callback import StageMonitor
    from lightning_dynpipe.plan.costs import CommModel, ModelCost
    from lightning_dynpipe.predictor import ForestPredictor

    forest = ForestPredictor(n_estimators=8)
    cfg = DynPipeConfig.from_arguments(predictor=forest)
    wiring = AdaptationWiring(
        cfg, partition=lambda: Partition((2, 2)), pending=lambda: False, repartition=print, past_pauses=lambda: []
    )
    monitor = StageMonitor(every_n_steps=10)
    trainer = SimpleNamespace(callbacks=[monitor], global_step=40, estimated_stepping_batches=100)
    wiring.attach(
        trainer, model_cost=ModelCost.from_arrays([1.0] * 4, [2.0] * 4), comm=CommModel(), num_stages=2, replicas=1
    )  # type: ignore[arg-type]
    assert monitor.report_token is not None and monitor.report_token() == 0.0  # nothing refitted yet
    seen: list[Any] = []

    class Recording(_Controller):
        def check(self, step: int, *args: Any, **kwargs: Any) -> Any:
            seen.append((kwargs.get("agreed_refit"), kwargs.get("stage_signs")))
            return SimpleNamespace(repartition=False, partition=Partition((2, 2)))

    wiring.controller = Recording()  # type: ignore[assignment]
    snapshot = _snapshot(MIN_SAMPLES)
    snapshot.agreed_token = 3.0
    wiring.on_snapshot(snapshot, trainer)  # type: ignore[arg-type]
    assert seen == [(3, [])]  # the snapshot's processes have no system readings: no signs
    wiring.detach(trainer)  # type: ignore[arg-type]
    assert monitor.report_token is None


def test_attaching_a_forest_starts_its_refit_process_and_imports_scikit_learn_before_the_first_step() -> None:
    import sys

    from lightning_dynpipe.predictor import ForestPredictor

    forest = ForestPredictor(n_estimators=8)
    wiring, trainer = _attached(DynPipeConfig.from_arguments(predictor=forest))
    try:
        assert forest._worker is not None and forest._worker._proc is not None  # started, not at the first window
        assert "sklearn.ensemble" in sys.modules
    finally:
        wiring.detach(trainer)  # type: ignore[arg-type]
    assert forest._worker is None  # the fit's end closes it


def _rank1_of_two(predictor: Any) -> tuple[AdaptationWiring, Any]:
    """A wiring of ``predictor`` attached as global rank 1 of a 2-process fit at step 40 of 100."""
    return _attached(
        DynPipeConfig.from_arguments(predictor=predictor),
        world_size=2,
        global_rank=1,
        global_step=40,
        estimated_stepping_batches=100,
    )


def _two_rank_snapshot(last: StageSummary) -> Any:
    """A snapshot of a 2-stage fit: stage 0 on rank 1, quiet; stage 1 on rank 0, its summary ``last``."""
    free = StageSummary.of([StageSample(step_s=0.1, forward_s=0.02, backward_s=0.04)] * MIN_SAMPLES)
    return SimpleNamespace(
        stages=[free, last],
        replicas=[StageReport(0, 0, free, rank=1), StageReport(0, 1, last, rank=0)],
        agreed_token=0.0,
        step=40,
    )


def test_with_one_rank_refits_a_fit_of_several_processes_refits_where_cpu_is_spare() -> None:
    from lightning_dynpipe.monitor.callback import StageMonitor
    from lightning_dynpipe.predictor import ForestPredictor

    every = ForestPredictor(n_estimators=8, one_rank_refits=False)  # every rank fits every refit
    wiring, trainer = _attached(DynPipeConfig.from_arguments(predictor=every), world_size=2, global_rank=1)
    wiring.detach(trainer)  # type: ignore[arg-type]
    assert every._rank is None and every._broadcast is None and every.fits_here
    forest = ForestPredictor(n_estimators=8, one_rank_refits=True)
    wiring, trainer = _rank1_of_two(forest)
    try:
        monitor = trainer.callbacks[0]
        assert isinstance(monitor, StageMonitor) and forest._broadcast == monitor.broadcast_object
        assert forest._rank == 1 and forest.refit_rank == 0 and not forest.fits_here
        assert monitor.broadcast_object("rank 0's forests", 0) == "rank 0's forests"  # one process: no collective
        # each check names the rank with spare CPU: here rank 0 runs the last stage under a CPU limit of a quarter
        free = StageSummary.of([StageSample(step_s=0.1, forward_s=0.02, backward_s=0.04)] * MIN_SAMPLES)
        wiring.controller = _Controller()  # type: ignore[assignment]
        wiring.on_snapshot(_two_rank_snapshot(dataclasses.replace(free, cpu_limit=0.25)), trainer)  # type: ignore[arg-type]
        assert forest.refit_rank == 1 and forest.fits_here
    finally:
        wiring.detach(trainer)  # type: ignore[arg-type]
    assert forest.fits_here and forest._broadcast is None  # a later fit in one process refits on its own


def test_by_default_one_rank_refits_only_while_a_process_of_the_fit_runs_under_a_cpu_limit() -> None:
    """``one_rank_refits="auto"`` (the default): every rank fits its own refits (no broadcast at the switch) until a
    snapshot shows a process under a CPU limit, whose refits would spend its quota; then the rank with the highest
    limit fits them, as with ``True``, and back when the limit is gone."""
    from lightning_dynpipe.predictor import ForestPredictor

    forest = ForestPredictor(n_estimators=8)
    assert forest.one_rank_refits == "auto"
    wiring, trainer = _rank1_of_two(forest)
    try:
        monitor = trainer.callbacks[0]
        assert forest._broadcast == monitor.broadcast_object and forest._rank == 1
        free = StageSummary.of([StageSample(step_s=0.1, forward_s=0.02, backward_s=0.04)] * MIN_SAMPLES)
        limited = dataclasses.replace(free, cpu_limit=0.25)
        wiring.controller = _Controller()  # type: ignore[assignment]
        for last, rank in ((free, None), (limited, 1), (free, None)):
            wiring.on_snapshot(_two_rank_snapshot(last), trainer)  # type: ignore[arg-type]
            assert forest.refit_rank == rank and forest.fits_here
    finally:
        wiring.detach(trainer)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="one_rank_refits"):
        ForestPredictor(one_rank_refits="yes")  # type: ignore[arg-type]


def test_the_refitting_rank_is_every_rank_without_a_cpu_limit_under_auto_and_the_spare_one_otherwise() -> None:
    base = StageSummary.of([StageSample(step_s=0.1, forward_s=0.02, backward_s=0.04)] * MIN_SAMPLES)

    def snap(*summaries: StageSummary) -> Any:
        return SimpleNamespace(replicas=[StageReport(0, k, s, rank=k) for k, s in enumerate(summaries)])

    def with_(**kw: Any) -> StageSummary:
        return dataclasses.replace(base, **kw)

    assert refit_rank(snap(base, base), one_rank_refits="auto") is None
    assert refit_rank(snap(with_(cpu_limit=float("inf")), base), one_rank_refits="auto") is None  # no limit read
    assert refit_rank(snap(with_(cpu_limit=0.25, cpu_share=0.2), base), one_rank_refits="auto", any_core=True) == 1
    # every process under one container's limit: one rank's refits spend the shared limit once, not once per rank
    assert refit_rank(snap(with_(cpu_limit=4.0), with_(cpu_limit=4.0)), one_rank_refits="auto") == 0
    assert refit_rank(snap(base, base), one_rank_refits=True) == 0
    assert refit_rank(snap(with_(cpu_share=0.95), with_(cpu_share=0.6)), one_rank_refits=True) == 1


def test_the_rank_with_spare_cpu_is_the_one_whose_limit_leaves_the_most_over_its_use_and_other_load() -> None:
    base = StageSummary.of([StageSample(step_s=0.1, forward_s=0.02, backward_s=0.04)] * MIN_SAMPLES)

    def snap(*summaries: StageSummary) -> Any:
        return SimpleNamespace(replicas=[StageReport(0, k, s, rank=k) for k, s in enumerate(summaries)])

    def with_(**kw: Any) -> StageSummary:
        return dataclasses.replace(base, **kw)

    assert spare_cpu_rank(snap(base, base)) == 0  # a tie: the lowest rank
    assert spare_cpu_rank(snap(with_(cpu_limit=0.5), base)) == 1  # a limit: its refit CPU comes out of it
    assert spare_cpu_rank(snap(with_(cpu_limit=0.5), with_(cpu_limit=0.25))) == 0  # the looser limit
    assert spare_cpu_rank(snap(with_(other_cpu_load=1.0), base)) == 1  # a hog on its core
    assert spare_cpu_rank(snap(with_(other_cpu_load=0.05), base)) == 0  # within a quarter core: no difference
    assert spare_cpu_rank(snap(with_(cpu_share=0.95), with_(cpu_share=0.6))) == 1  # the stage that waits more
    # the slowest stage keeps its core busy; a limited stage that waits for it has half of its limit to spare
    # (a CNN under a half-core quota after the move to [3, 2]: a refit at the lowest priority waited 8 s and more
    # on the first, 0.6 s on the second)
    busy, limited = with_(cpu_share=1.0), with_(cpu_limit=0.5, cpu_share=0.27)
    assert spare_cpu_rank(snap(busy, limited)) == 1
    assert spare_cpu_rank(snap(with_(cpu_limit=0.5, cpu_share=0.5), with_(cpu_share=0.5))) == 1  # none left at 0.5
    # neither has a quarter core to spare: not within the limit, where a refit spends the stage's quota (the CNN
    # under a quarter-core quota after the move to [4, 1]: the limited stage used 0.2 of its 0.25, the other 0.98)
    assert spare_cpu_rank(snap(with_(cpu_limit=0.25, cpu_share=0.2), with_(cpu_share=0.98))) == 1
    assert spare_cpu_rank(snap(with_(cpu_limit=0.5, cpu_share=0.45), with_(cpu_limit=0.25, cpu_share=0.2))) == 0
    assert spare_cpu_rank(SimpleNamespace(replicas=[StageReport(0, 0, base)])) == 0  # ranks unknown
    # a refit free to run on any core runs in a limited stage's idle time from the unlimited process, outside the
    # limit: the highest limit first, then the spare CPU
    assert spare_cpu_rank(snap(busy, limited), any_core=True) == 0
    assert spare_cpu_rank(snap(with_(cpu_limit=0.25, cpu_share=0.2), with_(cpu_share=0.98)), any_core=True) == 1
    assert (
        spare_cpu_rank(snap(with_(cpu_limit=0.5, cpu_share=0.2), with_(cpu_limit=0.5, cpu_share=0.45)), any_core=True)
        == 0
    )
    assert spare_cpu_rank(snap(with_(cpu_share=0.95), with_(cpu_share=0.6)), any_core=True) == 1
    assert spare_cpu_rank(snap(base, base), any_core=True) == 0


def test_each_fit_starts_the_policy_from_scratch() -> None:
    """A policy object reused for another fit (an in-process launch runs several fits in one process) forgets the
    last fit's refusals, cool-down and measured partitions when the adaptive loop is attached."""
    from lightning_dynpipe.repartition.policy import GainOverCostPolicy, PolicyInputs

    policy = GainOverCostPolicy(patience=1, cooldown_steps=50)
    cur, cand = Partition((2, 2)), Partition((3, 1))

    def inputs(step: int, current: Partition = cur, candidate: Partition = cand, s: float = 1.0) -> PolicyInputs:
        return PolicyInputs(step, current, candidate, s, 0.5, s, 0.01, None, (1.0, 1.0), conditions=(False, False))

    assert policy.decide(inputs(10)).repartition
    policy.migrated(10)
    assert policy.decide(inputs(20, cand, cur, s=2.0)).repartition  # slower: rolled back, CAND refused
    policy.migrated(20)
    assert not policy.decide(inputs(100)).repartition  # refused
    wiring, _ = _attached(DynPipeConfig.from_arguments(adaptive=policy))
    assert wiring.controller is not None and wiring.controller.policy is policy
    assert policy.decide(inputs(10)).repartition  # a new fit: nothing refused, no cool-down, nothing remembered
