"""Pipeline schedules as pure data: instructions, per-stage generators and a dry-run simulator.

Nothing here imports torch or Lightning: the engine consumes these instructions, the planner and the
tests reason about them, and the simulator checks them for deadlocks and measures their bubbles.

Example::

    >>> from lightning_dynpipe.schedule import format_instructions, step_instructions, simulate
    >>> format_instructions(step_instructions("async", stage_idx=1, num_stages=2, num_microbatches=2, step=0))
    'RA0 F0 B0 SG0 U0 RA1 F1'
    >>> simulate("sync", num_stages=2, num_microbatches=4, num_steps=2).steady_state_step_time
    15.0
"""

from __future__ import annotations

from lightning_dynpipe.schedule.generators import (
    SCHEDULES,
    ScheduleKind,
    drain_instructions,
    in_flight_after,
    iter_steps,
    max_stash,
    staleness,
    step_instructions,
)
from lightning_dynpipe.schedule.instructions import (
    INSTRUCTION_TYPES,
    Backward,
    Forward,
    Instruction,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    StashWeights,
    format_instructions,
    parse_instruction,
    parse_instructions,
)
from lightning_dynpipe.schedule.kinds import ASYNC, GPIPE, SYNC, AsyncSchedule, Schedule, get_schedule
from lightning_dynpipe.schedule.simulator import (
    STEP_SYNCS,
    ScheduleDeadlockError,
    SimEvent,
    SimResult,
    StepSync,
    simulate,
    simulate_programs,
    validate_schedule,
)

__all__ = [
    # instructions
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
    # schedules
    "Schedule",
    "AsyncSchedule",
    "ASYNC",
    "SYNC",
    "GPIPE",
    "get_schedule",
    "ScheduleKind",
    "SCHEDULES",
    "step_instructions",
    "drain_instructions",
    "iter_steps",
    "in_flight_after",
    "staleness",
    "max_stash",
    # simulator
    "StepSync",
    "STEP_SYNCS",
    "ScheduleDeadlockError",
    "SimEvent",
    "SimResult",
    "simulate",
    "simulate_programs",
    "validate_schedule",
]
