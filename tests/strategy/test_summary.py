"""Lightning's ModelSummary of a partitioned pipeline equals the summary of the whole model (no processes)."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import summarize
from torch import nn

from lightning_dynpipe.engine.shard import Placeholder as _Placeholder
from lightning_dynpipe.strategy.summary import install, uninstall, whole_pipeline_summary


class Net(L.LightningModule):
    def __init__(self, example: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pipeline = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * 8 * 8, 16),
            nn.BatchNorm1d(16),
            nn.Linear(16, 3),
        )
        if example:
            self.example_input_array = torch.zeros(2, 1, 8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.pipeline(x), dim=-1)  # work outside the pipeline, counted in FLOPs too


def _partitioned(model: Net, owned: set[int]) -> dict[int, nn.Module]:
    """What DynPipeStrategy._partition_module does on one stage: other layers to meta, placeholders in."""
    pipeline = model.pipeline
    offloaded: dict[int, nn.Module] = {}
    for i in range(len(pipeline)):
        if i not in owned:
            offloaded[i] = pipeline[i].to("meta")
            pipeline[i] = _Placeholder(i, 1)
    pipeline.forward = lambda *a, **k: pytest.fail("the routed forward ran")  # type: ignore[method-assign]
    return offloaded


def _numbers(summary: Any) -> tuple[Any, ...]:
    return (
        summary._get_summary_data(),
        summary.total_parameters,
        summary.trainable_parameters,
        summary.model_size,
        summary.total_training_modes,
        summary.total_flops,
    )


@pytest.mark.parametrize("example", [False, True], ids=["no-example", "example_input_array"])
@pytest.mark.parametrize("max_depth", [1, 2])
@pytest.mark.parametrize("owned", [{0, 1}, {3, 4, 5}, {2}], ids=["first", "last", "no-params"])
def test_equals_the_whole_models_summary(example: bool, max_depth: int, owned: set[int]) -> None:
    whole = Net(example)
    expected = _numbers(summarize(copy.deepcopy(whole), max_depth=max_depth))
    model = copy.deepcopy(whole)
    offloaded = _partitioned(model, owned)
    own_weights = {k: v.clone() for k, v in model.state_dict().items()}
    assert sum(p.numel() for p in model.parameters()) < expected[1]  # what Lightning alone would count

    got = whole_pipeline_summary(model, model.pipeline, offloaded, max_depth)

    assert _numbers(got) == expected
    if example:
        assert got.total_flops > 0 and "Out sizes" in dict(got.summary_data)
    # the stage's module is as it was: placeholders back, routed forward back, own tensors untouched
    assert all(isinstance(model.pipeline[i], _Placeholder) for i in offloaded)
    assert "forward" in vars(model.pipeline)
    for k, v in model.state_dict().items():
        assert v.device.type == "cpu" and torch.equal(v, own_weights[k]), k


def test_an_example_that_cannot_run_on_meta_gives_a_summary_without_sizes() -> None:
    whole = Net(example=False)
    expected = _numbers(summarize(copy.deepcopy(whole), max_depth=1))
    model = copy.deepcopy(whole)
    offloaded = _partitioned(model, {0})
    bad = torch.zeros(2, 5)  # wrong shape: the meta forward raises
    model.example_input_array = bad

    with pytest.warns(UserWarning, match="without input/output sizes and FLOPs.*such as .item"):
        got = whole_pipeline_summary(model, model.pipeline, offloaded, 1)

    assert _numbers(got) == expected  # the whole model's counts, as without an example
    assert model.example_input_array is bad
    assert all(isinstance(model.pipeline[i], _Placeholder) for i in offloaded)
    assert "forward" in vars(model.pipeline)


def test_restores_the_stage_when_the_summary_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_dynpipe.strategy.summary as summary_module

    model = Net(example=False)
    offloaded = _partitioned(model, {0})

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("summary failed")

    monkeypatch.setattr(summary_module, "summarize", broken)
    with pytest.raises(RuntimeError, match="summary failed"):
        whole_pipeline_summary(model, model.pipeline, offloaded, 1)

    assert all(isinstance(model.pipeline[i], _Placeholder) for i in offloaded)
    assert "forward" in vars(model.pipeline)


class SubclassedSummary(ModelSummary):
    """Like RichModelSummary (which needs ``rich``): a subclass that only changes how the table is printed."""


def test_install_overrides_each_summary_callback_and_uninstall_removes_it() -> None:
    model = Net(example=False)
    full = sum(p.numel() for p in model.parameters())
    offloaded = _partitioned(model, {5})
    plain, rich, other = ModelSummary(max_depth=2), SubclassedSummary(), L.Callback()
    custom = ModelSummary()
    custom._summary = lambda trainer, pl_module: "user's own"  # type: ignore[method-assign,assignment,return-value]

    changed = install([plain, other, rich, custom], lambda: model.pipeline, offloaded)

    assert changed == [plain, rich]
    for cb in changed:
        assert cb._summary(None, model).total_parameters == full  # type: ignore[arg-type]
    assert custom._summary(None, model) == "user's own"  # type: ignore[arg-type]
    uninstall(changed)
    assert "_summary" not in vars(plain) and "_summary" not in vars(rich)
    assert "_summary" in vars(custom)
    assert plain._summary.__func__ is ModelSummary._summary  # type: ignore[attr-defined]  # Lightning's own again
