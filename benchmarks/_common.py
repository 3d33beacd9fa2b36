"""Helpers shared by the benchmark scripts: machine and version records, robust statistics, tables.

Benchmarks on a shared or small machine are noisy, so every script here interleaves its systems, repeats
them, and reports medians, inter-quartile ranges and *paired* ratios (two systems measured back to back
in the same repeat), rather than means of a single pass.
"""

from __future__ import annotations

import os
import platform
import shlex
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = [
    "REPO_ROOT",
    "command_line",
    "describe_machine",
    "external_launch_env",
    "fit_dynpipe",
    "format_table",
    "free_port",
    "iqr",
    "machine_info",
    "median",
    "quartiles",
    "rotated",
]

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``init_process_group``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _package_version(name: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python < 3.8
        return None
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    import subprocess

    try:  # works in a git worktree too, where .git is a file that points to the real git directory
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    head = REPO_ROOT / ".git" / "HEAD"
    try:
        ref = head.read_text(encoding="utf-8").strip()
        if ref.startswith("ref: "):
            return (REPO_ROOT / ".git" / ref[5:]).read_text(encoding="utf-8").strip()
        return ref
    except OSError:
        return None


def _git_dirty() -> list[str] | None:
    """Tracked files with uncommitted changes (the numbers belong to the working tree, not only the commit)."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [line[3:] for line in out.splitlines() if line.strip()]


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge a number: CPU, cores, load, OS, Python, torch and Lightning versions."""
    import torch

    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on Linux/macOS
        load = None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        affinity = None
    return {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": affinity,
        "load_average_1_5_15": load,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_num_threads_default": torch.get_num_threads(),
        "lightning": _package_version("lightning"),
        "lightning_dynpipe": _package_version("lightning-dynpipe"),
        "git_commit": _git_commit(),
        "git_modified_files": _git_dirty(),
    }


def describe_machine(machine: dict[str, Any]) -> str:
    """Two lines for a benchmark's header: the CPU with its load, and the versions (from :func:`machine_info`)."""
    return (
        f"machine: {machine['cpu_model']}, {machine['logical_cpus']} logical CPUs, "
        f"load {machine['load_average_1_5_15']}\n"
        f"versions: torch {machine['torch']}, lightning {machine['lightning']}, python {machine['python']}"
    )


def command_line() -> str:
    """The command that reproduces this run, as typed in a shell from the repository root."""
    exe = sys.executable
    try:
        exe = os.path.relpath(exe, REPO_ROOT)
    except ValueError:  # pragma: no cover - different drive on Windows
        pass
    script = sys.argv[0]
    try:
        script = os.path.relpath(script, REPO_ROOT)
    except ValueError:  # pragma: no cover
        pass
    return shlex.join([exe, script, *sys.argv[1:]])


def median(values: Sequence[float]) -> float:
    """The median, NaN for no values."""
    return float(statistics.median(values)) if values else float("nan")


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """First and third quartile (inclusive method, so one or two values still give a range)."""
    if not values:
        return float("nan"), float("nan")
    if len(values) == 1:
        return float(values[0]), float(values[0])
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return float(q1), float(q3)


def iqr(values: Sequence[float]) -> float:
    """Inter-quartile range ``q3 - q1``."""
    q1, q3 = quartiles(values)
    return q3 - q1


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, markdown: bool = False) -> str:
    """A fixed-width text table (right-aligned except the first column), or a GitHub markdown table."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return ("| " + " | ".join(parts) + " |") if markdown else "  ".join(parts)

    out = [line(headers)]
    if markdown:
        out.append("|" + "|".join(("-" * (w + 1) + ":") if i else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|")
    else:
        out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    """Lays out a matplotlib figure, writes it to ``path`` (creating its folder) and closes it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


# ------------------------------------------------------------------------- running DynPipe inside workers
# A generalisation of what throughput.py's workers do for the MLP, for any model, strategy and batches. The
# timing callback and the CPU probe stay in throughput.py (``_step_timer``); callers pass the timer in.


def rotated(items: Sequence[Any], rep: int) -> list[Any]:
    """``items`` rotated left by ``rep``: interleaving that puts every item in every position over repeats."""
    shift = rep % len(items) if items else 0
    return list(items[shift:]) + list(items[:shift])


