"""The baseline predictor: each stage's slowdown measured against its profile, carried over to any partition.

A stage's slowdown is its measured compute over what the set-up profile predicts for its layers, relative to
the least slowed speed the pipeline shows (so a profile taken by another clock or on a quieter machine does not
look like interference). A stage whose process runs under a cgroup CPU limit of ``q < 1`` core is at least
``1/q`` slowed, whatever its compute looked like: under a quota the measured stretch shrinks as the stage's share
of the work shrinks (the throttling lands in its waits too), which hid the better partition. The slowdown belongs
to the stage (its device and what runs beside it), so a candidate partition's stage ``k`` is predicted as its
layers' profile times stage ``k``'s slowdown at the pipeline's speed (the least slowed speed's measured compute
over profile), and a boundary's message as the link model's time for the activation that crosses it. Both are
seconds, so a machine slower or faster than when the profile was taken weighs the stages against the link as it
runs: on a small model whose layers measure several times their profile in the pipeline, compute in the profile's
units would be priced at a fraction of its time against the link's. The slowdowns a prediction carries are likewise
each stage's stretch at the pipeline's speed (:func:`measured_slowdowns` gives the relative ones).

**The least slowed speed.** Without history it is the least slowed stage of the window. The predictor also
remembers the windows it is given (``observe``, which the adaptive loop calls at every check): the speed the
pipeline showed (the second lowest of the earlier windows' least slowed stages, so one window that read fast does
not set it), with a tolerance for the windows' noise (10%). A window's least slowed stage that reads slower than
that counts as slowed by the excess. This matters when interference lands on the stage that was the least slowed:
a stage with a small share of the work reads as slowed when nothing interferes (its compute per micro-batch is
mostly fixed costs the per-layer profile does not hold), so under a hog on the large stage, taken relative to the
window alone, the hogged stage would read 1.0 and set the pipeline's speed: the other stages' quiet readings would be
split against that slowed speed (below), their fixed costs read smaller, and the layers they would receive priced at
the hogged stage's speed.

**A stage's fixed costs.** A stage's compute per micro-batch is not its layers' profile times one factor: the
last stage also runs the loss and the loop's work per micro-batch, every stage dispatches its micro-batches, and a
stage with little work reads several times its profile with nothing beside it (the demo CNN's classifier alone on
the last stage: 4.8x). Carried to other layers as a stretch, that reading prices every layer the stage would receive
as slowed: from that window the CNN's ``[1, 4]`` was priced at 51.9 ms per micro-batch for its last stage where it
measured 10.4. So the predictor remembers, per stage and layer set, the readings of the
windows in which the stage showed no sign of interference (:meth:`PipelineWindow.signs`) and ran under no CPU
limit below one core: the second lowest of them is the stage's quiet reading under those layers. Its excess over the
pipeline's speed is a fixed cost per micro-batch that stays with the stage whatever layers it holds; what the stage
reads beyond its quiet reading stretches its layers and that fixed cost together (interference slows both). A
stage priced from a layer set it has not measured quiet under (a quota or a hog from the first window) is stretched
as before. On every clean cut of the CNN priced from every other's window, the slowest stage's error is 5.1%
(median) against 36% for the stretch (``benchmarks/stage_model.py``). ``fixed_costs=False`` keeps the stretch.

**The CPU a limited stage spends besides its layers.** A quota throttles the whole process: the framework's work
around the layers (the training loop, messages, the optimizer's glue) comes out of it too, and on a stage with few
layers that is most of its CPU. So where the window measured the stage's CPU per step (``StageTimes.cpu_s``), a
stage under a limit of ``q`` cores is predicted at no less than ``(other + M * layers) / q`` per step: ``layers``
the candidate's layers' profile, ``other`` the measured CPU per step less the profile of the layers (and updates)
it ran, both in the profile's units (the measured CPU over the least slowed stage's speed against its profile).
The layers moved in or out change the stage's CPU by their profile; the rest stays with the process, except its
messages' copies: where the set-up probe measured the CPU a process spends per byte of a message
(:attr:`CommModel.cpu_s_per_byte <lightning_dynpipe.plan.costs.CommModel>`; gloo), a candidate whose boundaries
next to the stage carry other activations changes the stage's CPU by that many bytes (per micro-batch, each
boundary's activation one way and its gradient the other). On the CNN under a quarter-core quota on its last
stage, the move from ``[4, 1]`` (an 8 KB activation at the boundary) to ``[2, 3]`` (400 KB) was priced 14% too fast
without it (``message_cpu=False``); the limited stage's CPU besides its layers grew by about 2 ns per byte of its
messages, of which the probe measures gloo's part, 0.16-1.0 ns, median 0.5, in one benchmark's 24 runs
(benchmarks/results/2026-12-08-refits-under-a-limit.md).

**The CPU a stage beside another process gets.** Another process busy on a stage's core (a co-located job's CPU
hog) takes a share of the core, and everything the stage does per step runs at the share it is left, its updates
and the loop's work as well as its layers; the stretch of its layers' compute leaves the rest out. On the CNN under
a hog on stage 0 (44 ms of CPU per step, busy 52% of the time, its main thread waiting for its core 51%) the move
off the hogged stage, ``[2, 3]`` to ``[1, 4]``, was priced 1-2% ahead for up to 90 steps, and ``[1, 4]`` then
measured 1.4-1.6x faster. A stage that competes for its cores
(:func:`~lightning_dynpipe.predictor.base.cpu_contended`) under no limit below one core is floored the same way,
with ``q`` the share of the core it obtained (:attr:`StageTimes.obtained_core_share`: busy over busy plus waiting),
where that is below one.

It has no spread model: its intervals are points.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.predictor.base import (
    Interval,
    PartitionPrediction,
    PipelineWindow,
    StageTimes,
    check_same_pipeline,
    cpu_contended,
)

__all__ = [
    "MeasuredSlowdownPredictor",
    "boundary_bytes",
    "cpu_limited_floors",
    "measured_slowdowns",
    "message_bytes",
    "quiet_split",
]


def measured_slowdowns(
    model_cost: ModelCost,
    partition: Partition,
    times: list[StageTimes] | tuple[StageTimes, ...],
    num_microbatches: int,
    *,
    reference: float | None = None,
) -> tuple[float, ...]:
    """Each stage's measured compute over the profile's prediction, relative to the least slowed stage (or to
    ``reference``, a measured compute over profile the pipeline showed before, where that is lower).

    A stage under a CPU limit of ``q < 1`` core (``StageTimes.cpu_limit``) counts as at least ``1/q`` slowed.

    Example::

        >>> cost = ModelCost.from_arrays([1.0] * 4, [2.0] * 4)
        >>> measured_slowdowns(cost, Partition((2, 2)), [StageTimes(12.0, 0), StageTimes(48.0, 0)], 2)
        (1.0, 4.0)
        >>> limited = [StageTimes(12.0, 0), StageTimes(18.0, 0, cpu_limit=0.25)]
        >>> measured_slowdowns(cost, Partition((2, 2)), limited, 2)
        (1.0, 4.0)
        >>> measured_slowdowns(cost, Partition((2, 2)), [StageTimes(24.0, 0), StageTimes(48.0, 0)], 2, reference=1.0)
        (2.0, 4.0)
    """
    ratios = _ratios(model_cost, partition, times, num_microbatches)
    return _slowdowns(ratios, _base(ratios, reference), times)


def _slowdowns(ratios: Sequence[float], base: float, times: Sequence[StageTimes]) -> tuple[float, ...]:
    """Each stage's ratio over ``base``, at least ``1/q`` under a CPU limit of ``q < 1`` core."""
    return tuple(
        max(r / base, 1.0 / q if (q := t.binding_cpu_limit) is not None else 1.0) for r, t in zip(ratios, times)
    )


