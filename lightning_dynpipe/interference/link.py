"""Network interference inside DynPipe's own P2P layer: delay and jitter on the sends across one stage boundary.

``tc netem`` needs privileges (and would slow every connection of the host); a :class:`DelayInjector` set as
the ``delay`` of a :class:`~lightning_dynpipe.engine.p2p.SendChannel` (any object with a ``sample()`` method,
see :class:`~lightning_dynpipe.engine.p2p.SendDelay`) delays exactly the pipeline traffic of one boundary.
Boundary ``b`` is the link between stage ``b`` and stage ``b + 1``: its activations are sent by stage ``b`` and
its gradients by stage ``b + 1``, so each of those ranks (in every data-parallel replica) delays its own send
channel.
"""

from __future__ import annotations

import logging
from typing import Protocol

from lightning_dynpipe.interference.base import InterferenceConfigError, InterferenceError, Lifecycle, check_fraction

__all__ = ["LinkDelay", "BoundLinkDelay", "PipelineHost", "DelayInjector"]

log = logging.getLogger(__name__)


class DelayInjector:
    """A delay (and jitter) before each send on a channel: network interference for tests and what-ifs.

    ``tc netem`` needs privileges we do not assume, so delay is injected in our own P2P layer.
    """

    def __init__(self, delay_s: float = 0.0, jitter_s: float = 0.0, seed: int = 0) -> None:
        import random

        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self._rng = random.Random(seed)

    def sample(self) -> float:
        """Seconds to wait before the next send."""
        if self.jitter_s <= 0:
            return max(0.0, self.delay_s)
        return max(0.0, self.delay_s + self._rng.uniform(-self.jitter_s, self.jitter_s))


class _Sender(Protocol):
    """What :class:`LinkDelay` needs of a send channel (:class:`~lightning_dynpipe.engine.p2p.SendChannel`)."""

    delay: DelayInjector | None

    @property
    def name(self) -> str: ...


class _Channels(Protocol):
    @property
    def send_activation(self) -> _Sender | None: ...

    @property
    def send_grad(self) -> _Sender | None: ...


class _Executor(Protocol):
    @property
    def channels(self) -> _Channels: ...


class PipelineHost(Protocol):
    """The parts of :class:`~lightning_dynpipe.strategy.DynPipeStrategy` that interference sources use."""

    @property
    def stage_idx(self) -> int: ...

    @property
    def num_stages(self) -> int: ...

    @property
    def executor(self) -> _Executor | None: ...


