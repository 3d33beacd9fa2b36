"""``benchmarks/reprice.py``: a recorded run's checks priced again offline (pure: a synthetic record, no runs)."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.reprice import main  # noqa: E402
from lightning_dynpipe.plan.partition import Partition  # noqa: E402
from lightning_dynpipe.predictor import MeasuredSlowdownPredictor  # noqa: E402
from lightning_dynpipe.repartition.controller import AdaptiveController  # noqa: E402
from lightning_dynpipe.repartition.policy import GainOverCostPolicy  # noqa: E402
from lightning_dynpipe.repartition.replay import LINK, Env, synthetic_model_cost, synthetic_window, true_compute  # noqa: E402

M = 4
COST = synthetic_model_cost(4, seed=0)
ENV = Env(quota=(None, 0.5))


def _record(
    system: str = "measured", predictor: Any = None, forest_file: str | None = None, agreed: bool = False
) -> dict[str, Any]:
    """A ``measured`` run under a half-core quota on stage 1, checked by the strategy's kind of controller (its own
    policy, other stage counts considered), three checks under ``[2, 2]`` then three under ``[3, 1]``, with every
    2-stage cut run fixed under the same quota; shaped as ``interference.py`` writes it."""
    setup = {
        "layers": [asdict(layer) for layer in COST.layers],
        "comm": asdict(LINK),
        "schedule": "async",
        "num_microbatches": M,
        "replicas": 1,
        "max_shift": 2,
    }
    controller = AdaptiveController(
        GainOverCostPolicy(),
        model_cost=COST,
        comm=LINK,
        schedule="async",
        num_microbatches=M,
        predictor=predictor if predictor is not None else MeasuredSlowdownPredictor(),
    )
    rng = np.random.default_rng(0)
    decisions = []
    for i, balance in enumerate([(2, 2)] * 3 + [(3, 1)] * 3):
        window = synthetic_window(COST, Partition(balance), ENV, M, rng)
        step = 10 * (i + 1)
        # agreed: as in a fit, the forest switches to a refit at the check the ranks agree on (here one in two)
        token = i // 2 if agreed else None
        d = controller.check(step, list(window.stages), window.partition, remaining_steps=500, agreed_refit=token)
        assert d is not None
        decisions.append(
            {
                "step": step,
                "stages": [asdict(t) for t in window.stages],
                "priced": [
                    {"partition": list(p.partition.balance), "step_s": p.step_s, "step_high_s": p.step_high_s}
                    for p in d.inputs.priced
                ],
                "agreed_refit": d.inputs.agreed_refit,
            }
        )
    runs: list[dict[str, Any]] = [
        {
            "system": system,
            "scenario": "quota50",
            "seed": 0,
            "setup": setup,
            "decisions": decisions,
            "forest_file": forest_file,
        }
    ]
    close = getattr(predictor, "close", None)
    if callable(close):
        close()
    for c in (1, 2, 3):
        _, step_s = true_compute(COST, Partition((c, 4 - c)), ENV, M)
        clock = [{"step": s, "t": s * step_s} for s in range(30)]
        runs.append({"system": f"cut{c},{4 - c}", "scenario": "quota50", "seed": 0, "steps": [[], clock]})
    return {"machine": {"git_commit": "0" * 40}, "runs": runs}


def test_a_run_replayed_by_its_own_predictor_is_priced_as_recorded_and_others_are_scored_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    record = tmp_path / "interference-x.json"
    record.write_text(json.dumps(_record()))
    result = main([str(record), "--predictors", "measured,prior", "--out", str(tmp_path)])
    (check,) = result["self_check"]
    assert check["system"] == "measured" and check["max_rel_diff"] == pytest.approx(0.0, abs=1e-12)
    # the replay scores the same prices as the record's
    assert result["pricing"]["quota50|measured (measured run)"] == result["recorded_pricing"]["quota50|measured"]
    prior = result["pricing"]["quota50|prior (measured run)"]
    assert prior["checks"] == 6 and not np.isnan(prior["others_median_abs_speedup_error"])
    out = capsys.readouterr().out
    assert "Priced again on the same windows" in out and "prior (measured run)" in out
    assert next(tmp_path.glob("reprice-*.png")).stat().st_size > 0
    saved = json.loads(next(tmp_path.glob("reprice-*.json")).read_text())
    assert saved["record"] == str(record) and saved["record_commit"] == "0" * 40 and saved["command"]
    assert [r["system"] for r in saved["replayed"]] == ["measured (measured run)", "prior (measured run)"]


def test_a_record_without_the_controllers_set_up_says_why_nothing_is_replayed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    data = _record()
    for r in data["runs"]:
        r.pop("setup", None)
    record = tmp_path / "old.json"
    record.write_text(json.dumps(data))
    assert main([str(record), "--out", str(tmp_path)]) == {}
    assert "controller set-up" in capsys.readouterr().out
    assert not list(tmp_path.glob("reprice-*"))


def test_a_calibrated_forest_run_is_replayed_from_the_rows_saved_beside_its_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``interference.py`` saves a calibrated forest's sweep rows beside the record (``forest_file``); the replay
    loads them and, learning online from the same windows as the run's forest did and switching to each refit at the
    check the record says the fit did (``agreed_refit``), prices as it did."""
    import json

    from lightning_dynpipe.predictor import ForestPredictor
    from lightning_dynpipe.predictor.features import LabelledSamples, samples_from_windows

    rng = np.random.default_rng(1)
    windows = [
        synthetic_window(COST, Partition(b), env, M, rng)
        for env in (Env(), Env(quota=(None, 0.5)), Env(hog=(1.0, 0.0)))
        for b in ((1, 3), (2, 2), (3, 1))
        for _ in range(3)
    ]
    rows = LabelledSamples.concat([samples_from_windows(COST, LINK, a, b) for a, b in zip(windows, windows[1:])])
    saved = ForestPredictor(n_estimators=8, refit_every=2, refit_on="every").fit(rows).save(tmp_path / "sweep.npz")
    data = _record("forest-cal", ForestPredictor.load(saved), str(saved), agreed=True)
    assert any(d["agreed_refit"] for d in data["runs"][0]["decisions"])  # the refits the fit switched to
    record = tmp_path / "interference-cal.json"
    record.write_text(json.dumps(data))
    result = main([str(record), "--predictors", "forest-cal,prior", "--out", str(tmp_path)])
    (check,) = result["self_check"]
    assert check["system"] == "forest-cal" and check["max_rel_diff"] == pytest.approx(0.0, abs=1e-9)
    assert {k.split("|")[1] for k in result["pricing"]} == {"forest-cal (forest-cal run)", "prior (forest-cal run)"}
    # a run without the file is not replayed by forest-cal (nothing to load), the others still are
    data["runs"][0]["forest_file"] = None
    record.write_text(json.dumps(data))
    result = main([str(record), "--predictors", "forest-cal,prior", "--out", str(tmp_path)])
    assert list(result["pricing"]) == ["quota50|prior (forest-cal run)"] and result["self_check"] == []


