"""The command line: ``python -m lightning_dynpipe {fit,validate,test,predict,plan,calibrate} ...``.

* :mod:`lightning_dynpipe.cli.lightning_cli`: Lightning's ``LightningCLI`` with
  :class:`~lightning_dynpipe.DynPipeStrategy` as the default strategy (``fit``, ``validate``, ``test``, ``predict``);
* :mod:`lightning_dynpipe.cli.plan`: ``plan``, profile a model, plan its partition and simulate it without
  training;
* :mod:`lightning_dynpipe.cli.calibrate`: ``calibrate``, train the interference forest on this machine with the
  model's own layer sets under injected interference, and save it;
* :func:`dispatch`: routes the arguments to one of them (``python -m lightning_dynpipe`` calls it).

Nothing here imports Lightning until a Lightning subcommand runs, so ``plan`` and ``calibrate`` start quickly.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["dispatch", "PLAN_COMMAND", "CALIBRATE_COMMAND"]

PLAN_COMMAND = "plan"
CALIBRATE_COMMAND = "calibrate"


def dispatch(argv: Sequence[str] | None = None) -> int:
    """Routes ``argv`` to the planner (``plan ...``), the calibration (``calibrate ...``) or to the
    ``LightningCLI`` (everything else).

    Args:
        argv: the arguments after ``python -m lightning_dynpipe``; ``None`` reads ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, otherwise what :func:`lightning_dynpipe.cli.plan.main` returns.
        ``LightningCLI`` exits by itself (status 2) on a bad argument.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [PLAN_COMMAND]:
        from lightning_dynpipe.cli.plan import main as plan_main

        return plan_main(args[1:])
    if args[:1] == [CALIBRATE_COMMAND]:
        from lightning_dynpipe.cli.calibrate import main as calibrate_main

        return calibrate_main(args[1:])
    from lightning_dynpipe.cli.lightning_cli import main  # imports Lightning (seconds): only on this path

    # popen children re-run sys.argv, so the LightningCLI must see this very command line.
    main(None if argv is None else args)
    return 0
