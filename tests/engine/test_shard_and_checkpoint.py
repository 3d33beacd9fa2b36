"""Stage shards, optimizer slots and the canonical checkpoint gather/load, in one process.

Two stages run as threads over a :class:`~lightning_dynpipe.engine.loopback.LoopbackGroup`, so the same gather
code as in a multi-process run is exercised.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_dynpipe.engine import checkpoint
from lightning_dynpipe.engine.loopback import LoopbackGroup, run_stages
from lightning_dynpipe.engine.replica import average_replica_gradients
from lightning_dynpipe.engine.shard import OptimizerSlots, Placeholder, StageShard
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.partition import Partition

CPU = torch.device("cpu")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pipeline = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.Linear(4, 2))
        self.register_buffer("outside", torch.arange(3.0))
        # a non-persistent buffer, as causal masks and rotary tables are: not in state_dict(), needed to compute
        self.pipeline[2].register_buffer("table", torch.linspace(0, 1, 4), persistent=False)


def _adam(net: Net) -> torch.optim.Optimizer:
    decay = [p for n, p in net.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in net.named_parameters() if not n.endswith("weight")]
    opt = torch.optim.Adam([{"params": decay, "weight_decay": 0.1}, {"params": rest}], lr=0.01)
    x = torch.randn(5, 3)
    net.pipeline(x).sum().backward()
    opt.step()  # populate state
    opt.zero_grad()
    return opt


def test_partition_module_keeps_owned_layers_and_meta_skeletons() -> None:
    net = Net()
    shard = StageShard(net.pipeline, Partition((2, 2)), stage_idx=1)
    shard.partition_module()
    assert shard.owned == [2, 3]
    assert [type(m) for m in net.pipeline[:2]] == [Placeholder, Placeholder]
    assert all(p.device.type == "meta" for i in (0, 1) for p in shard.skeleton(i).parameters())
    with pytest.raises(RuntimeError, match="Layer 0 of the pipeline lives on stage 0"):
        net.pipeline[0](torch.zeros(1, 3))
    assert [type(m) for m in shard.stage_module()] == [nn.Linear, nn.Linear]
    shard.set_partition(Partition((3, 1)))
    assert shard.placeholders()[1].owner_stage == 0


def _stage_one_of_two() -> tuple[torch.optim.Optimizer, OptimizerSlots, StageShard]:
    """Stage 1's optimizer, slots and shard of a [2, 2] split of ``Net`` (the optimizer built on the whole model)."""
    net = Net()
    opt = _adam(net)
    slots = OptimizerSlots.record(net.pipeline, [opt])
    shard = StageShard(net.pipeline, Partition((2, 2)), stage_idx=1)
    shard.partition_module()
    slots.refilter([opt], shard)
    return opt, slots, shard


def test_optimizer_slots_keep_the_canonical_order_per_group() -> None:
    opt, slots, _ = _stage_one_of_two()
    # group 0 (weights): layers 0..3 have weights -> canonical 0..3 (BN weight is layer 1); stage 1 holds 2, 3
    assert slots.canonical == [[[2, 3], [6, 7]]]  # per optimizer, per group
    assert slots.group_sizes == [[4, 4]]
    assert len(opt.state) == 4  # the other stage's state left with its layers


def test_parameters_added_to_the_optimizer_after_the_split_are_refused() -> None:
    """A finetuning callback's new group (or a group that grew) is outside the split: refused with the fix."""
    opt, slots, shard = _stage_one_of_two()
    slots.check_unchanged([opt], stage_idx=1)  # as split
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "lr": 0.1})
    with pytest.raises(ConfigurationError, match="changed during fit"):
        slots.refilter([opt], shard)  # a re-split (a layer move) would drop the new group's parameters
    with pytest.raises(ConfigurationError) as err:
        slots.check_unchanged([opt], stage_idx=1)
    msg = str(err.value)
    assert (
        "on stage 1 its groups hold [2, 2, 1] parameters, where the split across stages at set-up gave it [2, 2]" in msg
    )
    assert "requires_grad_(True)" in msg and "configure_optimizers" in msg
    opt.param_groups.pop()
    opt.param_groups[0]["params"].append(nn.Parameter(torch.zeros(2)))
    with pytest.raises(ConfigurationError, match=r"groups hold \[3, 2\] parameters"):
        slots.check_unchanged([opt], stage_idx=1)