def _ratios(
    model_cost: ModelCost, partition: Partition, times: Sequence[StageTimes], num_microbatches: int
) -> list[float]:
    """Each stage's measured compute over its layers' profile (1 where either is missing)."""
    return [1.0 if r is None else r for r in _measured_ratios(model_cost, partition, times, num_microbatches)]


def _measured_ratios(
    model_cost: ModelCost, partition: Partition, times: Sequence[StageTimes], num_microbatches: int
) -> list[float | None]:
    """Each stage's measured compute over its layers' profile (``None`` where either is missing)."""
    ratios: list[float | None] = []
    for k, t in enumerate(times):
        expected = num_microbatches * sum(model_cost.layers[i].compute_s for i in partition.stage_layers(k))
        ratios.append(t.compute_s / expected if expected > 0 and t.compute_s > 0 else None)
    return ratios


def quiet_split(quiet: float, reading: float, profile_s: float) -> tuple[float, float]:
    """How a stage's reading splits when it read ``quiet`` with nothing beside it under the layers it holds (both
    relative to the pipeline's speed): ``(stretch, fixed)`` with ``stretch * (profile_s + fixed) == reading *
    profile_s``. The fixed cost per micro-batch (in the profile's seconds) is the quiet reading's excess over the
    pipeline's speed, none below it and at most the whole reading; the stretch is what the stage reads beyond it.

    Example::

        >>> quiet_split(quiet=2.0, reading=3.0, profile_s=1.0)  # 1 s fixed, and 1.5x over both
        (1.5, 1.0)
        >>> quiet_split(quiet=0.9, reading=3.0, profile_s=1.0)  # read quiet at the pipeline's speed: all stretch
        (3.0, 0.0)
    """
    own = min(max(quiet, 1.0), reading)
    return reading / own, (own - 1.0) * profile_s


