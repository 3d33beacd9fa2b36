"""What ``on_train_batch_end`` receives as ``outputs`` when ``training_step`` returns a dict with more than the
loss: the step's micro-batches' values merged back into the batch's (per-sample tensors concatenated in order,
anything else as the list of the micro-batches' values). The merge itself is unit-tested in its doctest
(``lightning_dynpipe.engine.microbatch.merge_step_outputs``) and below."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from pipeline_models import RecordEachStep, TinyNet, loader, trainer_kwargs

from lightning_dynpipe import DynPipeStrategy
from lightning_dynpipe.engine.microbatch import merge_step_outputs


class OutputsNet(TinyNet):
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        logits = self.pipeline(x)
        return {"loss": F.cross_entropy(logits, y), "preds": logits.argmax(-1), "n": x.shape[0]}


def _outputs(trainer: L.Trainer, outputs: Any) -> dict[str, Any]:
    return {"loss": float(outputs["loss"]), "preds": outputs["preds"].tolist(), "n": outputs["n"]}


@pytest.mark.multiprocess
def test_on_train_batch_end_sees_the_batch_outputs_merged_over_the_micro_batches(tmp_path: Path) -> None:
    """Two ``sync`` stages, two micro-batches of 6: every step's ``preds`` equal one device's for the whole batch
    (the weights are one device's), its ``loss`` is the batch's mean, and the scalar ``n`` comes as the list of the
    micro-batches' values. Under ``async`` every step's outputs hold the whole batch too."""
    for name, devices, schedule in (("one", 1, None), ("sync", 2, "sync"), ("async", 2, "async")):
        strategy: Any = (
            DynPipeStrategy(num_microbatches=2, schedule=schedule, start_method="fork", balance=[2, 3], adaptive=False)
            if schedule
            else "auto"
        )
        kw = trainer_kwargs(max_epochs=1, callbacks=[RecordEachStep(tmp_path / f"{name}.json", _outputs)])
        L.Trainer(devices=devices, strategy=strategy, **kw).fit(OutputsNet(), loader(n=48))
    one, two, stale = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "sync", "async"))
    # async: the last stage runs every micro-batch of a step within it, so its outputs are whole batches too
    assert [(len(s["preds"]), s["n"]) for s in stale] == [(12, [6, 6])] * 4
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert b["preds"] == a["preds"] and len(b["preds"]) == 12
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert a["n"] == 12 and b["n"] == [6, 6]


def test_merge_keeps_what_is_not_one_row_per_sample_as_a_list() -> None:
    rows = [torch.zeros(2, 3), torch.ones(1, 3)]
    merged = merge_step_outputs(
        [
            {"rows": rows[0], "ragged": torch.zeros(2, 4), "scalar": torch.tensor(1.0), "some": 1},
            {"rows": rows[1], "ragged": torch.zeros(1, 5), "scalar": torch.tensor(2.0)},
        ],
        [2, 1],
    )
    assert torch.equal(merged["rows"], torch.cat(rows))
    assert [tuple(t.shape) for t in merged["ragged"]] == [(2, 4), (1, 5)]  # other dimensions differ: not joined
    assert [float(t) for t in merged["scalar"]] == [1.0, 2.0]
    assert merged["some"] == [1, None]