def _two_stage_states(net: Net, opt: torch.optim.Optimizer) -> tuple[list[dict], list[dict]]:
    """Runs both stages of a [2, 2] split of copies of ``net`` as threads; gathers layers and optimizer state."""
    nets = [copy.deepcopy(net) for _ in range(2)]
    opts = []
    for n in nets:  # the same optimizer (groups, hyperparameters, state) on each copy
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [dict(n.named_parameters())[name] for name in names],
            }
            for g, names in zip(opt.param_groups, _group_names(net, opt))
        ]
        o = type(opt)(groups)
        o.load_state_dict(copy.deepcopy(opt.state_dict()))
        opts.append(o)
    group = LoopbackGroup([0, 1])
    rank_of_stage = {0: 1, 1: 0}.__getitem__  # the last stage on rank 0, as the strategy places it

    def run(k: int) -> tuple[dict, dict]:
        rank = rank_of_stage(k)
        coll = group.member(rank)
        slots = OptimizerSlots.record(nets[k].pipeline, [opts[k]])
        shard = StageShard(nets[k].pipeline, Partition((2, 2)), stage_idx=k)
        shard.partition_module()
        slots.refilter([opts[k]], shard)
        layers = checkpoint.gather_layer_states(shard, coll, rank_of_stage=rank_of_stage, device=CPU, root=0)
        full = (
            checkpoint.full_state_dict(nets[k].state_dict(), layers, "pipeline.", list(net.state_dict()))
            if layers
            else {}
        )
        holders = {c: rank_of_stage(s) for c, s in slots.holders(0, Partition((2, 2))).items()}
        ostate = checkpoint.gather_optimizer_state(
            opts[k].state_dict(), slots.canonical[0], slots.group_sizes[0], holders, coll, device=CPU, root=0
        )
        everywhere = checkpoint.gather_layer_states(
            shard, coll, rank_of_stage=rank_of_stage, device=CPU, root=None, everything=True
        )
        shard.restore(everywhere, CPU)
        return full, ostate

    results = run_stages(run, 2)
    return [r[0] for r in results], [r[1] for r in results]


def _group_names(net: Net, opt: torch.optim.Optimizer) -> list[list[str]]:
    names = {id(p): n for n, p in net.named_parameters()}
    return [[names[id(p)] for p in g["params"]] for g in opt.param_groups]


def test_gathered_checkpoint_equals_the_plain_state_in_plain_order() -> None:
    net = Net()
    opt = _adam(net)
    fulls, ostates = _two_stage_states(net, opt)
    plain, plain_opt = net.state_dict(), opt.state_dict()
    full = fulls[1]  # the last stage sits on rank 0, the root
    assert list(full) == list(plain) and fulls[0] == {}
    for k in plain:
        assert torch.equal(full[k], plain[k]), k
    assert ostates[0] == {} and ostates[1]["param_groups"] == plain_opt["param_groups"]
    assert sorted(ostates[1]["state"]) == sorted(plain_opt["state"])
    for i, st in plain_opt["state"].items():
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(ostates[1]["state"][i][key]), torch.as_tensor(value))


def test_restore_puts_every_layer_back_on_every_stage() -> None:
    net = Net()
    opt = _adam(net)
    nets = [copy.deepcopy(net) for _ in range(2)]
    group = LoopbackGroup([0, 1])
    rank_of_stage = {0: 1, 1: 0}.__getitem__

    def run(k: int) -> None:
        shard = StageShard(nets[k].pipeline, Partition((1, 3)), stage_idx=k)
        shard.partition_module()
        states = checkpoint.gather_layer_states(
            shard, group.member(rank_of_stage(k)), rank_of_stage=rank_of_stage, device=CPU, root=None, everything=True
        )
        shard.restore(states, CPU)

    run_stages(run, 2)
    del opt
    for n in nets:
        for (key, a), b in zip(n.state_dict().items(), net.state_dict().values()):
            assert torch.equal(a, b), key
        assert torch.equal(n.pipeline[2].table, torch.linspace(0, 1, 4))  # the non-persistent buffer came back


