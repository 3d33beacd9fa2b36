"""``python -m lightning_dynpipe``: the command-line entry point.

Example::

    python -m lightning_dynpipe fit --config examples/configs/mnist_mlp.yaml
    python -m lightning_dynpipe test --config examples/configs/digits_sync.yaml
    python -m lightning_dynpipe plan --model lightning_dynpipe.demos:MLP --devices 2 --batch-size 64

``plan`` is handed to :func:`lightning_dynpipe.plan_cli.main` (profile, plan and simulate, no training);
everything else goes to the ``LightningCLI`` of :mod:`lightning_dynpipe.cli` (``fit``, ``validate``,
``test``, ``predict``).

The default ``popen`` launcher starts the other ranks with ``python -m lightning_dynpipe.__main__`` and the
same arguments, so they pass through this dispatch again and build the same Trainer.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

PLAN_COMMAND = "plan"


def dispatch(argv: Sequence[str] | None = None) -> int:
    """Routes ``argv`` to the planner (``plan ...``) or to the ``LightningCLI`` (everything else).

    Args:
        argv: the arguments after ``python -m lightning_dynpipe``; ``None`` reads ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, otherwise what ``plan_cli.main`` returns. ``LightningCLI`` exits by
        itself (status 2) on a bad argument.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [PLAN_COMMAND]:
        return _run_plan(args[1:])
    from lightning_dynpipe.cli import main  # imports Lightning (seconds): only on this path

    # popen children re-run sys.argv, so the LightningCLI must see this very command line.
    main(None if argv is None else args)
    return 0


def _run_plan(args: list[str]) -> int:
    from lightning_dynpipe.plan_cli import main as plan_main

    return plan_main(args)


if __name__ == "__main__":
    sys.exit(dispatch())
