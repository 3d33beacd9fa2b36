"""popen launcher, 2 stages: a transformer trained as users train one, then checked in every process after fit.

Usage: python real_models.py {async,async+1,tied-sync} CHECKPOINT_PATH

``async``: TinyGPT (non-persistent causal mask and rotary table, a tuple with an int64 tensor across the
boundary), async, a block moved to stage 0 at step 3. ``async+1``: the same with one more micro-batch in flight
(stage 0 two updates stale). ``tied-sync``: TinyGPT with GPT-2 tying (embedding and
head on different stages), sync, clipped by the whole model's norm at ``CLIP`` on every step, the same move. After
fit every rank checks that the module it holds computes
what a freshly built model with the same weights computes (so every buffer is right), rank 0 compares the weights
with the single-process reference, and ``trainer.save_checkpoint(CHECKPOINT_PATH)`` writes the file the test reads.
Prints ``REAL_MODELS_OK {json}`` per rank.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline_models import TinyGPT, gpt_loss, token_loader, trainer_kwargs  # noqa: E402

from lightning_dynpipe import DynPipeStrategy  # noqa: E402
from lightning_dynpipe.calibration import replay_async  # noqa: E402

M = 4
MOVE_AT, NEW_BALANCE = 3, [3, 2]
CLIP = 0.5  # below the tied model's gradient norm at every step of the run


class MoveABlock(L.Callback):
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == MOVE_AT:
            trainer.strategy.repartition(NEW_BALANCE)  # type: ignore[attr-defined]


class SummaryCount(L.Callback):
    """What the (whole-pipeline) model summary reports, read when Lightning shows it."""

    def __init__(self) -> None:
        self.total: int | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        cb = next(c for c in trainer.callbacks if isinstance(c, ModelSummary))  # type: ignore[attr-defined]
        self.total = cb._summary(trainer, pl_module).total_parameters


def plain_tied(model: TinyGPT, batches: list[Any]) -> tuple[TinyGPT, list[float]]:
    """Plain tied training clipped by norm as Lightning clips it; returns the model and each step's norm."""
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    norms = []
    for x, y in batches:
        opt.zero_grad()
        gpt_loss(ref.pipeline(x), (x, y)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        opt.step()
    return ref, norms


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    tie = mode == "tied-sync"
    model = TinyGPT(tie=tie)
    before = copy.deepcopy(model)
    summary = SummaryCount()
    trainer = L.Trainer(
        devices=2,
        max_steps=6,
        strategy=DynPipeStrategy(balance=[2, 3], num_microbatches=M, schedule="sync" if tie else mode, adaptive=False),
        gradient_clip_val=CLIP if tie else None,
        **trainer_kwargs(callbacks=[MoveABlock(), summary, ModelSummary()], enable_model_summary=True),
    )
    trainer.fit(model, token_loader())
    x, _ = next(iter(token_loader()))
    fresh = TinyGPT(tie=tie)
    fresh.load_state_dict(model.state_dict())  # builds its own buffers; the weights of the trained model
    out = model(x)
    result: dict[str, Any] = {
        "rank": dist.get_rank(),
        "finite": bool(torch.isfinite(out).all()),
        "equals_fresh": bool(torch.equal(out, fresh(x))),
        "tied": model.pipeline[4].out.weight is model.pipeline[0].tok.weight,
        "summary_total": summary.total,
        "plain_total": sum(p.numel() for p in before.parameters()),
    }
    if dist.get_rank() == 0:
        batches = list(token_loader())
        if tie:
            ref, norms = plain_tied(before, batches)
            result["min_norm_over_clip"] = min(norms) / CLIP
        else:
            ref = before
            replay_async(
                ref.pipeline,
                [2, 3],
                lambda ps: torch.optim.Adam(ps, lr=0.01),
                batches,
                M,
                gpt_loss,
                staleness=[2, 0] if mode == "async+1" else [1, 0],
                repartitions={MOVE_AT - 1: NEW_BALANCE},
                lr_scale=1 / M,
            )
        result["max_diff"] = max(
            float((a - b).abs().max()) for a, b in zip(model.state_dict().values(), ref.state_dict().values())
        )
    trainer.save_checkpoint(path)  # collective, like every Lightning checkpoint: called on every rank
    result["optimizer_entries"] = len(trainer.optimizers[0].state)
    # one write of the whole line: both ranks print to the same pipe, and under PYTHONUNBUFFERED print()'s separate
    # writes of the text and the newline interleaved the two ranks' lines (seen: two JSON objects on one line)
    sys.stdout.write("REAL_MODELS_OK " + json.dumps(result) + "\n")
    sys.stdout.flush()
