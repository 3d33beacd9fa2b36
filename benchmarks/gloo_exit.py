"""Why DynPipe destroys the default process group at exit: gloo workers that exit with it alive can abort.

Each trial spawns two processes (``torch.multiprocessing``, start method ``spawn``) that import
``lightning_dynpipe``, join a gloo group on 127.0.0.1, run 20 rounds of an asynchronous ``all_gather`` +
``barrier`` (what the stage monitor and Lightning do in a fit) and return. The arms rotate trial by trial:

* ``no hook``: the process exits with the group still initialised, as Lightning leaves gloo groups;
* ``hook``: :func:`lightning_dynpipe.engine.groups.destroy_default_group_at_exit` was called after
  ``init_process_group``, as :class:`~lightning_dynpipe.DynPipeStrategy` does in ``setup_distributed``;
* ``hook, group referenced``: the same, but a module-level variable still refers to the default group, so
  ``destroy_process_group()`` cannot free it and its gloo worker threads live on into interpreter exit (any
  module imported after ``init_process_group`` whose functions take ``group=dist.group.WORLD`` as a default
  does this, e.g. ``torch.distributed.pipelining``). Only the hook's short GIL-releasing pause protects it.

A trial fails when either process does not exit with status 0 (the failure seen is SIGABRT, printed as
"terminate called without an active exception"). The script prints the failure counts per arm and writes
the record (JSON, with machine and versions) to ``benchmarks/out/``.

Usage (from the repository root)::

    .venv/bin/python benchmarks/gloo_exit.py              # 30 trials per arm (about 10 minutes on 2 cores)
    .venv/bin/python benchmarks/gloo_exit.py --trials 5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `benchmarks` and the package importable
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks._common import REPO_ROOT, command_line, format_table, free_port, machine_info, rotated  # noqa: E402

ARMS = ("no hook", "hook", "hook, group referenced")
_KEPT: list[object] = []


def _worker(rank: int, port: int, arm: str) -> None:
    from lightning_dynpipe.engine.groups import destroy_default_group_at_exit

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if arm != "no hook":
        destroy_default_group_at_exit()
    if arm == "hook, group referenced":
        _KEPT.append(dist.group.WORLD)
    for _ in range(20):
        parts = [torch.empty(8) for _ in range(2)]
        dist.all_gather(parts, torch.full((8,), float(rank)), async_op=True).wait()
        dist.barrier()


def trial(arm: str) -> bool:
    """True when both processes of one spawned pair exited with status 0."""
    try:
        mp.start_processes(_worker, args=(free_port(), arm), nprocs=2, start_method="spawn")
    except mp.ProcessExitedException:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=30, help="spawned pairs per arm (default 30)")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=REPO_ROOT / "benchmarks" / "out",
        help="where the JSON record goes (default benchmarks/out/)",
    )
    args = parser.parse_args()

    failures = {arm: 0 for arm in ARMS}
    t0 = time.perf_counter()
    for i in range(args.trials):
        for arm in rotated(ARMS, i):
            if not trial(arm):
                failures[arm] += 1
    wall = time.perf_counter() - t0
    rows = [[arm, str(args.trials), str(failures[arm]), f"{100 * failures[arm] / args.trials:.0f}%"] for arm in ARMS]
    print(format_table(["arm", "trials", "aborted", "share"], rows))
    print(f"({wall:.0f} s)")
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    record = {
        "benchmark": "gloo_exit",
        "trials": args.trials,
        "failures": failures,
        "wall_s": wall,
        "machine": machine_info(),
        "command": command_line(),
    }
    path = out / f"gloo_exit-{stamp}.json"
    path.write_text(json.dumps(record, indent=2))
    print(f"record: {path}")


if __name__ == "__main__":
    main()
