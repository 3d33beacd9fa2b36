"""Instructions: string round trip, parsing errors, immutability."""

from __future__ import annotations

import dataclasses
import random

import pytest

from lightning_dynpipe.errors import ScheduleError
from lightning_dynpipe.schedule import (
    INSTRUCTION_TYPES,
    Backward,
    Forward,
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

CODES = {
    Forward: "F",
    Backward: "B",
    OptimizerStep: "U",
    StashWeights: "W",
    RecvActivation: "RA",
    SendActivation: "SA",
    RecvGrad: "RG",
    SendGrad: "SG",
}

_rng = random.Random(0)
MB_VALUES = sorted({0, 1, 2, 9, 10, 11, 99, 100, 101, 10**9, 2**63} | {_rng.randrange(10**6) for _ in range(200)})


def test_every_type_has_a_code() -> None:
    assert set(INSTRUCTION_TYPES) == set(CODES)
    assert {cls.code for cls in INSTRUCTION_TYPES} == set(CODES.values())


@pytest.mark.parametrize("cls", INSTRUCTION_TYPES, ids=lambda c: c.__name__)
def test_round_trip_over_many_indices(cls: type) -> None:
    for mb in MB_VALUES:
        inst = cls(mb)
        text = str(inst)
        assert text == f"{CODES[cls]}{mb}"
        back = parse_instruction(text)
        assert back == inst and type(back) is cls
        assert str(back) == text
        assert hash(back) == hash(inst)


def test_sync_update_has_no_index() -> None:
    assert str(OptimizerStep(None)) == "U" == str(OptimizerStep())
    assert parse_instruction("U") == OptimizerStep(None)
    assert parse_instruction("U0") == OptimizerStep(0) != OptimizerStep(None)


def test_list_round_trip_and_whitespace() -> None:
    text = "RA0 W0 F0 SA0 RG0 B0 SG0 U0 U"
    insts = parse_instructions(text)
    assert insts == (
        RecvActivation(0),
        StashWeights(0),
        Forward(0),
        SendActivation(0),
        RecvGrad(0),
        Backward(0),
        SendGrad(0),
        OptimizerStep(0),
        OptimizerStep(None),
    )
    assert format_instructions(insts) == text
    assert parse_instructions("  F1\n\tB1  ") == (Forward(1), Backward(1))
    assert parse_instructions("") == ()
    assert parse_instruction(" SG3 ") == SendGrad(3)


def test_types_with_equal_index_differ() -> None:
    insts = [cls(3) for cls in INSTRUCTION_TYPES]
    assert len(set(insts)) == len(insts)


def test_frozen() -> None:
    inst = Forward(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        inst.mb_idx = 2  # type: ignore[misc]
    assert not hasattr(inst, "__dict__")  # slots


@pytest.mark.parametrize("text", ["", "X3", "F", "B", "RA", "F-1", "F03", "f3", "F3x", "FF3", "U 3", "3F", "RA1.0"])
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ScheduleError):
        parse_instruction(text)


def test_parse_error_messages() -> None:
    with pytest.raises(
        ScheduleError, match=r"Cannot parse 'X3' as an instruction: the form is a code \(B, F, RA, RG, SA, SG, U, W\)"
    ):
        parse_instruction("X3")
    with pytest.raises(
        ScheduleError,
        match=r"Instruction 'F' needs a micro-batch index: only the synchronous update 'U' has none. Write e.g. 'F0'.",
    ):
        parse_instruction("F")
    with pytest.raises(ScheduleError, match="must be a str; got 3"):
        parse_instruction(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 1.0, True, "3", None])
def test_bad_index_rejected(bad: object) -> None:
    with pytest.raises(
        ScheduleError, match=r"Forward.mb_idx must be a non-negative int \(micro-batches are counted 0, 1, 2"
    ):
        Forward(bad)  # type: ignore[arg-type]


def test_optimizer_step_index_rejected() -> None:
    with pytest.raises(
        ScheduleError, match=r"OptimizerStep.mb_idx must be a non-negative int or None \(micro-batches .*\); got -2\."
    ):
        OptimizerStep(-2)
