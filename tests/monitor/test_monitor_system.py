"""ProcessSampler: CPU share of a busy loop and of a sleep, RSS, steal arithmetic, CUDA and NVML readings
(with stand-ins: these tests run on CPU machines), and tolerance of a missing or failing ``pynvml``."""

from __future__ import annotations

import os
import statistics
import sys
import time
import types
from typing import Any

import psutil
import pytest
import torch

from lightning_dynpipe.monitor import system as system_mod
from lightning_dynpipe.monitor.system import ProcessSampler


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def test_cpu_share_of_a_busy_loop_is_high_and_of_a_sleep_low() -> None:
    proc = psutil.Process()
    sampler = ProcessSampler()
    before = proc.cpu_times()
    sampler.mark()
    _spin(0.3)
    busy = sampler.sample()
    after = proc.cpu_times()
    time.sleep(0.2)
    idle = sampler.sample()
    sampler.close()
    # psutil counts the same CPU time in clock ticks: agreement within a few ticks, whatever the machine's load
    reference = (after.user + after.system - before.user - before.system) / busy.wall_s
    assert busy.cpu_share == pytest.approx(reference, abs=0.1)
    # loose absolute bounds: on a shared machine the busy loop may lose its core for a while
    assert busy.cpu_share > 0.15, busy
    assert idle.cpu_share < 0.1, idle
    assert busy.cpu_share > 3 * idle.cpu_share
    assert busy.wall_s >= 0.3 and idle.wall_s >= 0.2
    assert busy.cpu_s == pytest.approx(busy.cpu_share * busy.wall_s)


def test_sample_measures_since_the_last_mark() -> None:
    sampler = ProcessSampler()
    time.sleep(0.05)
    sampler.mark()
    first = sampler.sample()
    assert first.wall_s < 0.05


def test_step_cpu_counts_the_whole_cycle_between_samples() -> None:
    """``cpu_s`` starts at the mark (the batch's start); ``step_cpu_s`` at the previous sample, so the work between
    two batches (Lightning's loop, the data fetch) is in it: a quota pays for that too."""
    sampler = ProcessSampler()
    sampler.sample()
    _spin(0.1)  # between the batch hooks
    sampler.mark()
    _spin(0.1)  # the batch
    reading = sampler.sample()
    sampler.close()
    assert reading.step_cpu_s >= reading.cpu_s + 0.05, reading  # the spin before the mark, on a shared machine
    assert reading.step_cpu_s <= reading.cpu_s + 0.15, reading


def test_step_cpu_leaves_out_what_ran_between_a_pause_and_the_next_mark() -> None:
    """A validation run between two steps is paid once, not every step: the monitor pauses the sampler for it, and
    the CPU from the pause to the next batch's start is not in that step's ``step_cpu_s`` (the work before the pause
    still is); the sample after starts clean."""
    sampler = ProcessSampler()
    sampler.sample()
    _spin(0.1)  # between the batch hooks, before the validation
    sampler.pause()
    _spin(0.3)  # the validation run
    sampler.pause()  # a second pause (an epoch's end after the validation) keeps the first
    _spin(0.1)
    sampler.mark()
    _spin(0.1)  # the batch
    reading = sampler.sample()
    _spin(0.1)
    sampler.mark()
    _spin(0.1)
    after = sampler.sample()
    sampler.close()
    assert reading.step_cpu_s >= reading.cpu_s + 0.05, reading
    assert reading.step_cpu_s <= reading.cpu_s + 0.2, reading  # 0.4 s of the paused spins would be in it
    assert after.step_cpu_s >= after.cpu_s + 0.05, after  # nothing left over is subtracted from the next step
    assert after.step_cpu_s <= after.cpu_s + 0.15, after


def test_rss_agrees_with_psutil() -> None:
    reading = ProcessSampler().sample()
    rss = psutil.Process().memory_info().rss
    assert reading.rss_bytes == pytest.approx(rss, rel=0.1)


