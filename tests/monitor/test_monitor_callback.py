"""StageMonitor: cadence, listeners and window resets with a stand-in trainer; real fits in one process
(DynPipe with one stage, and another strategy); and a 2-process DynPipe fit that logs per-stage metrics."""

from __future__ import annotations

import csv
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategy"))
from pipeline_models import TinyNet, loader, trainer_kwargs  # noqa: E402

from lightning_dynpipe import DynPipeStrategy  # noqa: E402
from lightning_dynpipe.engine.executor import StepStats  # noqa: E402
from lightning_dynpipe.monitor import PipelineSnapshot, StageMonitor  # noqa: E402


# ---------------------------------------------------------------------------------------------- stand-in trainer
class _FakeStrategy:
    def __init__(self) -> None:
        self.executor = SimpleNamespace(stats=StepStats(step_s=0.01, forward_s=0.004, backward_s=0.004))
        self.stage_idx = 0
        self.dp_rank = 0
        self.partition: Any = "[5]"
        self.root_device = torch.device("cpu")


class _FakeModule:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log(self, name: str, value: float, **kw: Any) -> None:
        assert kw["prog_bar"] and not kw["logger"] and not kw["sync_dist"]
        self.logged[name] = value


class _FakeLogger:
    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((metrics, step))


def _fake_trainer() -> Any:
    return SimpleNamespace(
        strategy=_FakeStrategy(), world_size=1, global_step=0, is_global_zero=True, loggers=[_FakeLogger()]
    )


def _steps(monitor: StageMonitor, trainer: Any, module: Any, n: int, step_s: float | None = None) -> None:
    for _ in range(n):
        monitor.on_train_batch_start(trainer, module, None, 0)
        trainer.global_step += 1
        if step_s is not None:
            trainer.strategy.executor.stats = StepStats(step_s=step_s, forward_s=step_s / 2)
        monitor.on_train_batch_end(trainer, module, None, None, 0)


def test_snapshot_every_n_steps_listeners_logging_and_prog_bar() -> None:
    trainer, module = _fake_trainer(), _FakeModule()
    monitor = StageMonitor(every_n_steps=3, window=4, prog_bar=True)
    seen: list[tuple[int, int]] = []
    monitor.add_listener(lambda snap, tr: seen.append((snap.step, snap.stages[0].count)))
    monitor.on_train_start(trainer, module)  # type: ignore[arg-type]
    _steps(monitor, trainer, module, 7)
    assert seen == [(3, 3), (6, 4)]  # snapshots at steps 3 and 6; the window holds at most 4 samples
    assert monitor.snapshots_taken == 2 and monitor.latest is not None and monitor.latest.step == 6
    calls = trainer.loggers[0].calls
    assert [step for _, step in calls] == [3, 6]
    assert calls[0][0]["dynpipe/stage0/step_ms"] == pytest.approx(10.0)
    assert calls[0][0]["dynpipe/stage0/compute_ms"] == pytest.approx(8.0)
    assert module.logged == {"dynpipe/s0_busy_ms": pytest.approx(8.0)}  # one key per stage, up to 4 stages
    assert monitor.overhead_s > 0


def test_log_and_prog_bar_switches_and_non_zero_ranks() -> None:
    trainer, module = _fake_trainer(), _FakeModule()
    trainer.is_global_zero = False
    monitor = StageMonitor(every_n_steps=1, log=True, prog_bar=False)
    monitor.on_train_start(trainer, module)  # type: ignore[arg-type]
    _steps(monitor, trainer, module, 2)
    assert trainer.loggers[0].calls == []  # only global rank 0 writes to the loggers
    assert module.logged == {}
    assert monitor.latest is not None


def test_listener_removal_and_order() -> None:
    trainer, module = _fake_trainer(), _FakeModule()
    monitor = StageMonitor(every_n_steps=1, prog_bar=False)
    order: list[str] = []

    def a(snap: PipelineSnapshot, tr: Any) -> None:
        order.append("a")

    def b(snap: PipelineSnapshot, tr: Any) -> None:
        order.append("b")

    monitor.add_listener(a)
    monitor.add_listener(b)
    monitor.on_train_start(trainer, module)  # type: ignore[arg-type]
    _steps(monitor, trainer, module, 1)
    monitor.remove_listener(a)
    _steps(monitor, trainer, module, 1)
    assert order == ["a", "b", "b"]


def test_window_restarts_when_the_partition_changes() -> None:
    trainer, module = _fake_trainer(), _FakeModule()
    monitor = StageMonitor(every_n_steps=100, window=10, prog_bar=False)
    monitor.on_train_start(trainer, module)  # type: ignore[arg-type]
    _steps(monitor, trainer, module, 5, step_s=0.05)
    assert monitor.accumulator is not None and len(monitor.accumulator) == 5
    trainer.strategy.partition = "[3, 2]"  # a repartition replaced it
    _steps(monitor, trainer, module, 2, step_s=0.01)
    assert len(monitor.accumulator) == 2
    assert monitor.accumulator.summary().step_s == pytest.approx(0.01)


