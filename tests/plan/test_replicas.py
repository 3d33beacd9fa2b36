"""The split of a global batch across pipeline replicas (pure arithmetic), and the sample order it keeps: with
every replica reading the same global batches, the shares of an epoch cover every sample exactly once however
the split changes, and the global batches are those of the evenly split distributed-sampler run."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.replicas import ReplicaSplit, speed_weights, split_shares


@pytest.mark.parametrize(
    ("n", "weights", "min_share", "expected"),
    [
        (32, (3, 1), 4, (24, 8)),
        (32, (1, 1), 4, (16, 16)),
        (7, (1, 1), 2, (4, 3)),  # the remainder goes to the lower index
        (10, (1, 1, 1), 1, (4, 3, 3)),
        (16, (100, 1), 4, (12, 4)),  # the slow replica keeps one sample per micro-batch
        (8, (2, 1), 4, (4, 4)),  # only the minimum fits
        (12, (1, 2), 2, (4, 8)),
    ],
)
def test_split_shares(n: int, weights: tuple[float, ...], min_share: int, expected: tuple[int, ...]) -> None:
    assert split_shares(n, weights, min_share) == expected


def test_split_shares_invariants_on_random_cases() -> None:
    rng = random.Random(0)
    for _ in range(500):
        D = rng.randint(1, 5)
        m = rng.randint(1, 4)
        n = rng.randint(D * m, 200)
        w = [rng.uniform(0.05, 10.0) for _ in range(D)]
        shares = split_shares(n, w, m)
        assert sum(shares) == n and min(shares) >= m
        # the replicas above the minimum share what the others leave in proportion, to within one sample
        free = [d for d in range(D) if shares[d] > m]
        rest = n - sum(shares[d] for d in range(D) if d not in free)
        for d in free:
            assert abs(shares[d] - rest * w[d] / sum(w[i] for i in free)) < 1, (n, w, m, shares)
        # and a faster replica never gets more than one sample less than a slower one
        assert all(shares[a] >= shares[b] - 1 for a in range(D) for b in range(D) if w[a] >= w[b]), (n, w, shares)


def test_split_shares_refuses_with_rule_values_and_fix() -> None:
    with pytest.raises(ConfigurationError, match=r"12 samples .* 2 replicas .* at least 8 samples each .* needs 16"):
        split_shares(12, (1, 1), 8)
    with pytest.raises(ConfigurationError, match="positive finite"):
        split_shares(12, (1, 0), 1)
    with pytest.raises(ConfigurationError, match="positive finite"):
        ReplicaSplit((1.0, float("nan")))


def test_replica_split_normalises_and_offsets() -> None:
    split = ReplicaSplit((3.0, 1.0))
    assert split.weights == (0.75, 0.25) and not split.is_even
    assert split.offsets(32, 4) == (0, 24)
    assert ReplicaSplit.even(3).is_even
    assert split.differs(ReplicaSplit((0.7, 0.3)), 0.02) and not split.differs(ReplicaSplit((0.76, 0.24)), 0.02)
    assert str(split) == "0.750:0.250"


def test_speed_weights_are_samples_per_second() -> None:
    # replica 0 did 16 samples in 10 ms, replica 1 16 in 20 ms: speeds 1600 and 800 samples/s
    assert speed_weights((16, 16), (0.010, 0.020)) == pytest.approx((2 / 3, 1 / 3))
    with pytest.raises(ConfigurationError, match=r"Replicas \[1\] have no usable measurement"):
        speed_weights((16, 16), (0.010, 0.0))


def _global_batches(n: int, batch: int, epoch: int, drop_last: bool) -> list[list[int]]:
    """What every replica reads under replica_split: Lightning's sampler with num_replicas=1, the same seed."""
    sampler = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=7)  # type: ignore[arg-type]
    sampler.set_epoch(epoch)
    return [list(b) for b in BatchSampler(sampler, batch, drop_last)]


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_once_per_epoch_when_the_split_changes_mid_epoch(drop_last: bool) -> None:
    n, D, B, M = 203, 2, 32, 4  # 203 = 6 full global batches and a short one of 11
    splits = [ReplicaSplit.even(D), ReplicaSplit((3.0, 1.0)), ReplicaSplit((1.0, 2.0))]
    for epoch in range(2):
        seen: list[int] = []
        for t, batch in enumerate(_global_batches(n, B, epoch, drop_last)):
            split = splits[min(t // 2, 2)]  # changes at steps 2 and 4
            offsets, shares = split.offsets(len(batch), M), split.shares(len(batch), M)
            for d in range(D):
                seen += batch[offsets[d] : offsets[d] + shares[d]]
        expected = n - (n % B if drop_last else 0)
        assert len(seen) == expected and len(set(seen)) == expected  # each sample once, none lost


def test_global_batches_are_those_of_the_even_distributed_sampler_run() -> None:
    """The evenly split run (DistributedSampler over D replicas, per-replica batch b) and the replica_split run
    (every replica reads global batches of D*b) train on the same sets of samples, step by step."""
    n, D, b = 96, 2, 8
    per_replica = []
    for r in range(D):
        s = DistributedSampler(range(n), num_replicas=D, rank=r, shuffle=True, seed=7)  # type: ignore[arg-type]
        s.set_epoch(3)
        per_replica.append([list(x) for x in BatchSampler(s, b, False)])
    even_run = [sorted(sum((per_replica[r][t] for r in range(D)), [])) for t in range(len(per_replica[0]))]
    assert even_run == [sorted(x) for x in _global_batches(n, D * b, 3, False)]
    assert torch.tensor(even_run).unique().numel() == n
