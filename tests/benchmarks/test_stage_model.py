"""``benchmarks/stage_model.py``'s analysis: each clean cut's window prices every other cut, with and without the
predictor's fixed cost per micro-batch, against what the cuts measured (pure, no runs)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.interference import Config, _parse  # noqa: E402
from benchmarks.stage_model import analyse, cut_medians, render  # noqa: E402

# three layers of 1 ms each (forward + backward) per micro-batch; the last stage also spends 2 ms on its loss
PROFILE = {"forward_s": [0.0005] * 3, "backward_s": [0.0005] * 3, "activation_bytes": [100, 100, 100]}
M = 2


def _cut(balance: tuple[int, int]) -> dict[str, Any]:
    """A fixed cut's run without interference: stage k's compute per step is M x (its layers + 2 ms if last)."""
    stages = []
    for k, n in enumerate(balance):
        per_mb = n * 1e-3 + (2e-3 if k == 1 else 0.0)
        stages.append(
            [
                {
                    "step": s,
                    "balance": list(balance),
                    "forward_s": M * per_mb / 2,
                    "backward_s": M * per_mb / 2,
                    "step_s": 0.01,
                }  # fmt: skip
                for s in range(1, 31)
            ]
        )
    return {"system": f"cut{balance[0]},{balance[1]}", "scenario": "none", "steps": stages}


def _payload() -> dict[str, Any]:
    return {
        "config": {"num_microbatches": M},
        "layer_costs": PROFILE,
        "runs": [_cut((1, 2)), _cut((2, 1)), {"system": "static", "scenario": "none", "steps": [[], []]}],
    }


def test_the_cuts_medians_leave_the_start_out() -> None:
    cuts = cut_medians(_payload()["runs"], M)
    assert set(cuts) == {(1, 2), (2, 1)}  # the static run is not a cut
    assert cuts[(1, 2)]["compute_s"] == pytest.approx([1e-3, 4e-3])


def test_a_fixed_cost_per_micro_batch_is_priced_exactly_where_the_stretch_misses() -> None:
    """The last stage reads 2x its two layers at [1, 2] (4 ms for 2 ms): the fixed cost carries 2 ms to [2, 1]
    (3 ms, as measured), the stretch 2 x 1 ms; from [2, 1] (3x for one layer) the stretch prices [1, 2] at 6 ms."""
    result = analyse(_payload())
    pairs = {(tuple(x["source"]), tuple(x["target"])): x for x in result["pairs"]}
    fwd = pairs[((1, 2), (2, 1))]
    assert fwd["measured_s"] == pytest.approx([2e-3, 3e-3])
    assert fwd["predicted_s"]["fixed cost"] == pytest.approx([2e-3, 3e-3])
    assert fwd["predicted_s"]["stretch"] == pytest.approx([2e-3, 2e-3])
    back = pairs[((2, 1), (1, 2))]
    assert back["predicted_s"]["fixed cost"] == pytest.approx([1e-3, 4e-3])
    assert back["predicted_s"]["stretch"] == pytest.approx([1e-3, 6e-3])
    for pair in (fwd, back):  # the forest's prior carries the quiet reading the same way
        assert pair["predicted_s"]["forest prior"] == pytest.approx(pair["predicted_s"]["fixed cost"])
    assert result["summary"]["fixed cost"]["slowest_error_max"] == pytest.approx(0.0, abs=1e-12)
    assert result["summary"]["stretch"]["slowest_error_max"] == pytest.approx(0.5)
    assert "cuts ordered as measured" in render(result)


def test_without_the_clean_cuts_it_says_what_to_run() -> None:
    payload = _payload()
    payload["runs"] = payload["runs"][:1]
    with pytest.raises(SystemExit, match="--cut-scenarios none"):
        analyse(payload)


def test_interference_takes_the_scenarios_whose_cuts_run() -> None:
    assert _parse(["--cut-scenarios", "none,delay"])[0].cut_scenarios == ("none", "delay")
    assert _parse([])[0].cut_scenarios == Config().cut_scenarios
    with pytest.raises(SystemExit):
        _parse(["--cut-scenarios", "nothing"])
