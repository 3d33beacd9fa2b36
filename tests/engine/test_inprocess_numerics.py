"""The executor's numerics with every stage in one process (loopback channels, one thread per stage).

``async`` equals the single-process PipeDream replay bit for bit; ``sync`` and ``gpipe`` equal plain training
on the whole batch to float tolerance. The multi-process tests in tests/strategy check the same through
Lightning and gloo; these run in milliseconds.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dynpipe.calibration import replay_async
from lightning_dynpipe.engine.loopback import run_stages
from lightning_dynpipe.errors import ConfigurationError
from tests.engine.inprocess import InProcessPipeline, build

M = 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(6, 16), nn.Tanh()),
        nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
        nn.Linear(16, 16),
        nn.Linear(16, 3),
    )


def _batches(n: int = 5) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _loss(out: Tensor, mb: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(out, mb[1])


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _plain_sgd(model: nn.Module, batches: list[tuple[Tensor, Tensor]] | None = None) -> nn.Module:
    """Trains ``model`` in place as one process does, one SGD update per whole batch; returns it."""
    opt = _sgd(list(model.parameters()))
    for x, y in batches if batches is not None else _batches():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _errors_of_one_step(pipe: InProcessPipeline, batch: tuple[Tensor, Tensor]) -> list[BaseException | None]:
    """Each stage's exception in one training step (stage 0 of a refused stage 1 waits until its timeout)."""

    def run(k: int) -> BaseException | None:
        try:
            pipe.executors[k].train_step(batch)
        except BaseException as err:
            return err
        return None

    return run_stages(run, len(pipe.executors))


@pytest.mark.parametrize("make_optimizer", [_sgd, _adamw], ids=["sgd", "adamw"])
@pytest.mark.parametrize("fresh_storage", [False, True], ids=["copy", "fresh-storage"])
@pytest.mark.parametrize("balance", [[2, 2], [1, 2, 1], [1, 1, 1, 1]])
def test_async_equals_the_pipedream_replay_bit_for_bit(
    balance: list[int], fresh_storage: bool, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
) -> None:
    model, reference = _model(), _model()
    pipe = build(
        model, balance, schedule="async", num_microbatches=M, make_optimizer=make_optimizer, loss_fn=_loss,
        fresh_storage=fresh_storage,
    )  # fmt: skip
    losses = pipe.train(_batches())
    stash = pipe.executors[0].stash
    assert stash is not None  # the first stage keeps S versions: every update but the last few needs the old ones
    counts = (stash.copies_avoided, stash.copies_made)
    used, unused = counts if fresh_storage else counts[::-1]
    assert used > 0 and unused == 0  # SGD and AdamW on CPU write fresh storage instead of a copy
    if fresh_storage:  # into the memory of the gradients the stage's backward produced: nothing else holds them
        num_params = len(list(pipe.executors[0].stage_module.parameters()))
        assert (stash.grads_reused, stash.spares_reused) == (stash.copies_avoided * num_params, 0)
    ref_losses = replay_async(reference, balance, make_optimizer, _batches(), M, _loss)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    step_means = [sum(ref_losses[i : i + M]) / M for i in range(0, len(ref_losses), M)]
    assert losses[-1] == pytest.approx(step_means, abs=0)  # the last stage reports the mean loss of each batch