def test_restore_refuses_tensors_of_another_layer() -> None:
    net = Net()
    shard = StageShard(net.pipeline, Partition((3, 1)), stage_idx=1)
    shard.partition_module()
    with pytest.raises(RuntimeError, match="Layer tensors do not match"):
        shard.restore({0: {}, 1: {}, 2: {}}, CPU)


def test_a_checkpoint_holds_the_state_dict_only() -> None:
    net = Net()
    group = LoopbackGroup([0])
    shard = StageShard(net.pipeline, Partition((4,)), stage_idx=0)
    layers = checkpoint.gather_layer_states(shard, group.member(0), rank_of_stage=lambda k: 0, device=CPU, root=0)
    assert "table" not in layers[2] and set(layers[2]) == {"weight", "bias"}


def test_load_optimizer_state_takes_the_stage_entries_and_checks_groups() -> None:
    net = Net()
    opt = _adam(net)
    full = opt.state_dict()
    slots = OptimizerSlots.record(net.pipeline, [opt])
    shard = StageShard(net.pipeline, Partition((3, 1)), stage_idx=1)
    shard.partition_module()
    slots.refilter([opt], shard)
    checkpoint.load_optimizer_state(opt, full, slots.canonical[0])
    last = net.pipeline[3]
    assert torch.equal(opt.state[last.weight]["exp_avg"], full["state"][3]["exp_avg"])
    with pytest.raises(ConfigurationError, match="parameter groups"):
        checkpoint.load_optimizer_state(opt, {**full, "param_groups": full["param_groups"][:1]}, slots.canonical[0])


def test_owned_state_dict_keeps_the_stage_and_everything_outside_the_pipeline() -> None:
    sd = {"pipeline.0.weight": 0, "pipeline.1.bias": 1, "pipeline.10.weight": 2, "outside": 3}
    assert checkpoint.owned_state_dict(sd, "pipeline.", [1]) == {"pipeline.1.bias": 1, "outside": 3}


def test_replica_gradients_are_averaged_and_missing_ones_count_as_zero() -> None:
    group = LoopbackGroup([0, 1])
    layers = [nn.Linear(2, 2) for _ in range(2)]
    layers[0].weight.grad = torch.ones(2, 2)
    layers[1].weight.grad = 3 * torch.ones(2, 2)
    layers[0].bias.grad = torch.ones(2)  # replica 1 has no bias gradient

    run_stages(lambda r: average_replica_gradients(list(layers[r].parameters()), group.member(r), 2), 2)
    for layer in layers:
        assert torch.equal(layer.weight.grad, 2 * torch.ones(2, 2))
        assert torch.equal(layer.bias.grad, 0.5 * torch.ones(2))


def test_restored_layers_hold_new_parameter_objects() -> None:
    """As documented: a layer that was offloaded comes back with new Parameter objects (hold names, not
    references, across a fit); the layers the stage kept keep theirs."""
    net = Net()
    kept, offloaded = net.pipeline[3].weight, net.pipeline[0].weight
    shard = StageShard(net.pipeline, Partition((3, 1)), stage_idx=1)
    shard.partition_module()
    group = LoopbackGroup([0])
    states = checkpoint.gather_layer_states(
        StageShard(Net().pipeline, Partition((4,)), 0), group.member(0), rank_of_stage=lambda k: 0, device=CPU,
        root=None, everything=True,
    )  # fmt: skip
    shard.restore(states, CPU)
    assert net.pipeline[3].weight is kept and net.pipeline[0].weight is not offloaded
