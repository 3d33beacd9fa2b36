"""LightningCLI: ``python -m lightning_dynpipe`` and a user's own LightningCLI script with DynPipeStrategy.

Parse-only checks run in this process (``--print_config``, or ``run=False``, which builds the Trainer and
its strategy but starts no process; well under a second each). The ``multiprocess`` tests start the real
command in a fresh interpreter, so the default popen launcher re-runs it for rank 1
(``python -m lightning_dynpipe.__main__ ...`` or ``python examples/cli_user_script.py ...``); about
10-25 s each on 2 CPU cores, most of it interpreter and Lightning start-up.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

import lightning_dynpipe.__main__ as entry
from lightning_dynpipe import ConfigurationError, DynPipeStrategy
from lightning_dynpipe.cli.lightning_cli import main
from lightning_dynpipe.errors import PartitionError

# Lightning 2.6's LightningCLI calls jsonargparse APIs deprecated in jsonargparse 4.49; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning")

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
USER_SCRIPT = ROOT / "examples" / "cli_user_script.py"
TIMEOUT_S = 300


def _summary(schedule: str = "async", num_microbatches: int = 4, balance: str = r"\d+, \d+") -> str:
    return (
        rf"DynPipe: 2 stages x 1 pipeline\(s\), balance \[{balance}\], schedule={schedule}, "
        rf"num_microbatches={num_microbatches}\n"
    )


#: What each shipped config must set up: the strategy's one-line summary that rank 0 logs in ``setup`` (a regex;
#: where the config gives no ``balance`` the strategy balances by parameter count, not this test's business).
EXPECTED_SUMMARY = {
    "mnist_mlp.yaml": _summary(),
    "digits_sync.yaml": _summary("sync", 2, "2, 1"),
    "mnist_cnn.yaml": _summary(),
    "gpt_char.yaml": _summary(),
}
DYNPIPE_ARGS = {name for name in inspect.signature(DynPipeStrategy.__init__).parameters if name != "self"}
#: DDPStrategy's own arguments and the DistributedDataParallel ones it forwards through ``**kwargs``.
DDP_ONLY_ARGS = (
    {name for name in inspect.signature(DDPStrategy.__init__).parameters if name != "self"}
    | {
        "output_device",
        "broadcast_buffers",
        "find_unused_parameters",
        "static_graph",
        "gradient_as_bucket_view",
        "bucket_cap_mb",
    }
) - DYNPIPE_ARGS
#: A small model and data module for the parse checks of ``python -m lightning_dynpipe``.
SMALL = [
    "--model=lightning_dynpipe.demos.MLP",
    "--model.in_features=64",
    "--model.width=16",
    "--model.depth=1",
    "--data=lightning_dynpipe.demos.DigitsDataModule",
]
TWO_CPUS = ["--trainer.accelerator=cpu", "--trainer.devices=2"]


def _load_user_script() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("cli_user_script", USER_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Loaded at collection, like the other example tests (imports must not happen inside a test's env-leak check).
user_script = _load_user_script()


def _print_config(capsys: pytest.CaptureFixture[str], entry_point: Any, args: list[str]) -> dict[str, Any]:
    with pytest.raises(SystemExit) as exit_info:
        entry_point([*args, "--print_config"])
    out = capsys.readouterr().out
    assert exit_info.value.code in (0, None), out
    config = yaml.safe_load(out)
    assert isinstance(config, dict), out
    return config


def _strategy_class(value: Any) -> type:
    """The class a ``trainer.strategy`` config value resolves to: a registry name or a class path."""
    if isinstance(value, str):
        return StrategyRegistry[value.lower()]["strategy"]  # type: ignore[no-any-return]
    class_path = value["class_path"]
    if "." not in class_path:
        return DynPipeStrategy if class_path == DynPipeStrategy.__name__ else type(None)
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when both ``args`` and a command line (here pytest's) are present."""
    monkeypatch.setattr(sys, "argv", [sys.argv[0]])


# ---------------------------------------------------------------------------------------------- shipped configs
def test_every_shipped_config_has_expectations() -> None:
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED_SUMMARY)


@pytest.mark.parametrize("config", sorted(EXPECTED_SUMMARY))
def test_shipped_config_avoids_the_limit_batches_trap(config: str) -> None:
    """jsonargparse turns ``limit_val_batches: 1`` into ``1.0``, which Lightning reads as 100 %."""
    trainer = yaml.safe_load((CONFIGS / config).read_text())["trainer"]
    traps = {k: v for k, v in trainer.items() if k.startswith("limit_") and v == 1 and isinstance(v, int)}
    assert not traps, f"{config}: {traps} means 100 % once parsed; write an integer > 1 or a fraction < 1"


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test", "predict"])
@pytest.mark.parametrize("config", sorted(EXPECTED_SUMMARY))
def test_shipped_config_parses(capsys: pytest.CaptureFixture[str], config: str, subcommand: str) -> None:
    printed = _print_config(capsys, main, [subcommand, "--config", str(CONFIGS / config)])
    assert _strategy_class(printed["trainer"]["strategy"]) is DynPipeStrategy
    for key in ("model", "data"):
        module, _, name = printed[key]["class_path"].rpartition(".")
        assert hasattr(importlib.import_module(module), name)


