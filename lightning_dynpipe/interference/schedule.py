"""A declarative interference schedule: which source runs on which stage over which steps.

Pure data (:class:`InterferenceSpec`, :class:`InterferenceSchedule`) plus :func:`make_interference`, which turns
one entry into a start/stop source on the rank that hosts its stage. The Lightning side is
:class:`~lightning_dynpipe.interference.callback.InterferenceCallback`.

YAML form (a list, or a mapping with an ``interference`` list)::

    interference:
      - {kind: cpu_hog, stage: 0, start_step: 100, duty_cycle: 1.0}         # until the end of training
      - {kind: cpu_quota, stage: 1, start_step: 0, stop_step: 200, fraction: 0.25}
      - {kind: link_delay, stage: 0, start_step: 50, delay_s: 0.005, jitter_s: 0.002}   # boundary 0 -> 1
      - {kind: link_delay, stage: 1, delay_s: 0.001, bandwidth_Bps: 5.0e+7}             # boundary 1 -> 2 at 50 MB/s
      - {kind: gpu, stage: 1, start_step: 10, stop_step: 20, duty_cycle: 0.5}

Steps are ``trainer.global_step`` values; an entry is active for ``start_step <= step < stop_step``.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

from lightning_dynpipe.interference.base import Interference, InterferenceConfigError

__all__ = [
    "InterferenceKind",
    "InterferenceSpec",
    "InterferenceSchedule",
    "launched_ranks",
    "make_interference",
    "KINDS",
]

InterferenceKind = Literal["cpu_hog", "cpu_quota", "link_delay", "gpu"]
KINDS: tuple[str, ...] = get_args(InterferenceKind)

# The parameters each kind takes (others must be left unset), and those it needs.
_PARAMS: dict[str, frozenset[str]] = {
    "cpu_hog": frozenset({"duty_cycle", "cores", "period_s"}),
    "cpu_quota": frozenset({"fraction", "period_s"}),
    "link_delay": frozenset({"delay_s", "jitter_s", "seed", "bandwidth_Bps"}),
    "gpu": frozenset({"duty_cycle", "period_s"}),
}
_REQUIRED: dict[str, frozenset[str]] = {"cpu_quota": frozenset({"fraction"}), "link_delay": frozenset({"delay_s"})}
_ALL_PARAMS = frozenset().union(*_PARAMS.values())


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class InterferenceSpec:
    """One schedule entry: an interference ``kind`` on ``stage`` for steps ``[start_step, stop_step)``.

    Example::

        InterferenceSpec("cpu_hog", stage=0, start_step=100, duty_cycle=0.5)
        InterferenceSpec("cpu_quota", stage=1, fraction=0.25, stop_step=500)
        InterferenceSpec("link_delay", stage=0, delay_s=0.005, jitter_s=0.001)   # boundary 0 -> 1
        InterferenceSpec("link_delay", stage=0, delay_s=0.002, bandwidth_Bps=50e6)   # and 50 MB/s

    Attributes:
        kind: ``"cpu_hog"`` (:class:`~lightning_dynpipe.interference.cpu.CpuHog`), ``"cpu_quota"``
            (:class:`~lightning_dynpipe.interference.quota.CpuLimit`: a cgroup quota, else a throttle),
            ``"link_delay"`` (:class:`~lightning_dynpipe.interference.link.LinkDelay`) or ``"gpu"``
            (:class:`~lightning_dynpipe.interference.gpu.GpuContention`).
        stage: the stage slowed down; for ``link_delay``, the boundary ``stage -> stage + 1``. Every
            data-parallel replica of the stage gets the interference.
        start_step: first ``trainer.global_step`` with the interference on.
        stop_step: first step with it off again; ``None``: until training ends.
        duty_cycle: ``cpu_hog``, ``gpu``: share of each period busy, in (0, 1]; default 1.
        fraction: ``cpu_quota`` (required): share of one CPU the stage's process may use.
        delay_s: ``link_delay`` (required): mean delay added to each message's delivery, seconds.
        jitter_s: ``link_delay``: half-width of uniform jitter, seconds; default 0.
        seed: ``link_delay``: seed of the jitter; default 0.
        bandwidth_Bps: ``link_delay``: the emulated link's bandwidth, bytes per second; default unlimited.
        cores: ``cpu_hog``: cores to burn; default: every core the stage's process may run on (pin stages to
            their own cores, as the benchmarks do, to hit only one stage).
        period_s: ``cpu_hog`` (default 0.05), ``gpu`` (0.05), ``cpu_quota`` (0.1 cgroup, 0.02 throttle).
    """

    kind: InterferenceKind
    stage: int
    start_step: int = 0
    stop_step: int | None = None
    duty_cycle: float | None = None
    fraction: float | None = None
    delay_s: float | None = None
    jitter_s: float | None = None
    seed: int | None = None
    cores: tuple[int, ...] | None = None
    period_s: float | None = None
    bandwidth_Bps: float | None = None

    def __post_init__(self) -> None:
        def bad(field: str, rule: str, fix: str = "") -> InterferenceConfigError:
            value = getattr(self, field)
            return InterferenceConfigError(
                f"field {field!r} {rule}; got {value!r}." + (f" {fix}" if fix else ""), field=field
            )

        if self.kind not in KINDS:
            close = difflib.get_close_matches(str(self.kind), KINDS, n=1)
            raise bad("kind", f"must be one of {', '.join(KINDS)}", f"Did you mean {close[0]!r}?" if close else "")
        if not _is_int(self.stage) or self.stage < 0:
            raise bad("stage", "must be a stage index (an integer >= 0)")
        if not _is_int(self.start_step) or self.start_step < 0:
            raise bad("start_step", "must be an integer >= 0 (a trainer.global_step)")
        if self.stop_step is not None and (not _is_int(self.stop_step) or self.stop_step <= self.start_step):
            raise bad("stop_step", f"must be an integer > start_step ({self.start_step}), or None for 'until the end'")
        for name in sorted(_ALL_PARAMS - _PARAMS[self.kind]):
            if getattr(self, name) is not None:
                takes = sorted(k for k, v in _PARAMS.items() if name in v)
                raise bad(
                    name,
                    f"does not apply to kind {self.kind!r} (it applies to {', '.join(takes)}; "
                    f"{self.kind!r} takes {', '.join(sorted(_PARAMS[self.kind]))})",
                    "Remove it, or change the kind.",
                )
        for name in sorted(_REQUIRED.get(self.kind, frozenset())):
            if getattr(self, name) is None:
                raise bad(name, f"is required for kind {self.kind!r}")
        if self.duty_cycle is not None and not (_is_number(self.duty_cycle) and 0 < self.duty_cycle <= 1):
            raise bad("duty_cycle", "must be a number in (0, 1]", "Use 1.0 for always busy, 0.5 for half the time.")
        cpus = os.cpu_count() or 1
        if self.fraction is not None and not (_is_number(self.fraction) and 0 < self.fraction):
            raise bad("fraction", "must be a positive number (CPUs' worth of time, e.g. 0.25 of one core)")
        for name in ("delay_s", "jitter_s"):
            v = getattr(self, name)
            if v is not None and not (_is_number(v) and v >= 0):
                raise bad(name, "must be a number of seconds >= 0")
        if self.bandwidth_Bps is not None and not (_is_number(self.bandwidth_Bps) and self.bandwidth_Bps > 0):
            raise bad("bandwidth_Bps", "must be a number of bytes per second > 0", "E.g. 50e6 for 50 MB/s.")
        if self.kind == "link_delay" and not (self.delay_s or self.jitter_s or self.bandwidth_Bps):
            raise bad(
                "delay_s",
                "and jitter_s are both 0 with no bandwidth_Bps, which would do nothing",
                "Set e.g. delay_s: 0.005.",
            )
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer")
        if self.period_s is not None and not (_is_number(self.period_s) and 0 < self.period_s <= 60):
            raise bad("period_s", "must be a number of seconds in (0, 60]")
        if self.cores is not None:
            if isinstance(self.cores, (str, bytes)) or not isinstance(self.cores, Sequence):
                raise bad("cores", "must be a list of core ids")
            object.__setattr__(self, "cores", tuple(self.cores))
            assert self.cores is not None
            if (
                not self.cores
                or not all(_is_int(c) and c >= 0 for c in self.cores)
                or len(set(self.cores)) != len(self.cores)
            ):
                raise bad("cores", f"must be a non-empty list of distinct core ids >= 0 (this machine has {cpus})")
        # Numbers from YAML may be ints; store floats so equal specs compare equal.
        for name in ("duty_cycle", "fraction", "delay_s", "jitter_s", "period_s", "bandwidth_Bps"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, float(v))

    def active_at(self, step: int) -> bool:
        """Whether the interference is on at ``step``."""
        return self.start_step <= step and (self.stop_step is None or step < self.stop_step)

    def hosted_by(self, stage_idx: int) -> bool:
        """Whether a rank running ``stage_idx`` starts this entry (both sides of a boundary for ``link_delay``)."""
        if self.kind == "link_delay":
            return stage_idx in (self.stage, self.stage + 1)
        return stage_idx == self.stage

    def params(self) -> dict[str, Any]:
        """The kind's parameters that are set."""
        return {name: getattr(self, name) for name in sorted(_PARAMS[self.kind]) if getattr(self, name) is not None}

    def __str__(self) -> str:
        where = f"boundary {self.stage}->{self.stage + 1}" if self.kind == "link_delay" else f"stage {self.stage}"
        until = "end" if self.stop_step is None else str(self.stop_step)
        params = ", ".join(f"{k}={v}" for k, v in self.params().items())
        return f"{self.kind} on {where}, steps [{self.start_step}, {until})" + (f", {params}" if params else "")


