"""Reading only this replica's share of each global batch (``replica_split``), and checking that the shares tile it.

With an uneven replica split every replica trains on a contiguous slice of the same global batch. Reading the
whole global batch and keeping the slice costs each replica the loading and collation of every other replica's
samples too (with ``D`` replicas, ``D`` times the data work of the run; on a slowed replica, that is work the split
cannot move). :class:`ShareBatchSampler` wraps the dataloader's batch sampler instead: it draws each global batch
of indices exactly as before (the same sampler, the same seed on every replica), keeps this replica's slice of
the indices, and records which slice it took, so the dataset loads only that. Each replica's record says which
samples of which global batch it trained on; :func:`cover_row` and :func:`check_cover` let the gradient
all-reduce carry those records and refuse a step whose shares overlap or leave samples out.

Pure torch and Python, no process groups: the strategy supplies the split (:class:`ShareSource`).

Example::

    >>> from torch.utils.data import BatchSampler, SequentialSampler
    >>> inner = BatchSampler(SequentialSampler(range(10)), batch_size=5, drop_last=False)
    >>> reader = ShareBatchSampler(inner, replica=1, source=FixedShares((3, 2)))
    >>> [list(b) for b in reader]
    [[3, 4], [8, 9]]
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, Sampler

from lightning_dynpipe.errors import ConfigurationError

__all__ = [
    "FixedShares",
    "IssuedShare",
    "ShareBatchSampler",
    "ShareSource",
    "check_cover",
    "cover_row",
    "index_fingerprint",
    "share_reading_dataloader",
]


@dataclass(frozen=True)
class IssuedShare:
    """One global batch as a replica read it.

    Attributes:
        shares: every replica's number of samples of the global batch (they add up to its size).
        replica: this replica's index: it read the samples ``start : start + count`` of the global batch.
        split: what the shares were computed from (a :class:`~lightning_dynpipe.plan.replicas.ReplicaSplit`).
        fingerprint: of the global batch's indices (:func:`index_fingerprint`), on the first batch of each pass
            over the sampler only (``None`` on the others): replicas compare it to prove they draw the same
            global batches.
    """

    shares: tuple[int, ...]
    replica: int
    split: Any = None
    fingerprint: float | None = None

    @property
    def start(self) -> int:
        """Where this replica's share starts in the global batch."""
        return sum(self.shares[: self.replica])

    @property
    def count(self) -> int:
        """This replica's samples of the global batch."""
        return self.shares[self.replica]

    @property
    def total(self) -> int:
        """The global batch's size."""
        return sum(self.shares)


class ShareSource(Protocol):
    """What a :class:`ShareBatchSampler` asks: whether to read shares this pass, and the shares of a batch."""

    def reads_shares(self, sampler: ShareBatchSampler) -> bool:
        """At the start of each pass over the sampler: ``False`` yields whole global batches (and records none)."""
        ...

    def next_shares(self, batch_size: int) -> tuple[tuple[int, ...], Any]:
        """Every replica's samples of the next global batch of ``batch_size`` and the split they come from."""
        ...


class FixedShares:
    """A :class:`ShareSource` with the same shares for every batch (tests, examples)."""

    def __init__(self, shares: Sequence[int]) -> None:
        self.shares = tuple(int(s) for s in shares)

    def reads_shares(self, sampler: ShareBatchSampler) -> bool:
        return True

    def next_shares(self, batch_size: int) -> tuple[tuple[int, ...], Any]:
        if sum(self.shares) != batch_size:
            raise ConfigurationError(f"FixedShares {self.shares} do not add up to the batch of {batch_size}.")
        return self.shares, None


def index_fingerprint(indices: Sequence[Any]) -> float:
    """A number that differs, almost surely, between two lists of dataset indices (content or order).

    CRC-32 of their ``repr``: the same on every process (unlike ``hash`` of a string), exact as a float.
    """
    return float(zlib.crc32(repr(list(indices)).encode()))


