"""Out-of-place optimizer updates: bit for bit ``optimizer.step()``, and ``None`` wherever that is not certain."""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from lightning_dynpipe.engine.outofplace import direct_step, out_of_place_step, private_grad, stash_aware_step
from lightning_dynpipe.engine.stash import WeightStash

_SGD_CONFIGS = [
    dict(momentum=m, dampening=d, nesterov=n, weight_decay=wd, maximize=mx)
    for m, d, n, wd, mx in itertools.product([0.0, 0.9], [0.0, 0.3], [False, True], [0.0, 0.01], [False, True])
    if not (n and (m == 0 or d != 0))  # torch refuses Nesterov without momentum or with dampening
]


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 3, bias=False)).to(dtype)


def _set_grads(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for i, p in enumerate(model.parameters()):
        # the last layer gets no gradient every other step: SGD then skips it
        p.grad = None if (i == 4 and step % 2) else torch.randn(p.shape, generator=g).to(p.dtype)


def _reproduction(opt: torch.optim.Optimizer, in_place: bool) -> Any:
    step = direct_step(opt) if in_place else out_of_place_step(opt)
    assert step is not None and step != opt.step
    return step


Before = list[tuple[torch.Tensor, torch.Tensor, int, "int | None"]]


def _before(model: nn.Module) -> Before:
    """Each parameter's memory, values, version counter and its gradient's address, before a step."""
    return [
        (p.data, p.data.clone(), p._version, None if p.grad is None else p.grad.data_ptr()) for p in model.parameters()
    ]


def _check_storage(opt: torch.optim.Optimizer, model: nn.Module, old: Before, in_place: bool) -> None:
    """Fresh storage leaves the old memory as it was; in place writes it and bumps the version counter, as
    ``step()`` does (autograd's check that a saved tensor was not modified relies on it). Out of place, the new
    weights went into the gradient's memory (nothing else held these gradients), and the gradient is gone."""
    updated = {id(p) for g in opt.param_groups for p in g["params"]}
    for p, (storage, values, version, grad_ptr) in zip(model.parameters(), old):
        if grad_ptr is None or id(p) not in updated:
            assert p.data_ptr() == storage.data_ptr() and torch.equal(p.data, values)
        elif in_place:
            assert p.data_ptr() == storage.data_ptr() and p._version > version
        else:
            assert p.data_ptr() != storage.data_ptr() and torch.equal(storage, values)
            assert p.data_ptr() == grad_ptr and p.grad is None


@pytest.mark.parametrize("in_place", [False, True], ids=["fresh", "in_place"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", _SGD_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_sgd_reproductions_equal_step_bit_for_bit(config: dict, dtype: torch.dtype, in_place: bool) -> None:
    ours, theirs = _model(dtype), _model(dtype)
    layers = list(ours.children()), list(theirs.children())
    opts = [
        torch.optim.SGD([{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 0.05}], lr=0.1, **config)
        for m in layers
    ]  # two groups, two learning rates
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in opts]
    for o in opts:  # the third layer's parameters in a group of their own
        o.add_param_group({"params": list(layers[opts.index(o)][3].parameters()), "lr": 0.2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scheduler would warn if it thought step() had not run
        for step in range(6):
            _set_grads(ours, step)
            _set_grads(theirs, step)
            old = _before(ours)
            _reproduction(opts[0], in_place)()
            opts[1].step()
            for s in scheds:
                s.step()
            for p, q in zip(ours.parameters(), theirs.parameters()):
                assert torch.equal(p, q)
            _check_storage(opts[0], ours, old, in_place)
    for o_ours, o_theirs in zip(opts[0].state.values(), opts[1].state.values()):
        for key in o_theirs:
            assert torch.equal(o_ours[key], o_theirs[key])


_ADAM_CONFIGS = [
    (cls, dict(weight_decay=wd, amsgrad=ams, maximize=mx))
    for cls, wd, ams, mx in itertools.product(
        [torch.optim.Adam, torch.optim.AdamW], [0.0, 0.05], [False, True], [False, True]
    )
]


@pytest.mark.parametrize("in_place", [False, True], ids=["fresh", "in_place"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("cls", "config"), _ADAM_CONFIGS, ids=lambda c: c.__name__ if isinstance(c, type) else f"{c}".replace(" ", "")
)
def test_adam_reproductions_equal_step_bit_for_bit(cls: type, config: dict, dtype: torch.dtype, in_place: bool) -> None:
    ours, theirs = _model(dtype), _model(dtype)
    groups = [
        [{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 3e-3}]
        for m in (list(ours.children()), list(theirs.children()))
    ]  # two groups, two learning rates
    opts = [cls(g, lr=1e-2, betas=(0.8, 0.99), **config) for g in groups]
    for step in range(6):
        _set_grads(ours, step)
        _set_grads(theirs, step)
        old = _before(ours)
        _reproduction(opts[0], in_place)()
        opts[1].step()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(p, q)
        _check_storage(opts[0], ours, old, in_place)
    for s_ours, s_theirs in zip(opts[0].state.values(), opts[1].state.values()):
        assert list(s_ours) == list(s_theirs)
        for key in s_theirs:
            assert torch.equal(s_ours[key], s_theirs[key])


def test_unsupported_optimizers_get_none(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(torch.float32)
    params = list(model.parameters())
    _set_grads(model, 0)

    class MySGD(torch.optim.SGD):
        pass

    refused = [
        torch.optim.RMSprop(params),  # not reproduced here
        torch.optim.Adam(params, capturable=True),
        torch.optim.AdamW(params, foreach=True),
        MySGD(params, lr=0.1),  # a subclass may change step
        torch.optim.SGD(params, lr=0.1, foreach=True),  # another implementation
        torch.optim.SGD(params, lr=torch.tensor(0.1)),  # tensor hyper-parameters
        torch.optim.SGD(params, lr=0.1, differentiable=True),
    ]
    for opt in refused:
        assert out_of_place_step(opt) is None, opt
        assert direct_step(opt) == opt.step, opt  # the optimizer's own step, wrapper and all

    hooked = torch.optim.SGD(params, lr=0.1)
    handle = hooked.register_step_pre_hook(lambda *a: None)
    assert out_of_place_step(hooked) is None
    assert direct_step(hooked) == hooked.step  # the hook runs
    handle.remove()
    assert direct_step(hooked) != hooked.step
    with torch.autograd.profiler.profile():  # a profiler records the step's range: the real step keeps it
        assert direct_step(hooked) == hooked.step
    assert out_of_place_step(hooked) is not None

    handle = register_optimizer_step_post_hook(lambda *a: None)
    try:
        assert out_of_place_step(hooked) is None  # a global hook sees every optimizer
    finally:
        handle.remove()

    patched = torch.optim.SGD(params, lr=0.1)
    patched.step = lambda closure=None: None  # type: ignore[method-assign]
    assert out_of_place_step(patched) is None

    from lightning_dynpipe.engine import outofplace

    monkeypatch.setattr(outofplace, "_TORCH", (2, 99))  # a torch the reproduction was not checked against
    assert out_of_place_step(torch.optim.SGD(params, lr=0.1)) is None
    monkeypatch.undo()

    cplx = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    cplx.grad = torch.randn(3, dtype=torch.complex64)
    assert out_of_place_step(torch.optim.Adam([cplx])) is None

    emb = nn.Embedding(5, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    assert out_of_place_step(torch.optim.SGD(emb.parameters(), lr=0.1)) is None


def test_stash_aware_step_copies_or_writes_fresh_storage() -> None:
    layer = nn.Linear(3, 2)
    stash = WeightStash(layer)
    v = stash.acquire()  # a micro-batch in flight uses the live weights
    before = copy.deepcopy(stash.params(v))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)

    plain = stash_aware_step(opt, None, user_code_first=False)  # nothing stashed: the step in place
    assert plain != opt.step and plain.__qualname__ == direct_step(opt).__qualname__

    layer.weight.grad, layer.bias.grad = torch.ones(2, 3), torch.ones(2)
    step = stash_aware_step(opt, stash, user_code_first=True)  # user code may write the weights: copy first
    assert stash.copies_made == 1 and step.__qualname__ == plain.__qualname__
    step()
    stash.bump()
    assert all(torch.equal(stash.params(v)[k], before[k]) for k in before)

    v1 = stash.acquire()
    before1 = {k: t.clone() for k, t in stash.params(v1).items()}
    step = stash_aware_step(opt, stash, user_code_first=False)
    assert stash.copies_made == 1  # no copy: the update writes fresh storage
    step()
    stash.bump()
    assert stash.copies_avoided == 1
    assert all(torch.equal(stash.params(v1)[k], before1[k]) for k in before1)
    assert torch.equal(layer.weight, before1["weight"] - 0.1)

    rmsprop = torch.optim.RMSprop(layer.parameters())  # not reproduced: copy, then its own step
    stash.acquire()
    assert stash_aware_step(rmsprop, stash, user_code_first=False) == rmsprop.step and stash.copies_made == 2


def _grads(layer: nn.Module, skip: frozenset[str] = frozenset()) -> list[torch.Tensor]:
    """Sets the gradients, and returns them: while the caller holds them, an update cannot take their memory."""
    for name, p in layer.named_parameters():
        p.grad = None if name in skip else torch.ones_like(p)
    return [p.grad for p in layer.parameters() if p.grad is not None]


def test_released_versions_are_written_again_instead_of_new_memory() -> None:
    # the test holds every gradient (held): an update cannot take a gradient's memory, so it takes a spare
    layer = nn.Linear(3, 2)
    held: list[torch.Tensor] = []
    stash = WeightStash(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    v0 = stash.acquire()
    held += _grads(layer)
    stash_aware_step(opt, stash, user_code_first=False)()
    stash.bump()
    v0_ptrs = {n: t.data_ptr() for n, t in stash.params(v0).items()}
    v1 = stash.acquire()
    stash.release(v0)  # v0's memory is neither live nor used by v1: the next update writes into it
    expected = layer.weight.detach() - 0.1
    held += _grads(layer)
    stash_aware_step(opt, stash, user_code_first=False)()
    stash.bump()
    assert stash.spares_reused == 2 and layer.weight.data_ptr() == v0_ptrs["weight"]
    assert torch.equal(layer.weight, expected)
    assert stash.params(v1)["weight"].data_ptr() not in v0_ptrs.values()  # v1 kept its own memory

    stash.acquire()
    stash.release(v1)
    _grads(layer)
    stash.before_update()  # the copy path writes into the released version's memory too
    assert stash.spares_reused == 4 and layer.weight.data_ptr() != layer.bias.data_ptr()
    stash.drop_spares()
    assert stash.spare(layer.weight) is None


def test_memory_a_version_still_uses_is_never_recycled() -> None:
    layer = nn.Linear(3, 2)
    held: list[torch.Tensor] = []
    stash = WeightStash(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    v0 = stash.acquire()
    held += _grads(layer, skip=frozenset({"bias"}))  # the update skips the bias: v0's bias is still the live bias
    stash_aware_step(opt, stash, user_code_first=False)()
    stash.bump()
    v1 = stash.acquire()  # v1's bias: the same memory as v0's
    held += _grads(layer)
    stash_aware_step(opt, stash, user_code_first=False)()  # now the bias moves to new memory
    stash.bump()
    bias_v1 = stash.params(v1)["bias"].clone()
    stash.release(v0)  # v0's weight memory is free, its bias memory is still v1's
    assert stash.spare(layer.bias) is None
    v2 = stash.acquire()
    held += _grads(layer)
    stash_aware_step(opt, stash, user_code_first=False)()  # takes v0's weight memory, new memory for the bias
    stash.bump()
    assert stash.spares_reused == 1
    assert torch.equal(stash.params(v1)["bias"], bias_v1)  # v1 still has the bias its forward saw
    for v in (v1, v2):
        stash.release(v)

    fresh = WeightStash(nn.Linear(3, 2))
    fresh.release(fresh.acquire())  # the current version is the live weights: releasing it recycles nothing
    assert all(fresh.spare(p) is None for p in fresh._live)
    assert held


def test_an_update_writes_the_new_weights_into_a_gradient_nothing_else_holds() -> None:
    layer = nn.Linear(3, 2)
    stash = WeightStash(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    v0 = stash.acquire()
    held = _grads(layer)
    stash_aware_step(opt, stash, user_code_first=False)()  # held: new memory, the gradients as they were
    stash.bump()
    assert stash.grads_reused == 0 and all(torch.equal(g, torch.ones_like(g)) for g in held)
    assert layer.weight.grad is held[0] and layer.weight.data_ptr() != held[0].data_ptr()
    del held
    v1 = stash.acquire()
    stash.release(v0)  # a spare for each parameter
    expected = {n: p.detach() - 0.1 for n, p in layer.named_parameters()}
    _grads(layer)  # not held
    grad_ptrs = {n: p.grad.data_ptr() for n, p in layer.named_parameters() if p.grad is not None}
    stash_aware_step(opt, stash, user_code_first=False)()
    stash.bump()
    assert stash.grads_reused == 2 and stash.spares_reused == 0
    for n, p in layer.named_parameters():
        assert p.data_ptr() == grad_ptrs[n] and p.grad is None and torch.equal(p, expected[n])
    # the released version's memory stays until the executor's next backward starts, which frees it for its gradients
    assert set(stash._spare) == {id(p) for p in layer.parameters()}
    stash.drop_spares()
    stash.release(v1)


@pytest.mark.parametrize(
    "hold",
    ["reference", "view", "detached", "data", "base", "strides", "requires_grad", "offset"],
)
def test_a_gradient_held_elsewhere_or_laid_out_otherwise_is_not_private(hold: str) -> None:
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(4, 6))
    p.grad = torch.randn(4, 6)
    assert private_grad(p)
    p.grad = torch.randn(24).view(4, 6)  # a view of a tensor nobody else holds, of its size: as good as its own
    is_view = p.grad._base is not None  # (pytest keeps what an assert reads: not in the assert)
    assert is_view
    assert private_grad(p)
    keep: object = None
    if hold == "reference":
        keep = [p.grad]
    elif hold == "view":
        keep = p.grad[1:]
    elif hold == "detached":
        keep = p.grad.detach()
    elif hold == "data":
        keep = p.grad.data
    elif hold == "base":
        keep = p.grad._base
    elif hold == "strides":
        p.grad = torch.randn(6, 4).t()
    elif hold == "requires_grad":
        p.grad = torch.randn(4, 6, requires_grad=True)
    elif hold == "offset":
        p.grad = torch.randn(30)[6:].view(4, 6)
    assert not private_grad(p)
    if hold in ("reference", "view", "detached", "data", "base"):  # and an update leaves that gradient alone
        grad = p.grad.clone()
        expected = torch.add(p.detach(), grad, alpha=-0.1)
        step = out_of_place_step(torch.optim.SGD([p], lr=0.1))
        assert step is not None
        step()
        assert torch.equal(p.grad, grad) and torch.equal(p, expected)
        assert p.data_ptr() != p.grad.data_ptr()
    del keep


def test_without_the_counters_no_gradient_is_private_and_the_update_stays_exact(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    from lightning_dynpipe.engine import outofplace

    monkeypatch.delattr(torch._C, "_storage_Use_Count")  # a torch without it: the probe cannot run
    outofplace._alone.cache_clear()
    request.addfinalizer(outofplace._alone.cache_clear)  # before monkeypatch restores the counter
    ours, theirs = _model(torch.float32), _model(torch.float32)
    _set_grads(ours, 0)
    _set_grads(theirs, 0)
    assert not any(private_grad(p) for p in ours.parameters())
    old = _before(ours)
    out_of_place_step(torch.optim.SGD(ours.parameters(), lr=0.1))()  # type: ignore[misc]
    torch.optim.SGD(theirs.parameters(), lr=0.1).step()
    for p, q, (storage, _, _, grad_ptr) in zip(ours.parameters(), theirs.parameters(), old):
        assert torch.equal(p, q)
        if grad_ptr is not None:  # new memory, and the gradient left as it was
            assert p.data_ptr() not in (storage.data_ptr(), grad_ptr) and p.grad is not None
