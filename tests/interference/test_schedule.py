"""InterferenceSpec / InterferenceSchedule: parsing from dicts and YAML, and errors that name entry and field."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_dynpipe.interference.base import InterferenceConfigError
from lightning_dynpipe.interference.cpu import CpuHog, allowed_cores
from lightning_dynpipe.interference.link import BoundLinkDelay
from lightning_dynpipe.interference.quota import CpuLimit
from lightning_dynpipe.interference.schedule import InterferenceSchedule, InterferenceSpec, make_interference

ENTRIES: list[dict[str, Any]] = [
    {"kind": "cpu_hog", "stage": 0, "start_step": 100, "duty_cycle": 1},
    {"kind": "cpu_quota", "stage": 1, "start_step": 0, "stop_step": 200, "fraction": 0.25},
    {"kind": "link_delay", "stage": 0, "start_step": 50, "delay_s": 0.005, "jitter_s": 0.002},
    {"kind": "gpu", "stage": 1, "start_step": 10, "stop_step": 20, "duty_cycle": 0.5},
]

YAML = """\
interference:
  - {kind: cpu_hog, stage: 0, start_step: 100, duty_cycle: 1}
  - {kind: cpu_quota, stage: 1, start_step: 0, stop_step: 200, fraction: 0.25}
  - kind: link_delay
    stage: 0
    start_step: 50
    delay_s: 0.005
    jitter_s: 0.002
  - {kind: gpu, stage: 1, start_step: 10, stop_step: 20, duty_cycle: 0.5}