@pytest.mark.parametrize("make_optimizer", [_sgd, _adamw], ids=["sgd", "adamw"])
@pytest.mark.parametrize("fresh_storage", [False, True], ids=["copy", "fresh-storage"])
@pytest.mark.parametrize(("balance", "d"), [([2, 2], 1), ([2, 2], 3), ([1, 2, 1], 1), ([1, 1, 1, 1], 2)])
def test_deeper_async_equals_the_replay_with_its_staleness_bit_for_bit(
    balance: list[int],
    d: int,
    fresh_storage: bool,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
) -> None:
    """``async+d``: stage ``k`` forwards ``w = (S-1-k)(1+d)`` micro-batches ahead (more than a step's 4 when
    ``w > 4``, so micro-batches cross steps), each backward on its own forward's stashed version."""
    S = len(balance)
    model, reference = _model(), _model()
    pipe = build(
        model, balance, schedule=f"async+{d}", num_microbatches=M, make_optimizer=make_optimizer, loss_fn=_loss,
        fresh_storage=fresh_storage,
    )  # fmt: skip
    losses = pipe.train(_batches(6))
    depth = [(S - 1 - k) * (1 + d) for k in range(S)]
    assert [e.stats.max_stash_depth for e in pipe.executors] == [w + 1 if w else 0 for w in depth]
    ref_losses = replay_async(reference, balance, make_optimizer, _batches(6), M, _loss, staleness=depth)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    step_means = [sum(ref_losses[i : i + M]) / M for i in range(0, len(ref_losses), M)]
    assert losses[-1] == pytest.approx(step_means, abs=0)
    pipedream = _model()
    replay_async(pipedream, balance, make_optimizer, _batches(6), M, _loss)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), pipedream.parameters()))  # not PipeDream's


@pytest.mark.parametrize("schedule", ["sync", "gpipe"])
def test_flush_schedules_equal_plain_training(schedule: str) -> None:
    model = _model()
    plain = copy.deepcopy(model)
    accumulated = [0] * len(list(model.parameters()))
    for i, param in enumerate(model.parameters()):
        param.register_post_accumulate_grad_hook(lambda _, i=i: accumulated.__setitem__(i, accumulated[i] + 1))
    build(model, [1, 2, 1], schedule=schedule, num_microbatches=M, make_optimizer=_sgd, loss_fn=_loss).train(_batches())
    # each micro-batch's gradient is added into .grad by autograd as it is produced, one parameter at a time (as
    # loss.backward() does): no second copy of a stage's gradients while micro-batches accumulate
    assert accumulated == [M * len(_batches())] * len(accumulated)
    opt = _sgd(list(plain.parameters()))
    for x, y in _batches():
        opt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        opt.step()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


T = 5  # targets per sample of the token model below
IGNORE = -100


def _token_batches(lengths: list[list[int]]) -> list[tuple[Tensor, Tensor]]:
    """Batches of 8 samples with ``T`` targets each, padded (``IGNORE``) after each sample's length."""
    g = torch.Generator().manual_seed(1)
    out = []
    for lens in lengths:
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8, T), generator=g)
        y[torch.arange(T)[None, :] >= torch.tensor(lens)[:, None]] = IGNORE
        out.append((x, y))
    return out


def _token_mean_loss(out: Tensor, mb: tuple[Tensor, Tensor]) -> Tensor:
    """Cross-entropy averaged over the targets that are not padding, as language models compute it."""
    return F.cross_entropy(out.view(-1, 3), mb[1].reshape(-1), ignore_index=IGNORE)


def _targets(mb: tuple[Tensor, Tensor]) -> Tensor:
    return (mb[1] != IGNORE).sum()


def _token_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(6, 16), nn.Tanh()), nn.Linear(16, 16), nn.Linear(16, T * 3))


# long samples first, short ones last: the micro-batches count different numbers of targets; the third batch's
# last two samples (its last micro-batch at M=4) are all padding
_LENGTHS = [[5, 5, 4, 5, 1, 1, 2, 1], [3, 5, 5, 5, 2, 2, 1, 3], [5, 4, 5, 5, 2, 1, 0, 0]]


