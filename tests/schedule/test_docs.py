"""The examples in the schedule package's docstrings run and print what they say."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "lightning_dynpipe.schedule",
    "lightning_dynpipe.schedule.instructions",
    "lightning_dynpipe.schedule.generators",
    "lightning_dynpipe.schedule.simulator",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
