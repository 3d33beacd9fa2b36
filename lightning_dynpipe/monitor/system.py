"""Cheap readings of the stage process: CPU share, the machine's steal share, RSS, CUDA memory, GPU utilisation.

:class:`ProcessSampler` is called twice per training step (window start and end), so it avoids the slow
paths. On Linux it reads

* this process's CPU time with :func:`time.process_time` (all threads, user + system, nanosecond
  resolution; ``psutil.Process().cpu_times()`` counts the same time in 10 ms clock ticks, too coarse for a
  step of a few ms, and costs ~15 us),
* RSS from ``/proc/self/statm`` through a file descriptor kept open (~2 us),
* steal from ``/proc/stat``, at most every ``steal_interval_s`` (the counters tick at 100 Hz for the whole
  machine, so a per-step share would be mostly 0 or a whole tick), and from the same read the CPU time other
  processes used on the cores this process may run on (not counting the job's own processes: this process's
  children, such as the forest's refit process and data-loader workers, and the same job's processes on this
  machine that :meth:`ProcessSampler.set_siblings` named, with their children: :class:`JobCpu`),
* the cgroup CPU limit through descriptors kept open (:class:`~lightning_dynpipe.monitor.cgroups.CpuLimitReader`,
  a few microseconds), every sample, so a quota shows in the step it starts,
* the main thread's run-queue wait from ``/proc/self/schedstat`` (~2 us) and the involuntary context switches
  from :func:`resource.getrusage` (~1 us),

and falls back to :mod:`psutil` where ``/proc`` is missing. On a CUDA device it adds the caching allocator's
current numbers (every sample) and NVML's utilisation and memory (through ``pynvml``, imported lazily, at
most every ``nvml_interval_s``: NVML itself averages utilisation over a sampling period of 1/6 s to 1 s), with
the SM clock, whether the clocks are throttled, and the device memory other processes hold.
"""

from __future__ import annotations

import logging
import os
import resource
import time
import warnings
from collections.abc import Sequence
from typing import Any

import psutil
import torch

from lightning_dynpipe.monitor.cgroups import CpuLimitReader
from lightning_dynpipe.monitor.stats import SystemReading, helper_pids, process_cpu_and_start_s, process_descendants

__all__ = ["JobCpu", "ProcessSampler", "load_pynvml", "machine_steal_counters"]

log = logging.getLogger(__name__)

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_CLOCK_TICKS_PER_S = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
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


def machine_steal_counters(proc_stat: bytes | None = None) -> tuple[float, float]:
    """(steal, total) CPU time of the whole machine, in any unit; (0, 0) where not reported.

    ``proc_stat``: the start of ``/proc/stat`` if the caller read it already (else it is read here); where it
    cannot be read, psutil's counters. Two readings give the hypervisor's share of the machine between them:
    ``(steal1 - steal0) / (total1 - total0)``.
    """
    if proc_stat is None:
        try:
            with open("/proc/stat", "rb") as f:
                proc_stat = f.read(512)
        except OSError:
            proc_stat = None
    if proc_stat:
        first = proc_stat.split(b"\n", 1)[0].split()
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


