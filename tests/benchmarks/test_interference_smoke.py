"""Smoke test of ``benchmarks/interference.py --quick``: it runs end to end and prints the scenario table.

Not a performance test: it asserts no speed or ratio (STYLE.md: a benchmark prints a table, it is not a timed
unit test). It runs the script's ``main`` in the test process: two spawned gloo workers pinned to their own
cores, a tiny MLP, one seed, scenarios ``none`` and ``quota25`` for the forest and static systems (about 30-60 s
on two cores).
Outputs go to a temporary directory, so the documented plots in docs/img/ are left alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

HEADER = ("scenario", "system", "TTA s", "static TTA s", "static/system", "migrations", "onset->move", "limit over run")


@pytest.mark.multiprocess
def test_quick_run_prints_scenario_table(
    tmp_path: Path, run_benchmark_main: Callable[..., Any], table_rows: Callable[..., list[str]]
) -> None:
    proc = run_benchmark_main("interference.py", "--quick", "--out-dir", str(tmp_path))

    rows = table_rows(proc.stdout, HEADER, 2)
    assert [r.split()[:2] for r in rows] == [["none", "forest"], ["quota25", "forest"]], "\n".join(rows)
    assert "machine:" in proc.stdout and "command:" in proc.stdout
    checks = table_rows(proc.stdout, ("scenario", "system", "moved", "below the minimum saving"), 2)
    assert sorted(r.split()[:2] for r in checks) == [["none", "forest"], ["quota25", "forest"]], "\n".join(checks)

    (raw,) = tmp_path.glob("interference-*.json")
    payload = json.loads(raw.read_text())
    assert {(r["scenario"], r["system"]) for r in payload["runs"]} == {
        (s, y) for s in ("none", "quota25") for y in ("forest", "static")
    } | {("quota25", f"cut{c},{4 - c}") for c in (1, 2, 3)}  # quota25's limit: every cut of the MLP 3x64 fixed
    assert payload["machine"]["torch"] and payload["command"]
    decisions = [d for r in payload["runs"] if r["system"] == "forest" for d in r["decisions"]]
    assert decisions and all(len(d["stages"]) == 2 and d["stages"][0]["compute_s"] > 0 for d in decisions)
    # the controller prices with the link the set-up probe measured, its CPU per message byte included (gloo)
    setups = [r["setup"] for r in payload["runs"] if r["system"] == "forest"]
    assert setups and all(s["comm"]["bandwidth_Bps"] > 0 and s["comm"]["cpu_s_per_byte"] > 0 for s in setups)
    assert (tmp_path / "interference_accuracy.png").exists() and (tmp_path / "interference_stages.png").exists()


def test_the_delay_limit_is_measured_from_every_cut_run_fixed() -> None:
    """``delay``'s limit: the configured cut's mean ms/step over the fastest cut's, from the cut runs' own steps."""
    import sys

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from benchmarks.interference import Config, cut_systems, rebalancing_limit

    cfg = Config(model="cnn", balance=(2, 3))
    assert cut_systems(cfg) == ["cut1,4", "cut2,3", "cut3,2", "cut4,1"]

    def fixed(ms: float) -> dict[str, Any]:  # rank 0's clock of a run whose steps take `ms`, a slow first step
        times = [0.5] + [0.5 + (i + 1) * ms / 1e3 for i in range(60)]
        return {"steps": [[], [{"step": i, "t": t} for i, t in enumerate(times)]]}

    cuts = {"cut1,4": fixed(120.0), "cut2,3": fixed(90.0), "cut3,2": fixed(60.0), "cut4,1": fixed(50.0)}
    lim = rebalancing_limit({"schedule": []}, None, None, cfg, cuts)
    assert lim is not None and lim["measured"] and lim["best"] == "4,1"
    assert lim["limit_on"] == pytest.approx(90.0 / 50.0) and lim["limit_run"] == lim["limit_on"]


def test_cuts_trained_to_the_target_give_a_time_to_accuracy_limit() -> None:
    """With the cuts trained to the target, the limit in time to accuracy charges each cut its steps to the target:
    [4, 1] is the fastest per step but needs so many more steps that [3, 2] reaches the target first; a cut that
    missed the target is never the best."""
    import sys

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from benchmarks.interference import Config, rebalancing_limit

    cfg = Config(model="cnn", balance=(2, 3), cuts_to_target=True)

    def to_target(ms: float, steps: int | None) -> dict[str, Any]:
        times = [0.5 + (i + 1) * ms / 1e3 for i in range(steps or 600)]
        return {
            "steps": [[], [{"step": i, "t": t} for i, t in enumerate(times)]],
            "reached": steps is not None,
            "time_to_acc_s": times[-1] if steps else None,
            "steps_to_acc": steps,
        }

    cuts = {
        "cut1,4": to_target(120.0, None),
        "cut2,3": to_target(90.0, 200),
        "cut3,2": to_target(60.0, 200),
        "cut4,1": to_target(50.0, 300),
    }
    static = {"schedule": [], "reached": True, "time_to_acc_s": 18.5}
    lim = rebalancing_limit(static, None, None, cfg, cuts)
    assert lim is not None and lim["best"] == "4,1" and lim["limit_on"] == pytest.approx(90.0 / 50.0)
    assert lim["tta_best"] == "3,2" and lim["tta_steps"]["4,1"] == 300 and lim["tta_s"]["1,4"] == float("inf")
    assert lim["tta_limit"] == pytest.approx(18.5 / (0.5 + 200 * 0.06))


def test_the_mix_limit_over_the_run_uses_each_phases_measured_cuts() -> None:
    """``mix``: the link alone before the hog's onset, both after. The cuts of each phase give its limit; over the
    run, the static run's steps before the onset are sped up by the first phase's limit, those after by the second's."""
    import sys

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from benchmarks.interference import Config, rebalancing_limit, schedule_for

    cfg = Config(model="cnn", balance=(2, 3))

    def fixed(ms: float) -> dict[str, Any]:
        times = [0.5] + [0.5 + (i + 1) * ms / 1e3 for i in range(60)]
        return {"steps": [[], [{"step": i, "t": t} for i, t in enumerate(times)]]}

    both = {"cut1,4": fixed(150.0), "cut2,3": fixed(100.0), "cut3,2": fixed(80.0), "cut4,1": fixed(90.0)}
    link = {f"cut{k}@delay": fixed(ms) for k, ms in (("1,4", 120.0), ("2,3", 80.0), ("3,2", 50.0), ("4,1", 40.0))}
    # the static run: 20 steps of 80 ms (the link alone), then 20 of 100 ms (the hog from step 20 on)
    t = [0.08 * (i + 1) for i in range(20)] + [1.6 + 0.1 * (i + 1) for i in range(20)]
    static = {
        "schedule": schedule_for("mix", cfg, 20),
        "steps": [[], [{"step": i, "t": x} for i, x in enumerate(t)]],
        "reached": True,
        "time_to_acc_s": t[-1],
    }
    lim = rebalancing_limit(static, None, None, cfg, both | link)
    assert lim is not None and lim["measured"] and lim["best"] == "3,2" and lim["best_before"] == "4,1"
    assert lim["limit_on"] == pytest.approx(100.0 / 80.0) and lim["limit_before"] == pytest.approx(80.0 / 40.0)
    oracle = 20 * 0.08 / 2.0 + 20 * 0.1 / 1.25  # the first phase's steps at [4, 1], the second's at [3, 2]
    assert lim["limit_run"] == pytest.approx(t[-1] / oracle)


