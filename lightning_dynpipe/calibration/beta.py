"""Calibrating the convergence model on the user's own model and data with the staleness emulator.

The planner charges a deeper pipeline more iterations to reach a target through
:class:`~lightning_dynpipe.plan.ConvergenceModel`, ``I = I0 * (1 + beta * sum_k w_k * staleness_k)``.
Its ``beta`` is a prior until it is measured. This module measures it without any pipeline: it trains
fresh copies of the model in one process with :func:`~lightning_dynpipe.calibration.replay_async`, which
reproduces exactly what PipeDream's staleness does to the updates, once per staleness profile and seed,
records how many iterations each run needs to reach a target metric, and fits ``I0`` and ``beta`` with
:func:`~lightning_dynpipe.plan.fit_beta`.

Example::

    import torch, torch.nn.functional as F
    from lightning_dynpipe.calibration import calibrate_beta

    def model_factory(seed):               # same seed, same initial weights
        torch.manual_seed(seed)
        return torch.nn.Sequential(...)

    def batches(seed):                     # a fixed, seeded order of training batches
        ...

    model = calibrate_beta(
        model_factory, batches, profiles=[1, 2, 4], seeds=[0, 1, 2], num_microbatches=4,
        make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        loss_fn=lambda out, mb: F.cross_entropy(out, mb[1]),
        eval_fn=val_accuracy, target=0.92, eval_every=5, max_steps=600,
        lr_scale=1 / 4)                    # what DynPipeStrategy's lr_scale="auto" uses for async, M=4
    print(model.beta)

Units: :func:`steps_to_target` counts *steps* (Lightning batches, each ``num_microbatches`` updates),
while the convergence model counts *iterations* (micro-batches, one update each); :class:`ProfileRun`
carries both, and the fit uses iterations.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dynpipe.calibration.replay import default_staleness, replay_async
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.convergence import ConvergenceModel, Observation, fit_beta
from lightning_dynpipe.plan.partition import Partition, balance_by_weights

__all__ = [
    "ProfileRun",
    "calibrate_beta",
    "layer_parameter_counts",
    "measure_profiles",
    "median_observations",
    "resolve_profile",
    "steps_to_target",
]

log = logging.getLogger(__name__)

Profile: TypeAlias = "int | Sequence[int] | Partition"
"""A staleness profile to measure: a number of stages ``S`` (PipeDream's ``S-1-k``, layers split by parameter count),
explicit per-stage staleness (split the same way), or a :class:`~lightning_dynpipe.plan.Partition` (its layers per
stage, with PipeDream's ``S-1-k``): the partitions a run may move between, whose weighted staleness differs by which
layers sit on the stale stages."""


class _TargetReached(Exception):
    """Internal: raised from the emulator's step hook to stop training once the target is met."""


def layer_parameter_counts(pipeline: nn.Sequential) -> list[int]:
    """Number of trainable parameters of each layer of ``pipeline``."""
    return [sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in pipeline]


def resolve_profile(
    pipeline: nn.Sequential, profile: Profile, balance: Sequence[int] | None = None
) -> tuple[Partition, tuple[int, ...], tuple[int, ...]]:
    """The partition, per-stage staleness and per-stage parameter counts that a profile stands for.

    Args:
        pipeline: the layers (only their parameter counts are read).
        profile: ``S`` for the asynchronous profile ``(S-1, ..., 0)``, an explicit per-stage staleness
            whose length is the number of stages, or a :class:`~lightning_dynpipe.plan.Partition` (its balance,
            with ``(S-1, ..., 0)``).
        balance: layers per stage; by default the layers are split by parameter count with
            :func:`~lightning_dynpipe.plan.balance_by_weights`, as the strategy does before a plan exists. Not
            with a ``Partition`` profile, which is its own balance.

    Returns:
        ``(partition, staleness, stage_parameters)``.

    Raises:
        ConfigurationError: a profile or balance that does not fit the pipeline.
    """
    if isinstance(profile, Partition):
        if balance is not None:
            raise ConfigurationError(
                f"A Partition profile is its own balance; got the profile {profile} and balance={list(balance)}. "
                "Pass one of them."
            )
        balance, staleness = profile.balance, tuple(default_staleness(profile.num_stages))
    elif isinstance(profile, int):
        if profile < 1:
            raise ConfigurationError(f"A profile given as a number of stages must be >= 1; got {profile}.")
        staleness = tuple(default_staleness(profile))
    else:
        staleness = tuple(int(s) for s in profile)
        if not staleness or any(s < 0 for s in staleness):
            raise ConfigurationError(
                f"A staleness profile needs one value >= 0 per stage; got {list(profile)}. "
                "Pass e.g. [1, 0] or the number of stages, 2."
            )
    num_stages = len(staleness)
    counts = layer_parameter_counts(pipeline)
    if balance is None:
        part = balance_by_weights(counts, num_stages)
    else:
        part = Partition.from_balance(balance, len(pipeline))
        if part.num_stages != num_stages:
            raise ConfigurationError(
                f"balance {list(part.balance)} has {part.num_stages} stages but the staleness profile "
                f"{list(staleness)} has {num_stages}. Give one staleness value per stage."
            )
    stage_params = tuple(sum(counts[i] for i in part.stage_layers(k)) for k in range(num_stages))
    return part, staleness, stage_params


def _reached(value: float, target: float, mode: Literal["max", "min"]) -> bool:
    return value >= target if mode == "max" else value <= target


def steps_to_target(
    model_factory: Callable[[], nn.Sequential],
    batches: Iterable[Any],
    *,
    num_stages: int,
    balance: Sequence[int] | None = None,
    staleness: Sequence[int] | None = None,
    num_microbatches: int,
    make_optimizer: Callable[[list[nn.Parameter]], Optimizer],
    loss_fn: Callable[[Any, Any], Tensor],
    eval_fn: Callable[[nn.Sequential], float],
    target: float,
    eval_every: int,
    max_steps: int,
    mode: Literal["max", "min"] = "max",
    stop_at_target: bool = True,
    on_eval: Callable[[int, float], None] | None = None,
    lr_scale: float = 1.0,
) -> int | None:
    """Trains a fresh model with PipeDream staleness and returns the first evaluated step that meets ``target``.

    The model trains in one process with :func:`~lightning_dynpipe.calibration.replay_async`, in a single call,
    so the staleness is never reset by a drain (evaluation reads the live weights, which a real pipeline
    would drain for; draining only for evaluation would make the emulated pipeline less stale than the
    real one that validates once an epoch).

    Example::

        steps = steps_to_target(lambda: make_mlp(seed=0), train_batches, num_stages=4, num_microbatches=4,
                                make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05),
                                loss_fn=lambda out, mb: F.cross_entropy(out, mb[1]),
                                eval_fn=val_accuracy, target=0.92, eval_every=5, max_steps=500)

    Args:
        model_factory: builds the fresh ``nn.Sequential`` to train (called once).
        batches: training batches in order; the first ``max_steps`` are used (fewer if it runs out).
        num_stages: ``S``.
        balance: layers per stage; default: split by parameter count
            (:func:`~lightning_dynpipe.plan.balance_by_weights`).
        staleness: per-stage staleness; default PipeDream's ``S-1-k``.
        num_microbatches: micro-batches per step; each is one update.
        make_optimizer: builds one stage's optimizer from its parameters.
        loss_fn: ``loss_fn(output, micro_batch)``.
        eval_fn: the metric of the model, called under ``torch.no_grad()`` every ``eval_every`` steps and
            after the last step.
        target: the metric value to reach.
        eval_every: steps between evaluations (the resolution of the answer).
        max_steps: at most this many steps.
        mode: ``"max"`` when higher is better (accuracy), ``"min"`` when lower is (loss).
        stop_at_target: stop as soon as the target is met; ``False`` trains all ``max_steps`` (to record
            a whole curve through ``on_eval``) and still returns the first step that met it.
        on_eval: called with ``(step, metric)`` after every evaluation, ``step`` counted from 1.
        lr_scale: multiplies the learning rate of every update, as ``DynPipeStrategy(lr_scale=...)`` does;
            pass the scale the strategy trains with, ``strategy.config.lr_scale`` (the default ``"auto"``
            resolves to ``1/M`` under ``async``). Default 1: unscaled.

    Returns:
        The number of steps after which the metric first met the target, or ``None`` if it never did.

    Raises:
        ConfigurationError: an argument out of range, or ``balance``/``staleness`` not matching ``num_stages``.
    """
    if eval_every < 1 or max_steps < 1:
        raise ConfigurationError(
            f"eval_every and max_steps must be >= 1; got eval_every={eval_every}, max_steps={max_steps}."
        )
    if mode not in ("max", "min"):
        raise ConfigurationError(f"Unknown mode {mode!r}; valid options are ['max', 'min'].")
    if not math.isfinite(target):
        raise ConfigurationError(f"target must be a finite number; got {target!r}.")
    if num_stages < 1:
        raise ConfigurationError(f"num_stages must be >= 1; got {num_stages}.")
    if not (math.isfinite(lr_scale) and lr_scale > 0):
        raise ConfigurationError(f"lr_scale must be a finite positive number; got {lr_scale!r}.")
    stale = tuple(default_staleness(num_stages)) if staleness is None else tuple(staleness)
    if len(stale) != num_stages:
        raise ConfigurationError(
            f"staleness needs one entry per stage: num_stages={num_stages} but staleness={list(stale)}."
        )
    pipeline = model_factory()
    part, _, _ = resolve_profile(pipeline, stale, balance)

    first: int | None = None
    last_eval = 0

    def evaluate(step: int) -> None:
        nonlocal first, last_eval
        last_eval = step
        with torch.no_grad():
            value = float(eval_fn(pipeline))
        if on_eval is not None:
            on_eval(step, value)
        if first is None and _reached(value, target, mode):
            first = step
            if stop_at_target:
                raise _TargetReached

    def on_step_end(step: int, _losses: list[float]) -> None:
        if (step + 1) % eval_every == 0:
            evaluate(step + 1)

    steps_done = 0

    def counted(source: Iterable[Any]) -> Iterable[Any]:
        nonlocal steps_done
        for batch in source:
            steps_done += 1
            yield batch

    try:
        replay_async(
            pipeline,
            part.balance,
            make_optimizer,
            counted(itertools.islice(batches, max_steps)),
            num_microbatches,
            loss_fn,
            staleness=stale,
            on_step_end=on_step_end,
            lr_scale=lr_scale,
        )
        if steps_done > last_eval:
            evaluate(steps_done)
    except _TargetReached:
        pass
    return first


@dataclass(frozen=True)
class ProfileRun:
    """One measured run of :func:`measure_profiles`.

    Attributes:
        profile: the profile as given (a number of stages, a staleness tuple or a partition).
        seed: the seed passed to the model and batch factories.
        balance: layers per stage used.
        staleness: per-stage staleness used.
        stage_parameters: trainable parameters per stage (the model's ``w_k`` before normalisation).
        steps: steps to the target, ``None`` if it was not reached within ``max_steps``.
        num_microbatches: micro-batches (updates) per step.
        curve: ``(step, metric)`` at every evaluation.
    """

    profile: tuple[int, ...] | int | Partition
    seed: int
    balance: tuple[int, ...]
    staleness: tuple[int, ...]
    stage_parameters: tuple[int, ...]
    steps: int | None
    num_microbatches: int
    curve: tuple[tuple[int, float], ...] = ()

    @property
    def iterations(self) -> int | None:
        """Micro-batches (updates) to the target: ``steps * num_microbatches``, the convergence model's unit."""
        return None if self.steps is None else self.steps * self.num_microbatches

    def observation(self) -> Observation:
        """This run as an input to :func:`~lightning_dynpipe.plan.fit_beta`.

        Raises:
            ConfigurationError: the run never reached the target.
        """
        if self.iterations is None:
            raise ConfigurationError(
                f"The run of profile {self.profile} (seed {self.seed}) never reached the target, so it has no "
                "iteration count to fit. Raise max_steps or lower the target."
            )
        return Observation(self.staleness, tuple(float(p) for p in self.stage_parameters), float(self.iterations))


def measure_profiles(
    model_factory: Callable[[int], nn.Sequential],
    batches: Callable[[int], Iterable[Any]],
    *,
    profiles: Sequence[Profile],
    seeds: Sequence[int],
    num_microbatches: int,
    make_optimizer: Callable[[list[nn.Parameter]], Optimizer],
    loss_fn: Callable[[Any, Any], Tensor],
    eval_fn: Callable[[nn.Sequential], float],
    target: float,
    eval_every: int,
    max_steps: int,
    mode: Literal["max", "min"] = "max",
    stop_at_target: bool = True,
    lr_scale: float = 1.0,
) -> list[ProfileRun]:
    """Runs :func:`steps_to_target` for every seed and profile (seed-major, so each seed's runs are paired).

    Every profile of one seed starts from the same weights (``model_factory(seed)``) and sees the same
    batches (``batches(seed)``), so the profiles differ only in their staleness. The factories are called
    inside :func:`torch.random.fork_rng` after ``torch.manual_seed(seed)``, which makes a factory that
    draws from torch's global generator deterministic too, without changing the caller's generator.

    Args:
        model_factory: ``seed -> nn.Sequential``, fresh weights for each call.
        batches: ``seed -> training batches`` in a fixed order; called once per run.
        profiles: numbers of stages and/or explicit staleness lists, each partitioned by parameter count
            with :func:`~lightning_dynpipe.plan.balance_by_weights`; and/or partitions, each measured with its own
            balance and PipeDream's staleness (to calibrate on the partitions a run may move between).
        seeds: the seeds to repeat every profile with.
        num_microbatches, make_optimizer, loss_fn, eval_fn, target, eval_every, max_steps, mode,
            stop_at_target, lr_scale: as for :func:`steps_to_target`.

    Returns:
        One :class:`ProfileRun` per ``(seed, profile)``, in that order.
    """
    if not profiles or not seeds:
        raise ConfigurationError(
            f"measure_profiles needs at least one profile and one seed; got profiles={list(profiles)}, "
            f"seeds={list(seeds)}. Try profiles=[1, 2, 4], seeds=[0, 1, 2]."
        )
    runs: list[ProfileRun] = []
    for seed in seeds:
        for profile in profiles:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                probe = model_factory(seed)  # the run's fresh model; also gives the parameter counts
            part, stale, stage_params = resolve_profile(probe, profile)
            curve: list[tuple[int, float]] = []
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                steps = steps_to_target(
                    lambda probe=probe: probe,  # type: ignore[misc]
                    batches(seed),
                    num_stages=part.num_stages,
                    balance=part.balance,
                    staleness=stale,
                    num_microbatches=num_microbatches,
                    make_optimizer=make_optimizer,
                    loss_fn=loss_fn,
                    eval_fn=eval_fn,
                    target=target,
                    eval_every=eval_every,
                    max_steps=max_steps,
                    mode=mode,
                    stop_at_target=stop_at_target,
                    lr_scale=lr_scale,
                    on_eval=lambda step, value, curve=curve: curve.append((step, value)),  # type: ignore[misc]
                )
            run = ProfileRun(
                profile=profile if isinstance(profile, (int, Partition)) else tuple(profile),
                seed=seed,
                balance=part.balance,
                staleness=stale,
                stage_parameters=stage_params,
                steps=steps,
                num_microbatches=num_microbatches,
                curve=tuple(curve),
            )
            log.info(
                "calibration: profile %s balance %s seed %d -> %s steps",
                list(stale),
                list(part.balance),
                seed,
                steps,
            )
            runs.append(run)
    return runs


def median_observations(runs: Sequence[ProfileRun]) -> list[Observation]:
    """One :class:`~lightning_dynpipe.plan.Observation` per profile: the median iterations over its seeds.

    Fitting medians weighs every profile equally, and one slow seed does not pull the fit.

    Raises:
        ConfigurationError: a run that never reached the target (its steps-to-target is undefined).
    """
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[ProfileRun]] = {}
    for run in runs:
        groups.setdefault((run.staleness, run.stage_parameters), []).append(run)
    out = []
    for (stale, params), group in groups.items():
        missing = [r.seed for r in group if r.iterations is None]
        if missing:
            raise ConfigurationError(
                f"Profile {list(stale)} did not reach the target for seeds {missing} within max_steps, so "
                "steps-to-target is undefined. Raise max_steps, lower the target, or drop the profile."
            )
        iters = statistics.median(float(r.iterations) for r in group if r.iterations is not None)
        out.append(Observation(stale, tuple(float(p) for p in params), iters))
    return out


def calibrate_beta(
    model_factory: Callable[[int], nn.Sequential],
    batches: Callable[[int], Iterable[Any]],
    *,
    profiles: Sequence[Profile],
    seeds: Sequence[int],
    num_microbatches: int,
    make_optimizer: Callable[[list[nn.Parameter]], Optimizer],
    loss_fn: Callable[[Any, Any], Tensor],
    eval_fn: Callable[[nn.Sequential], float],
    target: float,
    eval_every: int,
    max_steps: int,
    mode: Literal["max", "min"] = "max",
    i0: float | None = None,
    lr_scale: float = 1.0,
) -> ConvergenceModel:
    """Measures steps-to-target for each staleness profile and fits ``I0`` and ``beta`` of the convergence model.

    Each profile is measured with every seed (:func:`measure_profiles`); the median iterations per profile
    are fitted by least squares with :func:`~lightning_dynpipe.plan.fit_beta`. ``I0`` comes out in
    micro-batches. Include at least two profiles with different weighted staleness (e.g. ``[1, 2, 4]``),
    or pass ``i0``.

    Example::

        model = calibrate_beta(model_factory, batches, profiles=[1, 2, 4], seeds=[0, 1, 2],
                               num_microbatches=4, make_optimizer=sgd, loss_fn=xent, eval_fn=val_acc,
                               target=0.92, eval_every=5, max_steps=600)

    Args:
        model_factory, batches, profiles, seeds, num_microbatches, make_optimizer, loss_fn, eval_fn,
            target, eval_every, max_steps, mode: as for :func:`measure_profiles`.
        i0: fix ``I0`` (micro-batches) and fit only ``beta``.
        lr_scale: the learning-rate scale of every update. **Pass the scale the strategy trains with**:
            ``beta`` measured at another scale describes another training run (on an MNIST MLP with SGD,
            0.110 unscaled against 0 at ``1/M``). The strategy's factor is ``strategy.config.lr_scale``;
            its default ``"auto"`` is ``1/M`` under ``async``. The default here, 1, is unscaled.

    Returns:
        The fitted :class:`~lightning_dynpipe.plan.ConvergenceModel`.

    Raises:
        ConfigurationError: a profile that never reached the target, or too few distinct profiles to fit.
    """
    runs = measure_profiles(
        model_factory,
        batches,
        profiles=profiles,
        seeds=seeds,
        num_microbatches=num_microbatches,
        make_optimizer=make_optimizer,
        loss_fn=loss_fn,
        eval_fn=eval_fn,
        target=target,
        eval_every=eval_every,
        max_steps=max_steps,
        mode=mode,
        lr_scale=lr_scale,
    )
    model = fit_beta(median_observations(runs), i0=i0)
    log.info("calibration: fitted I0=%.4g micro-batches, beta=%.4g", model.i0, model.beta)
    return model
