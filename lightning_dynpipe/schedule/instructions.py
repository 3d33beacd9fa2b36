"""Pipeline instructions: the plain, immutable data a stage executor runs.

A schedule (:mod:`lightning_dynpipe.schedule.generators`) turns ``(kind, stage_idx, num_stages,
num_microbatches, step)`` into a tuple of instructions; the executor in ``engine/`` dispatches each one by
type. Every instruction has a short string form that :func:`parse_instruction` reads back, so schedules can
be written, logged, diffed and kept as golden strings in tests.

Legend (``j`` is the ``mb_idx``: the micro-batch index counted since the last drain, so step ``t`` of ``M``
micro-batches holds ``j = t*M .. t*M+M-1``)::

    F3    Forward(3)          forward micro-batch 3 through this stage's layers
    B3    Backward(3)         backward micro-batch 3 (with the weights its forward used)
    U3    OptimizerStep(3)    async: update the weights with the gradient of micro-batch 3
    U     OptimizerStep()     sync / gpipe: one update per step with the accumulated gradients
    W3    StashWeights(3)     bind micro-batch 3 to the stage's current weight version; the executor
                              snapshots the weights, and Backward(3) uses and then releases that version
    RA3   RecvActivation(3)   receive micro-batch 3's activation from stage k-1
    SA3   SendActivation(3)   send micro-batch 3's activation to stage k+1
    RG3   RecvGrad(3)         receive the gradient of micro-batch 3's activation from stage k+1
    SG3   SendGrad(3)         send the gradient of micro-batch 3's input to stage k-1

Timeline of the asynchronous (PipeDream 1F1B, no flush) schedule, ``num_stages=3``,
``num_microbatches=4``, forward = backward = 1 time unit, compute only (receives, sends, stashes and
zero-time updates left out). ``|`` marks where each stage starts step 1; the pipeline never flushes, and the
last stage ends a step after its last forward (that micro-batch's backward opens the next step)::

    time     0  1  2  3  4  5  6  7  8  9  10 11 12 13
    stage 0  F0 F1 F2 .  .  B0 F3 B1|F4 B2 F5 B3 F6 B4 ...
    stage 1  .  F0 F1 .  B0 F2 B1 F3 B2|F4 B3 F5 B4 F6 ...
    stage 2  .  .  F0 B0 F1 B1 F2 B2 F3|B3 F4 B4 F5 B5 ...

Stage ``k`` runs ``w = num_stages - 1 - k`` warm-up forwards, then alternates one forward and one
backward; micro-batch ``j``'s backward runs ``w`` updates after its forward (its *staleness*), and at
most ``num_stages - k`` micro-batches, so as many stashed weight versions, are in flight on stage ``k``.

Example::

    >>> parse_instruction("RG12")
    RecvGrad(mb_idx=12)
    >>> str(OptimizerStep(None)), str(OptimizerStep(3))
    ('U', 'U3')
    >>> format_instructions(parse_instructions("W0 F0 SA0"))
    'W0 F0 SA0'
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from lightning_dynpipe.errors import ScheduleError

__all__ = [
    "Forward",
    "Backward",
    "OptimizerStep",
    "StashWeights",
    "RecvActivation",
    "SendActivation",
    "RecvGrad",
    "SendGrad",
    "Instruction",
    "INSTRUCTION_TYPES",
    "parse_instruction",
    "parse_instructions",
    "format_instructions",
]


def _check_mb_idx(value: object, name: str, optional: bool = False) -> None:
    # bool is an int subclass; True as a micro-batch index is always a bug.
    if value is None and optional:
        return
    if type(value) is not int or value < 0:
        allowed = "a non-negative int or None" if optional else "a non-negative int"
        raise ScheduleError(
            f"{name}.mb_idx must be {allowed} (micro-batches are counted 0, 1, 2, ... since the last "
            f"drain); got {value!r}. Pass the micro-batch index, e.g. {name}(0)."
        )


class _InstructionBase:
    """Shared string form: the instruction's code followed by its micro-batch index."""

    __slots__ = ()
    code: ClassVar[str]
    optional_mb: ClassVar[bool] = False
    mb_idx: int | None

    def __post_init__(self) -> None:
        _check_mb_idx(self.mb_idx, type(self).__name__, optional=self.optional_mb)

    def __str__(self) -> str:
        return self.code if self.mb_idx is None else f"{self.code}{self.mb_idx}"


@dataclass(frozen=True, slots=True)
class Forward(_InstructionBase):
    """Forward micro-batch ``mb_idx`` through the stage's layers; string form ``"F3"``."""

    mb_idx: int
    code: ClassVar[str] = "F"


