"""A 2-stage fit (popen launcher) with an interference schedule; optionally failing at step 4.

Usage: python interfered_fit.py {ok,fail} OUT_DIR

Each rank writes ``OUT_DIR/rank<r>.json``: its stage, the callback's events, the link delays seen on its send
channels at each step, and the helper processes / cgroups it had while interference was on.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "strategy"))
from pipeline_models import TinyNet, loader, trainer_kwargs  # noqa: E402

from lightning_dynpipe import DynPipeStrategy  # noqa: E402
from lightning_dynpipe.interference import InterferenceCallback  # noqa: E402

FAIL_STEP = 4
SCHEDULE = [
    {"kind": "link_delay", "stage": 0, "start_step": 1, "stop_step": 3, "delay_s": 0.002, "jitter_s": 0.001},
    {"kind": "cpu_quota", "stage": 1, "start_step": 2, "fraction": 0.5},
    {"kind": "cpu_hog", "stage": 0, "start_step": 3, "duty_cycle": 0.1, "cores": [0]},
]


class Recorder(L.Callback):
    """Runs after InterferenceCallback in each hook: records what the interference did on this rank."""

    def __init__(self, out: Path, fail: bool) -> None:
        self.out, self.fail, self.steps = out, fail, []  # type: ignore[var-annotated]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        s: Any = trainer.strategy
        ch = s.executor.channels
        self.steps.append(
            {
                "step": trainer.global_step,
                "delays": [c.name for c in (ch.send_activation, ch.send_grad) if c is not None and c.delay is not None],
                "children": sorted(p.pid for p in psutil.Process().children()),
                "cgroup": Path("/proc/self/cgroup").read_text(),
            }
        )
        if self.fail and trainer.global_step == FAIL_STEP and s.stage_idx == 0:
            raise RuntimeError("training failed on purpose")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.dump(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.dump(trainer)

    def dump(self, trainer: L.Trainer) -> None:
        cb = next(c for c in trainer.callbacks if isinstance(c, InterferenceCallback))  # type: ignore[attr-defined]
        s: Any = trainer.strategy
        record = {
            "stage": s.stage_idx,
            "steps": self.steps,
            "pid": os.getpid(),
            "events": [[e.action, e.spec.kind, e.step, e.detail] for e in cb.events],
        }
        (self.out / f"rank{s.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    interference = InterferenceCallback(SCHEDULE)
    trainer = L.Trainer(
        devices=2,
        max_steps=6,
        strategy=DynPipeStrategy(num_microbatches=2, balance=[2, 3]),
        **trainer_kwargs(callbacks=[interference, Recorder(out, mode == "fail")]),
    )
    trainer.fit(TinyNet(), loader())
