"""A pipeline built on the ``meta`` device, materialised per stage: only the layers the stage owns get memory.

Every stage replays the initialisation of the whole pipeline, one layer at a time, on the CPU and from the same
random state: a layer the stage owns is kept (and moved to its device), any other goes back to ``meta`` as soon
as it is initialised. So each stage's layers equal those of the whole pipeline materialised on one device by the
same procedure, whatever the partition, and no stage holds more than its own layers plus one layer in flight.

A layer is initialised by ``init(layer)``; the default calls ``reset_parameters()`` on the layer and every
submodule that has one, in registration order (``nn.Linear``, ``nn.Embedding``, ``nn.Conv*``, ``nn.LayerNorm``,
``nn.BatchNorm*`` ... define it). That is also what building the model eagerly draws, from the same random
state, when its layers are built in order and consume the random numbers only in those calls (a stack of
``torch.nn`` layers, for example).

Exactness is checked, not assumed: each layer is initialised twice, from memory filled with zeros and then with
ones; a tensor whose values depend on that fill (a buffer computed in ``__init__``, a parameter no
``reset_parameters`` sets) is refused with its name, since its values would otherwise be arbitrary.

The planner's profile of such a pipeline runs on :func:`materialized_copies`: a private copy of each layer, one
at a time and freed before the next, initialised by the same replay, so the profiling process holds one layer
beyond its own stage (which it materialises only after the plan) and the times are those of the real layers.

Pure torch: no process groups, no Lightning.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_dynpipe.engine.shard import keeping_grad_hooks, layer_tensors
from lightning_dynpipe.engine.ties import SharedParameter, resolve, retie
from lightning_dynpipe.errors import ConfigurationError

__all__ = [
    "reset_layer",
    "is_on_meta",
    "RandomDraws",
    "record_random_state",
    "materialize_layers",
    "materialized_copies",
]

_RANDOM_OPS = frozenset(
    {
        "uniform_",
        "normal_",
        "bernoulli_",
        "random_",
        "exponential_",
        "cauchy_",
        "geometric_",
        "log_normal_",
        "rand",
        "randn",
        "randint",
        "randperm",
        "normal",
        "bernoulli",
        "multinomial",
        "rand_like",
        "randn_like",
        "randint_like",
        "poisson",
    }
)


def reset_layer(layer: nn.Module) -> None:
    """The default initialisation: ``reset_parameters()`` of the layer and of each submodule that has one, in
    registration order."""
    for m in layer.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()


def is_on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the ``meta`` device."""
    return any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))


class RandomDraws(TorchFunctionMode):
    """Records the CPU random state at the first random draw made while it is active (``state``), and whether
    any draw used its own generator (``own_generator``), which a replay from the global state cannot follow."""

    def __init__(self) -> None:
        super().__init__()
        self.entry_state: Tensor = torch.get_rng_state()
        self.state: Tensor | None = None
        self.own_generator = False

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _RANDOM_OPS:
            if self.state is None:
                self.state = torch.get_rng_state()
            if kwargs.get("generator") is not None:
                self.own_generator = True
        return func(*args, **kwargs)


@contextmanager
def record_random_state() -> Iterator[RandomDraws]:
    """Builds modules on ``meta`` and records where their random draws would have started (see
    :class:`RandomDraws`)."""
    draws = RandomDraws()
    with torch.device("meta"), draws:
        yield draws


def _shared_names(layer: nn.Module) -> list[list[str]]:
    """Groups of names of one parameter used twice inside ``layer`` (``to_empty`` would untie them)."""
    groups: dict[int, list[str]] = {}
    for name, p in layer.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def _empty_on_cpu(layer: nn.Module, shared: list[list[str]], fill: int) -> None:
    with keeping_grad_hooks(layer):
        layer.to_empty(device="cpu")
    for names in shared:
        owner, leaf = resolve(layer, names[0])
        keep = owner._parameters[leaf]
        for other in names[1:]:
            o, lf = resolve(layer, other)
            o._parameters[lf] = keep
    with torch.no_grad():
        for t in layer_tensors(layer).values():
            t.fill_(bool(fill) if t.dtype == torch.bool else fill)


