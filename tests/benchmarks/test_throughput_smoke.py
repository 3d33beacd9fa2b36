"""Smoke test of ``benchmarks/throughput.py --quick``: it runs end to end and prints the table of all five systems.

This is not a performance test and asserts no speed (STYLE.md: a benchmark is a script that prints a table, not
a timed unit test). It runs the script's ``main`` in the test process: two spawned gloo workers, a tiny MLP,
one repeat of three timed steps per system (about 20-40 s on two cores). Outputs go to a temporary directory,
so the documented plot in docs/img/ is left alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

LABELS = ("DynPipe async", "DynPipe sync", "DynPipe gpipe", "torch Schedule1F1B", "torch ScheduleGPipe")
HEADER = ("system", "samples/s (median)", "IQR", "vs DynPipe sync", "vs torch 1F1B")


@pytest.mark.multiprocess
def test_quick_run_prints_table_of_all_systems(
    tmp_path: Path, run_benchmark_main: Callable[..., Any], table_rows: Callable[..., list[str]]
) -> None:
    proc = run_benchmark_main("throughput.py", "--quick", "--out-dir", str(tmp_path))

    rows = table_rows(proc.stdout, HEADER, len(LABELS))
    assert [r[: len(max(LABELS, key=len))].strip() for r in rows] == list(LABELS), "\n".join(rows)
    for row in rows:
        cells = row.split()
        assert any(c.endswith("x") for c in cells), f"no ratio in row {row!r}"

    assert "target async >= 1.10x DynPipe sync" in proc.stdout
    assert "simulator, isolated costs" in proc.stdout
    assert "simulator fed with the framework's costs measured inside each system's runs" in proc.stdout
    assert "target the simulator fed with the framework's costs predicts each DynPipe system within 15%" in proc.stdout

    records = list(tmp_path.glob("throughput-*.json"))
    assert len(records) == 1
    payload = json.loads(records[0].read_text())
    assert {r["system"] for r in payload["runs"]} == {"async", "sync", "gpipe", "torch-1f1b", "torch-gpipe"}
    assert payload["machine"]["torch"] and payload["machine"]["lightning"] and payload["command"]
    assert records[0].with_suffix(".csv").is_file()
    assert (tmp_path / "throughput-quick.png").is_file()


def test_defaults_cost_verdict_pairs_defaults_with_bare_by_repeat() -> None:
    """``async-defaults`` (and its every-50-steps variant) is compared with ``async-bare`` of the same repeat;
    nothing else gets that ratio."""
    from benchmarks.throughput import ALL_SYSTEMS, ratio_table, render_targets

    sps = {
        "async-defaults": [990.0, 2000.0, 970.0],
        "async-defaults-50": [995.0, 1980.0, 1000.0],
        "async-bare": [1000.0, 2000.0, 1000.0],
        "async": [1.0] * 3,
    }
    runs = [{"rep": rep, "system": s, "samples_per_s": v[rep]} for s, v in sps.items() for rep in range(3)]
    table = ratio_table(runs, [s for s in ALL_SYSTEMS if s in sps])
    assert table["async-defaults"]["vs_async-bare"]["per_rep"] == pytest.approx([0.99, 1.0, 0.97])
    assert table["async-defaults-50"]["vs_async-bare"]["per_rep"] == pytest.approx([0.995, 0.99, 1.0])
    assert "vs_async-bare" not in table["async"]
    verdict = render_targets({"table": table})
    assert (
        "defaults (monitor + adaptive loop) cost <= 2% against both off: measured 0.990x [0.980-0.995] -> met"
        in verdict
    )


def test_forest_cost_verdict_pairs_the_forest_with_the_defaults_by_repeat() -> None:
    """``async-forest`` (the defaults with ``predictor="forest"``) is compared with ``async-defaults`` of the same
    repeat, and with ``async-bare``; ``async-defaults`` itself gets no ratio to itself."""
    from benchmarks.throughput import ALL_SYSTEMS, ratio_table, render_targets

    sps = {"async-forest": [950.0, 1960.0, 990.0], "async-defaults": [1000.0, 2000.0, 1000.0], "async-bare": [1e3] * 3}
    runs = [{"rep": rep, "system": s, "samples_per_s": v[rep]} for s, v in sps.items() for rep in range(3)]
    table = ratio_table(runs, [s for s in ALL_SYSTEMS if s in sps])
    assert table["async-forest"]["vs_async-defaults"]["per_rep"] == pytest.approx([0.95, 0.98, 0.99])
    assert "vs_async-bare" in table["async-forest"] and "vs_async-defaults" not in table["async-defaults"]
    verdict = render_targets({"table": table})
    assert "forest predictor costs < 1% against the default measured predictor: measured 0.980x" in verdict
    assert "-> MISSED" in verdict


def test_framework_costs_feed_the_simulator_per_stage_and_message() -> None:
    """The framework's costs are the in-run time around the operations: outside the step plus the step's rest as
    ``step_overhead`` per step, and the sender's busy time per message; with them the simulator's step is longer
    than with forward/backward/update alone, by at least the bottleneck stage's overhead per step."""
    from benchmarks.throughput import Config, _framework_costs_from_runs, _simulate

    cfg = Config(num_microbatches=4, sim_steps=8)
    step = {"forward_s": 0.04, "backward_s": 0.08, "optimizer_s": 0.02, "num_forward": 4, "num_backward": 4,
            "num_updates": 4, "recv_wait_s": 0.01, "send_s": 0.004, "step_s": 0.16}  # fmt: skip
    stages = [{"stage": k, "wall_s": 3 * (0.17 + 0.01 * k), "steps": [dict(step)] * 3} for k in range(2)]
    runs = [{"system": "async", "rep": 0, "stages": stages}]
    costs = _framework_costs_from_runs(runs, "async", cfg)
    assert costs is not None
    assert costs["forward"] == pytest.approx([0.01, 0.01]) and costs["update"] == pytest.approx([0.005, 0.005])
    # other = 0.16 - 0.14 - 0.01 - 0.004 = 0.006 per step; outside = wall per step - step = 0.01 / 0.02
    assert costs["step_overhead"] == pytest.approx([0.016, 0.026])
    assert costs["send_overhead"] == pytest.approx([0.001, 0.001])
    bare = {k: costs[k] for k in ("forward", "backward", "update")}
    assert _simulate("async", costs, cfg, "last_stage_broadcast") >= _simulate(
        "async", bare, cfg, "last_stage_broadcast"
    ) + max(costs["step_overhead"])


