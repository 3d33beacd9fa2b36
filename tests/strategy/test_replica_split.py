"""Uneven replica splits through Lightning (replica_split): every replica draws the same global batches (the
strategy's sampler kwargs, with Lightning's sampler injection on) and trains on its share of each.

One run per layout, each combining its checks (every run costs 10-20 s of spawn):

* devices=2, num_stages=1, sync, gradient clipping, replica_split="speed" (an eager escalation ladder), a
  DataLoader subclass (so every replica loads the whole global batch and keeps its share): set to 3:1 by hand
  before step 1, then re-split by the ladder from the measured speeds (whatever they are), equals plain
  single-process training on the global batches with the same clipping (1e-6);
* devices=4, num_stages=2 (dp=2 x S=2), async, layers and replicas together, a plain DataLoader (each replica
  loads only its share): 3:1, layers 2-3 moved to stage 0 before step 2 (a drain), re-split to 1:3 in step 3's
  first hook, which the next batch drawn takes (step 4's), without a drain, equals
  the PipeDream replay whose micro-batch i is the union of the replicas' micro-batches i, with the same
  repartition (1e-6); both replicas of a stage hold the same weights after the move.

A wrong weighting, a lost or repeated sample, or a share taken from the wrong place moves the weights by far more
than the tolerance (tests/engine/test_replica_split.py shows the unweighted average failing).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from pipeline_models import LR, MOMENTUM, TinyNet, dataset, make_optimizer, trainer_kwargs
from torch.utils.data import DataLoader, DistributedSampler

from lightning_dynpipe import DynPipeStrategy
from lightning_dynpipe.calibration import replay_async
from lightning_dynpipe.engine.microbatch import split_microbatches, take_share
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.replicas import ReplicaSplit
from lightning_dynpipe.repartition.ladder import EscalationLadder

M, GLOBAL, N = 4, 24, 144  # micro-batches, global batch, samples: 6 steps
N_SPEED = 336  # 14 steps: the ladder needs a window of MIN_SAMPLES steps after the re-split by hand
CLIP = 0.5


# steps between set_replica_split() in on_train_batch_start and the first step trained on the new split: 0 where
# the whole global batch is loaded, 1 where only the share is (batch i was drawn before step i's hooks)
LAG = {False: 0, True: 1}


class WholeBatches(DataLoader):  # type: ignore[type-arg]
    """A DataLoader subclass: the strategy does not rebuild it, so every replica loads whole global batches."""


class Resplit(L.Callback):
    """Changes the split before the given batches; checks every rank's split, shares and batch."""

    def __init__(
        self,
        plan: dict[int, tuple[float, ...]],
        first: tuple[float, ...],
        ladder: bool = False,
        moves: dict[int, list[int]] | None = None,
        shares_only: bool = True,
    ) -> None:
        self.plan, self.first, self.ladder, self.moves = plan, first, ladder, moves or {}
        self.shares_only, self.lag = shares_only, LAG[shares_only]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        s = trainer.strategy
        assert isinstance(s, DynPipeStrategy)
        assert s.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
        if not self.shares_only:
            assert batch[0].shape[0] == GLOBAL  # every replica loads the whole global batch
        else:  # only its share of the split this step trains on
            assert batch[0].shape[0] == self._expected(i).shares(GLOBAL, M)[s.dp_rank]
        if i in self.plan:
            s.set_replica_split(list(self.plan[i]))
        if i in self.moves:
            s.repartition(self.moves[i])

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, b: Any, i: int) -> None:
        s = trainer.strategy
        assert isinstance(s, DynPipeStrategy) and s.replica_split is not None
        if self.ladder:  # the ladder's splits come from measurements: check the shares follow the split in use
            assert s.replica_shares == s.replica_split.shares(GLOBAL, M)
            return
        expected = self._expected(i)
        assert s.replica_split == expected, (i, s.replica_split, expected)
        assert s.replica_shares == expected.shares(GLOBAL, M)
        if i in self.moves:  # both replicas of this stage moved the same layers and hold the same weights
            assert s.partition is not None and list(s.partition.balance) == self.moves[i]
            flat = torch.cat([p.detach().reshape(-1) for p in s.stage.shard.stage_module().parameters()])  # type: ignore[union-attr]
            both = s.all_gather(flat)
            assert torch.equal(both[0], both[1])

    def _expected(self, i: int) -> ReplicaSplit:
        started = [k for k in self.plan if k + self.lag <= i]
        return ReplicaSplit(self.plan[max(started)] if started else self.first)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = trainer.strategy
        assert isinstance(s, DynPipeStrategy)
        steps = [step for step, _, _ in s.resplits]
        if not self.ladder:
            assert steps == [k + self.lag for k in sorted(self.plan)]
            return
        assert steps[: len(self.plan)] == [k + self.lag for k in sorted(self.plan)]
        rungs = [d.rung for d in s.adaptation.ladder_decisions]
        # every re-split the ladder decided was applied at the next step, except one decided by the check that
        # completes at the end of fit, after the last step
        applied = len(steps) - len(self.plan)
        assert "resplit" in rungs and applied in (rungs.count("resplit"), rungs.count("resplit") - 1), (steps, rungs)