@dataclass(frozen=True, slots=True)
class Backward(_InstructionBase):
    """Backward micro-batch ``mb_idx`` with the weight version its forward used; ``"B3"``."""

    mb_idx: int
    code: ClassVar[str] = "B"


@dataclass(frozen=True, slots=True)
class OptimizerStep(_InstructionBase):
    """Update the stage's live weights; ``"U3"`` (async) or ``"U"`` (sync / gpipe).

    Attributes:
        mb_idx: async: the micro-batch whose gradient this update applies (one update per backward).
            ``None``: one update per step with the gradients accumulated over its micro-batches.
    """

    mb_idx: int | None = None
    code: ClassVar[str] = "U"
    optional_mb: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class StashWeights(_InstructionBase):
    """Bind micro-batch ``mb_idx`` to the stage's current weight version; ``"W3"``.

    The executor snapshots the weights (or shares the current version); the micro-batch's
    :class:`Backward` uses that version and releases it.
    """

    mb_idx: int
    code: ClassVar[str] = "W"


@dataclass(frozen=True, slots=True)
class RecvActivation(_InstructionBase):
    """Receive micro-batch ``mb_idx``'s activation from the previous stage; ``"RA3"``."""

    mb_idx: int
    code: ClassVar[str] = "RA"


@dataclass(frozen=True, slots=True)
class SendActivation(_InstructionBase):
    """Send micro-batch ``mb_idx``'s output activation to the next stage; ``"SA3"``."""

    mb_idx: int
    code: ClassVar[str] = "SA"


@dataclass(frozen=True, slots=True)
class RecvGrad(_InstructionBase):
    """Receive the gradient of micro-batch ``mb_idx``'s output from the next stage; ``"RG3"``."""

    mb_idx: int
    code: ClassVar[str] = "RG"


@dataclass(frozen=True, slots=True)
class SendGrad(_InstructionBase):
    """Send the gradient of micro-batch ``mb_idx``'s input to the previous stage; ``"SG3"``."""

    mb_idx: int
    code: ClassVar[str] = "SG"


Instruction = Forward | Backward | OptimizerStep | StashWeights | RecvActivation | SendActivation | RecvGrad | SendGrad
"""Any pipeline instruction; an executor dispatches on its type."""

INSTRUCTION_TYPES: tuple[type[Instruction], ...] = (
    Forward,
    Backward,
    OptimizerStep,
    StashWeights,
    RecvActivation,
    SendActivation,
    RecvGrad,
    SendGrad,
)
"""Every instruction type, in legend order."""

_BY_CODE: dict[str, type[Instruction]] = {cls.code: cls for cls in INSTRUCTION_TYPES}
# Canonical form only (no sign, no leading zeros), so that str(parse_instruction(s)) == s.
_PATTERN = re.compile(r"(RA|SA|RG|SG|F|B|U|W)(0|[1-9][0-9]*)?")


def parse_instruction(text: str) -> Instruction:
    """Reads an instruction back from its string form.

    Example::

        >>> parse_instruction("SA7")
        SendActivation(mb_idx=7)
        >>> parse_instruction("U")
        OptimizerStep(mb_idx=None)

    Args:
        text: the short form, e.g. ``"F3"``, ``"RG12"``, ``"U"``; surrounding whitespace is ignored.

    Returns:
        The instruction ``inst`` with ``str(inst) == text.strip()``.

    Raises:
        ScheduleError: ``text`` is not the short form of an instruction.
    """
    if not isinstance(text, str):
        raise ScheduleError(f"An instruction's string form must be a str; got {text!r}. Pass e.g. 'F3'.")
    match = _PATTERN.fullmatch(text.strip())
    if match is None:
        codes = ", ".join(sorted(_BY_CODE))
        raise ScheduleError(
            f"Cannot parse {text!r} as an instruction: the form is a code ({codes}) followed by a "
            "micro-batch index written without sign or leading zeros, e.g. 'F3', 'RG12', or a bare 'U' "
            "for a synchronous update."
        )
    code, digits = match.group(1), match.group(2)
    if digits is None:
        if code != "U":
            raise ScheduleError(
                f"Instruction {text!r} needs a micro-batch index: only the synchronous update 'U' has none. "
                f"Write e.g. '{code}0'."
            )
        return OptimizerStep(None)
    return _BY_CODE[code](int(digits))


def parse_instructions(text: str) -> tuple[Instruction, ...]:
    """Reads a whitespace-separated list of instructions, e.g. ``"RA0 F0 SA0"``."""
    return tuple(parse_instruction(part) for part in text.split())


def format_instructions(instructions: Iterable[Instruction]) -> str:
    """Writes instructions in their short form, separated by single spaces (inverse of parsing)."""
    return " ".join(str(inst) for inst in instructions)
