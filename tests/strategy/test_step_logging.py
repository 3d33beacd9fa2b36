"""``microbatch_logging``: ``self.log`` in ``training_step`` reaches Lightning once per step (reduced) or once
per micro-batch. Unit tests of the reduction with a recording module, then one-process Lightning runs that
compare what the loggers receive in both modes."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from pipeline_models import TinyNet, loader, trainer_kwargs
from torchmetrics import MeanMetric

from lightning_dynpipe import DynPipeStrategy
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.strategy.logs import StepLogs


class Recorder(L.LightningModule):
    """Records what reaches ``log`` (the class method StepLogs forwards to)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []

    def log(self, name: str, value: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.calls.append((name, value, kwargs))


def _step(logs: StepLogs, module: Recorder, per_mb: list[dict[str, Any]], sizes: list[int]) -> None:
    for slot, calls in enumerate(per_mb):
        with logs.capture(weight=sizes[slot], last=slot == len(per_mb) - 1):
            for name, (value, kwargs) in calls.items():
                module.log(name, value, **kwargs)


def test_mean_is_weighted_by_micro_batch_size_and_logged_once() -> None:
    module = Recorder()
    logs = StepLogs(module)
    _step(logs, module, [{"loss": (torch.tensor(1.0), {})}, {"loss": (torch.tensor(4.0), {"prog_bar": True})}], [3, 1])
    [(name, value, kwargs)] = module.calls
    assert name == "loss" and kwargs["reduce_fx"] == "mean" and kwargs["batch_size"] is None
    assert kwargs["prog_bar"] is True  # the last call's options
    assert value.dtype == torch.float32 and value.item() == pytest.approx((3 * 1.0 + 1 * 4.0) / 4)
    assert "log" not in module.__dict__  # the instance attribute is gone after the capture


def test_a_micro_batch_of_weight_zero_counts_for_nothing_in_the_mean() -> None:
    """A micro-batch whose loss averages no terms (``loss_terms`` 0: all padding) has a mean loss of NaN (0/0); it
    weighs 0 in the step's mean and changes nothing, as its padding adds nothing to one device's batch mean."""
    module = Recorder()
    logs = StepLogs(module)
    _step(logs, module, [{"loss": (torch.tensor(v), {})} for v in (2.0, float("nan"), 4.0)], [3, 0, 1])
    [(_, value, _)] = module.calls
    assert value.item() == pytest.approx((3 * 2.0 + 1 * 4.0) / 4)


def test_given_batch_sizes_weight_the_mean_and_are_summed() -> None:
    module = Recorder()
    logs = StepLogs(module)
    calls = [{"acc": (0.5, {"batch_size": 10})}, {"acc": (1.0, {"batch_size": 30})}]
    _step(logs, module, calls, [2, 2])
    [(_, value, kwargs)] = module.calls
    assert kwargs["batch_size"] == 40 and value.item() == pytest.approx(0.875)


@pytest.mark.parametrize(("fx", "expected"), [("sum", 7.0), ("max", 4.0), ("min", 1.0), (torch.max, 4.0)])
def test_sum_max_min(fx: Any, expected: float) -> None:
    module = Recorder()
    logs = StepLogs(module)
    values = [1.0, 4.0, 2.0]
    _step(logs, module, [{"x": (torch.tensor(v), {"reduce_fx": fx})} for v in values], [1, 1, 1])
    [(_, value, kwargs)] = module.calls
    assert value.item() == expected and kwargs["reduce_fx"] == (fx if isinstance(fx, str) else "max")


def test_what_cannot_be_reduced_goes_through_at_once() -> None:
    module = Recorder()
    logs = StepLogs(module)
    metric = MeanMetric()
    with logs.capture(weight=1, last=False):
        module.log("m", metric)
        module.log("g", torch.tensor(1.0, requires_grad=True), enable_graph=True)
        module.log("c", torch.tensor(2.0), reduce_fx=lambda t: t.median())
        module.log("kept", torch.tensor(3.0))
    assert [c[0] for c in module.calls] == ["m", "g", "c"]
    logs.flush()
    assert [c[0] for c in module.calls] == ["m", "g", "c", "kept"]


def test_names_logged_in_some_micro_batches_only_and_reset() -> None:
    module = Recorder()
    logs = StepLogs(module)
    _step(logs, module, [{"a": (2.0, {})}, {}, {"a": (4.0, {}), "b": (1.0, {})}], [1, 1, 1])
    assert {c[0]: c[1].item() for c in module.calls} == {"a": 3.0, "b": 1.0}
    module.calls.clear()
    with logs.capture(weight=1, last=False):
        module.log("a", 5.0)
    logs.reset()  # a step that failed: nothing of it is logged later
    _step(logs, module, [{"a": (1.0, {})}], [1])
    assert [(c[0], c[1].item()) for c in module.calls] == [("a", 1.0)]


def test_two_reductions_of_one_name_in_a_step_are_refused() -> None:
    module = Recorder()
    logs = StepLogs(module)
    with pytest.raises(ConfigurationError, match="reduce_fx='mean' and 'max'.*microbatch_logging='each'"):
        _step(logs, module, [{"a": (1.0, {})}, {"a": (2.0, {"reduce_fx": "max"})}], [1, 1])


def test_invalid_option_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="microbatch_logging must be one of 'step', 'each'"):
        DynPipeStrategy(microbatch_logging="once")  # type: ignore[arg-type]