def test_cpu_device_has_no_cuda_or_gpu_readings() -> None:
    r = ProcessSampler("cpu").sample()
    assert r.cuda_allocated_bytes is None and r.cuda_reserved_bytes is None
    assert r.gpu_util is None and r.gpu_mem_used_bytes is None
    assert 0.0 <= r.steal_share <= 1.0


def test_steal_share_is_the_delta_over_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    counters = iter([(10.0, 1000.0), (30.0, 1400.0), (30.0, 1400.0)])
    monkeypatch.setattr(ProcessSampler, "_steal_counters", lambda self: next(counters))
    sampler = ProcessSampler(steal_interval_s=0.0)
    assert sampler.sample().steal_share == pytest.approx(20.0 / 400.0)
    assert sampler.sample().steal_share == pytest.approx(20.0 / 400.0)  # no new ticks: keep the last share


def test_steal_is_read_at_most_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def counters(self: ProcessSampler) -> tuple[float, float]:
        calls.append(1)
        return 0.0, float(len(calls))

    monkeypatch.setattr(ProcessSampler, "_steal_counters", counters)
    sampler = ProcessSampler(steal_interval_s=60.0)
    for _ in range(50):
        sampler.sample()
    assert len(calls) == 1  # the construction's reading only


def test_steal_counters_parse_proc_stat() -> None:
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    steal, total = ProcessSampler()._steal_counters()
    assert 0.0 <= steal <= total and total > 0


def test_proc_files_are_reopened_after_a_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("no /proc")
    f = system_mod._ProcFile("/proc/self/statm")
    assert f.read(64)
    fd = f._fd
    assert fd is not None
    monkeypatch.setattr(os, "getpid", lambda: -12345)  # as if we were a forked child
    assert f.read(64)
    assert f._pid == -12345
    os.close(fd)  # the "parent's" descriptor, which a child leaves open by design
    monkeypatch.undo()
    f.close()


def test_sample_is_cheap() -> None:
    """A few microseconds on CPU (the design target); the bound is loose because the machine is shared."""
    sampler = ProcessSampler()
    for _ in range(100):
        sampler.sample()
    times = []
    for _ in range(2000):
        t0 = time.perf_counter()
        sampler.sample()
        times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 100e-6, f"median {statistics.median(times) * 1e6:.1f} us"


# ---------------------------------------------------------------------------------------------- CUDA / NVML
class _FakeNVML(types.ModuleType):
    class NVMLError(Exception):
        pass

    def __init__(self, *, fail_query: bool = False) -> None:
        super().__init__("pynvml")
        self.queries = 0
        self.inits = 0
        self.fail_query = fail_query
        self.index: int | None = None

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.index = index
        return f"handle{index}"

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        self.queries += 1
        if self.fail_query:
            raise self.NVMLError("GPU is lost")
        return types.SimpleNamespace(gpu=37, memory=12)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return types.SimpleNamespace(used=3 << 30, total=80 << 30, free=77 << 30)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    nested = {"allocated_bytes": {"all": {"current": 1000}}, "reserved_bytes": {"all": {"current": 4096}}}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: nested)
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda index: index + 2, raising=False)


def test_cuda_allocator_and_nvml_readings(monkeypatch: pytest.MonkeyPatch, fake_cuda: None) -> None:
    nvml = _FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    sampler = ProcessSampler("cuda:1", nvml_interval_s=60.0)
    r = sampler.sample()
    assert (r.cuda_allocated_bytes, r.cuda_reserved_bytes) == (1000, 4096)
    assert r.gpu_util == pytest.approx(0.37)
    assert r.gpu_mem_used_bytes == 3 << 30
    assert nvml.index == 3  # torch's NVML index of cuda:1, not 1
    for _ in range(10):
        again = sampler.sample()
    assert nvml.queries == 1 and nvml.inits == 1  # throttled; the last values are reused
    assert again.gpu_util == pytest.approx(0.37)