def _second_lowest(ascending: Sequence[float]) -> float:
    """The second lowest of sorted values (the lowest of one): robust to one window that read fast."""
    return ascending[min(1, len(ascending) - 1)]


def _base(ratios: Sequence[float], reference: float | None) -> float:
    """The least slowed speed: the least ratio, or ``reference`` where that is lower."""
    least = min(ratios)
    return min(least, reference) if reference is not None and reference > 0 else least


def cpu_limited_floors(
    model_cost: ModelCost,
    window: PipelineWindow,
    candidate: Partition,
    *,
    seconds: bool = False,
    reference: float | None = None,
    message_cpu_s_per_byte: float = 0.0,
) -> tuple[float | None, ...]:
    """Per stage of ``candidate``, the least compute per micro-batch the CPU it gets allows, in the profile's units
    (the module's "CPU a limited stage spends besides its layers" and "CPU a stage beside another process gets";
    ``seconds=True``: in seconds at the machine's present speed, the least slowed stage's measured compute over its
    profile, or ``reference`` where lower, as in :func:`measured_slowdowns`); ``None`` for a stage without a measured
    CPU per step, or under no limit below one core and not competing for its cores (or not measurably slowed by it).
    ``message_cpu_s_per_byte``: the CPU a process spends per byte of a message it sends or receives; the bytes the
    candidate's boundaries next to a stage carry beyond those of the window's partition (per micro-batch an
    activation and its gradient per boundary) add that CPU to the stage's.

    Example (the profile: 1 ms per layer; the unlimited stage runs at its profile; the limited one, a quarter of a
    core, used 5 ms of CPU per step of 2 micro-batches, of which its layers 2 ms)::

        >>> cost = ModelCost.from_arrays([1e-3] * 4, [0.0] * 4)
        >>> times = (StageTimes(0.006, 0.02), StageTimes(0.008, 0.02, cpu_limit=0.25, cpu_s=0.005))
        >>> window = PipelineWindow(Partition((3, 1)), times, 2)
        >>> [round(f * 1e3, 3) if f else f for f in cpu_limited_floors(cost, window, Partition((2, 2)))]
        [None, 14.0]

    The same stage under no limit but beside a CPU hog, busy 40% of the time and waiting for its core 40%: it got
    half of its core::

        >>> hogged = StageTimes(0.008, 0.02, cpu_s=0.005, cpu_share=0.4, run_queue_wait_share=0.4, other_cpu_load=0.5)
        >>> quiet = StageTimes(0.006, 0.02, cpu_share=0.3, other_cpu_load=0.0)
        >>> window = PipelineWindow(Partition((3, 1)), (quiet, hogged), 2)
        >>> [round(f * 1e3, 3) if f else f for f in cpu_limited_floors(cost, window, Partition((2, 2)))]
        [None, 7.0]
    """
    check_same_pipeline(window, candidate)
    M = window.num_microbatches
    base = _base(_ratios(model_cost, window.partition, window.stages, M), reference)
    floors: list[float | None] = []
    for k, (t, contended) in enumerate(zip(window.stages, cpu_contended(window))):
        q = _cpu_obtained(t, contended)
        if q is None or not t.cpu_s > 0 or not base > 0:
            floors.append(None)
            continue
        ran = window.partition.stage_layers(k)
        own = M * model_cost.compute_s(ran.start, ran.stop) + t.num_updates * model_cost.update_s(ran.start, ran.stop)
        moved = message_bytes(model_cost, candidate, k) - message_bytes(model_cost, window.partition, k)
        other = max(0.0, (t.cpu_s + M * moved * message_cpu_s_per_byte) / base - own)
        layers = candidate.stage_layers(k)
        floor = (other / M + model_cost.compute_s(layers.start, layers.stop)) / q
        floors.append(floor * base if seconds else floor)
    return tuple(floors)