def _splits(plan: dict[int, tuple[float, ...]], first: tuple[float, ...], steps: int) -> list[ReplicaSplit]:
    out, now = [], ReplicaSplit(first)
    for t in range(steps):
        if t in plan:
            now = ReplicaSplit(plan[t])
        out.append(now)
    return out


def _global_batches(n: int = N) -> list[Any]:
    """What every replica reads: Lightning shuffles training data through the injected sampler, with the
    strategy's num_replicas=1 and the same seed (PL_GLOBAL_SEED) on every rank."""
    data = dataset(n)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=int(os.getenv("PL_GLOBAL_SEED", 0)))
    order = list(sampler)
    idx = [order[t : t + GLOBAL] for t in range(0, n, GLOBAL)]
    return [tuple(torch.stack([data[i][j] for i in rows]) for j in range(2)) for rows in idx]


def _fit(
    model: TinyNet, devices: int, num_stages: int, schedule: str, callback: Resplit, n: int = N, **kw: Any
) -> None:
    # an eager ladder: any measured difference in speed re-splits, at every check
    eager = EscalationLadder(min_gain=0.0, patience=1, min_change=0.0)
    strategy = DynPipeStrategy(
        num_stages=num_stages,
        balance=[5] if num_stages == 1 else [2, 3],
        num_microbatches=M,
        schedule=schedule,  # type: ignore[arg-type]
        replica_split=eager if callback.ladder else list(callback.first),
        monitor_every_n_steps=2,
        adaptive=False,
        start_method="fork",
    )
    trainer = L.Trainer(
        devices=devices,
        max_epochs=1,
        strategy=strategy,
        **trainer_kwargs(callbacks=[callback], use_distributed_sampler=True, **kw),
    )
    loader = DataLoader if callback.shares_only else WholeBatches
    trainer.fit(model, loader(dataset(n), batch_size=GLOBAL, shuffle=False))


