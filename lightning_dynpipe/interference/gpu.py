"""GPU contention: a background matmul loop on a CUDA device, on its own stream, with a duty cycle."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from lightning_dynpipe.interference.base import (
    InterferenceConfigError,
    InterferenceError,
    InterferenceUnavailable,
    Lifecycle,
    check_fraction,
)

if TYPE_CHECKING:
    import torch

__all__ = ["GpuContention"]

log = logging.getLogger(__name__)


class GpuContention(Lifecycle):
    """Keeps a CUDA device busy with matrix multiplications for ``duty_cycle`` of each period.

    Example::

        with GpuContention(device="cuda:0", duty_cycle=0.5):
            train_some_steps()          # the stage on cuda:0 shares its SMs and memory bandwidth

    A daemon thread (so it cannot outlive the process) runs ``size x size`` matmuls on a stream of its own,
    synchronising after each so the busy time is real GPU time, then sleeps for the rest of the period.
    :meth:`stop` is idempotent and also runs when the object is garbage-collected.

    Args:
        device: the CUDA device (``"cuda"``, ``"cuda:1"``, ``1`` or a ``torch.device``).
        duty_cycle: share of each period the device is kept busy, in (0, 1].
        period_s: length of one busy + idle cycle in seconds.
        size: matrix side; 4096 float32 matrices take 192 MiB.

    Raises:
        InterferenceUnavailable: from :meth:`start`, when CUDA is not available (CPU-only build or no GPU).
    """

    def __init__(self, device: Any = "cuda", duty_cycle: float = 1.0, period_s: float = 0.05, size: int = 4096) -> None:
        self.device = device
        self.duty_cycle = check_fraction(
            "duty_cycle",
            duty_cycle,
            0.0,
            1.0,
            "Use 1.0 to keep the GPU busy all the time, 0.5 for half of each period.",
        )
        self.period_s = check_fraction("period_s", period_s, 0.0, 60.0, "Use e.g. 0.05 (50 ms).")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InterferenceConfigError(
                f"size must be a positive integer; got {size!r}. Use e.g. 4096.", field="size"
            )
        self.size = size
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._finalizer: weakref.finalize[..., GpuContention] | None = None

    def __repr__(self) -> str:
        return f"GpuContention(device={self.device!r}, duty_cycle={self.duty_cycle:g}, period_s={self.period_s:g})"

    @property
    def active(self) -> bool:
        """Whether the matmul thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def _resolve_device(self) -> torch.device:
        import torch

        if not torch.cuda.is_available():
            raise InterferenceUnavailable(
                f"GpuContention needs CUDA, which is not available here (torch {torch.__version__}, "
                f"torch.cuda.is_available() is False: a CPU-only build or no visible GPU). Run on a machine with a "
                "GPU, or use CpuHog / CpuLimit to slow a CPU stage instead."
            )
        try:
            dev = torch.device(self.device) if not isinstance(self.device, int) else torch.device("cuda", self.device)
        except (RuntimeError, TypeError) as exc:
            raise InterferenceConfigError(
                f"GpuContention device {self.device!r} is not a device: {exc}. Use e.g. 'cuda:0'.", field="device"
            ) from None
        if dev.type != "cuda":
            raise InterferenceConfigError(
                f"GpuContention device must be a CUDA device; got {self.device!r}. Use e.g. "
                "'cuda:0', or CpuHog for a CPU stage.",
                field="device",
            )
        count = torch.cuda.device_count()
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if not 0 <= index < count:
            raise InterferenceConfigError(
                f"GpuContention device {self.device!r} does not exist: {count} CUDA "
                f"device(s) are visible (0..{count - 1}).",
                field="device",
            )
        return torch.device("cuda", index)

    def start(self) -> None:
        """Starts the matmul thread once its matrices are allocated; a no-op if already running.

        Raises:
            InterferenceUnavailable: CUDA is not available.
            InterferenceError: the thread could not allocate or run (e.g. out of memory).
        """
        if self.active:
            return
        dev = self._resolve_device()
        self._stop_event = threading.Event()
        errors: list[BaseException] = []
        ready = threading.Event()
        busy = self.duty_cycle * self.period_s
        # The thread gets no reference to self, so garbage collection can run the finaliser that stops it.
        self._thread = threading.Thread(
            target=_matmul_loop,
            args=(dev, self.size, busy, self.period_s - busy, ready, self._stop_event, errors),
            name=f"dynpipe-gpu-contention[{dev}]",
            daemon=True,
        )
        self._finalizer = weakref.finalize(self, self._stop_event.set)
        self._thread.start()
        ready.wait()
        if errors:
            self.stop()
            raise InterferenceError(
                f"{self!r} could not start: {errors[0]!r}. Lower size (now {self.size}) if the device is out of memory."
            ) from errors[0]
        log.debug("%r started", self)

    def stop(self) -> None:
        """Stops the matmul thread and waits for it; idempotent."""
        self._stop_event.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(10.0)
            if thread.is_alive():  # pragma: no cover - a kernel that takes longer than 10 s
                log.warning("%r: the matmul thread did not stop within 10 s (daemon: it ends with the process).", self)


def _matmul_loop(
    dev: torch.device,
    size: int,
    busy: float,
    idle: float,
    ready: threading.Event,
    stop: threading.Event,
    errors: list[BaseException],
) -> None:
    import torch

    try:
        torch.cuda.set_device(dev)
        stream = torch.cuda.Stream(dev)
        with torch.cuda.stream(stream):
            a = torch.randn(size, size, device=dev)
            b = torch.randn(size, size, device=dev)
            c = torch.empty_like(a)
        stream.synchronize()
    except BaseException as exc:  # reported by start()
        errors.append(exc)
        ready.set()
        return
    ready.set()
    try:
        with torch.cuda.stream(stream):
            while not stop.is_set():
                end = time.perf_counter() + busy
                while time.perf_counter() < end and not stop.is_set():
                    torch.matmul(a, b, out=c)
                    stream.synchronize()  # so the busy time is GPU time, not a growing queue
                if idle > 0:
                    stop.wait(idle)
    except BaseException as exc:  # pragma: no cover - device errors while running
        log.error("GPU contention on %s stopped on an error: %r", dev, exc)
    finally:
        del a, b, c
