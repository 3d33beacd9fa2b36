"""Set-up probe of point-to-point latency and bandwidth between two ranks (ping-pong on an existing group).

The planner charges each stage boundary ``latency + bytes / bandwidth`` per transfer
(:class:`~lightning_dynpipe.plan.costs.CommModel`); this module measures the two numbers on the real process
group. The fraction of a transfer that 1F1B hides behind compute (``overlap``) is not measured here: the
runtime measures it while training, so the probe leaves it at 0 (charge everything).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_dynpipe.errors import CommunicationError, ConfigurationError
from lightning_dynpipe.plan.costs import CommModel

__all__ = ["probe_p2p"]

log = logging.getLogger(__name__)

_WARMUP_ROUND_TRIPS = 2  # the first transfers connect (NCCL communicators, gloo pairs) and page buffers in


def probe_p2p(
    group: Any,
    peer: int,
    *,
    initiator: bool,
    sizes: Sequence[int] = (8, 1 << 20),
    repeats: int = 10,
    device: torch.device | None = None,
) -> CommModel:
    """Measures latency and bandwidth to ``peer`` by ping-pong; both ranks call it and get the same result.

    The initiator times ``repeats`` round trips of a ``sizes[0]``-byte message and of a ``sizes[1]``-byte
    message (after two untimed round trips of each); the other rank echoes them. Then::

        latency   = median(small round trip) / 2
        bandwidth = sizes[1] / (median(large round trip) / 2 - latency)

    (if the large transfer is not slower than the latency, the bandwidth is ``sizes[1]`` over its one-way
    time, a lower bound). On CPU buffers (gloo) it also measures the initiator's process CPU (all its threads) per
    round trip of each size: the large round trip's excess over the small one, over the two messages of
    ``sizes[1] - sizes[0]`` bytes it sent and received, is ``cpu_s_per_byte`` (0 on CUDA, where the copies are
    the GPU's and a synchronising receive spins the CPU). The initiator sends its result to the peer through
    ``group`` as a tensor, so both ranks return the identical :class:`~lightning_dynpipe.plan.costs.CommModel`;
    ``overlap`` is 0.

    It uses point-to-point operations only, so the group may hold other ranks that do not take part. Before
    timing, the two ranks exchange their ``sizes`` and ``repeats`` and both raise if they differ (rather
    than hang on mismatched messages). About 2 x (repeats + 2) round trips: well under a second on gloo
    over loopback with the defaults.

    Example::

        import torch.distributed as dist
        from lightning_dynpipe.engine.probe import probe_p2p

        # on ranks 0 and 1 of an initialised default group
        group = dist.new_group([0, 1])
        peer = 1 - dist.get_rank()
        comm = probe_p2p(group, peer, initiator=dist.get_rank() == 0)
        print(f"{comm.latency_s * 1e6:.0f} us, {comm.bandwidth_Bps / 1e9:.2f} GB/s")

    Args:
        group: an initialised process group holding this rank and ``peer`` (e.g. a stage boundary's group).
        peer: the peer's global rank.
        initiator: True on exactly one of the two ranks: it sends first and computes the result.
        sizes: ``(small, large)`` message sizes in bytes; ``0 < small < large``.
        repeats: timed round trips per size (``>= 1``).
        device: where the message buffers live; default CPU for gloo, the current CUDA device otherwise
            (NCCL sends CUDA tensors only).

    Returns:
        The measured :class:`~lightning_dynpipe.plan.costs.CommModel`, identical on both ranks.

    Raises:
        ConfigurationError: bad arguments, a peer outside the group or equal to this rank, or arguments that
            differ between the two ranks.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigurationError(
            "probe_p2p needs an initialised process group; call torch.distributed.init_process_group first."
        )
    rank = dist.get_rank()
    small, large = _check_sizes(sizes)
    if not (isinstance(repeats, int) and repeats >= 1):
        raise ConfigurationError(f"probe_p2p repeats must be an int >= 1; got {repeats!r}.")
    if peer == rank:
        raise ConfigurationError(f"probe_p2p peer must be another rank; got peer={peer}, the rank of this process.")
    try:
        dist.get_group_rank(group, peer)
        dist.get_group_rank(group, rank)
    except (ValueError, RuntimeError) as exc:
        members = dist.get_process_group_ranks(group)
        raise ConfigurationError(
            f"probe_p2p needs this rank ({rank}) and peer ({peer}) in the group; the group's global ranks are "
            f"{members}. Pass the boundary group the two ranks share."
        ) from exc
    if device is None:
        device = (
            torch.device("cpu")
            if dist.get_backend(group) == "gloo"
            else torch.device("cuda", torch.cuda.current_device())
        )

    def send(t: torch.Tensor) -> None:
        dist.send(t, dst=peer, group=group)

    def recv(t: torch.Tensor) -> None:
        dist.recv(t, src=peer, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NCCL's recv returns before the data has arrived

    # Both ranks check that they run the same probe: a mismatch would otherwise hang in recv.
    mine = torch.tensor([small, large, repeats], dtype=torch.int64, device=device)
    theirs = torch.empty_like(mine)
    if initiator:
        send(mine)
        recv(theirs)
    else:
        recv(theirs)
        send(mine)
    if not torch.equal(mine, theirs):
        a, b = mine.tolist(), theirs.tolist()
        raise ConfigurationError(
            f"probe_p2p must be called with the same sizes and repeats on both ranks: rank {rank} has "
            f"sizes=({a[0]}, {a[1]}), repeats={a[2]}; rank {peer} has sizes=({b[0]}, {b[1]}), repeats={b[2]}."
        )

    round_trips: list[list[float]] = []
    cpu_per_round_trip: list[float] = []
    for nbytes in (small, large):
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        times: list[float] = []
        cpu_s = 0.0
        for i in range(_WARMUP_ROUND_TRIPS + repeats):
            if initiator:
                t0, c0 = time.perf_counter(), time.process_time()
                send(buf)
                recv(buf)
                if i >= _WARMUP_ROUND_TRIPS:
                    times.append(time.perf_counter() - t0)
                    cpu_s += time.process_time() - c0
            else:
                recv(buf)
                send(buf)
        round_trips.append(times)
        cpu_per_round_trip.append(cpu_s / repeats)

    result = torch.zeros(3, dtype=torch.float64, device=device)
    if initiator:
        latency = statistics.median(round_trips[0]) / 2
        one_way = statistics.median(round_trips[1]) / 2
        payload_s = one_way - latency if one_way > latency else one_way
        result[0], result[1] = latency, large / payload_s
        if device.type == "cpu":
            result[2] = max(cpu_per_round_trip[1] - cpu_per_round_trip[0], 0.0) / (2 * (large - small))
        send(result)
    else:
        recv(result)
    latency_s, bandwidth_Bps, cpu_s_per_byte = (float(v) for v in result.tolist())
    if not (latency_s > 0 and bandwidth_Bps > 0):
        raise CommunicationError(
            f"probe_p2p measured latency {latency_s!r} s and bandwidth {bandwidth_Bps!r} B/s between ranks {rank} "
            f"and {peer}; both must be positive. The clock may be too coarse: raise sizes[1] or repeats."
        )
    comm = CommModel(latency_s=latency_s, bandwidth_Bps=bandwidth_Bps, cpu_s_per_byte=cpu_s_per_byte)
    log.debug(
        "P2P probe rank %d <-> %d: latency %.1f us, bandwidth %.3f GB/s, %.3f ns of CPU per byte",
        rank,
        peer,
        latency_s * 1e6,
        bandwidth_Bps / 1e9,
        cpu_s_per_byte * 1e9,
    )
    return comm


def _check_sizes(sizes: Sequence[int]) -> tuple[int, int]:
    values = tuple(sizes)
    if not (len(values) == 2 and all(isinstance(v, int) and v > 0 for v in values) and values[0] < values[1]):
        raise ConfigurationError(
            f"probe_p2p sizes must be two message sizes in bytes, (small, large) with 0 < small < large; got "
            f"{sizes!r}. The default (8, 1 << 20) measures latency with 8 bytes and bandwidth with 1 MiB."
        )
    return values[0], values[1]