# --- what Lightning's loggers receive, one stage in this process ---------------------------------------------


class LoggingNet(TinyNet):
    """Logs its loss per micro-batch and remembers every micro-batch loss it computed."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.pipeline(x), y)
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss


def _run(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> tuple[LoggingNet, list[dict[str, str]], int]:
    calls = []
    real = L.LightningModule.log

    def counting(self: Any, name: str, *args: Any, **kwargs: Any) -> None:
        if name == "train_loss":
            calls.append(name)
        real(self, name, *args, **kwargs)

    monkeypatch.setattr(L.LightningModule, "log", counting)
    model = LoggingNet()
    strategy = DynPipeStrategy(num_microbatches=4, microbatch_logging=mode, adaptive=False)  # type: ignore[arg-type]
    kw = trainer_kwargs(logger=CSVLogger(tmp_path, name=mode), log_every_n_steps=1)
    trainer = L.Trainer(devices=1, max_epochs=1, strategy=strategy, **kw)
    trainer.fit(model, loader(n=48))  # 4 batches of 12, micro-batches of 3
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:  # type: ignore[union-attr]
        rows = list(csv.DictReader(f))
    return model, rows, len(calls)


def test_step_and_each_give_the_same_epoch_values_and_step_gives_the_step_mean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step_model, step_rows, step_calls = _run(tmp_path, "step", monkeypatch)
    each_model, each_rows, each_calls = _run(tmp_path, "each", monkeypatch)
    assert (step_calls, each_calls) == (4, 16)  # 4 steps, M = 4
    assert step_model.losses == each_model.losses  # the maths is the same either way
    epoch = {m: [float(r["train_loss_epoch"]) for r in rows if r.get("train_loss_epoch")] for m, rows in
             (("step", step_rows), ("each", each_rows))}  # fmt: skip
    assert len(epoch["step"]) == 1 and epoch["step"] == pytest.approx(epoch["each"], rel=1e-6)
    losses = torch.tensor(step_model.losses).reshape(4, 4)
    step_values = [float(r["train_loss_step"]) for r in step_rows if r.get("train_loss_step")]
    each_values = [float(r["train_loss_step"]) for r in each_rows if r.get("train_loss_step")]
    assert step_values == pytest.approx(losses.mean(dim=1).tolist(), rel=1e-6)  # the step's mean
    assert each_values == pytest.approx(losses[:, -1].tolist(), rel=1e-6)  # the last micro-batch's
    assert epoch["step"] == pytest.approx([losses.mean().item()], rel=1e-6)


def test_options_given_by_position_are_named() -> None:
    module = Recorder()
    logs = StepLogs(module)
    with logs.capture(weight=1, last=True):
        module.log("x", 1.0, True, None, True, False, "max")  # prog_bar, logger, on_step, on_epoch, reduce_fx
    [(_, value, kwargs)] = module.calls
    assert value.item() == 1.0
    assert kwargs["reduce_fx"] == "max" and kwargs["prog_bar"] is True and kwargs["on_epoch"] is False