def test_the_cuts_of_another_run_price_the_checks_as_that_run_measured_them(tmp_path: Path) -> None:
    """``--cuts-from``: the noise floor. Cuts that measured the same times score no error; cuts that all ran 10%
    slower score 10% on each step but none on the speed-ups (the offset cancels); a check whose running partition
    the other record did not run is left out."""
    import json

    data = _record()
    record = tmp_path / "interference-a.json"
    record.write_text(json.dumps(data))
    same = tmp_path / "interference-b.json"
    same.write_text(json.dumps(data))
    result = main([str(record), "--predictors", "prior", "--cuts-from", str(same), "--out", str(tmp_path)])
    floor = result["pricing"]["quota50|the cuts run again (measured run)"]
    assert floor["checks"] == 6 and result["cuts_from"] == str(same)
    assert floor["others_median_abs_error"] == pytest.approx(0.0, abs=1e-12)
    assert floor["others_median_abs_speedup_error"] == pytest.approx(0.0, abs=1e-12)

    slower = json.loads(json.dumps(data))
    for r in slower["runs"]:
        if r["system"].startswith("cut"):
            r["steps"][1] = [{"step": c["step"], "t": c["t"] * 1.1} for c in r["steps"][1]]
    other = tmp_path / "interference-c.json"
    other.write_text(json.dumps(slower))
    floor = main([str(record), "--predictors", "", "--cuts-from", str(other), "--out", str(tmp_path)])["pricing"][
        "quota50|the cuts run again (measured run)"
    ]
    assert floor["others_median_abs_error"] == pytest.approx(0.1, rel=1e-9)
    assert floor["others_median_abs_speedup_error"] == pytest.approx(0.0, abs=1e-12)

    # the other record ran only [3, 1]: the checks under [2, 2] have no running price and are left out
    slower["runs"] = [r for r in slower["runs"] if r["system"] in ("measured", "cut3,1")]
    other.write_text(json.dumps(slower))
    floor = main([str(record), "--predictors", "", "--cuts-from", str(other), "--out", str(tmp_path)])["pricing"][
        "quota50|the cuts run again (measured run)"
    ]
    assert floor["checks"] == 3
