"""Varuna's and the original DynPipe's trigger rules as policies: when they trigger, where they go, and that they
run inside the controller (which fills the per-stage times they read)."""

from __future__ import annotations

import doctest

import pytest

import lightning_dynpipe.repartition.rules
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.convergence import ConvergenceModel
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor import StageTimes
from lightning_dynpipe.repartition import AdaptiveController, RepartitionPolicy
from lightning_dynpipe.repartition.policy import PolicyInputs
from lightning_dynpipe.repartition.rules import DynPipeThresholdRule, VarunaRule

P, Q = Partition((4, 4)), Partition((5, 3))


def _inputs(step: int, slowdowns: tuple[float, ...] = (1.0, 1.0), times: tuple[float, ...] = (0.1, 0.1),
            candidate: Partition = Q) -> PolicyInputs:  # fmt: skip
    return PolicyInputs(step, P, candidate, 0.1, 0.08, 0.1, 0.01, 100, slowdowns, stage_compute_s=times)


def test_docstring_examples() -> None:
    assert doctest.testmod(lightning_dynpipe.repartition.rules).failed == 0


def test_rules_are_policies() -> None:
    assert isinstance(VarunaRule(), RepartitionPolicy) and isinstance(DynPipeThresholdRule(), RepartitionPolicy)


def test_varuna_triggers_above_15_percent_of_the_median_stage() -> None:
    rule = VarunaRule()
    # three stages: median 1.0; 1.14 is within 15%, 1.16 is not
    assert not rule.decide(_inputs(10, (1.0, 1.0, 1.14))).repartition
    d = rule.decide(_inputs(20, (1.0, 1.0, 1.16)))
    assert d.repartition and d.partition == Q and "stage 2" in d.reason


def test_varuna_triggered_but_planner_keeps_the_partition() -> None:
    d = VarunaRule().decide(_inputs(10, (1.0, 3.0), candidate=P))
    assert not d.repartition and "keeps" in d.reason


def test_varuna_history_reference_detects_a_change_and_restarts_after_a_move() -> None:
    rule = VarunaRule(reference="history", history_checks=3)
    for step in (10, 20, 30):
        assert not rule.decide(_inputs(step, times=(0.1, 0.1))).repartition
    assert rule.decide(_inputs(40, times=(0.1, 0.12))).repartition  # 20% over its own median of 0.1
    rule.migrated(40)
    assert not rule.decide(_inputs(50, times=(0.1, 0.5))).repartition  # no history under the new partition yet


def test_varuna_cooldown_and_bad_config() -> None:
    rule = VarunaRule(cooldown_steps=30)
    rule.migrated(10)
    assert not rule.decide(_inputs(20, (1.0, 5.0))).repartition
    assert rule.decide(_inputs(40, (1.0, 5.0))).repartition
    with pytest.raises(ConfigurationError, match="threshold > 0"):
        VarunaRule(threshold=0.0)
    with pytest.raises(ConfigurationError, match="valid: 'stages', 'history'"):
        VarunaRule(reference="peers")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="stage_compute_s"):
        VarunaRule(reference="history").decide(_inputs(10, times=()))


def test_dynpipe_rule_checks_every_50_steps_for_a_2x_change_either_way() -> None:
    rule = DynPipeThresholdRule()
    assert not rule.decide(_inputs(10, times=(0.1, 0.1))).repartition  # reference
    assert not rule.decide(_inputs(50, times=(0.1, 0.5))).repartition  # 40 steps: not a check yet
    assert not rule.decide(_inputs(60, times=(0.1, 0.19))).repartition  # 1.9x: below the factor
    d = rule.decide(_inputs(110, times=(0.04, 0.1)))  # stage 0 halved (2.5x faster)
    assert d.repartition and "stage 0" in d.reason
    assert not rule.decide(_inputs(160, times=(0.04, 0.1))).repartition  # the trigger's window is the reference


def test_dynpipe_rule_resets_its_reference_after_a_migration() -> None:
    rule = DynPipeThresholdRule(check_every_steps=10)
    rule.decide(_inputs(10, times=(0.1, 0.1)))
    rule.migrated(10)
    assert "reference" in rule.decide(_inputs(20, times=(0.3, 0.1))).reason
    with pytest.raises(ConfigurationError, match="factor > 1"):
        DynPipeThresholdRule(factor=1.0)


def test_rules_run_inside_the_controller() -> None:
    cost = ModelCost.from_arrays([0.001] * 8, [0.002] * 8, param_bytes=[1000] * 8)
    rule = DynPipeThresholdRule(check_every_steps=10)
    controller = AdaptiveController(
        rule, model_cost=cost, comm=CommModel(), schedule="async", num_microbatches=4,
        convergence=ConvergenceModel(beta=0.0),
    )  # fmt: skip
    clean = [StageTimes(0.048, 0.05), StageTimes(0.048, 0.05)]
    slowed = [StageTimes(0.048, 0.2), StageTimes(0.192, 0.2)]  # stage 1 4x slower
    d1 = controller.check(10, clean, Partition((4, 4)), remaining_steps=500)
    d2 = controller.check(20, slowed, Partition((4, 4)), remaining_steps=500)
    assert d1 is not None and not d1.repartition
    assert d2 is not None and d2.repartition and d2.partition.balance[0] > 4, d2
    assert d2.inputs.stage_compute_s == (0.048, 0.192)
