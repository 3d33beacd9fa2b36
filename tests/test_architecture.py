"""The layout's one-way arrows (docs/design.md), checked on the source with the AST so a wrong import fails CI.

Every module belongs to a package (its first folder under ``lightning_dynpipe``); each package may import only
the packages listed for it (and itself), pure packages import nothing heavy, and only the strategy and the
command line touch Lightning beyond the two thin callbacks. A subprocess then checks what importing the pure
packages really loads.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "lightning_dynpipe"

# package -> the other parts of lightning_dynpipe it may import ("engine.microbatch": that module only)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "schedule": {"errors"},
    "plan": {"errors", "schedule"},
    "predictor": {"errors", "plan", "monitor.stats"},
    "profiling": {"errors", "plan", "engine.microbatch"},
    "engine": {"errors", "schedule", "plan"},
    "monitor": {"errors"},
    "calibration": {"errors", "plan", "engine.microbatch", "engine.updates"},
    "repartition": {"errors", "plan", "schedule", "predictor"},
    "interference": {"errors", "monitor"},
    "sweep": {"errors", "plan", "predictor", "interference", "monitor", "engine.microbatch"},
    "demos": {"errors"},
    "strategy": {
        "errors",
        "plan",
        "schedule",
        "profiling",
        "engine",
        "monitor",
        "predictor",
        "repartition",
        "interference",
        "sweep",
    },
    "cli": {
        "errors",
        "plan",
        "schedule",
        "profiling",
        "strategy",
        "predictor",
        "interference",
        "monitor",
        "sweep",
        "__init__",
    },
    "__init__": {"errors", "plan", "strategy"},
    "__main__": {"cli"},
}

HEAVY = {"torch", "lightning", "pytorch_lightning", "sklearn", "matplotlib", "torchmetrics"}
LIGHTNING = {"lightning", "pytorch_lightning", "torchmetrics"}

# package (or module) -> third-party tops it must not import at module level / at all
PURE = {"schedule", "plan", "predictor", "repartition", "monitor.stats"}
NO_LIGHTNING = {"engine", "profiling", "repartition", "calibration", "interference", "monitor", "predictor", "sweep"}
LIGHTNING_CALLBACKS = {"monitor/callback.py", "interference/callback.py"}  # thin Lightning callbacks


@dataclass(frozen=True)
class Import:
    name: str
    lazy: bool  # inside a function: the module loads without it


def _imports(path: Path) -> list[Import]:
    tree = ast.parse(path.read_text())
    out: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend(Import(a.name, lazy) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                if child.module == "lightning_dynpipe":  # `from lightning_dynpipe import x`: x is a module or a name
                    out.extend(Import(f"lightning_dynpipe.{a.name}", lazy) for a in child.names)
                else:
                    out.append(Import(child.module, lazy))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                continue  # annotations only
            visit(child, inner)

    visit(tree, False)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def _package(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _target(name: str) -> tuple[str, str] | None:
    """``lightning_dynpipe.engine.microbatch.x`` -> ("engine", "engine.microbatch")."""
    parts = name.split(".")
    if parts[0] != "lightning_dynpipe":
        return None
    if len(parts) == 1:
        return "__init__", "__init__"
    top = parts[1]
    if top in ("DynPipeStrategy", "MigrationRecord", "Partition", "__version__"):
        return "__init__", "__init__"
    return top, ".".join(parts[1:3])


MODULES = sorted(p for p in PKG.rglob("*.py"))


def test_every_module_is_in_a_package_or_is_the_public_entry() -> None:
    loose = sorted(p.name for p in PKG.glob("*.py") if p.stem not in ("__init__", "__main__", "errors"))
    assert not loose, f"modules outside a package: {loose}"
    unknown = sorted({_package(p) for p in MODULES} - set(ALLOWED))
    assert not unknown, f"packages without declared arrows: {unknown}; add them to ALLOWED and docs/design.md"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_follow_the_arrows(path: Path) -> None:
    package = _package(path)
    allowed = ALLOWED[package]
    bad = []
    for imp in _imports(path):
        target = _target(imp.name)
        if target is None or target[0] == package:
            continue
        if target[0] not in allowed and target[1] not in allowed:
            bad.append(f"{imp.name} ({package} may import {sorted(allowed)})")
    assert not bad, f"{path.relative_to(PKG.parent)}: " + "; ".join(bad)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_pure_packages_import_nothing_heavy_and_only_the_strategy_needs_lightning(path: Path) -> None:
    rel = str(path.relative_to(PKG))
    package = _package(path)
    module = f"{package}.{path.stem}"
    bad = []
    for imp in _imports(path):
        top = imp.name.split(".")[0]
        if (package in PURE or module in PURE) and top in HEAVY and not (imp.lazy and top in ("matplotlib", "sklearn")):
            bad.append(f"{imp.name} (pure: lazy matplotlib/sklearn only)")
        if package in NO_LIGHTNING and top in LIGHTNING and rel not in LIGHTNING_CALLBACKS:
            bad.append(f"{imp.name} (only the strategy, the CLI and the thin callbacks import Lightning)")
        if imp.name.startswith("torch.distributed") and package in ("profiling", "calibration"):
            bad.append(f"{imp.name} (single-process package)")
    assert not bad, f"{rel}: " + "; ".join(bad)


def test_nothing_but_the_cli_and_the_package_root_imports_the_strategy() -> None:
    offenders = [
        str(p.relative_to(PKG))
        for p in MODULES
        if _package(p) not in ("strategy", "cli", "__init__")
        and any((_target(i.name) or ("", ""))[0] == "strategy" for i in _imports(p))
    ]
    assert not offenders


def test_only_lightning_dot_pytorch_is_used() -> None:
    """`pytorch_lightning` is a separate copy; mixing it breaks isinstance checks in the connector."""
    offenders = [str(p) for p in MODULES if any(i.name.startswith("pytorch_lightning") for i in _imports(p))]
    assert not offenders


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_pure_packages_load_without_lightning_or_torch() -> None:
    out = _run(
        "import sys\n"
        "import lightning_dynpipe.plan, lightning_dynpipe.schedule, lightning_dynpipe.monitor.stats\n"
        "import lightning_dynpipe.predictor, lightning_dynpipe.repartition\n"
        "print(sorted(m for m in ('lightning', 'torch', 'torch.distributed', 'sklearn') if m in sys.modules))"
    )
    assert out == "[]"


_ORDERS = ("package-first", "lightning-first", "strategy-module-first")


def _registration_code(order: str) -> str:
    first, second = "import lightning_dynpipe", "from lightning.pytorch.strategies import StrategyRegistry"
    if order == "lightning-first":
        first, second = second, first
    elif order == "strategy-module-first":  # Lightning is first imported from inside the strategy package
        first = "import lightning_dynpipe.strategy.callbacks"
    return (
        f"{first}\n{second}\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "from lightning_dynpipe import DynPipeStrategy\n"
        "print(all(StrategyRegistry[n]['strategy'] is DynPipeStrategy for n in ('dynpipe', 'dynpipe_spawn')))"
    )


@pytest.fixture(scope="module")
def registrations() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """One fresh interpreter per import order, all started at once: each spends most of its time importing
    Lightning (about 8 s on the 2-core CI machine), which they then do side by side."""
    procs = {
        order: subprocess.Popen(
            [sys.executable, "-c", _registration_code(order)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for order in _ORDERS
    }
    yield procs
    for proc in procs.values():  # those of tests that did not run
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("order", _ORDERS)
def test_importing_the_package_registers_the_strategy_names(
    order: str, registrations: dict[str, subprocess.Popen[str]]
) -> None:
    out, err = registrations[order].communicate(timeout=120)
    assert registrations[order].returncode == 0, err
    out = out.strip()
    assert out == "True"
