"""The hand-written asynchronous baseline trains exactly as PipeDream does.

Two gloo ranks run ``time_handwritten_async`` on the halves of a small MLP; the trained halves must equal the
single-process PipeDream replay (:func:`lightning_dynpipe.calibration.replay_async`, staleness ``S-1-k``, one
SGD update per micro-batch, each backward on the weights its forward saw) bit for bit: the throughput benchmark
compares DynPipe with a loop that does the same arithmetic, not a cheaper one.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.multiprocessing import start_processes

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:  # plain `pytest` (unlike `python -m pytest`) does not put the repo root on sys.path
    sys.path.insert(0, str(_ROOT))

from benchmarks._common import free_port  # noqa: E402
from benchmarks.baselines.handwritten import time_handwritten_async  # noqa: E402
from lightning_dynpipe.calibration import replay_async  # noqa: E402
from tests.benchmarks_baselines import halves  # noqa: E402

NUM_MICROBATCHES = 4
LR = 0.1


def _stages(model: torch.nn.Sequential, balance: list[int]) -> list[torch.nn.Sequential]:
    cuts = [sum(balance[:k]) for k in range(len(balance) + 1)]
    return [model[a:b] for a, b in zip(cuts, cuts[1:])]


class _Window:
    """Records the calls a CPU probe of the timed micro-batches gets."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self) -> None:
        self.calls.append("start")

    def stop(self) -> None:
        self.calls.append("stop")


def _worker(rank: int, balance: list[int], port: int, out_dir: str) -> None:
    S = len(balance)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=S)
    try:
        stage = _stages(halves.model(), balance)[rank]
        window = _Window()
        result = time_handwritten_async(
            stage, rank, S, NUM_MICROBATCHES, halves.batches(), lr=LR, warmup_steps=1, window=window
        )
        torch.save({"state": stage.state_dict(), "window": window.calls, **result}, f"{out_dir}/{rank}.pt")
        with pytest.raises(ValueError, match="divisible by num_microbatches"):
            time_handwritten_async(stage, rank, S, 4, [(torch.zeros(6, 20), torch.zeros(6))] * 2, lr=LR, warmup_steps=1)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.parametrize("balance", [[2, 2], [1, 2, 1]])
def test_handwritten_async_equals_the_pipedream_replay_bit_for_bit(tmp_path: Path, balance: list[int]) -> None:
    S = len(balance)
    gc.collect()  # a forked child must not inherit (and then free) an earlier test's process group
    start_processes(_worker, args=(balance, free_port(), str(tmp_path)), nprocs=S, join=True, start_method="fork")

    reference, untrained = halves.model(), halves.model()
    replay_async(
        reference,
        balance,
        lambda ps: torch.optim.SGD(ps, lr=LR),
        halves.batches(),
        NUM_MICROBATCHES,
        lambda out, mb: F.cross_entropy(out, mb[1]),
    )
    expected, before = _stages(reference, balance), _stages(untrained, balance)
    results = [torch.load(tmp_path / f"{rank}.pt") for rank in range(S)]
    for rank, result in enumerate(results):
        for name, want in expected[rank].state_dict().items():
            assert torch.equal(result["state"][name], want), f"stage {rank} {name}"
            assert not torch.equal(want, before[rank].state_dict()[name])  # training moved every weight
        assert result["micro_batches"] == 4 * NUM_MICROBATCHES  # the batches after the warm-up one
        assert result["window"] == ["start", "stop"]  # a probe of the timed micro-batches, told once each
        assert result["op_cpu_s"]["backward"] > 0 and result["op_wall_s"]["backward"] > 0
        assert result["seconds"] == results[0]["seconds"] > 0  # the longest rank's window, on every rank
    assert all(r["op_cpu_s"]["send"] > 0 for r in results)  # activations forward, gradients back
