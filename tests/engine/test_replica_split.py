"""Uneven replica splits in the engine, in one process: D pipeline replicas of S stages on threads over loopback
channels, each stage averaging its gradient over its replicas weighted by sample count.

Sync must equal plain training on the global batch, async the PipeDream replay whose micro-batch ``i`` is the
union of every replica's micro-batch ``i``; both while the split changes between steps without a drain.
Tolerance 1e-6 absolute (float32; only the order of the sums differs from the references)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dynpipe.calibration import replay_async
from lightning_dynpipe.engine.executor import StageExecutor
from lightning_dynpipe.engine.loopback import LoopbackGroup, loopback_channels, run_stages
from lightning_dynpipe.engine.microbatch import batch_fingerprint, split_microbatches, take_share
from lightning_dynpipe.engine.replica import average_replica_gradients
from lightning_dynpipe.engine.shard import StageShard
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.partition import Partition
from lightning_dynpipe.plan.replicas import ReplicaSplit

ATOL = 1e-6
M = 4
LR = 0.1


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))


def _batches(steps: int, n: int, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(steps)]


def _loss(out: Tensor, mb: Any) -> Tensor:
    return F.cross_entropy(out, mb[1])  # the mean over the micro-batch, as a Lightning training_step returns


def _train_replicated(
    model: nn.Sequential, balance: Sequence[int], schedule: str, batches: list[Any], splits: list[ReplicaSplit]
) -> list[nn.Sequential]:
    """Every replica d of the pipeline trains on its share of each global batch (``splits[t]`` at step t);
    returns each replica's model."""
    D = splits[0].num_replicas
    part = Partition.from_balance(balance, len(model))
    S = part.num_stages
    replicas = [copy.deepcopy(model) for _ in range(D)]
    channels = [loopback_channels(S, timeout=30.0) for _ in range(D)]
    stage_groups = [LoopbackGroup(list(range(D))) for _ in range(S)]
    executors: dict[tuple[int, int], StageExecutor] = {}
    for d in range(D):
        for k in range(S):
            stage = StageShard(replicas[d], part, k).stage_module()
            opt = torch.optim.SGD(stage.parameters(), lr=LR, momentum=0.9)

            def step(d: int = d, k: int = k, opt: torch.optim.Optimizer = opt) -> None:
                params = [p for g in opt.param_groups for p in g["params"]]
                samples = executors[d, k].update_samples
                average_replica_gradients(params, stage_groups[k].member(d), D, samples=samples)
                opt.step()
                opt.zero_grad(set_to_none=True)

            holder: list[StageExecutor] = []

            def last(mb: Any, slot: int, holder: list[StageExecutor] = holder) -> Tensor:
                return _loss(holder[0].local_forward(mb[0] if S == 1 else None), mb)

            ex = StageExecutor(
                stage_module=stage,
                stage_idx=k,
                num_stages=S,
                schedule=schedule,
                num_microbatches=M,
                channels=channels[d][k],
                first_stage_input=lambda b: b[0],
                last_stage_loss=last if k == S - 1 else None,
                optimizer_step=step,
            )
            holder.append(ex)
            executors[d, k] = ex

    def run(r: int) -> None:
        d, k = divmod(r, S)
        for t, batch in enumerate(batches):
            n = batch[0].shape[0]
            offsets, shares = splits[t].offsets(n, M), splits[t].shares(n, M)
            executors[d, k].train_step(take_share(batch, offsets[d], shares[d]))
        executors[d, k].drain()

    run_stages(run, D * S)
    return replicas


def _plain(model: nn.Sequential, batches: list[Any]) -> nn.Sequential:
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    return ref


def _union_microbatches(batch: Any, split: ReplicaSplit) -> list[Any]:
    """Micro-batch i of the pipeline: every replica's micro-batch i, concatenated."""
    n = batch[0].shape[0]
    offsets, shares = split.offsets(n, M), split.shares(n, M)
    per_replica = [split_microbatches(take_share(batch, o, s), M)[0] for o, s in zip(offsets, shares)]
    return [tuple(torch.cat([mbs[i][j] for mbs in per_replica]) for j in range(2)) for i in range(M)]


