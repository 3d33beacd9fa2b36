"""Each replica loads only its share of every global batch (replica_split): the share sampler, the rebuilt
dataloader, and the cover check that refuses shares that do not tile the global batch. Pure, one process
(the gradient all-reduce on loopback threads)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
    TensorDataset,
)

from lightning_dynpipe.engine.loopback import LoopbackGroup, run_stages
from lightning_dynpipe.engine.replica import average_replica_gradients
from lightning_dynpipe.engine.shares import (
    FixedShares,
    IssuedShare,
    ShareBatchSampler,
    check_cover,
    cover_row,
    index_fingerprint,
    share_reading_dataloader,
)
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.replicas import ReplicaSplit


class SplitSource:
    """Shares from a ReplicaSplit that can change between draws, as the strategy's."""

    def __init__(self, split: ReplicaSplit, reads: bool = True) -> None:
        self.split, self.reads = split, reads

    def reads_shares(self, sampler: ShareBatchSampler) -> bool:
        return self.reads

    def next_shares(self, batch_size: int) -> tuple[tuple[int, ...], Any]:
        return self.split.shares(batch_size, 2), self.split


def _global(n: int = 22, batch: int = 8) -> BatchSampler:
    return BatchSampler(SequentialSampler(range(n)), batch_size=batch, drop_last=False)


def test_the_replicas_shares_tile_every_global_batch_and_the_records_follow_the_draws() -> None:
    source = SplitSource(ReplicaSplit((3.0, 1.0, 2.0)))
    readers = [ShareBatchSampler(_global(), d, source) for d in range(3)]
    per_replica = [list(r) for r in readers]
    assert len(readers[0]) == 3 and all(len(b) == 3 for b in per_replica)
    for t, whole in enumerate(_global()):  # 8, 8 and a short last batch of 6
        assert [i for d in range(3) for i in per_replica[d][t]] == list(whole)
    records = [[r.pop() for _ in range(3)] for r in readers]
    for d in range(3):
        first = records[d][0]
        assert isinstance(first, IssuedShare) and first.shares == (4, 2, 2) and first.replica == d
        assert first.fingerprint == index_fingerprint(list(range(8)))
        assert [rec.fingerprint for rec in records[d][1:]] == [None, None]  # the first batch of a pass only
        assert records[d][2].shares == (2, 2, 2) and records[d][2].total == 6
        assert [rec.count for rec in records[d]] == [len(b) for b in per_replica[d]]
    assert records[2][0].start == 6 and records[1][1].start == 4
    with pytest.raises(RuntimeError, match="did not draw"):
        readers[0].pop()


def test_a_new_split_reaches_the_batches_drawn_after_it_and_a_new_pass_forgets_the_old_records() -> None:
    source = SplitSource(ReplicaSplit.even(2))
    reader = ShareBatchSampler(_global(24), 0, source)
    it = iter(reader)
    assert next(it) == [0, 1, 2, 3]
    source.split = ReplicaSplit((1.0, 3.0))
    assert next(it) == [8, 9]  # drawn after the change
    assert [reader.pop().shares, reader.pop().shares] == [(4, 4), (2, 6)]  # type: ignore[union-attr]
    assert next(it) == [16, 17]
    assert next(iter(reader)) == [0, 1]  # a new pass: the third batch's record was never trained
    assert reader.pop().start == 0 and reader.passes == 2  # type: ignore[union-attr]
    with pytest.raises(RuntimeError):
        reader.pop()


def test_a_pass_that_does_not_read_shares_yields_whole_batches_and_no_records() -> None:
    reader = ShareBatchSampler(_global(), 1, SplitSource(ReplicaSplit.even(2), reads=False))
    assert [len(b) for b in reader] == [8, 8, 6] and not reader.reading
    assert reader.pop() is None


def test_the_rebuilt_dataloader_loads_each_replicas_share_of_the_same_shuffled_global_batches() -> None:
    data = TensorDataset(torch.arange(44).float().view(22, 2), torch.arange(22))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)

    def original() -> DataLoader[Any]:
        return DataLoader(data, batch_size=6, sampler=sampler, collate_fn=None, pin_memory=False, drop_last=False)

    split = ReplicaSplit((2.0, 1.0))
    loaders = []
    for d in range(2):
        rebuilt, reader, why_not = share_reading_dataloader(original(), d, SplitSource(split))
        assert isinstance(rebuilt, DataLoader) and reader is not None and why_not == ""
        assert rebuilt.batch_sampler is reader and reader.sampler is sampler and len(rebuilt) == 4
        loaders.append(rebuilt)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)  # what Lightning calls: it reaches the wrapped sampler
        whole = [b[1] for b in original()]
        shares = [[b[1] for b in dl] for dl in loaders]
        for t, batch in enumerate(whole):
            assert torch.equal(torch.cat([shares[0][t], shares[1][t]]), batch)
            assert len(shares[0][t]) == split.shares(len(batch), 2)[0]


