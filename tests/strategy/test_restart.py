"""The last rung of the escalation ladder, where the user opts in: end the fit and continue under the number of
stages the adaptive loop predicts better, from a partition-independent checkpoint.

Pure: the refusals of ``change_stages``, :class:`RestartPlan`, the loop of :func:`fit_with_restarts` (with stand-in
Trainers). Multi-process (fork, 2 ranks): a 2-stage fit whose planner, fed with a staleness penalty, prefers one
stage with two replicas; the fit checkpoints at the end of the step of that decision, stops, and continues from the
checkpoint under 1 stage x 2 replicas to ``max_steps``; the checkpoint is the first fit's model exactly. The same
under the popen launcher (``scripts/restart_popen.py``), where every process runs the loop.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from pipeline_models import TinyNet, loader, restarting_trainer, run_popen_script

from lightning_dynpipe import ConfigurationError, RestartPlan, fit_with_restarts
from lightning_dynpipe.strategy.config import DynPipeConfig


def test_change_stages_is_refused_where_a_restart_would_change_the_training() -> None:
    with pytest.raises(ConfigurationError, match=r"change_stages must be one of \['report', 'restart'\]; got 'x'"):
        DynPipeConfig.from_arguments(change_stages="x")
    with pytest.raises(ConfigurationError, match="adaptive=False turns the loop off"):
        DynPipeConfig.from_arguments(change_stages="restart", adaptive=False, replica_split="even")
    with pytest.raises(ConfigurationError, match="replica_split=None.*global batch would grow or shrink"):
        DynPipeConfig.from_arguments(change_stages="restart")
    with pytest.raises(ConfigurationError, match="replica_split=fixed weights"):
        DynPipeConfig.from_arguments(change_stages="restart", replica_split=[3, 1])
    assert DynPipeConfig.from_arguments(change_stages="restart", replica_split="speed").change_stages == "restart"
    assert DynPipeConfig.from_arguments().change_stages == "report"


def test_a_restart_plan_travels_as_plain_data() -> None:
    plan = RestartPlan(1, "/tmp/x/step6-stages2-to-1.ckpt", 6, 2, "the best plan has 1 stages")
    assert RestartPlan.from_dict(plan.to_dict()) == plan


class _FakeTrainer:
    """Stands in for a Trainer: ``fit`` records its call and leaves the next scripted plan."""

    def __init__(self, num_stages: int | None, plans: list[RestartPlan | None], calls: list[Any]) -> None:
        self.strategy = SimpleNamespace(
            config=SimpleNamespace(num_stages=num_stages), restart_plan=None, restart_allowed=True
        )
        self._plans, self._calls = plans, calls

    def fit(self, model: Any, *args: Any, ckpt_path: str | None = None, **kwargs: Any) -> None:
        plan = self._plans.pop(0)
        self._calls.append((self.strategy.config.num_stages, ckpt_path, self.strategy.restart_allowed, args))
        self.strategy.restart_plan = plan if self.strategy.restart_allowed else None


def test_fit_with_restarts_continues_from_each_plan_until_none_is_left() -> None:
    calls: list[Any] = []
    plans: list[RestartPlan | None] = [RestartPlan(1, "a.ckpt", 6, 2, "r"), RestartPlan(2, "b.ckpt", 20, 1, "r"), None]
    last = fit_with_restarts(lambda s: _FakeTrainer(s, plans, calls), "model", "loader", max_restarts=5)  # type: ignore[arg-type]
    assert calls == [
        (None, None, True, ("loader",)),
        (1, "a.ckpt", True, ("loader",)),
        (2, "b.ckpt", True, ("loader",)),
    ]
    assert last.strategy.config.num_stages == 2  # type: ignore[attr-defined]


def test_fit_with_restarts_lets_its_last_fit_run_to_the_end() -> None:
    calls: list[Any] = []
    plans: list[RestartPlan | None] = [RestartPlan(1, "a.ckpt", 6, 2, "r"), RestartPlan(2, "b.ckpt", 20, 1, "r")]
    fit_with_restarts(lambda s: _FakeTrainer(s, plans, calls), "model", max_restarts=1)  # type: ignore[arg-type]
    assert [c[2] for c in calls] == [True, False]  # the second fit may not restart


def test_fit_with_restarts_refuses_a_trainer_that_ignores_the_number_of_stages() -> None:
    plans: list[RestartPlan | None] = [RestartPlan(1, "a.ckpt", 6, 2, "r"), None]
    with pytest.raises(ConfigurationError, match=r"make_trainer\(1\) returned a DynPipeStrategy with num_stages=2"):
        fit_with_restarts(lambda s: _FakeTrainer(2, plans, []), "model")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="needs a Trainer with DynPipeStrategy; .* with SimpleNamespace"):
        fit_with_restarts(lambda s: SimpleNamespace(strategy=SimpleNamespace()), "model")  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigurationError, match="max_restarts must be an integer >= 0; got -1"):
        fit_with_restarts(lambda s: _FakeTrainer(s, [], []), "model", max_restarts=-1)  # type: ignore[arg-type]


MAX_STEPS = 16
SCRIPT = Path(__file__).parent / "scripts" / "restart_popen.py"


def _make_trainer(root: Path, checkpoint: str = "full") -> Any:
    def make(num_stages: int | None) -> L.Trainer:
        steps = _EndStep(root / "steps.txt")
        return restarting_trainer(num_stages, str(root), MAX_STEPS, [steps], start_method="fork", checkpoint=checkpoint)

    return make


class _EndStep(L.Callback):
    """Rank 0 writes each fit's first and last global step to a file (with spawn or fork the launching process's
    Trainer does not learn the workers' step count)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(f"{self.start} {trainer.global_step} {trainer.strategy.num_stages}\n")  # type: ignore[attr-defined]


