"""The exit hook that destroys the default process group (gloo workers otherwise abort at interpreter exit)."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from lightning_dynpipe.engine import groups


def test_hook_is_registered_once(monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[Any] = []
    monkeypatch.setattr(groups, "_exit_hook_registered", False)
    monkeypatch.setattr(groups.atexit, "register", registered.append)
    groups.destroy_default_group_at_exit()
    groups.destroy_default_group_at_exit()
    assert registered == [groups._destroy_default_group]


def test_hook_destroys_an_initialised_default_group(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized(), "another test left a default process group behind"
    monkeypatch.setattr(groups, "_EXIT_QUIESCE_S", 0.0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.barrier()
        groups._destroy_default_group()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_hook_without_a_group_does_nothing() -> None:
    assert not dist.is_initialized()
    groups._destroy_default_group()  # must not raise
    assert not dist.is_initialized()
