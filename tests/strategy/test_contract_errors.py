"""The user contract fails loudly in a real 2-stage run: a second pipeline call (raised on the last stage in the
middle of a step), a step that changes the pipeline's input before the call (which stage 0 would not do), and a
last batch that cannot be split (before the first step). Spawned processes: the first
rank's error reaches the caller.

The other contract errors are raised by functions with unit tests of their own, on paths real runs already
cover: a batch stage 0 cannot read (``first_stage_input``, called by stage 0 of every run; a stage-0 exception
reaching the caller is ``test_failures.py``) and async with tied weights split across stages (``check_setup``,
before any process group; ``test_config_and_contract.py``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from pipeline_models import TinyNet, loader, trainer_kwargs

from lightning_dynpipe import DynPipeStrategy

pytestmark = pytest.mark.multiprocess


class TwoViews(TinyNet):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        a, b = self.pipeline(x), self.pipeline(x + 0.1 * torch.randn_like(x))  # consistency loss: two calls
        return F.cross_entropy(a, y) + F.mse_loss(a, b)


def test_a_second_pipeline_call_in_one_step_is_an_error() -> None:
    s = DynPipeStrategy(num_microbatches=4, balance=[2, 3], start_method="fork", adaptive=False)
    with pytest.raises(Exception, match=r"self.pipeline\(...\) was called twice in one step"):
        L.Trainer(devices=2, max_steps=2, strategy=s, **trainer_kwargs()).fit(TwoViews(), loader())


def test_a_last_batch_too_small_to_split_is_refused_before_the_first_step() -> None:
    """98 samples in batches of 12: the epoch's last batch holds 2 < num_microbatches=4 (refused in
    ``on_train_start``, where it used to fail only when that batch arrived, after a whole epoch)."""
    s = DynPipeStrategy(num_microbatches=4, balance=[2, 3], start_method="fork", adaptive=False)
    with pytest.raises(Exception, match=r"last training batch of each epoch holds 2 samples .*drop_last=True"):
        L.Trainer(devices=2, max_epochs=1, strategy=s, **trainer_kwargs()).fit(TinyNet(), loader(n=98))


class NormalisedInTheStep(TinyNet):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = (x - x.mean()) / (x.std() + 1e-6)  # stage 0 never runs this: it would train on raw inputs
        return F.cross_entropy(self.pipeline(x), y)


class NormalisedInPipelineInput(TinyNet):
    def pipeline_input(self, batch: Any) -> torch.Tensor:
        x = batch[0]
        return (x - x.mean()) / (x.std() + 1e-6)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.pipeline(self.pipeline_input(batch)), batch[1])


def test_preprocessing_in_the_step_that_stage_0_would_skip_is_refused() -> None:
    """The last stage compares its step's pipeline argument with batch[0] at the first call: a normalisation written
    in the step is refused with the fix; the same normalisation in ``pipeline_input`` (not checked: the hook says
    what stage 0 feeds) trains."""
    s = DynPipeStrategy(num_microbatches=4, balance=[2, 3], start_method="fork", adaptive=False)
    with pytest.raises(
        Exception, match=r"stage 0 feeds the pipeline the same shapes with other values.*pipeline_input"
    ):
        L.Trainer(devices=2, max_steps=2, strategy=s, **trainer_kwargs()).fit(NormalisedInTheStep(), loader())

    model = NormalisedInPipelineInput()
    s = DynPipeStrategy(num_microbatches=4, balance=[2, 3], start_method="fork", adaptive=False)
    L.Trainer(devices=2, max_steps=2, strategy=s, **trainer_kwargs()).fit(model, loader())
    assert not torch.equal(model.pipeline[0].weight, TinyNet().pipeline[0].weight)  # it trained


class RankDependentOrder(torch.utils.data.Sampler[int]):
    """A sampler of the user's whose order depends on the process (here its rank; in practice its own RNG)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        order = list(range(self.n))
        return iter(order if torch.distributed.get_rank() == 0 else order[::-1])

    def __len__(self) -> int:
        return self.n


def test_stages_that_read_different_samples_are_stopped_at_the_first_step() -> None:
    """Stage 0 sends the integer tensors' checksum of each step's first micro-batch with its activation; the last
    stage compares it with its own. A sampler the static check cannot judge (the user's own) is caught there."""
    data = loader().dataset
    s = DynPipeStrategy(num_microbatches=4, balance=[2, 3], start_method="fork", adaptive=False)
    with pytest.raises(Exception, match=r"Stage 0 and the last stage read different samples for micro-batch 0"):
        L.Trainer(devices=2, max_steps=2, strategy=s, **trainer_kwargs()).fit(
            TinyNet(), torch.utils.data.DataLoader(data, batch_size=12, sampler=RankDependentOrder(len(data)))
        )