def test_a_validation_run_between_steps_stays_out_of_the_step_cpu() -> None:
    """The CPU a validation run (or an epoch's end) takes between two steps is not the next step's: the mean CPU
    per step prices a quota's floor, and a validation every few steps would raise it for the windows holding one."""
    trainer, module = _fake_trainer(), _FakeModule()
    monitor = StageMonitor(every_n_steps=100, window=10, prog_bar=False)
    monitor.on_validation_start(trainer, module)  # type: ignore[arg-type]  # the sanity check: before the fit
    monitor.on_train_start(trainer, module)  # type: ignore[arg-type]
    _steps(monitor, trainer, module, 4, step_s=0.01)
    for hook in (monitor.on_validation_start, monitor.on_train_epoch_end):
        hook(trainer, module)  # type: ignore[arg-type]
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            pass
        _steps(monitor, trainer, module, 1, step_s=0.01)
        last = monitor.accumulator.last if monitor.accumulator is not None else None
        assert last is not None and last.cpu_s < 0.1, (hook, last)


def test_a_new_fit_starts_from_scratch_but_keeps_listeners() -> None:
    trainer, module = _fake_trainer(), _FakeModule()
    monitor = StageMonitor(every_n_steps=2, prog_bar=False)
    calls: list[int] = []
    monitor.add_listener(lambda snap, tr: calls.append(snap.step))
    monitor.on_train_start(trainer, module)  # type: ignore[arg-type]
    _steps(monitor, trainer, module, 3)
    monitor.teardown(trainer, module, "fit")  # type: ignore[arg-type]
    assert monitor.latest is not None  # readable after the fit
    trainer.global_step = 0
    monitor.on_train_start(trainer, module)  # type: ignore[arg-type]
    assert monitor.latest is None and monitor.snapshots_taken == 0 and monitor.overhead_s == 0.0
    _steps(monitor, trainer, module, 1)
    assert monitor.latest is None  # the step counter restarted too
    _steps(monitor, trainer, module, 1)
    assert calls == [2, 2]


