"""Byte-level language-modelling data from the Python standard library's own source files (no network).

:class:`StdlibTextDataModule` concatenates ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (installed
packages excluded) into one byte string, holds out its last part for validation, and serves random windows of
``block_size + 1`` bytes as ``(x, y) = (window[:-1], window[1:])`` pairs of int64 token ids in ``0 .. 255``.
Everything is drawn from seeded generators, so every process of a pipeline (the popen launcher re-runs the
script) builds the same windows in the same order.
"""

from __future__ import annotations

import logging
import os
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_dynpipe.errors import ConfigurationError

__all__ = ["StdlibTextDataModule", "TextWindows", "read_stdlib_sources", "stdlib_source_files"]

log = logging.getLogger(__name__)

_Batch = tuple[Tensor, Tensor]
#: Directories under the standard library that hold installed third-party packages, not the library itself.
_NOT_STDLIB = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_source_files(root: str | Path | None = None) -> list[Path]:
    """The ``.py`` files below ``root`` (default: the standard library), sorted by their path below it.

    ``site-packages``, ``dist-packages`` and ``__pycache__`` directories are skipped: they hold installed
    packages and bytecode, not the library.
    """
    base = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _NOT_STDLIB]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def read_stdlib_sources(max_bytes: int, root: str | Path | None = None, shuffle_seed: int | None = None) -> bytes:
    """The first ``max_bytes`` bytes of the standard library's ``.py`` files, concatenated.

    The files are sorted by their path below ``root``; with ``shuffle_seed`` that sorted list is then permuted
    by ``torch.randperm`` with a generator seeded with it, so the result is the same on every call and in every
    process on one machine either way.

    Args:
        max_bytes: how many bytes to return at most (fewer when the library is smaller).
        root: the directory to read; default ``sysconfig.get_paths()["stdlib"]``. ``site-packages``,
            ``dist-packages`` and ``__pycache__`` below it are skipped.
        shuffle_seed: ``None`` keeps the path order; a seed reads the files in a seeded random order.

    Returns:
        The bytes, read in binary (no decoding).
    """
    files = stdlib_source_files(root)
    if shuffle_seed is not None:
        order = torch.randperm(len(files), generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
        files = [files[i] for i in order]
    chunks: list[bytes] = []
    size = 0
    for path in files:
        if size >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - size]
        chunks.append(data)
        size += len(data)
    return b"".join(chunks)


class TextWindows(Dataset[_Batch]):
    """Windows of a token sequence at fixed offsets: item ``i`` is ``(tokens[o:o+T], tokens[o+1:o+T+1])``.

    Items are int64 whatever the dtype of ``tokens`` (bytes are best kept as ``uint8``: 8 times less memory).

    Example::

        tokens = torch.arange(100)
        ds = TextWindows(tokens, torch.tensor([0, 10]), block_size=4)
        x, y = ds[1]          # x = 10..13, y = 11..14

    Args:
        tokens: the 1-D sequence of token ids (any integer dtype).
        offsets: the start of every window; each must satisfy ``0 <= o <= len(tokens) - block_size - 1``.
        block_size: tokens per input ``x`` (and per target ``y``).
    """

    def __init__(self, tokens: Tensor, offsets: Tensor, block_size: int) -> None:
        self.tokens = tokens
        self.offsets = offsets
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> _Batch:
        o = int(self.offsets[index])
        window = self.tokens[o : o + self.block_size + 1].long()
        return window[:-1], window[1:]


