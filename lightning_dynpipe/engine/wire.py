"""The wire format of stage-to-stage messages: a fixed int64 header, then the tensors, no pickle.

A message carries a tuple of up to :data:`MAX_TENSORS` tensors (an absent gradient is encoded as
``dtype_code == -1``). The header says what follows so that shapes are negotiated per message instead of
assumed: the last micro-batch of an epoch may be smaller, and stage outputs may change shape.

Header layout (``HEADER_LEN`` int64 values)::

    [0] MAGIC   [1] kind   [2] mb_idx   [3] num_tensors   [4] aux (float64 bits)   [5] is_tuple
    [6] the sender's clock when it sent the message (float64 bits of ``time.time()``; packed messages)
    [7] when the message may be delivered (float64 bits of ``time.time()``; 0: at once), set by an emulated link
        (:class:`~lightning_dynpipe.interference.LinkDelay`) and honoured by the receiver
    then per tensor, SLOT values: [dtype_code, requires_grad, ndim, dim_0 .. dim_{MAX_DIMS-1}]

On CPU (gloo) a message travels **packed**: one ``uint8`` buffer holding the header's bytes and then each
tensor's bytes at a 16-byte aligned offset (:func:`pack`, :func:`unpack`), at least :data:`MIN_MESSAGE` bytes.
One buffer per message lets the receiver keep its next receives posted before the data arrives (see
:mod:`lightning_dynpipe.engine.p2p`). On CUDA the header and each tensor are separate messages.
"""

from __future__ import annotations

import array
import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_dynpipe.errors import CommunicationError

__all__ = [
    "MessageKind",
    "TensorSpec",
    "Header",
    "HEADER_LEN",
    "HEADER_BYTES",
    "MIN_MESSAGE",
    "MAX_TENSORS",
    "MAX_DIMS",
    "encode",
    "decode",
    "message_size",
    "pack",
    "unpack",
    "sent_at",
    "not_before",
    "stamp_not_before",
]

MAGIC = 0x44594E50  # "DYNP"
MAX_TENSORS = 12
MAX_DIMS = 7
SLOT = 3 + MAX_DIMS
PREFIX = 8
HEADER_LEN = PREFIX + MAX_TENSORS * SLOT

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


class MessageKind(enum.IntEnum):
    """What a message carries."""

    ACTIVATION = 1
    GRADIENT = 2
    EVAL_ACTIVATION = 3
    CLOSE = 4
    ABORT = 5  # mb_idx = failed stage, aux = its global rank, one uint8 tensor = UTF-8 description
    RESIZE = 6  # packed messages only: aux = the size in bytes of the messages that follow; no tensors
    OPTIMIZER_STATE = 7  # mb_idx = canonical parameter index; key names (uint8), then one tensor per key


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and autograd flag of one tensor on the wire."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


@dataclass(frozen=True)
class Header:
    """A decoded header: what follows and for which micro-batch."""

    kind: MessageKind
    mb_idx: int
    specs: tuple[TensorSpec | None, ...]
    aux: float
    is_tuple: bool = False


