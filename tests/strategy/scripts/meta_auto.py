"""popen launcher, 2 processes: ``balance="auto"`` and the adaptive loop with a model built on ``meta``.

The same fit twice, once built on the CPU and once under ``trainer.init_module(empty_init=True)``: 2 stages,
``balance="auto"`` (rank 0 profiles and plans; with the meta start on copies materialised one layer at a time),
``schedule="sync"``, Adam, and an adaptive loop whose policy moves two layers at its first check (so a Linear
travels, with its weights and Adam's state, to a stage that did not materialise it).

1. Both runs planned (rank 0 holds the plan) and profiled the same sizes: every byte count of the per-layer
   costs is equal (the meta run measured the real layers, and read Adam's state size off an optimizer built on
   ``meta``).
2. Both migrated once, through the adaptive loop.
3. The final weights are equal to each other bit for bit when both runs chose the same partitions (the planner
   times the layers, so on a loaded machine the two may choose differently; then to 1e-6) and equal to plain
   single-process training with Adam to 1e-6 (under ``schedule="sync"`` the pipeline is exact; the rest is
   float summation order).

Usage: python meta_auto.py
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as L
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline_models import TinyNet, loader, plain_training, trainer_kwargs  # noqa: E402

from lightning_dynpipe import DynPipeStrategy  # noqa: E402
from lightning_dynpipe.engine.materialize import is_on_meta  # noqa: E402
from lightning_dynpipe.plan.partition import Partition  # noqa: E402
from lightning_dynpipe.repartition.policy import Decision, PolicyInputs  # noqa: E402

EPOCHS = 1  # 8 steps; the monitor checks every 5 steps, the move happens at the first check


class MoveTwoLayersOnce:
    """Moves the boundary by two layers at the first check (so a Linear moves, whatever the plan), then keeps."""

    def __init__(self) -> None:
        self.moved = False

    def decide(self, inputs: PolicyInputs) -> Decision:
        a, b = inputs.current.balance
        new = Partition((a - 2, b + 2) if a >= 3 else (a + 2, b - 2))
        move, self.moved = not self.moved, True
        return Decision(move, new if move else inputs.current, 0.0, "scripted: one move", inputs)

    def migrated(self, step: int) -> None:
        pass


def run(meta: bool) -> tuple[TinyNet, DynPipeStrategy]:
    strategy = DynPipeStrategy(
        num_stages=2,
        balance="auto",
        schedule="sync",
        num_microbatches=3,
        adaptive=MoveTwoLayersOnce(),
        monitor_every_n_steps=5,
    )
    trainer = L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(max_epochs=EPOCHS))  # type: ignore[arg-type]
    if meta:
        with trainer.init_module(empty_init=True):
            model = TinyNet(optimizer="adam")
        assert is_on_meta(model)
    else:
        model = TinyNet(optimizer="adam")
    trainer.fit(model, loader())
    return model, strategy


def byte_counts(strategy: DynPipeStrategy) -> list[tuple[int, int, int, int]]:
    assert strategy.model_cost is not None
    return [
        (c.activation_bytes, c.param_bytes, c.optimizer_state_bytes, c.workspace_bytes)
        for c in strategy.model_cost.layers
    ]


if __name__ == "__main__":
    ref = plain_training(TinyNet(optimizer="adam"), list(loader()) * EPOCHS, optimizer="adam")
    cpu_model, cpu = run(meta=False)
    meta_model, meta = run(meta=True)

    # 1. planned and profiled alike
    if dist.get_rank() == 0:
        assert cpu.plan is not None and meta.plan is not None
    assert byte_counts(meta) == byte_counts(cpu), (byte_counts(meta), byte_counts(cpu))
    assert byte_counts(cpu)[0][2] == 3 * byte_counts(cpu)[0][1]  # gradients + Adam's two moments
    # 2. one migration each, decided by the adaptive loop
    for s in (cpu, meta):
        assert len(s.migrations) == 1 and s.controller is not None
        assert sum(d.repartition for d in s.controller.decisions) == 1
        assert any(isinstance(TinyNet().pipeline[i], torch.nn.Linear) for i in s.migrations[0].moved)
    # 3. the same weights, and those of plain training
    history = [(list(r.old.balance), list(r.new.balance)) for r in meta.migrations]
    same = history == [(list(r.old.balance), list(r.new.balance)) for r in cpu.migrations]
    a, b = meta_model.state_dict(), cpu_model.state_dict()
    assert list(a) == list(b) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        if same:
            assert torch.equal(a[k], b[k]), k
        else:
            assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), k
        assert torch.allclose(a[k], v, atol=1e-6, rtol=0), f"{k}: {(a[k] - v).abs().max():.3g}"
    if dist.get_rank() == 0:
        print(f"partitions (meta run): {history}; same as the CPU run: {same}", flush=True)
        print("META_AUTO_OK", flush=True)
