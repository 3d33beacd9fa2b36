"""Unit tests of the character GPT demo and its standard-library text data: single process, a few seconds in all."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import lightning_dynpipe.__main__ as entry
from lightning_dynpipe.demos import CharGPT, StdlibTextDataModule
from lightning_dynpipe.demos.gpt import Block, LMHead, Rotary, TokenEmbedding
from lightning_dynpipe.demos.text import read_stdlib_sources, stdlib_source_files
from lightning_dynpipe.errors import ConfigurationError

TINY = dict(block_size=16, d_model=32, n_layers=2, n_heads=4, dropout=0.0)
NON_PERSISTENT = ("attn.mask", "attn.rotary.inv_freq", "attn.rotary.cos", "attn.rotary.sin")


def _tiny(**overrides: Any) -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(**{**TINY, **overrides})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- the model
def test_pipeline_units_and_shapes() -> None:
    model = _tiny()
    units = list(model.pipeline)
    assert model.num_layers == len(units) == TINY["n_layers"] + 2
    assert isinstance(units[0], TokenEmbedding) and isinstance(units[-1], LMHead)
    assert all(isinstance(u, Block) for u in units[1:-1])
    assert {id(p) for p in model.parameters()} == {id(p) for p in model.pipeline.parameters()}
    x = model.example_input(3)
    assert x.shape == (3, 16) and x.dtype == torch.int64
    h = units[0](x)
    assert h.shape == (3, 16, 32)
    for block in units[1:-1]:
        h = block(h)
        assert h.shape == (3, 16, 32)
    logits = units[-1](h)
    assert logits.shape == (3, 16, 256)
    torch.testing.assert_close(model(x), logits, rtol=0, atol=0)
    assert model(x[:, :5]).shape == (3, 5, 256)  # shorter sequences than block_size


def test_example_input_is_repeatable_random_tokens() -> None:
    model = _tiny()
    a, b = model.example_input(4), model.example_input(4)
    assert torch.equal(a, b)  # every process profiles the same tokens
    assert 0 <= int(a.min()) and int(a.max()) < 256 and a.unique().numel() > 20
    assert model.example_input_array.shape == (2, 16) and model.example_input_array.dtype == torch.int64


def test_mask_and_rotary_tables_are_non_persistent_buffers() -> None:
    model = _tiny()
    buffers = dict(model.named_buffers())
    for i in range(1, TINY["n_layers"] + 1):
        for name in NON_PERSISTENT:
            assert f"pipeline.{i}.{name}" in buffers
    state = model.state_dict()
    assert not [k for k in state if k.endswith(NON_PERSISTENT)]
    assert set(state) == {n for n, _ in model.named_parameters()}  # nothing else is saved
    mask = model.pipeline[1].attn.mask
    assert mask.dtype == torch.bool and torch.equal(mask[0, 0], torch.tril(torch.ones(16, 16, dtype=torch.bool)))


def test_rotary_rotates_by_position() -> None:
    rope = Rotary(head_dim=8, max_len=10)
    torch.testing.assert_close(rope.inv_freq, 10_000 ** (-torch.arange(0, 8, 2) / 8))
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    qs, ks = rope(q.expand(1, 1, 10, 8)), rope(k.expand(1, 1, 10, 8))
    torch.testing.assert_close(qs.norm(dim=-1), q.norm(dim=-1).expand(1, 1, 10))  # a rotation
    torch.testing.assert_close(qs[..., 0, :], q[..., 0, :])  # position 0 is not rotated
    # The attention score depends on the distance between positions only: <q_m, k_n> = <q_m+s, k_n+s>.
    scores = qs[0, 0] @ ks[0, 0].T
    torch.testing.assert_close(scores[2, 5], scores[6, 9])
    torch.testing.assert_close(scores[7, 1], scores[8, 2])
    assert not torch.allclose(scores[2, 5], scores[2, 6])


def test_attention_is_causal() -> None:
    model = _tiny().eval()
    x = model.example_input(2)
    t = 9
    changed = x.clone()
    changed[:, t] = (changed[:, t] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)  # the past does not see the future
    assert not torch.allclose(a[:, t:], b[:, t:])  # position t and later do


def test_forward_runs_on_meta() -> None:
    """Lightning's model summary runs example_input_array through the pipeline on ``meta`` under DynPipe."""
    model = _tiny().to("meta")
    out = model(model.example_input_array.to("meta"))
    assert out.device.type == "meta" and out.shape == (2, 16, 256)


