"""``python -m lightning_dynpipe``: the command-line entry point.

Example::

    python -m lightning_dynpipe fit --config examples/configs/mnist_mlp.yaml
    python -m lightning_dynpipe test --config examples/configs/digits_sync.yaml
    python -m lightning_dynpipe plan --model lightning_dynpipe.demos:MLP --devices 2 --batch-size 64

``plan`` goes to :func:`lightning_dynpipe.cli.plan.main` (profile, plan and simulate, no training); everything
else to the ``LightningCLI`` of :mod:`lightning_dynpipe.cli.lightning_cli` (``fit``, ``validate``, ``test``,
``predict``). The default ``popen`` launcher starts the other ranks with ``python -m lightning_dynpipe.__main__``
and the same arguments, so they pass through this dispatch again and build the same Trainer.
"""

from __future__ import annotations

import sys

from lightning_dynpipe.cli import dispatch

if __name__ == "__main__":
    sys.exit(dispatch())
