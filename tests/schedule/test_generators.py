"""Schedule generators: golden instruction strings (worked out by hand from the spec), invariants, errors."""

from __future__ import annotations

import ast
import sys
from itertools import islice
from pathlib import Path

import pytest

import lightning_dynpipe.schedule as schedule_pkg
from lightning_dynpipe.errors import ScheduleError
from lightning_dynpipe.schedule import (
    SCHEDULES,
    Backward,
    Forward,
    OptimizerStep,
    StashWeights,
    drain_instructions,
    format_instructions,
    in_flight_after,
    iter_steps,
    max_stash,
    staleness,
    step_instructions,
)


def steps(kind: str, k: int, S: int, M: int, t: int) -> str:
    return format_instructions(step_instructions(kind, k, S, M, t))  # type: ignore[arg-type]


def drain(kind: str, k: int, S: int, M: int, T: int) -> str:
    return format_instructions(drain_instructions(kind, k, S, M, T))  # type: ignore[arg-type]


# Golden strings, derived by hand from the rules in generators.py's docstring (w = S - 1 - k):
# async: for j in the step: [RA j] [W j] F j [SA j], then if j >= w: [RG j-w] B j-w [SG j-w] U j-w; the last
# stage of a multi-stage pipeline runs the same F j B j sequence cut after a forward: [B (t*M-1)] then the
# step's forwards, each followed by its backward except the last one, which opens the next step.
ASYNC_GOLDEN = [
    # S=2, M=4, stage 0 (w=1): no RA/SG on stage 0, one warm-up forward.
    (0, 2, 4, 0, "W0 F0 SA0 W1 F1 SA1 RG0 B0 U0 W2 F2 SA2 RG1 B1 U1 W3 F3 SA3 RG2 B2 U2"),
    (0, 2, 4, 1, "W4 F4 SA4 RG3 B3 U3 W5 F5 SA5 RG4 B4 U4 W6 F6 SA6 RG5 B5 U5 W7 F7 SA7 RG6 B6 U6"),
    # S=2, M=4, last stage (w=0): no W, no SA/RG; all of the batch forwarded in the step, its last backward
    # carried into the next step.
    (1, 2, 4, 0, "RA0 F0 B0 SG0 U0 RA1 F1 B1 SG1 U1 RA2 F2 B2 SG2 U2 RA3 F3"),
    (1, 2, 4, 1, "B3 SG3 U3 RA4 F4 B4 SG4 U4 RA5 F5 B5 SG5 U5 RA6 F6 B6 SG6 U6 RA7 F7"),
    (2, 3, 1, 1, "B0 SG0 U0 RA1 F1"),
    # S=3, M=2, middle stage (w=1): every kind of instruction.
    (1, 3, 2, 0, "RA0 W0 F0 SA0 RA1 W1 F1 SA1 RG0 B0 SG0 U0"),
    (1, 3, 2, 1, "RA2 W2 F2 SA2 RG1 B1 SG1 U1 RA3 W3 F3 SA3 RG2 B2 SG2 U2"),
    # S=4, M=2, stage 0 (w=3): step 0 is all warm-up; step 1 starts the 1F1B pairs.
    (0, 4, 2, 0, "W0 F0 SA0 W1 F1 SA1"),
    (0, 4, 2, 1, "W2 F2 SA2 W3 F3 SA3 RG0 B0 U0"),
    # S=1: no communication, no stash, an update after every backward.
    (0, 1, 3, 0, "F0 B0 U0 F1 B1 U1 F2 B2 U2"),
]

ASYNC_DRAIN_GOLDEN = [
    (0, 2, 4, 2, "RG7 B7 U7"),
    (1, 2, 4, 2, "B7 SG7 U7"),
    (2, 3, 2, 2, "B3 SG3 U3"),
    (1, 3, 2, 2, "RG3 B3 SG3 U3"),
    (0, 4, 2, 1, "RG0 B0 U0 RG1 B1 U1"),  # fewer micro-batches (2) than the warm-up (3)
    (0, 4, 2, 2, "RG1 B1 U1 RG2 B2 U2 RG3 B3 U3"),
    (0, 4, 2, 0, ""),
]