class StdlibTextDataModule(pl.LightningDataModule):
    """The Python standard library's source as bytes: random training windows, a fixed validation set.

    The first ``max_bytes`` bytes of the library's ``.py`` files (see :func:`read_stdlib_sources`) are the
    corpus; its last ``val_fraction`` is the validation split. The files are sorted by path and, by default
    (``shuffle_files=True``), then put in a seeded random order, so that both splits are a sample of the whole
    library. In path order the first 4 MB end, on CPython 3.11, with the generated code-page tables of
    ``encodings/cp*.py``, which would then be nearly all of the validation split.

    Training draws ``train_windows`` random window offsets from ``torch.Generator().manual_seed(seed)``,
    validation ``val_windows`` offsets from a generator seeded with ``seed + 1``. The training loader does not
    shuffle (the windows are random already) and drops its last, smaller batch, so every batch splits into
    equal micro-batches. A plain single-device Trainer and a ``DynPipeStrategy(...)`` run with
    ``Trainer(use_distributed_sampler=False)`` therefore see exactly the same batches in the same order (with
    Lightning's default ``DistributedSampler`` every stage still sees the same batches, in a shuffled order).

    Example::

        import lightning.pytorch as pl
        from lightning_dynpipe.demos import CharGPT, StdlibTextDataModule

        data = StdlibTextDataModule(block_size=64, batch_size=32)
        data.setup()
        x, y = next(iter(data.train_dataloader()))   # (32, 64) int64 each; y is x shifted by one byte
        pl.Trainer(accelerator="cpu", devices=1, max_steps=50).fit(CharGPT(block_size=64), datamodule=data)

    Args:
        block_size: tokens per sample; the model's ``block_size`` must be at least this.
        batch_size: windows per batch in both loaders.
        max_bytes: the corpus size in bytes (4 MB by default; the library on this machine holds more).
        val_fraction: share of the corpus, at its end, held out for validation, in ``(0, 1)``.
        train_windows: training windows per epoch; default: one window per ``block_size`` bytes of the
            training split.
        val_windows: validation windows (a fixed set, the same every epoch).
        seed: seed of the file order and of the window offsets.
        shuffle_files: read the files in a seeded random order (``True``) or in path order (``False``).
        root: the directory to read instead of the standard library (tests).
    """

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 32,
        max_bytes: int = 4_000_000,
        val_fraction: float = 0.1,
        train_windows: int | None = None,
        val_windows: int = 256,
        seed: int = 0,
        shuffle_files: bool = True,
        root: str | None = None,
    ) -> None:
        super().__init__()
        sizes = {"block_size": block_size, "batch_size": batch_size, "max_bytes": max_bytes, "val_windows": val_windows}
        if train_windows is not None:
            sizes["train_windows"] = train_windows
        bad = {k: v for k, v in sizes.items() if v < 1}
        if bad:
            raise ConfigurationError(f"These sizes must be positive integers: {bad}.")
        if not 0.0 < val_fraction < 1.0:
            raise ConfigurationError(
                f"val_fraction must lie strictly between 0 and 1 (both splits need text); got "
                f"val_fraction={val_fraction}. Try 0.1."
            )
        self.save_hyperparameters()
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.train_windows = train_windows
        self.val_windows = val_windows
        self.seed = seed
        self.shuffle_files = shuffle_files
        self.root = root
        self._train: TextWindows | None = None
        self._val: TextWindows | None = None

    @override
    def setup(self, stage: str | None = None) -> None:
        if self._train is not None:
            return
        corpus = read_stdlib_sources(self.max_bytes, self.root, self.seed if self.shuffle_files else None)
        tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        n_val = int(len(tokens) * self.val_fraction)
        train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
        shortest = min(len(train), len(val))
        if shortest < self.block_size + 1:
            raise ConfigurationError(
                f"Each split needs at least block_size + 1 = {self.block_size + 1} bytes; the corpus of "
                f"{len(tokens)} bytes (max_bytes={self.max_bytes}, val_fraction={self.val_fraction}) gives "
                f"{len(train)} training and {len(val)} validation bytes. Raise max_bytes or lower block_size."
            )
        n_train = self.train_windows if self.train_windows is not None else len(train) // self.block_size
        if n_train < self.batch_size:
            raise ConfigurationError(
                f"The training loader drops its last, smaller batch, so it needs at least batch_size="
                f"{self.batch_size} windows; got {n_train} training windows. Raise train_windows or max_bytes, "
                "or lower batch_size."
            )
        self._train = TextWindows(train, self._offsets(len(train), n_train, self.seed), self.block_size)
        self._val = TextWindows(val, self._offsets(len(val), self.val_windows, self.seed + 1), self.block_size)
        log.debug(
            "%s: %d bytes, %d/%d train/val bytes, %d/%d windows of %d (seed=%d)",
            type(self).__name__,
            len(tokens),
            len(train),
            len(val),
            n_train,
            self.val_windows,
            self.block_size,
            self.seed,
        )

    def _offsets(self, length: int, count: int, seed: int) -> Tensor:
        high = length - self.block_size  # the last valid start is length - block_size - 1
        return torch.randint(0, high, (count,), generator=torch.Generator().manual_seed(seed))

    def _dataset(self, name: str) -> TextWindows:
        ds = self._train if name == "train" else self._val
        if ds is None:
            raise RuntimeError(
                f"{type(self).__name__} has no {name} split yet: call setup() first, or pass the data module "
                "to the Trainer, which calls it."
            )
        return ds

    @property
    def train_set(self) -> TextWindows:
        """The training windows (after :meth:`setup`)."""
        return self._dataset("train")

    @property
    def val_set(self) -> TextWindows:
        """The validation windows (after :meth:`setup`)."""
        return self._dataset("val")

    @override
    def train_dataloader(self) -> DataLoader[_Batch]:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=False, drop_last=True)

    @override
    def val_dataloader(self) -> DataLoader[_Batch]:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False)
