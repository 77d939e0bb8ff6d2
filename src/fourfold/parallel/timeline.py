"""A pipeline schedule run in simulated time (:mod:`fourfold.parallel.schedule` holds the order; this, the
clock): when every action starts and ends under given costs, the bubble it leaves, the textbook bubble to
compare with, and how many micro-batches' activations each rank holds at once.

    t = simulate(make_schedule("1f1b", pp=4, microbatches=8), f=1.0, b=1.0, w=1.0)
    t.bubble, t.bubble_by_rank, peak_in_flight(t.schedule)       # 3/11, (3/11,)*4, [4, 3, 2, 1]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

from fourfold.parallel.schedule import SCHEDULES, Action, Cost, Schedule, run_order, validate

__all__ = ["TimedAction", "Timeline", "peak_in_flight", "simulate", "theory_bubble"]


class TimedAction(NamedTuple):
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """When every action ran under :func:`simulate`'s costs; ``ranks[r]`` in rank r's order."""

    schedule: Schedule
    ranks: tuple[tuple[TimedAction, ...], ...]
    makespan: float
    f: float
    b: float
    w: float
    comm: float

    @property
    def busy(self) -> tuple[float, ...]:
        return tuple(sum(t.end - t.start for t in row) for row in self.ranks)

    @property
    def bubble_by_rank(self) -> tuple[float, ...]:
        """Idle fraction of each rank between time 0 and the makespan."""
        return tuple(1 - busy / self.makespan for busy in self.busy)

    @property
    def bubble(self) -> float:
        """Idle time over all ranks / (pp * makespan)."""
        return 1 - sum(self.busy) / (self.schedule.pp * self.makespan)


def simulate(schedule: Schedule, f: float = 1.0, b: float = 1.0, w: float = 1.0, comm: float = 0.0,
             cost: Cost | None = None, speed: Callable[[int], float] | None = None) -> Timeline:
    """Start and end of every action when each rank runs its list in order as soon as inputs arrive.

    ``f``, ``b``, ``w``: forward, input-gradient and weight-gradient time of one micro-batch through one rank's
    share of the model (a fused B costs b + w; a virtual stage 1/virtual of each); ``comm``: added to each
    activation or gradient sent to another rank. ``cost``: instead of f, b, w, each action's own time (stages
    that differ; :mod:`fourfold.plan.predict`), or ``(computing, waiting)`` seconds: waiting (a tensor-parallel
    collective's latency) uses no core, so it is not slowed by ranks sharing them. ``speed(k)``: the fraction of its own speed each of k ranks
    computing at once gets, when they share a machine's cores (:mod:`fourfold.plan.predict`); None: a device
    each. Validates first.
    """
    if min(f, b, w, comm) < 0 or f + b + w <= 0:
        raise ValueError(f"costs must be >= 0 with f + b + w > 0, got f={f}, b={b}, w={w}, comm={comm}.")
    validate(schedule)
    fused = not schedule.split_backward
    each = {"F": f, "B": b + w if fused else b, "W": w}
    times, _ = run_order(schedule, cost or (lambda a: each[a.op] / schedule.virtual), comm, speed)
    rows = tuple(tuple(TimedAction(a, *times[(a.stage, a.op, a.microbatch)]) for a in actions)
                 for actions in schedule.ranks)
    makespan = max((t.end for row in rows for t in row), default=0.0)
    return Timeline(schedule, rows, makespan, f, b, w, comm)


def theory_bubble(name: str, pp: int, microbatches: int, virtual: int = 1, f: float = 1.0, b: float = 1.0,
                  w: float = 1.0) -> float:
    """The textbook bubble (idle / (pp * makespan)) with equal stages and comm = 0.

    naive (p-1)/p. gpipe, 1f1b: (p-1)/(m+p-1), for any f, b, w. interleaved: (p-1)/(vm+p-1), Megatron's
    estimate, and exact in :func:`simulate`. zb (ZB-H1): each rank idles (p-1)(f+b-w) of a makespan
    m(f+b+w) + (p-1)(f+b-w); exact for m >= p and w <= min(f, b) (a W must fit the gaps it fills).
    """
    p, m, v = pp, microbatches, virtual
    if name == "naive":
        return (p - 1) / p
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zb":
        idle = (p - 1) * (f + b - w)
        return idle / (m * (f + b + w) + idle)
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {name!r}.")


def peak_in_flight(schedule: Schedule, until: Literal["B", "W"] = "B") -> list[int]:
    """Per rank, the most (stage, microbatch) forwards whose B has not run yet: activations held at once.

    1f1b: pp - r on rank r; gpipe: m. An interleaved stage holds 1/virtual of a rank's layers, so its count
    weighs 1/virtual of a micro-batch's activations. ``until="W"`` counts a micro-batch until its weight
    gradient instead (what W still needs: the layer inputs and output gradients; zb keeps this at pp);
    for a schedule without W it is the same as ``"B"``.
    """
    end = "W" if until == "W" and schedule.split_backward else "B"
    peaks = []
    for actions in schedule.ranks:
        held = peak = 0
        for a in actions:
            held += {"F": 1, end: -1}.get(a.op, 0)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks
