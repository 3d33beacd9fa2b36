"""The wire format of stage-to-stage messages: a fixed int64 header, then the tensors, no pickle.

A message carries a tuple of up to :data:`MAX_TENSORS` tensors (an absent gradient is encoded as
``dtype_code == -1``). The header says what follows so that shapes are negotiated per message instead of
assumed: the last micro-batch of an epoch may be smaller, and stage outputs may change shape.

Header layout (``HEADER_LEN`` int64 values)::

    [0] MAGIC   [1] kind   [2] mb_idx   [3] num_tensors   [4] aux (float64 bits)   [5] is_tuple
    [6..7] reserved
    then per tensor, SLOT values: [dtype_code, requires_grad, ndim, dim_0 .. dim_{MAX_DIMS-1}]
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

__all__ = ["MessageKind", "TensorSpec", "Header", "HEADER_LEN", "MAX_TENSORS", "MAX_DIMS", "encode", "decode"]

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
    OPTIMIZER_STATE = 6  # mb_idx = canonical parameter index; key names (uint8), then one tensor per key


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
