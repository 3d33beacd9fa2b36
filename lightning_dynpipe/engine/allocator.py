"""Keeps freed CPU memory in the process, so that a step's tensors reuse it instead of faulting in fresh pages.

PyTorch takes CPU tensors straight from ``malloc``. glibc's allocator maps blocks of at least ``M_MMAP_THRESHOLD``
(128 KiB at first, raised as such blocks are freed) with ``mmap`` and unmaps them when they are freed, and it gives
free memory at the top of its heap back to the system once there is more than ``M_TRIM_THRESHOLD`` (twice the mmap
threshold). A pipeline stage allocates and frees every micro-batch's activations and gradients, tens of KiB to
several MiB each, so in a fresh process that memory keeps going back to the system and coming back as page faults.
On the throughput benchmark's MLP (2 stages on 2 cores), the only fit of a fresh process took 70-1,750 minor page
faults per step, and its samples/s were about 10% below the same fit with both thresholds fixed (13-32 faults per
step; two runs, 3 and 4 fits each way). A second fit in the same process did not fault: by then the heap is
fragmented enough that it is not trimmed. ``benchmarks/results/2026-12-03-first-fit.md`` has the numbers, and
what this does not fix: the adaptive loop's move at the first check of a fresh process.

:func:`keep_freed_memory` fixes both thresholds with ``mallopt``: blocks below 32 MiB come from the heap, and up to
256 MiB of free memory stays in the process. Peak RSS changed by -1 to +11 MiB per stage process in those runs.
The strategy calls it in each CPU stage process at set-up (``DynPipeStrategy(keep_freed_cpu_memory=True)``, the
default). It is a process-wide setting of the C library. Nothing changes where the C library is not glibc (musl,
macOS, Windows).
"""

from __future__ import annotations

import ctypes
import logging
import sys

__all__ = ["keep_freed_memory", "MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES"]

log = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks below this come from the heap (glibc's largest mmap threshold on 64-bit systems)."""
TRIM_THRESHOLD_BYTES = 256 << 20
"""Free memory at the top of the heap kept in the process before any is given back."""

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(mmap_threshold: int = MMAP_THRESHOLD_BYTES, trim_threshold: int = TRIM_THRESHOLD_BYTES) -> bool:
    """Sets glibc's ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` for this process; whether both were set.

    ``False`` (and nothing changed) where the C library is not glibc, or when glibc refuses a value (an mmap
    threshold above its maximum, for example).

    Example::

        keep_freed_memory()   # True on Linux with glibc
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library the process already uses
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl has mallopt but not these thresholds)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) != 1:
        log.debug("glibc refused M_MMAP_THRESHOLD=%d; the allocator is left as it was.", mmap_threshold)
        return False
    if mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)) != 1:
        log.debug("glibc refused M_TRIM_THRESHOLD=%d.", trim_threshold)
        return False
    return True
