"""A transformer trained as users train one: non-persistent buffers, a tuple across the stage boundary, GPT-2
tied weights, a live migration, and ``trainer.save_checkpoint`` after fit (the popen launcher, so the process
that called ``fit`` is a stage and its module was partitioned).

Tolerances: async against the PipeDream replay and sync against plain tied training, 1e-5 (Adam, float32,
gradients accumulated over micro-batches in another order)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from pipeline_models import TinyGPT, run_popen_script, token_loader, trainer_kwargs

from lightning_dynpipe import DynPipeStrategy

pytestmark = pytest.mark.multiprocess
SCRIPT = Path(__file__).parent / "scripts" / "real_models.py"
CLIP = 0.5  # the gradient_clip_val of scripts/real_models.py's tied-sync fit


def _run(mode: str, ckpt: Path) -> list[dict[str, Any]]:
    proc = run_popen_script(SCRIPT, mode, str(ckpt), timeout=240)
    lines = [line.split(" ", 1)[1] for line in (proc.stdout + proc.stderr).splitlines() if "REAL_MODELS_OK " in line]
    results = sorted((json.loads(line) for line in lines), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1], proc.stdout[-3000:]
    return results


def _plain_optimizer_loads(ckpt: Path, tie: bool) -> dict[str, Any]:
    data = torch.load(ckpt, weights_only=False)
    model = TinyGPT(tie=tie)
    model.load_state_dict(data["state_dict"])  # strict: the plain module's keys, nothing missing
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt.load_state_dict(data["optimizer_states"][0])
    assert sorted(data["optimizer_states"][0]["state"]) == list(range(len(list(model.parameters()))))
    return data


@pytest.mark.parametrize("schedule", ["async", "async+1"])
def test_async_transformer_keeps_every_buffer_through_a_migration_and_the_end_of_fit(
    tmp_path: Path, schedule: str
) -> None:
    ckpt = tmp_path / "after_fit.ckpt"
    results = _run(schedule, ckpt)
    for r in results:
        assert r["finite"] and r["equals_fresh"], r  # the returned module computes like a freshly built one
    assert results[0]["max_diff"] <= 1e-5  # the migrating run equals the replay with the same partition change
    _plain_optimizer_loads(ckpt, tie=False)


def test_tied_weights_stay_one_parameter_through_a_migration_checkpoint_and_resume(tmp_path: Path) -> None:
    ckpt = tmp_path / "tied_after_fit.ckpt"
    results = _run("tied-sync", ckpt)
    for r in results:
        assert r["finite"] and r["equals_fresh"] and r["tied"], r
        assert r["summary_total"] == r["plain_total"], r  # the tied matrix counted once
    assert results[0]["max_diff"] <= 1e-5  # equals plain tied training on one device, clipped by norm as it is
    assert results[0]["min_norm_over_clip"] > 1.0  # the clip acted on every step
    data = _plain_optimizer_loads(ckpt, tie=True)
    sd = data["state_dict"]
    assert sd["pipeline.0.tok.weight"].data_ptr() == sd["pipeline.4.out.weight"].data_ptr()  # saved once

    # Resume the file written after fit under 3 stages (the tie split between stages 0 and 2, clipped by the norm
    # over the three) and in plain Lightning: both must continue exactly as plain Lightning continues a file that
    # plain Lightning wrote (every run clipped by norm at CLIP, as the fit that wrote the file was).
    plain_first = TinyGPT(tie=True)
    plain_trainer = L.Trainer(devices=1, max_steps=6, gradient_clip_val=CLIP, **trainer_kwargs())
    plain_trainer.fit(plain_first, token_loader())
    plain_trainer.save_checkpoint(tmp_path / "plain.ckpt")
    reference = _resume(tmp_path / "plain.ckpt", 1, "auto")
    for devices, strategy in (
        (1, "auto"),
        (3, DynPipeStrategy(balance=[2, 2, 1], num_microbatches=4, schedule="sync", start_method="fork")),
    ):
        resumed = _resume(ckpt, devices, strategy)
        for (k, a), b in zip(resumed.state_dict().items(), reference.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{devices} device(s): {k}")


def _resume(ckpt: Path, devices: int, strategy: Any) -> TinyGPT:
    model = TinyGPT(tie=True)
    trainer = L.Trainer(devices=devices, max_steps=12, strategy=strategy, gradient_clip_val=CLIP, **trainer_kwargs())
    trainer.fit(model, token_loader(), ckpt_path=str(ckpt))
    assert devices > 1 or trainer.global_step == 12  # (spawn does not bring global_step back to this process)
    return model