class _FakeWork:
    def __init__(self, parts: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self.parts, self.tensor, self.done = parts, tensor, False

    def wait(self) -> bool:
        for i, p in enumerate(self.parts):  # a second rank running stage 1 with the same numbers
            p.copy_(self.tensor)
            p[1] = float(i)
        self.done = True
        return True

    def is_done(self) -> bool:
        return self.done


@pytest.fixture
def two_fake_ranks(monkeypatch: pytest.MonkeyPatch) -> list[_FakeWork]:
    works: list[_FakeWork] = []

    def all_gather(parts: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        work = _FakeWork(parts, tensor)
        works.append(work)
        if async_op:
            return work
        work.wait()
        return None

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)

    def all_gather_object(out: list[Any], obj: Any, group: Any = None) -> None:
        out[:] = [obj] * len(out)  # the other fake rank: this process again (so no sibling to name)

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    return works


def _latest(monitor: StageMonitor) -> PipelineSnapshot | None:
    return monitor.latest  # read through a call, so that mypy does not keep an earlier narrowing


def test_gather_overlaps_the_next_step(two_fake_ranks: list[_FakeWork]) -> None:
    trainer, module = _fake_trainer(), _FakeModule()
    trainer.world_size = 2
    monitor = StageMonitor(every_n_steps=3, window=4, prog_bar=True)
    steps: list[int] = []
    monitor.add_listener(lambda snap, tr: steps.append(tr.global_step))
    monitor.on_train_start(trainer, module)  # type: ignore[arg-type]
    _steps(monitor, trainer, module, 3)
    assert len(two_fake_ranks) == 1 and not two_fake_ranks[0].is_done() and _latest(monitor) is None
    _steps(monitor, trainer, module, 1)
    snap = _latest(monitor)
    assert two_fake_ranks[0].is_done() and snap is not None
    assert snap.step == 3 and snap.num_stages == 2  # taken at step 3, published at 4
    assert steps == [4]
    assert trainer.loggers[0].calls[0][1] == 3  # logged at the step it describes
    assert module.logged["dynpipe/s1_busy_ms"] == pytest.approx(8.0)
    _steps(monitor, trainer, module, 2)  # step 6 starts the next gather
    monitor.on_train_end(trainer, module)  # type: ignore[arg-type]
    snap = _latest(monitor)
    assert snap is not None and snap.step == 6 and monitor.snapshots_taken == 2 and steps == [4, 6]


def test_a_snapshot_overtaken_by_a_repartition_is_logged_but_not_acted_on(two_fake_ranks: list[_FakeWork]) -> None:
    trainer, module = _fake_trainer(), _FakeModule()
    trainer.world_size = 2
    trainer.strategy.partition = SimpleNamespace(balance=(2, 3))
    monitor = StageMonitor(every_n_steps=2, prog_bar=False)
    heard: list[PipelineSnapshot] = []
    monitor.add_listener(lambda snap, tr: heard.append(snap))
    monitor.on_train_start(trainer, module)  # type: ignore[arg-type]
    _steps(monitor, trainer, module, 3)  # gather started at 2, published at 3
    assert [s.balance for s in heard] == [(2, 3)]
    _steps(monitor, trainer, module, 1)  # gather started at 4 ...
    trainer.strategy.partition = SimpleNamespace(balance=(3, 2))  # ... and the pipeline moves a layer
    _steps(monitor, trainer, module, 1)
    snap = _latest(monitor)
    assert snap is not None and snap.step == 4 and snap.balance == (2, 3)
    assert len(heard) == 1  # the listeners did not see the old partition's numbers again
    assert [step for _, step in trainer.loggers[0].calls] == [2, 4]
    assert monitor.accumulator is not None and len(monitor.accumulator) == 1  # the window restarted
    _steps(monitor, trainer, module, 2)  # gather at 6 under the new partition, published at 7
    assert [s.balance for s in heard] == [(2, 3), (3, 2)]


def test_without_overlap_the_snapshot_is_published_at_once(two_fake_ranks: list[_FakeWork]) -> None:
    trainer, module = _fake_trainer(), _FakeModule()
    trainer.world_size = 2
    monitor = StageMonitor(every_n_steps=2, overlap=False, prog_bar=False)
    monitor.on_train_start(trainer, module)  # type: ignore[arg-type]
    _steps(monitor, trainer, module, 2)
    assert monitor.latest is not None and monitor.latest.step == 2


def test_teardown_after_a_failure_does_not_wait(two_fake_ranks: list[_FakeWork]) -> None:
    trainer, module = _fake_trainer(), _FakeModule()
    trainer.world_size = 2
    monitor = StageMonitor(every_n_steps=1, prog_bar=False)
    monitor.on_train_start(trainer, module)  # type: ignore[arg-type]
    _steps(monitor, trainer, module, 1)
    monitor.teardown(trainer, module, "fit")  # type: ignore[arg-type]
    assert not two_fake_ranks[0].done and monitor.latest is None


def test_prog_bar_shows_the_bottleneck_of_long_pipelines() -> None:
    from lightning_dynpipe.monitor import StageReport, StageStatsAccumulator
    from lightning_dynpipe.monitor.stats import StageSample

    reports = []
    for k in range(6):
        acc = StageStatsAccumulator(1)
        acc.add(StageSample(step_s=0.05, forward_s=0.01 * (1 + (k == 3))))
        reports.append(StageReport(0, k, acc.summary()))
    values = StageMonitor()._prog_bar_values(PipelineSnapshot.from_reports(1, reports))
    assert values == {"dynpipe/bottleneck_stage": 3.0, "dynpipe/bottleneck_busy_ms": pytest.approx(20.0)}


@pytest.mark.parametrize("kw", [{"every_n_steps": 0}, {"window": -1}, {"every_n_steps": 1.5}, {"window": True}])
def test_arguments_must_be_positive_integers(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be a positive integer"):
        StageMonitor(**kw)


def test_state_dict_is_empty() -> None:
    assert StageMonitor().state_dict() == {}


# ---------------------------------------------------------------------------------------------- real fits, 1 process
def test_other_strategy_warns_once_and_does_nothing() -> None:
    monitor = StageMonitor(every_n_steps=1)
    per_fit = []
    for _ in range(2):
        trainer = L.Trainer(devices=1, max_steps=3, **trainer_kwargs(callbacks=[monitor]))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(TinyNet(), loader(n=48))
        per_fit.append([str(w.message) for w in caught if "StageMonitor" in str(w.message)])
        assert monitor.latest is None and monitor.accumulator is None
    assert len(per_fit[0]) == 1 and not per_fit[1], per_fit
    assert "SingleDeviceStrategy" in per_fit[0][0] and "does nothing" in per_fit[0][0]


def test_single_stage_dynpipe_fit_logs_and_feeds_prog_bar(tmp_path: Path) -> None:
    monitor = StageMonitor(every_n_steps=2, window=3, prog_bar=True)
    snaps: list[PipelineSnapshot] = []
    monitor.add_listener(lambda snap, tr: snaps.append(snap))
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="dynpipe/s0_busy_ms", mode="min", save_top_k=1)
    trainer = L.Trainer(
        devices=1,
        max_steps=6,
        log_every_n_steps=1,
        strategy=DynPipeStrategy(balance=[5], num_microbatches=2),
        **trainer_kwargs(
            logger=CSVLogger(tmp_path, name="csv"),
            enable_checkpointing=True,
            callbacks=[monitor, ckpt, EarlyStopping(monitor="train_loss", patience=100)],
        ),
    )
    trainer.fit(TinyNet(), loader(n=72))
    assert [s.step for s in snaps] == [2, 4, 6]
    assert all(s.num_stages == 1 and s.bottleneck_stage == 0 for s in snaps)
    assert snaps[-1].stages[0].count == 3
    assert snaps[-1].stages[0].rss_bytes > 0 and snaps[-1].stages[0].compute_s > 0
    # async, 2 micro-batches: 2 forwards, backwards and updates per step
    counts = [(s.stages[0].num_forward, s.stages[0].num_backward, s.stages[0].num_updates) for s in snaps]
    assert counts == [(2, 2, 2)] * 3
    for key in ("dynpipe/s0_busy_ms",):
        assert key in trainer.progress_bar_metrics, trainer.progress_bar_metrics
        assert key in trainer.callback_metrics
    assert ckpt.best_model_path  # monitoring a monitor metric works
    rows = list(csv.DictReader(open(next((tmp_path / "csv").rglob("metrics.csv")))))
    logged = [r for r in rows if r.get("dynpipe/stage0/step_ms")]
    assert [int(r["step"]) for r in logged] == [2, 4, 6]
    assert all(float(r["dynpipe/stage0/step_ms"]) > 0 for r in logged)
    assert "dynpipe/s0_busy_ms" not in rows[0]  # the progress-bar values do not reach the loggers twice


# ---------------------------------------------------------------------------------------------- 2 processes
class _CheckInWorkers(L.Callback):
    """Runs inside every worker, after the monitor (it comes later in the callback list).

    Gathers start at steps 4, 8 and 12 and complete one step later (overlap), the last one at the end of
    training, so at step g the latest snapshot is the one taken at the largest multiple of 4 below g.
    """

    def __init__(self, monitor: StageMonitor) -> None:
        self.monitor = monitor

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        snap, g = self.monitor.latest, trainer.global_step
        if g <= 4:
            assert snap is None
            return
        assert snap is not None, f"rank {trainer.global_rank} has no snapshot at step {g}"
        assert snap.step == 4 * ((g - 1) // 4), (snap.step, g)
        self._check(snap)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        snap = self.monitor.latest
        assert snap is not None and snap.step == 12, snap
        assert self.monitor.snapshots_taken == 3
        self._check(snap)
        snaps: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(snaps, snap)
        assert snaps[0] == snaps[1], "ranks hold different snapshots"

    @staticmethod
    def _check(snap: PipelineSnapshot) -> None:
        assert snap.num_stages == 2 and snap.dp_size == 1
        assert all(s.count >= 1 and s.step_s > 0 and s.compute_s > 0 and s.rss_bytes > 0 for s in snap.stages)
        assert snap.bottleneck_stage in (0, 1)
        # async, 3 micro-batches: in steady state every stage runs 3 forwards, backwards and updates per step
        assert all((s.num_forward, s.num_backward, s.num_updates) == (3, 3, 3) for s in snap.stages), snap.stages


@pytest.mark.multiprocess
def test_two_stage_fit_logs_every_stage(tmp_path: Path) -> None:
    monitor = StageMonitor(every_n_steps=4, window=4)
    trainer = L.Trainer(
        devices=2,
        max_steps=12,
        log_every_n_steps=1,
        strategy=DynPipeStrategy(start_method="spawn", balance=[2, 3], num_microbatches=3),
        **trainer_kwargs(logger=CSVLogger(tmp_path, name="csv"), callbacks=[monitor, _CheckInWorkers(monitor)]),
    )
    trainer.fit(TinyNet(), loader(n=144))
    rows = list(csv.DictReader(open(next((tmp_path / "csv").rglob("metrics.csv")))))
    for k in (0, 1):
        logged = [r for r in rows if r.get(f"dynpipe/stage{k}/step_ms")]
        assert [int(r["step"]) for r in logged] == [4, 8, 12], rows
        assert all(float(r[f"dynpipe/stage{k}/compute_ms"]) > 0 for r in logged)
        assert all(float(r[f"dynpipe/stage{k}/rss_mb"]) > 0 for r in logged)
    assert {r["dynpipe/bottleneck_stage"] for r in rows if r.get("dynpipe/bottleneck_stage")} <= {"0.0", "1.0"}
