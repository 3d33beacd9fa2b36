"""Weight stashing: the weight versions a stage keeps so that each backward uses its forward's weights."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["WeightStash"]


class WeightStash:
    """Weight versions of one stage (PipeDream weight stashing), copy-on-write.

    ``version`` counts the optimizer updates applied to the live weights. :meth:`acquire` binds a micro-batch
    to the current version. The forward runs through ``torch.func.functional_call`` on that version's tensors,
    and the backward differentiates with respect to them. For the current version those tensors are aliases of
    the live parameters' storage (``p.data``: same memory, own autograd version counter), so stashing costs
    nothing until an update: :meth:`before_update` then moves the live parameters to fresh storage if a
    micro-batch in flight still uses the current version, and the alias keeps the values its forward saw.
    An update that writes the new weights to fresh storage (:mod:`~lightning_dynpipe.engine.outofplace`) needs
    no copy at all: the caller checks :attr:`shares_live` and records it with :meth:`updated_out_of_place`.
    A stage therefore holds exactly as many copies of its weights as it has versions in use (at most ``S-k``),
    the live weights included; :meth:`release` ends a version when its last micro-batch was back-propagated, and
    keeps its memory (where nothing else uses it) for the next update to write the new weights into
    (:meth:`spare`) instead of new memory: the released copy stands in for the one that update would allocate,
    so the total stays within ``S-k``. An update that wrote the new weights into the gradients' memory instead
    (:meth:`took_grad_memory`) leaves the released copy to the executor, which frees it when the next backward
    starts, where the gradients it replaces would be allocated; :meth:`drop_spares` frees it (and outside
    training).

    Example::

        stash = WeightStash(stage)
        v = stash.acquire()                      # before the forward of a micro-batch
        out = functional_call(stage, stash.params(v), (x,))
        ...
        stash.before_update(); optimizer.step(); stash.bump()
        ...                                      # backward w.r.t. stash.params(v).values()
        stash.release(v)
    """

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._named = list(module.named_parameters())  # read once: acquire runs once per micro-batch
        self._live = [p for _, p in self._named]
        self.version = 0
        self._versions: dict[int, dict[str, Tensor]] = {}
        self._refs: dict[int, int] = {}
        self.max_depth = 0
        self.copies_made = 0  # updates before which the live weights were copied
        self.copies_avoided = 0  # updates that wrote the new weights to fresh storage instead
        self.spares_reused = 0  # tensors of released versions that an update wrote the new weights into
        self.grads_reused = 0  # gradients whose memory an update wrote the new weights into
        self._ptrs: dict[int, frozenset[int]] = {}  # per version in use, the addresses of its tensors
        self._spare: dict[int, Tensor] = {}  # id(live parameter) -> a released version's tensor for it
        self._live_counts: tuple[int, ...] = ()  # the live parameters' version counters when the current version
        # was stashed (see written_in_place)

    def acquire(self) -> int:
        """Binds one micro-batch to the current version and returns that version."""
        v = self.version
        if v not in self._versions:
            self._versions[v] = {name: p.data.requires_grad_(p.requires_grad) for name, p in self._named}
            self._ptrs[v] = frozenset(t.data_ptr() for t in self._versions[v].values())
            self._refs[v] = 0
            self._live_counts = tuple(p._version for p in self._live)
        self._refs[v] += 1
        self.max_depth = max(self.max_depth, len(self._versions))
        return v

    def params(self, version: int) -> dict[str, Tensor]:
        """The tensors of ``version`` (name -> leaf tensor), as ``functional_call`` takes them."""
        return self._versions[version]

    @property
    def shares_live(self) -> bool:
        """Whether a micro-batch in flight uses the current version, i.e. the live weights' own storage: an
        update must then leave that storage alone (copy first with :meth:`before_update`, or write the new
        weights to fresh storage, :mod:`~lightning_dynpipe.engine.outofplace`)."""
        return self.version in self._versions

    def written_in_place(self) -> list[str]:
        """The live parameters written in place since the current version was stashed, while a micro-batch in flight
        still uses that version: its tensors are the live ones, so its backward would differentiate at the new
        values instead of those its forward used. Seen by the parameters' autograd version counters, which an
        in-place operation on the parameter itself bumps (``with torch.no_grad(): p.clamp_(...)``); a write through
        ``p.data`` does not bump it and goes unseen. Empty when no micro-batch uses the current version."""
        if self.version not in self._versions:
            return []
        return [name for (name, p), n in zip(self._named, self._live_counts) if p._version != n]

    def before_update(self) -> None:
        """Must run right before the live weights are updated in place (the optimizer step)."""
        if self.version in self._versions:
            for p in self._live:  # the stashed alias keeps the old storage
                spare = self.spare(p)
                if spare is None:
                    p.data = p.data.clone()
                else:
                    p.data = spare.copy_(p.data)
            self.copies_made += 1

    def updated_out_of_place(self) -> None:
        """Records that the update about to be counted by :meth:`bump` gave the live weights fresh storage."""
        self.copies_avoided += 1

    def release(self, version: int) -> None:
        """Ends one micro-batch's use of ``version``; frees it when nobody uses it any more."""
        self._refs[version] -= 1
        if self._refs[version] == 0:
            del self._refs[version], self._ptrs[version]
            self._recycle(self._versions.pop(version))

    def _recycle(self, tensors: dict[str, Tensor]) -> None:
        """Keeps a released version's tensors for the next update to write into (no allocation, no page faults),
        those whose memory nothing else uses: not the live weights (a parameter the updates skipped still shares
        it), not a version still in use. Plain training would overwrite this memory in place at the next
        update; writing it bumps the tensor's autograd version counter, as an in-place update does."""
        in_use = {p.data_ptr() for p in self._live}.union(*self._ptrs.values())
        self._spare = {id(p): t.detach() for name, p in self._named if (t := tensors[name]).data_ptr() not in in_use}

    def spare(self, param: Tensor) -> Tensor | None:
        """A released version's tensor to write ``param``'s next value into (same shape, strides, dtype and
        device), or ``None``. Each one is handed out once."""
        t = self._spare.pop(id(param), None)
        if t is None or (t.shape, t.stride(), t.dtype, t.device) != (
            param.shape,
            param.stride(),
            param.dtype,
            param.device,
        ):
            return None
        self.spares_reused += 1
        return t

    def took_grad_memory(self, param: Tensor) -> None:
        """Records that ``param``'s next value went into its gradient's memory. The released version's tensor kept
        for it stays until the next backward starts (the executor's :meth:`drop_spares`): freed there, its memory is
        what that backward's gradients are allocated from, instead of going to the forward's activations first and
        the gradients to new memory (on the GPT example, the process's heap then settled about 20 MiB higher)."""
        self.grads_reused += 1

    def drop_spares(self) -> None:
        """Frees the kept tensors of released versions (outside training: after a drain)."""
        self._spare = {}

    def bump(self) -> None:
        """Records one optimizer update of the live weights."""
        self.version += 1

    def reset(self) -> None:
        """Forgets everything; only legal when no micro-batch is in flight (after a drain)."""
        if self._versions:
            raise RuntimeError(f"WeightStash.reset with {len(self._versions)} versions still in use")
        self.version = 0
        self._spare = {}

    @property
    def depth(self) -> int:
        """Number of weight versions in use (each one copy of the stage's weights, the live one included)."""
        return len(self._versions)