def workers_done() -> None:
    """Waits until every worker has finished its runs, then closes the default group, rank 0 last.

    Call it at the end of a worker's successful work (not on the error path: a peer that failed would never
    arrive), and :func:`close_group` in the worker's ``finally``. Rank 0 hosts the group's store: a rank still
    tearing its group down after rank 0 had exited ended with SIGABRT ("terminate called without an active
    exception") in about 1 of 8 ``intra_stage.py --quick`` runs (the throttled replica, slow to finish), and in none
    of 31 with the barrier alone; the barrier alone still let it through once in the test suite since. So after the
    barrier every other rank closes its group here and leaves a file saying so, and rank 0 waits for those files
    (up to 30 s) before it closes its own.

    Then the worker process ends here, without the interpreter's finalisation (``os._exit(0)`` after flushing its
    output): with every group closed, a worker still aborted at finalisation in about 1 of 7 runs of the
    ``intra_stage.py --quick`` smoke test (rank 1, 1 stage x 2 replicas; 0 of 12 runs of the script itself), a
    gloo thread outliving its group (docs/troubleshooting.md). Its results are written by then, and nothing of a
    worker runs after this call but the ``finally`` that closes its group, which is done.
    """
    import torch.distributed as dist

    dist.barrier()
    rank, world = dist.get_rank(), dist.get_world_size()
    tag = Path(tempfile.gettempdir()) / f"dynpipe-bench-{os.getppid()}-{os.environ.get('MASTER_PORT', 'port')}"
    markers = [Path(f"{tag}-closed-{r}") for r in range(1, world)]
    if rank != 0:
        dist.destroy_process_group()
        markers[rank - 1].touch()
        _end_worker()
    deadline = time.monotonic() + 30.0
    while not all(m.exists() for m in markers) and time.monotonic() < deadline:
        time.sleep(0.01)
    for m in markers:
        m.unlink(missing_ok=True)
    dist.destroy_process_group()
    _end_worker()


def _end_worker() -> None:
    """Ends this worker process now, its output flushed, skipping the interpreter's finalisation (see
    :func:`workers_done`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def close_group() -> None:
    """Closes the default group if it is still open: a worker's ``finally``, after :func:`workers_done` or a failure."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def external_launch_env(rank: int, world_size: int, port: int) -> None:
    """Environment under which Lightning treats a spawned worker as externally launched (single node).

    With these set, Lightning's ``LightningEnvironment`` reuses a process group the worker has already
    initialised on ``tcp://127.0.0.1:port`` instead of launching processes itself.
    """
    os.environ.update(
        {
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )


def fit_dynpipe(
    model: Any,
    batches: Sequence[Any],
    strategy: Any,
    timer: Any,
    *,
    world_size: int,
    callbacks: Sequence[Any] = (),
    val_batches: Sequence[Any] | None = None,
    val_every_n_steps: int | None = None,
) -> dict[str, Any]:
    """``Trainer.fit`` of ``model`` with ``strategy`` on pre-made ``batches``, timed by ``timer``; collective.

    Every DynPipe run of the benchmarks goes through here. The Trainer runs on CPU with ``devices=world_size``
    and no logger, checkpoints, progress bar, model summary or sanity check; the loader hands out the batches
    unchanged, and ``max_steps`` is ``len(batches)``. ``timer`` is the callback of
    ``throughput._step_timer(warmup, steps)``: it clocks the timed steps on each rank and keeps that stage's
    ``StepStats`` and CPU probe. ``callbacks`` are added after it (e.g. one that records what the strategy
    decided at set-up, which teardown clears). ``val_batches`` with ``val_every_n_steps``: Lightning's
    validation loop runs on those batches every that many training steps (default: no validation).

    Returns ``seconds`` (this rank's clock; global rank 0 hosts the last stage), ``stages`` (every stage's
    timing and StepStats, by stage), ``cpu`` (per stage), ``migrations`` (the live repartitions the run made:
    ``{"step", "old", "new"}`` each) and ``decisions`` (the adaptive loop's decision at every check, as logged).
    """
    import lightning.pytorch as pl
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    val: dict[str, Any] = {}
    if val_batches is not None:
        if val_every_n_steps is None or val_every_n_steps < 1:
            raise ValueError(f"val_batches needs val_every_n_steps >= 1; got {val_every_n_steps!r}.")
        val = {"val_check_interval": val_every_n_steps, "check_val_every_n_epoch": None}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=len(batches),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=[timer, *callbacks],
        **val,
    )
    val_loader: Any = DataLoader(list(val_batches), batch_size=None) if val_batches is not None else None  # type: ignore[arg-type]
    trainer.fit(
        model,
        train_dataloaders=DataLoader(list(batches), batch_size=None),  # type: ignore[arg-type]
        val_dataloaders=val_loader,
    )
    if not dist.is_initialized():
        raise RuntimeError(
            "The default process group was destroyed by trainer.fit; the benchmark relies on it surviving "
            "between runs (Lightning 2.6 leaves an externally initialised group alone)."
        )
    mine = {
        "rank": dist.get_rank(),
        "stage": timer.stage_idx,
        "wall_s": timer.end - timer.start,
        "steps": timer.stats,
        "cpu": timer.probe.result,
        "param_bytes": getattr(timer, "param_bytes", None),
        "predicted_versions": getattr(timer, "predicted_versions", None),
    }
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    stages = sorted(gathered, key=lambda g: g["stage"])
    cpu = [{"rank": g["rank"], "stage": g["stage"], "cpu": g.pop("cpu")} for g in stages]
    migrations = [
        {"step": m.step, "old": list(m.old.balance), "new": list(m.new.balance)}
        for m in getattr(strategy, "migrations", [])
    ]
    controller = getattr(strategy, "controller", None)
    decisions = [str(d) for d in controller.decisions] if controller is not None else []
    return {"seconds": mine["wall_s"], "stages": stages, "cpu": cpu, "migrations": migrations, "decisions": decisions}
