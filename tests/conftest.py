"""Fixtures shared by the whole suite (after Lightning's own tests/tests_pytorch/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import lightning.pytorch  # noqa: F401  (importing it sets environment variables: do it before any test looks)
import pytest
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[1]
# Rank variables inherited from a surrounding launch would make a script's Lightning join the wrong job.
_LAUNCH_ENV = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")

_ENV_ALLOWED_TO_CHANGE = {
    "LOCAL_RANK",
    "MASTER_PORT",
    "WORLD_SIZE",
    "PL_GLOBAL_SEED",
    "OMP_NUM_THREADS",
    "PL_SEED_WORKERS",
    "MASTER_ADDR",
    "NODE_RANK",
    "RANK",
    "CUDA_MODULE_LOADING",
    # set by importing scikit-learn (OpenMP), not by the code under test
    "KMP_DUPLICATE_LIB_OK",
    "KMP_INIT_AT_FORK",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks as ``slow`` every test that starts processes and every benchmark smoke test (``make test-fast``
    runs the rest)."""
    for item in items:
        path = Path(str(item.fspath))
        benchmark = path.parent.name.startswith("benchmarks") or path.stem.endswith("_smoke")
        if benchmark or item.get_closest_marker("multiprocess") is not None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def teardown_process_group() -> Iterator[None]:
    """A test must not leave a process group behind."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def restore_env_variables() -> Iterator[None]:
    """A test must not leak environment variables (Lightning's launchers set some on purpose)."""
    before = dict(os.environ)
    yield
    leaked = {k for k in os.environ if k not in before} - _ENV_ALLOWED_TO_CHANGE
    for k in list(os.environ):
        if k not in before:
            del os.environ[k]
    os.environ.update(before)
    assert not leaked, f"test leaked environment variables {sorted(leaked)}"


@pytest.fixture
def run_benchmark() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Runs ``benchmarks/<script> <args>`` in a subprocess as a user would, from the repository root, with a
    clean launch environment; fails the test with the output's tails unless the script exits with 0."""

    def run(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
        proc = subprocess.run(
            [sys.executable, str(REPO_ROOT / "benchmarks" / script), *args],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
        return proc

    return run


@pytest.fixture
def run_benchmark_main(capfd: pytest.CaptureFixture[str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Runs ``benchmarks/<script>``'s ``main(argv)`` in this process, with ``sys.argv`` as a user's shell would
    set it, and returns what it printed as a completed process (exit status 0 or the test fails).

    The script's own start-up (torch and Lightning imports, 5-9 s on the CI machine) is the largest part of a
    quick benchmark run; in this process it is already paid. Spawned workers are launched as in a user's run.
    What ``main`` changes in this process (torch's thread count and global RNG, warning filters, logger levels,
    ``sys.argv``) is restored afterwards. Output is captured at the file-descriptor level, so what the script's
    own subprocesses and workers print is in it too, as in a shell. ``run_benchmark`` (a subprocess) stays the
    way to test a script's ``__main__`` block and exit-time behaviour."""

    def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
        import importlib
        import logging
        import warnings

        import torch

        module = importlib.import_module(f"benchmarks.{Path(script).stem}")
        capfd.readouterr()  # drop what the test printed before
        threads, rng = torch.get_num_threads(), torch.get_rng_state()
        levels = {name: logging.getLogger(name).level for name in logging.root.manager.loggerDict}
        argv = sys.argv
        sys.argv = [str(Path("benchmarks") / script), *args]
        try:
            with warnings.catch_warnings():
                result = module.main(list(args))
        finally:
            sys.argv = argv
            torch.set_num_threads(threads)
            torch.set_rng_state(rng)
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
        out, err = capfd.readouterr()
        code = result if isinstance(result, int) else 0
        assert code == 0, f"exit status {code}\nstdout:\n{out[-4000:]}\nstderr:\n{err[-4000:]}"
        return subprocess.CompletedProcess([script, *args], code, out, err)

    return run


def table_rows(out: str, header: tuple[str, ...], count: int) -> list[str]:
    """The ``count`` rows under the first table of ``out`` whose header line holds every column of ``header``
    (the rows start two lines below the header, after the rule); fails with the output when there is none."""
    lines = out.splitlines()
    starts = [i for i, line in enumerate(lines) if all(h in line for h in header)]
    assert starts, f"no table with columns {header} in the output:\n{out}"
    return lines[starts[0] + 2 : starts[0] + 2 + count]


@pytest.fixture(name="table_rows")
def table_rows_fixture() -> Callable[[str, tuple[str, ...], int], list[str]]:
    """:func:`table_rows`, for the benchmark smoke tests."""
    return table_rows
