"""``python -m lightning_dynpipe``: the command-line entry point.

Example::

    python -m lightning_dynpipe fit --config examples/configs/mnist_mlp.yaml
    python -m lightning_dynpipe test --config examples/configs/digits_sync.yaml
    python -m lightning_dynpipe plan ...          # only where lightning_dynpipe.plan_cli is installed

``plan`` is handed to ``lightning_dynpipe.plan_cli.main(argv)`` (the arguments after ``plan``; it returns an
exit status or ``None``) when that module exists; everything else goes to the ``LightningCLI`` of
:mod:`lightning_dynpipe.cli` (``fit``, ``validate``, ``test``, ``predict``).

The default ``popen`` launcher starts the other ranks with ``python -m lightning_dynpipe.__main__`` and the
same arguments, so they pass through this dispatch again and build the same Trainer.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from typing import cast

PLAN_COMMAND = "plan"
PLAN_MODULE = "lightning_dynpipe.plan_cli"


def dispatch(argv: Sequence[str] | None = None) -> int:
    """Routes ``argv`` to the planner (``plan ...``) or to the ``LightningCLI`` (everything else).

    Args:
        argv: the arguments after ``python -m lightning_dynpipe``; ``None`` reads ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, 2 when ``plan`` is asked for but not installed, otherwise what
        ``plan_cli.main`` returns. ``LightningCLI`` exits by itself (status 2) on a bad argument.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [PLAN_COMMAND]:
        return _run_plan(args[1:])
    from lightning_dynpipe.cli import main  # imports Lightning (seconds): only on this path

    # popen children re-run sys.argv, so the LightningCLI must see this very command line.
    main(None if argv is None else args)
    return 0


def _run_plan(args: list[str]) -> int:
    if importlib.util.find_spec(PLAN_MODULE) is None:
        print(
            f"error: the '{PLAN_COMMAND}' command needs the module {PLAN_MODULE}, which is not part of this "
            f"installation of lightning_dynpipe. Available commands: fit, validate, test, predict "
            f"(python -m lightning_dynpipe fit --help).",
            file=sys.stderr,
        )
        return 2
    plan_main = cast(Callable[[list[str]], "int | None"], importlib.import_module(PLAN_MODULE).main)
    status = plan_main(args)
    return 0 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(dispatch())
