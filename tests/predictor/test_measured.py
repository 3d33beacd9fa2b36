"""The predictor protocol's data types and the measured-slowdown baseline (pure, no torch)."""

from __future__ import annotations

import doctest

import pytest

import lightning_dynpipe.predictor.base
import lightning_dynpipe.predictor.measured
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor import (
    InterferencePredictor,
    Interval,
    MeasuredSlowdownPredictor,
    PipelineWindow,
    StageTimes,
)

COST = ModelCost.from_arrays([1.0] * 4, [2.0] * 4, activation_bytes=[100, 200, 300, 400])


@pytest.mark.parametrize("module", [lightning_dynpipe.predictor.base, lightning_dynpipe.predictor.measured])
def test_docstring_examples(module: object) -> None:
    result = doctest.testmod(module)  # type: ignore[arg-type]
    assert result.failed == 0


def test_baseline_carries_each_stage_slowdown_to_any_partition() -> None:
    window = PipelineWindow(Partition((2, 2)), (StageTimes(12.0, 30.0), StageTimes(36.0, 40.0)), 2)
    p = MeasuredSlowdownPredictor().predict(
        COST, CommModel(latency_s=1e-3, bandwidth_Bps=1e5), window, Partition((1, 3))
    )
    assert p.slowdowns == (1.0, 3.0)
    assert [i.value for i in p.stage_compute_s] == [3.0, 27.0]  # 1 layer x 3 s x 1.0 ; 3 layers x 3 s x 3.0
    assert p.boundary_s[0].value == pytest.approx(1e-3 + 100 / 1e5)  # the activation of layer 0 crosses
    assert all(i.low == i.value == i.high for i in (*p.stage_compute_s, *p.boundary_s))  # no spread model
    assert isinstance(MeasuredSlowdownPredictor(), InterferencePredictor)


def test_window_measures_overlap_and_the_pipeline_step() -> None:
    w = PipelineWindow(Partition((2, 2)), (StageTimes(1.0, 5.0, 2.0, 0.5), StageTimes(1.0, 6.0, 2.0, 1.5)), 4)
    assert w.comm_overlap == pytest.approx(0.5) and w.step_s == 6.0
    assert PipelineWindow(Partition((4,)), (StageTimes(1.0, 1.0),), 1).comm_overlap == 0.0
    with pytest.raises(ConfigurationError, match="one StageTimes per stage"):
        PipelineWindow(Partition((2, 2)), (StageTimes(1.0, 1.0),), 4)


def test_interval_must_contain_its_value() -> None:
    assert Interval.point(2.0) == Interval(2.0, 2.0, 2.0)
    with pytest.raises(ConfigurationError, match="low <= value <= high"):
        Interval(1.0, 2.0, 3.0)