def test_the_table_separates_the_speed_from_the_steps_to_the_target() -> None:
    """``per step`` is static's ms per step over the system's, each up to its own target (median of seeds), beside
    the time-to-accuracy ratio that also counts the steps: here 2.5x per step, 1.25x in time to accuracy."""
    import sys

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from benchmarks.interference import Config, render_table, summarise

    cfg = Config(model="cnn", balance=(2, 3), scenarios=("quota25",), systems=("measured", "static"))

    def run(system: str, seed: int, tta_s: float, steps: int) -> dict[str, Any]:
        return {
            "system": system,
            "scenario": "quota25",
            "seed": seed,
            "reached": True,
            "time_to_acc_s": tta_s,
            "steps_to_acc": steps,
            "migrations": [],
            "schedule": [],
            "steps": [[{"step": 0, "balance": [2, 3]}], []],
        }

    runs = [run("static", s, 10.0, 100) for s in (0, 1, 2)]
    runs += [run("measured", 0, 8.0, 160), run("measured", 1, 4.0, 100), run("measured", 2, 10.0, 250)]
    summary = summarise(runs, None, cfg)
    ratios = summary["quota25"]["ratios"]["measured"]
    assert ratios["median"] == pytest.approx(1.25)  # 10/8, 10/4, 10/10
    assert ratios["per_step"] == pytest.approx(2.5)  # 100 ms over 50, 40 and 40 ms
    table = render_table(summary, cfg)
    assert "per step" in table and "2.50x" in table and "1.25x" in table