class ShareBatchSampler(Sampler[list[Any]]):
    """Yields this replica's slice of each global batch of indices that ``batch_sampler`` yields.

    Every replica wraps the same global batch sampler (same sampler, same seed, so the same global batches in
    the same order) and asks ``source`` for the shares of each global batch when it draws it: replica ``d``
    keeps the indices ``start : start + count``. The record of every batch drawn (:class:`IssuedShare`) waits in
    order until the training step that trains that batch takes it (:meth:`pop`): batches are trained in the
    order they are drawn, however far ahead the dataloader draws (workers, Lightning's prefetch).

    ``sampler`` is the wrapped batch sampler's sampler, so Lightning's ``set_epoch`` reaches it; the length is
    the wrapped batch sampler's.
    """

    def __init__(self, batch_sampler: Iterable[Sequence[Any]], replica: int, source: ShareSource) -> None:
        self.batch_sampler = batch_sampler
        self.replica = replica
        self.source = source
        self.sampler = getattr(batch_sampler, "sampler", None)
        self._issued: deque[IssuedShare] = deque()
        self._reading = False
        self.passes = 0

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]

    @property
    def reading(self) -> bool:
        """Whether the current pass yields shares (``False``: whole global batches, before the first pass too)."""
        return self._reading

    def __iter__(self) -> Iterator[list[Any]]:
        # a new pass: the records of a pass left unfinished (a fit stopped mid-epoch) belong to no batch any more
        self._issued.clear()
        self._reading = self.source.reads_shares(self)
        self.passes += 1
        for position, indices in enumerate(self.batch_sampler):
            indices = list(indices)
            if not self._reading:
                yield indices
                continue
            shares, split = self.source.next_shares(len(indices))
            record = IssuedShare(
                tuple(shares), self.replica, split, index_fingerprint(indices) if position == 0 else None
            )
            self._issued.append(record)
            yield indices[record.start : record.start + record.count]

    def pop(self) -> IssuedShare | None:
        """The record of the oldest batch drawn and not yet trained; ``None`` if this pass yields whole batches.

        Raises:
            RuntimeError: the pass reads shares but no batch is waiting (a batch reached the training step
                without being drawn by this sampler).
        """
        if not self._reading:
            return None
        if not self._issued:
            raise RuntimeError(
                "A training step received a batch that the replica-share sampler did not draw. With replica_split "
                "every training batch must come from the training dataloader the strategy prepared; do not fetch "
                "batches from it outside the training loop."
            )
        return self._issued.popleft()


_KEEP = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
         "generator", "persistent_workers", "pin_memory_device", "in_order")  # fmt: skip


def share_reading_dataloader(
    dataloader: object, replica: int, source: ShareSource
) -> tuple[object, ShareBatchSampler | None, str]:
    """``dataloader`` rebuilt to read only this replica's shares, its sampler, and ``""``; or, where that cannot
    be done exactly, ``dataloader`` itself, ``None`` and the reason (it then reads whole global batches).

    Only a plain :class:`~torch.utils.data.DataLoader` over a map-style dataset with a batch sampler is rebuilt:
    a subclass may hold state its constructor set up that a copy would lose, an iterable dataset ignores the
    indices, and a loader without a batch sampler yields batches the dataset made itself.
    """
    if type(dataloader) is not DataLoader:
        return dataloader, None, f"it is a {type(dataloader).__name__}, not a torch DataLoader (subclasses are kept)"
    if isinstance(dataloader.dataset, IterableDataset):
        return dataloader, None, "its dataset is an IterableDataset (it does not load by index)"
    if dataloader.batch_sampler is None:
        return dataloader, None, "it has no batch sampler (batch_size=None: the dataset yields whole batches)"
    sampler = ShareBatchSampler(dataloader.batch_sampler, replica, source)
    kwargs: dict[str, Any] = {k: getattr(dataloader, k) for k in _KEEP if hasattr(dataloader, k)}
    if dataloader.num_workers > 0:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
    return DataLoader(dataloader.dataset, batch_sampler=sampler, **kwargs), sampler, ""


def cover_row(replica: int, num_replicas: int, start: int, count: int, total: int, like: Tensor) -> Tensor:
    """This replica's slot of the cover check: ``(start, count, total)`` at ``3 * replica``, zeros elsewhere.

    Summed over the replicas (in the gradient all-reduce, :func:`check_cover` reads it) every replica sees every
    replica's slice. ``like`` gives the dtype and device; a float32 or wider dtype keeps the integers exact.
    """
    row = torch.zeros(3 * num_replicas, dtype=like.dtype, device=like.device)
    row[3 * replica : 3 * replica + 3] = torch.tensor([start, count, total], dtype=like.dtype)
    return row


def check_cover(summed: Tensor, num_replicas: int) -> None:
    """Raises unless the replicas' slices, in replica order, tile one global batch exactly once.

    ``summed``: the sum over the replicas of their :func:`cover_row`. A gap or an overlap means a sample was
    left out or trained twice in this update: never silently.
    """
    values = [int(round(v)) for v in summed.double().tolist()]
    slices = [tuple(values[3 * d : 3 * d + 3]) for d in range(num_replicas)]
    at, totals = 0, {t for _, _, t in slices}
    ok = len(totals) == 1
    for start, count, _ in slices:
        ok = ok and start == at and count >= 1
        at = start + count
    if not (ok and at == totals.pop()):
        described = ", ".join(f"replica {d}: samples {s}:{s + c} of {t}" for d, (s, c, t) in enumerate(slices))
        raise ConfigurationError(
            "With replica_split the replicas' shares must tile each global batch (every sample trained once); "
            f"this update's shares do not: {described}. Every replica must draw the same global batches at the "
            "same points: give every process the same seed, the same dataloader (the same num_workers and "
            "prefetch_factor) and call set_replica_split() with the same weights at the same step on every rank."
        )
