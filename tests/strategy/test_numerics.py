"""Multi-process numerics: the pipeline against single-process references, to stated tolerances.

- S=1 equals plain Lightning training.
- ``sync``/``gpipe`` with S=2, 3 equal plain single-device training on the same batches (float32 reassociation
  of the micro-batch gradient sum: 1e-6).
- ``async`` with S=2, 3 equals the single-process PipeDream replay (`lightning_dynpipe.calibration.replay_async`)
  bit for bit (same operations in the same order; tolerance 0).
- Stage k never stashes more than S-k weight versions; hooks fire once per step / once per micro-update.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch.nn.functional as F
from pipeline_models import TinyNet, loader, make_optimizer, plain_training, trainer_kwargs

from lightning_dynpipe import DynPipeStrategy
from lightning_dynpipe.calibration import replay_async
from lightning_dynpipe.plan.convergence import staleness_profile

pytestmark = pytest.mark.multiprocess


def _assert_close(model: L.LightningModule, ref: L.LightningModule, atol: float) -> None:
    got, want = model.state_dict(), ref.state_dict()
    assert list(got) == list(want)
    for k in want:
        diff = (got[k] - want[k]).abs().max().item()
        assert diff <= atol, f"{k}: max |diff| {diff:.3g} > {atol}"


class _PipelineInvariants(L.Callback):
    """Asserted on every rank, inside the workers: stash bound, batch-end counts, and how the stash kept its
    versions: with no user code before the updates, SGD's updates write fresh storage and nothing is copied."""

    def __init__(self, num_microbatches: int) -> None:
        self.M = num_microbatches
        self.batch_ends = 0
        self.copies_expected = False
        self.stash_counts: tuple[int, int] | None = None  # (copies made, copies avoided) by the stash

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.batch_ends += 1
        s = trainer.strategy
        assert isinstance(s, DynPipeStrategy) and s.executor is not None
        bound = s.config.schedule.weight_versions(s.stage_idx, s.num_stages)  # S-k for async, (S-1-k)(1+d)+1 deeper
        depth = s.executor.stats.max_stash_depth
        assert depth <= bound, f"stage {s.stage_idx} stashed {depth} versions > {bound}"
        full = trainer.global_step * self.M > 2 * (bound - 1)  # every version in flight is a distinct one
        if s.schedule.startswith("async") and not s.is_last_stage and full:
            assert depth == bound, f"stage {s.stage_idx} should keep exactly {bound} versions, kept {depth}"
        if s.executor.stash is not None:
            self.stash_counts = (s.executor.stash.copies_made, s.executor.stash.copies_avoided)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps = trainer.global_step
        assert self.batch_ends == steps
        if self.stash_counts is not None:  # async, not the last stage
            copied, fresh = self.stash_counts
            assert (copied > 0, fresh > 0) == (self.copies_expected, not self.copies_expected), (copied, fresh)


class _CountingInvariants(_PipelineInvariants):
    """Also counts ``on_before_optimizer_step``: user code before every update, so the stash copies first."""

    def __init__(self, num_microbatches: int) -> None:
        super().__init__(num_microbatches)
        self.updates = 0
        self.copies_expected = True

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.updates += 1

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_fit_end(trainer, pl_module)
        steps = trainer.global_step
        expected = steps * self.M if trainer.strategy.schedule.startswith("async") else steps  # type: ignore[attr-defined]
        assert self.updates == expected, f"{self.updates} optimizer-step hooks, expected {expected}"


def _fit(
    model: TinyNet,
    devices: int,
    schedule: str,
    M: int = 4,
    epochs: int = 2,
    optimizer: str = "sgd",
    start_method: str = "fork",
    count_updates: bool = True,
) -> None:
    balance = {1: [5], 2: [2, 3], 3: [2, 2, 1]}[devices]  # the replay must use the same partition
    invariants = (_CountingInvariants if count_updates else _PipelineInvariants)(M)
    strategy = DynPipeStrategy(
        num_microbatches=M,
        schedule=schedule,
        start_method=start_method,  # type: ignore[arg-type]
        balance=balance,
        adaptive=False,
    )  # the reference keeps the partition
    trainer = L.Trainer(
        devices=devices, max_epochs=epochs, strategy=strategy, callbacks=[invariants], **trainer_kwargs()
    )
    trainer.fit(model, loader())


def test_single_stage_equals_plain_lightning() -> None:
    """S=1, M=1: DynPipe is plain training. (M>1 async would update per micro-batch by design.)"""
    model = TinyNet()
    plain = copy.deepcopy(model)
    L.Trainer(devices=1, max_epochs=2, **trainer_kwargs()).fit(plain, loader())
    _fit(model, devices=1, schedule="async", M=1, start_method="popen")
    _assert_close(model, plain, atol=0.0)


