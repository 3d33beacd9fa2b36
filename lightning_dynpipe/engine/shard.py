"""One stage's share of the user's model: the layers it owns, placeholders for the rest, optimizer slots.

A :class:`StageShard` edits the user's ``nn.Sequential`` in place, so the LightningModule stays the object
Lightning and the user hold: layers the stage owns stay where they are, every other layer is replaced by a
:class:`Placeholder` and kept aside on the ``meta`` device (shapes and dtypes, no data) as the skeleton a
layer is received into when it moves here, or when the whole model is put back together.

:class:`OptimizerSlots` remembers where each parameter sat in the optimizer the user built on the whole model
(its parameter group and its canonical index, the index of the plain optimizer's ``state_dict``), so that a
stage's optimizer holds exactly its own layers' parameters in canonical order, and checkpoints can be written
in the plain layout from any partition.

Pure torch: no process groups, no Lightning.

Example::

    shard = StageShard(model.pipeline, Partition((2, 1)), stage_idx=0)
    slots = OptimizerSlots.record(model.pipeline, [optimizer])   # before partitioning
    shard.partition_module()                                      # layer 2 -> placeholder, skeleton on meta
    slots.refilter([optimizer], shard)                            # optimizer keeps layers 0 and 1
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.partition import Partition

__all__ = ["Placeholder", "StageShard", "OptimizerSlots", "keeping_grad_hooks", "layer_tensors", "load_layer_tensors"]


def layer_tensors(layer: nn.Module) -> dict[str, Tensor]:
    """Every tensor a layer needs to compute: its parameters and all its buffers, persistent or not, by name.

    ``state_dict()`` leaves out non-persistent buffers (causal masks, rotary tables, ``position_ids``), which a
    layer still needs when it moves to another stage or comes back into the user's module; this is what travels.
    """
    out: dict[str, Tensor] = {name: p.detach() for name, p in layer.named_parameters()}
    out.update(layer.named_buffers())
    return out


@contextmanager
def keeping_grad_hooks(layer: nn.Module) -> Iterator[None]:
    """Gives the parameters of ``layer`` after the block the gradient hooks its parameters of the same names had
    before it (``register_hook``, ``register_post_accumulate_grad_hook``).

    ``Module.to("meta")`` and ``Module.to_empty(...)`` replace every parameter by a new ``Parameter`` object, which
    has none of the hooks the user registered on the old one: a layer offloaded to ``meta`` and materialised again
    (moved to another stage, gathered after fit, built on the meta device) would lose them silently. The hooks move
    as the same dictionaries, so a handle the user kept still removes them.

    Example::

        with keeping_grad_hooks(layer):
            layer.to_empty(device="cpu")
    """
    hooks = {
        name: (p._backward_hooks, p._post_accumulate_grad_hooks)
        for name, p in layer.named_parameters(remove_duplicate=False)
        if p._backward_hooks or p._post_accumulate_grad_hooks
    }
    yield
    if not hooks:
        return
    params = dict(layer.named_parameters(remove_duplicate=False))
    for name, (tensor_hooks, post_hooks) in hooks.items():
        p = params.get(name)
        if p is None:
            continue
        if tensor_hooks and p._backward_hooks is not tensor_hooks:
            p._backward_hooks = tensor_hooks
        if post_hooks and p._post_accumulate_grad_hooks is not post_hooks:
            p._post_accumulate_grad_hooks = post_hooks


def load_layer_tensors(layer: nn.Module, tensors: dict[str, Tensor]) -> None:
    """Copies ``tensors`` (from :func:`layer_tensors` of the same kind of layer) into ``layer``, in place."""
    mine = layer_tensors(layer)
    if mine.keys() != tensors.keys():
        raise RuntimeError(
            f"Layer tensors do not match: expected {sorted(mine)}, got {sorted(tensors)} (the stages built different "
            "models; build the same model on every rank)."
        )
    with torch.no_grad():
        for name, t in mine.items():
            t.copy_(tensors[name])


class Placeholder(nn.Module):
    """Stands in for a layer that another stage owns."""

    def __init__(self, layer_idx: int, stage_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.owner_stage = stage_idx

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"Layer {self.layer_idx} of the pipeline lives on stage {self.owner_stage}, not on this process. Under "
            "DynPipeStrategy call the whole pipeline once (self.pipeline(x)) from a *_step method; single layers "
            "cannot be called during fit/validate/test/predict."
        )

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, owner_stage={self.owner_stage}"


class StageShard:
    """The layers of one stage inside the user's pipeline; the others as placeholders and ``meta`` skeletons.

    Args:
        pipeline: the user's ``nn.Sequential`` (edited in place).
        partition: layers per stage.
        stage_idx: the stage this process runs.
    """

    def __init__(self, pipeline: nn.Sequential, partition: Partition, stage_idx: int) -> None:
        self.pipeline = pipeline
        self.partition = partition
        self.stage_idx = stage_idx
        self.offloaded: dict[int, nn.Module] = {}

    @property
    def owned(self) -> list[int]:
        """Indices of the layers this stage owns, in order."""
        return list(self.partition.stage_layers(self.stage_idx))

    def partition_module(self) -> None:
        """Replaces every layer the stage does not own by a placeholder; keeps the layer on ``meta``."""
        owned = set(self.owned)
        for layer_idx in range(len(self.pipeline)):
            if layer_idx not in owned:
                self.offload(layer_idx, self.partition.stage_of_layer(layer_idx))

    def stage_module(self) -> nn.Sequential:
        """The owned layers as one module (sharing them with the pipeline), what the executor runs."""
        return nn.Sequential(*[self.pipeline[i] for i in self.owned])

    def offload(self, layer_idx: int, owner_stage: int) -> nn.Module:
        """Moves layer ``layer_idx`` out of this process (to ``meta``) and puts a placeholder in its place."""
        layer = self.pipeline[layer_idx]
        with keeping_grad_hooks(layer):  # a new Parameter per tensor: the hooks go with the names
            layer.to("meta")
        self.offloaded[layer_idx] = layer
        self.pipeline[layer_idx] = Placeholder(layer_idx, owner_stage)
        return layer

    def skeleton(self, layer_idx: int) -> nn.Module:
        """The ``meta`` skeleton of an offloaded layer (to receive its state into)."""
        return self.offloaded[layer_idx]

    def adopt(self, layer_idx: int) -> nn.Module:
        """Puts an offloaded layer back into the pipeline (its skeleton must have been materialised)."""
        layer = self.offloaded.pop(layer_idx)
        self.pipeline[layer_idx] = layer
        return layer

    def set_partition(self, partition: Partition) -> None:
        """Records a new partition after layers moved, and points the placeholders at their new owners."""
        self.partition = partition
        for i, layer in enumerate(self.pipeline):
            if isinstance(layer, Placeholder):
                layer.owner_stage = partition.stage_of_layer(i)

    def empty_state(self, layer_idx: int, device: torch.device, *, everything: bool = False) -> dict[str, Tensor]:
        """Uninitialised tensors shaped like an offloaded layer's ``state_dict`` (to receive it into); with
        ``everything``, like its :func:`layer_tensors` (non-persistent buffers included)."""
        layer = self.offloaded[layer_idx]
        shapes = layer_tensors(layer) if everything else layer.state_dict()
        return {k: torch.empty_like(v, device=device) for k, v in shapes.items()}

    def restore(self, tensors: dict[int, dict[str, Tensor]], device: torch.device) -> None:
        """Puts every offloaded layer back, materialised on ``device`` with ``tensors[layer_idx]`` (all of its
        :func:`layer_tensors`, so non-persistent buffers come back right too)."""
        for layer_idx in sorted(self.offloaded):
            layer = self.offloaded[layer_idx]
            with keeping_grad_hooks(layer):
                layer.to_empty(device=device)
            load_layer_tensors(layer, tensors[layer_idx])
            self.pipeline[layer_idx] = layer
        self.offloaded.clear()

    def placeholders(self) -> dict[int, nn.Module]:
        """The placeholders currently in the pipeline, by layer index."""
        return {i: m for i, m in enumerate(self.pipeline) if isinstance(m, Placeholder)}


@dataclass
class OptimizerSlots:
    """Where every pipeline parameter sits in each optimizer built on the whole model.

    Attributes:
        slots: per optimizer, ``(layer_idx, parameter name) -> (group index, canonical index)``.
        group_sizes: per optimizer, the number of parameters of each group in the whole model.
        canonical: per optimizer and group, the canonical index of each parameter the stage's optimizer holds
            (filled by :meth:`refilter`), in the order of the group's ``params``.
        members: per optimizer and group, every entry of the whole model's group in order: ``(layer_idx, name)``
            for a pipeline parameter (its ``Parameter`` object may be replaced while offloaded), the parameter
            itself for one outside the pipeline (frozen ones may sit in the optimizer).
    """

    slots: list[dict[tuple[int, str], tuple[int, int]]]
    group_sizes: list[list[int]]
    canonical: list[list[list[int]]]
    members: list[list[list[tuple[int, str] | nn.Parameter]]]

    @classmethod
    def record(cls, pipeline: nn.Sequential, optimizers: Sequence[Optimizer]) -> OptimizerSlots:
        """Reads the slots off optimizers built on the whole model (before any layer is offloaded)."""
        # every (layer, name) of each parameter: a parameter shared by two layers has one slot and two names
        names: dict[int, list[tuple[int, str]]] = {}
        for i in range(len(pipeline)):
            for n, p in pipeline[i].named_parameters(remove_duplicate=False):
                names.setdefault(id(p), []).append((i, n))
        slots_all, sizes_all, members_all = [], [], []
        for opt in optimizers:
            slots: dict[tuple[int, str], tuple[int, int]] = {}
            sizes, members, base = [], [], 0
            for g, group in enumerate(opt.param_groups):
                entries: list[tuple[int, str] | nn.Parameter] = []
                for j, p in enumerate(group["params"]):
                    if id(p) in names:
                        for occurrence in names[id(p)]:
                            slots[occurrence] = (g, base + j)
                        entries.append(names[id(p)][0])
                    else:
                        entries.append(p)
                sizes.append(len(group["params"]))
                members.append(entries)
                base += len(group["params"])
            slots_all.append(slots)
            sizes_all.append(sizes)
            members_all.append(members)
        return cls(slots_all, sizes_all, [], members_all)

    def holders(self, opt_idx: int, partition: Partition) -> dict[int, int]:
        """The stage that speaks for each pipeline parameter of optimizer ``opt_idx``, by canonical index (sorted).

        Every stage whose layers use a parameter holds it (a shared parameter split across stages has a copy on
        each, all equal); the lowest of those stages is the one whose copy a checkpoint writes.
        """
        out: dict[int, int] = {}
        for (layer_idx, _), (_, c) in self.slots[opt_idx].items():
            k = partition.stage_of_layer(layer_idx)
            out[c] = min(k, out.get(c, k))
        return dict(sorted(out.items()))

    def refilter(self, optimizers: Sequence[Optimizer], shard: StageShard) -> None:
        """Puts exactly the owned layers' parameters in the optimizer groups, in canonical order.

        Groups are edited in place and never removed, so LR schedulers and ``LightningOptimizer`` wrappers keep
        working; the state of parameters that left this stage is dropped (they travelled with their layer). A
        re-split refuses groups changed since the last split (:meth:`check_unchanged`): it would drop them.
        """
        if self.canonical:
            self.check_unchanged(optimizers, shard.stage_idx)
        pipeline = shard.pipeline
        self.canonical = []
        for opt, slots in zip(optimizers, self.slots):
            per_group: list[list[tuple[int, nn.Parameter]]] = [[] for _ in opt.param_groups]
            taken: set[int] = set()  # canonical indices already placed (a shared parameter of two owned layers)
            for i in shard.owned:
                for n, p in pipeline[i].named_parameters(remove_duplicate=False):
                    if (i, n) in slots and slots[(i, n)][1] not in taken:
                        g, c = slots[(i, n)]
                        per_group[g].append((c, p))
                        taken.add(c)
            canon = []
            for group, items in zip(opt.param_groups, per_group):
                items.sort(key=lambda item: item[0])
                group["params"] = [p for _, p in items]
                canon.append([c for c, _ in items])
            live = {id(q) for group in opt.param_groups for q in group["params"]}
            for stale in [q for q in opt.state if id(q) not in live]:
                del opt.state[stale]
            self.canonical.append(canon)

    def check_unchanged(self, optimizers: Sequence[Optimizer], stage_idx: int) -> None:
        """Refuses parameters added to the optimizers after the split (a new parameter group, a group that grew).

        The split happened at set-up, from the groups ``configure_optimizers`` built on the whole model; parameters
        added later exist on one stage only, and the checkpoint's optimizer state, the migrations and the other
        stages know nothing of them (a checkpoint fails on them).

        Raises:
            ConfigurationError: an optimizer whose groups' sizes differ from the split's.
        """
        for opt, canon in zip(optimizers, self.canonical):
            sizes, split = [len(g["params"]) for g in opt.param_groups], [len(c) for c in canon]
            if sizes != split:
                raise ConfigurationError(
                    f"The optimizer's parameters changed during fit: on stage {stage_idx} its groups hold {sizes} "
                    f"parameters, where the split across stages at set-up gave it {split}. Parameters added after "
                    "set-up (BaseFinetuning.unfreeze_and_add_param_group, optimizer.add_param_group) are outside the "
                    "split that checkpoints, layer moves and the other stages use. Put every parameter in the "
                    "optimizer in configure_optimizers, frozen ones too (a parameter with requires_grad=False gets "
                    "no gradient and no update, as on one device), in a group of their own if they need their own "
                    "learning rate, and unfreeze them with requires_grad_(True) (BaseFinetuning.make_trainable)."
                )

    def unfilter(self, optimizers: Sequence[Optimizer], pipeline: nn.Sequential, states: Sequence[Any]) -> None:
        r"""Gives each optimizer back every parameter of the whole model, in canonical order, with ``states``
        (plain optimizer ``state_dict``\ s), after every layer is back in ``pipeline``."""
        for opt, members, full in zip(optimizers, self.members, states):
            for group, entries in zip(opt.param_groups, members):
                group["params"] = [
                    dict(pipeline[e[0]].named_parameters(remove_duplicate=False))[e[1]] if isinstance(e, tuple) else e
                    for e in entries
                ]
            opt.load_state_dict(full)