def _check_compared_with_async_only(system: str, target_line: str) -> None:
    """A system that only ``async`` is compared with: the ratio is in ``async``'s row alone, and in the targets."""
    from benchmarks.throughput import ALL_SYSTEMS, ratio_table, render_targets

    sps = {"async": [1100.0, 1000.0, 990.0], system: [1000.0, 1000.0, 1000.0], "sync": [900.0] * 3}
    runs = [{"rep": rep, "system": s, "samples_per_s": v[rep]} for s, v in sps.items() for rep in range(3)]
    table = ratio_table(runs, [s for s in ALL_SYSTEMS if s in sps])
    assert table["async"][f"vs_{system}"]["per_rep"] == pytest.approx([1.1, 1.0, 0.99])
    assert f"vs_{system}" not in table["sync"] and f"vs_{system}" not in table[system]
    assert f"{target_line}: 1.000x" in render_targets({"table": table})


def test_async_copy_switches_the_fresh_storage_updates_off_for_its_fit_only() -> None:
    """``async-copy`` runs with the stash copying first; ``async`` is compared with it, nothing else is."""
    import torch

    from benchmarks.throughput import stash_updates
    from lightning_dynpipe.engine.outofplace import out_of_place_step

    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with stash_updates("async"):
        assert out_of_place_step(opt) is not None
    with stash_updates("async-copy"):
        assert out_of_place_step(opt) is None
    assert out_of_place_step(opt) is not None  # restored after the fit
    _check_compared_with_async_only("async-copy", "against the stash copying first")


def test_async_spare_keeps_the_new_weights_out_of_the_gradients_for_its_fit_only() -> None:
    """``async-spare`` runs with no gradient private, so no update writes into one; ``async`` is compared with it."""
    import torch

    from benchmarks.throughput import stash_updates
    from lightning_dynpipe.engine import outofplace

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with stash_updates("async"):
        assert outofplace.private_grad(p)
    with stash_updates("async-spare"):
        assert not outofplace.private_grad(p)
        assert outofplace.out_of_place_step(torch.optim.SGD([p], lr=0.1)) is not None  # still out of place
    assert outofplace.private_grad(p)  # restored after the fit
    _check_compared_with_async_only("async-spare", "into the gradients against other memory")


def test_steal_share_is_the_hypervisors_part_of_the_machines_cpu_time_between_two_readings() -> None:
    from benchmarks.throughput import _steal_share
    from lightning_dynpipe.monitor.system import machine_steal_counters

    assert _steal_share((10.0, 1000.0), (30.0, 2000.0)) == pytest.approx(0.02)
    assert _steal_share(None, (1.0, 2.0)) is None and _steal_share((1.0, 5.0), (1.0, 5.0)) is None
    steal, total = machine_steal_counters()  # (steal, total) ticks of the whole machine
    assert 0 <= steal <= total and total > 0
    assert machine_steal_counters(b"cpu  100 0 50 800 10 0 5 35 7 0\ncpu0 1 2 3\n") == (35.0, 1000.0)


def test_each_model_has_its_own_default_plot() -> None:
    """A run on the GPT example does not overwrite the MLP's documented plot."""
    from benchmarks.throughput import default_plot

    assert default_plot("mlp").name == "throughput.png" and default_plot("mlp").parent.name == "img"
    assert default_plot("gpt") == default_plot("mlp").with_name("throughput-gpt.png")