"""


def test_dicts_and_yaml_give_the_same_schedule(tmp_path: Path) -> None:
    from_dicts = InterferenceSchedule.from_config(ENTRIES)
    (tmp_path / "mapping.yaml").write_text(YAML)
    (tmp_path / "list.yaml").write_text(YAML.split("\n", 1)[1])
    assert InterferenceSchedule.from_config(tmp_path / "mapping.yaml") == from_dicts
    assert InterferenceSchedule.from_config(str(tmp_path / "list.yaml")) == from_dicts
    assert InterferenceSchedule.from_config(from_dicts) is from_dicts
    assert len(from_dicts) == 4
    hog = from_dicts[0]
    assert hog == InterferenceSpec("cpu_hog", 0, start_step=100, duty_cycle=1.0)
    assert isinstance(hog.duty_cycle, float)
    assert str(from_dicts[2]) == ("link_delay on boundary 0->1, steps [50, end), delay_s=0.005, jitter_s=0.002")
    assert str(from_dicts[1]) == "cpu_quota on stage 1, steps [0, 200), fraction=0.25"


def test_which_entries_a_stage_wants_at_a_step() -> None:
    schedule = InterferenceSchedule.from_config(ENTRIES)
    assert schedule.wanted(0, stage_idx=0) == []
    assert schedule.wanted(0, stage_idx=1) == [1]
    assert schedule.wanted(10, stage_idx=1) == [1, 3]
    assert schedule.wanted(20, stage_idx=1) == [1]  # stop_step is exclusive
    assert schedule.wanted(50, stage_idx=0) == [2]  # link_delay: both sides of its boundary
    assert schedule.wanted(50, stage_idx=1) == [1, 2]
    assert schedule.wanted(50, stage_idx=2) == []
    assert schedule.wanted(10_000, stage_idx=0) == [0, 2]  # no stop_step: until the end


@pytest.mark.parametrize(
    ("entry", "field", "message"),
    [
        (
            {"kind": "cpu_hgo", "stage": 0},
            "kind",
            "must be one of cpu_hog, cpu_quota, link_delay, gpu.*Did you mean 'cpu_hog'",
        ),
        (
            {"kind": "cpu_hog", "stage": 0, "dutycycle": 0.5},
            "dutycycle",
            "unknown field 'dutycycle' .did you mean 'duty_cycle'",
        ),
        ({"stage": 0}, "kind", "field 'kind' is required"),
        ({"kind": "cpu_hog"}, "stage", "field 'stage' is required"),
        ({"kind": "cpu_hog", "stage": -1}, "stage", "must be a stage index"),
        (
            {"kind": "cpu_hog", "stage": 0, "start_step": 10, "stop_step": 10},
            "stop_step",
            "must be an integer > start_step .10.",
        ),
        (
            {"kind": "cpu_hog", "stage": 0, "fraction": 0.5},
            "fraction",
            "does not apply to kind 'cpu_hog' .it applies to cpu_quota",
        ),
        ({"kind": "cpu_quota", "stage": 1}, "fraction", "field 'fraction' is required for kind 'cpu_quota'"),
        ({"kind": "cpu_quota", "stage": 1, "fraction": 0}, "fraction", "must be a positive number"),
        ({"kind": "cpu_hog", "stage": 0, "duty_cycle": 1.5}, "duty_cycle", r"must be a number in \(0, 1\]; got 1.5"),
        ({"kind": "cpu_hog", "stage": 0, "cores": [0, 0]}, "cores", "distinct core ids"),
        ({"kind": "cpu_hog", "stage": 0, "cores": "0,1"}, "cores", "must be a list of core ids"),
        ({"kind": "link_delay", "stage": 0, "delay_s": 0}, "delay_s", "would do nothing"),
        ({"kind": "link_delay", "stage": 0, "delay_s": -0.1}, "delay_s", "seconds >= 0"),
        ({"kind": "gpu", "stage": 0, "period_s": 0}, "period_s", r"in \(0, 60\]"),
    ],
)
def test_errors_name_the_entry_and_the_field(entry: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(InterferenceConfigError, match=message) as info:
        InterferenceSchedule.from_config([{"kind": "cpu_hog", "stage": 0}, entry])
    assert str(info.value).startswith("interference entry 1")
    assert info.value.entry == 1 and info.value.field == field


def test_files_that_are_not_schedules_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("kind: cpu_hog\nstage: 0\n")
    with pytest.raises(InterferenceConfigError, match="must hold a list of entries"):
        InterferenceSchedule.from_config(path)
    path.write_text("- {kind: cpu_hog, stage: [\n")
    with pytest.raises(InterferenceConfigError, match="is not valid YAML"):
        InterferenceSchedule.from_config(path)
    with pytest.raises(InterferenceConfigError, match="Cannot read the interference schedule"):
        InterferenceSchedule.from_config(tmp_path / "missing.yaml")
    with pytest.raises(InterferenceConfigError, match="Wrap a single entry in a list"):
        InterferenceSchedule.from_config({"kind": "cpu_hog", "stage": 0})  # type: ignore[arg-type]
    with pytest.raises(InterferenceConfigError, match="entry 0: expected a mapping"):
        InterferenceSchedule.from_config([["cpu_hog", 0]])  # type: ignore[list-item]


def test_validate_checks_stages_against_the_pipeline() -> None:
    schedule = InterferenceSchedule.from_config(ENTRIES)
    schedule.validate(num_stages=2)
    with pytest.raises(InterferenceConfigError, match=r"entry 1 .*'stage' is 1, but the pipeline has 1 stage\(s\)"):
        InterferenceSchedule.from_config(ENTRIES[:2]).validate(num_stages=1)
    with pytest.raises(InterferenceConfigError, match=r"entry 0 .*boundary 1 -> 2.*valid boundaries: 0..0") as info:
        InterferenceSchedule.from_config([{"kind": "link_delay", "stage": 1, "delay_s": 0.01}]).validate(2)
    assert info.value.field == "stage"


def test_make_interference_builds_unstarted_sources() -> None:
    host = SimpleNamespace(stage_idx=0, num_stages=2, executor=None)
    hog = make_interference(InterferenceSpec("cpu_hog", 0), host)
    assert isinstance(hog, CpuHog) and hog.cores == allowed_cores() and hog.duty_cycle == 1.0 and not hog.active
    hog = make_interference(InterferenceSpec("cpu_hog", 0, cores=[0], duty_cycle=0.5, period_s=0.1), host)
    assert isinstance(hog, CpuHog) and (hog.cores, hog.duty_cycle, hog.period_s) == ([0], 0.5, 0.1)
    limit = make_interference(InterferenceSpec("cpu_quota", 0, fraction=0.25), host)
    assert isinstance(limit, CpuLimit) and not limit.active
    link = make_interference(InterferenceSpec("link_delay", 0, delay_s=0.01, jitter_s=0.002, seed=4), host)
    assert isinstance(link, BoundLinkDelay) and link.boundary == 0
    assert (link.link.delay_s, link.link.jitter_s, link.link.seed) == (0.01, 0.002, 4)