def test_the_records_stay_in_draw_order_with_dataloader_workers() -> None:
    data = TensorDataset(torch.arange(48))
    loader = DataLoader(data, batch_size=8, num_workers=2, prefetch_factor=2, multiprocessing_context="fork")
    source = SplitSource(ReplicaSplit((3.0, 1.0)))
    rebuilt, reader, _ = share_reading_dataloader(loader, 1, source)
    assert reader is not None and rebuilt.prefetch_factor == 2 and rebuilt.num_workers == 2  # type: ignore[attr-defined]
    seen = []
    for t, (batch,) in enumerate(rebuilt):  # type: ignore[attr-defined]
        if t == 0:  # 4 batches went to the workers at the start, the fifth when the first came back
            source.split = ReplicaSplit.even(2)  # the batch not given to a worker yet takes it
        record = reader.pop()
        assert record is not None and len(batch) == record.count
        assert batch.tolist() == list(range(8 * t + record.start, 8 * t + record.start + record.count))
        seen.append(record.shares)
    assert seen == [(6, 2)] * 5 + [(4, 4)]


class _Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        return iter(range(4))


class _MyLoader(DataLoader):  # type: ignore[type-arg]
    pass


@pytest.mark.parametrize(
    ("loader", "reason"),
    [
        (_MyLoader(TensorDataset(torch.zeros(4)), batch_size=2), "_MyLoader, not a torch DataLoader"),
        (DataLoader(_Stream(), batch_size=2), "IterableDataset"),
        (DataLoader(TensorDataset(torch.zeros(4)), batch_size=None), "no batch sampler"),
    ],
    ids=["subclass", "iterable", "no-batch-sampler"],
)
def test_what_cannot_be_rebuilt_exactly_is_kept_with_the_reason(loader: Any, reason: str) -> None:
    kept, reader, why_not = share_reading_dataloader(loader, 0, FixedShares((1, 1)))
    assert kept is loader and reader is None and reason in why_not


def test_the_cover_check_accepts_a_tiling_and_refuses_gaps_overlaps_and_other_batches() -> None:
    like = torch.zeros(1)

    def summed(*slices: tuple[int, int, int]) -> torch.Tensor:
        return sum(cover_row(d, len(slices), *s, like=like) for d, s in enumerate(slices))  # type: ignore[return-value]

    check_cover(summed((0, 700, 1024), (700, 324, 1024)), 2)
    check_cover(summed((0, 2, 6), (2, 2, 6), (4, 2, 6)), 3)
    bad = {
        "overlap": summed((0, 700, 1024), (512, 512, 1024)),
        "gap": summed((0, 512, 1024), (700, 324, 1024)),
        "other batch sizes": summed((0, 4, 8), (4, 4, 9)),
        "an empty share": summed((0, 0, 8), (0, 8, 8)),
    }
    for name, values in bad.items():
        with pytest.raises(ConfigurationError, match=r"must tile each global batch.*replica 1: samples"):
            check_cover(values, 2)
        assert name


def _two_replicas(cover: list[tuple[int, int, int, int]], dtype: torch.dtype, samples: list[int]) -> list[nn.Linear]:
    group = LoopbackGroup([0, 1])
    layers = [nn.Linear(2, 2).to(dtype) for _ in range(2)]
    for r, layer in enumerate(layers):
        layer.weight.grad = torch.full((2, 2), float(r + 1), dtype=dtype)
        layer.bias.grad = torch.full((2,), float(3 * r), dtype=dtype)
    run_stages(
        lambda r: average_replica_gradients(
            list(layers[r].parameters()), group.member(r), 2, samples=samples[r], cover=cover[r]
        ),
        2,
    )
    return layers


def test_the_gradient_all_reduce_carries_the_cover_and_every_replica_refuses_a_bad_one() -> None:
    layers = _two_replicas([(0, 0, 701, 1024), (1, 701, 323, 1024)], torch.float32, [701, 323])
    for layer in layers:
        assert torch.allclose(layer.weight.grad, torch.full((2, 2), (701 + 2 * 323) / 1024))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="replica 0: samples 0:701 of 1024, replica 1: samples 512:1024"):
        _two_replicas([(0, 0, 701, 1024), (1, 512, 512, 1024)], torch.float32, [701, 512])


def test_half_precision_gradients_are_weighted_with_exact_sample_counts() -> None:
    # 701 and 323 are not bfloat16 numbers: weighting in bfloat16 divides by a rounded total
    layers = _two_replicas([(0, 0, 701, 1024), (1, 701, 323, 1024)], torch.bfloat16, [701, 323])
    want = torch.tensor((701 * 1.0 + 323 * 2.0) / 1024).to(torch.bfloat16)
    bias = torch.tensor(323 * 3.0 / 1024).to(torch.bfloat16)
    for layer in layers:
        assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.bfloat16
        assert torch.equal(layer.weight.grad, want.expand(2, 2)) and torch.equal(layer.bias.grad, bias.expand(2))  # type: ignore[arg-type]
