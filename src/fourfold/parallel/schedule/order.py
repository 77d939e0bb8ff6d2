"""A schedule's vocabulary and its reading: :class:`Action`, :class:`Schedule`, what an action waits for, the
order a schedule runs in (:func:`run_order`, the simulator's and the grid's), :func:`validate` and
:func:`format_grid`. The named schedules that produce one are :mod:`~fourfold.parallel.schedule.named`'s."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple, NoReturn

__all__ = ["Action", "Cost", "Op", "Schedule", "ScheduleError", "format_grid", "parse_actions", "run_order",
           "validate"]

Op = Literal["F", "B", "W"]
_FB: tuple[Op, ...] = ("F", "B")
_FBW: tuple[Op, ...] = ("F", "B", "W")
_BEFORE: dict[str, Op] = {"B": "F", "W": "B"}  # on a stage, B needs its F, W needs its B
_ACTION = re.compile(r"(\d+)([FBW])(\d+)")


class Action(NamedTuple):
    """One unit of pipeline work: ``op`` of model stage ``stage`` on micro-batch ``microbatch``."""

    stage: int
    op: Op
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """``"1F3"`` -> ``Action(stage=1, op="F", microbatch=3)``."""
        match = _ACTION.fullmatch(text.strip())
        if not match:
            raise ValueError(f"an action must read <stage><F|B|W><microbatch>, e.g. 1F3, got {text!r}.")
        return cls(int(match[1]), match[2], int(match[3]))  # type: ignore[arg-type]


def parse_actions(text: str) -> tuple[Action, ...]:
    """``"0F0 0F1 0B0"`` -> three actions (whitespace separated)."""
    return tuple(Action.parse(t) for t in text.split())


class ScheduleError(ValueError):
    """A schedule that breaks a rule; the message holds the rank x step grid with the failing step marked."""

    def __init__(self, message: str, rank: int | None = None, step: int | None = None) -> None:
        super().__init__(message)
        self.rank, self.step = rank, step


@dataclass(frozen=True)
class Schedule:
    """Every rank's actions in the order it runs them; ``ranks[r][i]`` is rank r's step i."""

    name: str
    pp: int
    microbatches: int
    virtual: int
    ranks: tuple[tuple[Action, ...], ...]
    split_backward: bool = False  # B is the input gradient only and each (stage, microbatch) has a W

    def __post_init__(self) -> None:
        _check_sizes(self.name, self.pp, self.microbatches, self.virtual)
        if len(self.ranks) != self.pp:
            raise ValueError(f"a schedule needs one action list per rank, got {len(self.ranks)} lists for "
                             f"pp={self.pp}.")

    @property
    def stages(self) -> int:
        return self.pp * self.virtual

    def owner(self, stage: int) -> int:
        """The rank that holds ``stage``."""
        return stage % self.pp

    def held(self, rank: int) -> list[int]:
        """The stages pp rank ``rank`` holds, in order (:meth:`owner`'s inverse)."""
        return [s for s in range(self.stages) if self.owner(s) == rank]

    def sends(self, a: Action) -> bool:
        """Whether ``a`` hands a tensor to another rank: an F its activation to the next stage, a B its input's
        gradient to the one before (the messages :func:`_inputs` waits for); a W nothing."""
        to = a.stage + 1 if a.op == "F" else a.stage - 1 if a.op == "B" else -1
        return 0 <= to < self.stages and self.owner(to) != self.owner(a.stage)

    def __str__(self) -> str:
        return format_grid(self)


def _check_sizes(name: str, pp: int, microbatches: int, virtual: int) -> None:
    for key, value in (("pp", pp), ("microbatches", microbatches), ("virtual", virtual)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {key}={value!r} for {name}.")


# ---------------------------------------------------------------------------------------------------------
# running a schedule: dependencies, validation, simulated time

def _inputs(a: Action, stages: int) -> list[tuple[tuple[int, str, int], bool]]:
    """What ``a`` needs before it can start: ``(stage, op, microbatch)`` keys, and whether it is a message."""
    s, i = a.stage, a.microbatch
    if a.op == "F":
        return [((s - 1, "F", i), True)] if s > 0 else []
    if a.op == "B":  # the activations its forward saved, and the gradient from the next stage
        return [((s, "F", i), False)] + ([((s + 1, "B", i), True)] if s < stages - 1 else [])
    return [((s, "B", i), False)]


@dataclass
class _Job:
    """An action under way on one rank: ``work`` seconds of computing left (at the rank's share of the cores),
    then ``wait`` seconds that use no core (a collective's latency, waits for a peer)."""

    action: Action
    start: float
    work: float
    wait: float

    def left(self, rate: float) -> float:
        """Seconds to the end of its current part at ``rate``."""
        return self.work / rate if self.work > 0 else self.wait


Cost = Callable[[Action], "float | tuple[float, float]"]


def run_order(schedule: Schedule, cost: Cost, comm: float = 0.0, speed: Callable[[int], float] | None = None,
         ) -> tuple[dict[tuple[int, str, int], tuple[float, float]], list[int]]:
    """Execute every rank's list in order: ``{key: (start, end)}`` for what ran, and how far each rank got.

    Time moves from event to event (an action's computing or waiting ends, a message arrives). ``cost(a)``: the
    action's seconds, or ``(computing, waiting)``: the waiting part uses no core and goes at full speed.
    ``speed(k)``: the fraction of its own speed each of k ranks computing at once gets (ranks sharing cores);
    None: each has a device of its own.
    """
    times: dict[tuple[int, str, int], tuple[float, float]] = {}
    pos, free = [0] * schedule.pp, [0.0] * schedule.pp
    running: dict[int, _Job] = {}
    now = 0.0
    while True:
        arrivals = []
        for r, actions in enumerate(schedule.ranks):
            if r in running or pos[r] >= len(actions):
                continue
            a = actions[pos[r]]
            needs = _inputs(a, schedule.stages)
            if any(key not in times for key, _ in needs):
                continue  # blocked on a receive (or on its own later step: a deadlock if nobody moves)
            ready = max([free[r]] + [times[key][1] + (comm if message and schedule.owner(key[0]) != r else 0)
                                     for key, message in needs])
            if ready <= now:
                c = cost(a)
                work, wait = (c, 0.0) if isinstance(c, (int, float)) else c
                running[r] = _Job(a, now, float(work), float(wait))
            else:
                arrivals.append(ready)
        if not running and not arrivals:
            return times, pos
        computing = sum(1 for job in running.values() if job.work > 0)
        rate = 1.0 if speed is None or not computing else speed(computing)
        left = {r: job.left(rate) for r, job in running.items()}
        dt = min([*left.values(), *(t - now for t in arrivals)])
        now += dt
        for r, job in list(running.items()):
            ends = left[r] - dt <= 1e-12 * left[r]  # the part that sets dt ends exactly: no rounding residue
            if job.work > 0:
                job.work = 0.0 if ends else job.work - dt * rate
            else:
                job.wait = 0.0 if ends else job.wait - dt
            if job.work <= 0 and job.wait <= 0:
                times[(job.action.stage, job.action.op, job.action.microbatch)] = (job.start, now)
                free[r] = now
                pos[r] += 1
                del running[r]


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless the schedule is complete, well placed, ordered and deadlock-free.

    Every (stage, microbatch) has exactly one F and one B (and one W iff ``split_backward``), on the rank that
    owns the stage; on a rank, a stage's B comes after its F and its W after its B; and the lists run to the
    end with blocking receives (the F of stage s waits for stage s-1's activation, the B of stage s for stage
    s+1's gradient). The error shows the rank x step grid with the failing step marked ``>1B3<``.
    """
    s = schedule
    seen: dict[tuple[int, str, int], tuple[int, int]] = {}
    for r, actions in enumerate(s.ranks):
        for i, a in enumerate(actions):
            what = f"{a} at rank {r} step {i}"
            if not isinstance(a, Action) or a.op not in ("F", "B", "W"):
                _fail(s, r, i, f"{a!r} at rank {r} step {i} is not an Action(stage, 'F'|'B'|'W', microbatch).")
            if not (0 <= a.stage < s.stages and 0 <= a.microbatch < s.microbatches):
                _fail(s, r, i, f"{what} is out of range: stages are 0..{s.stages - 1} and micro-batches "
                               f"0..{s.microbatches - 1}.")
            if a.op == "W" and not s.split_backward:
                _fail(s, r, i, f"{what} is a weight-gradient step, but {s.name} does not split backward "
                               "(its B computes the weight gradient too).")
            if s.owner(a.stage) != r:
                _fail(s, r, i, f"{what} is on the wrong rank: stage {a.stage} lives on rank "
                               f"{s.owner(a.stage)} (stage % pp = {a.stage} % {s.pp}).")
            key = (a.stage, a.op, a.microbatch)
            if key in seen:
                _fail(s, r, i, f"{what} appears twice: also at rank {seen[key][0]} step {seen[key][1]}.")
            seen[key] = (r, i)
            before = _BEFORE.get(a.op)
            if before and seen.get((a.stage, before, a.microbatch)) is None:
                later = [j for j, b in enumerate(actions) if b == Action(a.stage, before, a.microbatch)]
                where = f"it comes later, at step {later[0]}" if later else "it is missing"
                _fail(s, r, i, f"{what} comes before {a.stage}{before}{a.microbatch} ({where}): "
                               + ("a backward needs the activations its forward saved."
                                  if a.op == "B" else "a weight gradient needs its backward's output gradient."))
    ops = _FBW if s.split_backward else _FB
    missing = [Action(st, op, i) for st in range(s.stages) for i in range(s.microbatches) for op in ops
               if (st, op, i) not in seen]
    if missing:
        a = missing[0]
        words = f"{len(missing)} action(s) on no rank, first {a} (it belongs on rank {s.owner(a.stage)}): " \
                f"every stage runs {', '.join(ops)} once per micro-batch"
        needs = [(r, i) for r, actions in enumerate(s.ranks) for i, b in enumerate(actions)
                 if any(key == tuple(a) for key, _ in _inputs(b, s.stages))]
        if not needs:
            _fail(s, None, None, words + ".")
        r, i = needs[0]  # mark the step that would wait for it forever
        _fail(s, r, i, f"{words}; {s.ranks[r][i]} at rank {r} step {i} waits for it.")
    _, pos = run_order(s, lambda a: 1.0)
    stuck = [r for r in range(s.pp) if pos[r] < len(s.ranks[r])]
    if stuck:
        lines = []
        for r in stuck:
            a = s.ranks[r][pos[r]]
            for (st, op, i), _ in _inputs(a, s.stages):
                src, j = seen[(st, op, i)]
                if j >= pos[src]:  # not run yet
                    kind = "activation" if op == "F" else "gradient"
                    lines.append(f"rank {r} waits at step {pos[r]} ({a}) for the {kind} of {st}{op}{i}, "
                                 f"rank {src}'s step {j}")
        _fail(s, stuck[0], pos[stuck[0]], "deadlock: no rank can go on.\n  " + "\n  ".join(lines))


def _fail(schedule: Schedule, rank: int | None, step: int | None, words: str) -> NoReturn:
    mark = None if rank is None or step is None else (rank, step)
    head = f"{schedule.name} (pp={schedule.pp}, microbatches={schedule.microbatches}, virtual=" \
           f"{schedule.virtual}) is broken: {words}"
    raise ScheduleError(f"{head}\n{format_grid(schedule, mark=mark, columns='step')}", rank, step)


# ---------------------------------------------------------------------------------------------------------
# the picture in text

def format_grid(schedule: Schedule, mark: tuple[int, int] | None = None,
                columns: Literal["time", "step"] = "time") -> str:
    """Rows = ranks, cells like ``0F1``, ``.`` = idle; ``mark=(rank, step)`` draws that cell as ``>0F1<``.

    ``columns="time"``: time slots with every action one slot (the order the schedule makes, not durations);
    a schedule that :func:`validate` refuses is drawn by ``"step"``: each rank's list position.
    """
    cells: list[dict[int, str]] = []
    if columns == "time":
        try:
            validate(schedule)
            times, _ = run_order(schedule, lambda a: 1.0)
        except ScheduleError:
            columns = "step"
    for r, actions in enumerate(schedule.ranks):
        row = {}
        for i, a in enumerate(actions):
            col = i if columns == "step" else int(times[(a.stage, a.op, a.microbatch)][0])
            row[col] = (">{}<" if mark == (r, i) else " {} ").format(str(a))
        cells.append(row)
    width = max([len(c) for row in cells for c in row.values()] + [5])
    n = max([max(row, default=-1) + 1 for row in cells] + [1])
    lines = [(f"{columns:<7}" + "".join(f"{c:^{width}}" for c in range(n))).rstrip()]
    for r, row in enumerate(cells):
        idle = " . " if columns == "time" else "   "  # by step, a shorter list just ends
        text = "".join(_pad(row.get(c, idle), width) for c in range(n))
        lines.append(f"rank {r:<2}" + text.rstrip())
    return "\n".join(lines)


def _pad(cell: str, width: int) -> str:
    """Centre a cell, keeping a mark's ``>`` and ``<`` hugging the label."""
    inner = cell[1:-1].center(width - 2)
    return cell[0] + inner + cell[-1] if cell[0] == ">" else f" {inner} "