_FIELD_NAMES = tuple(f.name for f in fields(InterferenceSpec))


@dataclass(frozen=True)
class InterferenceSchedule:
    """An ordered set of :class:`InterferenceSpec` entries; pure data.

    Example::

        schedule = InterferenceSchedule.from_config([
            {"kind": "cpu_hog", "stage": 0, "start_step": 100},
            {"kind": "cpu_quota", "stage": 1, "fraction": 0.25, "start_step": 0, "stop_step": 200},
        ])
        schedule = InterferenceSchedule.from_config("interference.yaml")
        trainer = Trainer(strategy="dynpipe", callbacks=[InterferenceCallback(schedule)])
    """

    specs: tuple[InterferenceSpec, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "specs", tuple(self.specs))
        for i, spec in enumerate(self.specs):
            if not isinstance(spec, InterferenceSpec):
                raise InterferenceConfigError(
                    f"interference entry {i}: expected an InterferenceSpec; got "
                    f"{type(spec).__name__}. Use InterferenceSchedule.from_config for "
                    "dicts or YAML.",
                    entry=i,
                )

    def __iter__(self) -> Iterator[InterferenceSpec]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def __getitem__(self, i: int) -> InterferenceSpec:
        return self.specs[i]

    @classmethod
    def from_config(
        cls, config: InterferenceSchedule | Sequence[Mapping[str, Any] | InterferenceSpec] | str | os.PathLike[str]
    ) -> InterferenceSchedule:
        """A schedule from a list of dicts (or specs), or from a YAML file holding such a list.

        The YAML file holds either the list itself or a mapping with the list under ``interference``.

        Raises:
            InterferenceConfigError: naming the entry and the field that break a rule (an unknown kind or
                field, a missing or misplaced parameter, a value out of range), or a file that is not a list.
        """
        if isinstance(config, InterferenceSchedule):
            return config
        if isinstance(config, (str, os.PathLike)):
            return cls.from_config(_load_yaml(Path(config)))
        if isinstance(config, Mapping) or not isinstance(config, Sequence):
            raise InterferenceConfigError(
                f"An interference schedule is a list of entries (dicts), or the path of a YAML file holding one; "
                f"got {type(config).__name__}. Wrap a single entry in a list."
            )
        entries: Sequence[Any] = config
        specs = []
        for i, entry in enumerate(entries):
            specs.append(_spec_from_entry(i, entry))
        return cls(tuple(specs))

    def validate(self, num_stages: int) -> None:
        """Checks each entry's stage against a pipeline of ``num_stages`` stages.

        Raises:
            InterferenceConfigError: a stage (or, for ``link_delay``, a boundary) the pipeline does not have.
        """
        for i, spec in enumerate(self.specs):
            if spec.kind == "link_delay" and spec.stage >= num_stages - 1:
                valid = f"0..{num_stages - 2}" if num_stages > 1 else "none (a 1-stage pipeline has no boundary)"
                raise InterferenceConfigError(
                    f"interference entry {i} ({spec}): field 'stage' names boundary {spec.stage} -> {spec.stage + 1}, "
                    f"which a {num_stages}-stage pipeline does not have; valid boundaries: {valid}.",
                    field="stage",
                    entry=i,
                )
            if spec.stage >= num_stages:
                raise InterferenceConfigError(
                    f"interference entry {i} ({spec}): field 'stage' is {spec.stage}, but the pipeline has "
                    f"{num_stages} stage(s) (0..{num_stages - 1}).",
                    field="stage",
                    entry=i,
                )

    def wanted(self, step: int, stage_idx: int) -> list[int]:
        """Indices of the entries a rank running ``stage_idx`` should have on at ``step``."""
        return [i for i, s in enumerate(self.specs) if s.active_at(step) and s.hosted_by(stage_idx)]


