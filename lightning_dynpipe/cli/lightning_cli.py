"""``LightningCLI`` entry point: ``python -m lightning_dynpipe fit --config examples/configs/mnist_mlp.yaml``.

Example::

    python -m lightning_dynpipe fit --config examples/configs/mnist_mlp.yaml
    python -m lightning_dynpipe fit --config examples/configs/mnist_mlp.yaml --trainer.max_steps=50
    python -m lightning_dynpipe fit --config examples/configs/mnist_mlp.yaml --print_config

The model and the data module are chosen by class path (any ``LightningModule`` / ``LightningDataModule``)::

    model:
      class_path: lightning_dynpipe.demos.MLP
      init_args: {width: 128, depth: 2}
    data:
      class_path: lightning_dynpipe.demos.MNISTDataModule

and the strategy by any of the forms Lightning's CLI accepts, all of which resolve to
:class:`~lightning_dynpipe.DynPipeStrategy`:

* a registered name: ``--trainer.strategy=dynpipe`` (also ``dynpipe_spawn``, ``dynpipe_fork``);
* a bare class path: ``--trainer.strategy=lightning_dynpipe.DynPipeStrategy``;
* a class path with init args, in YAML (``strategy: {class_path: lightning_dynpipe.DynPipeStrategy,
  init_args: {num_microbatches: 8}}``) or as flags
  (``--trainer.strategy=lightning_dynpipe.DynPipeStrategy --trainer.strategy.num_microbatches=8``).

When the configuration names no strategy, this entry point uses ``DynPipeStrategy()`` with its defaults
(Lightning's own default would be ``"auto"``), so ``--print_config`` lists DynPipe's arguments.

Your own ``LightningCLI`` script works the same way once it has done ``import lightning_dynpipe`` (which
registers the strategy names); see ``examples/cli_user_script.py``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.cli import ArgsType, LightningCLI

import lightning_dynpipe  # noqa: F401  (registers "dynpipe" and the class-path aliases before parsing)

__all__ = ["DEFAULT_STRATEGY", "main"]

#: The strategy this entry point uses when the configuration names none.
DEFAULT_STRATEGY: dict[str, Any] = {"class_path": "lightning_dynpipe.DynPipeStrategy"}


_DESCRIPTION = (
    "Lightning's CLI with DynPipeStrategy as the default strategy. Choose the model and the data module by "
    "class path (--model=lightning_dynpipe.demos.MLP, or model: {class_path: ..., init_args: ...} in a "
    "--config file). Example: python -m lightning_dynpipe fit --config examples/configs/mnist_mlp.yaml"
)


def main(args: ArgsType = None, *, run: bool = True) -> LightningCLI:
    """Parses the command line (or ``args``), builds the Trainer, model and data module, and runs a subcommand.

    Args:
        args: the arguments, as a list (``["fit", "--config", "cfg.yaml"]``) or a dict; ``None`` reads
            ``sys.argv[1:]``. With the default ``popen`` launcher the other ranks re-run the command line of
            this process, not ``args``, so pass arguments programmatically only for single-process runs or
            with ``start_method="spawn"``.
        run: run the subcommand (``fit``, ``validate``, ``test``, ``predict``); with ``run=False`` there is no
            subcommand and the CLI only instantiates the classes.

    Returns:
        The ``LightningCLI`` instance, whose ``trainer``, ``model`` and ``datamodule`` can be inspected.
    """
    return LightningCLI(
        model_class=None,  # any LightningModule, by class path
        datamodule_class=None,  # any LightningDataModule, by class path
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"strategy": DEFAULT_STRATEGY},
        parser_kwargs={"prog": "python -m lightning_dynpipe", "description": _DESCRIPTION},
        args=args,
        run=run,
    )