class JobCpu:
    """The CPU that the job's other processes on this machine spent on a set of cores, span by span.

    The job's processes are, besides this one: its children and their children (the forest's refit process,
    data-loader workers, the ranks a launcher started from here) and the processes named with :meth:`set_roots`
    (the other stages' ranks on this machine) with theirs, found at every reading in
    ``/proc/<pid>/task/<tid>/children``, and the helpers registered with
    :func:`~lightning_dynpipe.monitor.stats.register_helper`. A process counts by the share of the cores it may
    run on that are among ``cores`` (its CPU assumed spread evenly over them): a stage and its refit process pinned
    to another core count 0, a process allowed on every core of this one counts in full.

    Each reading returns the CPU seconds since the previous one (or :meth:`restart`). A process found for the first
    time counts from its start when it started after the previous reading, and from this reading otherwise (its CPU
    before it was seen is not known to fall in the span). A process that ended loses its last span's CPU.

    A rank's refit process that floats over the cores of a machine without pinning is the reason: counted as another
    process's load, one rank's refit raised the other rank's ``other_cpu_load`` by 0.2-0.4 of a core.
    """

    def __init__(self, cores: frozenset[int]) -> None:
        self._cores = cores
        self._roots: tuple[int, ...] = ()
        self._ref: dict[int, float] = {}
        self._at = _boot_s()
        self.restart()

    def set_roots(self, pids: Sequence[int]) -> None:
        """Names the job's other processes on this machine (this process's pid among them is ignored); restarts."""
        me = os.getpid()
        self._roots = tuple(int(p) for p in pids if int(p) != me)
        self.restart()

    def members(self) -> set[int]:
        """The job's processes on this machine now, this one left out."""
        me = os.getpid()
        found = set(process_descendants(me))
        for root in (*self._roots, *helper_pids()):
            if root not in found:
                found.add(root)
                found.update(process_descendants(root))
        found.discard(me)
        return found

    def restart(self) -> None:
        """The next reading counts from now."""
        self._ref = {pid: process_cpu_and_start_s(pid)[0] for pid in self.members()}
        self._at = _boot_s()

    def cpu_on_cores_s(self) -> float:
        """CPU seconds the job's other processes spent on ``cores`` since the previous reading."""
        total, ref = 0.0, {}
        at = self._at
        for pid in self.members():
            cpu, start = process_cpu_and_start_s(pid)
            if cpu < 0.0:  # gone between the listing and the read
                continue
            ref[pid] = cpu
            base = self._ref.get(pid)
            if base is None:
                base = 0.0 if start + 1.0 / _CLOCK_TICKS_PER_S > at else cpu  # start times are in whole ticks
            share = self._share(pid)
            if share > 0.0:
                total += share * max(0.0, cpu - base)
        self._ref, self._at = ref, _boot_s()
        return total

    def _share(self, pid: int) -> float:
        try:
            theirs = os.sched_getaffinity(pid)
        except (AttributeError, OSError):  # gone, or no affinity to read (not Linux)
            return 0.0
        return len(theirs & self._cores) / len(theirs) if theirs else 0.0