@pytest.mark.parametrize("schedule", ["sync", "gpipe"])
@pytest.mark.parametrize("num_microbatches", [2, 4])
def test_flush_schedules_weigh_micro_batches_by_the_terms_their_loss_averages(
    schedule: str, num_microbatches: int
) -> None:
    """A loss averaged over the targets that are not padding (a token-mean cross-entropy): one device's update is
    the gradient of the whole batch's mean over its targets. Weighting each micro-batch's mean by its samples gives
    another update; with the module's ``loss_terms`` (the targets each micro-batch counts) the flush schedules give
    one device's, to float tolerance, a micro-batch with no targets at all included (its own mean is NaN and adds
    nothing)."""
    batches = _token_batches(_LENGTHS)
    plain = _token_model()
    opt = _sgd(list(plain.parameters()))
    for b in batches:
        opt.zero_grad()
        _token_mean_loss(plain(b[0]), b).backward()
        opt.step()
    weighted, by_samples = _token_model(), _token_model()
    kw = dict(schedule=schedule, num_microbatches=num_microbatches, make_optimizer=_sgd, loss_fn=_token_mean_loss)
    pipe = build(weighted, [1, 2], loss_terms=_targets, **kw)  # type: ignore[arg-type]
    pipe.train(batches)
    size = 8 // num_microbatches  # the last step's weights: each micro-batch's targets
    expected = [float(sum(_LENGTHS[-1][i : i + size])) for i in range(0, 8, size)]
    assert pipe.executors[-1].microbatch_weights == expected
    assert (0.0 in expected) == (num_microbatches == 4)
    for p, q in zip(weighted.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    if num_microbatches == 2:  # (at M=4 the all-padding micro-batch makes the samples' weighting NaN)
        build(by_samples, [1, 2], **kw).train(batches[:2])  # type: ignore[arg-type]
        replain = _token_model()
        opt = _sgd(list(replain.parameters()))
        for b in batches[:2]:
            opt.zero_grad()
            _token_mean_loss(replain(b[0]), b).backward()
            opt.step()
        assert max((p - q).abs().max().item() for p, q in zip(by_samples.parameters(), replain.parameters())) > 1e-3


def test_a_summed_loss_is_weighted_by_its_micro_batches_share_under_sync() -> None:
    """A loss summed over the samples (``reduction="sum"``) is weighted like a mean, by its micro-batch's share of
    the samples: with equal micro-batches the update is one device's on the batch's sum divided by ``M`` (what the
    user guide says to expect; return a mean, or scale the sum)."""

    def summed(out: Tensor, mb: tuple[Tensor, Tensor]) -> Tensor:
        return F.cross_entropy(out, mb[1], reduction="sum")

    model, plain = _model(), _model()
    build(model, [1, 3], schedule="sync", num_microbatches=M, make_optimizer=_sgd, loss_fn=summed).train(_batches())
    opt = _sgd(list(plain.parameters()))
    for x, y in _batches():
        opt.zero_grad()
        (summed(plain(x), (x, y)) / M).backward()
        opt.step()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_async_updates_ignore_loss_terms() -> None:
    """Under ``async`` every update is one micro-batch's own loss: ``loss_terms`` changes no weight (bit for bit),
    only the weights of the step's logged mean (:attr:`StageExecutor.microbatch_weights`)."""
    kw = dict(schedule="async", num_microbatches=2, make_optimizer=_sgd, loss_fn=_token_mean_loss)
    with_terms, without = _token_model(), _token_model()
    pipe = build(with_terms, [1, 2], loss_terms=_targets, **kw)  # type: ignore[arg-type]
    pipe.train(_token_batches(_LENGTHS[:2]))
    build(without, [1, 2], **kw).train(_token_batches(_LENGTHS[:2]))  # type: ignore[arg-type]
    assert all(torch.equal(p, q) for p, q in zip(with_terms.parameters(), without.parameters()))
    assert pipe.executors[-1].microbatch_weights == [18.0, 8.0]  # the second batch's targets per half


@pytest.mark.parametrize(
    ("terms", "message"),
    [
        (lambda mb: -1, r"finite number >= 0 .* returned -1.0 for micro-batch 0"),
        (lambda mb: float("nan"), r"returned nan for micro-batch 0"),
        (lambda mb: torch.ones(2), r"returned a torch.float32 tensor of shape \(2,\) for micro-batch 0"),
        (lambda mb: 0, r"returned 0 for every micro-batch of this step \(\[0.0, 0.0\]\)"),
    ],
)
def test_loss_terms_that_cannot_weigh_a_step_are_refused(terms: Callable[[object], object], message: str) -> None:
    pipe = build(
        _token_model(), [3], schedule="sync", num_microbatches=2, make_optimizer=_sgd, loss_fn=_token_mean_loss,
        loss_terms=terms,
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match=message):
        pipe.executors[0].train_step(_token_batches(_LENGTHS)[0])


def test_stash_depth_is_bounded_by_s_minus_k() -> None:
    pipe = build(_model(), [1, 1, 1, 1], schedule="async", num_microbatches=M, make_optimizer=_sgd, loss_fn=_loss)
    pipe.train(_batches(3))
    depths = [e.stats.max_stash_depth for e in pipe.executors]
    assert depths == [4, 3, 2, 0]


def _inplace_model() -> nn.Sequential:
    """Layers that write their input in place where one process lets them: the previous layer's output."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.Hardtanh(inplace=True), nn.Linear(16, 3)
    )


@pytest.mark.parametrize("balance", [[1, 4], [1, 1, 1, 2], [2, 3]])
def test_a_stage_may_start_with_a_layer_that_writes_its_input_in_place(balance: list[int]) -> None:
    """A stage after the first receives a leaf, which autograd forbids writing in place: the stage gives its layers
    a copy when they wrote the first micro-batch's input, and the received tensor itself otherwise. async equals the
    replay bit for bit; sync equals plain training."""
    model, reference = _inplace_model(), _inplace_model()
    pipe = build(model, balance, schedule="async", num_microbatches=M, make_optimizer=_sgd, loss_fn=_loss)
    pipe.train(_batches())
    replay_async(reference, balance, _sgd, _batches(), M, _loss)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    bounds = [sum(balance[:k]) for k in range(len(balance))]
    writes = [k > 0 and isinstance(_inplace_model()[b], (nn.ReLU, nn.Hardtanh)) for k, b in enumerate(bounds)]
    assert [ex._copy_input for ex in pipe.executors] == writes

    model, reference = _inplace_model(), _plain_sgd(_inplace_model())
    pipe = build(model, balance, schedule="sync", num_microbatches=M, make_optimizer=_sgd, loss_fn=_loss)
    pipe.train(_batches())
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


class _SometimesInPlace(nn.Module):
    """Writes its input in place from its second call on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return x.mul_(2.0) if self.calls > 1 else x * 2.0


def test_a_layer_that_starts_writing_its_input_in_place_later_is_refused_with_the_fix() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), _SometimesInPlace(), nn.Linear(16, 3))
    pipe = build(model, [1, 2], schedule="async", num_microbatches=M, make_optimizer=_sgd, loss_fn=_loss, timeout=2.0)

    errors = _errors_of_one_step(pipe, _batches(1)[0])
    assert isinstance(errors[1], ConfigurationError), errors
    assert "Stage 1's layers wrote their input in place, but not on the first micro-batch" in str(errors[1])
    assert "nn.ReLU(inplace=False)" in str(errors[1])


