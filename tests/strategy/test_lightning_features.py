"""Lightning features under DynPipe (S=2, async), each asserted either inside every worker or on the results.

One training run exercises logging (CSV + TensorBoard), ModelCheckpoint/EarlyStopping/ReduceLROnPlateau on a
monitored validation metric (mirrored to every rank), torchmetrics in validation_step, gradient clipping per
stage, validation each epoch, and Lightning's ModelSummary with an ``example_input_array`` (the whole model
counted while each rank holds one stage); validate/test/predict then run forward-only through the pipeline
and must equal the plain model."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import BasePredictionWriter, EarlyStopping, ModelCheckpoint, ModelSummary
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from pipeline_models import TinyNet, loader, trainer_kwargs

from lightning_dynpipe import DynPipeStrategy

pytestmark = pytest.mark.multiprocess

CLIP = 0.05


class FeatureNet(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        self.example_input_array = torch.zeros(2, 8)  # ModelSummary runs it through forward at fit start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pipeline(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.pipeline(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.pipeline(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.cross_entropy(self.pipeline(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        # threshold=10 (absolute): no epoch "improves", so the LR halves after every validation but the first
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(
            opt, factor=0.5, patience=0, threshold=10.0, threshold_mode="abs"
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss", "interval": "epoch"}}

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if not gradient_clip_val:
            return
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        assert norm <= CLIP * (1 + 1e-4), f"stage gradient norm {norm} exceeds gradient_clip_val={CLIP}"


class RankChecks(L.Callback):
    """Runs inside every worker."""

    def __init__(self, num_parameters: int) -> None:
        self.validations = 0
        self.num_parameters = num_parameters

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Every rank holds one stage; the summary (the one ModelSummary printed on rank 0) counts the whole model.
        summary_cb = next(c for c in trainer.callbacks if isinstance(c, ModelSummary))  # type: ignore[attr-defined]
        summary = summary_cb._summary(trainer, pl_module)
        assert summary.total_parameters == self.num_parameters, (summary.total_parameters, self.num_parameters)
        columns = dict(summary._get_summary_data())
        assert dict(zip(columns["Name"], columns["Out sizes"]))["pipeline"] == "[2, 3]"
        assert sum(p.numel() for p in pl_module.parameters()) < self.num_parameters  # still partitioned

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # a callback reading a metric on any rank sees the last stage's value of this very step
        loss = float(trainer.callback_metrics["train_loss"])
        losses: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(losses, (trainer.global_step, loss))
        assert all(x == losses[0] for x in losses), f"ranks read different train_loss at a step's end: {losses}"

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.validations += 1
        assert "val_loss" in trainer.callback_metrics, f"rank {trainer.global_rank} misses val_loss"

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = trainer.strategy
        assert isinstance(s, DynPipeStrategy) and s.partition is not None
        assert s.balance_mode == "auto" and s.plan_table and "time to accuracy" in s.plan_table
        balances: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(balances, s.partition.balance)
        assert len(set(balances)) == 1, f"ranks disagree on the planned partition: {balances}"
        assert trainer.model is pl_module  # no wrapper around the LightningModule

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        lrs: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(lrs, lr)
        assert len(set(lrs)) == 1, f"learning rates differ between stages: {lrs}"
        assert lr == pytest.approx(0.1 * 0.5 ** (self.validations - 1)), (lr, self.validations)
        metrics: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(metrics, sorted(trainer.callback_metrics))
        assert all(m == metrics[0] for m in metrics), f"callback_metrics keys differ between ranks: {metrics}"


def _strategy() -> DynPipeStrategy:
    return DynPipeStrategy(num_microbatches=3, start_method="fork")


def test_training_with_loggers_monitors_metrics_and_clipping(tmp_path: Path) -> None:
    model = FeatureNet()
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_top_k=1, save_last=True)
    trainer = L.Trainer(
        devices=2,
        strategy=_strategy(),
        max_epochs=4,
        gradient_clip_val=CLIP,
        log_every_n_steps=1,
        **trainer_kwargs(
            logger=[CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")],
            enable_checkpointing=True,
            num_sanity_val_steps=2,
            enable_model_summary=True,
            callbacks=[
                ckpt_cb,
                EarlyStopping(monitor="val_loss", patience=10),
                RankChecks(sum(p.numel() for p in model.parameters())),
            ],
        ),
    )
    trainer.fit(model, loader(n=48), loader(n=24))

    assert "val_loss" in trainer.callback_metrics and "val_acc" in trainer.callback_metrics
    rows = list(csv.DictReader(open(next((tmp_path / "csv").rglob("metrics.csv")))))
    assert sum(1 for r in rows if r.get("train_loss")) == 16  # every step of 4 epochs x 4 batches
    assert sum(1 for r in rows if r.get("val_acc")) == 4
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert "ckpt" in trainer.checkpoint_callback.best_model_path  # type: ignore[union-attr]
    last = FeatureNet.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    for k, v in model.state_dict().items():
        assert torch.equal(v, last.state_dict()[k]), k  # the process holds the full trained model


class _SavePredictions(BasePredictionWriter):
    """Spawned workers do not return predictions; the last stage (rank 0) writes them to a file."""

    def __init__(self, path: Path) -> None:
        super().__init__(write_interval="batch")
        self.path = path
        self.preds: list[torch.Tensor] = []

    def write_on_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if trainer.is_global_zero:
            self.preds.append(prediction)
            torch.save(self.preds, self.path)
        else:
            assert prediction is None  # only the last stage runs predict_step


def test_validate_and_predict_equal_plain_model(tmp_path: Path) -> None:
    """``trainer.test`` takes the validation path (``DynPipeStrategy._eval``, with the test hooks); a 2-stage
    ``trainer.test`` runs in ``tests/examples/test_examples.py`` (the MNIST demo's test accuracy)."""
    model = FeatureNet()
    val = loader(n=24)
    kw = trainer_kwargs()
    plain_val = L.Trainer(devices=1, **kw).validate(model, val, verbose=False)
    pipe_val = L.Trainer(devices=2, strategy=_strategy(), **kw).validate(model, val, verbose=False)
    writer = _SavePredictions(tmp_path / "preds.pt")
    L.Trainer(devices=2, strategy=_strategy(), **{**kw, "callbacks": [writer]}).predict(model, val)
    preds = torch.load(tmp_path / "preds.pt")
    assert pipe_val[0]["val_loss"] == pytest.approx(plain_val[0]["val_loss"], abs=1e-6)
    assert pipe_val[0]["val_acc"] == pytest.approx(plain_val[0]["val_acc"], abs=1e-6)
    expected = torch.cat([model.pipeline(x) for x, _ in val])
    assert len(preds) == len(val)
    assert torch.allclose(torch.cat(preds), expected, atol=1e-6)


class _StepCount(L.Callback):
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert trainer.global_step == 2, trainer.global_step


def test_fast_dev_run() -> None:
    trainer = L.Trainer(devices=2, strategy=_strategy(), fast_dev_run=2, **trainer_kwargs(callbacks=[_StepCount()]))
    trainer.fit(FeatureNet(), loader(n=48), loader(n=24))
