"""Stage memory: weight versions, optimizer state, in-flight activations, workspace."""

from __future__ import annotations

import pytest

from lightning_dynpipe.errors import ConfigurationError, ScheduleError
from lightning_dynpipe.plan import ModelCost, in_flight_microbatches, stage_memory, weight_versions


def test_versions_and_in_flight_follow_the_schedule() -> None:
    assert [weight_versions(k, 4) for k in range(4)] == [4, 3, 2, 1]
    assert [weight_versions(k, 4, "sync") for k in range(4)] == [1, 1, 1, 1]
    assert [in_flight_microbatches(k, 4) for k in range(4)] == [4, 3, 2, 1]
    assert [in_flight_microbatches(k, 4, "sync", num_microbatches=2) for k in range(4)] == [2, 2, 2, 1]


def test_stage_memory_by_hand() -> None:
    model = ModelCost.from_arrays(
        [1.0] * 3, [1.0] * 3, activation_bytes=[5, 7, 11], param_bytes=[100, 0, 30],
        optimizer_state_bytes=[200, 0, 60], workspace_bytes=[13, 50, 17],
    )  # fmt: skip
    # stage 1 of 3 owns layers 1..2: 2 versions, 2 micro-batches in flight, each keeping the 5 bytes it received
    got = stage_memory(model, [1], [3], stage_idx=1, num_stages=3)
    assert got.tolist() == [2 * 30 + 60 + 2 * (5 + 7 + 11) + 50]
    got = stage_memory(model, [0, 0], [1, 3], stage_idx=0, num_stages=3, schedule="sync", num_microbatches=2)
    assert got.tolist() == [100 + 200 + 2 * 5 + 13, 130 + 260 + 2 * 23 + 50]


def test_each_micro_batch_in_flight_keeps_the_held_bytes_where_measured() -> None:
    # layer 1 keeps 40 bytes per micro-batch (its saved tensors and output); layers 0 and 2 were not measured, so
    # their outputs stand in
    model = ModelCost.from_arrays(
        [1.0] * 3, [1.0] * 3, activation_bytes=[5, 7, 11], param_bytes=[100, 0, 30], held_bytes=[0, 40, 0]
    )
    assert [layer.kept_bytes for layer in model.layers] == [5, 40, 11]
    assert stage_memory(model, [1], [3], stage_idx=1, num_stages=3).tolist() == [2 * 30 + 2 * (5 + 40 + 11)]
    assert ModelCost.from_arrays(**model.to_arrays()) == model
    with pytest.raises(ConfigurationError, match="held_bytes"):
        ModelCost.from_arrays([1.0], [1.0], held_bytes=[-1])


def test_stage_memory_errors() -> None:
    model = ModelCost.from_arrays([1.0], [1.0])
    with pytest.raises(ConfigurationError, match="num_microbatches"):
        stage_memory(model, [0], [1], stage_idx=0, num_stages=1, schedule="sync")
    with pytest.raises(ScheduleError, match="Valid schedules: 'async', 'sync', 'gpipe'"):
        stage_memory(model, [0], [1], stage_idx=0, num_stages=1, schedule="zb")
    with pytest.raises(ConfigurationError, match="num_microbatches"):
        stage_memory(model, [0], [1], stage_idx=0, num_stages=1, schedule="gpipe")
    with pytest.raises(ConfigurationError, match="stage_idx"):
        weight_versions(3, 3)


def test_each_schedule_brings_its_own_memory_model() -> None:
    # gpipe holds every micro-batch of the step before the first backward; 1F1B with a flush at most S - k.
    assert [in_flight_microbatches(k, 3, "gpipe", 5) for k in range(3)] == [5, 5, 5]
    assert [in_flight_microbatches(k, 3, "sync", 5) for k in range(3)] == [3, 2, 1]
    assert [in_flight_microbatches(k, 3, "async") for k in range(3)] == [3, 2, 1]
    assert [weight_versions(k, 3, s) for s in ("async", "sync", "gpipe") for k in range(3)] == [3, 2, 1] + [1] * 6
