"""The torch.distributed.pipelining baseline trains exactly like full-batch SGD on one process.

Two gloo ranks run ``time_torch_schedule`` for 1F1B and for GPipe on the two halves of a small MLP; the
trained halves must equal a single-process reference that takes the same SGD steps on the full batches.
Both schedules accumulate the micro-batch gradients and, with ``scale_grads=True``, divide them by the
number of micro-batches, so the only difference is float reassociation (measured about 1e-7 here); the
tolerance is ``atol=1e-5, rtol=0``.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.multiprocessing import start_processes

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:  # plain `pytest` (unlike `python -m pytest`) does not put the repo root on sys.path
    sys.path.insert(0, str(_ROOT))

from benchmarks._common import free_port  # noqa: E402
from benchmarks.baselines.torch_pipelining import time_torch_schedule  # noqa: E402
from tests.benchmarks_baselines import halves  # noqa: E402

NUM_STAGES = 2
NUM_MICROBATCHES = 4
LR = 0.1
KINDS = ("1f1b", "gpipe")
ATOL = 1e-5


def _split(model: nn.Sequential) -> list[nn.Module]:
    return [model[:2], model[2:]]


def _reference(batches: list[tuple[Tensor, Tensor]]) -> nn.Sequential:
    model = halves.model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=NUM_STAGES)
    try:
        batches = halves.batches()
        for kind in KINDS:
            stage = _split(halves.model())[rank]
            losses: list[float] = []
            seconds = time_torch_schedule(
                kind,  # type: ignore[arg-type]
                stage,
                rank,
                NUM_STAGES,
                NUM_MICROBATCHES,
                batches,
                lr=LR,
                warmup_steps=1,
                losses=losses,
            )
            result = {"state": stage.state_dict(), "seconds": seconds, "losses": losses}
            torch.save(result, f"{out_dir}/{kind}_{rank}.pt")
        # A ragged last batch is refused before any communication, on every rank.
        ragged = batches[:2] + [(batches[2][0][:10], batches[2][1][:10])]
        with pytest.raises(ValueError, match="divisible by num_microbatches"):
            time_torch_schedule("1f1b", _split(halves.model())[rank], rank, NUM_STAGES, NUM_MICROBATCHES, ragged, lr=LR)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_pipelined_sgd_equals_full_batch_sgd(tmp_path: Path) -> None:
    gc.collect()  # a forked child must not inherit (and then free) an earlier test's process group
    start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=NUM_STAGES, join=True, start_method="fork")

    batches = halves.batches()
    reference = _split(_reference(batches))
    untrained = _split(halves.model())
    for kind in KINDS:
        for rank in range(NUM_STAGES):
            result = torch.load(tmp_path / f"{kind}_{rank}.pt")
            assert result["seconds"] > 0
            state = result["state"]
            for name, expected in reference[rank].state_dict().items():
                torch.testing.assert_close(state[name], expected, rtol=0, atol=ATOL, msg=f"{kind} stage {rank} {name}")
                # The comparison means something only if training moved the weights by much more than ATOL.
                assert (expected - untrained[rank].state_dict()[name]).abs().max() > 100 * ATOL
        losses = torch.load(tmp_path / f"{kind}_{NUM_STAGES - 1}.pt")["losses"]
        assert len(losses) == len(batches)
        assert torch.load(tmp_path / f"{kind}_0.pt")["losses"] == []


def test_unknown_kind_lists_the_options() -> None:
    with pytest.raises(ValueError, match=r"valid options are \['1f1b', 'gpipe'\]"):
        time_torch_schedule("zb", nn.Linear(2, 2), 0, 1, 1, halves.batches(2), lr=0.1)  # type: ignore[arg-type]


def test_needs_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        time_torch_schedule("gpipe", nn.Linear(2, 2), 0, 1, 1, halves.batches(2), lr=0.1)
