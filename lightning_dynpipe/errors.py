"""Exception hierarchy of lightning-dynpipe.

Every user-facing error states the rule that was broken, the offending values, and how to fix it.
Configuration problems derive from :class:`ValueError`; failures at run time derive from :class:`RuntimeError`.
"""

from __future__ import annotations

__all__ = [
    "DynPipeError",
    "ConfigurationError",
    "PartitionError",
    "ScheduleError",
    "CommunicationError",
    "PipelineTimeoutError",
    "PeerFailure",
]


class DynPipeError(Exception):
    """Base class of every exception raised by lightning-dynpipe."""


class ConfigurationError(DynPipeError, ValueError):
    """An argument, model or Trainer setting that the pipeline strategy cannot run with."""


class PartitionError(ConfigurationError):
    """A partition (layers per stage) that does not fit the model or the number of stages."""


class ScheduleError(DynPipeError, ValueError):
    """A pipeline schedule that is unknown, inconsistent, or would deadlock."""


class CommunicationError(DynPipeError, RuntimeError):
    """A point-to-point transfer between stages failed or carried something unexpected."""


class PipelineTimeoutError(CommunicationError, TimeoutError):
    """A stage waited longer than the strategy's ``timeout`` for a peer stage."""


class PeerFailure(CommunicationError):
    """Another stage failed (an exception in its code, or its process died); raised on the stages that wait.

    Attributes:
        stage_idx: the stage that failed first.
        rank: its global rank.
    """

    def __init__(self, message: str, stage_idx: int, rank: int) -> None:
        super().__init__(message)
        self.stage_idx = stage_idx
        self.rank = rank
