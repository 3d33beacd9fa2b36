"""The solver against brute force on every small case: 1..10 layers, up to 4 stages, many random costs.

Every partition of every case is scored independently (tests/plan/reference.py); the solver's predicted
time to accuracy must equal the best of them, and a case where nothing fits must raise PartitionError.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest

from lightning_dynpipe.errors import PartitionError
from lightning_dynpipe.plan import (
    CommModel,
    ConvergenceModel,
    DefaultCostModel,
    DeviceSpec,
    ModelCost,
    evaluate,
    solve,
)
from lightning_dynpipe.plan.costs import FloatArray

from .reference import brute_force, score

SEEDS = range(6)
MAX_STAGES = range(1, 5)
NUM_DEVICES = 4


class PositionalCostModel:
    """A CostModel without a prefix form (the solver's dense path): depends on the stage's position, is
    not linear in its layers, and penalises long stages quadratically."""

    def stage_time(
        self,
        model: ModelCost,
        first: Any,
        stop: Any,
        *,
        stage_idx: int,
        num_stages: int,
        replicas: int,
        device: DeviceSpec,
        microbatches_per_update: int,
    ) -> FloatArray:
        i = np.asarray(first)
        j = np.asarray(stop)
        compute = (model.compute_prefix[j] - model.compute_prefix[i]) * device.slowdown
        handoff = 0.4 * (stage_idx + 1) / num_stages
        return np.asarray(np.maximum(compute, handoff) ** 1.1 / replicas + 0.01 * (j - i) ** 2)


def random_model(rng: random.Random, n: int) -> ModelCost:
    return ModelCost.from_arrays(
        [rng.uniform(0.05, 2.0) for _ in range(n)],
        [rng.uniform(0.05, 4.0) for _ in range(n)],
        activation_bytes=[rng.randint(0, 100) for _ in range(n)],
        # zero-parameter layers (activations, pooling) are common and make ties in the staleness term
        param_bytes=[rng.choice([0, rng.randint(1, 60)]) for _ in range(n)],
        optimizer_state_bytes=[rng.randint(0, 60) for _ in range(n)],
        workspace_bytes=[rng.randint(0, 40) for _ in range(n)],
        # optimizer updates: none for parameter-free layers, and up to a whole forward + backward
        update_s=[rng.choice([0.0, rng.uniform(0.0, 3.0)]) for _ in range(n)],
        # what a micro-batch keeps: unmeasured (the output stands in), or saved tensors above or below the output
        held_bytes=[rng.choice([0, rng.randint(1, 150)]) for _ in range(n)],
    )


def scenario(name: str, rng: random.Random, n: int, max_stages: int) -> dict[str, Any]:
    beta = rng.choice([0.0, 0.05, 0.3, 1.0, 4.0])
    kw: dict[str, Any] = {
        "num_devices": NUM_DEVICES,
        "convergence": ConvergenceModel(i0=rng.uniform(0.5, 2.0), beta=beta),
    }
    # alternate between letting the solver choose S <= max_stages and fixing S
    if rng.random() < 0.3 and max_stages <= n:
        kw["fixed_num_stages"] = max_stages
    else:
        kw["max_stages"] = max_stages
    comm = CommModel(
        latency_s=rng.uniform(0.0, 0.5),
        bandwidth_Bps=rng.uniform(50.0, 500.0),
        overlap=tuple(rng.uniform(0, 1) for _ in range(n - 1)) if rng.random() < 0.5 else rng.uniform(0, 1),
    )
    if name == "compute":
        pass
    elif name == "comm":
        kw["cost_model"] = DefaultCostModel(comm)
    elif name == "memory":
        kw["cost_model"] = DefaultCostModel(comm)
        kw["memory_cap"] = rng.uniform(60.0, 700.0)
    elif name == "devices":
        kw["cost_model"] = DefaultCostModel(comm)
        kw["slowdowns"] = [rng.choice([1.0, 1.0, 1.3, 2.5]) for _ in range(NUM_DEVICES)]
        kw["memory_cap"] = [rng.uniform(80.0, 900.0) for _ in range(NUM_DEVICES)]
    elif name == "dp":
        kw["cost_model"] = DefaultCostModel(comm)
        kw["dp"] = None if rng.random() < 0.7 else rng.randint(1, 2)
        if rng.random() < 0.5:
            kw["slowdowns"] = [rng.choice([1.0, 2.0]) for _ in range(NUM_DEVICES)]
    elif name == "sync":
        kw["cost_model"] = DefaultCostModel(comm)
        kw["schedule"] = "sync"
        kw["num_microbatches"] = rng.randint(1, 6)
        kw["dp"] = rng.choice([1, None])
        if rng.random() < 0.5:
            kw["memory_cap"] = rng.uniform(60.0, 500.0)
    elif name == "deep":  # more micro-batches in flight: staleness, weight versions and activations grow with d
        kw["cost_model"] = DefaultCostModel(comm)
        kw["schedule"] = rng.choice(["async+1", "async+2"])
        kw["dp"] = rng.choice([1, None])
        if rng.random() < 0.7:
            kw["memory_cap"] = rng.uniform(60.0, 900.0)
    elif name == "custom":
        kw["cost_model"] = PositionalCostModel()
        kw["dp"] = rng.choice([1, None])
        if rng.random() < 0.5:
            kw["memory_cap"] = rng.uniform(60.0, 700.0)
        if rng.random() < 0.5:
            kw["slowdowns"] = [rng.choice([1.0, 1.5]) for _ in range(NUM_DEVICES)]
    else:  # pragma: no cover
        raise AssertionError(name)
    if "fixed_num_stages" in kw and kw.get("dp", 1) is not None and kw["fixed_num_stages"] * kw.get("dp", 1) > 4:
        kw["dp"] = 1
    return kw


SCENARIOS = ["compute", "comm", "memory", "devices", "dp", "sync", "deep", "custom"]


@pytest.mark.parametrize("num_layers", range(1, 11))
@pytest.mark.parametrize("name", SCENARIOS)
def test_solver_matches_brute_force(name: str, num_layers: int) -> None:
    for max_stages in MAX_STAGES:
        for seed in SEEDS:
            rng = random.Random(f"{name}-{num_layers}-{max_stages}-{seed}")
            model = random_model(rng, num_layers)
            kw = scenario(name, rng, num_layers, max_stages)
            if kw.get("fixed_num_stages", 0) > num_layers:
                continue
            expected = brute_force(model, **kw)
            where = f"{name}, n={num_layers}, seed={seed}, {kw}"
            if math.isinf(expected.objective):
                with pytest.raises(PartitionError, match="fits the memory cap"):
                    solve(model, **kw)
                continue
            plan = solve(model, **kw)
            assert plan.time_to_accuracy_s == pytest.approx(expected.objective, rel=1e-9, abs=0), where
            # the plan is what it says: feasible, within the limits, and scored the same way independently
            assert plan.fits_memory, where
            assert plan.num_stages * plan.dp <= NUM_DEVICES
            if "fixed_num_stages" in kw:
                assert plan.num_stages == kw["fixed_num_stages"]
            else:
                assert plan.num_stages <= max_stages
            if kw.get("dp", 1) is not None:
                assert plan.dp == kw.get("dp", 1)
            independent = score(
                model, plan.partition.balance, plan.dp, num_devices=NUM_DEVICES, slowdowns=kw.get("slowdowns"),
                memory_cap=kw.get("memory_cap"), num_microbatches=kw.get("num_microbatches"),
                schedule=kw.get("schedule", "async"), convergence=kw["convergence"],
                cost_model=kw.get("cost_model", DefaultCostModel()),
            )  # fmt: skip
            assert plan.time_to_accuracy_s == pytest.approx(independent, rel=1e-12), where
            again = evaluate(
                model, plan.partition, devices=plan.devices,
                **{k: v for k, v in kw.items() if k not in ("max_stages", "fixed_num_stages", "dp")},
            )  # fmt: skip
            assert again == plan
