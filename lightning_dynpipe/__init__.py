"""lightning-dynpipe: asynchronous, interference-aware, dynamically repartitioned pipeline parallelism for Lightning.

Example::

    import lightning.pytorch as L
    from lightning_dynpipe import DynPipeStrategy

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DynPipeStrategy(num_microbatches=4))

Importing the package registers the strategy names ``"dynpipe"``, ``"dynpipe_spawn"`` and ``"dynpipe_fork"``
(idempotently), so ``Trainer(strategy="dynpipe")`` works after ``import lightning_dynpipe``. The import itself
stays light: the pure packages (``lightning_dynpipe.plan``, ``.schedule``, ``.monitor.stats``) load without
Lightning or ``torch.distributed``. The strategy class is imported on first use, and the names are registered
as soon as ``lightning.pytorch`` is imported (at once if it already is).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from lightning_dynpipe.errors import (
    CommunicationError,
    ConfigurationError,
    DynPipeError,
    PartitionError,
    PeerFailure,
    PipelineTimeoutError,
    ScheduleError,
)
from lightning_dynpipe.plan.partition import Partition

if TYPE_CHECKING:
    from lightning_dynpipe.strategy import (
        DynPipeStrategy,
        MigrationRecord,
        RestartPlan,
        ScheduleChange,
        fit_with_restarts,
    )

__version__ = "0.1.0"

__all__ = [
    "DynPipeStrategy",
    "MigrationRecord",
    "ScheduleChange",
    "RestartPlan",
    "fit_with_restarts",
    "Partition",
    "DynPipeError",
    "ConfigurationError",
    "PartitionError",
    "ScheduleError",
    "CommunicationError",
    "PipelineTimeoutError",
    "PeerFailure",
    "__version__",
]

_LAZY = {"DynPipeStrategy", "MigrationRecord", "ScheduleChange", "RestartPlan", "fit_with_restarts"}
_TRIGGER = "lightning.pytorch"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from lightning_dynpipe import strategy

        return getattr(strategy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)


def _register_strategy_names() -> None:
    """Registers the strategy names with Lightning (idempotent), once ``lightning.pytorch`` is loaded.

    When Lightning is first imported from inside the strategy package, that package is still half-built when
    Lightning's import ends; it registers the names itself at its end.
    """
    strategy = sys.modules.get("lightning_dynpipe.strategy")
    if strategy is not None and not hasattr(strategy, "register_strategy_names"):
        return
    from lightning_dynpipe.strategy import register_strategy_names

    register_strategy_names()


class _RegisterAfterImport(importlib.abc.Loader):
    """Runs ``lightning.pytorch``'s own loader, then registers the strategy names."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _register_strategy_names()

    def __getattr__(self, name: str) -> Any:  # resource readers and the like: the original loader's
        return getattr(self._loader, name)


class _LightningImportHook(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch`` with the other finders and wraps its loader; removes itself after one use."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TRIGGER:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisterAfterImport(spec.loader)
                return spec
        return None


def _install_registration() -> None:
    if _TRIGGER in sys.modules:
        _register_strategy_names()
    elif not any(isinstance(f, _LightningImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _LightningImportHook())


_install_registration()