def _spec_from_entry(i: int, entry: Mapping[str, Any] | InterferenceSpec) -> InterferenceSpec:
    if isinstance(entry, InterferenceSpec):
        return entry
    if not isinstance(entry, Mapping):
        raise InterferenceConfigError(
            f"interference entry {i}: expected a mapping such as {{kind: cpu_hog, stage: 0}}; got {entry!r}.", entry=i
        )
    unknown = sorted(str(k) for k in entry if k not in _FIELD_NAMES)
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, _FIELD_NAMES, n=1)
        raise InterferenceConfigError(
            f"interference entry {i}: unknown field {name!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; valid fields: {', '.join(_FIELD_NAMES)}.",
            field=name,
            entry=i,
        )
    for required in ("kind", "stage"):
        if required not in entry:
            raise InterferenceConfigError(
                f"interference entry {i}: field {required!r} is required (e.g. {{kind: cpu_hog, stage: 0, "
                f"start_step: 100}}); got fields {sorted(entry)}.",
                field=required,
                entry=i,
            )
    try:
        return InterferenceSpec(**entry)
    except InterferenceConfigError as exc:
        raise InterferenceConfigError(
            f"interference entry {i} (kind {entry.get('kind')!r}, stage {entry.get('stage')!r}): {exc}",
            field=exc.field,
            entry=i,
        ) from None


