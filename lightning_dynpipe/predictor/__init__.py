"""Interference predictors: from stage statistics measured under one partition to the costs of any other.

* :class:`InterferencePredictor`: the protocol (plain data in and out, see :mod:`.base`);
* :class:`MeasuredSlowdownPredictor`: the baseline, each stage's measured slowdown against its profile (at
  least ``1/q`` under a cgroup CPU limit of ``q`` cores) carried over to any partition, what a stage reads with no
  sign of interference as a fixed cost per micro-batch;
* :class:`ForestPredictor`: a small random forest (scikit-learn, imported on the first fit) that predicts the
  residual over an analytic prior from the stage's environment and the candidate's layer set
  (:mod:`.features`), with calibrated intervals, trained by ``python -m lightning_dynpipe calibrate`` and online.

Pure: no torch, no Lightning.
"""

from __future__ import annotations

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.predictor.base import (
    InterferencePredictor,
    Interval,
    PartitionPrediction,
    PipelineWindow,
    StageTimes,
)
from lightning_dynpipe.predictor.features import FEATURE_SCHEMA, FeatureSchema, LabelledSamples
from lightning_dynpipe.predictor.forest import ForestPredictor, QuantileForest
from lightning_dynpipe.predictor.measured import MeasuredSlowdownPredictor, measured_slowdowns

PREDICTORS: tuple[str, ...] = ("measured", "forest")
"""The names ``DynPipeStrategy(predictor=...)`` accepts (aliases of the classes)."""


def get_predictor(predictor: str | InterferencePredictor) -> InterferencePredictor:
    """The predictor for a name of :data:`PREDICTORS` (a new instance), or the object itself.

    Example::

        >>> type(get_predictor("forest")).__name__
        'ForestPredictor'

    Raises:
        ConfigurationError: an unknown name, or an object without a ``predict`` method.
    """
    if isinstance(predictor, str):
        if predictor == "measured":
            return MeasuredSlowdownPredictor()
        if predictor == "forest":
            return ForestPredictor()
        raise ConfigurationError(
            f"predictor must be one of {list(PREDICTORS)} or an InterferencePredictor object; got {predictor!r}. "
            "For a calibrated forest pass ForestPredictor.load('dynpipe-forest.npz')."
        )
    if not isinstance(predictor, InterferencePredictor):
        raise ConfigurationError(
            f"predictor must be one of {list(PREDICTORS)} or an object with a predict(model_cost, comm, window, "
            f"candidate) method (an InterferencePredictor); got {type(predictor).__name__}."
        )
    return predictor


__all__ = [
    "PREDICTORS",
    "get_predictor",
    "InterferencePredictor",
    "Interval",
    "PartitionPrediction",
    "PipelineWindow",
    "StageTimes",
    "MeasuredSlowdownPredictor",
    "measured_slowdowns",
    "ForestPredictor",
    "QuantileForest",
    "FeatureSchema",
    "FEATURE_SCHEMA",
    "LabelledSamples",
]
