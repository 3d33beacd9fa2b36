"""The link between stages as the windows measure it: latency and bandwidth re-fitted while training runs.

The set-up probe measures the link once, on a quiet network. When the link slows down later (congestion, a
co-located job's traffic, an emulated :class:`~lightning_dynpipe.interference.LinkDelay`), the planner must price
every candidate cut with the link as it is now, and a cut's price depends on the bytes that cross it: moving a
boundary to a smaller activation only pays when the link's cost grows with the bytes.

:class:`LinkEstimate` keeps, per boundary, the recent ``(bytes, seconds per message)`` points of the monitor's
windows (:func:`~lightning_dynpipe.predictor.features.measured_message_s`), and the latest point of every other
message size measured there (a partition kept for longer than the history would otherwise leave one size, and the
one-size rule below, after the boundary had measured two), and answers the
:class:`~lightning_dynpipe.plan.costs.CommModel` to price with:

* while the measured message time stays within ``min_excess_s`` and ``ratio`` times of the set-up model, the set-up
  model (a quiet link's measured times carry scheduling noise the planner should not chase);
* once it is slower, and the recent points measured slower span two message sizes (the boundary moved, or the
  stages' outputs changed size), the least-squares line ``latency + bytes / bandwidth`` through them;
* with one size only, latency and bandwidth cannot be told apart, and the probe's latency is kept with the rest of
  the measured time charged per byte (the bandwidth that explains the measured message): a move to a smaller
  activation is then predicted to gain, the outcome check measures it, and the next window has the second size.
  Scaling the probe's model as a whole instead made the price of a small message depend on how the set-up probe
  happened to split its (sub-millisecond) time between latency and bandwidth, and a slow link's round trips (which
  the controller prices in full) then hid the move to the smallest activation in some runs.

With several boundaries, the one slowed most (measured over modelled) sets the model: the planner prices every
boundary with one link. A re-fitted model keeps the set-up model's ``cpu_s_per_byte``: the CPU a process spends on
a message's copies belongs to the transport on this host, not to the link's delay.

Pure: no torch.
"""

from __future__ import annotations

import math
from collections import deque

from lightning_dynpipe.plan.costs import CommModel, ModelCost
from lightning_dynpipe.predictor.base import PipelineWindow

__all__ = ["LinkEstimate"]


class LinkEstimate:
    """Per boundary, recent measured message times; :meth:`model` is the link to price candidates with.

    Example::

        >>> base = CommModel(latency_s=1e-4, bandwidth_Bps=1e9)
        >>> link = LinkEstimate(base)
        >>> link.add([(200_000, 0.0003)]).model() == base          # as the probe said: keep it
        True
        >>> slow = link.add([(200_000, 0.012)]).model()              # 40x slower, one size: charged per byte
        >>> round(float(slow.transfer_time(200_000)), 4), round(float(slow.transfer_time(8_000)), 4)
        (0.012, 0.0006)
        >>> fitted = link.add([(8_000, 0.0024)]).model()           # a second size: the line through both
        >>> round(fitted.latency_s, 4), round(fitted.bandwidth_Bps / 1e6, 1)
        (0.002, 20.0)

    Args:
        base: the set-up probe's link.
        history: points kept per boundary.
        min_excess_s: the link counts as slower than ``base`` when a message takes at least this much longer ...
        ratio: ... and at least this many times as long.
    """

    def __init__(self, base: CommModel, history: int = 8, min_excess_s: float = 1e-3, ratio: float = 2.0) -> None:
        self.base = base
        self.history = history
        self.min_excess_s = min_excess_s
        self.ratio = ratio
        self._points: list[deque[tuple[float, float]]] = []
        self._latest: list[dict[float, tuple[float, float]]] = []  # per boundary: the latest point of each size

    def observe(self, model_cost: ModelCost, window: PipelineWindow) -> LinkEstimate:
        """Adds each boundary's measured message time and bytes from ``window``."""
        from lightning_dynpipe.predictor.features import measured_message_s

        measured = measured_message_s(window)
        p = window.partition
        sizes = [model_cost.layers[p.stage_layers(b)[-1]].activation_bytes for b in range(p.num_stages - 1)]
        return self.add([(float(n), t) for n, (t, _) in zip(sizes, measured)])

    def add(self, points: list[tuple[float, float]]) -> LinkEstimate:
        """Adds one ``(bytes, seconds per message)`` point per boundary (a time <= 0: not measured)."""
        if len(points) != len(self._points):
            self._points = [deque(maxlen=self.history) for _ in points]
            self._latest = [{} for _ in points]
        for kept, latest, (nbytes, seconds) in zip(self._points, self._latest, points):
            if seconds > 0 and math.isfinite(seconds):
                kept.append((nbytes, seconds))
                latest[nbytes] = (nbytes, seconds)
        return self

    def _slowed(self, nbytes: float, seconds: float) -> float:
        """Measured over modelled time, when the link is slower than the base by the thresholds; else 1."""
        modelled = float(self.base.transfer_time(nbytes))
        if seconds - modelled < self.min_excess_s or seconds < self.ratio * modelled:
            return 1.0
        return seconds / modelled if modelled > 0 else math.inf

    def model(self) -> CommModel:
        """The link to price with now (``base`` unless the latest windows measured it slower; see the module)."""
        worst, worst_ratio, older = None, 1.0, []
        for kept, latest in zip(self._points, self._latest):
            if kept:
                r = self._slowed(*kept[-1])
                if r > worst_ratio:
                    recent = {n for n, _ in kept}
                    worst, worst_ratio, older = kept, r, [pt for n, pt in latest.items() if n not in recent]
        if worst is None:
            return self.base
        # the recent points and the latest of each size no longer among them; not the points from before it slowed
        fitted = _line([pt for pt in [*worst, *older] if self._slowed(*pt) > 1.0])
        if fitted is not None:
            latency, per_byte = fitted
            return CommModel(
                latency_s=latency,
                bandwidth_Bps=1.0 / per_byte if per_byte > 0 else math.inf,
                cpu_s_per_byte=self.base.cpu_s_per_byte,
            )
        nbytes, seconds = worst[-1]
        excess = seconds - self.base.latency_s
        if math.isinf(worst_ratio) or nbytes <= 0 or excess <= 0:  # nothing to charge per byte: all latency
            return CommModel(latency_s=seconds, bandwidth_Bps=math.inf, cpu_s_per_byte=self.base.cpu_s_per_byte)
        # one size: the probe's latency, and the rest of the measured time charged per byte
        return CommModel(
            latency_s=self.base.latency_s, bandwidth_Bps=nbytes / excess, cpu_s_per_byte=self.base.cpu_s_per_byte
        )


def _line(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares ``seconds = latency + per_byte * bytes`` (both >= 0) when the sizes differ by >= 10%."""
    xs = [x for x, _ in points]
    if min(xs) <= 0 or max(xs) < 1.1 * min(xs):
        return None
    n = len(points)
    mx, my = sum(xs) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    per_byte = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx)
    latency = max(0.0, my - per_byte * mx)
    if latency == 0.0:  # the line's intercept was negative: the best line through the origin
        per_byte = sum(x * y for x, y in points) / sum(x * x for x in xs)
    return latency, per_byte