def test_batchnorm_under_sync_normalises_each_micro_batch_which_one_device_does_not() -> None:
    """Why a fit refuses BatchNorm under a flush schedule with micro-batches unless asked: the update is not plain
    training's on the whole batch (it is with one micro-batch)."""

    def norm_model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))

    reference = _plain_sgd(norm_model())
    for m, equal in ((M, False), (1, True)):
        model = norm_model()
        build(model, [2, 1], schedule="sync", num_microbatches=m, make_optimizer=_sgd, loss_fn=_loss).train(_batches())
        close = all(torch.allclose(p, q, atol=1e-5) for p, q in zip(model.parameters(), reference.parameters()))
        assert close == equal, m
        assert torch.allclose(model[1].running_mean, reference[1].running_mean, atol=1e-6) == equal, m


def _spectral(legacy: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    norm = nn.utils.spectral_norm if legacy else nn.utils.parametrizations.spectral_norm
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), norm(nn.Linear(16, 16)), nn.Linear(16, 3))


@pytest.mark.parametrize("legacy", [False, True], ids=["parametrization", "hook"])
def test_a_layer_that_updates_buffers_per_forward_is_refused_under_sync_with_micro_batches(legacy: bool) -> None:
    """Spectral norm runs one power iteration per training forward, writing its ``u`` (and ``v``) buffers: under
    ``sync`` with 4 micro-batches that is 4 iterations per step where one device runs one, and the weights differ
    from plain training. The first training forward of the stage that holds it refuses it with the fix; accepted
    with ``microbatch_statistics=True`` (and then not plain training); ``async`` equals the replay bit for bit."""
    batches = _batches()

    plain = _plain_sgd(_spectral(legacy), batches)
    pipe = build(_spectral(legacy), [2, 2], schedule="sync", num_microbatches=M, make_optimizer=_sgd, loss_fn=_loss,
                 microbatch_statistics=False, timeout=2.0)  # fmt: skip

    errors = _errors_of_one_step(pipe, batches[0])
    assert isinstance(errors[1], ConfigurationError), errors
    msg = str(errors[1])
    written = "['2.weight_u'" if legacy else "['2.parametrizations.weight.0._u', '2.parametrizations.weight.0._v']"
    assert f"Stage 1's layers update buffers in every training forward ({written}" in msg, msg
    assert "num_microbatches=4 that forward runs 4 times per batch" in msg and "microbatch_statistics=True" in msg

    model = _spectral(legacy)
    build(model, [2, 2], schedule="sync", num_microbatches=M, make_optimizer=_sgd, loss_fn=_loss,
          microbatch_statistics=True).train(batches)  # fmt: skip
    assert (
        max((p - q).abs().max().item() for p, q in zip(model.state_dict().values(), plain.state_dict().values())) > 1e-3
    )

    model = _spectral(legacy)  # one micro-batch: one iteration per step, as on one device
    build(model, [2, 2], schedule="sync", num_microbatches=1, make_optimizer=_sgd, loss_fn=_loss,
          microbatch_statistics=False).train(batches)  # fmt: skip
    for p, q in zip(model.state_dict().values(), plain.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)

    model, reference = _spectral(legacy), _spectral(legacy)
    build(model, [2, 2], schedule="async", num_microbatches=M, make_optimizer=_sgd, loss_fn=_loss,
          microbatch_statistics=False).train(batches)  # fmt: skip
    replay_async(reference, [2, 2], _sgd, batches, M, _loss)
    for p, q in zip(model.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(p, q)


def test_a_stage_whose_buffers_no_forward_writes_runs_under_sync_with_the_check_on() -> None:
    """Buffers that a training forward only reads (a causal mask, a fixed scale) pass the check."""

    class Scaled(nn.Linear):
        def __init__(self) -> None:
            super().__init__(16, 16)
            self.register_buffer("scale", torch.full((16,), 0.5), persistent=False)

        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x) * self.scale

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), Scaled(), nn.Linear(16, 3))
    ref = _plain_sgd(copy.deepcopy(model))
    build(model, [2, 2], schedule="sync", num_microbatches=M, make_optimizer=_sgd, loss_fn=_loss,
          microbatch_statistics=False).train(_batches())  # fmt: skip
    for p, q in zip(model.state_dict().values(), ref.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("schedule", "num_microbatches", "drained", "refused"),
    [("async+2", 1, False, True), ("async+2", 1, True, False), ("async", 4, False, False)],
    ids=["live-version-in-flight", "drained", "only-older-versions-in-flight"],
)
def test_weights_written_in_place_under_micro_batches_in_flight_are_refused(
    schedule: str, num_microbatches: int, drained: bool, refused: bool
) -> None:
    """A stage can end a step with backwards in flight whose forwards used the live weights (the current stashed
    version is their storage): stage 0 of ``async+2`` with one micro-batch per step. Writing those weights in
    place then (a weight clamp in ``on_train_batch_end``) would have the backwards differentiate at other weights
    than their forwards saw: the next step refuses it, naming the weights. After a drain nothing is in flight, and
    where the micro-batches in flight use older versions (``async`` with 4 micro-batches: an update followed
    their forwards, and it wrote the live weights to fresh storage), they keep their own copies: the same write is
    allowed."""
    model = _model()
    kw = dict(schedule=schedule, num_microbatches=num_microbatches, make_optimizer=_sgd, loss_fn=_loss, timeout=2.0)
    pipe = build(model, [1, 3], fresh_storage=True, **kw)  # type: ignore[arg-type]
    first, *later = _batches(4)
    assert _errors_of_one_step(pipe, first) == [None, None]
    stash = pipe.executors[0].stash
    assert stash is not None and pipe.executors[0].in_flight > 0
    if drained:
        run_stages(lambda k: pipe.executors[k].drain(), 2)
    assert stash.shares_live == refused
    with torch.no_grad():
        model[0][0].weight.clamp_(-0.1, 0.1)
    for batch in later:  # the backwards in flight run within the next steps (async+2, M=1: the third)
        errors = _errors_of_one_step(pipe, batch)
        if errors != [None, None]:
            break
    if not refused:
        assert errors == [None, None]
        return
    assert isinstance(errors[0], ConfigurationError)
    assert "Stage 0's weights ['0.0.weight'] were written in place outside an optimizer update" in str(errors[0])