@pytest.mark.multiprocess
def test_a_fit_continues_under_the_number_of_stages_the_loop_predicts_better(tmp_path: Path) -> None:
    make = _make_trainer(tmp_path)
    trainers: list[L.Trainer] = []
    model = TinyNet()
    first_fit: dict[str, torch.Tensor] = {}

    def recorded(num_stages: int | None) -> L.Trainer:
        if num_stages is not None:  # the first fit has ended: the model holds what it trained
            first_fit.update({k: v.clone() for k, v in model.state_dict().items()})
        trainers.append(make(num_stages))
        return trainers[-1]

    last = fit_with_restarts(recorded, model, loader(batch_size=16))
    plan = trainers[0].strategy.restart_plan  # type: ignore[attr-defined]
    assert plan is not None and plan.old_num_stages == 2 and plan.num_stages == 1, plan
    assert "the best plan under the measured slowdowns has 1 stages" in plan.reason
    assert 0 < plan.step < MAX_STEPS
    assert Path(plan.checkpoint) == tmp_path / "dynpipe-restart" / f"step{plan.step}-stages2-to-1.ckpt"
    assert len(trainers) == 2 and last is trainers[1] and last.strategy.restart_plan is None  # type: ignore[attr-defined]
    # the checkpoint is the first fit's model: it ended right after writing it
    saved = torch.load(plan.checkpoint, weights_only=False)
    assert saved["global_step"] == plan.step and list(saved["state_dict"]) == list(first_fit)
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in first_fit.items())
    assert saved["optimizer_states"][0]["state"]  # SGD's momentum buffers travel with it
    # the second fit started from it, with 1 stage (2 replicas), and ran to the end
    fits = [line.split() for line in (tmp_path / "steps.txt").read_text().splitlines()]
    assert fits == [["0", str(plan.step), "2"], [str(plan.step), str(MAX_STEPS), "1"]]


@pytest.mark.multiprocess
def test_a_sharded_run_restarts_from_its_sharded_checkpoint(tmp_path: Path) -> None:
    trainers: list[L.Trainer] = []
    make = _make_trainer(tmp_path, checkpoint="sharded")

    def recorded(num_stages: int | None) -> L.Trainer:
        trainers.append(make(num_stages))
        return trainers[-1]

    fit_with_restarts(recorded, TinyNet(), loader(batch_size=16))
    plan = trainers[0].strategy.restart_plan  # type: ignore[attr-defined]
    assert plan is not None and plan.num_stages == 1
    assert Path(plan.checkpoint) == tmp_path / "dynpipe-restart" / f"step{plan.step}-stages2-to-1"
    assert (Path(plan.checkpoint) / ".metadata").is_file()  # a torch.distributed.checkpoint directory
    fits = [line.split() for line in (tmp_path / "steps.txt").read_text().splitlines()]
    assert fits == [["0", str(plan.step), "2"], [str(plan.step), str(MAX_STEPS), "1"]]


@pytest.mark.multiprocess
def test_every_process_restarts_in_step_under_the_popen_launcher(tmp_path: Path) -> None:
    """The default launcher: every process runs the script, so every process calls fit_with_restarts."""
    proc = run_popen_script(SCRIPT, str(tmp_path))
    assert proc.stdout.count("RESTART_OK") == 2  # both ranks
