"""The opt-in calibration sweep at set-up: its refusals (unit tests), and one fit on a transformer through Lightning
(the popen launcher runs ``scripts/calibrate_fit.py``; its docstring lists what it checks)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from pipeline_models import TinyNet, loader, run_popen_script, trainer_kwargs

from lightning_dynpipe import DynPipeStrategy
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.strategy.config import DynPipeConfig
from lightning_dynpipe.sweep import DEFAULT_SCENARIOS, SweepSettings

SCRIPT = Path(__file__).parent / "scripts" / "calibrate_fit.py"


def test_calibrate_resolves_to_sweep_settings_and_is_off_by_default() -> None:
    assert DynPipeConfig.from_arguments().calibrate is None
    cfg = DynPipeConfig.from_arguments(predictor="forest", calibrate=True)
    assert cfg.calibrate == SweepSettings() and cfg.calibrate.scenarios == DEFAULT_SCENARIOS
    mine = SweepSettings(scenarios=("none", "quota50"), partitions=4, steps=2)
    assert DynPipeConfig.from_arguments(predictor="forest", calibrate=mine).calibrate is mine


def test_calibrate_is_refused_where_nothing_would_learn_from_it() -> None:
    with pytest.raises(ConfigurationError, match=r"MeasuredSlowdownPredictor has no fit\(samples\) method"):
        DynPipeConfig.from_arguments(calibrate=True)  # the default predictor does not learn
    with pytest.raises(ConfigurationError, match="adaptive=False turns that loop off"):
        DynPipeConfig.from_arguments(predictor="forest", calibrate=True, adaptive=False)
    with pytest.raises(ConfigurationError, match="calibrate must be True, False or a lightning_dynpipe.sweep"):
        DynPipeConfig.from_arguments(predictor="forest", calibrate="yes")  # type: ignore[arg-type]


def test_sweep_settings_state_the_rule() -> None:
    with pytest.raises(ConfigurationError, match=r"unknown: \['bogus'\]"):
        SweepSettings(scenarios=("none", "bogus"))
    with pytest.raises(ConfigurationError, match=r"partitions >= 2 and steps >= 2 \(.*\); got partitions=1, steps=3"):
        SweepSettings(partitions=1)
    with pytest.raises(ConfigurationError, match="balances name at least 2 partitions"):
        SweepSettings(balances=((2, 3),))


def test_calibrate_is_refused_on_cuda_and_for_a_model_built_on_meta() -> None:
    check = DynPipeStrategy._check_calibration
    with pytest.raises(ConfigurationError, match="does not measure this run's cuda stages"):
        check(SimpleNamespace(root_device=torch.device("cuda", 0)), False)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="built on the meta device"):
        check(SimpleNamespace(root_device=torch.device("cpu")), True)  # type: ignore[arg-type]
    check(SimpleNamespace(root_device=torch.device("cpu")), False)  # type: ignore[arg-type]


def test_a_fit_of_a_model_built_on_meta_is_refused_before_the_process_group() -> None:
    trainer = L.Trainer(
        devices=1, max_steps=2, strategy=DynPipeStrategy(predictor="forest", calibrate=True), **trainer_kwargs()
    )
    with trainer.init_module(empty_init=True):
        model = TinyNet()
    with pytest.raises(ConfigurationError, match="calibrate needs the whole model's weights in one process"):
        trainer.fit(model, loader())
    assert not dist.is_initialized()


@pytest.mark.multiprocess
def test_the_sweep_at_setup_fits_every_ranks_forest_alike_and_leaves_the_model_alone() -> None:
    proc = run_popen_script(SCRIPT)
    assert "CALIBRATE_FIT_OK" in proc.stdout, proc.stdout[-2000:]
    # 3 candidate partitions, and up to 3 more the planner proposes from their windows (under the delay, from what
    # the link measured)
    found = re.search(
        r"DynPipe calibration sweep: calibrated on (\d+) windows \(2 scenarios x (\d+) partitions",
        proc.stdout + proc.stderr,
    )
    assert found is not None and int(found[1]) == 2 * int(found[2]) and 3 <= int(found[2]) <= 6, proc.stdout[-2000:]


def test_sweep_rows_priced_with_another_fixed_cost_than_a_loaded_forests_replace_them_with_a_warning() -> None:
    """A forest loaded from a file keeps its rows when the sweep at set-up priced its rows with the same fixed cost
    per micro-batch; with another one the rows cannot mix, and the sweep's (this run's) are kept, with a warning."""
    import numpy as np

    from lightning_dynpipe.predictor import ForestPredictor, LabelledSamples
    from lightning_dynpipe.predictor.features import BOUNDARY_FEATURES, STAGE_FEATURES
    from lightning_dynpipe.strategy.decision import _fit_predictor

    def rows(n: int, fixed_s: float) -> dict[str, object]:
        rng = np.random.default_rng(n)
        return {
            "stage_x": rng.random((n, len(STAGE_FEATURES))),
            "stage_y": rng.random(n),
            "boundary_x": rng.random((n, len(BOUNDARY_FEATURES))),
            "boundary_y": rng.random(n),
            "fixed_s": fixed_s,
        }

    same = ForestPredictor().fit(LabelledSamples(**rows(30, 1e-4)))  # type: ignore[arg-type]
    _fit_predictor(SimpleNamespace(predictor=same), rows(24, 1e-4), "sweep")  # type: ignore[arg-type]
    assert len(same.samples) == 54
    other = ForestPredictor().fit(LabelledSamples(**rows(30, 3e-4)))  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match=r"fixed cost of 0.1 ms per micro-batch and stage, where the predictor's 30"):
        _fit_predictor(SimpleNamespace(predictor=other), rows(24, 1e-4), "sweep")  # type: ignore[arg-type]
    assert len(other.samples) == 24 and other.fixed_s == 1e-4
