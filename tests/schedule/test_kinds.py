"""Schedule objects: each kind answers the questions the executor, the planner and the simulator ask."""

from __future__ import annotations

import doctest

import pytest

import lightning_dynpipe.schedule.kinds
from lightning_dynpipe.errors import ScheduleError
from lightning_dynpipe.schedule import ASYNC, GPIPE, SYNC, Schedule, get_schedule, simulate, validate_schedule


def test_docstring_examples() -> None:
    assert doctest.testmod(lightning_dynpipe.schedule.kinds).failed == 0


def test_names_resolve_to_the_three_instances() -> None:
    assert [get_schedule(n) for n in ("async", "sync", "gpipe")] == [ASYNC, SYNC, GPIPE]
    assert get_schedule(SYNC) is SYNC and str(GPIPE) == "gpipe"
    with pytest.raises(ScheduleError, match="Unknown schedule 'zb'. Valid schedules: 'async', 'sync', 'gpipe'"):
        get_schedule("zb")


@pytest.mark.parametrize(
    ("sched", "staleness", "versions", "in_flight", "accumulates"),
    [
        (ASYNC, [2, 1, 0], [3, 2, 1], [3, 2, 1], False),
        (SYNC, [0, 0, 0], [1, 1, 1], [3, 2, 1], True),
        (GPIPE, [0, 0, 0], [1, 1, 1], [8, 8, 8], True),
    ],
)
def test_rules(
    sched: Schedule, staleness: list[int], versions: list[int], in_flight: list[int], accumulates: bool
) -> None:
    assert [sched.staleness(k, 3) for k in range(3)] == staleness
    assert [sched.weight_versions(k, 3) for k in range(3)] == versions
    assert [sched.in_flight(k, 3, 8) for k in range(3)] == in_flight
    assert sched.accumulates is accumulates
    assert sched.updates_per_step(8) == (1 if accumulates else 8)
    assert sched.microbatches_per_update(8) == (8 if accumulates else 1)


def test_iteration_time_closed_forms() -> None:
    assert ASYNC.iteration_time([1.0, 3.0], 4) == 3.0
    assert SYNC.iteration_time([1.0, 3.0], 4) == GPIPE.iteration_time([1.0, 3.0], 4) == (3 * 3.0 + 4.0) / 4


def test_a_new_schedule_is_a_subclass_and_runs_in_the_simulator() -> None:
    """One forward-backward per micro-batch, stage by stage, no overlap: slow, but a valid flush schedule."""

    class Sequential(type(GPIPE)):  # type: ignore[misc]
        name = "sequential"

        def _step(self, k: int, S: int, M: int, t: int):  # type: ignore[no-untyped-def]
            out = []
            for j in range(t * M, t * M + M):
                out += [i for i in super()._step(k, S, M, t) if getattr(i, "mb_idx", None) == j]
            return (*out, *super()._step(k, S, M, t)[-1:])

    sched = Sequential()
    validate_schedule(sched, 3, 2)
    assert simulate(sched, 3, 2, 2).kind == "sequential"
