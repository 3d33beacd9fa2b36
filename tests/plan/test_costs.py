"""Per-layer costs, prefix sums, the communication model and the default stage time."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan import (
    CommModel,
    CostModel,
    DefaultCostModel,
    DeviceSpec,
    LayerCost,
    ModelCost,
    PrefixCostModel,
)


def _model(seed: int, n: int) -> ModelCost:
    rng = random.Random(seed)
    return ModelCost.from_arrays(
        [rng.uniform(0, 2) for _ in range(n)],
        [rng.uniform(0, 3) for _ in range(n)],
        activation_bytes=[rng.randint(0, 99) for _ in range(n)],
        param_bytes=[rng.randint(0, 99) for _ in range(n)],
        optimizer_state_bytes=[rng.randint(0, 99) for _ in range(n)],
        workspace_bytes=[rng.randint(0, 99) for _ in range(n)],
        update_s=[rng.uniform(0, 1) for _ in range(n)],
    )


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 33])
def test_range_queries_match_naive_sums(n: int) -> None:
    model = _model(n, n)
    layers = model.layers
    for i in range(n + 1):
        for j in range(i, n + 1):
            span = layers[i:j]
            assert model.compute_s(i, j) == pytest.approx(sum(c.forward_s + c.backward_s for c in span))
            assert model.update_s(i, j) == pytest.approx(sum(c.update_s for c in span))
            assert model.param_bytes(i, j) == sum(c.param_bytes for c in span)
            assert model.activation_bytes(i, j) == sum(c.activation_bytes for c in span)
            assert model.optimizer_state_bytes(i, j) == sum(c.optimizer_state_bytes for c in span)
            assert int(model.workspace_max(i, j)) == max((c.workspace_bytes for c in span), default=0)


def test_workspace_max_is_vectorised() -> None:
    model = _model(3, 9)
    first = np.asarray([0, 2, 5, 8, 4])
    stop = np.asarray([9, 3, 9, 9, 4])
    expected = [max((c.workspace_bytes for c in model.layers[i:j]), default=0) for i, j in zip(first, stop)]
    assert model.workspace_max(first, stop).tolist() == expected


def test_prefix_arrays_are_read_only() -> None:
    model = _model(0, 4)
    with pytest.raises(ValueError):
        model.compute_prefix[1] = 0.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("forward_s", -1.0),
        ("backward_s", math.nan),
        ("param_bytes", -4),
        ("activation_bytes", 1.5),
        ("update_s", -0.5),
        ("update_s", math.inf),
    ],
)
def test_layer_cost_rejects_bad_values(field: str, value: float) -> None:
    kwargs = {"forward_s": 1.0, "backward_s": 1.0, field: value}
    with pytest.raises(ConfigurationError, match=field):
        LayerCost(**kwargs)  # type: ignore[arg-type]


def test_model_cost_rejects_mismatched_columns_and_empty_models() -> None:
    with pytest.raises(ConfigurationError, match="one entry per layer"):
        ModelCost.from_arrays([1.0, 1.0], [1.0, 1.0], param_bytes=[1, 2, 3])
    with pytest.raises(ConfigurationError, match="update_s must have one entry per layer"):
        ModelCost.from_arrays([1.0, 1.0], [1.0, 1.0], update_s=[0.1])
    with pytest.raises(ConfigurationError, match="at least one layer"):
        ModelCost(())


def test_comm_model_transfer_and_allreduce() -> None:
    comm = CommModel(latency_s=0.5, bandwidth_Bps=100.0)
    assert comm.transfer_time([0, 100, 250]).tolist() == [0.5, 1.5, 3.0]
    assert float(comm.allreduce_time(1000, 1)) == 0.0
    # ring: 2 (r-1) latency + 2 (r-1)/r bytes / bandwidth
    assert float(comm.allreduce_time(1000, 4)) == pytest.approx(2 * 3 * 0.5 + 2 * 3 / 4 * 1000 / 100)


def test_comm_model_overlap_per_cut() -> None:
    assert CommModel(overlap=0.25).overlap_per_cut(4).tolist() == [0.25, 0.25, 0.25]
    assert CommModel(overlap=[0.1, 0.2]).overlap_per_cut(3).tolist() == [0.1, 0.2]  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="3 possible cuts"):
        CommModel(overlap=(0.1, 0.2)).overlap_per_cut(4)
    with pytest.raises(ConfigurationError, match=r"\[0, 1\]"):
        CommModel(overlap=1.5)
    with pytest.raises(ConfigurationError, match="bandwidth_Bps"):
        CommModel(bandwidth_Bps=0.0)


def test_device_spec_validation() -> None:
    with pytest.raises(ConfigurationError, match="slowdown"):
        DeviceSpec(slowdown=0.0)
    with pytest.raises(ConfigurationError, match="memory_cap_bytes"):
        DeviceSpec(memory_cap_bytes=0)


def test_model_cost_columns_round_trip_and_older_columns_have_no_update_time() -> None:
    """to_arrays/from_arrays carry the update times; columns written before they existed read as 0 (not timed)."""
    model = _model(5, 6)
    assert ModelCost.from_arrays(**model.to_arrays()) == model
    older = {k: v for k, v in model.to_arrays().items() if k != "update_s"}
    assert ModelCost.from_arrays(**older).update_prefix.tolist() == [0.0] * 7
    assert ModelCost.from_arrays([1.0, 1.0], [1.0, 1.0], update_s=0.25).update_s(0, 2) == 0.5


def test_default_cost_model_formula() -> None:
    """T = (s * (compute + update / M_u) + (1 - overlap) * 2 * transfer(out) + allreduce / M_u) / r, by hand
    (``M_u``: micro-batches per update, 1 for async)."""
    model = ModelCost.from_arrays(
        [1.0, 2.0, 3.0],
        [2.0, 4.0, 6.0],
        activation_bytes=[100, 200, 300],
        param_bytes=[10, 20, 30],
        update_s=[0.5, 0.0, 1.25],
    )
    comm = CommModel(latency_s=0.1, bandwidth_Bps=100.0, overlap=(0.5, 0.25))
    cost = DefaultCostModel(comm)
    device = DeviceSpec(slowdown=1.5)

    def by_hand(i: int, j: int, r: int, mpu: int) -> float:
        compute = 1.5 * (sum([3.0, 6.0, 9.0][i:j]) + sum([0.5, 0.0, 1.25][i:j]) / mpu)
        boundary = 0.0 if j == 3 else (1 - (0.5, 0.25)[j - 1]) * 2 * (0.1 + [100, 200, 300][j - 1] / 100.0)
        params = sum([10, 20, 30][i:j])
        allreduce = 0.0 if r == 1 else (2 * (r - 1) * 0.1 + 2 * (r - 1) / r * params / 100.0) / mpu
        return (compute + boundary + allreduce) / r

    for r, mpu in [(1, 1), (2, 1), (3, 4)]:
        for i in range(3):
            for j in range(i + 1, 4):
                got = cost.stage_time(
                    model, [i], [j], stage_idx=0, num_stages=2, replicas=r, device=device, microbatches_per_update=mpu
                )
                assert float(got[0]) == pytest.approx(by_hand(i, j, r, mpu), rel=1e-12)


def test_default_cost_model_is_both_protocols_and_prefix_form_is_monotone() -> None:
    cost = DefaultCostModel(CommModel(latency_s=0.1, bandwidth_Bps=10.0))
    assert isinstance(cost, CostModel)
    assert isinstance(cost, PrefixCostModel)
    q, r = cost.prefix_form(_model(1, 20), replicas=3, device=DeviceSpec(slowdown=2.0), microbatches_per_update=2)
    assert q.shape == r.shape == (21,)
    assert np.all(np.diff(q) >= 0)