def test_the_speed_of_runs_that_miss_the_target_is_their_whole_runs() -> None:
    """A seed where a run did not reach the target still has its speed: ``per step`` then compares the two runs'
    mean step times over the whole run (here 100 ms against 40, 2.5x), and the time-to-accuracy ratio stays empty."""
    import sys

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from benchmarks.interference import Config, render_table, summarise

    cfg = Config(model="cnn", balance=(2, 3), scenarios=("quota25",), systems=("measured", "static"))

    def run(system: str, ms: float) -> dict[str, Any]:
        times = [0.1 * i for i in range(5)] + [0.5 + (i + 1) * ms / 1e3 for i in range(40)]
        return {
            "system": system,
            "scenario": "quota25",
            "seed": 0,
            "reached": False,
            "time_to_acc_s": None,
            "steps_to_acc": None,
            "migrations": [],
            "schedule": [],
            "steps": [[{"step": 0, "balance": [2, 3]}], [{"step": i, "t": t} for i, t in enumerate(times)]],
        }

    summary = summarise([run("static", 100.0), run("measured", 40.0)], None, cfg)
    ratios = summary["quota25"]["ratios"]["measured"]
    assert ratios["median"] != ratios["median"]  # NaN: no time to accuracy to compare
    assert ratios["per_step"] == pytest.approx(2.5)
    assert "2.50x" in render_table(summary, cfg)


def test_systems_with_more_micro_batches_in_flight() -> None:
    """``static+d`` and ``measured+d`` train with ``async+d`` and otherwise as ``static`` and ``measured``; under
    another ``--schedule`` they are refused before anything runs."""
    import sys

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from benchmarks.interference import Config, main, schedule_of, system_config

    cfg = Config(model="cnn")
    assert [schedule_of(s, cfg) for s in ("static", "static+1", "static+2", "measured+1")] == [
        "async",
        "async+1",
        "async+2",
        "async+1",
    ]
    assert system_config("static+2", cfg) == (False, "measured")
    assert system_config("measured+1", cfg) == (True, "measured")
    with pytest.raises(SystemExit):
        main(["--systems", "static,static+1", "--schedule", "sync", "--no-plot"])


