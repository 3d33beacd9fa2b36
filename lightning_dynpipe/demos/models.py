"""Demo classifiers that follow the DynPipe user contract.

Every model keeps ALL of its trainable parameters in ``self.pipeline``, an :class:`~torch.nn.Sequential`
whose elements are the partition units (layers), and every ``*_step`` calls ``self.pipeline(x)`` exactly
once. They train unchanged under a plain ``Trainer(accelerator="cpu", devices=1)`` and under
``DynPipeStrategy``. No dropout or batch norm: the numerics tests need deterministic layers.

Layer counts (``len(model.pipeline)``, also :attr:`PipelineClassifier.num_layers`):

- :class:`MLP`: ``depth + 1`` (``depth`` hidden blocks and a linear head).
- :class:`HeavyLayerMLP`: ``depth + 1``, one hidden block about ``2 * heavy_width / width`` times the cost
  of the others.
- :class:`CNN`: 5 (three conv blocks, one hidden linear block, a linear head).
"""

from __future__ import annotations

from typing import Literal, get_args

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_dynpipe.errors import ConfigurationError

__all__ = ["CNN", "HeavyLayerMLP", "MLP", "OptimizerName", "PipelineClassifier"]

OptimizerName = Literal["sgd", "adam"]

_Batch = tuple[Tensor, Tensor]


