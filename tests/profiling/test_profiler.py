"""profile_layers: exact byte counts, tuple outputs, the model left untouched, a heavy layer found, errors.

Timing is only compared between layers whose costs differ by two orders of magnitude; nothing else
asserts on a duration (the suite runs on shared, loaded CPUs).
"""

from __future__ import annotations

import ast
import doctest
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import lightning_dynpipe.profiling.layers
from lightning_dynpipe.errors import ConfigurationError
from lightning_dynpipe.plan.costs import LayerCost, ModelCost
from lightning_dynpipe.profiling import LayerProfile, optimizer_state_factor, profile_layers

F32 = 4


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Single-threaded kernels: on a shared 2-core machine a second OpenMP thread mostly waits for a core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _linear_stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_linear_layers_bytes_are_exact() -> None:
    profile = profile_layers(_linear_stack(), torch.randn(3, 8), warmup=0, repeats=1)
    assert isinstance(profile, LayerProfile) and profile.num_layers == 3
    assert profile.device == "cpu" and not profile.peak_measured
    assert [s.layer_idx for s in profile.layers] == [0, 1, 2]
    assert [s.name for s in profile.layers] == ["Linear", "ReLU", "Linear"]
    assert [s.output_shapes for s in profile.layers] == [((3, 16),), ((3, 16),), ((3, 4),)]
    assert [s.activation_bytes for s in profile.layers] == [3 * 16 * F32, 3 * 16 * F32, 3 * 4 * F32]
    params = [(8 * 16 + 16) * F32, 0, (16 * 4 + 4) * F32]
    assert [s.param_bytes for s in profile.layers] == params
    assert [s.grad_bytes for s in profile.layers] == params
    assert [s.optimizer_state_bytes for s in profile.layers] == [2 * p for p in params]  # Adam by default
    assert [s.buffer_bytes for s in profile.layers] == [0, 0, 0]
    relu = profile.layers[1]
    assert relu.saved_bytes == relu.peak_bytes == 3 * 16 * F32  # ReLU keeps its output for the backward
    assert all(s.forward_s > 0 and s.backward_s > 0 for s in profile.layers)


def test_to_model_cost_maps_every_field() -> None:
    profile = profile_layers(
        _linear_stack(), torch.randn(3, 8), warmup=0, repeats=1, optimizer_state_bytes_per_param_byte=1.0
    )
    model = profile.to_model_cost()
    assert isinstance(model, ModelCost) and model.num_layers == 3
    first = model.layers[0]
    assert first == LayerCost(
        forward_s=profile.layers[0].forward_s,
        backward_s=profile.layers[0].backward_s,
        activation_bytes=3 * 16 * F32,
        param_bytes=(8 * 16 + 16) * F32,
        optimizer_state_bytes=2 * (8 * 16 + 16) * F32,  # gradient + SGD momentum
        workspace_bytes=profile.layers[0].workspace_bytes,
        held_bytes=3 * 16 * F32,  # its output: Linear saves only its input and weight
    )
    assert model.compute_s(0, 3) == pytest.approx(profile.total_compute_s)
    assert model.param_bytes(0, 3) == sum(s.param_bytes for s in profile.layers)


def test_dtype_sets_the_byte_counts() -> None:
    layers = nn.Sequential(nn.Linear(8, 16)).double()
    (stats,) = profile_layers(layers, torch.randn(5, 8, dtype=torch.float64), warmup=0, repeats=1).layers
    assert stats.activation_bytes == 5 * 16 * 8 and stats.param_bytes == (8 * 16 + 16) * 8


class _Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.proj(x)
        return h[:, :2].relu(), h.tanh()


class _Join(nn.Module):
    def forward(self, xs: tuple[Tensor, Tensor]) -> Tensor:
        a, b = xs
        return torch.cat([a, b], dim=1) * 2


def test_tuple_outputs_are_summed_and_feed_the_next_layer() -> None:
    torch.manual_seed(0)
    profile = profile_layers(nn.Sequential(_Split(), _Join(), nn.Linear(8, 3)), torch.randn(4, 6), warmup=1, repeats=2)
    split, join, head = profile.layers
    assert split.output_shapes == ((4, 2), (4, 6))
    assert split.activation_bytes == (4 * 2 + 4 * 6) * F32
    assert join.output_shapes == ((4, 8),) and join.param_bytes == 0
    assert join.backward_s > 0  # both tuple members got a gradient path back
    assert head.output_shapes == ((4, 3),)


