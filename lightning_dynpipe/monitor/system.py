"""Cheap readings of the stage process: CPU share, the machine's steal share, RSS, CUDA memory, GPU utilisation.

:class:`ProcessSampler` is called twice per training step (window start and end), so it avoids the slow
paths. On Linux it reads

* this process's CPU time with :func:`time.process_time` (all threads, user + system, nanosecond
  resolution; ``psutil.Process().cpu_times()`` counts the same time in 10 ms clock ticks, too coarse for a
  step of a few ms, and costs ~15 us),
* RSS from ``/proc/self/statm`` through a file descriptor kept open (~2 us),
* steal from ``/proc/stat``, at most every ``steal_interval_s`` (the counters tick at 100 Hz for the whole
  machine, so a per-step share would be mostly 0 or a whole tick),

and falls back to :mod:`psutil` where ``/proc`` is missing. On a CUDA device it adds the caching allocator's
current numbers (every sample) and NVML's utilisation and memory (through ``pynvml``, imported lazily, at
most every ``nvml_interval_s``: NVML itself averages utilisation over a sampling period of 1/6 s to 1 s).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any

import psutil
import torch

from lightning_dynpipe.monitor.cgroups import cpu_limit_cores
from lightning_dynpipe.monitor.stats import SystemReading

__all__ = ["ProcessSampler", "load_pynvml"]

log = logging.getLogger(__name__)

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_NVML_HINT = "GPU utilisation needs NVML's Python bindings: pip install nvidia-ml-py"


def load_pynvml() -> Any | None:
    """Imports and initialises ``pynvml`` (from the ``nvidia-ml-py`` distribution); None where unavailable.

    The deprecated ``pynvml`` wrapper distribution warns on import; the warning is about packaging, not about
    what we read, so it is silenced here.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            import pynvml  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        log.info("%s; the monitor reports gpu_util and gpu_mem_used as None.", _NVML_HINT)
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError subclasses; no driver, no permission
        log.info("NVML could not be initialised (%s); the monitor reports gpu_util and gpu_mem_used as None.", exc)
        return None
    return pynvml