@pytest.mark.parametrize("kind", ["tensor", "post_accumulate"])
@pytest.mark.parametrize("schedule", ["async", "async+1", "sync", "gpipe"])
def test_gradient_hooks_of_a_stage_parameter_run_once_per_micro_batch_as_in_plain_training(
    schedule: str, kind: str
) -> None:
    """A hook on a parameter (``register_hook``, ``register_post_accumulate_grad_hook``) runs on every backward of
    its gradient, as in plain training, also where the backward differentiates at a stashed weight version (the
    stages before the last under ``async``), which carries none of the parameter's hooks."""
    model = _model()
    weight = model[0][0].weight  # stage 0 of [2, 2]: stashed under async
    before = weight.detach().clone()
    calls: list[int] = []
    if kind == "tensor":
        weight.register_hook(lambda g: (calls.append(1), torch.zeros_like(g))[1])
    else:

        def zero_grad(p: Tensor) -> None:
            calls.append(1)
            assert p.grad is not None
            p.grad.zero_()

        weight.register_post_accumulate_grad_hook(zero_grad)
    pipe = build(
        model, [2, 2], schedule=schedule, num_microbatches=M, make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        loss_fn=_loss, fresh_storage=True,
    )  # fmt: skip
    pipe.train(_batches(3))
    assert len(calls) == 3 * M  # once per micro-batch's backward
    assert torch.equal(weight, before)  # its gradient was zero every time: as plain training with the hook
    assert not torch.equal(model[0][0].bias, _model()[0][0].bias)  # the rest trained


