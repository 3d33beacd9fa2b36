"""probe_p2p: ping-pong latency/bandwidth on a real 2-process gloo group; both ranks get the same CommModel."""

from __future__ import annotations

import gc
import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import start_processes

from lightning_dynpipe.engine.probe import probe_p2p
from lightning_dynpipe.errors import ConfigurationError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _probe(group: object, rank: int, repeats: int) -> dict[str, object]:
    t0 = time.perf_counter()
    try:
        comm = probe_p2p(group, 1 - rank, initiator=rank == 0, repeats=repeats)
        result: dict[str, object] = {
            "latency_s": comm.latency_s,
            "bandwidth_Bps": comm.bandwidth_Bps,
            "overlap": comm.overlap,
            "cpu_s_per_byte": comm.cpu_s_per_byte,
        }
    except ConfigurationError as exc:
        result = {"error": str(exc)}
    result["elapsed_s"] = time.perf_counter() - t0
    return result


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)  # forked: the test process's OpenMP pool does not exist here (libgomp would hang)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        group = dist.new_group([0, 1])
        results = {
            "probe": _probe(group, rank, 10),
            # rank 1 asks for fewer round trips than rank 0: both must refuse, not hang
            "mismatch": _probe(group, rank, 10 if rank == 0 else 3),
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier(group)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, object]]]:
    """One 2-process gloo run shared by the tests below (starting processes is most of their cost)."""
    out = tmp_path_factory.mktemp("probe")
    gc.collect()  # a forked child must not inherit (and then free) an earlier test's process group
    start_processes(_worker, args=(_free_port(), str(out)), nprocs=2, join=True, start_method="fork")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.multiprocess
def test_probe_measures_and_both_ranks_agree(two_ranks: list[dict[str, dict[str, object]]]) -> None:
    r0, r1 = (r["probe"] for r in two_ranks)
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert r0["latency_s"] == r1["latency_s"] and r0["bandwidth_Bps"] == r1["bandwidth_Bps"]
    latency, bandwidth = float(r0["latency_s"]), float(r0["bandwidth_Bps"])  # type: ignore[arg-type]
    assert 0 < latency < 1.0 and 0 < bandwidth < float("inf")
    assert r0["overlap"] == 0.0  # measured later by the runtime, never assumed
    # gloo copies each message through the CPU: a send and a receive of a MiB cost some of it (a fraction of a ns a
    # byte here), the same on both ranks
    assert r0["cpu_s_per_byte"] == r1["cpu_s_per_byte"]
    assert 0.0 < float(r0["cpu_s_per_byte"]) < 1e-6, r0  # type: ignore[arg-type]
    # about 0.2 s here; the bound only catches a probe that waits on something (loaded CI machines)
    assert float(r0["elapsed_s"]) < 5.0, r0  # type: ignore[arg-type]


@pytest.mark.multiprocess
def test_mismatched_arguments_raise_on_both_ranks_instead_of_hanging(
    two_ranks: list[dict[str, dict[str, object]]],
) -> None:
    for r in two_ranks:
        assert "must be called with the same sizes and repeats on both ranks" in str(r["mismatch"].get("error")), r


def test_argument_errors_state_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    with pytest.raises(ConfigurationError, match="initialised process group"):
        probe_p2p(None, 1, initiator=True)
    dist.init_process_group("gloo", rank=0, world_size=1)
    group = dist.new_group([0])
    with pytest.raises(ConfigurationError, match="peer must be another rank"):
        probe_p2p(group, 0, initiator=True)
    with pytest.raises(ConfigurationError, match=r"this rank \(0\) and peer \(3\) in the group"):
        probe_p2p(group, 3, initiator=True)
    with pytest.raises(ConfigurationError, match="0 < small < large"):
        probe_p2p(group, 1, initiator=True, sizes=(1 << 20, 8))
    with pytest.raises(ConfigurationError, match="repeats must be an int >= 1"):
        probe_p2p(group, 1, initiator=True, repeats=0)
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"
