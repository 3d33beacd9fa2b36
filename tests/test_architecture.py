"""Dependency direction (ARCHITECTURE.md): plan/ and schedule/ are pure; engine/ never imports Lightning;
nothing below strategy.py imports it. Checked on the source with the AST, so the rule holds in CI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "lightning_dynpipe"

# package -> top-level imports it must not make (directly)
FORBIDDEN = {
    "plan": {
        "torch",
        "lightning",
        "pytorch_lightning",
        "sklearn",
        "lightning_dynpipe.engine",
        "lightning_dynpipe.strategy",
    },
    "schedule": {
        "torch",
        "lightning",
        "pytorch_lightning",
        "sklearn",
        "lightning_dynpipe.engine",
        "lightning_dynpipe.strategy",
    },
    "engine": {"lightning", "pytorch_lightning", "lightning_dynpipe.strategy"},
    "repartition": {"lightning", "pytorch_lightning", "lightning_dynpipe.strategy"},
    "profiling": {
        "lightning",
        "pytorch_lightning",
        "torch.distributed",
        "sklearn",
        "lightning_dynpipe.engine",
        "lightning_dynpipe.strategy",
    },
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependency_direction(package: str) -> None:
    bad = []
    for path in sorted((PKG / package).rglob("*.py")):
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(PKG.parent)} imports {name}")
    assert not bad, "\n".join(bad)


def test_only_lightning_dot_pytorch_is_used() -> None:
    """`pytorch_lightning` is a separate copy; mixing it breaks isinstance checks in the connector."""
    offenders = [str(p) for p in PKG.rglob("*.py") if any(n.startswith("pytorch_lightning") for n in _imports(p))]
    assert not offenders