def _assert_equal(models: Sequence[nn.Module], ref: nn.Module) -> None:
    for m in models:
        for (name, a), b in zip(m.state_dict().items(), ref.state_dict().values()):
            assert torch.allclose(a, b, atol=ATOL, rtol=0), (name, (a - b).abs().max())


def test_take_share_slices_every_tensor_and_refuses_outside_the_batch() -> None:
    batch = {"x": torch.arange(10).view(5, 2), "y": (torch.arange(5), "tag")}
    share = take_share(batch, 3, 2)
    assert share["x"].tolist() == [[6, 7], [8, 9]] and share["y"][0].tolist() == [3, 4] and share["y"][1] == "tag"
    assert take_share(batch, 0, 0)["y"][0].numel() == 0
    with pytest.raises(ConfigurationError, match=r"samples 4:6 of a batch of 5"):
        take_share(batch, 4, 2)


def test_batch_fingerprint_tells_other_content_and_other_order_apart() -> None:
    x, y = torch.randn(8, 3), torch.arange(8)
    assert batch_fingerprint((x, y)) == batch_fingerprint((x.clone(), y.clone()))
    assert batch_fingerprint((x, y)) != batch_fingerprint((x.flip(0), y.flip(0)))  # same samples, other order
    assert batch_fingerprint((x, y)) != batch_fingerprint((x[:7], y[:7]))
    assert batch_fingerprint({"a": x, "tag": "t"}) == batch_fingerprint({"a": x, "tag": "u"})  # tensors only


def test_weighted_replica_average_is_the_mean_over_all_samples() -> None:
    group = LoopbackGroup([0, 1])
    layers = [nn.Linear(2, 2) for _ in range(2)]
    layers[0].weight.grad = torch.ones(2, 2)  # the mean over 3 samples
    layers[1].weight.grad = 5 * torch.ones(2, 2)  # the mean over 1 sample
    layers[0].bias.grad = torch.ones(2)  # replica 1 has no bias gradient: it counts as zero
    samples = [3, 1]
    run_stages(lambda r: average_replica_gradients(list(layers[r].parameters()), group.member(r), 2, samples[r]), 2)
    for layer in layers:
        assert torch.equal(layer.weight.grad, 2 * torch.ones(2, 2))  # (3*1 + 1*5) / 4
        assert torch.equal(layer.bias.grad, 0.75 * torch.ones(2))


@pytest.mark.parametrize("balance", [[5], [3, 2]], ids=["S1", "S2"])
def test_sync_uneven_splits_equal_plain_training_on_the_global_batch(balance: list[int]) -> None:
    model, batches = _net(), _batches(6, 16)
    # 3:1, then 1:2, then even, changing between steps (no drain between them under sync anyway)
    splits = [ReplicaSplit((3.0, 1.0))] * 2 + [ReplicaSplit((1.0, 2.0))] * 2 + [ReplicaSplit.even(2)] * 2
    ref = _plain(model, batches)
    _assert_equal(_train_replicated(model, balance, "sync", batches, splits), ref)
    even = _train_replicated(model, balance, "sync", batches, [ReplicaSplit.even(2)] * 6)
    _assert_equal(even, ref)


def test_async_uneven_split_equals_the_replay_with_the_same_microbatches_across_a_change() -> None:
    model, batches = _net(), _batches(6, 24)
    # 3:1 for three steps, then 1:3 without a drain: in-flight micro-batches keep the counts they were split with
    splits = [ReplicaSplit((3.0, 1.0))] * 3 + [ReplicaSplit((1.0, 3.0))] * 3
    replicas = _train_replicated(model, [3, 2], "async", batches, splits)
    ref = copy.deepcopy(model)
    by_step = {id(b): s for b, s in zip(batches, splits)}
    replay_async(
        ref,
        [3, 2],
        lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
        batches,
        M,
        _loss,
        split=lambda b: _union_microbatches(b, by_step[id(b)]),
    )
    _assert_equal(replicas, ref)
    # and the uneven run is not the even run's replay (the test would not see a wrong weighting otherwise)
    even = copy.deepcopy(model)
    replay_async(even, [3, 2], lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9), batches, M, _loss)
    assert not torch.allclose(replicas[0][0].weight, even[0].weight, atol=1e-4)