# ---------------------------------------------------------------------------------------------- --print_config
@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--config", str(CONFIGS / "mnist_mlp.yaml")], id="yaml-class-path"),
        pytest.param(["--config", str(CONFIGS / "digits_sync.yaml")], id="yaml-short-class-name"),
        pytest.param(SMALL, id="entry-point-default"),
        pytest.param(
            [*SMALL, "--trainer.strategy=DynPipeStrategy", "--trainer.strategy.schedule=sync"],
            id="flag-with-nested-arg",
        ),
    ],
)
def test_print_config_shows_exactly_dynpipe_init_args(capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    strategy = _print_config(capsys, main, ["fit", *args])["trainer"]["strategy"]
    assert strategy["class_path"] in ("lightning_dynpipe.DynPipeStrategy", "DynPipeStrategy")
    assert set(strategy["init_args"]) == DYNPIPE_ARGS
    assert {"ddp_comm_hook", "model_averaging_period", "kwargs"} <= DDP_ONLY_ARGS  # the reference is DDP's
    assert not set(strategy["init_args"]) & DDP_ONLY_ARGS


def test_user_script_print_config_shows_exactly_dynpipe_init_args(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "strategy.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "strategy": {
                        "class_path": "lightning_dynpipe.DynPipeStrategy",
                        "init_args": {"num_microbatches": 8},
                    }
                }
            }
        )
    )
    strategy = _print_config(capsys, user_script.cli_main, ["fit", "--config", str(config)])["trainer"]["strategy"]
    assert set(strategy["init_args"]) == DYNPIPE_ARGS
    assert strategy["init_args"]["num_microbatches"] == 8


# ---------------------------------------------------------------------------------------------- strategy forms
@pytest.fixture
def strategy_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "strategy.yaml"
    path.write_text(
        "trainer:\n"
        "  strategy:\n"
        "    class_path: lightning_dynpipe.DynPipeStrategy\n"
        "    init_args: {num_microbatches: 8, schedule: sync}\n"
    )
    return path


FORMS = [
    pytest.param(["--trainer.strategy=dynpipe"], {}, id="registered-name"),
    pytest.param(["--trainer.strategy=lightning_dynpipe.DynPipeStrategy"], {}, id="bare-class-path"),
    pytest.param(["--trainer.strategy=lightning_dynpipe.strategy.DynPipeStrategy"], {}, id="bare-module-path"),
    pytest.param(["--trainer.strategy=DynPipeStrategy"], {}, id="bare-class-name"),
    pytest.param(
        ["--trainer.strategy=lightning_dynpipe.DynPipeStrategy", "--trainer.strategy.num_microbatches=8"],
        {"num_microbatches": 8},
        id="class-path-with-nested-flag",
    ),
    pytest.param(
        [
            '--trainer.strategy={"class_path": "lightning_dynpipe.DynPipeStrategy",'
            ' "init_args": {"schedule": "gpipe", "balance": [1, 1]}}'
        ],
        {"schedule": "gpipe", "balance": [1, 1]},
        id="json",
    ),
    pytest.param(["--config", "STRATEGY_YAML"], {"num_microbatches": 8, "schedule": "sync"}, id="yaml"),
    pytest.param(["--trainer.strategy=dynpipe_spawn"], {"_start_method": "spawn"}, id="registered-spawn"),
]


@pytest.mark.parametrize("form, expected", FORMS)
@pytest.mark.parametrize("entry_point", ["python -m lightning_dynpipe", "user script"])
def test_strategy_forms_build_dynpipe(
    form: list[str], expected: dict[str, Any], entry_point: str, strategy_yaml: Path
) -> None:
    """Every form gives a DynPipeStrategy with the right arguments and launcher (built, not launched)."""
    form = [str(strategy_yaml) if a == "STRATEGY_YAML" else a for a in form]
    if entry_point == "user script":
        cli: LightningCLI = user_script.cli_main([*TWO_CPUS, *form], run=False)
    else:
        cli = main([*SMALL, *TWO_CPUS, "--seed_everything=0", *form], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, DynPipeStrategy)
    want = {"num_microbatches": 4, "schedule": "async", "_start_method": "popen", **expected}
    assert {k: getattr(strategy, k) for k in want} == want
    launcher = _SubprocessScriptLauncher if want["_start_method"] == "popen" else _MultiProcessingLauncher
    assert isinstance(strategy.launcher, launcher)
    assert cli.trainer.world_size == 2


def test_user_script_keeps_lightnings_default_strategy() -> None:
    """Only ``python -m lightning_dynpipe`` defaults to DynPipe; a user's own CLI keeps Lightning's ``auto``."""
    cli = user_script.cli_main(["--trainer.accelerator=cpu", "--trainer.devices=1"], run=False)
    assert not isinstance(cli.trainer.strategy, DynPipeStrategy)