def _boot_s() -> float:
    """Seconds since boot, the clock of ``/proc/<pid>/stat``'s start times."""
    try:
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return time.monotonic()


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

    :meth:`sample` measures since the last :meth:`mark` or :meth:`sample` (or the construction), and its
    ``step_cpu_s`` since the last :meth:`sample` (a whole step's cycle, whatever was marked in between), less the
    CPU between a :meth:`pause` and the :meth:`mark` after it (work between two steps that is not part of a step:
    a validation run, the end of an epoch).

    Args:
        device: the stage's device; CUDA readings are taken only for a ``cuda`` device.
        steal_interval_s: shortest span over which the steal share and the other processes' load on this
            process's cores are computed (both are reused in between): 25 ticks of ``/proc/stat``'s 100 Hz
            counters per core at the default, and a job that starts or stops on a stage's cores shows within
            about a quarter of a second. The cgroup CPU limit is read at every sample
            (:class:`~lightning_dynpipe.monitor.cgroups.CpuLimitReader`, a few microseconds).
        nvml_interval_s: shortest time between two NVML queries (the last values are reused in between).
        nvml: query NVML at all (on a CUDA device, when ``pynvml`` is importable).
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        steal_interval_s: float = 0.25,
        nvml_interval_s: float = 0.5,
        nvml: bool = True,
    ) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.steal_interval_s = steal_interval_s
        self.nvml_interval_s = nvml_interval_s
        self._statm = _ProcFile("/proc/self/statm")
        self._stat = _ProcFile("/proc/stat")
        self._schedstat = _ProcFile("/proc/self/schedstat")
        self._psutil_proc: psutil.Process | None = None
        self._is_cuda = self.device.type == "cuda"
        self._want_nvml = nvml and self._is_cuda
        self._nvml: Any | None = None
        self._nvml_handle: Any | None = None
        self._nvml_tried = False
        self._nvml_at = -float("inf")
        self._gpu_util: float | None = None
        self._gpu_mem: int | None = None
        self._gpu_clock: float | None = None
        self._gpu_throttled: float | None = None
        self._gpu_other_mem: int | None = None
        self._cores = self._allowed_cores()
        self._job = JobCpu(self._cores)
        self._other_cpu_load: float | None = None
        self._busy_ref = self._busy_of_cores(self._stat_text())
        self._busy_cpu_ref = time.process_time()
        self._steal_at, self._steal_ref = time.perf_counter(), self._steal_counters()
        self._steal_share = 0.0
        self._limit = CpuLimitReader()
        self._cpu_limit = self._limit.read()
        self._paused_at: float | None = None  # process CPU time at the pause
        self._excluded_cpu_s = 0.0  # CPU between pauses and the marks after them, left out of the next step_cpu_s
        self.mark()
        self._cpu_sampled = self._cpu0  # the previous sample's CPU time (a whole step's cycle starts there)

    # ------------------------------------------------------------------ windows
    def mark(self) -> None:
        """Starts a measurement window (and ends a :meth:`pause`)."""
        self._t0 = time.perf_counter()
        self._cpu0 = time.process_time()
        if self._paused_at is not None:
            self._excluded_cpu_s += max(0.0, self._cpu0 - self._paused_at)
            self._paused_at = None
        self._wait0 = self._run_queue_wait_s()
        self._switches0 = self._involuntary_switches()

    def sample(self) -> SystemReading:
        """The readings over the window since the last :meth:`mark` / :meth:`sample`; starts a new window."""
        now = time.perf_counter()
        cpu = time.process_time()
        wall = now - self._t0
        cpu_s = cpu - self._cpu0
        wait, switches = self._run_queue_wait_s(), self._involuntary_switches()
        wait_s, switched = wait - self._wait0, switches - self._switches0
        self._t0, self._cpu0, self._wait0, self._switches0 = now, cpu, wait, switches
        step_cpu_s, self._cpu_sampled = max(0.0, cpu - self._cpu_sampled - self._excluded_cpu_s), cpu
        self._excluded_cpu_s = 0.0
        if now - self._steal_at >= self.steal_interval_s:
            self._update_other_load(now, cpu)
            self._update_steal(now)
        self._cpu_limit = self._limit.read()  # every window: a quota applied now shows in this step's reading
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
            run_queue_wait_share=min(1.0, max(0.0, wait_s / wall)) if wall > 0 else 0.0,
            ctx_switches_per_s=switched / wall if wall > 0 else 0.0,
            other_cpu_load=self._other_cpu_load,
            gpu_sm_clock_mhz=self._gpu_clock,
            gpu_throttled=self._gpu_throttled,
            gpu_other_mem_bytes=self._gpu_other_mem,
            step_cpu_s=step_cpu_s,
        )

    def pause(self) -> None:
        """Leaves the CPU from now to the next :meth:`mark` out of the next sample's ``step_cpu_s``.

        For work between two training steps that is not part of a step, which a CPU limit pays for once rather
        than every step: a validation run, checkpoint saving, the end of an epoch. A second pause before the mark
        keeps the first.
        """
        if self._paused_at is None:
            self._paused_at = time.process_time()

    def set_siblings(self, pids: Sequence[int]) -> None:
        """Names the same job's other processes on this machine (the other stages' ranks): their CPU on this
        process's cores, and that of their children (another rank's refit process or data-loader workers), is the
        job's own load, not other processes', and the other-load reading leaves it out (:class:`JobCpu`).

        Without this, stages that share cores see each other as other processes, and the stage that waits more
        (it uses less CPU) looked busier with other processes by the difference (``interference_excess`` then
        named the faster stage as interfered with). Restarts the spans.
        """
        self._job.set_roots(pids)
        self.refresh()

    def refresh(self) -> None:
        """Restarts the steal and other-load spans now (e.g. after the caller changed the interference on this
        process), so the next :meth:`sample` that computes them covers only the new conditions. (The cgroup
        limit needs no refresh: every sample reads it.)"""
        now, cpu = time.perf_counter(), time.process_time()
        self._busy_ref, self._busy_cpu_ref = self._busy_of_cores(self._stat_text()), cpu
        self._job.restart()
        self._steal_at, self._steal_ref = now, self._steal_counters()

    def close(self) -> None:
        """Releases the open ``/proc`` descriptors (NVML stays initialised: it is process-wide and refcounted)."""
        self._statm.close()
        self._stat.close()
        self._schedstat.close()
        self._limit.close()

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

    def _run_queue_wait_s(self) -> float:
        """Seconds the main thread has waited on a run queue since it started (0 where not reported)."""
        raw = self._schedstat.read(128)
        if raw:
            parts = raw.split()
            if len(parts) >= 2:
                try:
                    return int(parts[1]) * 1e-9
                except ValueError:
                    pass
        return 0.0

    @staticmethod
    def _involuntary_switches() -> float:
        try:
            return float(resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw)
        except (OSError, AttributeError):  # pragma: no cover - getrusage exists on every POSIX system
            return 0.0

    @staticmethod
    def _allowed_cores() -> frozenset[int]:
        try:
            return frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # pragma: no cover - macOS has no sched_getaffinity
            return frozenset()

    def _stat_text(self) -> bytes:
        # one line per core plus a few more; 64 KiB covers ~700 cores
        return self._stat.read(1 << 16) or b""

    def _busy_of_cores(self, text: bytes) -> float | None:
        """Busy (non-idle, non-iowait) seconds of the cores in this process's affinity; None where unknown."""
        if not self._cores or not text:
            return None
        hz = _CLOCK_TICKS_PER_S
        busy, found = 0.0, 0
        for line in text.split(b"\n"):
            if not line.startswith(b"cpu") or line.startswith(b"cpu "):
                continue
            fields_ = line.split()
            try:
                core = int(fields_[0][3:])
            except ValueError:
                continue
            if core in self._cores and len(fields_) >= 9:
                vals = [float(v) for v in fields_[1:9]]  # user nice system idle iowait irq softirq steal
                busy += vals[0] + vals[1] + vals[2] + vals[5] + vals[6]
                found += 1
        return busy / hz if found else None

    def _update_other_load(self, now: float, cpu: float) -> None:
        busy = self._busy_of_cores(self._stat_text())
        job = self._job.cpu_on_cores_s()  # the job's other processes: siblings, children, theirs
        span = now - self._steal_at
        if busy is not None and self._busy_ref is not None and span > 0:
            own = cpu - self._busy_cpu_ref + job
            self._other_cpu_load = max(0.0, (busy - self._busy_ref - own) / span)
        self._busy_ref, self._busy_cpu_ref = busy, cpu

    def _steal_counters(self) -> tuple[float, float]:
        return machine_steal_counters(self._stat.read(512))

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
            self._gpu_clock = self._gpu_throttled = self._gpu_other_mem = None
            return
        self._gpu_clock, self._gpu_throttled, self._gpu_other_mem = _nvml_extras(nvml, self._nvml_handle)


_NVML_IDLE_REASON = 0x1  # nvmlClocksThrottleReasonGpuIdle: the clock is low because nothing runs, not throttling


def _nvml_extras(nvml: Any, handle: Any) -> tuple[float | None, float | None, int | None]:
    """SM clock (MHz), throttled (0/1) and other processes' device memory; each None where NVML lacks it."""
    clock: float | None = None
    throttled: float | None = None
    other: int | None = None
    try:
        clock = float(nvml.nvmlDeviceGetClockInfo(handle, getattr(nvml, "NVML_CLOCK_SM", 1)))
    except Exception:
        pass
    query = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
    )
    try:
        if query is not None:
            throttled = 1.0 if int(query(handle)) & ~_NVML_IDLE_REASON else 0.0
    except Exception:
        pass
    try:
        me = os.getpid()
        procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        other = sum(int(p.usedGpuMemory or 0) for p in procs if int(p.pid) != me)
    except Exception:
        pass
    return clock, throttled, other