def boundary_bytes(model_cost: ModelCost, partition: Partition) -> list[int]:
    """Per boundary of ``partition``, the bytes of the activation that crosses it (its last layer's output)."""
    return [model_cost.layers[partition.stage_layers(b)[-1]].activation_bytes for b in range(partition.num_stages - 1)]


def message_bytes(model_cost: ModelCost, partition: Partition, stage: int) -> int:
    """The bytes stage ``stage`` of ``partition`` sends and receives per micro-batch: per boundary next to it, the
    activation that crosses it one way and its gradient (as large) the other.

    Example::

        >>> cost = ModelCost.from_arrays([1.0] * 3, [1.0] * 3, activation_bytes=[100, 10, 1])
        >>> [message_bytes(cost, Partition((1, 1, 1)), k) for k in range(3)]
        [200, 220, 20]
    """
    crossing = boundary_bytes(model_cost, partition)
    return 2 * sum(crossing[b] for b in (stage - 1, stage) if 0 <= b < len(crossing))


def _cpu_obtained(times: StageTimes, contended: bool) -> float | None:
    """The cores a stage's process gets when it is ready to run, where below one: its CPU limit below one core, else,
    where it competes for its cores, the share of the core it obtained; ``None`` otherwise."""
    if times.binding_cpu_limit is not None:
        return times.binding_cpu_limit
    share = times.obtained_core_share if contended else None
    return share if share is not None and share < 1.0 else None