def _load_yaml(path: Path) -> Sequence[Mapping[str, Any]]:
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML comes with Lightning
        raise ImportError("Reading an interference schedule from YAML needs PyYAML: pip install pyyaml") from None
    try:
        text = path.read_text()
    except OSError as exc:
        raise InterferenceConfigError(f"Cannot read the interference schedule {str(path)!r}: {exc}.") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InterferenceConfigError(f"The interference schedule {str(path)!r} is not valid YAML: {exc}") from None
    if isinstance(data, Mapping) and "interference" in data:
        data = data["interference"]
    if not isinstance(data, list):
        raise InterferenceConfigError(
            f"The interference schedule {str(path)!r} must hold a list of entries (or a mapping with the list under "
            f"'interference'); got {type(data).__name__}."
        )
    return data


def launched_ranks(host: Any) -> list[int]:
    """The pids of the other ranks this process launched: Lightning's default launcher (a script run again per rank)
    starts them from rank 0's process, so they are its children but not its helpers, and a limit on rank 0's
    stage must leave them out. Empty where this process launched none (other ranks, the spawn and fork launchers,
    torchrun, SLURM)."""
    launcher = getattr(host, "launcher", None)
    return [p.pid for p in getattr(launcher, "procs", None) or () if isinstance(getattr(p, "pid", None), int)]


def make_interference(spec: InterferenceSpec, host: Any) -> Interference:
    """The (unstarted) source for ``spec`` on the rank whose strategy is ``host``.

    ``cpu_hog`` burns ``spec.cores`` (default: the cores this process may use); ``cpu_quota`` limits this
    process with :class:`~lightning_dynpipe.interference.quota.CpuLimit`, with the processes it started except the
    job's other ranks (:func:`launched_ranks`); ``link_delay`` emulates a slower link
    for this rank's sends across boundary ``spec.stage``; ``gpu`` loads ``host.root_device``.
    """
    if spec.kind == "cpu_hog":
        from lightning_dynpipe.interference.cpu import CpuHog, allowed_cores

        return CpuHog(
            cores=list(spec.cores) if spec.cores is not None else allowed_cores(),
            duty_cycle=spec.duty_cycle if spec.duty_cycle is not None else 1.0,
            period_s=spec.period_s if spec.period_s is not None else 0.05,
        )
    if spec.kind == "cpu_quota":
        from lightning_dynpipe.interference.quota import CpuLimit

        assert spec.fraction is not None  # required by the spec
        return CpuLimit(os.getpid(), spec.fraction, spec.period_s, exclude=launched_ranks(host))
    if spec.kind == "link_delay":
        from lightning_dynpipe.interference.link import LinkDelay

        assert spec.delay_s is not None
        link = LinkDelay(spec.delay_s, spec.jitter_s or 0.0, spec.seed or 0, float(spec.bandwidth_Bps or math.inf))
        return link.bound(host, spec.stage)
    if spec.kind == "gpu":
        from lightning_dynpipe.interference.gpu import GpuContention

        return GpuContention(
            getattr(host, "root_device", "cuda"),
            duty_cycle=spec.duty_cycle if spec.duty_cycle is not None else 1.0,
            period_s=spec.period_s if spec.period_s is not None else 0.05,
        )
    raise AssertionError(f"unhandled interference kind {spec.kind!r}")  # pragma: no cover - checked by the spec