class LinkDelay:
    """Delay (and jitter) on every send across one stage boundary, applied to a live strategy.

    Example::

        link = LinkDelay(delay_s=0.005, jitter_s=0.002, seed=0)
        link.apply(trainer.strategy, boundary=0)   # stage 0 -> 1 activations and 1 -> 0 gradients
        ...
        link.remove(trainer.strategy)

    Call :meth:`apply` on every rank (it is a no-op on ranks that own neither side of the boundary), after the
    strategy has set up its pipeline (from ``on_train_start`` or ``on_train_batch_start`` for instance; the
    schedule kind ``"link_delay"`` does this for you). Each send then waits ``delay_s + U(-jitter_s, jitter_s)``
    seconds (at least 0) before it is started; the channels survive repartitioning, and so does the delay.

    Args:
        delay_s: mean added delay per send, in seconds.
        jitter_s: half-width of the uniform jitter around ``delay_s``.
        seed: seed of each channel's jitter generator.
    """

    def __init__(self, delay_s: float, jitter_s: float = 0.0, seed: int = 0) -> None:
        self.delay_s = check_fraction(
            "delay_s", delay_s, 0.0, 3600.0, "Use seconds, e.g. 0.005 for 5 ms.", low_open=False
        )
        self.jitter_s = check_fraction(
            "jitter_s", jitter_s, 0.0, 3600.0, "Use seconds, e.g. 0.002 for 2 ms.", low_open=False
        )
        if self.delay_s == 0 and self.jitter_s == 0:
            raise InterferenceConfigError(
                "LinkDelay needs delay_s > 0 or jitter_s > 0; got both 0, which would do "
                "nothing. Set e.g. delay_s=0.005.",
                field="delay_s",
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InterferenceConfigError(f"seed must be an integer; got {seed!r}.", field="seed")
        self.seed = seed
        self._applied: list[tuple[_Sender, DelayInjector | None, DelayInjector]] = []

    def __repr__(self) -> str:
        return f"LinkDelay(delay_s={self.delay_s:g}, jitter_s={self.jitter_s:g}, seed={self.seed})"

    @property
    def active(self) -> bool:
        """Whether this object currently delays channels of this rank."""
        return bool(self._applied)

    @property
    def channel_names(self) -> list[str]:
        """Names of the channels of this rank it delays (e.g. ``["activations 0->1"]``)."""
        return [ch.name for ch, _, _ in self._applied]

    def apply(self, strategy: PipelineHost, boundary: int) -> list[str]:
        """Delays this rank's sends across ``boundary``; returns the names of the channels delayed (maybe none).

        Raises:
            InterferenceConfigError: ``boundary`` is not between two stages of this pipeline.
            InterferenceError: already applied, or the strategy has not set up its pipeline yet.
        """
        num_stages = strategy.num_stages
        if isinstance(boundary, bool) or not isinstance(boundary, int) or not 0 <= boundary < num_stages - 1:
            valid = f"0..{num_stages - 2}" if num_stages > 1 else "none: a 1-stage pipeline has no boundary"
            raise InterferenceConfigError(
                f"LinkDelay boundary must name a link between two stages (boundary b is stage b -> b + 1): valid "
                f"boundaries for {num_stages} stage(s) are {valid}; got {boundary!r}.",
                field="stage",
            )
        if self._applied:
            raise InterferenceError(f"{self!r} is already applied (to {self.channel_names}); call remove() first.")
        executor = strategy.executor
        if executor is None:
            raise InterferenceError(
                "LinkDelay.apply needs a strategy whose pipeline is set up (strategy.executor is None). Apply it "
                "once training has started, e.g. from a callback's on_train_batch_start (InterferenceCallback "
                "with kind 'link_delay' does this)."
            )
        k = strategy.stage_idx
        channels = executor.channels
        targets = [channels.send_activation] if k == boundary else []
        if k == boundary + 1:
            targets.append(channels.send_grad)
        for ch in targets:
            if ch is None:  # pragma: no cover - a stage next to a boundary always has that channel
                raise InterferenceError(f"Stage {k} has no send channel across boundary {boundary}; this is a bug.")
            injector = DelayInjector(self.delay_s, self.jitter_s, self.seed)
            self._applied.append((ch, ch.delay, injector))
            ch.delay = injector
        names = self.channel_names
        if names:
            log.debug("%r applied to %s (stage %d)", self, names, k)
        return names

    def remove(self, strategy: PipelineHost | None = None) -> None:
        """Takes the delay off the channels :meth:`apply` changed, restoring what they had before; idempotent.

        Args:
            strategy: accepted for symmetry with :meth:`apply`; the channels recorded by :meth:`apply` are restored
                (also if the strategy was torn down meanwhile).
        """
        for ch, previous, injector in reversed(self._applied):
            if ch.delay is injector:
                ch.delay = previous
            else:  # someone replaced our injector since: theirs stays
                log.debug("%r: channel %s carries another delay now; left as is", self, ch.name)
        self._applied.clear()

    def bound(self, strategy: PipelineHost, boundary: int) -> BoundLinkDelay:
        """This delay tied to ``strategy`` and ``boundary``, with ``start()``/``stop()`` like other sources."""
        return BoundLinkDelay(self, strategy, boundary)


class BoundLinkDelay(Lifecycle):
    """A :class:`LinkDelay` on a given strategy and boundary, as a start/stop interference source.

    Example::

        with LinkDelay(0.005).bound(trainer.strategy, boundary=0):
            ...
    """

    def __init__(self, link: LinkDelay, strategy: PipelineHost, boundary: int) -> None:
        self.link = link
        self.strategy = strategy
        self.boundary = boundary

    def __repr__(self) -> str:
        return f"{self.link!r} on boundary {self.boundary}"

    @property
    def active(self) -> bool:
        """Whether channels of this rank are delayed."""
        return self.link.active

    def start(self) -> None:
        """Applies the delay (a no-op if already applied)."""
        if not self.link.active:
            self.link.apply(self.strategy, self.boundary)

    def stop(self) -> None:
        """Removes the delay; idempotent."""
        self.link.remove(self.strategy)
