"""End to end on a real 2-stage DynPipe run (popen launcher, gloo): the schedule's sources start on the right
ranks at the right steps, and nothing is left behind, also when a stage fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.interference.helpers import gone

SCRIPT = Path(__file__).parent / "scripts" / "interfered_fit.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["fail"])  # "ok" also works; the failing run checks the same and the clean-up
def test_schedule_on_a_two_stage_run(mode: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), mode, str(tmp_path)], env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == (0 if mode == "ok" else 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    if mode == "fail":
        assert "training failed on purpose" in proc.stderr
    ranks = {r["stage"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob("rank*.json"))}
    assert sorted(ranks) == [0, 1]
    last = 5 if mode == "ok" else 4
    # link_delay on boundary 0: stage 0 delays its activations, stage 1 its gradients, for steps 1 and 2.
    for stage, name in ((0, "activations 0->1"), (1, "gradients 1->0")):
        delayed = [s["step"] for s in ranks[stage]["steps"] if s["delays"] == [name]]
        assert delayed == [1, 2]
    # stage 1 (the cpu_quota, from step 2) and stage 0 (the cpu_hog, from step 3) stop everything at the end.
    assert [e[:3] for e in ranks[1]["events"]] == [
        ["start", "link_delay", 1],
        ["start", "cpu_quota", 2],
        ["stop", "link_delay", 3],
        ["stop", "cpu_quota", None],
    ]
    assert ranks[1]["events"][1][3] in ("cgroup v1", "cgroup v2", "throttle")
    if ranks[1]["events"][1][3].startswith("cgroup"):  # the quota holds stage 1's process (rank 0) from step 2 on
        assert ["dynpipe-quota" in s["cgroup"] for s in ranks[1]["steps"]] == [
            s["step"] >= 2 for s in ranks[1]["steps"]
        ]
    # and not stage 0's, which the popen launcher started from rank 0's process: a child, not one of its helpers
    assert not any("dynpipe-quota" in s["cgroup"] for s in ranks[0]["steps"])
    assert [e[:3] for e in ranks[0]["events"]] == [
        ["start", "link_delay", 1],
        ["stop", "link_delay", 3],
        ["start", "cpu_hog", 3],
        ["stop", "cpu_hog", None],
    ]
    hog_steps = [s["step"] for s in ranks[0]["steps"] if s["children"]]
    assert hog_steps == list(range(3, last + 1))
    helpers = {pid for r in ranks.values() for s in r["steps"] for pid in s["children"]} - {ranks[0]["pid"]}
    assert helpers and all(gone(pid) for pid in helpers)
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")):
        if root.is_dir():
            assert not list(root.glob(f"dynpipe-quota-{ranks[1]['pid']}-*"))
