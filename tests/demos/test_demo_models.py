"""Unit tests of the demo models: the pipeline contract, layer counts, shapes and a short training run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_dynpipe.demos import CNN, MLP, DigitsDataModule, HeavyLayerMLP, PipelineClassifier
from lightning_dynpipe.errors import ConfigurationError

# Importing scikit-learn sets KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK; do it at collection time so the
# conftest's environment-leak check does not blame whichever test first sets up a DigitsDataModule.
pytest.importorskip("sklearn")


def _all_params_in_pipeline(model: PipelineClassifier) -> bool:
    return {id(p) for p in model.parameters()} == {id(p) for p in model.pipeline.parameters()}


@pytest.mark.parametrize(
    ("model", "num_layers"),
    [
        (MLP(in_features=64, width=32, depth=8), 9),
        (MLP(in_features=64, width=32, depth=0), 1),
        (HeavyLayerMLP(in_features=64, width=16, heavy_width=256, depth=6), 7),
        (CNN(image_size=8, channels=4, hidden=16), 5),
    ],
    ids=["mlp-d8", "mlp-d0", "heavy", "cnn"],
)
def test_contract_and_layer_count(model: PipelineClassifier, num_layers: int) -> None:
    assert isinstance(model.pipeline, nn.Sequential)
    assert model.num_layers == len(model.pipeline) == num_layers
    assert _all_params_in_pipeline(model)
    assert all(any(True for _ in layer.parameters()) for layer in model.pipeline)
    x = model.example_input(5)
    assert model(x).shape == (5, 10)
    assert not any(isinstance(m, (nn.Dropout, nn.modules.batchnorm._BatchNorm)) for m in model.modules())


@pytest.mark.parametrize("factory", [MLP, HeavyLayerMLP, CNN], ids=["mlp", "heavy", "cnn"])
def test_example_input_is_random_and_repeatable(factory: type[PipelineClassifier]) -> None:
    model = factory()
    a, b = model.example_input(4), model.example_input(4)
    assert a.shape == (4, *model.input_shape)
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # every process profiles the same numbers
    assert a.std() > 0.5  # not a constant batch: profiles on zeros are optimistic


def test_layer_by_layer_equals_whole_model() -> None:
    model = CNN(image_size=8, channels=4, hidden=16)
    x = torch.randn(3, 1, 8, 8)
    h = x
    for layer in model.pipeline:
        h = layer(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=0)


def test_mlp_accepts_images_and_vectors() -> None:
    model = MLP(in_features=64, width=8, depth=2)
    x = torch.randn(4, 1, 8, 8)
    torch.testing.assert_close(model(x), model(x.flatten(1)), rtol=0, atol=0)


def test_heavy_block_dominates_cost() -> None:
    model = HeavyLayerMLP(in_features=64, width=16, heavy_width=512, depth=4, heavy_index=2)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in model.pipeline]
    assert sizes.index(max(sizes)) == 2
    assert sizes[2] > 10 * sizes[1]


def _macs(layer: nn.Module, x: torch.Tensor) -> int:
    """Multiply-accumulates of one sample through ``layer``, counted with forward hooks."""
    total = 0

    def count(module: nn.Module, _: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        nonlocal total
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        total += weight.numel() * (out.shape[-1] * out.shape[-2] if isinstance(module, nn.Conv2d) else 1)

    handles = [m.register_forward_hook(count) for m in layer.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    layer(x)
    for h in handles:
        h.remove()
    return total


def test_cnn_costs_are_uneven() -> None:
    model = CNN(image_size=28, channels=8, hidden=32)
    x = model.example_input(1)
    macs = []
    for layer in model.pipeline:
        macs.append(_macs(layer, x))
        x = layer(x)
    assert macs.index(max(macs)) == 1
    assert max(macs) > 10 * min(macs)


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: MLP(optimizer="rmsprop"), "valid options are \\['sgd', 'adam'\\]"),  # type: ignore[arg-type]
        (lambda: MLP(depth=-1), "depth"),
        (lambda: MLP(lr=0.0), "lr must be positive"),
        (lambda: CNN(image_size=10), "divisible by 4"),
        (lambda: HeavyLayerMLP(depth=3, heavy_index=3), "heavy_index"),
    ],
)
def test_bad_arguments(factory: object, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        factory()  # type: ignore[operator]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_configure_optimizers(optimizer: str) -> None:
    model = MLP(in_features=64, width=8, depth=1, lr=0.01, optimizer=optimizer, momentum=0.5)  # type: ignore[arg-type]
    opt = model.configure_optimizers()
    assert type(opt).__name__.lower() == optimizer
    assert opt.param_groups[0]["lr"] == 0.01


def _trainer(tmp_path: Path, **kwargs: object) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("factory", "flat"),
    [
        (lambda: MLP(in_features=64, width=32, depth=2, lr=0.01, optimizer="adam"), True),
        (lambda: HeavyLayerMLP(in_features=64, width=16, heavy_width=64, depth=3, lr=0.01, optimizer="adam"), True),
        (lambda: CNN(image_size=8, channels=4, hidden=16, lr=0.01, optimizer="adam"), False),
    ],
    ids=["mlp", "heavy", "cnn"],
)
def test_few_steps_reduce_validation_loss(
    factory: Callable[[], PipelineClassifier], flat: bool, tmp_path: Path
) -> None:
    # The model is built after seeding: built at collection time, its initial weights depended on how much
    # of the global RNG stream the collection of earlier test modules had used (CI saw val_acc 0.54 once).
    # Seeded, the accuracies after 60 steps are 0.88-0.93 (mlp), 0.71-0.82 (heavy), 0.64-0.81 (cnn) over
    # seeds 0-7.
    pl.seed_everything(0, verbose=False)
    model = factory()
    dm = DigitsDataModule(batch_size=32, flat=flat)
    trainer = _trainer(tmp_path, max_steps=60, enable_checkpointing=False, num_sanity_val_steps=0)
    before = trainer.validate(model, dm, verbose=False)[0]["val_loss"]
    trainer.fit(model, dm)
    assert {"train_loss", "val_loss", "val_acc"} <= set(trainer.callback_metrics)
    after = trainer.validate(model, dm, verbose=False)[0]
    assert after["val_loss"] < 0.5 * before
    assert after["val_acc"] > 0.6
    result = trainer.test(model, dm, verbose=False)[0]
    assert set(result) == {"test_loss", "test_acc"}
    preds = trainer.predict(model, dm)
    assert preds is not None and sum(p.shape[0] for p in preds) == 359  # type: ignore[union-attr]


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    model = MLP(in_features=64, width=16, depth=2, lr=0.1, momentum=0.9)
    trainer = _trainer(tmp_path, max_steps=3, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model, DigitsDataModule(batch_size=32))
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    loaded = MLP.load_from_checkpoint(path)
    assert loaded.hparams["width"] == 16 and loaded.hparams["momentum"] == 0.9
    for (k1, v1), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