def test_a_gradient_hook_halving_a_stashed_parameters_gradient_equals_halving_its_lr_bit_for_bit() -> None:
    """``async``, the hook on a parameter of stage 0 (stashed): the same weights as the run without the hook whose
    optimizer gives that parameter half the learning rate (SGD; halving is exact in floating point)."""
    hooked, reference = _model(), _model()
    hooked[0][0].weight.register_hook(lambda g: g * 0.5)
    target = reference[0][0].weight

    def halved_lr(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        rest = [p for p in params if p is not target]
        groups = [{"params": rest}] + ([{"params": [target], "lr": 0.05}] if len(rest) < len(params) else [])
        return torch.optim.SGD(groups, lr=0.1)

    for model, make in ((hooked, lambda ps: torch.optim.SGD(ps, lr=0.1)), (reference, halved_lr)):
        build(model, [2, 2], schedule="async", num_microbatches=M, make_optimizer=make, loss_fn=_loss,
              fresh_storage=True).train(_batches())  # fmt: skip
    assert not torch.equal(hooked[0][0].weight, _model()[0][0].weight)
    for p, q in zip(hooked.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_a_gradient_hook_returning_another_shape_on_a_stashed_stage_is_refused() -> None:
    """Autograd refuses such a hook on the parameter itself; the stage, which runs the hooks of a stashed stage's
    parameters, refuses it too instead of accumulating a gradient of the wrong shape."""
    model = _model()
    model[0][0].weight.register_hook(lambda g: g.sum(0))
    pipe = build(
        model, [2, 2], schedule="async", num_microbatches=M, make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        loss_fn=_loss, fresh_storage=True, timeout=2.0,
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match=r"gradient hook of a parameter of shape \(16, 6\) returned"):
        pipe.train(_batches(2))
