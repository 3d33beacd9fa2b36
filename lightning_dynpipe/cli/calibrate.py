"""``python -m lightning_dynpipe calibrate``: train the interference forest here, with the model's own layers.

Example::

    python -m lightning_dynpipe calibrate --model lightning_dynpipe.demos:MLP --init-args '{"width": 384}' \\
        --batch-size 64 --num-stages 2 --out dynpipe-forest.npz

then ``DynPipeStrategy(predictor=ForestPredictor.load("dynpipe-forest.npz"))``.

The command profiles the pipeline's layers (the set-up profile a run would take), runs the sweep of
:mod:`lightning_dynpipe.sweep` (``--scenarios`` x ``--partitions`` candidate partitions, in one worker process
pinned to one core), fits the :class:`~lightning_dynpipe.predictor.ForestPredictor` on its rows and saves it (rows,
schema, versions; no pickle). ``DynPipeStrategy(predictor="forest", calibrate=True)`` runs the same sweep at
set-up instead.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor import ForestPredictor
from lightning_dynpipe.sweep import SCENARIOS, SweepSettings, calibrate_pipeline

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The ``calibrate`` command's arguments."""
    p = argparse.ArgumentParser(prog="python -m lightning_dynpipe calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the LightningModule class, as 'package.module:Class'")
    p.add_argument("--init-args", default="{}", help="JSON object of keyword arguments for the class")
    p.add_argument("--pipeline-attr", default="pipeline", help="attribute holding the nn.Sequential")
    p.add_argument("--batch-size", type=int, required=True, help="the Lightning batch size")
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--num-stages", type=int, default=2)
    p.add_argument("--input-shape", default=None, help="per-sample input shape, e.g. '784'")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {list(SCENARIOS)}")
    p.add_argument("--partitions", type=int, default=5, help="candidate partitions per scenario")
    p.add_argument(
        "--balances", default=None,
        help="the partitions to measure instead, layers per stage, e.g. '2,7;3,6;4,5' (overrides --partitions)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=6, help="steps per measured window")
    p.add_argument(
        "--clean-rounds", type=int, default=SweepSettings.clean_rounds,
        help="rounds of measuring every layer set without interference (each keeps its median round)",
    )  # fmt: skip
    p.add_argument(
        "--no-planned", action="store_true",
        help="measure only the candidate partitions, not also those the planner proposes from their windows",
    )  # fmt: skip
    p.add_argument("--core", type=int, default=None, help="the core the worker runs on (default: the last allowed)")
    p.add_argument("--out", default="dynpipe-forest.npz", help="where to save the forest")
    p.add_argument("--runs-out", default=None, help="also save every measured window as JSON (for benchmarks)")
    return p


def _parse_balances(text: str, num_stages: int, num_layers: int) -> list[Partition]:
    """``'2,7;3,6'`` -> partitions; each must have ``num_stages`` stages over ``num_layers`` layers."""
    out = []
    for item in text.split(";"):
        try:
            balance = tuple(int(x) for x in item.split(","))
        except ValueError as exc:
            raise ConfigurationError(f"--balances takes 'a,b;c,d' (layers per stage); got {text!r}.") from exc
        if len(balance) != num_stages or sum(balance) != num_layers or min(balance) < 1:
            raise ConfigurationError(
                f"--balances: {item!r} is not a split of {num_layers} layers into {num_stages} stages of at least "
                "one layer each."
            )
        out.append(Partition(balance))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``calibrate`` command; returns the exit status."""
    import torch

    from lightning_dynpipe.cli.plan import _load_model, _sample
    from lightning_dynpipe.profiling import optimizer_state_factor, profile_layers

    a = build_parser().parse_args(argv)
    unknown = [s for s in a.scenarios.split(",") if s and s not in SCENARIOS]
    if unknown:
        raise ConfigurationError(f"--scenarios names {unknown}; the known scenarios are {list(SCENARIOS)}.")
    scenarios = tuple(s for s in a.scenarios.split(",") if s)
    if a.num_stages < 2 or a.partitions < 2 or a.steps < 2:
        raise ConfigurationError(
            f"calibrate needs --num-stages >= 2, --partitions >= 2 and --steps >= 2; got {a.num_stages}, "
            f"{a.partitions}, {a.steps}."
        )
    torch.set_num_threads(1)
    module = _load_model(a.model, a.init_args)
    pipeline: Any = module
    for part in a.pipeline_attr.split("."):
        pipeline = getattr(pipeline, part)
    micro_batch = max(1, a.batch_size // a.num_microbatches)
    optimizer = module.configure_optimizers() if hasattr(module, "configure_optimizers") else None
    if isinstance(optimizer, dict):
        optimizer = optimizer.get("optimizer")
    factor = optimizer_state_factor(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else 2.0
    sample = _sample(module, a.input_shape, micro_batch)
    timed = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    cost = profile_layers(
        pipeline, sample, optimizer_state_bytes_per_param_byte=factor, optimizer=timed
    ).to_model_cost()
    balances = (
        tuple(p.balance for p in _parse_balances(a.balances, a.num_stages, cost.num_layers)) if a.balances else None
    )
    settings = SweepSettings(scenarios, a.partitions, a.steps, balances, a.core, a.clean_rounds, not a.no_planned)
    result = calibrate_pipeline(
        pipeline, sample, cost, num_stages=a.num_stages, num_microbatches=a.num_microbatches, settings=settings
    )
    forest = ForestPredictor().fit(result.samples)
    path = forest.save(a.out)
    print(result.summary())
    print(f"forest saved to {path} (load it with ForestPredictor.load({str(path)!r}))")
    if a.runs_out:
        with open(a.runs_out, "w") as fh:
            comm = result.comm
            json.dump({"layers": cost.to_arrays(), "comm": [comm.latency_s, comm.bandwidth_Bps],
                       "runs": [r.to_dict() for r in result.runs]}, fh)  # fmt: skip
        print(f"windows saved to {a.runs_out}")
    return 0
