"""What `pip install lightning-dynpipe` brings: everything the library and its command line import, and not
matplotlib (optional, with an install hint where a plot is asked for)."""

from __future__ import annotations

import builtins
import configparser
import re
from pathlib import Path
from typing import Any

import pytest

from lightning_dynpipe.cli import dispatch
from lightning_dynpipe.schedule import simulate
from lightning_dynpipe.schedule.plot import plot_timeline

ROOT = Path(__file__).resolve().parents[1]


def _requirements(section: str, key: str) -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = [line.split("#")[0].strip() for line in cfg[section][key].splitlines()]
    return {re.split(r"[<>=;\[ ]", line)[0].lower() for line in lines if line}


def test_the_package_itself_depends_on_what_the_cli_and_the_library_import() -> None:
    required = _requirements("options", "install_requires")
    assert {"torch", "lightning", "jsonargparse", "torchmetrics", "scikit-learn", "numpy", "psutil"} <= required
    assert "matplotlib" not in required
    cfg = (ROOT / "setup.cfg").read_text()
    assert "jsonargparse[signatures]" in cfg.split("[options.extras_require]")[0]  # LightningCLI needs the extra


def test_without_matplotlib_a_plot_gives_the_install_hint_and_the_plan_command_still_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".")[0] == "matplotlib":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"plot_timeline needs matplotlib: pip install 'lightning-dynpipe\[plot\]'"):
        plot_timeline(simulate("async", 2, 2, 1), tmp_path / "t.png")
    args = ["plan", "--model", "lightning_dynpipe.demos:MLP", "--init-args", '{"width": 16, "depth": 2}',
            "--devices", "2", "--batch-size", "8", "--timeline", str(tmp_path / "t.png")]  # fmt: skip
    assert dispatch(args) == 0
    out = capsys.readouterr().out
    assert "time to accuracy" in out and "timeline not written: plot_timeline needs matplotlib" in out
    assert not (tmp_path / "t.png").exists()
