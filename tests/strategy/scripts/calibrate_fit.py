"""popen launcher, 2 processes: the opt-in calibration sweep at set-up (``calibrate=...``) on a transformer.

TinyGPT with tied embeddings (a tuple with an int64 tensor crosses every boundary, non-persistent buffers in every
block), ``schedule="sync"``, Adam, ``predictor=ForestPredictor(...)`` and ``calibrate=SweepSettings(...)``:

1. every rank's forest is fitted before the first step, on the same rows (the sweep runs on rank 0 and its rows
   travel with the set-up decision), as many as the sweep measures: every ordered pair of partitions under each
   scenario, per stage (the candidate partitions and those the planner proposed from their windows);
2. the sweep ran the model's own layer sets (its log line names the windows) and left the model alone: the final
   weights equal plain single-process training with Adam to 1e-5 (the micro-batches' gradients are summed in
   another order than the batch's; after 90 Adam steps a bias differed by 1.9e-6 in this test), and the tie holds;
3. with ``one_rank_refits=True``, each of the run's refits (one per window here) ran on one rank, the one with
   CPU to spare at its check: a rank that fitted none spent no CPU on refits, and every rank switched to the same
   forests (the fitting rank's, received in the broadcast at each switch).

Usage: python calibrate_fit.py
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
import sys
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline_models import TinyGPT, gpt_loss, token_loader, trainer_kwargs  # noqa: E402

from lightning_dynpipe import DynPipeStrategy  # noqa: E402
from lightning_dynpipe.predictor import ForestPredictor  # noqa: E402
from lightning_dynpipe.sweep import SweepSettings  # noqa: E402

SETTINGS = SweepSettings(scenarios=("none", "delay1"), partitions=3, steps=2)
# 60 steps, windows every 3 steps. A refit runs at the lowest CPU priority, in the time the stages leave: on
# 2 cores it took 0.15-0.22 s of CPU and 0.5 s of wall time, and with 30 steps (0.75 s) the one refit, on the busier
# rank, at times had not finished when the fit ended, so none was adopted.
EPOCHS = 10


def digest(forest: ForestPredictor) -> str:
    rows = forest.samples
    h = hashlib.sha256()
    for a in (rows.stage_x, rows.stage_y, rows.boundary_x, rows.boundary_y):
        h.update(a.tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    model = TinyGPT(tie=True)
    ref = copy.deepcopy(model)
    forest = ForestPredictor(n_estimators=8, refit_on="every", refit_every=1, one_rank_refits=True)
    fitted_at_start: list[bool] = []

    class FittedAtStart(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            fitted_at_start.append(forest.fitted)

    strategy = DynPipeStrategy(
        num_stages=2,
        schedule="sync",
        num_microbatches=2,
        predictor=forest,
        calibrate=SETTINGS,
        monitor_every_n_steps=3,
    )
    trainer = L.Trainer(devices=2, strategy=strategy, max_epochs=EPOCHS, **trainer_kwargs(callbacks=[FittedAtStart()]))  # type: ignore[arg-type]
    trainer.fit(model, token_loader())

    # 1. fitted before the first step, on the same rows everywhere, as many as the sweep measures
    assert fitted_at_start == [True], fitted_at_start
    # the 3 candidate partitions and those the planner proposed from their windows (at most 3 more)
    found = re.match(r"calibrated on (\d+) windows \(2 scenarios x (\d+) partitions", strategy.calibration or "")
    assert found is not None, strategy.calibration
    windows, measured = int(found[1]), int(found[2])
    assert windows == 2 * measured and SETTINGS.partitions <= measured <= 2 * SETTINGS.partitions, strategy.calibration
    assert strategy.calibration_s is not None and strategy.calibration_s > 0
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest(forest))
    assert len(set(digests)) == 1, digests
    pairs = len(SETTINGS.scenarios) * measured**2
    assert len(forest.samples) >= pairs * 2, len(forest.samples)  # 2 stages per window (then the run's own)
    # 2. the model is what plain training gives
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for _ in range(EPOCHS):
        for x, y in token_loader():
            opt.zero_grad()
            gpt_loss(ref.pipeline(x), (x, y)).backward()
            opt.step()
    assert model.pipeline[-1].out.weight is model.pipeline[0].tok.weight
    for k, v in ref.state_dict().items():
        assert torch.allclose(model.state_dict()[k], v, atol=1e-5, rtol=0), (
            f"{k}: {(model.state_dict()[k] - v).abs().max():.3g}"
        )
    # 3. each refit on one rank, the same forests everywhere
    gathered: list[Any] = [None] * dist.get_world_size()
    stage = forest._stage
    assert stage is not None
    answer = hashlib.sha256(np.concatenate(stage.predict(forest.samples.stage_x)).tobytes()).hexdigest()
    dist.all_gather_object(gathered, (forest.refits, forest._refits_started, forest.refits_fitted, forest.refit_cpu_s))
    answers: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(answers, answer)
    refits = [tuple(r) for r in gathered]
    assert refits[0][0] >= 1 and len({r[:2] for r in refits}) == 1, refits  # adopted and started: the same
    assert sum(r[2] for r in refits) == refits[0][1], refits  # each started refit fitted on exactly one rank
    assert all(r[3] == 0.0 for r in refits if r[2] == 0), refits  # no refit CPU where none was fitted
    assert sum(r[3] for r in refits) > 0.0, refits
    assert len(set(answers)) == 1, answers
    if dist.get_rank() == 0:
        print(f"rows: {len(forest.samples)}; sweep {strategy.calibration_s:.1f} s; refits {refits}", flush=True)
        print("CALIBRATE_FIT_OK", flush=True)
