"""Two forked gloo processes for tests of the strategy's own collectives, with no Lightning loop.

A test's worker is ``worker(rank, port, store_port, out)``: it calls :func:`join` first, writes what it saw as JSON
to ``f"{out}.{rank}"`` and destroys the process group at the end; :func:`run_two_ranks` runs it and returns both
ranks' JSON.
"""

from __future__ import annotations

import gc
import json
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing import start_processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join(rank: int, port: int, store_port: int) -> dist.TCPStore:
    """Joins the two-rank gloo group; returns a store the ranks can order their steps by."""
    torch.set_num_threads(1)  # forked: the test process's OpenMP pool does not exist here (libgomp would hang)
    store = dist.TCPStore("127.0.0.1", store_port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    return store


def run_two_ranks(worker: Callable[[int, int, int, str], None], tmp_path: Path) -> list[Any]:
    """Runs ``worker`` on two forked processes; each rank's JSON, by rank."""
    out = str(tmp_path / "seen")
    gc.collect()  # a forked child must not inherit (and then free) an earlier test's process group
    start_processes(worker, args=(free_port(), free_port(), out), nprocs=2, join=True, start_method="fork")
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
