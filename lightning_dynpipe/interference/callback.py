"""The Lightning side of interference injection: switch schedule entries on and off at step boundaries.

This is the only module of :mod:`lightning_dynpipe.interference` that imports Lightning.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_dynpipe.interference.base import Interference
from lightning_dynpipe.interference.schedule import InterferenceSchedule, InterferenceSpec, make_interference

__all__ = ["InterferenceCallback", "InterferenceEvent"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InterferenceEvent:
    """One start or stop on this rank, for logs and plots (``time`` is ``time.time()``).

    ``step`` is ``None`` for a stop at the end of training or on a failure.
    """

    action: Literal["start", "stop"]
    index: int
    spec: InterferenceSpec
    step: int | None
    stage_idx: int
    time: float
    detail: str = ""


def _stage_of(strategy: Any) -> tuple[int, int]:
    """``(stage_idx, num_stages)`` of this rank; a strategy without stages is one stage."""
    if hasattr(strategy, "stage_idx") and hasattr(strategy, "num_stages"):
        return int(strategy.stage_idx), int(strategy.num_stages)
    return 0, 1


class InterferenceCallback(Callback):
    """Starts and stops interference by training step, on the ranks hosting each entry's stage.

    Example::

        from lightning_dynpipe.interference import InterferenceCallback

        trainer = Trainer(
            strategy=DynPipeStrategy(num_stages=2), devices=2,
            callbacks=[InterferenceCallback([
                {"kind": "cpu_hog", "stage": 0, "start_step": 100},
                {"kind": "link_delay", "stage": 0, "start_step": 50, "stop_step": 80, "delay_s": 0.005},
            ])],
        )

    Before each training batch (``on_train_batch_start``) every rank compares ``trainer.global_step`` with the
    schedule and starts the entries that should be on for its stage (``trainer.strategy.stage_idx``; every
    data-parallel replica of the stage) and stops those that should not. Everything it started is stopped in
    ``on_fit_end``, ``teardown`` and ``on_exception``, so a failed run leaves no hog, quota or delay behind.
    Each start and stop is logged with step and stage and recorded in :attr:`events`.

    Args:
        schedule: an :class:`InterferenceSchedule`, a list of entries (dicts or specs), or a YAML path.
        factory: builds the source for an entry on this rank; :func:`make_interference` by default.
    """

    def __init__(
        self,
        schedule: InterferenceSchedule | Sequence[Mapping[str, Any] | InterferenceSpec] | str | os.PathLike[str],
        factory: Callable[[InterferenceSpec, Any], Interference] = make_interference,
    ) -> None:
        self.schedule = InterferenceSchedule.from_config(schedule)
        self.factory = factory
        self.events: list[InterferenceEvent] = []
        self._active: dict[int, Interference] = {}
        self._validated = False

    @property
    def active(self) -> dict[int, Interference]:
        """The running sources on this rank, by schedule index."""
        return dict(self._active)

    def __getstate__(self) -> dict[str, Any]:
        # Running sources hold processes and threads; a pickled copy (spawn launchers) starts with none.
        state = dict(self.__dict__)
        state["_active"] = {}
        return state

    # ------------------------------------------------------------------ hooks
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._validate(trainer.strategy)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.update(trainer.strategy, trainer.global_step)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.stop_all("end of training")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.stop_all("teardown")

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.stop_all(f"training failed ({type(exception).__name__})")

    # ------------------------------------------------------------------ logic
    def _validate(self, strategy: Any) -> None:
        if not self._validated:
            self.schedule.validate(_stage_of(strategy)[1])
            self._validated = True

    def update(self, strategy: Any, step: int) -> None:
        """Starts and stops entries so that exactly those wanted at ``step`` on this rank's stage run.

        Stops come before starts, so an entry ending at the step where another begins never overlaps it.
        """
        self._validate(strategy)
        stage_idx, _ = _stage_of(strategy)
        wanted = set(self.schedule.wanted(step, stage_idx))
        for i in sorted(set(self._active) - wanted):
            self._stop(i, step, stage_idx, f"step {step}")
        for i in sorted(wanted - set(self._active)):
            spec = self.schedule[i]
            source = self.factory(spec, strategy)
            self._active[i] = source  # before start(): a partial start is still stopped on failure
            source.start()
            detail = str(getattr(source, "backend", None) or "")
            log.info(
                "Interference on at step %d, stage %d (rank %s): %s%s",
                step,
                stage_idx,
                getattr(strategy, "global_rank", 0),
                spec,
                f" [{detail}]" if detail else "",
            )
            self.events.append(InterferenceEvent("start", i, spec, step, stage_idx, time.time(), detail))

    def _stop(self, i: int, step: int | None, stage_idx: int, why: str) -> None:
        source = self._active.pop(i)
        try:
            source.stop()
        finally:
            spec = self.schedule[i]
            log.info("Interference off at %s, stage %d: %s", why, stage_idx, spec)
            self.events.append(InterferenceEvent("stop", i, spec, step, stage_idx, time.time()))

    def stop_all(self, why: str = "stop_all") -> None:
        """Stops every source this callback started on this rank; errors are logged, never raised."""
        for i in sorted(self._active):
            try:
                self._stop(i, None, self.schedule[i].stage, why)
            except Exception:
                log.exception("Interference entry %d (%s) failed to stop cleanly.", i, self.schedule[i])