def test_model_parameters_grads_buffers_mode_and_rng_are_unchanged() -> None:
    torch.manual_seed(0)
    frozen_linear, head = nn.Linear(16, 16), nn.Linear(16, 2)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()),
        nn.Dropout(0.5),
        nn.Sequential(frozen_linear, nn.ReLU()),
        head,
    )
    frozen_linear.weight.requires_grad_(False)  # a frozen parameter stays frozen and gets no state
    head.weight.grad = torch.full_like(head.weight, 0.5)  # an existing gradient is kept as is
    model.eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    x = torch.randn(6, 8)
    rng = torch.get_rng_state()

    profile = profile_layers(model, x, warmup=1, repeats=2)

    assert torch.equal(torch.get_rng_state(), rng)
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads.pop("3.weight") is not None and torch.equal(head.weight.grad, torch.full((2, 16), 0.5))
    assert all(g is None for g in grads.values())
    assert not any(m.training for m in model.modules())
    frozen = profile.layers[2]
    assert frozen.param_bytes == (16 * 16 + 16) * F32 and frozen.grad_bytes == 16 * F32
    assert frozen.optimizer_state_bytes == 2 * 16 * F32


def test_batch_norm_running_stats_are_unchanged_and_counted() -> None:
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4)
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), bn, nn.ReLU()),
        nn.Sequential(nn.Flatten(), nn.Linear(4 * 5 * 5, 3)),
    )
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    profile = profile_layers(model, torch.randn(2, 3, 5, 5), warmup=2, repeats=3)
    after = bn.state_dict()
    assert sorted(before) == ["bias", "num_batches_tracked", "running_mean", "running_var", "weight"]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert int(after["num_batches_tracked"]) == 0
    assert profile.layers[0].buffer_bytes == 2 * 4 * F32 + 8  # running mean/var + int64 counter
    assert profile.layers[0].output_shapes == ((2, 4, 5, 5),)
    cost = profile.to_model_cost().layers[0]
    assert cost.optimizer_state_bytes == 3 * profile.layers[0].param_bytes + profile.layers[0].buffer_bytes


def test_heavy_layer_is_measured_much_slower_than_light_layers() -> None:
    torch.manual_seed(0)
    light = 64
    heavy = nn.Sequential(nn.Linear(light, 4096), nn.ReLU(), nn.Linear(4096, light))  # ~128x the MACs
    model = nn.Sequential(nn.Linear(light, light), nn.ReLU(), heavy, nn.Linear(light, light))
    profile = profile_layers(model, torch.randn(64, light), warmup=2, repeats=5)
    times = [s.compute_s for s in profile.layers]
    slowest_light = max(times[0], times[1], times[3])
    # medians on ~2 orders of magnitude of work; a factor 5 leaves a wide margin for a loaded machine
    assert times[2] > 5 * slowest_light, profile.table()
    assert profile.layers[2].forward_s > 5 * max(profile.layers[i].forward_s for i in (0, 1, 3)), profile.table()
    assert profile.layers[2].backward_s > 5 * max(profile.layers[i].backward_s for i in (0, 1, 3)), profile.table()