HEADER_BYTES = HEADER_LEN * 8
"""Bytes of a header (its int64 values)."""
ALIGN = 16
"""Alignment of each tensor's bytes in a packed message (any dtype's element size divides it)."""
MIN_MESSAGE = HEADER_BYTES + 1024
"""The smallest packed message: room for a header and a failure description of up to 1 KiB."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def message_size(tensors: Sequence[Tensor]) -> int:
    """Bytes of the packed message carrying ``tensors`` (the ones present), at least :data:`MIN_MESSAGE`."""
    return max(MIN_MESSAGE, HEADER_BYTES + sum(_aligned(t.numel() * t.element_size()) for t in tensors))


def pack(
    header: Tensor,
    tensors: Sequence[Tensor],
    size: int,
    sent_at: float,
    not_before: float = 0.0,
    out: Tensor | None = None,
) -> Tensor:
    """One ``uint8`` buffer of ``size`` bytes: ``header`` (with ``sent_at`` and ``not_before`` written in) and
    ``tensors``' bytes.

    ``tensors`` are the present ones, contiguous, on one device; ``size`` is at least their
    :func:`message_size` (a larger buffer is padded, which is how control messages keep the receiver's size).
    ``out``: a ``uint8`` buffer of ``size`` bytes on that device to write into (a sender's buffer whose earlier
    send has completed) instead of a new one. The times are written into ``header`` (a CPU tensor) too.
    """
    device = tensors[0].device if tensors else torch.device("cpu")
    if out is not None and (out.dtype != torch.uint8 or out.numel() != size or out.device != device):
        raise ValueError(f"pack's out must be a uint8 buffer of {size} bytes on {device}; got {out.dtype} "
                         f"{out.numel()} bytes on {out.device}.")  # fmt: skip
    buf = torch.empty(size, dtype=torch.uint8, device=device) if out is None else out
    values = header.numpy()  # the header's own memory: two stores, then one copy of the whole header
    values[6], values[7] = _bits(sent_at), _bits(not_before)
    buf[:HEADER_BYTES].copy_(header.view(torch.uint8))
    offset = HEADER_BYTES
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            buf[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8))
        offset += _aligned(n)
    if offset > size:
        raise CommunicationError(f"A packed message needs {offset} bytes but its buffer has {size}.")
    return buf


def _bits(value: float) -> int:
    return int(struct.unpack("=q", struct.pack("=d", float(value)))[0])


def _float(bits: int) -> float:
    return float(struct.unpack("=d", struct.pack("=q", int(bits)))[0])


def sent_at(header: Tensor) -> float:
    """The sender's clock in a packed message's header (value [6])."""
    return _float(int(header[6]))


def not_before(header: Tensor) -> float:
    """When the message may be delivered (value [7], the sender's ``time.time()``); 0: at once.

    Example::

        >>> h = encode(MessageKind.ACTIVATION, 0, [])
        >>> not_before(h)
        0.0
        >>> stamp_not_before(h, 12.5)
        >>> not_before(h)
        12.5
    """
    return _float(int(header[7]))


def stamp_not_before(header: Tensor, when: float) -> None:
    """Writes :func:`not_before` into an encoded header (int64 values, on the CPU)."""
    header[7] = _bits(when)


def unpack(buf: Tensor, header: Header) -> list[Tensor | None]:
    """The tensors of a packed message, as views of ``buf`` detached from it (no copy)."""
    tensors: list[Tensor | None] = []
    offset = HEADER_BYTES
    for spec in header.specs:
        if spec is None:
            tensors.append(None)
            continue
        numel = 1
        for d in spec.shape:
            numel *= d
        n = numel * spec.dtype.itemsize
        if offset + n > buf.numel():
            raise CommunicationError(
                f"A pipeline message of {buf.numel()} bytes is too short for its header's tensors ({offset + n} "
                "bytes): the stages are out of step, usually because another stage failed first."
            )
        tensors.append(buf[offset : offset + n].view(spec.dtype).view(spec.shape).detach())
        offset += _aligned(n)
    return tensors


_TEMPLATES: dict[tuple[object, ...], bytes] = {}
"""Header values by (kind, is_tuple, per tensor: dtype, requires_grad, shape), without mb_idx and aux."""
_MAX_TEMPLATES = 256
_INT64 = 8  # bytes per header value


def encode(
    kind: MessageKind,
    mb_idx: int,
    tensors: Sequence[Tensor | None],
    aux: float = float("nan"),
    is_tuple: bool = False,
) -> Tensor:
    """Builds the header tensor for ``tensors``; raises :class:`CommunicationError` for what cannot be sent.

    A pipeline sends the same shapes over and over, so the header of each combination of kind, dtypes,
    autograd flags and shapes is built once (as the bytes of its int64 values) and reused with the message's
    ``mb_idx`` and ``aux`` written in.
    """
    key = (
        int(kind),
        bool(is_tuple),
        *(None if t is None else (t.dtype, bool(t.requires_grad), tuple(t.shape)) for t in tensors),
    )
    template = _TEMPLATES.get(key)
    if template is None:
        template = array.array("q", _template(kind, tensors, is_tuple)).tobytes()
        if len(_TEMPLATES) >= _MAX_TEMPLATES:  # shapes that keep changing: do not grow without bound
            _TEMPLATES.clear()
        _TEMPLATES[key] = template
    buf = bytearray(template)
    struct.pack_into("=q", buf, 2 * _INT64, int(mb_idx))
    struct.pack_into("=d", buf, 4 * _INT64, float(aux))  # the float64's bits as value [4]
    return torch.frombuffer(buf, dtype=torch.int64)


def _template(kind: MessageKind, tensors: Sequence[Tensor | None], is_tuple: bool) -> list[int]:
    """The header values of ``tensors`` with ``mb_idx`` and ``aux`` left at 0; checks what can be sent."""
    if len(tensors) > MAX_TENSORS:
        raise CommunicationError(
            f"At most {MAX_TENSORS} tensors can cross a stage boundary; a layer output has {len(tensors)}. "
            "Concatenate them or move the boundary."
        )
    h = [0] * HEADER_LEN
    h[0], h[1], h[3] = MAGIC, int(kind), len(tensors)
    h[5] = int(is_tuple)
    for i, t in enumerate(tensors):
        base = PREFIX + i * SLOT
        if t is None:
            h[base] = -1
            continue
        if t.dtype not in _CODE:
            raise CommunicationError(
                f"Tensors of dtype {t.dtype} cannot cross a stage boundary; supported: "
                f"{', '.join(str(d) for d in _DTYPES)}."
            )
        if t.dim() > MAX_DIMS:
            raise CommunicationError(
                f"Tensors crossing a stage boundary may have at most {MAX_DIMS} dimensions; got shape "
                f"{tuple(t.shape)}. Reshape before the boundary."
            )
        h[base] = _CODE[t.dtype]
        h[base + 1] = int(t.requires_grad)
        h[base + 2] = t.dim()
        for d, size in enumerate(t.shape):
            h[base + 3 + d] = int(size)
    return h


def decode(header: Tensor) -> Header:
    """Parses a header tensor built by :func:`encode`."""
    h = header.tolist()
    if h[0] != MAGIC:
        raise CommunicationError(
            f"Received a malformed pipeline header (magic {h[0]:#x}, expected {MAGIC:#x}): the stages are out of "
            "step, usually because another stage failed first. Check all ranks' logs."
        )
    try:
        kind = MessageKind(h[1])
    except ValueError as exc:
        raise CommunicationError(f"Unknown pipeline message kind {h[1]}.") from exc
    specs: list[TensorSpec | None] = []
    for i in range(h[3]):
        base = PREFIX + i * SLOT
        code = h[base]
        if code == -1:
            specs.append(None)
            continue
        ndim = h[base + 2]
        specs.append(TensorSpec(_DTYPES[code], tuple(h[base + 3 : base + 3 + ndim]), bool(h[base + 1])))
    aux = struct.unpack("<d", struct.pack("<q", h[4]))[0]
    return Header(kind, h[2], tuple(specs), aux, bool(h[5]))
