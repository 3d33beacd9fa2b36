"""Partition-independent checkpoints from a sharded pipeline: gather the layers, write the plain layout.

A checkpoint written from any partition has the plain module's ``state_dict`` keys, in its order, and the
plain optimizer's ``state_dict``: state keyed by canonical index (the parameter's position in the optimizer
the user built on the whole model) and the whole model's parameter groups. So it loads into the plain
LightningModule, and resumes under any other number of stages. Everything moves as tensors, only to the member
that needs it: layers into receivers allocated from their ``meta`` skeletons (no shapes travel), each
parameter's optimizer state as one wire message (:mod:`~lightning_dynpipe.engine.optstate`); nothing is pickled.

Pure torch plus :class:`~lightning_dynpipe.engine.collectives.Collectives`: no Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_dynpipe.engine.collectives import Collectives
from lightning_dynpipe.engine.optstate import broadcast_state, recv_state, send_state
from lightning_dynpipe.engine.shard import StageShard, layer_tensors
from lightning_dynpipe.engine.ties import SharedParameter
from lightning_dynpipe.errors import ConfigurationError

__all__ = [
    "gather_layer_states",
    "full_state_dict",
    "owned_state_dict",
    "gather_optimizer_state",
    "load_optimizer_state",
]


def gather_layer_states(
    shard: StageShard,
    coll: Collectives,
    *,
    rank_of_stage: Callable[[int], int],
    device: torch.device,
    root: int | None,
    everything: bool = False,
) -> dict[int, dict[str, Tensor]]:
    """Every layer's ``state_dict``, by layer index: on every member (``root=None``) or only on ``root``.

    Collective over the pipeline: every member calls it with the same arguments. Other members than
    ``root`` return ``{}`` when ``root`` is given. With ``everything``, each layer's
    :func:`~lightning_dynpipe.engine.shard.layer_tensors` instead (non-persistent buffers too): what it takes to
    put the layer back into a module, rather than what a checkpoint holds.

    Args:
        shard: this member's stage shard (its own layers and the skeletons of the others).
        coll: the pipeline's collectives.
        rank_of_stage: the global rank of each stage in this pipeline.
        device: where received tensors are allocated.
        root: the member that collects everything, or ``None`` for all of them.
        everything: gather every tensor of each layer, not only its ``state_dict``.
    """
    pipeline, partition = shard.pipeline, shard.partition
    own = {i: layer_tensors(pipeline[i]) if everything else pipeline[i].state_dict() for i in shard.owned}
    out: dict[int, dict[str, Tensor]] = {}
    for layer_idx in range(partition.num_layers):
        owner = rank_of_stage(partition.stage_of_layer(layer_idx))
        if root is None:
            sd = own[layer_idx] if layer_idx in own else shard.empty_state(layer_idx, device, everything=everything)
            if partition.num_stages > 1:
                for t in sd.values():
                    coll.broadcast(t, src=owner)
            out[layer_idx] = sd
        elif coll.rank == root:
            if owner == root:
                out[layer_idx] = own[layer_idx]
            else:
                sd = shard.empty_state(layer_idx, device, everything=everything)
                for t in sd.values():
                    coll.recv(t, src=owner)
                out[layer_idx] = sd
        elif owner == coll.rank:
            for t in own[layer_idx].values():
                coll.send(t, dst=root)
    return out


def full_state_dict(
    module_state: Mapping[str, Any],
    layers: Mapping[int, Mapping[str, Tensor]],
    prefix: str,
    key_order: Sequence[str],
    ties: Sequence[SharedParameter] = (),
) -> dict[str, Any]:
    """The plain module's ``state_dict``: its entries outside the pipeline, plus every layer's, in key order.

    Args:
        module_state: the LightningModule's own ``state_dict`` (with this stage's layers only).
        layers: every layer's ``state_dict``, by layer index.
        prefix: the pipeline's key prefix, e.g. ``"pipeline."``.
        key_order: the plain module's keys, in order.
        ties: parameters shared by several layers: all their keys get one tensor, as in the plain module's
            ``state_dict`` (so a saved file holds it once).
    """
    merged: dict[str, Any] = {k: v for k, v in module_state.items() if not k.startswith(prefix)}
    for layer_idx, sd in layers.items():
        for k, v in sd.items():
            merged[f"{prefix}{layer_idx}.{k}"] = v
    for tie in ties:
        keys = [f"{prefix}{i}.{n}" for i, n in tie.occurrences if f"{prefix}{i}.{n}" in merged]
        for k in keys[1:]:
            merged[k] = merged[keys[0]]
    return {k: merged[k] for k in key_order if k in merged}


def owned_state_dict(state: Mapping[str, Any], prefix: str, owned: Sequence[int]) -> dict[str, Any]:
    """The entries of a plain ``state_dict`` that a stage owning layers ``owned`` loads (and those outside
    the pipeline)."""
    mine = tuple(f"{prefix}{i}." for i in owned)
    return {k: v for k, v in state.items() if not k.startswith(prefix) or k.startswith(mine)}


def gather_optimizer_state(
    local: Mapping[str, Any],
    canonical: Sequence[Sequence[int]],
    group_sizes: Sequence[int],
    holders: Mapping[int, int],
    coll: Collectives,
    *,
    device: torch.device,
    root: int | None,
) -> dict[str, Any]:
    """The plain optimizer's ``state_dict``, assembled on ``root`` (``None``: on every member) from the stages'.

    Collective over the pipeline: every member calls it with the same ``holders``; members other than ``root``
    return ``{}``. Each parameter's state moves as tensors (:mod:`~lightning_dynpipe.engine.optstate`), from the
    member that holds it to the root only (or broadcast, with ``root=None``): in canonical order, one parameter
    in flight at a time.

    Args:
        local: this stage's ``optimizer.state_dict()``.
        canonical: per group, the canonical index of each parameter in the local optimizer.
        group_sizes: the number of parameters of each group in the whole model.
        holders: the global rank that sends each canonical index (every pipeline parameter of the optimizer).
        coll: the pipeline's collectives.
        device: where tensors travel and received ones are allocated.
        root: the member that returns the result, or ``None`` for all of them.
    """
    flat = [c for g in canonical for c in g]
    mine = {flat[i]: st for i, st in local["state"].items()}
    state: dict[int, Any] = {}
    for c, holder in sorted(holders.items()):
        if root is None:
            got = broadcast_state(coll, mine.get(c), c, holder, device)
        elif coll.rank == root:
            got = mine.get(c) if holder == root else recv_state(coll, c, holder, device)
        else:
            if holder == coll.rank:
                send_state(coll, mine.get(c), c, root, device)
            continue
        if got is not None:
            state[c] = got
    if root is not None and coll.rank != root:
        return {}
    groups, base = [], 0
    for g, n in zip(local["param_groups"], group_sizes):
        groups.append({**g, "params": list(range(base, base + n))})
        base += n
    return {"state": {k: state[k] for k in sorted(state)}, "param_groups": groups}


def load_optimizer_state(optimizer: Optimizer, full: Mapping[str, Any], canonical: Sequence[Sequence[int]]) -> None:
    """Loads the entries of a plain optimizer ``state_dict`` that belong to this stage's parameters.

    Raises:
        ConfigurationError: the checkpoint's optimizer has another number of parameter groups.
    """
    if len(full["param_groups"]) != len(canonical):
        raise ConfigurationError(
            f"The checkpoint's optimizer has {len(full['param_groups'])} parameter groups but "
            f"configure_optimizers built {len(canonical)}; resume with the same optimizer set-up."
        )
    state, groups, local_i = {}, [], 0
    for g_saved, g_canon in zip(full["param_groups"], canonical):
        idx = []
        for c in g_canon:
            if c in full["state"]:
                state[local_i] = full["state"][c]
            idx.append(local_i)
            local_i += 1
        groups.append({**g_saved, "params": idx})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
