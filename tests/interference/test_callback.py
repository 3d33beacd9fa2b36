"""InterferenceCallback starts and stops entries at the right steps on the right stages, and always cleans up."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynpipe.interference import InterferenceCallback, InterferenceEvent
from lightning_dynpipe.interference.base import InterferenceConfigError
from lightning_dynpipe.interference.schedule import InterferenceSpec


class StandIn:
    """An interference source that only records what happened to it (no processes)."""

    def __init__(self, spec: InterferenceSpec, log: list[tuple[str, str]], fail_start: bool = False) -> None:
        self.spec = spec
        self.log = log
        self.fail_start = fail_start
        self.active = False

    def start(self) -> None:
        self.active = True  # a partial start: stop() must still come
        self.log.append(("start", self.spec.kind))
        if self.fail_start:
            raise RuntimeError("could not start")

    def stop(self) -> None:
        if self.active:
            self.log.append(("stop", self.spec.kind))
        self.active = False


def _factory(log: list[tuple[str, str]], fail: str = "") -> Any:
    return lambda spec, host: StandIn(spec, log, fail_start=spec.kind == fail)


SCHEDULE = [
    {"kind": "cpu_hog", "stage": 0, "start_step": 2, "stop_step": 5},
    {"kind": "cpu_quota", "stage": 1, "start_step": 3, "fraction": 0.5},
    {"kind": "link_delay", "stage": 0, "start_step": 1, "stop_step": 3, "delay_s": 0.01},
]


def _run_steps(callback: InterferenceCallback, stage_idx: int, steps: range) -> list[tuple[int, list[int]]]:
    strategy = SimpleNamespace(stage_idx=stage_idx, num_stages=2, global_rank=stage_idx)
    trainer = SimpleNamespace(strategy=strategy, global_step=0)
    callback.on_train_start(trainer, None)  # type: ignore[arg-type]
    seen = []
    for step in steps:
        trainer.global_step = step
        callback.on_train_batch_start(trainer, None, None, step)  # type: ignore[arg-type]
        seen.append((step, sorted(callback.active)))
    return seen


def test_entries_run_over_their_steps_on_their_stage() -> None:
    log: list[tuple[str, str]] = []
    callback = InterferenceCallback(SCHEDULE, factory=_factory(log))
    assert _run_steps(callback, stage_idx=0, steps=range(7)) == [
        (0, []),
        (1, [2]),
        (2, [0, 2]),
        (3, [0]),
        (4, [0]),
        (5, []),
        (6, []),
    ]
    assert log == [("start", "link_delay"), ("start", "cpu_hog"), ("stop", "link_delay"), ("stop", "cpu_hog")]
    assert [(e.action, e.index, e.step, e.stage_idx) for e in callback.events] == [
        ("start", 2, 1, 0),
        ("start", 0, 2, 0),
        ("stop", 2, 3, 0),
        ("stop", 0, 5, 0),
    ]
    assert all(isinstance(e, InterferenceEvent) for e in callback.events)


def test_the_other_stage_gets_its_entries_and_both_sides_of_the_link() -> None:
    log: list[tuple[str, str]] = []
    callback = InterferenceCallback(SCHEDULE, factory=_factory(log))
    assert _run_steps(callback, stage_idx=1, steps=range(5)) == [(0, []), (1, [2]), (2, [2]), (3, [1]), (4, [1])]
    callback.on_fit_end(None, None)  # type: ignore[arg-type]
    assert log == [("start", "link_delay"), ("stop", "link_delay"), ("start", "cpu_quota"), ("stop", "cpu_quota")]
    assert callback.active == {}
    callback.teardown(None, None, "fit")  # type: ignore[arg-type]
    assert len(log) == 4


def test_a_resumed_run_starts_what_is_on_at_its_first_step() -> None:
    log: list[tuple[str, str]] = []
    callback = InterferenceCallback(SCHEDULE, factory=_factory(log))
    assert _run_steps(callback, stage_idx=0, steps=range(4, 6)) == [(4, [0]), (5, [])]


def test_an_exception_stops_everything_started_even_a_failed_start() -> None:
    log: list[tuple[str, str]] = []
    callback = InterferenceCallback(SCHEDULE, factory=_factory(log, fail="cpu_hog"))
    with pytest.raises(RuntimeError, match="could not start"):
        _run_steps(callback, stage_idx=0, steps=range(4))
    callback.on_exception(None, None, RuntimeError("boom"))  # type: ignore[arg-type]
    assert log[:2] == [("start", "link_delay"), ("start", "cpu_hog")]
    assert sorted(log[2:]) == [("stop", "cpu_hog"), ("stop", "link_delay")]
    assert callback.active == {}


def test_an_error_while_stopping_does_not_stop_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    log: list[tuple[str, str]] = []

    class BadStop(StandIn):
        def stop(self) -> None:
            raise OSError("stuck")

    def factory(spec: InterferenceSpec, host: Any) -> StandIn:
        return (BadStop if spec.kind == "link_delay" else StandIn)(spec, log)

    callback = InterferenceCallback(SCHEDULE, factory=factory)
    _run_steps(callback, stage_idx=0, steps=range(3))
    callback.on_exception(None, None, RuntimeError("boom"))  # type: ignore[arg-type]
    assert ("stop", "cpu_hog") in log and callback.active == {}
    assert "failed to stop cleanly" in caplog.text


def test_the_schedule_is_checked_against_the_pipeline() -> None:
    callback = InterferenceCallback([{"kind": "cpu_hog", "stage": 3}], factory=_factory([]))
    with pytest.raises(InterferenceConfigError, match="the pipeline has 2 stage"):
        _run_steps(callback, stage_idx=0, steps=range(1))


class _Failing(LightningModule):
    def __init__(self, fail_at: int | None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.fail_at = fail_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at:
            raise ValueError("training failed on purpose")
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=2)


@pytest.mark.parametrize("fail_at", [None, 4])
def test_a_real_trainer_drives_the_callback_and_cleans_up(fail_at: int | None, tmp_path: Path) -> None:
    log: list[tuple[str, str]] = []
    # A strategy without stages counts as stage 0 of 1.
    callback = InterferenceCallback(
        [
            {"kind": "cpu_hog", "stage": 0, "start_step": 2},
            {"kind": "cpu_quota", "stage": 0, "start_step": 1, "stop_step": 3, "fraction": 0.5},
        ],
        factory=_factory(log),
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    if fail_at is None:
        trainer.fit(_Failing(None))
    else:
        with pytest.raises(ValueError, match="on purpose"):
            trainer.fit(_Failing(fail_at))
    assert log == [("start", "cpu_quota"), ("start", "cpu_hog"), ("stop", "cpu_quota"), ("stop", "cpu_hog")]
    starts = [(e.index, e.step) for e in callback.events if e.action == "start"]
    assert starts == [(1, 1), (0, 2)]
    assert callback.active == {}


def test_only_the_callback_module_imports_lightning() -> None:
    package = Path(__file__).resolve().parents[2] / "lightning_dynpipe" / "interference"
    importers = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            )
            if any(n == "lightning" or n.startswith("lightning.") for n in names):
                importers.append(path.name)
    assert sorted(set(importers)) == ["callback.py"]
