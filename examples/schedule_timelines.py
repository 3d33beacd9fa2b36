"""ASCII timelines of the three schedules, drawn by the dry-run simulator (no torch, no processes).

Prints, for ``async``, ``sync`` and ``gpipe``, one row per stage: each character is one time unit, a forward
of micro-batch ``i`` takes one unit and is drawn ``i``, a backward takes two units and is drawn with the
letter of its micro-batch (``a`` = 0, ``b`` = 1, ...), ``.`` is idle time and ``|`` marks where the stage
finished a Lightning step. Then the simulated step time and bubble per schedule, with and without a wait for
the last stage at every step's end (what a callback that reads the mirrored metrics, or calls a collective, on
every rank at every batch's end brings).

    python examples/schedule_timelines.py                     # S=3, M=4, 2 steps then a drain
    python examples/schedule_timelines.py --stages 4 --microbatches 8 --steps 3

docs/schedules.md embeds this script's default output; tests/examples/test_examples.py checks that it
still matches.
"""

from __future__ import annotations

import argparse
import string

from lightning_dynpipe.schedule import SCHEDULES, simulate
from lightning_dynpipe.schedule.simulator import SimResult

FORWARD_TIME = 1.0
BACKWARD_TIME = 2.0


def _label(mb_idx: int, backward: bool) -> str:
    return string.ascii_lowercase[mb_idx % 26] if backward else str(mb_idx % 10)


def render(result: SimResult) -> str:
    """One row per stage (stage 0 on top); one character per time unit; ``|`` after each step of the stage."""
    width = int(round(result.makespan))
    rows = []
    for k, events in enumerate(result.events):
        cells = ["."] * width
        for ev in events:
            kind, mb = ev.instruction[0], ev.instruction[1:]
            if kind not in "FB" or not mb.isdigit():  # only compute occupies time here
                continue
            for t in range(int(round(ev.start)), int(round(ev.end))):
                cells[t] = _label(int(mb), backward=kind == "B")
        ends = sorted({int(round(t)) for t in result.step_end_times[k]}, reverse=True)
        for t in ends:
            cells.insert(t, "|")
        rows.append(f"stage {k}  " + "".join(cells).rstrip("."))
    return "\n".join(rows)


def report(num_stages: int = 3, num_microbatches: int = 4, num_steps: int = 2) -> str:
    """The timelines and the step-time table, as printed by this script."""
    out = [
        f"S={num_stages} stages, M={num_microbatches} micro-batches per step, {num_steps} steps, then a drain.",
        f"forward = {FORWARD_TIME:g} unit (digit = micro-batch), backward = {BACKWARD_TIME:g} units "
        "(letter: a = micro-batch 0), '.' idle, '|' end of the stage's step.",
        "",
    ]
    for kind, sync in [("async", "none"), ("async", "last_stage_broadcast"), ("sync", "none"), ("gpipe", "none")]:
        r = simulate(
            kind,
            num_stages,
            num_microbatches,
            num_steps,
            forward_time=FORWARD_TIME,
            backward_time=BACKWARD_TIME,
            step_sync=sync,
        )  # type: ignore[arg-type]
        title = f"{kind}, with a wait for the last stage at every step's end:" if sync != "none" else f"{kind}:"
        out += [title, render(r), ""]
    out.append(
        "steady-state step time (units; ideal M*(F+B) = "
        f"{num_microbatches * (FORWARD_TIME + BACKWARD_TIME):g}) and bubble of stage 0, 8 steps:"
    )
    out.append(f"{'schedule':<8} {'no step sync':>14} {'step-end wait':>20}")
    for kind in SCHEDULES:
        cols = []
        for sync in ("none", "last_stage_broadcast"):
            r = simulate(
                kind,
                num_stages,
                num_microbatches,
                8,
                forward_time=FORWARD_TIME,
                backward_time=BACKWARD_TIME,
                step_sync=sync,
            )
            cols.append(f"{r.steady_state_step_time:g} ({r.bubble_fraction[0]:.0%})")
        out.append(f"{kind:<8} {cols[0]:>14} {cols[1]:>20}")
    return "\n".join(out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    a = p.parse_args()
    print(report(a.stages, a.microbatches, a.steps))
