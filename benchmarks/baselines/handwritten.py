"""Baseline: PipeDream's asynchronous 1F1B written by hand, the least any framework can add to it.

One stage per rank of an already initialised process group (gloo on CPU), the same ``batches`` everywhere.
The batches form one stream of micro-batches (``num_microbatches`` per batch) with no flush between batches:
stage ``k`` of ``S`` keeps ``S - k`` micro-batches in flight, alternates one forward and one backward once full,
and applies SGD after every backward. Weight stashing costs no copy: the update writes the new weights to fresh
storage, the gradient's memory (:func:`lightning_dynpipe.engine.outofplace.out_of_place_step`), as DynPipe's
updates do, so each backward differentiates through the weights its forward saw, kept alive by the autograd graph.
Messages are raw ``isend``/``irecv`` of contiguous float tensors; each receive is posted one message ahead, so it
lands while the stage computes.

What it leaves out is what a framework brings: no Lightning loop, hooks or ``self.log``, no message headers, no
schedule interpreter, no per-step broadcast, no monitor. Its throughput against the simulated ideal (the
isolated layer costs on a dedicated core each) is what this machine and gloo give such a pipeline; a framework's
distance from the ideal beyond that is its own. ``op_cpu_s`` and ``op_wall_s`` hold the calling thread's CPU
seconds and the wall seconds in each kind of operation over the timed micro-batches, to set beside the isolated
calibration of the same arithmetic (CPU) and beside a framework's per-operation timers (wall).

Example (inside each of ``S`` spawned ranks)::

    dist.init_process_group("gloo", rank=rank, world_size=S, init_method=f"tcp://127.0.0.1:{port}")
    result = time_handwritten_async(stage_modules[rank], rank, S, 4, batches, lr=0.05, warmup_steps=2)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.baselines._checks import check_stage_call
from benchmarks.baselines.torch_pipelining import TimedWindow
from lightning_dynpipe.engine.outofplace import out_of_place_step

__all__ = ["time_handwritten_async"]

_OPS = ("forward", "backward", "update", "send", "recv_wait")


def _send_shape(shape: torch.Size, dst: int, group: Any) -> None:
    """Tells the next stage the shape of the activations it will receive (up to 8 dimensions)."""
    assert len(shape) <= 8, f"boundary tensors of up to 8 dimensions; got {shape}"
    header = torch.zeros(9, dtype=torch.int64)
    header[0] = len(shape)
    header[1 : 1 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    dist.send(header, dst=dst, group=group)


def _recv_shape(src: int, group: Any) -> torch.Size:
    """The shape :func:`_send_shape` of the previous stage sent."""
    header = torch.zeros(9, dtype=torch.int64)
    dist.recv(header, src=src, group=group)
    return torch.Size(int(d) for d in header[1 : 1 + int(header[0])])


def time_handwritten_async(
    stage_module: nn.Module,
    stage_idx: int,
    num_stages: int,
    num_microbatches: int,
    batches: Sequence[tuple[Tensor, Tensor]],
    *,
    lr: float,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
    warmup_steps: int = 2,
    group: dist.ProcessGroup | None = None,
    window: TimedWindow | None = None,
) -> dict[str, Any]:
    """Trains ``stage_module`` as stage ``stage_idx`` on the micro-batches of ``batches``, asynchronously.

    The clock covers the micro-batches of the batches after the first ``warmup_steps``: on each rank from the
    start of its first timed forward to the end of its last update; every rank returns the longest of the ranks'
    windows.

    Args:
        stage_module: this rank's layers; its parameters are updated after every micro-batch.
        stage_idx: this rank's stage, equal to its rank in ``group``.
        num_stages: stages in the pipeline, equal to the size of ``group``.
        num_microbatches: micro-batches per batch; must divide every batch size.
        batches: ``(x, y)`` pairs, the same on every rank (stage 0 reads ``x``, the last stage ``y``).
        lr: SGD's learning rate, applied per micro-batch.
        loss_fn: ``loss_fn(output, target)`` on the last stage.
        warmup_steps: leading batches that train but are not timed.
        group: the pipeline's process group; ``None`` is the default (world) group.
        window: when given, its ``start()`` runs as this rank's clock starts and its ``stop()`` as it stops (a
            CPU probe of the timed micro-batches, say).

    Returns:
        ``{"seconds": ..., "op_cpu_s": {op: seconds}, "op_wall_s": {op: seconds}, "micro_batches": n}``: the
        timed window's wall seconds (the longest rank's), and this rank's main-thread CPU seconds and wall seconds
        per kind of operation over its timed micro-batches (``forward`` includes the loss on the last stage;
        ``send`` the posting of sends and the waits for old ones; ``recv_wait`` the waits for messages).

    Raises:
        ValueError: for inconsistent stage/group sizes, too few batches, or batches not all of one size that
            ``num_microbatches`` divides.
        RuntimeError: when no process group is initialised.
    """
    check_stage_call("time_handwritten_async", stage_idx, num_stages, num_microbatches, batches, warmup_steps, group)
    is_first, is_last = stage_idx == 0, stage_idx == num_stages - 1
    prev = None if is_first else (dist.get_global_rank(group, stage_idx - 1) if group else stage_idx - 1)
    nxt = None if is_last else (dist.get_global_rank(group, stage_idx + 1) if group else stage_idx + 1)
    inputs = [x_mb for x, _ in batches for x_mb in x.chunk(num_microbatches)]
    targets = [y_mb for _, y in batches for y_mb in y.chunk(num_microbatches)]
    n, timed_from = len(inputs), warmup_steps * num_microbatches
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=lr)
    update = out_of_place_step(optimizer)
    if update is None:
        raise ValueError("plain SGD must have a fresh-storage step (lightning_dynpipe.engine.outofplace)")

    # Shapes once, before the clock, stage by stage: what a forward of the first micro-batch sends on (a dry run).
    in_shape = _recv_shape(prev, group) if prev is not None else None
    grad_shape = None
    if nxt is not None:
        with torch.no_grad():
            grad_shape = stage_module(inputs[0] if in_shape is None else torch.zeros(in_shape)).shape
        _send_shape(grad_shape, nxt, group)

    op_cpu = dict.fromkeys(_OPS, 0.0)
    op_wall = dict.fromkeys(_OPS, 0.0)
    timing = False

    def clock() -> tuple[float, float]:
        return time.thread_time(), time.perf_counter()

    def charge(op: str, since: tuple[float, float]) -> tuple[float, float]:
        now = clock()
        if timing:
            op_cpu[op] += now[0] - since[0]
            op_wall[op] += now[1] - since[1]
        return now

    def post_recv(shape: torch.Size, src: int) -> tuple[Tensor, Any]:
        buf = torch.empty(shape)
        return buf, dist.irecv(buf, src=src, group=group)

    def take(
        pending: tuple[Tensor, Any] | None, src: int | None, more: bool, since: tuple[float, float]
    ) -> tuple[Tensor, tuple[Tensor, Any] | None, tuple[float, float]]:
        """Waits for the posted receive, posts the next one (``more``) and charges the wait: (message, next, now)."""
        assert pending is not None and src is not None
        buf, work = pending
        work.wait()
        now = charge("recv_wait", since)
        return buf, post_recv(buf.shape, src) if more else None, now

    pending_act = post_recv(in_shape, prev) if prev is not None else None  # type: ignore[arg-type]
    pending_grad = post_recv(grad_shape, nxt) if nxt is not None and n > 0 else None  # type: ignore[arg-type]
    sends: deque[Any] = deque()
    in_flight: deque[tuple[Tensor | None, Tensor]] = deque()  # (the stage's input, its output or loss)
    limit = num_stages - stage_idx

    def send(tensor: Tensor, dst: int) -> None:
        sends.append((dist.isend(tensor, dst=dst, group=group), tensor))
        while len(sends) > 2 * limit:  # a send completes as the peer receives; keep a bounded number open
            sends.popleft()[0].wait()

    dist.barrier(group=group)
    start = end = 0.0
    fwd = bwd = 0
    while bwd < n:
        if fwd < n and fwd - bwd < limit:
            if fwd == timed_from:
                timing, start = True, time.perf_counter()
                if window is not None:
                    window.start()
            t = clock()
            if is_first:
                x = inputs[fwd]
            else:
                x, pending_act, t = take(pending_act, prev, fwd + 1 < n, t)
                x.requires_grad_(True)
            out = stage_module(x)
            if is_last:
                out = loss_fn(out, targets[fwd])
            t = charge("forward", t)
            if nxt is not None:
                send(out.detach(), nxt)
                charge("send", t)
            in_flight.append((None if is_first else x, out))
            fwd += 1
        else:
            x_saved, out = in_flight.popleft()
            t = clock()
            if is_last:
                out.backward()
            else:
                grad, pending_grad, t = take(pending_grad, nxt, bwd + 1 < n, t)
                out.backward(grad)
            t = charge("backward", t)
            if prev is not None:
                assert x_saved is not None and x_saved.grad is not None
                send(x_saved.grad, prev)
                t = charge("send", t)
            update()
            optimizer.zero_grad(set_to_none=True)
            charge("update", t)
            bwd += 1
            if bwd == n:
                end = time.perf_counter()
                if window is not None:
                    window.stop()
    while sends:
        sends.popleft()[0].wait()
    window = torch.tensor([end - start], dtype=torch.float64)
    dist.all_reduce(window, op=dist.ReduceOp.MAX, group=group)
    return {"seconds": float(window.item()), "op_cpu_s": op_cpu, "op_wall_s": op_wall, "micro_batches": n - timed_from}