def test_the_depth_choosing_system_needs_beta_and_the_table_shows_its_changes() -> None:
    """``measured-depth`` (the loop may change the schedule) is refused without ``--beta``; the table lists each
    seed's changes of schedule after its migrations ("-" for a seed without)."""
    import sys

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from benchmarks.interference import Config, main, render_table, summarise, system_config

    with pytest.raises(SystemExit):
        main(["--systems", "static,measured-depth", "--no-plot"])
    cfg = Config(model="cnn", balance=(2, 3), scenarios=("none",), systems=("measured-depth", "static"), beta=0.31)
    assert system_config("measured-depth", cfg) == (True, "measured")

    def run(system: str, seed: int, changes: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "system": system,
            "scenario": "none",
            "seed": seed,
            "reached": True,
            "time_to_acc_s": 10.0,
            "steps_to_acc": 100,
            "migrations": [],
            "schedule_changes": changes,
            "schedule": [],
            "steps": [[{"step": 0, "balance": [2, 3]}], []],
        }

    deeper = {"step": 41, "old": "async", "new": "async+2", "pause_s": 0.01}
    runs = [run("static", s, []) for s in (0, 1)] + [run("measured-depth", 0, [deeper]), run("measured-depth", 1, [])]
    summary = summarise(runs, None, cfg)
    assert summary["none"]["systems"]["measured-depth"]["schedule_changes"] == [["41:async+2"], []]
    table = render_table(summary, cfg)
    assert "0,0 [41:async+2; -]" in table


def test_the_gpt_example_trains_on_text_windows_and_refuses_another_optimizer() -> None:
    """``--model gpt``: the GPT example's CharGPT (6 units, 5 cuts) on batches of 64-byte windows, the validation
    windows as one test batch whose accuracy is the next byte's; its own AdamW, so ``--optimizer`` is refused."""
    import sys

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from benchmarks.interference import GPT_BLOCK_SIZE, Config, _data, _model, cut_systems, main, num_layers

    cfg = Config(model="gpt", batch_size=8, max_steps=3, balance=(3, 3))
    assert num_layers(cfg) == 6 and cut_systems(cfg) == ["cut1,5", "cut2,4", "cut3,3", "cut4,2", "cut5,1"]
    batches, test = _data(cfg, seed=0)
    assert len(batches) == 3 and all(x.shape == y.shape == (8, GPT_BLOCK_SIZE) for x, y in batches)
    assert torch.equal(batches[0][1][:, :-1], batches[0][0][:, 1:])  # y is x shifted by one byte
    assert not torch.equal(batches[0][0], _data(cfg, seed=1)[0][0][0])  # the seed orders the windows
    ((xt, yt),) = test
    assert xt.shape == yt.shape and xt.shape[1] == GPT_BLOCK_SIZE and xt.shape[0] >= 64
    model = _model(cfg, seed=0)
    assert len(model.pipeline) == 6 and isinstance(model.configure_optimizers(), torch.optim.AdamW)
    with pytest.raises(SystemExit):
        main(["--model", "gpt", "--optimizer", "sgd", "--no-plot"])


def test_the_noise_option_puts_a_bursty_neighbour_on_the_stages_cores() -> None:
    """``--noise`` runs :class:`CpuBursts` on the cores the two workers pin their stages to, for the whole run (off:
    no source); ``measured-checks`` is ``measured`` with the policy's persistence counted in checks alone."""
    import os
    import sys

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from benchmarks.interference import _noise, _parse, render_targets, system_config
    from lightning_dynpipe.interference import CpuBursts
    from lightning_dynpipe.repartition.policy import GainOverCostPolicy

    cfg, _ = _parse(["--noise", "--scenarios", "none", "--systems", "measured,measured-checks"])
    assert cfg.noise and cfg.systems == ("measured", "measured-checks")
    noise = _noise(cfg)
    assert isinstance(noise, CpuBursts) and not noise.active
    assert noise.cores == sorted(os.sched_getaffinity(0))[:2]
    assert _noise(_parse([])[0]) is None
    policy, predictor = system_config("measured-checks", cfg)
    assert isinstance(policy, GainOverCostPolicy) and predictor == "measured"
    assert (policy.explained_min_s, policy.patience_s) == (0.0, 0.0)
    assert (GainOverCostPolicy().explained_min_s, GainOverCostPolicy().patience_s) == (0.5, 0.75)
    # a run with the neighbour is not a clean run: its verdict says so
    summary = {"none": {"ratios": {"measured": {"median": 1.0}}, "systems": {"measured": {"migrations": [0, 2]}}}}
    assert "(target: 0 in every seed) -> MISSED" in render_targets(summary)
    assert "-> missed under --noise (not a clean run)" in render_targets(summary, noise=True)