class MeasuredSlowdownPredictor:
    """The :class:`~lightning_dynpipe.predictor.base.InterferencePredictor` of measured per-stage slowdowns.

    Example::

        >>> cost = ModelCost.from_arrays([1.0] * 4, [2.0] * 4)
        >>> window = PipelineWindow(Partition((2, 2)), (StageTimes(12.0, 30.0), StageTimes(48.0, 50.0)), 2)
        >>> predictor = MeasuredSlowdownPredictor()
        >>> p = predictor.predict(cost, CommModel(), window, Partition((3, 1)))
        >>> p.slowdowns, [i.value for i in p.stage_compute_s]
        ((1.0, 4.0), [9.0, 12.0])

    After it has seen a window in which stage 0 ran at its profile, a window where stage 0 runs 2.2 times as slow
    reads as 2x slowed (what exceeds the 10% tolerance), not as stage 0 at the unloaded speed; the prediction is in
    seconds either way::

        >>> predictor.observe(cost, CommModel(), window)
        >>> hogged = PipelineWindow(Partition((2, 2)), (StageTimes(26.4, 50.0), StageTimes(48.0, 50.0)), 2)
        >>> reference = predictor.reference
        >>> [round(s, 3) for s in measured_slowdowns(cost, hogged.partition, hogged.stages, 2, reference=reference)]
        [2.0, 3.636]
        >>> [round(i.value, 3) for i in predictor.predict(cost, CommModel(), hogged, Partition((2, 2))).stage_compute_s]
        [13.2, 24.0]

    Args:
        remember: how many of the lowest least slowed speeds of the observed windows it keeps (the remembered speed
            is the second lowest of them, the lowest with one); ``0``: every window's slowdowns are relative to that
            window alone.
        tolerance: how much slower than the remembered speed a window's least slowed stage may read and still count
            as unslowed (the windows' noise); beyond it, the stage is slowed by what it reads over
            ``remembered * (1 + tolerance)``.
        fixed_costs: carry what a stage reads over the pipeline's speed while it shows no sign of interference as a
            fixed cost per micro-batch (see the module docstring); ``False``: as a stretch of every layer it would
            hold. Needs ``remember >= 1``.
        message_cpu: price the CPU a limited stage's messages cost by their bytes (``CommModel.cpu_s_per_byte``;
            see the module docstring); ``False``: the CPU it measured around its layers stays the same whatever its
            boundaries carry.
    """

    def __init__(
        self, remember: int = 3, tolerance: float = 0.1, fixed_costs: bool = True, message_cpu: bool = True
    ) -> None:
        if isinstance(remember, bool) or not isinstance(remember, int) or remember < 0:
            raise ConfigurationError(
                f"MeasuredSlowdownPredictor(remember=...) takes a whole number of windows >= 0; got {remember!r}. "
                "Use 0 for slowdowns relative to each window alone, or the default 3."
            )
        if not (isinstance(tolerance, (int, float)) and not isinstance(tolerance, bool) and 0 <= tolerance < 10):
            raise ConfigurationError(
                f"MeasuredSlowdownPredictor(tolerance=...) is a share of the remembered speed, >= 0 and < 10; got "
                f"{tolerance!r}. Use the default 0.1 (a window's least slowed stage counts as slowed by what it reads "
                "beyond 10% over the remembered speed)."
            )
        if not isinstance(fixed_costs, bool):
            raise ConfigurationError(
                f"MeasuredSlowdownPredictor(fixed_costs=...) takes True or False; got {fixed_costs!r}."
            )
        if not isinstance(message_cpu, bool):
            raise ConfigurationError(
                f"MeasuredSlowdownPredictor(message_cpu=...) takes True or False; got {message_cpu!r}."
            )
        self.remember = remember
        self.tolerance = float(tolerance)
        self.fixed_costs = fixed_costs
        self.message_cpu = message_cpu
        self._cost: ModelCost | None = None
        self._least: list[float] = []
        # per (stage, first layer, end layer): the lowest ratios the stage measured holding those layers, in windows
        # where it showed no sign of interference (and ran under no CPU limit below one core)
        self._quiet: dict[tuple[int, int, int], list[float]] = {}

    @property
    def reference(self) -> float | None:
        """The speed (measured compute over profile) a window's least slowed stage is measured against: the second
        lowest least slowed stage of the observed windows (the lowest with one window, robust to one window that
        read fast) times ``1 + tolerance``; ``None`` before any window."""
        if not self._least:
            return None
        return _second_lowest(self._least) * (1.0 + self.tolerance)

    def observe(
        self, model_cost: ModelCost, comm: CommModel, window: PipelineWindow, *, agreed_refit: int | None = None
    ) -> None:
        """Remembers the window's least slowed speed (the adaptive loop gives every window; see the module
        docstring). A window priced with another profile (another fit) starts the memory afresh; ``comm`` and
        ``agreed_refit`` are not used."""
        if model_cost is not self._cost:
            self._cost, self._least, self._quiet = model_cost, [], {}
        measured = _measured_ratios(model_cost, window.partition, window.stages, window.num_microbatches)
        ratios = [r for r in measured if r is not None]
        if ratios:
            self._least = sorted([*self._least, min(ratios)])[: self.remember]
        signs = window.signs()
        if not self.fixed_costs or not self.remember or len(signs) != len(measured):
            return  # without the stages' readings a quiet stage cannot be told from a slowed one
        for k, (r, sign, t) in enumerate(zip(measured, signs, window.stages)):
            if r is None or sign or t.binding_cpu_limit is not None:
                continue
            layers = window.partition.stage_layers(k)
            key = (k, layers.start, layers.stop)
            self._quiet[key] = sorted([*self._quiet.get(key, []), r])[: self.remember]

    def quiet_ratio(self, stage: int, layers: range) -> float | None:
        """The stage's measured compute over its layers' profile while it held ``layers`` and showed no sign of
        interference: the second lowest of the observed windows' (the lowest with one); ``None`` before any."""
        seen = self._quiet.get((stage, layers.start, layers.stop))
        return _second_lowest(seen) if seen else None

    def slowdowns(self, model_cost: ModelCost, window: PipelineWindow) -> tuple[float, ...]:
        """How the window's environment stretches each stage's profiled work, in seconds (the pipeline's speed times
        the stage's slowdown): what :meth:`predict` reports for every candidate, and what prices its updates."""
        ratios = _ratios(model_cost, window.partition, window.stages, window.num_microbatches)
        base = _base(ratios, self.reference if model_cost is self._cost else None)
        return tuple(base * s for s in _slowdowns(ratios, base, window.stages))

    def predict(
        self, model_cost: ModelCost, comm: CommModel, window: PipelineWindow, candidate: Partition
    ) -> PartitionPrediction:
        """See the module docstring."""
        reference = self.reference if model_cost is self._cost else None
        ratios = _ratios(model_cost, window.partition, window.stages, window.num_microbatches)
        base = _base(ratios, reference)
        slowdowns = _slowdowns(ratios, base, window.stages)
        floors = cpu_limited_floors(
            model_cost,
            window,
            candidate,
            seconds=True,
            reference=reference,
            message_cpu_s_per_byte=comm.cpu_s_per_byte if self.message_cpu else 0.0,
        )
        fixed = self._fixed_parts(model_cost, window, slowdowns, base)
        compute = []
        for k in range(candidate.num_stages):
            profile = sum(model_cost.layers[i].compute_s for i in candidate.stage_layers(k))
            stretch, own = fixed[k]
            # in seconds: the relative stretch at the pipeline's speed, as the messages are
            compute.append(Interval.point(max(base * stretch * (profile + own), floors[k] or 0.0)))
        boundaries = [Interval.point(float(comm.transfer_time(n))) for n in boundary_bytes(model_cost, candidate)]
        return PartitionPrediction(candidate, tuple(base * s for s in slowdowns), tuple(compute), tuple(boundaries))

    def _fixed_parts(
        self,
        model_cost: ModelCost,
        window: PipelineWindow,
        slowdowns: Sequence[float],
        base: float,
    ) -> list[tuple[float, float]]:
        """Per stage, (the stretch, the fixed cost per micro-batch in the profile's seconds) that price it under any
        layers: its slowdown and no fixed cost, unless it measured quiet under the layers it holds (see the module
        docstring; ``base``: the pipeline's speed the slowdowns are relative to)."""
        out = [(s, 0.0) for s in slowdowns]
        if not self.fixed_costs or model_cost is not self._cost:
            return out
        for k, t in enumerate(window.stages):
            layers = window.partition.stage_layers(k)
            quiet = self.quiet_ratio(k, layers)
            if quiet is None or t.binding_cpu_limit is not None or not base > 0:
                continue
            profile = sum(model_cost.layers[i].compute_s for i in layers)
            out[k] = quiet_split(quiet / base, slowdowns[k], profile)
        return out
