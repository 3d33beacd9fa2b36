"""The metrics mirror on two gloo processes: every rank reads rank 0's metrics, values and dtypes, and no rank
waits for another at a mirror point.

While the names stay the same the values travel as one float64 tensor; a change of names, or a value that is
not a 0-dim floating-point tensor, sends the whole dict as an object again. The trainer is a stand-in with the
attributes the mirror reads, so the test needs no Lightning loop.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch  # noqa: F401  (Lightning first: a spawned child imports this module cold)
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from two_gloo_ranks import join, run_two_ranks

from lightning_dynpipe.strategy.callbacks import MetricsMirror, metrics_schema

# What rank 0 holds at each step, and whether that step must send the dict as an object.
_STEPS: list[tuple[dict[str, Any], bool]] = [
    ({"train_loss": torch.tensor(2.5)}, True),  # first step: the names are new
    ({"train_loss": torch.tensor(1.0 / 3.0)}, False),  # same names: values only
    ({"train_loss": torch.tensor(0.1), "val_loss": torch.tensor(0.7, dtype=torch.float64)}, True),
    ({"train_loss": torch.tensor(0.2), "val_loss": torch.tensor(0.6, dtype=torch.float64)}, False),
    ({"train_loss": torch.tensor(0.2, dtype=torch.bfloat16), "val_loss": torch.tensor(0.5)}, True),  # dtypes
    ({"train_loss": torch.tensor(0.3), "epoch": 1}, True),  # not a tensor: object path
    ({"train_loss": torch.tensor(0.4), "epoch": 1}, True),  # and again (no float schema)
    ({"train_loss": torch.tensor(0.5), "count": torch.tensor(3)}, True),  # an integer tensor
]


_UNREAD = {1, 3}  # steps whose values rank 1 never reads: the next mirror point applies them


def _worker(rank: int, port: int, store_port: int, out: str) -> None:
    store = join(rank, port, store_port)
    try:
        mirror = MetricsMirror(torch.device("cpu"))
        metrics: dict[str, Any] = {}
        trainer = SimpleNamespace(
            world_size=2,
            is_global_zero=rank == 0,
            callback_metrics=metrics,
            _logger_connector=SimpleNamespace(_callback_metrics=metrics),
        )
        seen = []
        for step, (logged, _) in enumerate(_STEPS):
            if rank == 0:
                # rank 0 reaches each point only after rank 1 has passed it: a mirror that waited at the point
                # itself would leave rank 1 waiting for rank 0 there, and the store's wait would time out
                store.wait([f"rank1-passed-{step}"])
                metrics.clear()
                metrics.update(logged)
            before = mirror.object_broadcasts
            mirror._mirror(trainer)  # type: ignore[arg-type]
            if rank == 1:
                store.set(f"rank1-passed-{step}", "1")
                if step in _UNREAD:
                    continue
                mirror.resolve()  # what reading trainer.callback_metrics does
            seen.append(
                {
                    "step": step,
                    "object": mirror.object_broadcasts > before,
                    "values": {
                        k: [float(v), str(v.dtype)] if isinstance(v, torch.Tensor) else v for k, v in metrics.items()
                    },
                }
            )
        mirror.finish(wait=True)
        Path(f"{out}.{rank}").write_text(json.dumps(seen), encoding="utf-8")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_every_rank_gets_rank_zeros_metrics_when_it_reads_them_and_no_rank_waits_at_a_mirror_point(
    tmp_path: Path,
) -> None:
    seen = run_two_ranks(_worker, tmp_path)
    rank0, rank1 = ({r["step"]: r for r in ranks} for ranks in seen)
    assert sorted(rank1) == [s for s in range(len(_STEPS)) if s not in _UNREAD]
    for step, (metrics, expect_object) in enumerate(_STEPS):
        assert rank0[step]["object"] == expect_object, f"step {step}: {rank0[step]['object']}"
        if step in _UNREAD:
            continue
        assert rank1[step]["object"] == expect_object, f"step {step}: {rank1[step]['object']}"
        # every value and dtype of rank 0's
        for k, v in metrics.items():
            want = [float(v), str(v.dtype)] if isinstance(v, torch.Tensor) else v
            assert rank1[step]["values"][k] == want, f"step {step}, {k}: {rank1[step]['values'][k]} != {want}"


class _Mirror:
    def __init__(self) -> None:
        self.resolved = 0

    def resolve(self) -> None:
        self.resolved += 1


def test_reading_callback_metrics_on_a_receiving_rank_applies_the_mirror_first_and_detach_undoes_it() -> None:
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    connector = trainer._logger_connector
    base = type(connector)
    mirror = _Mirror()
    stand_in = SimpleNamespace(is_global_zero=False, _logger_connector=connector)
    MetricsMirror.attach(mirror, stand_in)  # type: ignore[arg-type]
    connector._callback_metrics["loss"] = torch.tensor(1.0)
    assert float(trainer.callback_metrics["loss"]) == 1.0 and mirror.resolved == 1
    MetricsMirror.detach(stand_in)  # type: ignore[arg-type]
    assert type(connector) is base and float(trainer.callback_metrics["loss"]) == 1.0 and mirror.resolved == 1
    MetricsMirror.attach(mirror, SimpleNamespace(is_global_zero=True, _logger_connector=connector))  # type: ignore[arg-type]
    assert type(connector) is base  # rank 0 sends: nothing to apply


def test_schema_accepts_only_zero_dim_floating_point_tensors() -> None:
    assert metrics_schema({}) == ()
    assert metrics_schema({"a": torch.tensor(1.0), "b": torch.tensor(2.0, dtype=torch.float16)}) == (
        ("a", torch.float32),
        ("b", torch.float16),
    )
    assert metrics_schema({"a": torch.tensor([1.0])}) is None  # not 0-dim
    assert metrics_schema({"a": torch.tensor(1)}) is None  # integer
    assert metrics_schema({"a": 1.0}) is None  # not a tensor