def test_weights_are_untied_by_default_and_tied_on_request() -> None:
    untied, tied = _tiny(), _tiny(tie_weights=True)
    assert untied.pipeline[-1].proj.weight is not untied.pipeline[0].tok.weight
    assert tied.pipeline[-1].proj.weight is tied.pipeline[0].tok.weight
    n = sum(p.numel() for p in untied.parameters())
    assert sum(p.numel() for p in tied.parameters()) == n - 256 * 32


@pytest.mark.parametrize("tie_weights", [False, True])
def test_adamw_groups_cover_every_parameter_once(tie_weights: bool) -> None:
    model = _tiny(tie_weights=tie_weights)
    opt = model.configure_optimizers()
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    embedding = model.pipeline[0].tok.weight
    assert {id(p) for p in decay["params"]} == linear - {id(embedding)}
    assert all(p.ndim == 2 for p in decay["params"])
    assert any(p is embedding for p in no_decay["params"])
    ln_and_bias = [p for n, p in model.named_parameters() if n.endswith("bias") or ".ln_" in n]
    assert ln_and_bias and all(any(p is q for q in no_decay["params"]) for p in ln_and_bias)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"d_model": 30, "n_heads": 4}, r"d_model must be divisible by n_heads.*d_model=30, n_heads=4. Try n_heads="),
        ({"d_model": 12, "n_heads": 4}, r"even head size.*head size 3"),
        ({"n_layers": 0}, r"positive integers: \{'n_layers': 0\}"),
        ({"dropout": 1.0}, r"dropout must lie in \[0, 1\); got dropout=1.0"),
        ({"lr": 0.0}, r"lr must be positive; got lr=0.0"),
        ({"weight_decay": -0.1}, r"weight_decay must be 0 or more"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        CharGPT(**kwargs)


def test_few_steps_of_plain_training_reduce_the_loss(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    model = CharGPT(**{**TINY, "lr": 3e-3})  # type: ignore[arg-type]
    data = StdlibTextDataModule(block_size=16, batch_size=16, max_bytes=300_000, val_windows=64)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=40,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    first = trainer.validate(model, data, verbose=False)[0]
    before = first["val_loss"]
    assert abs(before - math.log(256)) < 0.1  # small initial weights: close to uniform over the bytes
    trainer.fit(model, data)
    last = trainer.validate(model, data, verbose=False)[0]
    after = last["val_loss"]
    # Seeds 0-3 give 5.53-5.58 -> 3.20-3.20 (40 steps learn the byte frequencies; 3.01 nats is the unigram
    # entropy of this validation split).
    assert after < before - 1.5, (before, after)
    # the next-byte accuracy: near chance (1/256) before, the most frequent bytes (the space first) after
    assert first["val_acc"] < 0.05 < 0.1 < last["val_acc"] <= 1.0, (first["val_acc"], last["val_acc"])


def test_plan_command_profiles_the_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``python -m lightning_dynpipe plan`` builds its sample from ``example_input()`` (token ids)."""
    status = entry.dispatch(
        [
            "plan",
            "--model",
            "lightning_dynpipe.demos:CharGPT",
            "--init-args",
            '{"block_size": 16, "d_model": 32, "n_layers": 2}',
            "--devices",
            "2",
            "--batch-size",
            "8",
            "--timeline",
            str(tmp_path / "timeline.png"),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "Per-layer profile (micro-batch of 2)" in out and "partition=[" in out


# ---------------------------------------------------------------------------------------------- the data
def _fake_stdlib(root: Path) -> dict[str, bytes]:
    files = {
        "b.py": b"B" * 30,
        "a.py": b"A" * 30,
        "pkg/c.py": b"C" * 30,
        "pkg/d.txt": b"not python",
        "site-packages/e.py": b"installed, not the library",
        "z.py": bytes(range(256)),
    }
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def test_reads_the_library_sources_in_path_order(tmp_path: Path) -> None:
    files = _fake_stdlib(tmp_path)
    assert read_stdlib_sources(1000, tmp_path) == files["a.py"] + files["b.py"] + files["pkg/c.py"] + files["z.py"]
    assert read_stdlib_sources(45, tmp_path) == b"A" * 30 + b"B" * 15
    shuffled = read_stdlib_sources(1000, tmp_path, shuffle_seed=0)
    assert sorted(shuffled) == sorted(read_stdlib_sources(1000, tmp_path))
    assert shuffled == read_stdlib_sources(1000, tmp_path, shuffle_seed=0)


def test_the_real_library_is_read_without_installed_packages() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_source_files()
    assert len(files) > 500 and root / "os.py" in files
    assert not [f for f in files if {"site-packages", "dist-packages"} & set(f.relative_to(root).parts)]
    expected = b""
    for f in files:
        if len(expected) >= 200_000:
            break
        expected += f.read_bytes()
    assert read_stdlib_sources(200_000) == expected[:200_000]  # path order: __future__.py first


def _batches(loader: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(loader)


@pytest.mark.parametrize("fake", [False, True], ids=["stdlib", "tmp"])
def test_windows_are_deterministic_and_shifted_by_one(fake: bool, tmp_path: Path) -> None:
    kwargs: dict[str, Any] = dict(block_size=8, batch_size=4, max_bytes=100_000, train_windows=12, val_windows=10)
    if fake:
        _fake_stdlib(tmp_path)
        kwargs["root"] = str(tmp_path)
    a, b = StdlibTextDataModule(**kwargs), StdlibTextDataModule(**kwargs)
    other = StdlibTextDataModule(**{**kwargs, "seed": 1})
    for dm in (a, b, other):
        dm.setup()
    train_a, train_b = _batches(a.train_dataloader()), _batches(b.train_dataloader())
    assert len(train_a) == len(a.train_set) // 4  # drop_last
    for (xa, ya), (xb, yb) in zip(train_a, train_b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)  # every process sees the same batches
        assert xa.shape == ya.shape == (4, 8) and xa.dtype == ya.dtype == torch.int64
        assert torch.equal(xa[:, 1:], ya[:, :-1])  # y is x shifted by one byte
    val_a = _batches(a.val_dataloader())
    assert sum(len(x) for x, _ in val_a) == 10
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(val_a, _batches(b.val_dataloader())))
    assert not torch.equal(train_a[0][0], _batches(other.train_dataloader())[0][0])


def test_validation_is_the_tail_of_the_corpus(tmp_path: Path) -> None:
    _fake_stdlib(tmp_path)  # 346 bytes: a.py, b.py, pkg/c.py (30 each), then z.py = bytes 0..255
    dm = StdlibTextDataModule(
        block_size=8, batch_size=2, val_fraction=0.5, train_windows=20, root=str(tmp_path), shuffle_files=False
    )
    dm.setup()
    corpus = read_stdlib_sources(10**6, tmp_path)
    n_val = int(len(corpus) * 0.5)
    assert bytes(dm.train_set.tokens.tolist()) == corpus[:-n_val]
    assert bytes(dm.val_set.tokens.tolist()) == corpus[-n_val:]
    for x, y in dm.val_set:
        start = int(x[0])  # the tail is inside z.py, where each byte equals its position's value
        assert torch.equal(x, torch.arange(start, start + 8)) and torch.equal(y, x + 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"val_fraction": 0.0}, r"val_fraction must lie strictly between 0 and 1"),
        ({"batch_size": 0}, r"positive integers: \{'batch_size': 0\}"),
    ],
)
def test_bad_data_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        StdlibTextDataModule(**kwargs)


def test_too_little_text_is_explained(tmp_path: Path) -> None:
    _fake_stdlib(tmp_path)
    with pytest.raises(ConfigurationError, match=r"at least block_size \+ 1 = 65 bytes.*Raise max_bytes"):
        StdlibTextDataModule(block_size=64, max_bytes=100, root=str(tmp_path)).setup()
    with pytest.raises(ConfigurationError, match=r"needs at least batch_size=32 windows; got 3"):
        StdlibTextDataModule(block_size=8, batch_size=32, train_windows=3, root=str(tmp_path)).setup()
