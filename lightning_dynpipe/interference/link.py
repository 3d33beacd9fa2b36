"""Network interference inside DynPipe's own P2P layer: an emulated link (delay, jitter, bandwidth) on one boundary.

``tc netem`` needs privileges (and would slow every connection of the host); a :class:`DelayInjector` set as
the ``delay`` of a :class:`~lightning_dynpipe.engine.p2p.SendChannel` (any object with a ``deliver_at()`` method,
see :class:`~lightning_dynpipe.engine.p2p.SendDelay`) emulates a slower link for exactly the pipeline traffic of one
boundary. The sender stamps each message with its delivery time and goes on; the receiver holds the message until
then. Boundary ``b`` is the link between stage ``b`` and stage ``b + 1``: its activations are sent by stage ``b``
and its gradients by stage ``b + 1``, so each of those ranks (in every data-parallel replica) puts the emulated link
on its own send channel: one link per direction, as on a full-duplex network.

The emulation relies on the two ranks' ``time.time()`` agreeing (one host, or hosts synchronised by NTP/PTP to well
under the emulated delay).
"""

from __future__ import annotations

import logging
import math
from typing import Protocol

from lightning_dynpipe.interference.base import InterferenceConfigError, InterferenceError, Lifecycle, check_fraction

__all__ = ["LinkDelay", "BoundLinkDelay", "PipelineHost", "DelayInjector"]

log = logging.getLogger(__name__)


class DelayInjector:
    """An emulated link for the messages of one channel: delay, jitter and bandwidth, in order.

    A message of ``n`` bytes sent at ``t`` waits for the link to finish the messages before it, occupies it for
    ``n / bandwidth_Bps`` seconds, and then travels ``delay_s + U(-jitter_s, jitter_s)`` (at least 0) seconds; it is
    never delivered before the message sent ahead of it (one ordered stream, as TCP delivers).

    Example::

        >>> link = DelayInjector(delay_s=0.002, bandwidth_Bps=1e6)
        >>> link.sample(1000)                       # one message on an idle link: 2 ms + 1 ms
        0.003
        >>> link.deliver_at(10.0, 1000), link.deliver_at(10.0, 1000)   # the second queues behind the first
        (10.003, 10.004)
    """

    def __init__(
        self, delay_s: float = 0.0, jitter_s: float = 0.0, seed: int = 0, bandwidth_Bps: float = math.inf
    ) -> None:
        import random

        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self.bandwidth_Bps = bandwidth_Bps
        self._rng = random.Random(seed)
        self._free_at = -math.inf  # when the link has sent everything queued so far
        self._last_due = -math.inf

    def _travel(self) -> float:
        if self.jitter_s <= 0:
            return max(0.0, self.delay_s)
        return max(0.0, self.delay_s + self._rng.uniform(-self.jitter_s, self.jitter_s))

    def _serialise(self, nbytes: int) -> float:
        return nbytes / self.bandwidth_Bps if math.isfinite(self.bandwidth_Bps) else 0.0

    def sample(self, nbytes: int = 0) -> float:
        """Seconds one message of ``nbytes`` takes on an idle link (travel with jitter, plus its bytes' time)."""
        return round(self._travel() + self._serialise(nbytes), 12)

    def deliver_at(self, sent_s: float, nbytes: int) -> float:
        """When a message of ``nbytes`` sent at ``sent_s`` (``time.time()``) is delivered."""
        start = max(sent_s, self._free_at)
        self._free_at = start + self._serialise(nbytes)
        self._last_due = max(self._last_due, self._free_at + self._travel())
        return round(self._last_due, 9)


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
    """An emulated slower link across one stage boundary (delay, jitter, bandwidth), applied to a live strategy.

    Example::

        link = LinkDelay(delay_s=0.005, jitter_s=0.002, bandwidth_Bps=50e6, seed=0)
        link.apply(trainer.strategy, boundary=0)   # stage 0 -> 1 activations and 1 -> 0 gradients
        ...
        link.remove(trainer.strategy)

    Call :meth:`apply` on every rank (it is a no-op on ranks that own neither side of the boundary), after the
    strategy has set up its pipeline (from ``on_train_start`` or ``on_train_batch_start`` for instance; the
    schedule kind ``"link_delay"`` does this for you). Each message across the boundary is then delivered
    ``delay_s + U(-jitter_s, jitter_s)`` seconds (at least 0) after the link has carried its bytes at
    ``bandwidth_Bps``, in order (:class:`DelayInjector`); the sender does not wait, the receiver does when it needs
    the message. The channels survive repartitioning, and so does the emulated link: a partition whose boundary
    carries fewer bytes is faster across it, as on a real link.

    Args:
        delay_s: mean added delay per message, in seconds.
        jitter_s: half-width of the uniform jitter around ``delay_s``.
        seed: seed of each channel's jitter generator.
        bandwidth_Bps: the link's bandwidth in bytes per second (``math.inf``, the default: only the delay).
    """

    def __init__(self, delay_s: float, jitter_s: float = 0.0, seed: int = 0, bandwidth_Bps: float = math.inf) -> None:
        self.delay_s = check_fraction(
            "delay_s", delay_s, 0.0, 3600.0, "Use seconds, e.g. 0.005 for 5 ms.", low_open=False
        )
        self.jitter_s = check_fraction(
            "jitter_s", jitter_s, 0.0, 3600.0, "Use seconds, e.g. 0.002 for 2 ms.", low_open=False
        )
        if isinstance(bandwidth_Bps, bool) or not isinstance(bandwidth_Bps, (int, float)) or not bandwidth_Bps > 0:
            raise InterferenceConfigError(
                f"LinkDelay bandwidth_Bps must be a number of bytes per second > 0 (math.inf: unlimited); got "
                f"{bandwidth_Bps!r}. E.g. 50e6 for 50 MB/s.",
                field="bandwidth_Bps",
            )
        self.bandwidth_Bps = float(bandwidth_Bps)
        if self.delay_s == 0 and self.jitter_s == 0 and math.isinf(self.bandwidth_Bps):
            raise InterferenceConfigError(
                "LinkDelay needs delay_s > 0, jitter_s > 0 or a finite bandwidth_Bps; got none, which would do "
                "nothing. Set e.g. delay_s=0.005.",
                field="delay_s",
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InterferenceConfigError(f"seed must be an integer; got {seed!r}.", field="seed")
        self.seed = seed
        self._applied: list[tuple[_Sender, DelayInjector | None, DelayInjector]] = []

    def __repr__(self) -> str:
        bw = "" if math.isinf(self.bandwidth_Bps) else f", bandwidth_Bps={self.bandwidth_Bps:g}"
        return f"LinkDelay(delay_s={self.delay_s:g}, jitter_s={self.jitter_s:g}{bw}, seed={self.seed})"

    @property
    def active(self) -> bool:
        """Whether this object currently delays channels of this rank."""
        return bool(self._applied)

    @property
    def channel_names(self) -> list[str]:
        """Names of the channels of this rank it delays (e.g. ``["activations 0->1"]``)."""
        return [ch.name for ch, _, _ in self._applied]

    def apply(self, strategy: PipelineHost, boundary: int) -> list[str]:
        """Puts the emulated link on this rank's sends across ``boundary``; returns the names of those channels.

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
            injector = DelayInjector(self.delay_s, self.jitter_s, self.seed, self.bandwidth_Bps)
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
