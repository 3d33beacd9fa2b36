"""Parameters shared by layers (tied weights, e.g. GPT-2's embedding and output head).

One ``Parameter`` object used by two layers is one logical parameter: plain training sums both uses' gradients
into it and updates it once. When the two layers sit on different stages, each of those stages holds a copy.
The copies start identical (every rank builds the same model), and under a schedule that accumulates a step's
gradients (``"sync"``, ``"gpipe"``) they stay identical: before each update the owners' gradients are summed
(:func:`sum_shared_gradients`), and every owner applies the same update with the same optimizer state. The
checkpoint holds the parameter once (every key of it refers to one tensor), the model summary counts it once,
and the module handed back after a run has the two layers tied again (:func:`retie`).

Example::

    >>> from torch import nn
    >>> emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    >>> head.weight = emb.weight
    >>> [t.occurrences for t in shared_parameters(nn.Sequential(emb, nn.ReLU(), head))]
    [((0, 'weight'), (2, 'weight'))]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_dynpipe.engine.collectives import Collectives
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.partition import Partition

__all__ = [
    "SharedParameter",
    "shared_parameters",
    "split_ties",
    "retie",
    "sum_shared_gradients",
    "copies_counted_elsewhere",
    "resolve",
]


@dataclass(frozen=True)
class SharedParameter:
    """One parameter used by several layers of the pipeline.

    Attributes:
        occurrences: every ``(layer_idx, qualified name in the layer)`` that refers to it, in layer order.
        shape: its shape.
        dtype: its dtype.
    """

    occurrences: tuple[tuple[int, str], ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers that use it."""
        return tuple(sorted({i for i, _ in self.occurrences}))

    def stages(self, partition: Partition) -> tuple[int, ...]:
        """The stages that hold a copy of it under ``partition``."""
        return tuple(sorted({partition.stage_of_layer(i) for i in self.layers}))

    def describe(self, pipeline_attr: str = "pipeline") -> str:
        """Its keys, e.g. ``pipeline.0.tok.weight = pipeline.4.out.weight``."""
        return " = ".join(f"{pipeline_attr}.{i}.{n}" for i, n in self.occurrences)


def shared_parameters(pipeline: nn.Sequential) -> list[SharedParameter]:
    """The parameters used by more than one layer of ``pipeline`` (a parameter shared inside one layer is
    that layer's business and is not listed)."""
    found: dict[int, list[tuple[int, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for i, layer in enumerate(pipeline):
        for name, p in layer.named_parameters(remove_duplicate=False):
            found.setdefault(id(p), []).append((i, name))
            params[id(p)] = p
    out = []
    for key, occ in found.items():
        if len({i for i, _ in occ}) > 1:
            p = params[key]
            out.append(SharedParameter(tuple(occ), tuple(p.shape), p.dtype))
    return sorted(out, key=lambda t: t.occurrences)


def split_ties(ties: Iterable[SharedParameter], partition: Partition) -> list[SharedParameter]:
    """The shared parameters whose layers ``partition`` puts on different stages."""
    return [t for t in ties if len(t.stages(partition)) > 1]


def resolve(module: nn.Module, qualified: str) -> tuple[nn.Module, str]:
    """The submodule that owns ``qualified`` (``"out.weight"`` -> ``(module.out, "weight")``)."""
    *path, leaf = qualified.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    return owner, leaf


def retie(pipeline: nn.Sequential, ties: Iterable[SharedParameter], layers: Iterable[int]) -> None:
    """Makes every occurrence of each shared parameter among ``layers`` refer to one ``Parameter`` object.

    The object kept is the first occurrence's (the caller makes sure the values agree); layers that were
    materialised separately (moved here, or put back at the end of a run) become tied again.
    """
    present = set(layers)
    for tie in ties:
        mine = [(i, n) for i, n in tie.occurrences if i in present]
        if len(mine) < 2:
            continue
        owner, leaf = resolve(pipeline[mine[0][0]], mine[0][1])
        keep = owner._parameters[leaf]
        for i, n in mine[1:]:
            other, other_leaf = resolve(pipeline[i], n)
            other._parameters[other_leaf] = keep


def copies_counted_elsewhere(
    pipeline: nn.Sequential,
    ties: Sequence[SharedParameter],
    owned: Iterable[int],
    partition: Partition,
    stage_idx: int,
) -> set[int]:
    """The ids of stage ``stage_idx``'s copies of the shared parameters ``ties`` that an earlier stage also holds.

    A norm over the whole pipeline's gradient counts each shared parameter once (its copies hold the same summed
    gradient after :func:`sum_shared_gradients`): on the first stage that holds it.
    """
    owned_set = set(owned)
    out: set[int] = set()
    for tie in ties:
        if tie.stages(partition)[0] == stage_idx:
            continue
        for i, name in tie.occurrences:
            if i in owned_set:
                owner, leaf = resolve(pipeline[i], name)
                out.add(id(owner._parameters[leaf]))
    return out


def sum_shared_gradients(
    pipeline: nn.Sequential, ties: Sequence[SharedParameter], owned: Iterable[int], coll: Collectives
) -> None:
    """Sums the gradients of the shared parameters over the stages of one pipeline (collective over it).

    Every stage calls it with the same ``ties`` (those split across stages): a stage that holds a copy
    contributes its gradient (zeros without one), one that holds none contributes zeros and ignores the result.
    Afterwards every copy's ``.grad`` is the gradient plain training would have.

    Raises:
        ConfigurationError: a copy has a gradient hook (``register_hook``, ``register_post_accumulate_grad_hook``).
            Plain training runs it once on the sum of both uses' gradients; here each stage's copy would run it on
            its own part of that sum, which differs for any hook that is not linear (a clamp, a norm).
    """
    if not ties:
        return
    owned_set = set(owned)
    local: list[nn.Parameter | None] = []
    parts: list[Tensor] = []
    for tie in ties:
        here = [(i, n) for i, n in tie.occurrences if i in owned_set]
        p = None
        if here:
            owner, leaf = resolve(pipeline[here[0][0]], here[0][1])
            p = owner._parameters[leaf]
            if p is not None and (p._backward_hooks or p._post_accumulate_grad_hooks):
                raise ConfigurationError(
                    f"The tied parameter {tie.describe()} is used by layers on different stages and has a gradient "
                    "hook (register_hook or register_post_accumulate_grad_hook). Plain training runs the hook once on "
                    "the sum of both uses' gradients; here each stage holds a copy and would run it on its own part "
                    "before the sum. Remove the hook (for clipping, use Trainer(gradient_clip_val=...)), or choose a "
                    "balance that puts every layer using the parameter on one stage."
                )
        local.append(p)
        grad = p.grad if p is not None and p.grad is not None else None
        parts.append(grad.reshape(-1) if grad is not None else torch.zeros(_numel(tie.shape), dtype=tie.dtype))
    device = next((p.device for p in local if p is not None), torch.device("cpu"))
    flat = torch.cat([t.to(device) for t in parts])
    coll.all_reduce_sum(flat)
    offset = 0
    for tie, p in zip(ties, local):
        n = _numel(tie.shape)
        if p is not None:
            total = flat[offset : offset + n].view(tie.shape).to(p.dtype)
            if p.grad is None:
                p.grad = total.clone()
            else:
                p.grad.copy_(total)
        offset += n


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