# ---------------------------------------------------------------------------------------------- __main__ dispatch
def test_dispatch_sends_lightning_subcommands_to_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    config = _print_config(capsys, entry.dispatch, ["fit", *SMALL])
    assert config["model"]["class_path"] == "lightning_dynpipe.demos.MLP"


def test_plan_command_prints_the_plan_and_writes_the_timeline(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``python -m lightning_dynpipe plan``: profile, plan and simulate without starting any process."""
    timeline, trace = tmp_path / "timeline.png", tmp_path / "trace.json"
    status = entry.dispatch(
        [
            "plan",
            "--model",
            "lightning_dynpipe.demos:MLP",
            "--init-args",
            '{"width": 64, "depth": 3}',
            "--devices",
            "2",
            "--batch-size",
            "32",
            "--num-microbatches",
            "4",
            "--timeline",
            str(timeline),
            "--trace",
            str(trace),
            "--latency-us",
            "50",
            "--bandwidth-gbps",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "Per-layer profile (micro-batch of 8)" in out
    assert "stages=2" in out and "partition=[" in out and "time to accuracy" in out
    assert "simulated async step" in out
    assert timeline.stat().st_size > 1000 and json.loads(trace.read_text())["traceEvents"]


def test_plan_command_plans_within_a_memory_cap(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["plan", "--model", "lightning_dynpipe.demos:MLP", "--init-args", '{"width": 64, "depth": 3}',
            "--devices", "2", "--batch-size", "32", "--timeline", str(tmp_path / "t.png")]  # fmt: skip
    assert entry.dispatch([*args, "--memory-cap", "1GiB"]) == 0
    assert "1.0 GiB" in capsys.readouterr().out  # the cap column of the plan table
    with pytest.raises(PartitionError, match="No partition of the .* layers fits the memory cap"):
        entry.dispatch([*args, "--memory-cap", "1KiB"])
    with pytest.raises(SystemExit):
        entry.dispatch([*args, "--memory-cap", "12GB"])
    assert "expected bytes with an optional unit of B, KiB, MiB, GiB, TiB" in capsys.readouterr().err


class NoExampleInput(torch.nn.Module):
    """A model with a pipeline but no way to tell its input shape."""

    def __init__(self) -> None:
        super().__init__()
        self.pipeline = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def test_plan_command_explains_a_missing_input_shape(tmp_path: Path) -> None:
    args = [
        "plan",
        "--model",
        f"{__name__}:NoExampleInput",
        "--devices",
        "2",
        "--batch-size",
        "8",
        "--timeline",
        str(tmp_path / "t.png"),
    ]
    with pytest.raises(ConfigurationError, match="give --input-shape"):
        entry.dispatch(args)
    assert entry.dispatch([*args, "--input-shape", "4"]) == 0
    with pytest.raises(ConfigurationError, match="has no attribute `layers`"):
        entry.dispatch([*args, "--pipeline-attr", "layers"])


# ---------------------------------------------------------------------------------------------- real runs
_LAUNCH_ENV = ("MASTER_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK", "TORCHELASTIC_", "PL_")
FEW_STEPS = ["--trainer.max_steps=2", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false"]


def _run(command: list[str], root_dir: Path) -> str:
    # A clean launch environment: rank variables inherited from a surrounding job would make Lightning think
    # the processes were already created.
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_ENV)}
    proc = subprocess.run(
        [sys.executable, *command, *FEW_STEPS, f"--trainer.default_root_dir={root_dir}"],
        cwd=root_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command} exited with {proc.returncode}:\n{out[-4000:]}"
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in out, "rank 1 was not started by the popen launcher"
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in out, out[-4000:]
    assert len(list(root_dir.glob("lightning_logs/version_0/checkpoints/*step=2.ckpt"))) == 1
    return out


#: The shipped configs run for real here: the transformer (async, the planner, adaptation on) and the sync one
#: (short class names). Every config is parsed for every subcommand above; the MNIST models of the other two run
#: in 2 processes in tests/examples (the MNIST demo) and tests/benchmarks (the planner and simulator smoke runs).
REAL_RUNS = ["digits_sync.yaml", "gpt_char.yaml"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", REAL_RUNS)
def test_shipped_config_runs_a_few_steps(config: str, tmp_path: Path) -> None:
    out = _run(["-m", "lightning_dynpipe", "fit", "--config", str(CONFIGS / config)], tmp_path)
    assert len(re.findall(EXPECTED_SUMMARY[config], out)) == 1, out[-4000:]  # rank 0 only
    saved = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "config.yaml").read_text())
    assert _strategy_class(saved["trainer"]["strategy"]) is DynPipeStrategy


@pytest.mark.multiprocess
def test_user_script_runs_with_a_bare_class_path(tmp_path: Path) -> None:
    """The riskiest form end to end: the bare class path reaches the registry as a lower-cased string."""
    out = _run([str(USER_SCRIPT), "fit", *TWO_CPUS, "--trainer.strategy=lightning_dynpipe.DynPipeStrategy"], tmp_path)
    assert len(re.findall(_summary(), out)) == 1, out[-4000:]  # DynPipe's defaults
