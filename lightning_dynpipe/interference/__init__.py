"""Interference injection for tests, benchmarks and what-if runs: slow a stage down on purpose.

Sources (each with ``start()``, ``stop()``, ``active`` and ``with``):

* :class:`CpuHog`: busy-loop processes pinned to chosen cores, with a duty cycle;
  :func:`pin_current_process` pins a stage to its own cores.
* :class:`CpuBursts`: a bursty neighbour, short busy loops on random cores at random times.
* :class:`CpuQuota`: a cgroup CPU bandwidth limit on a process (cgroup v2 ``cpu.max`` or the v1 cpu
  controller); :class:`InterferenceUnavailable` with the reasons where the machine does not allow it.
* :class:`CpuThrottle`: the same average CPU share by SIGSTOP/SIGCONT from a helper process, without
  privileges; :class:`CpuLimit` picks the quota where possible and the throttle otherwise.
* :class:`LinkDelay`: delay and jitter on the sends across one stage boundary, inside DynPipe's P2P layer.
* :class:`GpuContention`: a matmul loop on a CUDA device.

A declarative :class:`InterferenceSchedule` of :class:`InterferenceSpec` entries (from dicts or YAML) switches
them by training step through :class:`InterferenceCallback` (the only part that imports Lightning; it is
imported on first use).

Example::

    from lightning_dynpipe.interference import InterferenceCallback

    callback = InterferenceCallback([
        {"kind": "cpu_hog", "stage": 0, "start_step": 100, "duty_cycle": 1.0},
        {"kind": "cpu_quota", "stage": 1, "start_step": 300, "stop_step": 600, "fraction": 0.25},
    ])
    trainer = Trainer(strategy="dynpipe", devices=2, callbacks=[callback])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_dynpipe.interference.base import (
    Interference,
    InterferenceConfigError,
    InterferenceError,
    InterferenceUnavailable,
)
from lightning_dynpipe.interference.cpu import CpuBursts, CpuHog, allowed_cores, pin_current_process, pin_process
from lightning_dynpipe.interference.gpu import GpuContention
from lightning_dynpipe.interference.link import BoundLinkDelay, LinkDelay
from lightning_dynpipe.interference.quota import CpuLimit, CpuQuota
from lightning_dynpipe.interference.schedule import (
    InterferenceSchedule,
    InterferenceSpec,
    make_interference,
)
from lightning_dynpipe.interference.throttle import CpuThrottle

if TYPE_CHECKING:
    from lightning_dynpipe.interference.callback import InterferenceCallback, InterferenceEvent

__all__ = [
    "Interference",
    "InterferenceError",
    "InterferenceUnavailable",
    "InterferenceConfigError",
    "CpuHog",
    "CpuBursts",
    "pin_current_process",
    "pin_process",
    "allowed_cores",
    "CpuQuota",
    "CpuThrottle",
    "CpuLimit",
    "LinkDelay",
    "BoundLinkDelay",
    "GpuContention",
    "InterferenceSpec",
    "InterferenceSchedule",
    "make_interference",
    "InterferenceCallback",
    "InterferenceEvent",
]


def __getattr__(name: str) -> Any:
    # The callback imports Lightning; everything else here works without it.
    if name in ("InterferenceCallback", "InterferenceEvent"):
        from lightning_dynpipe.interference import callback

        return getattr(callback, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
