"""The examples in the schedule package's docstrings run and print what they say."""

from __future__ import annotations

import doctest
from types import ModuleType

import pytest

# Imported at collection: importing the package imports Lightning, which sets environment variables that
# the suite's conftest would otherwise report as leaked by the first test.
import lightning_dynpipe.schedule
import lightning_dynpipe.schedule.generators
import lightning_dynpipe.schedule.instructions
import lightning_dynpipe.schedule.simulator

MODULES = [
    lightning_dynpipe.schedule,
    lightning_dynpipe.schedule.instructions,
    lightning_dynpipe.schedule.generators,
    lightning_dynpipe.schedule.simulator,
]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module: ModuleType) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
