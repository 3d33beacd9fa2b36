"""The profile of a pipeline built on ``meta``: one materialised layer at a time, the real layers measured.

Memory is checked exactly, by reference: when a layer's copy is made, no earlier copy is alive (weak references
to its parameters are dead), so the profiling process holds one layer beyond the meta skeleton. That the times
come from the materialised layers is checked by counting the forwards each copy ran (every warm-up, timed and
memory iteration) and by comparing each copy's tensors with the eager build's layer. No duration is asserted.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator

import pytest
import torch
from torch import nn

from lightning_dynpipe.engine.materialize import materialized_copies, record_random_state
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.profiling import profile_layers

CPU = torch.device("cpu")
WARMUP, REPEATS = 1, 2


def build() -> nn.Sequential:
    # a dropout between two layers: the profile draws random numbers between two copies
    return nn.Sequential(
        nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 64), nn.LayerNorm(64), nn.BatchNorm1d(64), nn.Linear(64, 3)
    )


def _eager_and_meta() -> tuple[nn.Sequential, nn.Sequential, torch.Tensor]:
    torch.manual_seed(5)
    eager = build()
    torch.manual_seed(5)
    with record_random_state() as draws:
        meta = build()
    assert draws.state is not None
    return eager, meta, draws.state


class Tracked:
    """Wraps the copies: checks that no earlier copy is alive when the next one exists, records what ran."""

    def __init__(self, copies: Iterable[nn.Module], eager: nn.Sequential) -> None:
        self.copies, self.eager = copies, eager
        self.forwards: list[int] = []
        self.equal_to_eager: list[bool] = []
        self.earlier_alive: list[int] = []

    def __iter__(self) -> Iterator[nn.Module]:
        alive: list[weakref.ref[nn.Parameter]] = []
        for i, layer in enumerate(self.copies):
            self.earlier_alive.append(sum(r() is not None for r in alive))
            alive = [weakref.ref(p) for p in layer.parameters()]
            self.equal_to_eager.append(
                all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), self.eager[i].state_dict().values()))
            )
            self.forwards.append(0)
            layer.register_forward_hook(lambda *_, i=i: self.forwards.__setitem__(i, self.forwards[i] + 1))
            yield layer
            del layer


def test_a_meta_pipeline_is_profiled_on_one_materialised_layer_at_a_time() -> None:
    eager, meta, state = _eager_and_meta()
    sample = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    rng_before = torch.get_rng_state()
    tracked = Tracked(materialized_copies(meta, CPU, random_state=state), eager)
    profile = profile_layers(meta, sample, layer_copies=tracked, warmup=WARMUP, repeats=REPEATS)
    assert torch.equal(torch.get_rng_state(), rng_before)

    assert tracked.earlier_alive == [0] * len(meta)  # one layer in memory at a time
    assert tracked.equal_to_eager == [True] * len(meta)  # the real layers, dropout's draws notwithstanding
    assert tracked.forwards == [WARMUP + REPEATS + 1] * len(meta)  # every measured iteration ran on the copy
    assert all(t.is_meta for t in (*meta.parameters(), *meta.buffers()))  # the pipeline stays on meta

    # sizes and shapes are those of the eager model's profile, byte for byte
    ref = profile_layers(eager, sample, warmup=WARMUP, repeats=REPEATS)
    fields = ("output_shapes", "activation_bytes", "param_bytes", "grad_bytes", "optimizer_state_bytes")
    fields += ("buffer_bytes", "saved_bytes", "peak_bytes", "name")
    for a, b in zip(profile.layers, ref.layers):
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields], a.layer_idx
    assert all(s.forward_s > 0 for s in profile.layers if s.param_bytes > 0)


def test_a_meta_pipeline_without_copies_is_refused_and_wrong_copies_are_named() -> None:
    _, meta, state = _eager_and_meta()
    sample = torch.randn(6, 8)
    with pytest.raises(ConfigurationError, match=r"layers \[0, 2, 3, 4, 5\] on the meta device.*layer_copies="):
        profile_layers(meta, sample)
    too_few = list(materialized_copies(meta, CPU, random_state=state))[:3]
    with pytest.raises(ConfigurationError, match="layer_copies ran out at layer 3 of 6"):
        profile_layers(meta, sample, layer_copies=too_few, repeats=1, warmup=0)
    shuffled = list(materialized_copies(meta, CPU, random_state=state))
    shuffled[2], shuffled[5] = shuffled[5], shuffled[2]
    with pytest.raises(ConfigurationError, match=r"yielded a Linear with tensors .*for layer 2 \(Linear with"):
        profile_layers(meta, sample, layer_copies=shuffled, repeats=1, warmup=0)


def test_a_tied_parameter_is_profiled_with_its_shape_and_the_later_layers_own_values() -> None:
    def tied() -> nn.Sequential:
        emb, mid, head = nn.Embedding(6, 4), nn.Linear(4, 4), nn.Linear(4, 6, bias=False)
        head.weight = emb.weight
        return nn.Sequential(emb, mid, nn.Tanh(), head)

    torch.manual_seed(2)
    eager = tied()
    torch.manual_seed(2)
    with record_random_state() as draws:
        meta = tied()
    assert draws.state is not None
    tokens = torch.randint(0, 6, (5, 3), generator=torch.Generator().manual_seed(0))
    tracked = Tracked(materialized_copies(meta, CPU, random_state=draws.state), eager)
    profile = profile_layers(meta, tokens, layer_copies=tracked, warmup=0, repeats=1)
    # the head's copy holds its own initialisation of the shared weight (the documented exception); the rest is
    # the eager build's, and every size equals the eager profile's
    assert tracked.equal_to_eager == [True, True, True, False]
    assert tracked.earlier_alive == [0] * 4
    ref = profile_layers(eager, tokens, warmup=0, repeats=1)
    for a, b in zip(profile.layers, ref.layers):
        assert (a.output_shapes, a.activation_bytes, a.param_bytes, a.grad_bytes) == (
            b.output_shapes,
            b.activation_bytes,
            b.param_bytes,
            b.grad_bytes,
        )
