"""Smoke test of ``benchmarks/profile_step.py`` and unit tests of its exclusive-time accounting.

The smoke test runs the script's ``main`` in the test process (two spawned gloo workers, a tiny MLP, three profiled
steps of DynPipe ``async`` and torch ``Schedule1F1B``) and checks the table and the JSON record; it asserts no speed.
The unit tests check that a component called inside another is subtracted from it, that the rows add up to
the main thread's CPU, and that every patch is undone.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.profile_step import OTHER, THREADS, Sections


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_sections_are_exclusive_and_add_up_to_the_main_thread() -> None:
    ns = SimpleNamespace(inner=lambda: _spin(0.02), outer=None)

    def outer() -> None:
        _spin(0.01)
        ns.inner()

    ns.outer = outer
    s = Sections()
    s.patch(ns, "inner", "inner")
    s.patch(ns, "outer", "outer")
    s.start()
    ns.outer()
    _spin(0.005)  # outside every component
    s.stop()
    r = s.result(steps=1)["components_ms"]
    assert r["inner"] == pytest.approx(20, abs=4)
    assert r["outer"] == pytest.approx(10, abs=4)  # its own time only: inner's 20 ms are not in it
    total = sum(v for k, v in r.items() if k != THREADS)
    assert total == pytest.approx(s.main_cpu_s * 1e3, rel=1e-6)
    assert r[OTHER] == pytest.approx(5, abs=4)
    s.restore()
    assert not hasattr(ns.inner, "_profile_step_wrapped") and ns.outer is outer


def test_patching_an_inherited_method_wraps_it_and_restores_the_inheritance() -> None:
    class Base:
        def work(self) -> None:
            _spin(0.005)

    class Child(Base):
        pass

    s = Sections()
    s.patch(Child, "work", "work")
    assert "work" in vars(Child)
    s.start()
    Child().work()
    Base().work()  # the base class is not patched
    s.stop()
    assert s.calls["work"] == 1
    s.restore()
    assert "work" not in vars(Child) and Child.work is Base.work


def test_sections_ignore_other_threads_and_calls_outside_the_window() -> None:
    ns = SimpleNamespace(work=lambda: _spin(0.01))
    s = Sections()
    s.patch(ns, "work", "work")
    ns.work()  # before start: not counted
    s.start()
    t = threading.Thread(target=ns.work)
    t.start()
    t.join()
    s.stop()
    ns.work()  # after stop: not counted
    assert s.calls.get("work", 0) == 0
    s.restore()


@pytest.mark.multiprocess
def test_quick_run_prints_the_component_table(tmp_path: Path, run_benchmark_main: Callable[..., Any]) -> None:
    proc = run_benchmark_main("profile_step.py", "--quick", "--out-dir", str(tmp_path))
    header = next(line for line in proc.stdout.splitlines() if line.startswith("component (CPU ms per step)"))
    for column in ("async / stage 0", "async / stage 1", "torch-1f1b / stage 0", "torch-1f1b / stage 1"):
        assert column in header
    for row in ("layers forward", "autograd (backward kernels)", "Lightning self.log", "= main thread CPU"):
        assert any(line.startswith(row) for line in proc.stdout.splitlines()), row
    records = list(tmp_path.glob("profile_step-*.json"))
    assert len(records) == 1
    payload = json.loads(records[0].read_text())
    assert {r["system"] for r in payload["runs"]} == {"async", "torch-1f1b"}
    assert payload["machine"]["git_commit"]
    again = run_benchmark_main("profile_step.py", "--from-json", str(records[0]), str(records[0]))  # pooled re-analysis
    assert "component (CPU ms per step)" in again.stdout and "= main thread CPU" in again.stdout
