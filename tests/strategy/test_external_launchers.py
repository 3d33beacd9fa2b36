"""torchrun and multi-node launches: processes created outside Lightning are used, not re-spawned, and the
result equals the PipeDream replay."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pipeline_models import TinyNet, loader, make_optimizer

from lightning_dynpipe.calibration import replay_async

pytestmark = pytest.mark.multiprocess
SCRIPT = Path(__file__).parent / "scripts" / "external_launch.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _expected() -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(TinyNet())
    loss = lambda o, mb: F.cross_entropy(o, mb[1])  # noqa: E731
    replay_async(
        ref.pipeline, [2, 3], make_optimizer, list(loader()), 4, loss, lr_scale=1 / 4
    )  # DynPipe's default lr_scale='auto': 1/M per async update
    return ref.state_dict()


def _check(out: Path) -> None:
    got, want = torch.load(out), _expected()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "state.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={_port()}",
        str(SCRIPT),
        str(out),
    ]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(out)


def test_two_nodes_one_device_each(tmp_path: Path) -> None:
    """The pipeline's stage boundary crosses the (simulated) node boundary."""
    out = tmp_path / "state.pt"
    port = str(_port())
    procs = []
    for node in (1, 0):
        env = {
            **_env(),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "NODE_RANK": str(node),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), str(out), "--devices", "1", "--num-nodes", "2"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    _check(out)