class PipelineClassifier(pl.LightningModule):
    """Base class: a classifier whose layers are the elements of ``self.pipeline``.

    Subclasses build ``self.pipeline`` and call ``self.save_hyperparameters()`` in their ``__init__``;
    this class supplies the steps, the logged metrics (``train_loss``, ``val_loss``, ``val_acc``,
    ``test_loss``, ``test_acc``) and the optimizer.

    Example::

        class Logistic(PipelineClassifier):
            def __init__(self, lr: float = 0.1) -> None:
                super().__init__(lr=lr)
                self.save_hyperparameters()
                self.pipeline = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    Args:
        lr: learning rate.
        optimizer: ``"sgd"`` or ``"adam"``.
        momentum: SGD momentum (ignored by Adam).
    """

    pipeline: nn.Sequential

    def __init__(self, lr: float = 0.05, optimizer: OptimizerName = "sgd", momentum: float = 0.0) -> None:
        super().__init__()
        if optimizer not in get_args(OptimizerName):
            raise ConfigurationError(
                f"Unknown optimizer {optimizer!r}; valid options are {list(get_args(OptimizerName))}."
            )
        if lr <= 0:
            raise ConfigurationError(f"lr must be positive; got lr={lr}.")
        self.lr = lr
        self.optimizer_name: OptimizerName = optimizer
        self.momentum = momentum

    @property
    def num_layers(self) -> int:
        """Number of partition units, ``len(self.pipeline)``."""
        return len(self.pipeline)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input sample, without the batch dimension (each model declares its own)."""
        raise ConfigurationError(
            f"{type(self).__name__} does not declare the shape of its input; override the input_shape property "
            "to use example_input()."
        )

    def example_input(self, batch_size: int = 2) -> Tensor:
        """A batch of the input shape, for profiling and shape checks: standard normal, the same on every call.

        Not zeros: layer times can depend on the data. The CNN's first stage profiled 4.7 ms per forward on
        zeros, 5.8 ms on real MNIST images and 7.0 ms on standard-normal data (``benchmarks/profile_inputs.py``,
        ``docs/planner.md``); the MLPs did not change. Random data matches the random batches of the
        benchmarks; to plan for real data, profile a real micro-batch (the strategy does). Seeded, so every
        process profiles the same numbers.

        This is deliberately not ``example_input_array``, which Lightning's ``ModelSummary`` runs through
        ``forward`` at fit start.
        """
        generator = torch.Generator().manual_seed(0)
        return torch.randn(batch_size, *self.input_shape, generator=generator)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.pipeline(x)  # type: ignore[no-any-return]

    @override
    def training_step(self, batch: _Batch, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.pipeline(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: _Batch, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.pipeline(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_acc", acc, prog_bar=True)
        return loss

    @override
    def test_step(self, batch: _Batch, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.pipeline(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        self.log("test_loss", loss)
        self.log("test_acc", acc)
        return loss

    @override
    def predict_step(self, batch: _Batch | Tensor, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.pipeline(x)  # type: ignore[no-any-return]

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def _hidden(in_features: int, out_features: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(in_features, out_features), nn.ReLU())


def _with_flatten(block: nn.Module) -> nn.Sequential:
    # Flatten first, so layer 0 accepts (N, C, H, W) images as well as (N, C*H*W) vectors.
    children = list(block.children()) if isinstance(block, nn.Sequential) else [block]
    return nn.Sequential(nn.Flatten(), *children)


def _check_positive(**values: int) -> None:
    bad = {k: v for k, v in values.items() if v < 1}
    if bad:
        raise ConfigurationError(f"These sizes must be positive integers: {bad}.")


class MLP(PipelineClassifier):
    """A multi-layer perceptron with ``depth + 1`` layers.

    ``pipeline[i]`` for ``i < depth`` is ``Sequential(Linear, ReLU)``; ``pipeline[depth]`` is the linear
    head. ``pipeline[0]`` starts with an ``nn.Flatten`` (it has no parameters), so ``(N, 1, 28, 28)``
    images work as well as ``(N, 784)`` vectors. ``depth=0`` is multinomial logistic regression.

    Example::

        import lightning.pytorch as pl
        from lightning_dynpipe.demos import MLP, MNISTDataModule

        model = MLP(in_features=784, width=1024, depth=8)   # 9 layers
        assert model.num_layers == 9
        pl.Trainer(accelerator="cpu", devices=1, max_epochs=1).fit(model, MNISTDataModule())

    Args:
        in_features: inputs per sample (784 for MNIST, 64 for the sklearn digits).
        width: features of every hidden block.
        depth: number of hidden blocks.
        num_classes: outputs of the head.
        lr: learning rate.
        optimizer: ``"sgd"`` or ``"adam"``.
        momentum: SGD momentum.
    """

    def __init__(
        self,
        in_features: int = 784,
        width: int = 1024,
        depth: int = 8,
        num_classes: int = 10,
        lr: float = 0.05,
        optimizer: OptimizerName = "sgd",
        momentum: float = 0.0,
    ) -> None:
        super().__init__(lr=lr, optimizer=optimizer, momentum=momentum)
        _check_positive(in_features=in_features, width=width, num_classes=num_classes)
        if depth < 0:
            raise ConfigurationError(f"depth (hidden blocks) must be 0 or more; got depth={depth}.")
        self.save_hyperparameters()
        self._in_features = in_features
        sizes = [in_features] + [width] * depth
        layers: list[nn.Module] = [_hidden(a, b) for a, b in zip(sizes[:-1], sizes[1:])]
        layers.append(nn.Linear(sizes[-1], num_classes))
        layers[0] = _with_flatten(layers[0])
        self.pipeline = nn.Sequential(*layers)

    @property
    @override
    def input_shape(self) -> tuple[int, ...]:
        return (self._in_features,)


class HeavyLayerMLP(PipelineClassifier):
    """An MLP in which one hidden block is much more expensive than the others.

    All hidden blocks map ``width -> width`` (the first maps ``in_features -> width``); block
    ``heavy_index`` expands to ``heavy_width`` and projects back (``Linear, ReLU, Linear, ReLU``), so it
    costs about ``2 * heavy_width / width`` ordinary blocks. Layer count: ``depth + 1``. Useful for testing
    that a planner isolates a hot layer.

    Example::

        from lightning_dynpipe.demos import HeavyLayerMLP

        model = HeavyLayerMLP(width=256, heavy_width=4096, depth=6, heavy_index=3)   # 7 layers
        assert model.num_layers == 7

    Args:
        in_features: inputs per sample.
        width: features of the ordinary hidden blocks.
        heavy_width: hidden features inside the heavy block.
        depth: number of hidden blocks, the heavy one included.
        heavy_index: position of the heavy block, ``0 <= heavy_index < depth``; default ``depth // 2``.
        num_classes: outputs of the head.
        lr: learning rate.
        optimizer: ``"sgd"`` or ``"adam"``.
        momentum: SGD momentum.
    """

    def __init__(
        self,
        in_features: int = 784,
        width: int = 256,
        heavy_width: int = 4096,
        depth: int = 6,
        heavy_index: int | None = None,
        num_classes: int = 10,
        lr: float = 0.05,
        optimizer: OptimizerName = "sgd",
        momentum: float = 0.0,
    ) -> None:
        super().__init__(lr=lr, optimizer=optimizer, momentum=momentum)
        _check_positive(
            in_features=in_features, width=width, heavy_width=heavy_width, depth=depth, num_classes=num_classes
        )
        heavy = depth // 2 if heavy_index is None else heavy_index
        if not 0 <= heavy < depth:
            raise ConfigurationError(
                f"heavy_index must name one of the {depth} hidden blocks (0 <= heavy_index < {depth}); "
                f"got heavy_index={heavy_index}."
            )
        self.save_hyperparameters()
        self._in_features = in_features
        self.heavy_index = heavy
        layers: list[nn.Module] = []
        features = in_features
        for i in range(depth):
            if i == heavy:
                layers.append(nn.Sequential(*_hidden(features, heavy_width), *_hidden(heavy_width, width)))
            else:
                layers.append(_hidden(features, width))
            features = width
        layers.append(nn.Linear(width, num_classes))
        layers[0] = _with_flatten(layers[0])
        self.pipeline = nn.Sequential(*layers)

    @property
    @override
    def input_shape(self) -> tuple[int, ...]:
        return (self._in_features,)


class CNN(PipelineClassifier):
    """A small convolutional network for ``(N, C, H, W)`` images, with 5 layers of uneven cost.

    ====  ==========================================  ============================
    idx   layer                                       output (28x28 input, c=32)
    ====  ==========================================  ============================
    0     Conv3x3(C -> c), ReLU                       c x 28 x 28   (cheap)
    1     Conv3x3(c -> 2c), ReLU, MaxPool2            2c x 14 x 14  (most expensive)
    2     Conv3x3(2c -> 2c), ReLU, MaxPool2           2c x 7 x 7
    3     Flatten, Linear(2c*H/4*W/4 -> hidden), ReLU  hidden
    4     Linear(hidden -> num_classes)               num_classes
    ====  ==========================================  ============================

    Example::

        import lightning.pytorch as pl
        from lightning_dynpipe.demos import CNN, MNISTDataModule

        model = CNN(channels=16)
        pl.Trainer(accelerator="cpu", devices=1, max_epochs=1).fit(model, MNISTDataModule(flat=False))

    Args:
        in_channels: channels of the input image.
        image_size: height and width of the input image; must be divisible by 4.
        channels: channels ``c`` of the first conv block (the next two have ``2c``).
        hidden: features of the hidden linear block.
        num_classes: outputs of the head.
        lr: learning rate.
        optimizer: ``"sgd"`` or ``"adam"``.
        momentum: SGD momentum.
    """

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 28,
        channels: int = 32,
        hidden: int = 128,
        num_classes: int = 10,
        lr: float = 0.05,
        optimizer: OptimizerName = "sgd",
        momentum: float = 0.0,
    ) -> None:
        super().__init__(lr=lr, optimizer=optimizer, momentum=momentum)
        _check_positive(
            in_channels=in_channels, image_size=image_size, channels=channels, hidden=hidden, num_classes=num_classes
        )
        if image_size % 4:
            raise ConfigurationError(
                f"image_size must be divisible by 4 (two 2x2 max-pools); got image_size={image_size}. "
                "Pad or resize the images, e.g. to 28 or 8."
            )
        self.save_hyperparameters()
        self._input_shape = (in_channels, image_size, image_size)
        c2 = 2 * channels
        side = image_size // 4
        self.pipeline = nn.Sequential(
            nn.Sequential(nn.Conv2d(in_channels, channels, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(channels, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Conv2d(c2, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Flatten(), nn.Linear(c2 * side * side, hidden), nn.ReLU()),
            nn.Linear(hidden, num_classes),
        )

    @property
    @override
    def input_shape(self) -> tuple[int, ...]:
        return self._input_shape