def test_updates_are_timed_with_a_new_optimizer_of_the_runs_class_and_the_run_optimizer_is_untouched() -> None:
    """With the run's optimizer, what each layer adds to an update is timed on the copy's parameters: AdamW on 1,179,648
    parameters against 72 (four orders of magnitude of work, so that an update's fixed cost on a loaded machine cannot
    hide the difference: with 294,912 parameters a CI run measured 0.56 ms against 0.11 ms); a parameter-free layer adds
    nothing. The run's optimizer gains no state and the model keeps its weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1 << 17))
    before = [p.detach().clone() for p in model.parameters()]
    # AdamW: its defaults name `decoupled_weight_decay`, which only Adam's constructor takes
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    profile = profile_layers(model, torch.randn(4, 8), warmup=1, repeats=5, optimizer=optimizer)
    small, relu, table = (s.update_s for s in profile.layers)
    assert relu == 0.0 and small >= 0.0
    assert table > 0.0 and table > 5 * small, profile.table()
    assert profile.to_model_cost().update_s(0, 3) == pytest.approx(small + table)
    assert "upd ms" in profile.table()
    assert optimizer.state_dict()["state"] == {}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    # without an optimizer nothing is timed: the cost model counts updates as free, as before
    assert all(s.update_s == 0.0 for s in profile_layers(model, torch.randn(4, 8), warmup=0, repeats=1).layers)


def test_an_optimizer_that_cannot_be_rebuilt_from_its_defaults_warns_and_times_nothing() -> None:
    class Custom(torch.optim.SGD):
        def __init__(self, params: object, scale: float) -> None:  # its defaults do not name `scale`
            super().__init__(params, lr=0.1 * scale)  # type: ignore[arg-type]

    model = _linear_stack()
    with pytest.warns(UserWarning, match=r"does not time optimizer updates: a new Custom\(params"):
        profile = profile_layers(model, torch.randn(3, 8), warmup=0, repeats=1, optimizer=Custom(model.parameters(), 2))
    assert all(s.update_s == 0.0 for s in profile.layers)


def test_runs_under_no_grad_and_with_integer_inputs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(5 * 8, 2))
    tokens = torch.randint(0, 50, (3, 5))
    with torch.no_grad():
        profile = profile_layers(model, tokens, warmup=0, repeats=1)
    assert [s.output_shapes for s in profile.layers] == [((3, 5, 8),), ((3, 40),), ((3, 2),)]
    assert profile.layers[0].backward_s > 0  # the embedding's weight gradient
    assert profile.layers[1].saved_bytes == 0  # Flatten is a view of its input: nothing new is held
    assert profile.layers[1].peak_bytes == 0


def test_layer_without_differentiable_output_has_zero_backward() -> None:
    class ArgMax(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x.argmax(dim=1)

    profile = profile_layers(nn.Sequential(nn.Linear(4, 3), ArgMax()), torch.randn(2, 4), warmup=0, repeats=2)
    assert profile.layers[1].backward_s == 0.0
    assert profile.layers[1].activation_bytes == 2 * 8 and profile.layers[1].peak_bytes == 2 * 8


def test_a_borrowed_weight_gets_no_gradient_written() -> None:
    class Borrow(nn.Module):  # uses another module's weight without registering it (a tied head, say)
        def __init__(self, weight: Tensor) -> None:
            super().__init__()
            self.__dict__["borrowed"] = weight

        def forward(self, x: Tensor) -> Tensor:
            weight: Tensor = self.__dict__["borrowed"]
            return x @ weight.t()

    source = nn.Linear(4, 3)
    profile = profile_layers(nn.Sequential(Borrow(source.weight)), torch.randn(2, 4), warmup=0, repeats=1)
    assert source.weight.grad is None
    assert profile.layers[0].backward_s == 0.0 and profile.layers[0].output_shapes == ((2, 3),)


def test_table_has_one_row_per_layer_and_a_total() -> None:
    profile = profile_layers(_linear_stack(), torch.randn(3, 8), warmup=0, repeats=1)
    lines = profile.table().splitlines()
    assert len(lines) == 3 + profile.num_layers + 2  # title, header, rule, rows, rule, total
    assert lines[0].startswith("Layer profile on cpu: median of 1 after 0 warm-up")
    assert "estimated" in lines[0]
    assert lines[1].split()[:4] == ["idx", "layer", "fwd", "ms"]
    assert lines[3].split()[:2] == ["0", "Linear"] and lines[-1].split()[0] == "total"
    assert "3x16" in lines[3] and "576 B" in lines[3]


@pytest.mark.parametrize(
    ("make", "factor"),
    [
        (lambda p: torch.optim.Adam(p), 2.0),
        (lambda p: torch.optim.AdamW(p, amsgrad=True), 3.0),
        (lambda p: torch.optim.SGD(p, lr=0.1), 0.0),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1.0),
        (lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True), 3.0),
        (lambda p: torch.optim.Adagrad(p), 1.0),
    ],
)
def test_optimizer_state_factor_by_type(make: object, factor: float) -> None:
    params = [nn.Parameter(torch.zeros(4, 3))]
    optimizer = make(params)  # type: ignore[operator]
    assert optimizer_state_factor(optimizer) == factor


@pytest.mark.parametrize(
    ("make", "factor"),
    [
        (lambda p: torch.optim.Adam(p), 2.0),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1.0),
        (lambda p: torch.optim.AdamW(p, amsgrad=True), 3.0),
    ],
)
def test_optimizer_state_factor_is_measured_after_a_step(make: object, factor: float) -> None:
    layer = nn.Linear(3, 1)  # a one-element bias: its state counts, only 0-dim counters do not
    optimizer = make(layer.parameters())  # type: ignore[operator]
    layer(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    assert optimizer.state  # the measured path, not the table
    assert optimizer_state_factor(optimizer) == factor


def test_optimizer_state_factor_refuses_an_unknown_fresh_optimizer() -> None:
    class Mine(torch.optim.Optimizer):
        def __init__(self, params: object) -> None:
            super().__init__(params, {})  # type: ignore[arg-type]

    with pytest.raises(ConfigurationError, match=r"does not know Mine.*optimizer_state_bytes_per_param_byte"):
        optimizer_state_factor(Mine([nn.Parameter(torch.zeros(2))]))


def test_errors_state_the_rule_and_the_fix() -> None:
    x = torch.randn(3, 8)
    with pytest.raises(ConfigurationError, match="nn.Sequential"):
        profile_layers([nn.Linear(8, 2)], x)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="empty nn.Sequential"):
        profile_layers(nn.Sequential(), x)
    with pytest.raises(ConfigurationError, match="repeats an int >= 1"):
        profile_layers(_linear_stack(), x, repeats=0)
    with pytest.raises(ConfigurationError, match="warmup must be an int >= 0"):
        profile_layers(_linear_stack(), x, warmup=-1)
    with pytest.raises(ConfigurationError, match="optimizer_state_bytes_per_param_byte must be finite"):
        profile_layers(_linear_stack(), x, optimizer_state_bytes_per_param_byte=-1)
    bad = nn.Sequential(nn.Linear(8, 16), nn.Linear(7, 2))
    with pytest.raises(
        ConfigurationError, match=r"layer 1 \(Linear\) failed on an input with tensor shapes \[\(3, 16\)\]"
    ):
        profile_layers(bad, x, warmup=0, repeats=1)


def test_demo_models_profile_with_their_example_input() -> None:
    from lightning_dynpipe.demos import CNN, MLP

    for model in (MLP(in_features=64, width=32, depth=2), CNN(image_size=8, channels=4, hidden=16)):
        profile = profile_layers(model.pipeline, model.example_input(4), warmup=0, repeats=1)
        assert profile.num_layers == model.num_layers
        assert profile.layers[-1].output_shapes == ((4, 10),)
        assert sum(s.param_bytes for s in profile.layers) == sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_memory_is_measured() -> None:
    model = _linear_stack().cuda()
    params = {k: v.clone() for k, v in model.state_dict().items()}
    profile = profile_layers(model, torch.randn(256, 8, device="cuda"), warmup=1, repeats=3)
    assert profile.peak_measured and profile.device.startswith("cuda")
    assert all(s.peak_bytes >= s.activation_bytes > 0 for s in profile.layers)
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    cpu_model = _linear_stack()
    moved = profile_layers(cpu_model, torch.randn(256, 8), device=torch.device("cuda"), warmup=0, repeats=1)
    assert moved.device.startswith("cuda") and next(cpu_model.parameters()).device.type == "cpu"


def test_docstring_examples() -> None:
    result = doctest.testmod(lightning_dynpipe.profiling.layers, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_profiling_imports_neither_lightning_nor_torch_distributed() -> None:
    """profiling/ is torch only (it runs before any process group exists); of the engine it shares only the
    micro-batch helpers."""
    package = Path(lightning_dynpipe.profiling.layers.__file__).parent
    forbidden = (
        "lightning",
        "pytorch_lightning",
        "torch.distributed",
        "lightning_dynpipe.engine",
        "lightning_dynpipe.strategy",
        "sklearn",
    )
    bad = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            )
            bad += [
                f"{path.name}: {n}"
                for n in names
                if any(n == f or n.startswith(f + ".") for f in forbidden)
                and n != "lightning_dynpipe.engine.microbatch"
            ]
    assert not bad


class _AddPair(nn.Module):
    def forward(self, xy: tuple[Tensor, Tensor]) -> Tensor:
        return xy[0] + xy[1]


def test_constant_sample_input_warns() -> None:
    layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    pairs = nn.Sequential(_AddPair(), nn.Linear(4, 8))
    with pytest.warns(UserWarning, match="constant .*Profile on a real micro-batch, or on torch.randn"):
        profile_layers(layers, torch.zeros(3, 4), warmup=0, repeats=1)
    with pytest.warns(UserWarning, match="constant"):
        profile_layers(pairs, (torch.full((3, 4), 0.5), torch.ones(3, 4)), warmup=0, repeats=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        profile_layers(layers, torch.randn(3, 4), warmup=0, repeats=1)
        profile_layers(pairs, (torch.zeros(3, 4), torch.randn(3, 4)), warmup=0, repeats=1)  # one varies
        embed = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
        profile_layers(embed, torch.zeros(3, 5, dtype=torch.long), warmup=0, repeats=1)  # token ids: not checked


def test_a_transformer_micro_batch_keeps_what_the_held_bytes_say() -> None:
    """What one micro-batch keeps for the backward of a nanoGPT-style model (dropout on) is the sum of the
    profile's ``held_bytes`` less the last output (nothing inside the pipeline saves it), exactly; the outputs
    alone (``activation_bytes``) count less than a tenth of it."""
    from lightning_dynpipe.demos import CharGPT

    torch.manual_seed(0)
    model = CharGPT(block_size=64, d_model=128, n_layers=2, dropout=0.1)
    x = torch.randint(0, 256, (8, 64))
    cost = profile_layers(model.pipeline, x, warmup=0, repeats=1).to_model_cost()
    skip = {t.untyped_storage().data_ptr() for t in (x, *model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.pipeline(x)
    kept = sum(saved.values())
    assert int(cost.kept_prefix[-1]) == kept + out.untyped_storage().nbytes()
    assert int(cost.activation_prefix[-1]) < kept / 10
