"""Small models and data for the multi-process strategy tests (importable by spawned workers)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

LR = 0.1
MOMENTUM = 0.9


class TinyNet(L.LightningModule):
    """Five layers, no randomness in forward: numerics must match references exactly."""

    def __init__(self, optimizer: str = "sgd", seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.pipeline = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.pipeline(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.pipeline(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.pipeline(batch[0])

    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


class RecordEachStep(L.Callback):
    """On rank 0 (the last stage), ``record(trainer, outputs)`` at the end of every training batch, the list so far
    written to ``path`` as JSON after each: what a test reads back from a fit whose ranks are processes of their own
    (a fork launcher's callbacks stay in the workers)."""

    def __init__(self, path: Path, record: Any) -> None:
        self.path = path
        self.record = record
        self.rows: list[Any] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        if trainer.global_rank == 0:
            self.rows.append(self.record(trainer, outputs))
            self.path.write_text(json.dumps(self.rows))


def make_optimizer(params: list[nn.Parameter], optimizer: str = "sgd") -> torch.optim.Optimizer:
    """The same optimizer TinyNet builds, for single-process references."""
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def dataset(n: int = 96, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def loader(batch_size: int = 12, n: int = 96) -> DataLoader:
    return DataLoader(dataset(n), batch_size=batch_size, shuffle=False)


def plain_training(model: TinyNet, batches: list[Any], optimizer: str = "sgd") -> TinyNet:
    """Single-device reference: one update per whole batch."""
    ref = copy.deepcopy(model)
    opt = make_optimizer(list(ref.parameters()), optimizer)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(ref.pipeline(x), y).backward()
        opt.step()
    return ref


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    kw.update(overrides)
    return kw


def fit_three_stages_against_the_replay(callback: L.Callback, optimizer: str = "sgd", **replay: Any) -> None:
    """Fits TinyNet on 3 async stages ``[2, 2, 1]`` (M=4, one epoch, fork, no adaptation) with ``callback``, and
    asserts that its weights equal, to 1e-6, the PipeDream replay of the same batches given ``replay``'s changes
    (``repartitions``, ``restaleness``: keyed by the step after which they apply)."""
    from lightning_dynpipe import DynPipeStrategy
    from lightning_dynpipe.calibration import replay_async

    model = TinyNet(optimizer=optimizer)
    ref = copy.deepcopy(model)
    trainer = L.Trainer(
        devices=3,
        max_epochs=1,
        strategy=DynPipeStrategy(balance=[2, 2, 1], num_microbatches=4, start_method="fork", adaptive=False),
        **trainer_kwargs(callbacks=[callback]),
    )
    trainer.fit(model, loader())
    replay_async(
        ref.pipeline,
        [2, 2, 1],
        lambda ps: make_optimizer(ps, optimizer),
        list(loader()),
        4,
        lambda out, mb: F.cross_entropy(out, mb[1]),
        lr_scale=1 / 4,  # DynPipe's default lr_scale='auto': 1/M per async update
        **replay,
    )
    for k, v in ref.state_dict().items():
        assert torch.allclose(model.state_dict()[k], v, atol=1e-6, rtol=0), k


class ScheduledNet(TinyNet):
    """TinyNet with Adam and a per-step StepLR, so resumption must restore optimizer and scheduler state."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(optimizer="adam", seed=seed)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def plain_scheduled_training(model: ScheduledNet, batches: list[Any]) -> ScheduledNet:
    """Single-device reference for ScheduledNet: Adam, StepLR stepped after every batch."""
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(ref.pipeline(x), y).backward()
        opt.step()
        sched.step()
    return ref


# ----------------------------------------------------------------------------- a transformer, as people pipeline
class _Embed(nn.Module):
    """Tokens -> (hidden, positions): a tuple crosses the stage boundary, with an int64 tensor in it."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.tok(tokens), pos


class _Block(nn.Module):
    """Pre-LN causal self-attention with rotary positions and an MLP. The causal mask and the rotary frequencies
    are non-persistent buffers, as in real models: not in state_dict(), needed to compute."""

    def __init__(self, dim: int, heads: int, block: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.register_buffer("mask", torch.tril(torch.ones(block, block, dtype=torch.bool)), persistent=False)
        half = dim // heads // 2
        self.register_buffer("inv_freq", 1.0 / (100.0 ** (torch.arange(half) / half)), persistent=False)

    def _rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        angles = pos[:, None, :, None].to(x.dtype) * self.inv_freq.to(x.dtype)  # (B, 1, T, half)
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], dim=-1)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, pos = inputs
        B, T, D = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        q, k = self._rotate(q, pos), self._rotate(k, pos)
        att = (q @ k.transpose(-1, -2)) / (D // self.heads) ** 0.5
        att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(-1)
        h = h + self.proj((att @ v).transpose(1, 2).reshape(B, T, D))
        return h + self.mlp(self.ln2(h)), pos


class _Head(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.out(self.ln(inputs[0]))


VOCAB, BLOCK = 32, 8


class TinyGPT(L.LightningModule):
    """Embedding, three transformer blocks, head; no dropout (numerics must match references exactly)."""

    def __init__(self, dim: int = 16, heads: int = 2, layers: int = 3, tie: bool = False, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        units: list[nn.Module] = [_Embed(VOCAB, dim), *(_Block(dim, heads, BLOCK) for _ in range(layers))]
        self.pipeline = nn.Sequential(*units, _Head(VOCAB, dim))
        if tie:
            self.pipeline[-1].out.weight = self.pipeline[0].tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.pipeline(tokens)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = gpt_loss(self.pipeline(x), (x, y))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def gpt_loss(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[1].reshape(-1))


def token_loader(n: int = 48, batch_size: int = 8, seed: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, BLOCK), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=batch_size, shuffle=False)


def restarting_trainer(
    num_stages: int | None,
    root: str,
    max_steps: int,
    callbacks: list[Any],
    start_method: str = "popen",
    checkpoint: str = "full",
) -> L.Trainer:
    """2 processes, TinyNet's async pipeline of 2 stages (``num_stages`` after a restart), whose planner, with a
    strong staleness penalty, prefers 2 replicas of 1 stage: ``change_stages="restart"`` ends the fit at the
    adaptive loop's first check (every 3 steps, on 5 steps or more) to continue under 1 stage."""
    from lightning_dynpipe import DynPipeStrategy
    from lightning_dynpipe.plan.convergence import ConvergenceModel

    strategy = DynPipeStrategy(
        num_stages=num_stages or 2,
        num_microbatches=4,
        start_method=start_method,  # type: ignore[arg-type]
        replica_split="even",
        change_stages="restart",
        convergence=ConvergenceModel(beta=20.0),
        monitor_every_n_steps=3,
        checkpoint=checkpoint,  # type: ignore[arg-type]
    )
    return L.Trainer(
        devices=2,
        strategy=strategy,
        max_steps=max_steps,
        default_root_dir=root,
        **trainer_kwargs(callbacks=callbacks),
    )


def run_popen_script(script: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs ``script`` as a user would (``python script.py ...``: Lightning's popen launcher starts the other ranks
    from it), without this process's rank variables; asserts it exited 0, with its output's tail if not."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    proc = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc
