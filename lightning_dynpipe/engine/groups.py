"""Process groups of the pipeline: one per direction of each stage boundary, per pipeline, per stage."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_dynpipe.engine.executor import StageChannels
from lightning_dynpipe.engine.p2p import FailureHandler, RecvChannel, SendChannel, wait_for_receivers
from lightning_dynpipe.engine.topology import PipelineTopology

__all__ = ["PipelineGroups", "build_groups", "build_channels", "destroy_default_group_at_exit"]

log = logging.getLogger(__name__)
_exit_hook_registered = False
_EXIT_QUIESCE_S = 0.05
_EXIT_RECEIVER_WAIT_S = 10.0


def _destroy_default_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    # After a failure a receiver thread may still wait for a peer that is on its way out; its connection closes
    # within moments, and only then may the groups go (the exit would abort under a blocked receive otherwise).
    still = wait_for_receivers(_EXIT_RECEIVER_WAIT_S)
    if still:
        log.warning("%d DynPipe receiver thread(s) still blocked at exit; ending the process without clean-up.", still)
        sys.stderr.flush()
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception as exc:  # exiting anyway; a peer may be gone already
        log.debug("Could not destroy the default process group at exit: %r", exc)
    gc.collect()
    # The group's C++ object outlives destroy_process_group() when anything still refers to it (a module imported
    # after init_process_group that captured `group.WORLD` as a default argument is enough), and so do its gloo
    # worker threads. A worker that just finished a collective releases the work, and the tensors in it, under
    # the GIL. Releasing the GIL here for a moment lets it do so while the interpreter is still alive.
    time.sleep(_EXIT_QUIESCE_S)


def destroy_default_group_at_exit() -> None:
    """Destroys the default process group when this process exits normally (idempotent).

    Gloo's worker threads release finished work, and the tensors in it, on their own, and that needs the GIL.
    A process that exits with the group alive can reach interpreter finalisation while a worker still has
    such a release to do; the worker then dies inside C++ code and the process aborts with SIGABRT
    ("terminate called without an active exception") after a successful run. ``benchmarks/gloo_exit.py``
    (spawned pairs running async all-gathers and barriers, then exiting): 5 of 20 pairs aborted without this
    hook, 0 of 20 with it, and 0 of 20 with it while another reference kept the group's C++ object (and its
    threads) alive. Lightning registers a similar clean-up only for NCCL;
    :class:`~lightning_dynpipe.DynPipeStrategy` registers this one for every backend.
    """
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_destroy_default_group)
        _exit_hook_registered = True


@dataclass
class PipelineGroups:
    """The process groups one rank belongs to. Built collectively by :func:`build_groups`."""

    topology: PipelineTopology
    rank: int
    pipeline: Any = None
    stage_dp: Any = None
    last_stage_dp: Any = None
    activation_in: Any = None
    activation_out: Any = None
    grad_in: Any = None
    grad_out: Any = None
    created: list[Any] = field(default_factory=list)

    @property
    def dp_rank(self) -> int:
        """Which pipeline replica this rank is in."""
        return self.topology.coords(self.rank)[0]

    @property
    def stage_idx(self) -> int:
        """Which stage this rank runs."""
        return self.topology.coords(self.rank)[1]

    def destroy(self) -> None:
        """Destroys every group this rank is a member of (not WORLD)."""
        for g in self.created:
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)
        self.created.clear()


def build_groups(topology: PipelineTopology, rank: int, backend: str | None, timeout: timedelta) -> PipelineGroups:
    """Creates all pipeline process groups. Collective: every rank of WORLD calls it with the same arguments."""
    out = PipelineGroups(topology, rank)
    S, D = topology.num_stages, topology.dp_size

    def new(ranks: list[int]) -> Any:
        g = dist.new_group(sorted(ranks), timeout=timeout, backend=backend)
        out.created.append(g)
        return g if rank in ranks else None

    for d in range(D):
        g = new(topology.pipeline_ranks(d))
        if g is not None:
            out.pipeline = g
    for k in range(S):
        g = new(topology.stage_ranks(k))
        if g is not None:
            out.stage_dp = g
        if k == S - 1:
            out.last_stage_dp = g
    for d in range(D):
        for b in range(S - 1):
            lo, hi = topology.rank_of(d, b), topology.rank_of(d, b + 1)
            act = new([lo, hi])
            grad = new([lo, hi])
            if rank == lo:
                out.activation_out, out.grad_in = act, grad
            elif rank == hi:
                out.activation_in, out.grad_out = act, grad
    return out


def build_channels(
    groups: PipelineGroups, device: torch.device, timeout_s: float, failure: FailureHandler | None = None
) -> StageChannels:
    """Opens this rank's channels to its neighbouring stages; ``failure`` learns of peers that fail."""
    topo = groups.topology
    d, k = groups.dp_rank, groups.stage_idx
    on_failure = failure.peer_failed if failure is not None else None
    ch = StageChannels()
    senders: list[SendChannel] = []
    if k > 0:
        up = topo.rank_of(d, k - 1)
        ch.recv_activation = RecvChannel(
            groups.activation_in,
            up,
            device,
            timeout_s,
            f"activations {k - 1}->{k}",
            peer_stage=k - 1,
            on_failure=on_failure,
        )
        ch.send_grad = grad_out = SendChannel(groups.grad_out, up, f"gradients {k}->{k - 1}", device)
        senders.append(grad_out)
    if k < topo.num_stages - 1:
        down = topo.rank_of(d, k + 1)
        ch.send_activation = act_out = SendChannel(groups.activation_out, down, f"activations {k}->{k + 1}", device)
        senders.insert(0, act_out)
        ch.recv_grad = RecvChannel(
            groups.grad_in, down, device, timeout_s, f"gradients {k + 1}->{k}", peer_stage=k + 1, on_failure=on_failure
        )
    if failure is not None:
        failure.channels = senders  # activations first, as the failure path has always sent
    return ch
