"""Plots of simulated and measured pipelines (matplotlib, imported lazily, so the package runs without it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_dynpipe.schedule.simulator import SimResult

__all__ = ["plot_timeline"]

_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "U": "#55A868", "R": "#D0D0D0", "S": "#8172B3", "H": "#937860"}
_LABELS = {
    "F": "forward",
    "B": "backward",
    "U": "update",
    "R": "waiting to receive",
    "S": "sending",
    "H": "step overhead",
}


def plot_timeline(result: SimResult, path: str | Path, *, title: str | None = None, max_events: int = 4000) -> None:
    """Writes a Gantt chart of ``result`` (one row per stage: forwards, backwards, updates, receive waits, and
    sends and step overhead where the simulation gave them time).

    Example::

        plot_timeline(simulate("async", 2, 4, 3), "timeline.png")

    Args:
        result: a simulation from :func:`~lightning_dynpipe.schedule.simulator.simulate`.
        path: the PNG to write.
        title: the figure title; default names the schedule and its shape.
        max_events: draw at most this many events per stage (the first ones), so huge runs stay legible.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("plot_timeline needs matplotlib: pip install 'lightning-dynpipe[plot]'") from exc
    fig, ax = plt.subplots(figsize=(12, 0.6 + 0.5 * result.num_stages))
    drawn: set[str] = set()
    for k, events in enumerate(result.events):
        for ev in events[:max_events]:
            kind = ev.instruction[0]
            if kind not in _COLOURS or ev.end <= ev.start:
                continue  # stashing, and sends without a send_overhead, take no simulated time
            drawn.add(kind)
            ax.barh(k, ev.end - ev.start, left=ev.start, color=_COLOURS[kind], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(result.num_stages), [f"stage {k}" for k in range(result.num_stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    shown = [kind for kind in _COLOURS if kind in drawn or kind in "FBUR"]
    handles: list[Any] = [
        plt.Rectangle((0, 0), 1, 1, color=_COLOURS[kind])  # type: ignore[attr-defined]
        for kind in shown
    ]
    ax.legend(handles, [_LABELS[kind] for kind in shown], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(
        title
        or f"{result.kind} schedule, S={result.num_stages}, M={result.num_microbatches}, "
        f"{result.num_steps} steps (makespan {result.makespan:.3g})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