def _init_checked(layer: nn.Module, layer_idx: int, init: Callable[[nn.Module], None]) -> None:
    """Initialises ``layer`` on the CPU from the current random state (which it advances as one ``init`` does);
    refuses a tensor that ``init`` leaves partly unset."""
    shared = _shared_names(layer)
    state = torch.get_rng_state()
    _empty_on_cpu(layer, shared, 0)
    with torch.no_grad():
        init(layer)
    first = {n: t.detach().clone() for n, t in layer_tensors(layer).items()}
    torch.set_rng_state(state)
    _empty_on_cpu(layer, shared, 1)
    with torch.no_grad():
        init(layer)
    unset = [n for n, t in layer_tensors(layer).items() if not torch.equal(t, first[n])]
    if unset:
        raise ConfigurationError(
            f"Layer {layer_idx} of the pipeline ({type(layer).__name__}) was built on the meta device, and its "
            f"initialisation leaves {unset} (partly) unset, so their values would be arbitrary. Give the submodules "
            "holding them a reset_parameters() that sets every parameter and buffer (torch.nn's layers have one; "
            "a buffer computed in __init__, such as a causal mask, needs one too), or build the model without "
            "empty_init / the meta device."
        )


def materialize_layers(
    pipeline: nn.Sequential,
    owned: Collection[int],
    device: torch.device,
    *,
    random_state: Tensor,
    ties: Sequence[SharedParameter] = (),
    init: Callable[[nn.Module], None] = reset_layer,
) -> None:
    """Materialises the ``owned`` layers of a pipeline built on ``meta``, as the whole pipeline would be.

    Every layer is initialised in order on the CPU from ``random_state`` (the global random state is left as it
    was); the owned ones are moved to ``device``, the others go back to ``meta``. A parameter shared by several
    layers takes the value of its first layer's initialisation (as assigning ``head.weight = emb.weight`` after
    building both does), also on a stage that owns only a later one; owned layers that share it are tied again.

    Raises:
        ConfigurationError: a layer whose initialisation leaves a tensor unset (see :func:`_init_checked`).
    """
    owned_set = set(owned)
    kept: dict[int, Tensor] = {}  # tie index -> the first occurrence's value, while a later owned layer needs it
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(random_state)
        for i in range(len(pipeline)):
            layer = pipeline[i]
            _init_checked(layer, i, init)
            for t_idx, tie in enumerate(ties):
                first_layer, first_name = tie.occurrences[0]
                later_owned = any(j in owned_set for j, _ in tie.occurrences[1:] if j != first_layer)
                if first_layer == i and later_owned:
                    owner, leaf = resolve(layer, first_name)
                    kept[t_idx] = owner._parameters[leaf].detach().clone()  # type: ignore[union-attr]
                if i in owned_set and first_layer != i:
                    for j, name in tie.occurrences[1:]:
                        if j == i:
                            owner, leaf = resolve(layer, name)
                            with torch.no_grad():
                                owner._parameters[leaf].copy_(kept[t_idx])  # type: ignore[union-attr]
            with keeping_grad_hooks(layer):
                layer.to(device if i in owned_set else torch.device("meta"))
    retie(pipeline, ties, owned_set)


def materialized_copies(
    pipeline: nn.Sequential,
    device: torch.device,
    *,
    random_state: Tensor,
    init: Callable[[nn.Module], None] = reset_layer,
) -> Iterator[nn.Module]:
    """Yields a private, materialised copy of each layer of a pipeline built on ``meta``, in order, one at a time.

    Each copy is initialised on the CPU by the replay :func:`materialize_layers` runs (from ``random_state``, layer
    after layer), then moved to ``device``: layer ``i``'s copy holds the values the stage that owns layer ``i``
    gets. One exception: a parameter shared with an earlier layer (a tied head) holds this layer's own
    initialisation, with the right shape and dtype, not the earlier layer's value. The generator drops its
    reference to a copy before it builds the next one, so a caller that does the same (the profiler does) holds
    at most one layer. The pipeline is left on ``meta``, and the global random state is left as it was, also
    between two copies (the caller may draw random numbers, e.g. dropout while the copy is profiled).

    Initialisation is not checked here (each copy is initialised once); :func:`materialize_layers` refuses a
    layer whose initialisation leaves a tensor unset before any training.

    Example::

        with record_random_state() as draws:
            pipeline = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096))
        for layer in materialized_copies(pipeline, torch.device("cpu"), random_state=draws.state):
            ...  # time it; drop it before the next iteration
    """
    state = random_state
    for i in range(len(pipeline)):
        layer = copy.deepcopy(pipeline[i])  # on meta: shapes only
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(state)
            _empty_on_cpu(layer, _shared_names(layer), 0)
            with torch.no_grad():
                init(layer)
            state = torch.get_rng_state()
        yield layer.to(device)
        del layer
