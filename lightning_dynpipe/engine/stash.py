"""Weight stashing: the weight versions a stage keeps so that each backward uses its forward's weights."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["WeightStash"]


class WeightStash:
    """Weight versions of one stage (PipeDream weight stashing).

    ``version`` counts the optimizer updates applied to the live weights. :meth:`acquire` binds a micro-batch
    to the current version, taking a detached snapshot the first time that version is needed (micro-batches
    forwarded between two updates share one snapshot). The forward runs on the snapshot through
    ``torch.func.functional_call`` and the backward differentiates with respect to it, so the in-place update
    of the live weights never touches a tensor that a pending backward needs. :meth:`release` drops the
    snapshot when its last micro-batch has been back-propagated.

    Example::

        stash = WeightStash(stage)
        v = stash.acquire()                     # before the forward of a micro-batch
        out = functional_call(stage, stash.params(v), (x,))
        ...                                     # backward w.r.t. stash.params(v).values()
        stash.release(v); stash.bump()          # after the update
    """

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self.version = 0
        self._snapshots: dict[int, dict[str, Tensor]] = {}
        self._refs: dict[int, int] = {}
        self.max_depth = 0

    def acquire(self) -> int:
        """Binds one micro-batch to the current version and returns that version."""
        v = self.version
        if v not in self._snapshots:
            self._snapshots[v] = {
                name: p.detach().clone().requires_grad_(p.requires_grad)
                for name, p in self._module.named_parameters()
            }
            self._refs[v] = 0
        self._refs[v] += 1
        self.max_depth = max(self.max_depth, len(self._snapshots))
        return v

    def params(self, version: int) -> dict[str, Tensor]:
        """The snapshot of ``version`` (name -> leaf tensor), as ``functional_call`` takes it."""
        return self._snapshots[version]

    def release(self, version: int) -> None:
        """Ends one micro-batch's use of ``version``; frees the snapshot when nobody uses it any more."""
        self._refs[version] -= 1
        if self._refs[version] == 0:
            del self._refs[version]
            del self._snapshots[version]

    def bump(self) -> None:
        """Records one optimizer update of the live weights."""
        self.version += 1

    def reset(self) -> None:
        """Forgets everything; only legal when no micro-batch is in flight (after a drain)."""
        if self._snapshots:
            raise RuntimeError(f"WeightStash.reset with {len(self._snapshots)} versions still in use")
        self.version = 0

    @property
    def depth(self) -> int:
        """Number of versions currently stashed."""
        return len(self._snapshots)
