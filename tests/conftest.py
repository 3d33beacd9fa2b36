"""Fixtures shared by the whole suite (after Lightning's own tests/tests_pytorch/conftest.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

_ENV_ALLOWED_TO_CHANGE = {"LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "PL_GLOBAL_SEED", "OMP_NUM_THREADS",
                          "PL_SEED_WORKERS", "MASTER_ADDR", "NODE_RANK", "RANK", "CUDA_MODULE_LOADING",
                          # set by importing scikit-learn (OpenMP), not by the code under test
                          "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"}


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
