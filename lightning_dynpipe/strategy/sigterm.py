"""Lightning's per-batch SIGTERM broadcast, one batch late, so that no stage waits for another at a batch's start.

With more than one process, Lightning's training loop broadcasts global rank 0's SIGTERM flag at the start of every
training batch (``_TrainingEpochLoop._broadcast_sigterm_tensor``, Lightning 2.6). A broadcast is a rendezvous: every
rank waits until every other has reached it. In a pipeline the stages are never at the same point of the same
batch (that is what a pipeline is), so the broadcast makes the first stage wait for the last stage's end of the
previous batch and the last stage wait for the first stage's, every batch; on ``benchmarks/throughput.py``'s MLP it
and the metrics mirror's broadcast together cost the ``async`` schedule 5.5% of its throughput
(``benchmarks/results/2026-12-06-no-rendezvous.md``).

:class:`LaggedSigtermCheck` replaces it on the fit's epoch loop: at the start of batch ``k`` every rank starts the
broadcast of rank 0's flag without waiting for it (``async_op=True``), then waits for the broadcast it started at
batch ``k - 1``, which every rank has long reached, and acts on that flag as Lightning does (a barrier, then
:class:`~lightning.pytorch.utilities.exceptions.SIGTERMException`). Every rank acts on the same batch's flag at the
same batch, one batch later than under Lightning's own broadcast. (The rank that received the signal does not wait
for it: Lightning ends that rank's fit at the end of its batch, and the pipeline's failure path tells the others.)

Lightning's SIGTERM handler also broadcasts on the default group itself, from inside the handler, on whichever rank
received the signal: a collective issued at an arbitrary point of one rank's program, which Lightning's loop pairs
with its next per-batch broadcast. Without a blocking collective at every batch, that broadcast waits for a partner
that may never come (the rank that raised first is already on its way out), and the process hangs in the handler.
:func:`quiet_sigterm_handler` takes it out and leaves the rest of the handler (the flag, the launcher's children
signalled): a rank that received SIGTERM still ends at the end of its batch, as under Lightning, and the pipeline's
failure path tells the other stages.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

__all__ = [
    "LaggedSigtermCheck",
    "install_lagged_sigterm_check",
    "quiet_sigterm_handler",
    "remove_lagged_sigterm_check",
]

log = logging.getLogger(__name__)

_REPLACED = "_broadcast_sigterm_tensor"
"""The epoch loop's method that :class:`LaggedSigtermCheck` replaces on the loop object (Lightning 2.6)."""


class LaggedSigtermCheck:
    """A drop-in for the epoch loop's ``_broadcast_sigterm_tensor`` that waits for the previous batch's broadcast.

    Args:
        trainer: the Trainer whose ``received_sigterm`` rank 0 broadcasts.
        device: where the flag tensor lives (the strategy's root device).
    """

    def __init__(self, trainer: Any, device: torch.device) -> None:
        self.trainer = trainer
        self.device = device
        self._pending: tuple[Any, torch.Tensor] | None = None  # the last broadcast started, not yet waited for
        self.started = 0  # broadcasts started (tests read it)

    def __call__(self) -> None:
        """Starts this batch's broadcast; acts on the previous batch's flag.

        Raises:
            SIGTERMException: rank 0 had received SIGTERM when the previous batch started.
        """
        flag = torch.tensor([1 if getattr(self.trainer, "received_sigterm", False) else 0], device=self.device)
        previous, self._pending = self._pending, None
        try:
            self._pending = (dist.broadcast(flag, src=0, async_op=True), flag)
            self.started += 1
        except Exception as exc:  # as Lightning's: a broken group reads as "no SIGTERM"; the pipeline reports it
            log.debug("SIGTERM flag broadcast not started: %r", exc)
        if previous is None or not _completed(previous[0]):
            return
        if previous[1].item() == 1:
            with contextlib.suppress(Exception):
                dist.barrier()  # as Lightning does: every rank reaches this batch before any exits
            raise SIGTERMException()

    def finish(self, timeout_s: float = 30.0) -> None:
        """Waits for the broadcast still in flight (every rank started it: it completes unless a peer failed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            _completed(pending[0], timeout_s)


def _completed(work: Any, timeout_s: float | None = None) -> bool:
    """Waits for ``work``; ``False`` if it failed (a peer gone: the pipeline's own receives report that)."""
    try:
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        log.debug("SIGTERM flag broadcast failed: %r", exc)
        return False
    return True


def install_lagged_sigterm_check(trainer: Trainer, device: torch.device) -> LaggedSigtermCheck | None:
    """Puts a :class:`LaggedSigtermCheck` on ``trainer``'s fit epoch loop; ``None`` if that loop has no such method."""
    loop = trainer.fit_loop.epoch_loop
    if not callable(getattr(type(loop), _REPLACED, None)):
        return None
    check = LaggedSigtermCheck(trainer, device)
    setattr(loop, _REPLACED, check)
    return check


def remove_lagged_sigterm_check(trainer: Trainer | None, check: LaggedSigtermCheck | None) -> None:
    """Gives the epoch loop its own method back. A broadcast still in flight (a fit that failed: the end of a fit
    waits for it, :meth:`LaggedSigtermCheck.finish`) is dropped, not waited for."""
    if check is None:
        return
    check._pending = None
    if trainer is not None and trainer.fit_loop.epoch_loop.__dict__.get(_REPLACED) is check:
        delattr(trainer.fit_loop.epoch_loop, _REPLACED)


def quiet_sigterm_handler(trainer: Trainer) -> bool:
    """Replaces Lightning's SIGTERM notifier in the installed SIGTERM handler by one without its broadcast.

    Call it after Lightning has installed its handlers (the strategy's ``on_train_start``). Returns whether the
    notifier was found (Lightning 2.6 composes its handlers in ``_HandlersCompose.signal_handlers``).
    """
    connector = getattr(trainer, "_signal_connector", None)
    handlers = getattr(signal.getsignal(signal.SIGTERM), "signal_handlers", None)
    notifier = getattr(type(connector), "_sigterm_notifier_fn", None)
    if connector is None or notifier is None or not isinstance(handlers, list):
        return False
    for i, h in enumerate(handlers):
        if getattr(h, "__func__", None) is notifier and getattr(h, "__self__", None) is connector:
            handlers[i] = functools.partial(_notify_without_broadcast, connector)
            return True
    return False


def _notify_without_broadcast(connector: Any, signum: int, frame: FrameType | None) -> None:
    """Lightning's ``_sigterm_notifier_fn`` without the broadcast: logs, signals the launcher's children once, and
    sets the flag that ends this rank's fit at the end of its batch."""
    log.info("[rank: %s] Received SIGTERM: %s", connector.trainer.local_rank, signum)
    if not connector.received_sigterm:
        launcher = connector.trainer.strategy.launcher
        if launcher is not None:
            launcher.kill(signum)
    connector.received_sigterm = True
