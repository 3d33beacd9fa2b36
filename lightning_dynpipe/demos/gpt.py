"""A nanoGPT-style character (byte) language model that follows the DynPipe user contract.

``CharGPT.pipeline`` is ``nn.Sequential(TokenEmbedding, Block x n_layers, LMHead)``: ``n_layers + 2`` units, each
of which takes and returns one tensor (token ids ``(B, T)`` into the embedding, ``(B, T, d_model)`` between units,
logits ``(B, T, vocab_size)`` out of the head), so any contiguous range of them can be a pipeline stage.

The blocks are pre-LayerNorm (``x + attn(ln(x))``, ``x + mlp(ln(x))``) with causal self-attention and rotary
position embeddings (RoPE) on the queries and keys; there is no learned position embedding. Like real models,
each attention layer keeps derived constants as **non-persistent buffers** (``register_buffer(...,
persistent=False)``): the causal mask and the rotary ``inv_freq``, ``cos`` and ``sin`` tables. They are part of
the module (they move with ``.to()``) but not of its ``state_dict``, so checkpoints do not carry them.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_dynpipe.errors import ConfigurationError

__all__ = ["Block", "CausalSelfAttention", "CharGPT", "LMHead", "Rotary", "TokenEmbedding"]

_Batch = tuple[Tensor, Tensor]


class Rotary(nn.Module):
    """Rotary position embedding (Su et al., RoFormer) for ``(B, heads, T, head_dim)`` queries and keys.

    Feature pairs ``(i, i + head_dim/2)`` of position ``t`` are rotated by the angle ``t * inv_freq[i]`` with
    ``inv_freq[i] = base ** (-2i / head_dim)``. ``inv_freq`` and the ``cos``/``sin`` tables for positions
    ``0 .. max_len - 1`` are non-persistent buffers: derived from the constructor's arguments, never saved.

    Example::

        rope = Rotary(head_dim=32, max_len=64)
        q = rope(torch.randn(2, 4, 64, 32))     # same shape, positions encoded

    Args:
        head_dim: features per attention head; must be even.
        max_len: the longest sequence the tables cover.
        base: the wavelength base of the frequencies (10,000 as in the paper).
    """

    inv_freq: Tensor
    cos: Tensor
    sin: Tensor

    def __init__(self, head_dim: int, max_len: int, base: float = 10_000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ConfigurationError(
                f"Rotary embeddings rotate pairs of features, so head_dim must be even; got head_dim={head_dim}. "
                "Choose d_model and n_heads so that d_model // n_heads is even."
            )
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # (max_len, head_dim / 2)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    @override
    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[-2]
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with rotary queries and keys.

    The causal mask (``mask[0, 0, i, j]`` is ``True`` where position ``i`` may attend to ``j <= i``) is a
    non-persistent buffer of shape ``(1, 1, block_size, block_size)``.

    Example::

        attn = CausalSelfAttention(d_model=128, n_heads=4, block_size=64)
        y = attn(torch.randn(2, 64, 128))       # (2, 64, 128)

    Args:
        d_model: width of the residual stream; divisible by ``n_heads``.
        n_heads: attention heads.
        block_size: the longest sequence.
        dropout: dropout on the attention weights and on the output projection.
    """

    mask: Tensor

    def __init__(self, d_model: int, n_heads: int, block_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_dropout = nn.Dropout(dropout)
        self.rotary = Rotary(self.head_dim, block_size)
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool)).view(1, 1, block_size, block_size)
        self.register_buffer("mask", mask, persistent=False)

    @override
    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask[:, :, :t, :t], dropout_p=self.dropout if self.training else 0.0
        )
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, d)))  # type: ignore[no-any-return]


class Block(nn.Module):
    """A pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))`` (MLP 4x wide, GELU).

    Example::

        block = Block(d_model=128, n_heads=4, block_size=64)
        y = block(torch.randn(2, 64, 128))      # (2, 64, 128)

    Args: see :class:`CausalSelfAttention`.
    """

    def __init__(self, d_model: int, n_heads: int, block_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, block_size, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )

    @override
    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]


class TokenEmbedding(nn.Module):
    """The first pipeline unit: token ids ``(B, T)`` (int64) to embeddings ``(B, T, d_model)``, with dropout.

    Example::

        emb = TokenEmbedding(vocab_size=256, d_model=128)
        h = emb(torch.randint(0, 256, (2, 64)))  # (2, 64, 128)
    """

    def __init__(self, vocab_size: int, d_model: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.dropout = nn.Dropout(dropout)

    @override
    def forward(self, idx: Tensor) -> Tensor:
        return self.dropout(self.tok(idx))  # type: ignore[no-any-return]


class LMHead(nn.Module):
    """The last pipeline unit: the final LayerNorm and the projection to ``vocab_size`` logits (no bias).

    Example::

        head = LMHead(d_model=128, vocab_size=256)
        logits = head(torch.randn(2, 64, 128))  # (2, 64, 256)
    """

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(d_model)
        self.proj = nn.Linear(d_model, vocab_size, bias=False)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.ln_f(x))  # type: ignore[no-any-return]