# sync: min(w, M) warm-up forwards, then F/B in turn, then the remaining backwards, then one U.
SYNC_GOLDEN = [
    (0, 2, 4, 0, "F0 SA0 F1 SA1 RG0 B0 F2 SA2 RG1 B1 F3 SA3 RG2 B2 RG3 B3 U"),
    (0, 2, 4, 1, "F4 SA4 F5 SA5 RG4 B4 F6 SA6 RG5 B5 F7 SA7 RG6 B6 RG7 B7 U"),
    (1, 2, 4, 0, "RA0 F0 B0 SG0 RA1 F1 B1 SG1 RA2 F2 B2 SG2 RA3 F3 B3 SG3 U"),
    (0, 4, 2, 0, "F0 SA0 F1 SA1 RG0 B0 RG1 B1 U"),  # warm-up capped at M = 2
    (1, 4, 2, 0, "RA0 F0 SA0 RA1 F1 SA1 RG0 B0 SG0 RG1 B1 SG1 U"),
    (2, 4, 2, 0, "RA0 F0 SA0 RA1 F1 SA1 RG0 B0 SG0 RG1 B1 SG1 U"),
    (0, 1, 2, 0, "F0 B0 F1 B1 U"),
]

# gpipe: all forwards, then all backwards in ascending order, then one U.
GPIPE_GOLDEN = [
    (1, 3, 3, 1, "RA3 F3 SA3 RA4 F4 SA4 RA5 F5 SA5 RG3 B3 SG3 RG4 B4 SG4 RG5 B5 SG5 U"),
    (0, 2, 2, 0, "F0 SA0 F1 SA1 RG0 B0 RG1 B1 U"),
    (1, 2, 2, 0, "RA0 F0 RA1 F1 B0 SG0 B1 SG1 U"),
]


@pytest.mark.parametrize("k,S,M,t,expected", ASYNC_GOLDEN)
def test_async_golden(k: int, S: int, M: int, t: int, expected: str) -> None:
    assert steps("async", k, S, M, t) == expected


@pytest.mark.parametrize("k,S,M,T,expected", ASYNC_DRAIN_GOLDEN)
def test_async_drain_golden(k: int, S: int, M: int, T: int, expected: str) -> None:
    assert drain("async", k, S, M, T) == expected


@pytest.mark.parametrize("k,S,M,t,expected", SYNC_GOLDEN)
def test_sync_golden(k: int, S: int, M: int, t: int, expected: str) -> None:
    assert steps("sync", k, S, M, t) == expected


@pytest.mark.parametrize("k,S,M,t,expected", GPIPE_GOLDEN)
def test_gpipe_golden(k: int, S: int, M: int, t: int, expected: str) -> None:
    assert steps("gpipe", k, S, M, t) == expected


@pytest.mark.parametrize("kind", ["sync", "gpipe"])
def test_synchronous_schedules_drain_nothing(kind: str) -> None:
    for S in range(1, 6):
        for k in range(S):
            for T in range(4):
                assert drain(kind, k, S, 3, T) == ""
                assert in_flight_after(kind, k, S, 3, T) == 0  # type: ignore[arg-type]


def test_staleness_and_stash_tables() -> None:
    assert [staleness("async", k, 4) for k in range(4)] == [3, 2, 1, 0]
    assert [max_stash("async", k, 4) for k in range(4)] == [4, 3, 2, 0]
    assert staleness("async", 0, 1) == max_stash("async", 0, 1) == 0
    for kind in ("sync", "gpipe"):
        assert [staleness(kind, k, 4) for k in range(4)] == [0, 0, 0, 0]  # type: ignore[arg-type]
        assert [max_stash(kind, k, 4) for k in range(4)] == [0, 0, 0, 0]  # type: ignore[arg-type]