def test_each_check_is_counted_by_what_held_or_moved_the_partition() -> None:
    """The reasons are the policy's own: a saving below the minimum at the predictor's values, and a lower end that
    does not pay, are told apart, per scenario and system over all seeds; runs without checks are left out."""
    from benchmarks.interference import CHECK_OUTCOMES, check_outcomes
    from lightning_dynpipe.repartition.policy import _gain_refusal

    kw: dict[str, Any] = dict(min_relative_gain=0.1, margin=2.0, cost="migration cost")
    small = _gain_refusal(0.001, 0.1, 100, 0.05, predicted_saving_s=0.004, **kw)  # 4% at the values
    unpaid = _gain_refusal(0.0002, 0.1, 100, 0.05, predicted_saving_s=0.02, **kw)  # 20%, lower end 0.02 s < 0.1 s
    point = _gain_refusal(0.004, 0.1, 100, 0.05, **kw)  # a point prediction's 4%
    assert small and unpaid and point and "does not pay" in unpaid

    def check(reason: str, moved: bool = False) -> dict[str, Any]:
        return {"repartition": moved, "reason": reason}

    runs = [
        {"scenario": "quota50", "system": "forest-cal", "decisions": [check(small), check(unpaid), check(point)]},
        {
            "scenario": "quota50",
            "system": "forest-cal",
            "decisions": [check("predicted gain pays the migration", True)],
        },
        {
            "scenario": "quota50",
            "system": "measured",
            "decisions": [
                check("the current partition is already the best"),
                check("waiting for 2 checks in a row"),
            ],
        },  # fmt: skip
        {"scenario": "quota50", "system": "static", "decisions": []},
    ]
    counts = check_outcomes(runs)
    assert set(counts) == {("quota50", "forest-cal"), ("quota50", "measured")}
    assert counts[("quota50", "forest-cal")] == dict(
        zip(CHECK_OUTCOMES, (1, 2, 1, 0, 0))
    )  # moved, below the minimum, lower end, best, other
    assert counts[("quota50", "measured")] == dict(zip(CHECK_OUTCOMES, (0, 0, 0, 1, 1)))