@pytest.mark.multiprocess
def test_sync_speed_splits_equal_plain_training_with_clipping() -> None:
    model = TinyNet()
    ref = copy.deepcopy(model)
    callback = Resplit({1: (3.0, 1.0)}, (1.0, 1.0), ladder=True, shares_only=False)
    _fit(model, 2, 1, "sync", callback, n=N_SPEED, gradient_clip_val=CLIP)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    for x, y in _global_batches(N_SPEED):
        opt.zero_grad()
        F.cross_entropy(ref.pipeline(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
    for k, v in ref.state_dict().items():
        assert torch.allclose(model.state_dict()[k], v, atol=1e-6, rtol=0), k


@pytest.mark.multiprocess
def test_async_dp2_x_s2_uneven_split_changed_mid_run_equals_the_replay() -> None:
    model = TinyNet()
    ref = copy.deepcopy(model)
    plan, first, moves = {3: (1.0, 3.0)}, (3.0, 1.0), {2: [4, 1]}
    _fit(model, 4, 2, "async", Resplit(plan, first, moves=moves))
    trained = {k + LAG[True]: v for k, v in plan.items()}
    batches, splits = _global_batches(), _splits(trained, first, N // GLOBAL)
    by_step = {id(b): s for b, s in zip(batches, splits)}

    def union(batch: Any) -> list[Any]:
        split = by_step[id(batch)]
        shares = [take_share(batch, o, s) for o, s in zip(split.offsets(GLOBAL, M), split.shares(GLOBAL, M))]
        per_replica = [split_microbatches(s, M)[0] for s in shares]
        return [tuple(torch.cat([mbs[i][j] for mbs in per_replica]) for j in range(2)) for i in range(M)]

    replay_async(
        ref.pipeline,
        [2, 3],
        make_optimizer,
        batches,
        M,
        lambda out, mb: F.cross_entropy(out, mb[1]),
        lr_scale=1 / M,
        split=union,
        repartitions={k - 1: v for k, v in moves.items()},
    )
    for k, v in ref.state_dict().items():
        assert torch.allclose(model.state_dict()[k], v, atol=1e-6, rtol=0), k


def test_replica_split_refusals_state_the_rule() -> None:
    with pytest.raises(ConfigurationError, match=r"replica_split must be None, one of \['even', 'speed'\]"):
        DynPipeStrategy(replica_split="fast")
    with pytest.raises(ConfigurationError, match="positive finite numbers, one per pipeline replica"):
        DynPipeStrategy(replica_split=[1.0, -1.0])
    with pytest.raises(ConfigurationError, match="which the stage monitor measures"):
        DynPipeStrategy(replica_split="speed", monitor_every_n_steps=None, adaptive=False)


def test_batchnorm_and_a_wrong_number_of_weights_are_refused_at_set_up() -> None:
    from torch import nn

    from lightning_dynpipe.strategy.contract import check_replica_split

    net = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.BatchNorm1d(4)), nn.Linear(4, 2))
    with pytest.raises(ConfigurationError, match=r"BatchNorm layers \(\['1.0'\]\).*LayerNorm, GroupNorm"):
        check_replica_split(net, "speed", None, 2, "pipeline")
    check_replica_split(net, "speed", None, 1, "pipeline")  # one replica: nothing is split
    with pytest.raises(ConfigurationError, match=r"gives 3 weights .* 2 pipeline replica"):
        check_replica_split(nn.Sequential(nn.Linear(4, 2)), "fixed", (1.0, 1.0, 1.0), 2, "pipeline")


def test_global_batches_too_small_for_every_replica_are_refused_before_the_first_step() -> None:
    from lightning_dynpipe.strategy.contract import check_batches

    def loader(n: int, b: int, drop_last: bool = False) -> DataLoader:
        return DataLoader(dataset(n), batch_size=b, drop_last=drop_last)

    kw: dict[str, Any] = dict(num_microbatches=4, num_training_batches=float("inf"), max_steps=-1, replicas=2)
    with pytest.raises(ConfigurationError, match=r"batch_size=6 is the global batch of 2 replicas .* at least 8"):
        check_batches(loader(48, 6), **kw)
    with pytest.raises(ConfigurationError, match=r"last training batch of each epoch holds 6 samples .* the 8 that"):
        check_batches(loader(54, 16), **kw)
    check_batches(loader(54, 16, drop_last=True), **kw)
    check_batches(loader(56, 16), **kw)  # a last batch of 8: one sample per micro-batch on each replica
    check_batches(loader(54, 16), **{**kw, "replicas": 1})  # 6 >= 4 without a split