def _stage_sequence(kind: str, k: int, S: int, M: int, T: int) -> list:  # type: ignore[type-arg]
    out = []
    for t in range(T):
        out.extend(step_instructions(kind, k, S, M, t))  # type: ignore[arg-type]
    out.extend(drain_instructions(kind, k, S, M, T))  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("S", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("M", [1, 2, 3, 7])
def test_async_sequence_is_1f1b_without_flush(S: int, M: int) -> None:
    T = 3
    for k in range(S):
        w = S - 1 - k
        seq = [i for i in _stage_sequence("async", k, S, M, T) if isinstance(i, (Forward, Backward))]
        n = T * M
        expected: list[Forward | Backward] = [Forward(j) for j in range(min(w, n))]
        for j in range(w, n):
            expected += [Forward(j), Backward(j - w)]
        expected += [Backward(j) for j in range(max(0, n - w), n)]  # the drain
        assert seq == expected


@pytest.mark.parametrize("S", [1, 2, 3, 4, 6, 9])
@pytest.mark.parametrize("M", [1, 2, 3, 5])
def test_async_staleness_and_stash_invariants(S: int, M: int) -> None:
    """Stage k forwards micro-batch i after exactly max(0, i - w) updates and backwards it after i."""
    T = 4
    for k in range(S):
        w = staleness("async", k, S)
        updates = 0
        version_of: dict[int, int] = {}
        in_flight: set[int] = set()
        peak_flight = peak_versions = 0
        for inst in _stage_sequence("async", k, S, M, T):
            if isinstance(inst, StashWeights):
                version_of[inst.mb_idx] = updates
                peak_versions = max(peak_versions, len(set(version_of.values())))
            elif isinstance(inst, Forward):
                assert updates == max(0, inst.mb_idx - w)
                in_flight.add(inst.mb_idx)
                peak_flight = max(peak_flight, len(in_flight))
            elif isinstance(inst, Backward):
                assert updates == inst.mb_idx
                in_flight.remove(inst.mb_idx)
                version_of.pop(inst.mb_idx, None)
            elif isinstance(inst, OptimizerStep):
                assert inst.mb_idx == updates  # updates apply micro-batches in order
                updates += 1
        assert updates == T * M and not in_flight and not version_of
        assert peak_flight == min(S - k, T * M)
        assert peak_versions <= max_stash("async", k, S)
        if T * M >= 2 * w + 1:
            assert peak_versions == max_stash("async", k, S)


@pytest.mark.parametrize("M", [1, 2, 4, 5])
def test_async_step_boundaries(M: int) -> None:
    """Stage 0 and the last stage forward all of batch t in step t; the last stage backwards its first M-1
    micro-batches and the previous step's last one."""
    S = 4
    for t in range(3):
        batch = list(range(t * M, t * M + M))
        first = step_instructions("async", 0, S, M, t)
        assert [i.mb_idx for i in first if isinstance(i, Forward)] == batch
        last = step_instructions("async", S - 1, S, M, t)
        assert [i.mb_idx for i in last if isinstance(i, Forward)] == batch
        assert [i.mb_idx for i in last if isinstance(i, Backward)] == ([t * M - 1] if t else []) + batch[:-1]
        for k in range(S):
            # what is in flight after the step is exactly what the drain would finish
            carried = 1 if k == S - 1 else min(S - 1 - k, (t + 1) * M)
            assert in_flight_after("async", k, S, M, t + 1) == carried
            assert len(drain_instructions("async", k, S, M, t + 1)) == in_flight_after("async", k, S, M, t + 1) * (
                (k < S - 1) + 1 + (k > 0) + 1
            )


@pytest.mark.parametrize("kind", ["sync", "gpipe"])
@pytest.mark.parametrize("S,M", [(1, 1), (3, 1), (3, 2), (4, 7), (6, 3)])
def test_synchronous_step_is_self_contained(kind: str, S: int, M: int) -> None:
    for k in range(S):
        for t in range(2):
            prog = step_instructions(kind, k, S, M, t)  # type: ignore[arg-type]
            batch = list(range(t * M, t * M + M))
            assert sorted(i.mb_idx for i in prog if isinstance(i, Forward)) == batch
            assert sorted(i.mb_idx for i in prog if isinstance(i, Backward)) == batch
            assert prog[-1] == OptimizerStep(None)
            assert sum(isinstance(i, OptimizerStep) for i in prog) == 1
            assert not any(isinstance(i, StashWeights) for i in prog)


def test_iter_steps_matches_step_instructions() -> None:
    for kind in SCHEDULES:
        got = list(islice(iter_steps(kind, 1, 3, 2), 50))
        assert got == [step_instructions(kind, 1, 3, 2, t) for t in range(50)]


def test_instructions_are_shared_but_equal_to_fresh_ones() -> None:
    a = step_instructions("async", 0, 2, 2, 0)
    b = step_instructions("async", 0, 2, 2, 0)
    assert a == b
    assert Forward(1) in a


def test_unknown_kind() -> None:
    msg = r"Unknown schedule 'pipedream'. Valid schedules: 'async', 'sync', 'gpipe'"
    for call in (
        lambda: step_instructions("pipedream", 0, 2, 2, 0),  # type: ignore[arg-type]
        lambda: drain_instructions("pipedream", 0, 2, 2, 1),  # type: ignore[arg-type]
        lambda: iter_steps("pipedream", 0, 2, 2),  # type: ignore[arg-type]
        lambda: staleness("pipedream", 0, 2),  # type: ignore[arg-type]
        lambda: max_stash("pipedream", 0, 2),  # type: ignore[arg-type]
        lambda: in_flight_after("pipedream", 0, 2, 2, 1),  # type: ignore[arg-type]
    ):
        with pytest.raises(ScheduleError, match=msg):
            call()


def test_range_errors() -> None:
    with pytest.raises(
        ScheduleError, match=r"stage_idx must be an int in \[0, num_stages\) = \[0, 2\); got stage_idx=2\."
    ):
        step_instructions("async", 2, 2, 4, 0)
    with pytest.raises(
        ScheduleError, match=r"stage_idx must be an int in \[0, num_stages\) = \[0, 2\); got stage_idx=-1\."
    ):
        staleness("async", -1, 2)
    with pytest.raises(ScheduleError, match=r"num_stages must be a positive int; got num_stages=0\."):
        step_instructions("async", 0, 0, 4, 0)
    with pytest.raises(ScheduleError, match=r"num_stages must be a positive int; got num_stages=True\."):
        max_stash("async", 0, True)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match=r"num_microbatches must be a positive int; got num_microbatches=0\."):
        step_instructions("sync", 0, 2, 0, 0)
    with pytest.raises(ScheduleError, match=r"num_microbatches must be a positive int; got num_microbatches=2\.0\."):
        iter_steps("gpipe", 0, 2, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match=r"step must be a non-negative int \(steps are counted .*\); got step=-1\."):
        step_instructions("async", 0, 2, 4, -1)
    with pytest.raises(ScheduleError, match=r"steps_done must be a non-negative int .*; got steps_done=-2\."):
        drain_instructions("async", 0, 2, 4, -2)
    with pytest.raises(ScheduleError, match=r"steps_done must be a non-negative int"):
        in_flight_after("sync", 0, 2, 4, -1)


def test_schedule_package_is_pure() -> None:
    """schedule/ imports only the standard library, errors and itself: no torch, no Lightning (the timeline plot
    imports matplotlib inside its function, where a missing matplotlib gives an install hint)."""
    root = Path(schedule_pkg.__file__).parent
    allowed = {"lightning_dynpipe.errors"}
    files = sorted(root.glob("*.py"))
    assert len(files) >= 4
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0 and node.module is not None, f"{path.name}: use absolute imports"
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                ok = top in sys.stdlib_module_names or name in allowed or name.startswith("lightning_dynpipe.schedule")
                ok = ok or (path.name == "plot.py" and top == "matplotlib" and node.col_offset > 0)
                assert ok, f"{path.name} imports {name}; schedule/ must stay pure (stdlib only)"