def test_the_prices_of_each_check_are_set_against_the_cuts_run_fixed_under_the_same_scenario_and_seed() -> None:
    """Every priced partition against the same cut run fixed (same scenario and seed): the running partition's error
    apart (what the window measured, against another run), the others' median absolute error, the error of their
    speed-up over the running partition, how often the measured step stays under the upper end, and how often the
    partition priced fastest is the fastest cut. Cuts of another seed, phases of ``mix`` and checks without prices
    count for nothing."""
    from benchmarks.interference import PRICING_COLUMNS, pricing_errors, render_pricing

    def cut(name: str, ms: float, seed: int = 0, scenario: str = "quota50") -> dict[str, Any]:
        steps = [{"step": i, "t": i * ms / 1e3} for i in range(20)]
        return {"system": name, "scenario": scenario, "seed": seed, "steps": [steps]}

    def priced(*rows: tuple[tuple[int, int], float, float]) -> list[dict[str, Any]]:
        return [{"partition": list(p), "step_s": v, "step_high_s": h} for p, v, h in rows]

    runs = [
        cut("cut1,2", 100.0),
        cut("cut2,1", 50.0),
        cut("cut1,2", 10.0, seed=1),  # another seed's cuts: not this run's truth
        cut("cut2,1@delay", 10.0, scenario="mix"),
        {
            "system": "forest-cal",
            "scenario": "quota50",
            "seed": 0,
            "decisions": [
                # running [1, 2] priced 110 ms (measured 100: +10%); [2, 1] priced 60 (50: +20%), upper end 70 holds
                {"partition": [1, 2], "priced": priced(((1, 2), 0.110, 0.110), ((2, 1), 0.06, 0.07))},
                # [2, 1] priced 40 (-20%), upper end 45 below the 50 measured; [2, 1] is the fastest priced and measured
                {"partition": [2, 1], "priced": priced(((1, 2), 0.09, 0.09), ((2, 1), 0.04, 0.045))},
                {"partition": [2, 1], "priced": []},
            ],
        },
        {"system": "measured", "scenario": "hog", "seed": 0, "decisions": [{"priced": priced(((1, 2), 0.1, 0.1))}]},
    ]  # fmt: skip
    errors = pricing_errors(runs)
    assert set(errors) == {("quota50", "forest-cal")}
    e = errors[("quota50", "forest-cal")]
    assert e["checks"] == 2
    assert e["running_median_error"] == pytest.approx(0.0)  # +10% and -10%
    assert e["others_median_abs_error"] == pytest.approx(0.2)  # +20% and -20%
    # the speed-up over the running partition: 60/110 against 50/100 (+9.1%), 40/90 against 50/100 (-11.1%)
    assert e["others_median_abs_speedup_error"] == pytest.approx((0.6 / 1.1 / 0.5 - 1 + 1 - 0.4 / 0.9 / 0.5) / 2)
    assert e["others_median_speedup_error"] == pytest.approx((0.6 / 1.1 / 0.5 + 0.4 / 0.9 / 0.5) / 2 - 1)
    assert e["others_upper_holds"] == pytest.approx(0.5)
    # with the offset between the two runs cancelled: 70/110 and 45/90 over the running price, against 50/100 measured
    assert e["others_speedup_upper_holds"] == pytest.approx(1.0)
    assert e["fastest_priced_fastest"] == pytest.approx(1.0)
    table = render_pricing(runs)
    assert all(c in table for c in PRICING_COLUMNS) and "+0.0%" in table and "20.0%" in table and "-1.0%" in table


def test_a_slow_monitor_window_shows_against_the_median_window() -> None:
    """``step_windows``: the speed after the first window, and its slowest window of ``every`` steps over the median
    one; the cuts and a run too short for two windows are left out."""
    from benchmarks.interference import render_step_windows, step_windows

    def run(system: str, seed: int, ms: list[float]) -> dict[str, Any]:
        t, clock = 0.0, []
        for step, dt in enumerate(ms):
            clock.append({"step": step, "t": t})
            t += dt / 1e3
        clock.append({"step": len(ms), "t": t})
        return {"system": system, "scenario": "quota25", "seed": seed, "steps": [[], clock]}

    steady = [50.0] * 51
    refit = [50.0] * 21 + [150.0] * 10 + [50.0] * 20  # steps 21-30: three times as slow
    runs = [
        run("forest", 0, refit),
        run("forest", 1, steady),
        run("measured", 0, steady),
        run("measured", 1, [50.0] * 15),  # one window after the first: left out
        run("cut4,1", 0, refit),
    ]
    out = step_windows(runs, 10)
    assert set(out) == {("quota25", "forest"), ("quota25", "measured")}
    forest, measured = out[("quota25", "forest")], out[("quota25", "measured")]
    assert forest["seeds"] == 2 and measured["seeds"] == 1
    assert measured["ms_per_step"] == pytest.approx(50.0) and measured["slowest_over_median"] == pytest.approx(1.0)
    assert forest["slowest_over_median_max"] == pytest.approx(3.0)  # seed 0's refit window
    assert forest["slowest_over_median"] == pytest.approx(2.0)  # the median of 3x and 1x
    assert forest["ms_per_step"] == pytest.approx((75.0 + 50.0) / 2)  # seed 0: (30 x 50 + 10 x 150) / 40 steps
    table = render_step_windows(runs, 10)
    assert "slowest/median" in table and "3.00x" in table
