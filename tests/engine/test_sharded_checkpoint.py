"""Sharded checkpoints through torch.distributed.checkpoint, without Lightning: written by the stages of one
partition (each only its own layers and optimizer state), read under another partition and in one plain process;
every tensor equals the whole model's exactly.

Two gloo processes (this one and a spawned one) write as a 2-stage pipeline; reading needs no process group, so
each stage of a 3-stage and of a 1-stage pipeline reads its part here, one after the other.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from lightning_dynpipe.engine import checkpoint, sharded
from lightning_dynpipe.engine.shard import OptimizerSlots, StageShard
from lightning_dynpipe.engine.ties import shared_parameters
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.partition import Partition

PREFIX = "pipeline."


class Net(nn.Module):
    """A tied embedding/head (GPT-2 style), a BatchNorm (buffers), a buffer outside the pipeline."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        emb = nn.Embedding(6, 4)
        head = nn.Linear(4, 6, bias=False)
        head.weight = emb.weight
        self.pipeline = nn.Sequential(emb, nn.Linear(4, 4), nn.BatchNorm1d(4), head)
        self.register_buffer("outside", torch.arange(3.0) + seed)


def _trained(seed: int) -> tuple[Net, torch.optim.Optimizer]:
    net = Net(seed)
    params = list(net.parameters())
    opt = torch.optim.Adam([{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:]}], lr=0.01)
    g = torch.Generator().manual_seed(seed)
    for _ in range(2 + seed):
        net.pipeline(torch.randint(0, 6, (5,), generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def _lightning_like(net: Net, opt: torch.optim.Optimizer, state_dict: Any, opt_state: Any) -> dict[str, Any]:
    return {
        "epoch": 1,
        "global_step": 4,
        "state_dict": state_dict,
        "loops": {"fit_loop": {"epoch_progress": {"total": {"completed": 1}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": torch.tensor(0.25)}},
        "optimizer_states": [opt_state],
        "lr_schedulers": [{"last_epoch": 4, "_last_lr": [0.01, 0.01]}],
    }


def _stage(net: Net, opt: torch.optim.Optimizer, partition: Partition, k: int) -> tuple[StageShard, OptimizerSlots]:
    slots = OptimizerSlots.record(net.pipeline, [opt])
    shard = StageShard(net.pipeline, partition, k)
    shard.partition_module()
    slots.refilter([opt], shard)
    return shard, slots


def _write(rank: int, init: str, path: str) -> None:
    """Rank ``rank`` of a 2-stage pipeline (stage 1 on rank 0, as the strategy places it) writes its part."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        aliases = sharded.tie_aliases(shared_parameters(Net().pipeline), PREFIX)
        net, opt = _trained(0)
        k = {1: 0, 0: 1}[rank]
        shard, slots = _stage(net, opt, Partition((2, 2)), k)
        mine = {c for c, s in slots.holders(0, shard.partition).items() if s == k}
        flat = [c for g in slots.canonical[0] for c in g]
        local = opt.state_dict()
        entries = sharded.local_model_entries(net.state_dict(), PREFIX, shard.owned, aliases, outside=rank == 0)
        shard_state = {flat[i]: st for i, st in local["state"].items() if flat[i] in mine}
        entries.update(sharded.local_optimizer_entries(0, {"state": shard_state}))
        if rank == 0:
            rest = _lightning_like(net, opt, None, {"param_groups": checkpoint_groups(opt, slots)})
            rest["dynpipe"] = {"aliases": aliases, "key_order": list(Net().state_dict())}
            entries[sharded.REST] = rest
        sharded.save(entries, path)
    finally:
        dist.destroy_process_group()


def _read_as_stage(path: str, partition: Partition, k: int) -> None:
    """Stage ``k`` of ``partition`` reads its part into a model built with other weights and optimizer state;
    every tensor it holds then equals the written model's."""
    aliases = sharded.tie_aliases(shared_parameters(Net().pipeline), PREFIX)
    net, opt = _trained(k + 1)
    ref, ref_opt = _trained(0)
    _, slots = _stage(net, opt, partition, k)
    loaded = sharded.load_stage(
        path,
        targets=net.state_dict(),
        prefix=PREFIX,
        aliases=aliases,
        expected_keys=list(ref.state_dict()),
        wanted=[{c for g in slots.canonical[0] for c in g}],
    )
    checkpoint.load_optimizer_state(opt, loaded["optimizer_states"][0], slots.canonical[0])
    plain = ref.state_dict()
    for key, value in net.state_dict().items():  # read in place: the stage's own layers and the outside buffer
        assert torch.equal(value, plain[key]), key
    assert torch.equal(loaded["callbacks"]["ModelCheckpoint{'monitor': None}"]["best_model_score"], torch.tensor(0.25))
    ref_state = ref_opt.state_dict()["state"]
    names = {id(p): n for n, p in net.named_parameters(remove_duplicate=False)}
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    ref_index = {id(p): i for i, p in enumerate(q for g in ref_opt.param_groups for q in g["params"])}
    for group in opt.param_groups:
        for p in group["params"]:
            want = ref_state[ref_index[id(ref_params[names[id(p)]])]]
            assert list(opt.state[p]) == list(want), names[id(p)]
            for name in want:
                assert torch.equal(opt.state[p][name], want[name]), (names[id(p)], name)


def checkpoint_groups(opt: torch.optim.Optimizer, slots: OptimizerSlots) -> list[dict[str, Any]]:
    """The whole model's param_groups in canonical form (what the strategy writes)."""
    groups, base = [], 0
    for g, n in zip(opt.state_dict()["param_groups"], slots.group_sizes[0]):
        groups.append({**g, "params": list(range(base, base + n))})
        base += n
    return groups


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.multiprocess
def test_sharded_checkpoint_reads_under_another_partition_and_in_one_plain_process(tmp_path: Path) -> None:
    path, init = str(tmp_path / "last.ckpt"), f"file://{tmp_path / 'pg'}"
    child = mp.get_context("spawn").Process(target=_write, args=(1, init, path))
    child.start()
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=2)
    _write(0, init, path)
    child.join(60)
    assert child.exitcode == 0

    for k in range(3):  # each stage of another partition reads only its part (no process group needed)
        _read_as_stage(path, Partition((1, 2, 1)), k)
    _read_as_stage(path, Partition((4,)), 0)

    ref, ref_opt = _trained(0)
    full = _lightning_like(ref, ref_opt, ref.state_dict(), ref_opt.state_dict())
    # the tied parameter is stored once; so is every other tensor
    md = sharded.read_metadata(path).state_dict_metadata
    assert "state_dict.pipeline.3.weight" not in md and "state_dict.pipeline.0.weight" in md
    assert sum(1 for fqn in md if fqn.startswith("state_dict.")) == len(ref.state_dict()) - 1

    # the full checkpoint, from the sharded one, in one process: the same content, the same bytes
    whole = sharded.consolidate(path)
    assert list(whole["state_dict"]) == list(full["state_dict"])
    for key, value in full["state_dict"].items():
        assert torch.equal(whole["state_dict"][key], value), key
    assert _saved(whole["optimizer_states"]) == _saved(full["optimizer_states"])
    assert whole["loops"] == full["loops"] and whole["lr_schedulers"] == full["lr_schedulers"]

    # plain torch, the standard DCP call: the weights straight into a plain model (the tied key left out)
    plain = Net(seed=5)
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: state_dict.pipeline.3.weight"):
        dcp.load({"state_dict": plain.state_dict()}, checkpoint_id=path)
    sd = {k: v for k, v in plain.state_dict().items() if k != "pipeline.3.weight"}
    dcp.load({"state_dict": sd}, checkpoint_id=path)
    for key, value in ref.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key
    assert plain.pipeline[3].weight is plain.pipeline[0].weight


def test_loading_into_another_model_is_refused_with_the_keys(tmp_path: Path) -> None:
    net, _ = _trained(0)
    path = tmp_path / "ckpt"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        entries = sharded.local_model_entries(net.state_dict(), PREFIX, range(4), {}, outside=True)
        entries[sharded.REST] = {"state_dict": None}
        sharded.save(entries, path)
    finally:
        dist.destroy_process_group()
    assert sharded.is_sharded_checkpoint(path) and not sharded.is_sharded_checkpoint(tmp_path / "pg")
    other = copy.deepcopy(net)
    other.pipeline.append(nn.Linear(6, 2))
    with pytest.raises(ConfigurationError, match=r"missing keys \['pipeline.4.bias', 'pipeline.4.weight'\]"):
        sharded.load_stage(
            path,
            targets=other.state_dict(),
            prefix=PREFIX,
            aliases={},
            expected_keys=list(other.state_dict()),
            wanted=[],
        )
