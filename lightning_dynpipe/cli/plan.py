"""``python -m lightning_dynpipe plan``: profile a model, plan its partition and simulate it, without training.

Example::

    python -m lightning_dynpipe plan --model lightning_dynpipe.demos:MLP --init-args '{"width": 1024}' \\
        --devices 2 --batch-size 64 --num-microbatches 4

prints the per-layer profile, the plan table (partition, predicted stage times, memory, staleness, predicted
time to accuracy) and the simulated step time, and writes the simulated timeline as a PNG (and, on request,
a Chrome trace). No process group is created: the link between stages is what ``--latency-us`` and
``--bandwidth-gbps`` say (by default nothing is charged for communication); a training run measures it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.auto import best_plan, simulate_plan
from lightning_dynpipe.plan.convergence import DEFAULT_BETA, ConvergenceModel
from lightning_dynpipe.plan.costs import CommModel
from lightning_dynpipe.profiling import optimizer_state_factor, profile_layers
from lightning_dynpipe.schedule import SCHEDULES
from lightning_dynpipe.schedule.plot import plot_timeline

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The ``plan`` command's arguments."""
    p = argparse.ArgumentParser(prog="python -m lightning_dynpipe plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the LightningModule class, as 'package.module:Class'")
    p.add_argument("--init-args", default="{}", help="JSON object of keyword arguments for the class")
    p.add_argument("--pipeline-attr", default="pipeline", help="attribute holding the nn.Sequential")
    p.add_argument("--devices", type=int, required=True, help="processes the run will have (all nodes)")
    p.add_argument("--num-stages", default=None, help="a number, or 'auto' to let the planner choose")
    p.add_argument("--batch-size", type=int, required=True, help="the Lightning batch size")
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--schedule", choices=SCHEDULES, default=SCHEDULES[0])
    p.add_argument(
        "--input-shape",
        default=None,
        help="per-sample input shape, e.g. '784' or '1,28,28'; default: the model's example_input() "
        "or example_input_array",
    )
    p.add_argument("--beta", type=float, default=DEFAULT_BETA, help="the convergence model's staleness cost")
    p.add_argument("--latency-us", type=float, default=0.0, help="link latency between stages (microseconds)")
    p.add_argument("--bandwidth-gbps", type=float, default=math.inf, help="link bandwidth (GB/s)")
    p.add_argument(
        "--memory-cap",
        type=_bytes,
        default=None,
        help="bytes each process may hold by the planner's memory model, e.g. 12GiB or 500MiB (default: no cap)",
    )
    p.add_argument("--steps", type=int, default=6, help="steps to simulate")
    p.add_argument("--timeline", default="plan_timeline.png", help="where to write the simulated timeline")
    p.add_argument("--trace", default=None, help="also write a Chrome trace (JSON) here")
    return p


_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _bytes(text: str) -> float:
    """``--memory-cap``: a number of bytes with an optional binary unit (``12GiB``, ``500 MiB``, ``1e9``)."""
    number = text.strip().rstrip("".join(sorted({c for u in _UNITS for c in u}))).strip()
    unit = text.strip()[len(number) :].strip()
    try:
        value = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(
            f"expected bytes with an optional unit of {', '.join(u for u in _UNITS if u)} (e.g. 12GiB); got {text!r}"
        ) from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of bytes > 0; got {text!r}")
    return value


def _load_model(spec: str, init_args: str) -> Any:
    module_name, sep, cls_name = spec.partition(":")
    if not sep:
        module_name, _, cls_name = spec.rpartition(".")
    if not module_name or not cls_name:
        raise ConfigurationError(f"--model must look like 'package.module:Class'; got {spec!r}.")
    cls = getattr(importlib.import_module(module_name), cls_name)
    kwargs = json.loads(init_args)
    if not isinstance(kwargs, dict):
        raise ConfigurationError(f"--init-args must be a JSON object; got {init_args!r}.")
    return cls(**kwargs)


def _sample(model: Any, shape: str | None, micro_batch: int) -> Any:
    if shape is not None:
        dims = [int(d) for d in shape.replace("x", ",").split(",") if d.strip()]
        return torch.randn(micro_batch, *dims)
    if callable(getattr(model, "example_input", None)):
        return model.example_input(micro_batch)
    example = getattr(model, "example_input_array", None)
    if isinstance(example, torch.Tensor):
        return torch.randn(micro_batch, *example.shape[1:], dtype=example.dtype)
    raise ConfigurationError(
        "Cannot build a sample input: give --input-shape (e.g. --input-shape 784), or define "
        "example_input(batch_size) or example_input_array on the model."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``plan`` command; returns the exit status."""
    a = build_parser().parse_args(argv)
    model = _load_model(a.model, a.init_args)
    pipeline: Any = model
    for part in a.pipeline_attr.split("."):
        if not hasattr(pipeline, part):
            raise ConfigurationError(
                f"{type(model).__name__} has no attribute `{part}` (from --pipeline-attr {a.pipeline_attr!r}); "
                "name the attribute that holds the nn.Sequential."
            )
        pipeline = getattr(pipeline, part)
    if not isinstance(pipeline, nn.Sequential):
        raise ConfigurationError(f"`{a.pipeline_attr}` must be an nn.Sequential; got {type(pipeline).__name__}.")
    micro_batch = max(1, a.batch_size // a.num_microbatches)
    optimizer = model.configure_optimizers() if hasattr(model, "configure_optimizers") else None
    if isinstance(optimizer, dict):
        optimizer = optimizer.get("optimizer")
    factor = optimizer_state_factor(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else 2.0
    profile = profile_layers(
        pipeline,
        _sample(model, a.input_shape, micro_batch),
        optimizer_state_bytes_per_param_byte=factor,
        optimizer=optimizer if isinstance(optimizer, torch.optim.Optimizer) else None,
    )
    print(f"Per-layer profile (micro-batch of {micro_batch}):")
    print(profile.table())
    cost = profile.to_model_cost()
    comm = CommModel(latency_s=a.latency_us * 1e-6, bandwidth_Bps=a.bandwidth_gbps * 1e9)
    if a.num_stages in (None, "auto"):
        num_stages = None if a.num_stages == "auto" else min(a.devices, cost.num_layers)
    else:
        num_stages = int(a.num_stages)
    plan = best_plan(
        cost,
        a.devices,
        num_stages=num_stages,
        schedule=a.schedule,
        convergence=ConvergenceModel(beta=a.beta),
        comm=comm,
        num_microbatches=a.num_microbatches,
        memory_cap=a.memory_cap,
    )
    print()
    print(plan.table())
    sim = simulate_plan(
        plan, cost, schedule=a.schedule, num_microbatches=a.num_microbatches, num_steps=a.steps, comm=comm
    )
    step = sim.steady_state_step_time
    print()
    print(
        f"simulated {a.schedule} step: {step * 1e3:.2f} ms for {a.batch_size} samples per pipeline "
        f"(~{plan.dp * a.batch_size / step:,.0f} samples/s with {plan.dp} pipeline(s)); "
        f"bubble per stage {', '.join(f'{b:.0%}' for b in sim.bubble_fraction)}"
    )
    try:
        plot_timeline(sim, a.timeline, title=f"{a.model}: {a.schedule}, balance {list(plan.partition.balance)}")
    except ImportError as exc:  # matplotlib is optional: the plan above is the result
        print(f"timeline not written: {exc}")
    else:
        print(f"timeline written to {a.timeline}")
    if a.trace:
        sim.write_chrome_trace(a.trace)
        print(f"Chrome trace written to {a.trace}")
    return 0