def test_missing_pynvml_gives_none(monkeypatch: pytest.MonkeyPatch, fake_cuda: None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    r = ProcessSampler("cuda:0").sample()
    assert r.cuda_allocated_bytes == 1000
    assert r.gpu_util is None and r.gpu_mem_used_bytes is None


def test_failing_nvml_query_gives_none(monkeypatch: pytest.MonkeyPatch, fake_cuda: None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNVML(fail_query=True))
    r = ProcessSampler("cuda:0", nvml_interval_s=0.0).sample()
    assert r.gpu_util is None and r.gpu_mem_used_bytes is None


def test_nvml_switched_off(monkeypatch: pytest.MonkeyPatch, fake_cuda: None) -> None:
    nvml = _FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    r = ProcessSampler("cuda:0", nvml=False).sample()
    assert r.gpu_util is None and nvml.inits == 0


def test_uninitialised_cuda_gives_no_allocator_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    r = ProcessSampler("cuda:0").sample()
    assert r.cuda_allocated_bytes is None and r.cuda_reserved_bytes is None


def test_load_pynvml_silences_the_wrapper_deprecation(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The old ``pynvml`` wrapper distribution warns on import; the monitor must not spread that warning."""
    import warnings

    (tmp_path / "pynvml.py").write_text(
        "import warnings\n"
        "warnings.warn('The pynvml package is deprecated. Please install nvidia-ml-py instead.', FutureWarning)\n"
        "inits = 0\n"
        "def nvmlInit():\n"
        "    global inits\n"
        "    inits += 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = system_mod.load_pynvml()
    assert module is not None and module.inits == 1
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)


class _FakeNVMLExtras(_FakeNVML):
    NVML_CLOCK_SM = 1

    def nvmlDeviceGetClockInfo(self, handle: str, kind: int) -> int:
        assert kind == self.NVML_CLOCK_SM
        return 1410

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: str) -> int:
        return 0x1 | 0x4  # idle (ignored) and a power cap (a throttle)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
        return [
            types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=1 << 30),
            types.SimpleNamespace(pid=-7, usedGpuMemory=2 << 30),
            types.SimpleNamespace(pid=-8, usedGpuMemory=None),  # NVML reports None without permission
        ]


def test_nvml_sm_clock_throttle_and_other_processes_memory(monkeypatch: pytest.MonkeyPatch, fake_cuda: None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNVMLExtras())
    r = ProcessSampler("cuda:0", nvml_interval_s=0.0).sample()
    assert r.gpu_sm_clock_mhz == 1410.0 and r.gpu_throttled == 1.0
    assert r.gpu_other_mem_bytes == 2 << 30  # our own process's memory is not "other"


def test_nvml_without_the_extra_queries_reports_none_for_them(monkeypatch: pytest.MonkeyPatch, fake_cuda: None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNVML())
    r = ProcessSampler("cuda:0", nvml_interval_s=0.0).sample()
    assert r.gpu_util == pytest.approx(0.37)
    assert r.gpu_sm_clock_mhz is None and r.gpu_throttled is None and r.gpu_other_mem_bytes is None


def test_run_queue_wait_context_switches_and_other_load_are_plausible() -> None:
    sampler = ProcessSampler(steal_interval_s=0.0)
    _spin(0.05)
    r = sampler.sample()
    assert 0.0 <= r.run_queue_wait_share <= 1.0 and r.ctx_switches_per_s >= 0.0
    if os.path.exists("/proc/self/schedstat") and hasattr(os, "sched_getaffinity"):
        assert r.other_cpu_load is not None and 0.0 <= r.other_cpu_load <= len(os.sched_getaffinity(0)) + 0.5


def test_every_sample_reads_the_cpu_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quota that starts mid-window shows in that window's reading, not a steal interval later."""
    limits = iter([None, None, 0.25, 0.25])
    monkeypatch.setattr(system_mod.CpuLimitReader, "read", lambda self: next(limits))
    sampler = ProcessSampler(steal_interval_s=60.0)  # construction reads once
    assert sampler.sample().cpu_limit is None
    assert sampler.sample().cpu_limit == 0.25
    sampler.refresh()  # restarts the spans; reads no limit
    assert sampler.sample().cpu_limit == 0.25


def test_a_registered_helper_process_counts_as_own_cpu_not_other_load() -> None:
    """The forest's refit process works for this process: its CPU is counted with this process's, not as other
    processes' load on the stage's cores."""
    import subprocess

    from lightning_dynpipe.monitor.stats import helpers_cpu_s, register_helper, unregister_helper

    assert helpers_cpu_s() == 0.0
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        register_helper(spin.pid)
        time.sleep(0.5)
        assert helpers_cpu_s() > 0.05
    finally:
        unregister_helper(spin.pid)
        spin.kill()
        spin.wait()
    assert helpers_cpu_s() == 0.0


def _orphan(code: str) -> int:
    """Starts ``python -c code`` as a process that is not this process's child (its parent, a shell, exits at once):
    another job's process, or another rank's, which a launcher started elsewhere."""
    import shlex
    import subprocess

    out = subprocess.run(
        ["sh", "-c", f"{shlex.quote(sys.executable)} -c {shlex.quote(code)} >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[0])


def _kill_tree(pid: int) -> None:
    import signal

    for child in psutil.Process(pid).children(recursive=True):
        child.kill()
    os.kill(pid, signal.SIGKILL)


def _other_loads(sampler_setup: Any) -> dict[bool, float]:
    """``other_cpu_load`` over 0.6 s while this process idles, without and with ``sampler_setup(sampler)``."""
    readings: dict[bool, float] = {}
    for named in (False, True):
        sampler = ProcessSampler(steal_interval_s=0.0)
        if named:
            sampler_setup(sampler)
        time.sleep(0.6)  # this process idles: the cores' busy time is the others'
        reading = sampler.sample().other_cpu_load
        assert reading is not None
        readings[named] = reading
    return readings


SPIN = "while True: pass"
JOBS = pytest.mark.skipif(
    not os.path.exists("/proc/self/task") or not hasattr(os, "sched_getaffinity"),
    reason="reads /proc/stat, /proc/<pid>/stat and /proc/<pid>/task/<tid>/children",
)


@JOBS
def test_a_sibling_process_on_the_same_cores_is_the_jobs_own_load_not_other_load() -> None:
    """Stages that share cores saw each other as other processes: the one that waited more looked busier with
    other processes by the difference. Named as siblings, the same job's processes are left out of the reading."""
    spin = _orphan(SPIN)  # the other stage, busy on our cores
    try:
        time.sleep(0.3)  # it is running
        readings = _other_loads(lambda s: s.set_siblings([spin, os.getpid()]))  # every rank's pid, ours included
        assert readings[False] > 0.6, readings  # about one core
        assert readings[True] < readings[False] - 0.5, readings
    finally:
        _kill_tree(spin)


@JOBS
def test_a_siblings_child_is_the_jobs_own_load_not_other_load() -> None:
    """Another rank's refit process floats over the machine's cores when nothing pins it: its CPU on this rank's
    cores is the job's own load once the rank is named, not another process's (one rank's refit raised the other
    rank's other_cpu_load by 0.2-0.4 of a core when it counted)."""
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {SPIN!r}]); time.sleep(60)"
    rank = _orphan(code)  # an idle rank whose child spins
    try:
        time.sleep(0.5)  # its child is running
        assert len(psutil.Process(rank).children()) == 1
        readings = _other_loads(lambda s: s.set_siblings([rank]))
        assert readings[False] > 0.6, readings
        assert readings[True] < readings[False] - 0.5, readings
    finally:
        _kill_tree(rank)


@JOBS
def test_this_processs_children_are_the_jobs_own_load_not_other_load() -> None:
    """A child of the stage process (a refit process, a data-loader worker) is the job's own load without being
    named; one started after the sampler counts from its start."""
    import subprocess

    sampler = ProcessSampler(steal_interval_s=0.0)
    spin = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        time.sleep(0.6)
        reading = sampler.sample().other_cpu_load
        assert reading is not None and reading < 0.4, reading  # one core busy, none of it another job's
    finally:
        spin.kill()
        spin.wait()