class _ProcFile:
    """A ``/proc`` file read with ``pread`` on a descriptor kept open; reopened after a fork."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._pid = -1

    def read(self, size: int) -> bytes | None:
        pid = os.getpid()
        if self._fd is None or pid != self._pid:  # /proc/self was resolved when opened: a child must reopen
            self.close()
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except OSError:
                return None
            self._pid = pid
        try:
            return os.pread(self._fd, size, 0)
        except OSError:
            return None

    def close(self) -> None:
        if self._fd is not None:
            try:
                if self._pid == os.getpid():
                    os.close(self._fd)
            except OSError:
                pass
            self._fd = None


class ProcessSampler:
    """Measures this process's resource use between two calls.

    Example::

        sampler = ProcessSampler(device=torch.device("cpu"))
        sampler.mark()                 # start of a training step
        ...                            # the step
        reading = sampler.sample()     # the step's SystemReading; also starts the next window
        reading.cpu_share, reading.rss_bytes
        sampler.close()

    :meth:`sample` measures since the last :meth:`mark` or :meth:`sample` (or the construction).

    Args:
        device: the stage's device; CUDA readings are taken only for a ``cuda`` device.
        steal_interval_s: shortest span over which the steal share is computed, and between two reads of the
            cgroup CPU limit (both are reused in between).
        nvml_interval_s: shortest time between two NVML queries (the last values are reused in between).
        nvml: query NVML at all (on a CUDA device, when ``pynvml`` is importable).
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        steal_interval_s: float = 1.0,
        nvml_interval_s: float = 0.5,
        nvml: bool = True,
    ) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.steal_interval_s = steal_interval_s
        self.nvml_interval_s = nvml_interval_s
        self._statm = _ProcFile("/proc/self/statm")
        self._stat = _ProcFile("/proc/stat")
        self._psutil_proc: psutil.Process | None = None
        self._is_cuda = self.device.type == "cuda"
        self._want_nvml = nvml and self._is_cuda
        self._nvml: Any | None = None
        self._nvml_handle: Any | None = None
        self._nvml_tried = False
        self._nvml_at = -float("inf")
        self._gpu_util: float | None = None
        self._gpu_mem: int | None = None
        self._steal_at, self._steal_ref = time.perf_counter(), self._steal_counters()
        self._steal_share = 0.0
        self._cpu_limit = cpu_limit_cores()  # re-read with the steal share (a quota can come and go)
        self.mark()

    # ------------------------------------------------------------------ windows
    def mark(self) -> None:
        """Starts a measurement window."""
        self._t0 = time.perf_counter()
        self._cpu0 = time.process_time()

    def sample(self) -> SystemReading:
        """The readings over the window since the last :meth:`mark` / :meth:`sample`; starts a new window."""
        now = time.perf_counter()
        cpu = time.process_time()
        wall = now - self._t0
        cpu_s = cpu - self._cpu0
        self._t0, self._cpu0 = now, cpu
        if now - self._steal_at >= self.steal_interval_s:
            self._update_steal(now)
            self._cpu_limit = cpu_limit_cores()
        allocated = reserved = None
        if self._is_cuda:
            allocated, reserved = self._cuda_allocator()
            if self._want_nvml and now - self._nvml_at >= self.nvml_interval_s:
                self._nvml_at = now
                self._update_nvml()
        return SystemReading(
            wall_s=wall,
            cpu_s=cpu_s,
            cpu_share=cpu_s / wall if wall > 0 else 0.0,
            steal_share=self._steal_share,
            cpu_limit=self._cpu_limit,
            rss_bytes=self._rss(),
            cuda_allocated_bytes=allocated,
            cuda_reserved_bytes=reserved,
            gpu_util=self._gpu_util,
            gpu_mem_used_bytes=self._gpu_mem,
        )

    def close(self) -> None:
        """Releases the open ``/proc`` descriptors (NVML stays initialised: it is process-wide and refcounted)."""
        self._statm.close()
        self._stat.close()

    # ------------------------------------------------------------------ CPU and memory
    def _rss(self) -> int:
        raw = self._statm.read(128)
        if raw:
            try:
                return int(raw.split()[1]) * _PAGE_SIZE
            except (IndexError, ValueError):
                pass
        if self._psutil_proc is None:
            self._psutil_proc = psutil.Process()
        return int(self._psutil_proc.memory_info().rss)

    def _steal_counters(self) -> tuple[float, float]:
        """(steal, total) CPU time of the whole machine, in any unit; (0, 0) where not reported."""
        raw = self._stat.read(512)
        if raw:
            first = raw.split(b"\n", 1)[0].split()
            if first and first[0] == b"cpu" and len(first) >= 5:
                # user nice system idle iowait irq softirq steal [guest guest_nice]; guest time is already
                # counted in user/nice, so the total stops at steal.
                vals = [float(v) for v in first[1:9]]
                steal = vals[7] if len(vals) > 7 else 0.0
                return steal, sum(vals)
        try:
            t = psutil.cpu_times()
        except Exception:  # pragma: no cover - psutil always has cpu_times, but never fail a training step
            return 0.0, 0.0
        steal = float(getattr(t, "steal", 0.0))
        total = sum(float(getattr(t, f)) for f in t._fields if f not in ("guest", "guest_nice"))
        return steal, total

    def _update_steal(self, now: float) -> None:
        steal, total = self._steal_counters()
        d_total = total - self._steal_ref[1]
        if d_total > 0:
            self._steal_share = min(1.0, max(0.0, (steal - self._steal_ref[0]) / d_total))
        self._steal_at, self._steal_ref = now, (steal, total)

    # ------------------------------------------------------------------ CUDA and NVML
    def _cuda_allocator(self) -> tuple[int | None, int | None]:
        try:
            if not torch.cuda.is_initialized():  # untyped in torch; getattr keeps --strict quiet
                return None, None
            # the nested dict avoids memory_allocated()'s flattening of every allocator statistic
            stats = torch.cuda.memory_stats_as_nested_dict(self.device)
            return int(stats["allocated_bytes"]["all"]["current"]), int(stats["reserved_bytes"]["all"]["current"])
        except Exception:
            try:
                return int(torch.cuda.memory_allocated(self.device)), int(torch.cuda.memory_reserved(self.device))
            except Exception:
                return None, None

    def _nvml_index(self) -> int:
        """NVML's index of our device (NVML ignores ``CUDA_VISIBLE_DEVICES``; torch maps it)."""
        index = self.device.index if self.device.index is not None else 0
        try:
            from torch.cuda import _get_nvml_device_index  # private, but the mapping torch itself uses

            return int(_get_nvml_device_index(index))
        except Exception:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            parts = [p.strip() for p in visible.split(",") if p.strip()]
            if index < len(parts) and parts[index].isdigit():
                return int(parts[index])
            return index

    def _update_nvml(self) -> None:
        if self._nvml_handle is None:
            if self._nvml_tried:
                return
            self._nvml_tried = True
            self._nvml = load_pynvml()
            if self._nvml is None:
                return
            try:
                self._nvml_handle = self._nvml.nvmlDeviceGetHandleByIndex(self._nvml_index())
            except Exception as exc:
                log.info("NVML has no handle for %s (%s); gpu_util and gpu_mem_used stay None.", self.device, exc)
                return
        nvml: Any = self._nvml
        try:
            self._gpu_util = float(nvml.nvmlDeviceGetUtilizationRates(self._nvml_handle).gpu) / 100.0
            self._gpu_mem = int(nvml.nvmlDeviceGetMemoryInfo(self._nvml_handle).used)
        except Exception as exc:  # a GPU that fell off the bus must not stop training
            log.debug("NVML query failed: %s", exc)
            self._gpu_util = self._gpu_mem = None