class CharGPT(pl.LightningModule):
    """A nanoGPT-style byte-level language model whose units are the elements of ``self.pipeline``.

    ``pipeline = Sequential(TokenEmbedding, Block x n_layers, LMHead)`` (``n_layers + 2`` units). The loss is
    the next-token cross entropy, logged as ``train_loss`` and ``val_loss`` (nats per byte); validation also logs
    ``val_acc``, the share of bytes whose most likely prediction is the next byte. The optimizer is
    AdamW with two parameter groups, as in nanoGPT: weight decay on the weight matrices of the linear layers,
    none on biases, LayerNorm weights and the token embedding.

    Example::

        import lightning.pytorch as pl
        from lightning_dynpipe import DynPipeStrategy
        from lightning_dynpipe.demos import CharGPT, StdlibTextDataModule

        pl.seed_everything(0)
        model = CharGPT(block_size=64, d_model=128, n_layers=4)      # 6 units in model.pipeline
        data = StdlibTextDataModule(block_size=64, batch_size=32)
        trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=200,
                             strategy=DynPipeStrategy(num_microbatches=4))
        trainer.fit(model, datamodule=data)

    Args:
        vocab_size: number of token ids; 256 for bytes.
        block_size: the longest sequence (context length) the model takes.
        d_model: width of the residual stream.
        n_layers: transformer blocks.
        n_heads: attention heads per block; must divide ``d_model``, and ``d_model // n_heads`` must be even
            (rotary embeddings rotate pairs of features).
        dropout: dropout probability in ``[0, 1)`` on the embeddings, the attention weights and the residual
            branches.
        lr: AdamW learning rate (betas ``(0.9, 0.99)``, no schedule). 1e-3 rather than 3e-3: see
            ``docs/gpt-example.md``.
        weight_decay: AdamW weight decay of the decayed group (weight matrices).
        tie_weights: share one matrix between the token embedding and the head (``head.proj.weight is
            tok.weight``, as GPT-2 does). **Off by default**: the embedding and the head are the first and the
            last pipeline units, so with ``S > 1`` the shared matrix would have to live on two stages.
    """

    pipeline: nn.Sequential

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        dropout: float = 0.1,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        sizes = {
            "vocab_size": vocab_size,
            "block_size": block_size,
            "d_model": d_model,
            "n_layers": n_layers,
            "n_heads": n_heads,
        }
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ConfigurationError(f"These sizes must be positive integers: {bad}.")
        if d_model % n_heads:
            raise ConfigurationError(
                f"d_model must be divisible by n_heads (each head gets d_model // n_heads features); got "
                f"d_model={d_model}, n_heads={n_heads}. Try n_heads={_divisor_near(d_model, n_heads)}."
            )
        if (d_model // n_heads) % 2:
            raise ConfigurationError(
                f"Rotary embeddings need an even head size d_model // n_heads; got d_model={d_model}, "
                f"n_heads={n_heads} (head size {d_model // n_heads}). Use an even multiple of n_heads for d_model."
            )
        if not 0.0 <= dropout < 1.0:
            raise ConfigurationError(f"dropout must lie in [0, 1); got dropout={dropout}.")
        if lr <= 0:
            raise ConfigurationError(f"lr must be positive; got lr={lr}.")
        if weight_decay < 0:
            raise ConfigurationError(f"weight_decay must be 0 or more; got weight_decay={weight_decay}.")
        self.save_hyperparameters()
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.lr = lr
        self.weight_decay = weight_decay
        self.tie_weights = tie_weights
        embedding = TokenEmbedding(vocab_size, d_model, dropout)
        head = LMHead(d_model, vocab_size)
        blocks = [Block(d_model, n_heads, block_size, dropout) for _ in range(n_layers)]
        self.pipeline = nn.Sequential(embedding, *blocks, head)
        self.apply(self._init_weights)
        # GPT-2: scale the init of the projections that write into the residual stream by 1/sqrt(2 * n_layers).
        for block in blocks:
            for proj in (block.attn.proj, block.mlp[2]):
                assert isinstance(proj, nn.Linear)
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layers))
        if tie_weights:
            head.proj.weight = embedding.tok.weight
        self.example_input_array = torch.zeros(2, block_size, dtype=torch.long)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def num_layers(self) -> int:
        """Number of pipeline units, ``len(self.pipeline)`` (``n_layers + 2``)."""
        return len(self.pipeline)

    def example_input(self, batch_size: int = 2) -> Tensor:
        """A ``(batch_size, block_size)`` batch of random token ids, the same on every call (for profiling).

        Seeded, so every process profiles the same numbers; used by ``python -m lightning_dynpipe plan``.
        """
        generator = torch.Generator().manual_seed(0)
        return torch.randint(0, self.vocab_size, (batch_size, self.block_size), generator=generator)

    def pipeline_input(self, batch: _Batch) -> Tensor:
        """What stage 0 feeds into the pipeline: the input tokens ``x`` of a ``(x, y)`` batch."""
        return batch[0]

    @override
    def forward(self, idx: Tensor) -> Tensor:
        return self.pipeline(idx)  # type: ignore[no-any-return]

    def _logits_and_loss(self, batch: _Batch) -> tuple[Tensor, Tensor]:
        logits = self.pipeline(self.pipeline_input(batch))
        return logits, F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    @override
    def training_step(self, batch: _Batch, batch_idx: int) -> Tensor:
        _, loss = self._logits_and_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: _Batch, batch_idx: int) -> Tensor:
        logits, loss = self._logits_and_loss(batch)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == batch[1]).float().mean())
        return loss

    def parameter_groups(self) -> list[dict[str, Any]]:
        """The AdamW groups: ``[{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0}]``.

        Decayed: the weight of every ``nn.Linear``. Not decayed: biases, LayerNorm weights and the token
        embedding (with ``tie_weights`` the shared matrix counts as the embedding). Every parameter is in
        exactly one group.
        """
        embeddings = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        linear = {id(m.weight) for m in self.modules() if isinstance(m, nn.Linear)} - embeddings
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for p in self.parameters():  # unique parameters: a tied matrix once
            (decay if id(p) in linear else no_decay).append(p)
        return [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameter_groups(), lr=self.lr, betas=(0.9, 0.99))


def _divisor_near(n: int, target: int) -> int:
    """The divisor of ``n`` closest to ``target`` (for an error message's suggestion)."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - target), d))
