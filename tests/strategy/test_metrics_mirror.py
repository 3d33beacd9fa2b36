"""The metrics mirror on two gloo processes: every rank ends each step with rank 0's metrics, values and dtypes.

While the names stay the same the values travel as one float64 tensor; a change of names, or a value that is
not a 0-dim floating-point tensor, sends the whole dict as an object again. The trainer is a stand-in with the
three attributes the mirror reads, so the test needs no Lightning loop.
"""

from __future__ import annotations

import gc
import json
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch  # noqa: F401  (Lightning first: a spawned child imports this module cold)
import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import start_processes

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)  # forked: the test process's OpenMP pool does not exist here (libgomp would hang)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mirror = MetricsMirror(torch.device("cpu"))
        store: dict[str, Any] = {}
        trainer = SimpleNamespace(
            world_size=2,
            is_global_zero=rank == 0,
            callback_metrics=store,
            _logger_connector=SimpleNamespace(_callback_metrics=store),
        )
        seen = []
        for metrics, _ in _STEPS:
            if rank == 0:
                store.clear()
                store.update(metrics)
            before = mirror.object_broadcasts
            mirror._mirror(trainer)  # type: ignore[arg-type]
            seen.append(
                {
                    "object": mirror.object_broadcasts > before,
                    "values": {
                        k: [float(v), str(v.dtype)] if isinstance(v, torch.Tensor) else v for k, v in store.items()
                    },
                }
            )
        Path(f"{out}.{rank}").write_text(json.dumps(seen), encoding="utf-8")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_every_rank_gets_rank_zeros_metrics_and_names_travel_only_when_they_change(tmp_path: Path) -> None:
    out = str(tmp_path / "seen")
    gc.collect()  # a forked child must not inherit (and then free) an earlier test's process group
    start_processes(_worker, args=(_free_port(), out), nprocs=2, join=True, start_method="fork")
    rank0 = json.loads(Path(f"{out}.0").read_text())
    rank1 = json.loads(Path(f"{out}.1").read_text())
    for step, ((metrics, expect_object), r0, r1) in enumerate(zip(_STEPS, rank0, rank1)):
        assert r0["object"] == r1["object"] == expect_object, f"step {step}: {r0['object']}, {r1['object']}"
        for k, v in metrics.items():
            want = [float(v), str(v.dtype)] if isinstance(v, torch.Tensor) else v
            assert r1["values"][k] == want, f"step {step}, {k}: {r1['values'][k]} != {want}"


def test_schema_accepts_only_zero_dim_floating_point_tensors() -> None:
    assert metrics_schema({}) == ()
    assert metrics_schema({"a": torch.tensor(1.0), "b": torch.tensor(2.0, dtype=torch.float16)}) == (
        ("a", torch.float32),
        ("b", torch.float16),
    )
    assert metrics_schema({"a": torch.tensor([1.0])}) is None  # not 0-dim
    assert metrics_schema({"a": torch.tensor(1)}) is None  # integer
    assert metrics_schema({"a": 1.0}) is None  # not a tensor
