"""The examples in the plan package's docstrings run and print what they say."""

from __future__ import annotations

import doctest
from types import ModuleType

import pytest

import lightning_dynpipe.plan.convergence
import lightning_dynpipe.plan.costs
import lightning_dynpipe.plan.memory
import lightning_dynpipe.plan.solver

MODULES = [
    lightning_dynpipe.plan.costs,
    lightning_dynpipe.plan.memory,
    lightning_dynpipe.plan.convergence,
    lightning_dynpipe.plan.solver,
]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module: ModuleType) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
