"""The SIGTERM flag's broadcast one batch late, on two gloo processes (no Lightning loop: a stand-in trainer).

Lightning's own per-batch broadcast is a rendezvous at every batch's start; the lagged check must let a rank run a
batch ahead of rank 0 without waiting, and every rank must still stop at the same batch when rank 0 is told to.
"""

from __future__ import annotations

import inspect
import json
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch  # noqa: F401  (Lightning first: a spawned child imports this module cold)
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from two_gloo_ranks import join, run_two_ranks

from lightning_dynpipe.strategy.sigterm import (
    LaggedSigtermCheck,
    install_lagged_sigterm_check,
    quiet_sigterm_handler,
    remove_lagged_sigterm_check,
)

_SIGTERM_BEFORE = 3  # rank 0 receives SIGTERM before its batch 3 starts
_BATCHES = 8


def _worker(rank: int, port: int, store_port: int, out: str) -> None:
    store = join(rank, port, store_port)
    try:
        trainer = SimpleNamespace(received_sigterm=False)
        check = LaggedSigtermCheck(trainer, torch.device("cpu"))
        stopped_at = None
        for batch in range(_BATCHES):
            if rank == 0:
                # Up to the SIGTERM, rank 0 starts batch k only after rank 1 has passed its check of batch k. A
                # rendezvous per batch (Lightning's broadcast) would leave rank 1 waiting for rank 0 there, and the
                # store's wait would time out.
                if 0 < batch <= _SIGTERM_BEFORE:
                    store.wait([f"rank1-passed-{batch}"])
                trainer.received_sigterm = batch >= _SIGTERM_BEFORE
            try:
                check()
            except SIGTERMException:
                stopped_at = batch
                break
            if rank == 1:
                store.set(f"rank1-passed-{batch}", "1")
        Path(f"{out}.{rank}").write_text(json.dumps({"stopped_at": stopped_at, "started": check.started}))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_no_rank_waits_for_the_batch_it_starts_and_every_rank_stops_one_batch_after_rank_zero_is_told(
    tmp_path: Path,
) -> None:
    seen: list[dict[str, Any]] = run_two_ranks(_worker, tmp_path)
    # the flag of batch 3's broadcast is acted on at batch 4's start, by both ranks
    assert [s["stopped_at"] for s in seen] == [_SIGTERM_BEFORE + 1] * 2
    assert [s["started"] for s in seen] == [_SIGTERM_BEFORE + 2] * 2


def test_without_a_broadcast_started_nothing_is_waited_for() -> None:
    check = LaggedSigtermCheck(SimpleNamespace(received_sigterm=True), torch.device("cpu"))
    check.finish()  # nothing in flight: returns at once
    assert check.started == 0


def test_lightnings_epoch_loop_still_broadcasts_the_flag_through_the_method_replaced() -> None:
    # a Lightning that broadcasts the flag some other way would bring the per-batch rendezvous back unnoticed
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)


def test_the_check_replaces_the_fit_loops_method_and_removing_it_gives_the_method_back() -> None:
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    loop = trainer.fit_loop.epoch_loop
    check = install_lagged_sigterm_check(trainer, torch.device("cpu"))
    assert check is not None and loop._broadcast_sigterm_tensor is check
    remove_lagged_sigterm_check(trainer, check)
    assert "_broadcast_sigterm_tensor" not in vars(loop)
    assert loop._broadcast_sigterm_tensor.__func__ is type(loop)._broadcast_sigterm_tensor


def test_the_quiet_handler_sets_the_flag_as_lightnings_does_without_its_broadcast() -> None:
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    connector = trainer._signal_connector
    connector.register_signal_handlers()
    try:
        handlers = signal.getsignal(signal.SIGTERM).signal_handlers  # type: ignore[union-attr]
        assert any(getattr(h, "__func__", None) is type(connector)._sigterm_notifier_fn for h in handlers)
        assert quiet_sigterm_handler(trainer)
        assert not any(getattr(h, "__func__", None) is type(connector)._sigterm_notifier_fn for h in handlers)
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # type: ignore[operator]
        assert connector.received_sigterm
    finally:
        connector.teardown()
    assert not quiet_sigterm_handler(trainer)  # Lightning's handler is gone: nothing to replace
