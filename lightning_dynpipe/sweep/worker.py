"""The calibration sweep's worker process: runs layer sets of the user's pipeline as a stage would.

Started as ``python -m lightning_dynpipe.sweep.worker FD`` (a fresh interpreter: nothing of the parent's threads or
process groups, and the user's script is not imported again) with one end of a private socket pair as ``FD``. It
receives the pipeline and one micro-batch (``torch.save`` bytes, written by the parent that started it), pins itself
to one core with one torch thread, and answers each command ``(first, stop, M, steps, other_per_mb)`` with the
:class:`~lightning_dynpipe.predictor.StageTimes` of that window, measured with the stage monitor's sampler.
"""

from __future__ import annotations

import io
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from lightning_dynpipe.engine.microbatch import iter_tensors, tree_map
from lightning_dynpipe.monitor.stats import StageSample, StageSummary
from lightning_dynpipe.predictor import StageTimes

__all__ = ["run_worker"]


def _stage_input(x: Any) -> Any:
    """``x`` as a stage receives it: detached tensors, floating ones requiring gradients."""
    return tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point() or t.is_complex()), x)


def _backward(out: Any) -> None:
    """A backward from every output that requires gradients (ones as their gradient)."""
    import torch

    outputs = [t for t in iter_tensors(out) if t.requires_grad]
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


@dataclass(frozen=True)
class _Step:
    """One step's times in the shape :meth:`StageSample.from_step` reads (no updates, no messages)."""

    forward_s: float
    backward_s: float
    step_s: float
    m: int
    optimizer_s: float = 0.0
    recv_wait_s: float = 0.0
    send_s: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    in_flight: int = 0
    stash_depth: int = 0

    @property
    def num_forward(self) -> int:
        return self.m

    @property
    def num_backward(self) -> int:
        return self.m

    @property
    def num_updates(self) -> int:
        return 0


def run_worker(conn: Connection, pipeline: Any, sample: Any, core: int, autocast_dtype: Any = None) -> None:
    """The worker's main loop (the target of a spawned process); ``None`` on ``conn`` ends it.

    Args:
        conn: the parent's end of the pipe: commands in, "ready" and then one ``StageTimes`` per window out.
        pipeline: the ``nn.Sequential`` (on the CPU).
        sample: one micro-batch of what ``pipeline[0]`` takes.
        core: the core to pin to.
        autocast_dtype: run the forwards under CPU autocast to this dtype (a mixed-precision run), or ``None``.
    """
    import torch

    from lightning_dynpipe.interference import pin_current_process
    from lightning_dynpipe.monitor.system import ProcessSampler

    pin_current_process([core])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pipeline.train()

    def autocast() -> Any:
        return torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()

    inputs = [sample]
    with torch.no_grad(), autocast():
        for layer in pipeline:
            inputs.append(layer(inputs[-1]))
    sampler = ProcessSampler(steal_interval_s=0.2)
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        first, stop, M, steps, other_per_mb = cmd
        sampler.refresh()  # the interference may have changed since the last window
        samples = []
        for _ in range(steps + 1):  # the first step warms up and is dropped
            sampler.mark()
            t_step = time.perf_counter()
            fwd = bwd = 0.0
            for _ in range(M):
                t0 = time.perf_counter()
                h = _stage_input(inputs[first])
                with autocast():
                    for i in range(first, stop):
                        h = pipeline[i](h)
                t1 = time.perf_counter()
                _backward(h)
                t2 = time.perf_counter()
                fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
                wait = other_per_mb - (t2 - t0)
                if wait > 0:
                    time.sleep(wait)
            step_s = time.perf_counter() - t_step
            samples.append(StageSample.from_step(_Step(fwd, bwd, step_s, M), sampler.sample()))
        pipeline.zero_grad(set_to_none=True)
        conn.send(StageTimes.from_summary(StageSummary.of(samples[1:])))
    sampler.close()


def main(argv: list[str]) -> int:
    """The worker process's entry point: ``argv`` is ``[FD]``, the worker's end of the socket pair."""
    import torch

    conn = Connection(int(argv[0]))
    pipeline, sample, core, autocast_dtype = torch.load(io.BytesIO(conn.recv_bytes()), weights_only=False)
    run_worker(conn, pipeline, sample, core, autocast_dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
