"""One parameter's optimizer state as tensors on the wire: what checkpoints and re-assembly move, no pickle.

A parameter's state (``optimizer.state[p]``, e.g. Adam's ``step``, ``exp_avg``, ``exp_avg_sq``) travels as one
message of the engine's wire format (:mod:`~lightning_dynpipe.engine.wire`): a header naming the shapes and
dtypes, a uint8 tensor with the state's keys, then one tensor per key. The header's ``mb_idx`` carries the
parameter's canonical index, so a receiver that is out of step with its sender fails loudly instead of filling
one parameter's state with another's.

Every value comes back as it left: tensors with their dtype and shape (and on the CPU if they were there while
the stage computes elsewhere, as Adam keeps ``step``), Python ``int``/``float``/``bool`` as the same type and
value, ``None`` as ``None``; "no state" and "an empty state" stay distinct. Anything else (lists, nested
dicts) is refused with the parameter named.

Pure torch plus :class:`~lightning_dynpipe.engine.collectives.Collectives`: no Lightning.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_dynpipe.engine.collectives import Collectives
from lightning_dynpipe.engine.p2p import decode_text, encode_text
from lightning_dynpipe.engine.wire import HEADER_LEN, MAX_TENSORS, MessageKind, decode, encode
from lightning_dynpipe.errors import CommunicationError, ConfigurationError

__all__ = ["pack_state", "unpack_state", "send_state", "recv_state", "broadcast_state", "MAX_STATE_ENTRIES"]

MAX_STATE_ENTRIES = MAX_TENSORS - 1
"""The most entries one parameter's optimizer state may have (one wire slot carries the key names)."""

# one-letter type tags in front of each key name
_TENSOR, _CPU_TENSOR, _INT, _FLOAT, _BOOL, _NONE = "t", "c", "i", "f", "b", "n"


def pack_state(state: Mapping[Any, Any] | None, device: torch.device, canonical_idx: int) -> list[Tensor | None]:
    """``[key names, value, ...]`` for one parameter's state (``[]`` when it has none), tensors on ``device``.

    Raises:
        ConfigurationError: a key that is not a string, more than :data:`MAX_STATE_ENTRIES` entries, or a value
            that is neither a tensor, a Python number, a bool nor ``None``.
    """
    if state is None:
        return []
    if len(state) > MAX_STATE_ENTRIES:
        raise ConfigurationError(
            f"The optimizer state of parameter {canonical_idx} (its index in the plain optimizer) has {len(state)} "
            f"entries ({sorted(map(str, state))}); DynPipe moves at most {MAX_STATE_ENTRIES} per parameter. Use an "
            "optimizer with fewer state entries per parameter."
        )
    names: list[str] = []
    values: list[Tensor | None] = []
    for key, value in state.items():
        if not isinstance(key, str) or "\n" in key:
            raise ConfigurationError(
                f"The optimizer state of parameter {canonical_idx} has the key {key!r}; DynPipe moves optimizer state "
                "keyed by strings (as every torch.optim optimizer keys it)."
            )
        if isinstance(value, Tensor):
            on_cpu = value.device.type == "cpu" and device.type != "cpu"
            names.append((_CPU_TENSOR if on_cpu else _TENSOR) + key)
            values.append(value.detach().to(device).contiguous())
        elif isinstance(value, bool):
            names.append(_BOOL + key)
            values.append(torch.tensor(value, dtype=torch.bool, device=device))
        elif isinstance(value, int):
            names.append(_INT + key)
            values.append(torch.tensor(value, dtype=torch.int64, device=device))
        elif isinstance(value, float):
            names.append(_FLOAT + key)
            values.append(torch.tensor(value, dtype=torch.float64, device=device))
        elif value is None:
            names.append(_NONE + key)
            values.append(None)
        else:
            raise ConfigurationError(
                f"The optimizer state of parameter {canonical_idx} holds {key!r} of type {type(value).__name__}; "
                "DynPipe moves optimizer state made of tensors, Python numbers and None (every torch.optim optimizer "
                "but LBFGS). Use such an optimizer."
            )
    return [encode_text("\n".join(names)).to(device), *values]


def unpack_state(tensors: list[Tensor | None]) -> dict[str, Any] | None:
    """Inverse of :func:`pack_state`."""
    if not tensors:
        return None
    names_t, *values = tensors
    assert names_t is not None
    text = decode_text(names_t).strip()
    state: dict[str, Any] = {}
    for name, value in zip(text.split("\n") if text else [], values):
        tag, key = name[0], sys.intern(name[1:])  # shared key objects, as in the optimizer: same bytes saved
        if tag == _NONE:
            state[key] = None
            continue
        assert value is not None
        if tag == _TENSOR:
            state[key] = value
        elif tag == _CPU_TENSOR:
            state[key] = value.cpu()
        elif tag == _BOOL:
            state[key] = bool(value.item())
        elif tag == _INT:
            state[key] = int(value.item())
        elif tag == _FLOAT:
            state[key] = float(value.item())
        else:
            raise CommunicationError(f"Unknown optimizer-state tag {tag!r} in {text!r}: the stages run different code.")
    return state


def _header(tensors: list[Tensor | None], canonical_idx: int, device: torch.device) -> Tensor:
    return encode(MessageKind.OPTIMIZER_STATE, canonical_idx, tensors).to(device)


def _receive(header_t: Tensor, canonical_idx: int, device: torch.device, get: Any) -> list[Tensor | None]:
    header = decode(header_t)
    if header.kind != MessageKind.OPTIMIZER_STATE or header.mb_idx != canonical_idx:
        raise CommunicationError(
            f"Expected the optimizer state of parameter {canonical_idx}, received {header.kind.name} for "
            f"{header.mb_idx}: the stages walk different parameter lists (build the same model and optimizer on "
            "every rank)."
        )
    out: list[Tensor | None] = []
    for spec in header.specs:
        if spec is None:
            out.append(None)
            continue
        t = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        get(t)
        out.append(t)
    return out


def send_state(
    coll: Collectives, state: Mapping[Any, Any] | None, canonical_idx: int, dst: int, device: torch.device
) -> int:
    """Sends one parameter's state (``None``: it has none) to ``dst``; returns the bytes of its values."""
    tensors = pack_state(state, device, canonical_idx)
    coll.send(_header(tensors, canonical_idx, device), dst)
    for t in tensors:
        if t is not None:
            coll.send(t, dst)
    return sum(t.numel() * t.element_size() for t in tensors[1:] if t is not None)


def recv_state(coll: Collectives, canonical_idx: int, src: int, device: torch.device) -> dict[str, Any] | None:
    """Receives what :func:`send_state` sent for ``canonical_idx`` from ``src``."""
    header_t = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    coll.recv(header_t, src)
    return unpack_state(_receive(header_t, canonical_idx, device, lambda t: coll.recv(t, src)))


def broadcast_state(
    coll: Collectives, state: Mapping[Any, Any] | None, canonical_idx: int, src: int, device: torch.device
) -> dict[str, Any] | None:
    """Every member ends with ``src``'s state of ``canonical_idx`` (``src`` passes it, the others ``None``; ``src``
    gets a shallow copy of its own dict back)."""
    if coll.rank == src:
        tensors = pack_state(state, device, canonical_idx)
        coll.broadcast(_header(tensors, canonical_idx, device), src)
        for t in tensors:
            if t is not None:
                coll.broadcast(t, src)
        return None if state is None else dict(state)
    header_t = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    coll.broadcast(header_t, src)
    return unpack_state(_receive(header_t, canonical_idx, device, lambda t: coll.broadcast(t, src)))