@pytest.mark.parametrize(("schedule", "num_stages"), [("sync", 3), ("gpipe", 2)])
def test_flush_schedules_equal_plain_training(schedule: str, num_stages: int) -> None:
    """Over real channels; 2-stage sync (and gpipe, async at 2-4 stages) run in one process in
    ``tests/engine/test_inprocess_numerics.py``."""
    model = TinyNet(optimizer="adam")
    ref = plain_training(model, list(loader()) * 2, optimizer="adam")
    _fit(model, devices=num_stages, schedule=schedule, optimizer="adam")
    _assert_close(model, ref, atol=1e-6)


class _ValLosses(L.Callback):
    """Each validation's epoch-level ``val_loss`` as each rank's callback metrics hold it, written to
    ``<directory>/rank<r>.json`` (the ranks are processes of their own)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.val_losses: list[float] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.val_losses.append(float(trainer.callback_metrics["val_loss"]))
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.val_losses))


@pytest.mark.parametrize("drained_by", ["validation", "checkpoint"])
def test_async_drains_mid_epoch_equal_the_replay_with_its_drains(drained_by: str, tmp_path: Path) -> None:
    """In the middle of an epoch, a validation (``val_check_interval``) or a checkpoint (``every_n_train_steps``)
    drains an ``async`` pipeline first (the backwards still in flight run, with their updates), sees one consistent
    set of weights, and the pipeline restarts its micro-batch count. Bit for bit the PipeDream replay that drains
    after the same steps; each validation loss, and each checkpoint's weights, equal the replayed model's at that
    point. Without the drains the replay ends elsewhere: the drains matter."""
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = TinyNet()
    ref, no_drains = copy.deepcopy(model), copy.deepcopy(model)
    val = loader(n=24)
    if drained_by == "validation":
        kw = trainer_kwargs(val_check_interval=3, callbacks=[_ValLosses(tmp_path)])
    else:
        every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
        kw = trainer_kwargs(enable_checkpointing=True, callbacks=[every])
    strategy = DynPipeStrategy(
        num_microbatches=4, schedule="async", start_method="fork", balance=[2, 3], adaptive=False
    )
    trainer = L.Trainer(devices=2, max_epochs=1, strategy=strategy, **kw)
    # 8 batches: the validations or checkpoints come after the 3rd and the 6th
    trainer.fit(model, loader(), val if drained_by == "validation" else None)
    val_losses: list[float] = []
    weights: list[dict[str, torch.Tensor]] = []

    def at_drain(step: int, losses: list[float]) -> None:
        if step in (2, 5):
            weights.append({k: v.clone() for k, v in ref.state_dict().items()})
            with torch.no_grad():  # Lightning's epoch value: the batch-size-weighted mean (equal batches here)
                val_losses.append(sum(float(F.cross_entropy(ref.pipeline(x), y)) for x, y in val) / len(val))

    common = dict(lr_scale=1 / 4, staleness=staleness_profile(2, "async"))  # DynPipe's default lr_scale: 1/M
    batches = list(loader())
    replay_async(
        ref.pipeline, [2, 3], make_optimizer, batches, 4, lambda out, mb: F.cross_entropy(out, mb[1]),
        drain_after_steps=[2, 5], on_step_end=at_drain, **common,
    )  # fmt: skip
    replay_async(
        no_drains.pipeline, [2, 3], make_optimizer, batches, 4, lambda out, mb: F.cross_entropy(out, mb[1]), **common
    )
    _assert_close(model, ref, atol=0.0)
    assert max((a - b).abs().max().item() for a, b in zip(ref.parameters(), no_drains.parameters())) > 1e-4
    if drained_by == "validation":
        assert val_losses[0] != val_losses[1]
        for rank in (0, 1):  # the value the last stage computed, mirrored to the other rank
            seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
            assert seen == pytest.approx(val_losses, abs=1e-6, rel=0)
        return
    for step, want in zip((3, 6), weights):
        got = torch.load(tmp_path / f"step={step}.ckpt", weights_only=True)["state_dict"]
        assert list(got) == list(want)
        assert all(torch.equal(got[k], want[k]) for k in want), step


def test_async_adam_resumed_from_its_checkpoint_equals_the_replay_that_drains_there(tmp_path: Path) -> None:
    """A checkpoint written at the end of an ``async`` fit resumes, in a new fit, where the uninterrupted replay that
    drains at that step continues: Adam's moments and its step counter (``M`` per batch under ``async``, which its
    bias correction reads) come back as they were; bit for bit."""
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = TinyNet(optimizer="adam")
    ref = copy.deepcopy(model)

    def fit(epochs: int, ckpt_path: Path | None) -> None:
        strategy = DynPipeStrategy(
            num_microbatches=4, schedule="async", start_method="fork", balance=[2, 3], adaptive=False
        )
        save = ModelCheckpoint(dirpath=tmp_path / f"e{epochs}", save_last=True, save_top_k=0)
        kw = trainer_kwargs(enable_checkpointing=True, callbacks=[save])
        L.Trainer(devices=2, max_epochs=epochs, strategy=strategy, **kw).fit(model, loader(), ckpt_path=ckpt_path)

    fit(1, None)  # 8 batches
    first = torch.load(tmp_path / "e1" / "last.ckpt", weights_only=False)
    assert sorted(float(s["step"]) for s in first["optimizer_states"][0]["state"].values()) == [32.0] * 6
    fit(2, tmp_path / "e1" / "last.ckpt")  # 8 more
    replay_async(
        ref.pipeline,
        [2, 3],
        lambda ps: make_optimizer(ps, "adam"),
        list(loader()) * 2,
        4,
        lambda out, mb: F.cross_entropy(out, mb[1]),
        staleness=staleness_profile(2, "async"),
        lr_scale=1 / 4,
        drain_after_steps=[7],
    )
    _assert_close(model, ref, atol=0.0)


def _clipped_training(model: TinyNet, batches: list[Any], clip: float, per_stage: list[list[str]] | None) -> TinyNet:
    """Plain training with Lightning's clipping by norm; ``per_stage``: each group of parameters clipped by its own
    norm instead (what a pipeline that clips each stage alone would compute)."""
    import torch

    ref = copy.deepcopy(model)
    opt = make_optimizer(list(ref.parameters()))
    named = dict(ref.named_parameters())
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(ref.pipeline(x), y).backward()
        for group in per_stage or [list(named)]:
            torch.nn.utils.clip_grad_norm_([named[n] for n in group], clip)
        opt.step()
    return ref


def test_sync_clips_by_the_norm_over_every_stage() -> None:
    """gradient_clip_val under a flush schedule clips by the norm of the whole model's gradient, as on one device
    (one all-reduce of a number over the stages per update), not each stage by its own."""
    clip = 0.05  # below every step's gradient norm: every update is clipped
    model = TinyNet()
    batches = list(loader()) * 2
    ref = _clipped_training(model, batches, clip, None)
    stages = [["pipeline.0.weight", "pipeline.0.bias"], ["pipeline.2.weight", "pipeline.2.bias"]]
    stages.append(["pipeline.4.weight", "pipeline.4.bias"])
    per_stage = _clipped_training(model, batches, clip, [stages[0], stages[1] + stages[2]])
    assert max((a - b).abs().max().item() for a, b in zip(ref.parameters(), per_stage.parameters())) > 1e-3
    strategy = DynPipeStrategy(num_microbatches=4, schedule="sync", start_method="fork", balance=[2, 3], adaptive=False)
    trainer = L.Trainer(devices=2, max_epochs=2, strategy=strategy, gradient_clip_val=clip, **trainer_kwargs())
    trainer.fit(model, loader())
    _assert_close(model, ref, atol=1e-6)


@pytest.mark.parametrize(("schedule", "num_stages"), [("async", 2), ("async", 3), ("async+1", 2)])
def test_async_equals_pipedream_replay(schedule: str, num_stages: int) -> None:
    """With 2 stages nothing runs before the updates (SGD's updates write fresh storage instead of a copy); with
    3 a callback's ``on_before_optimizer_step`` does (the stash copies first). Both bit for bit. ``"async+1"``
    keeps one more micro-batch in flight: the same replay with stage 0's staleness 2."""
    model = TinyNet()
    ref = copy.deepcopy(model)
    _fit(model, devices=num_stages, schedule=schedule, count_updates=num_stages == 3)
    balance = {2: [2, 3], 3: [2, 2, 1]}[num_stages]  # as in _fit
    replay_async(
        ref.pipeline,
        balance,
        make_optimizer,
        list(loader()) * 2,
        4,
        lambda out, mb: F.cross_entropy(out, mb[1]),
        staleness=staleness_profile(num_stages, schedule),
        lr_scale=1 / 4,  # DynPipe's default lr_scale='auto': 1/M per async update
    )
    _assert_close(model, ref, atol=0.0)
    # and the async run really is different from synchronous training
    sync_ref = plain_training(TinyNet(), list(loader()) * 2)
    assert (model.pipeline[0].weight - sync_ref.pipeline[0].weight).abs().max() > 1e-3
