"""``fourfold schedule``: print and draw a pipeline schedule, its bubble and its memory; no process is started.

    fourfold schedule --schedule 1f1b --pp 4 --microbatches 8
    fourfold schedule --schedule interleaved --pp 4 --microbatches 8 --virtual 2 --out runs/il.png
    fourfold schedule --schedule all --pp 4 --microbatches 8        # every schedule, one above the other
    fourfold schedule --schedule 1f1b --comm 0.2                     # messages that take time

Prints the rank x time grid (every action one slot: the order the schedule makes), then the schedule run
with the costs given (--f forward, --b input gradient, --w weight gradient, each per micro-batch through
one rank's share of the model; a fused backward costs b + w): the makespan, the bubble next to its textbook
formula, and the peak number of micro-batches whose activations a rank holds at once. The PNG draws that
run: ranks as rows, time to the right, one colour per micro-batch; F solid, B lighter and hatched, W
lightest and dotted; white is idle. These are the numbers a traced run of the same schedule is measured
against.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from fourfold.parallel.schedule import SCHEDULES, Schedule, format_grid, make_schedule
from fourfold.parallel.timeline import Timeline, peak_in_flight, simulate, theory_bubble

__all__ = ["draw", "main", "report"]

FORMULAS = {
    "naive": "(p-1)/p",
    "gpipe": "(p-1)/(m+p-1)",
    "1f1b": "(p-1)/(m+p-1)",
    "interleaved": "(p-1)/(v*m+p-1)",
    "zb": "(p-1)(f+b-w)/(m(f+b+w)+(p-1)(f+b-w))",
}


def report(schedule: Schedule, timeline: Timeline) -> str:
    """The text ``fourfold schedule`` prints for one schedule."""
    s, t = schedule, timeline
    costs = f"f={_num(t.f)} b={_num(t.b)} w={_num(t.w)} comm={_num(t.comm)}"
    backward = "B = input gradient, W = weight gradient" if s.split_backward else \
        f"B = input and weight gradient, costing b+w = {_num(t.b + t.w)}"
    lines = [
        f"{s.name}: {(SCHEDULES[s.name].__doc__ or '').splitlines()[0].replace('``', '')}",
        f"pp={s.pp} ranks, {s.microbatches} micro-batches, {s.stages} stages (stage s on rank s % pp)",
        "",
        "order (one column per action; '.' = idle):",
        format_grid(s),
        "",
        f"simulated with {costs} ({backward}"
        + (f"; each of the {s.virtual} stages on a rank costs 1/{s.virtual})" if s.virtual > 1 else ")"),
        f"  makespan {_num(t.makespan)}, bubble {t.bubble:.1%} (theory {FORMULAS[s.name]} = "
        f"{theory_bubble(s.name, s.pp, s.microbatches, s.virtual, t.f, t.b, t.w):.1%}{_caveat(s, t)})",
    ]
    held, until_w = peak_in_flight(s), peak_in_flight(s, until="W")
    head = "  rank    busy    idle  bubble  peak in flight" + ("  until W" if s.split_backward else "")
    lines.append(head)
    for r in range(s.pp):
        row = f"  {r:<4}{t.busy[r]:8.2f}{t.makespan - t.busy[r]:8.2f}{t.bubble_by_rank[r]:8.1%}  {held[r]:>14}"
        if s.virtual > 1:
            row += f" (= {held[r] / s.virtual:g} micro-batches of a rank's layers)"
        lines.append(row + (f"  {until_w[r]:>7}" if s.split_backward else ""))
    lines.append("  peak in flight: the most micro-batches (stage, micro-batch pairs) whose forward ran and whose\n"
                 "  backward did not, i.e. the activations a rank holds at once"
                 + (";\n  until W: the same, counted until the weight gradient" if s.split_backward else ""))
    return "\n".join(lines)


def _caveat(s: Schedule, t: Timeline) -> str:
    """Where the textbook formula does not claim to hold, say which of its assumptions this run breaks."""
    broken = ["comm = 0"] if t.comm > 0 else []
    if s.name == "zb" and (s.microbatches < s.pp or t.w > min(t.f, t.b)):
        broken.append("m >= p and w <= min(f, b)")
    return f", which assumes {' and '.join(broken)}" if broken else ""


def _num(x: float) -> str:
    return f"{round(x, 4):g}"  # 31.3, not 31.299999999999994


def draw(timelines: list[Timeline], path: str | Path) -> None:
    """One panel per schedule, stacked on a shared time axis; written atomically as a PNG."""
    from fourfold.files import atomic_path
    from fourfold.observe.visualize import (  # one palette and shading with traced timelines
        _MICROBATCH_COLORS,
        OP_HATCH,
        OP_LEGEND,
        OP_SHADE,
        _matplotlib,
        mix,
    )

    Figure, FigureCanvasAgg = _matplotlib()  # first: its ImportError says how to install matplotlib
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Patch, Rectangle
    end = max(t.makespan for t in timelines)
    heights = [t.schedule.pp + 1.2 for t in timelines]
    fig = Figure(figsize=(11, 0.8 + 0.42 * sum(heights)), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    for ax, t in zip(axes, timelines, strict=True):
        s = t.schedule
        boxes: dict[str, tuple[list[Rectangle], list[tuple[float, float, float]]]] = {}  # op -> boxes, colours
        for r, row in enumerate(t.ranks):
            for a, start, stop in row:
                rects, colors = boxes.setdefault(a.op, ([], []))
                rects.append(Rectangle((start, r - 0.4), stop - start, 0.8))
                colors.append(mix(_MICROBATCH_COLORS[a.microbatch % len(_MICROBATCH_COLORS)], OP_SHADE[a.op]))
                label = f"{a.op}{a.microbatch}" if s.virtual == 1 else str(a)
                if (stop - start) / end * 900 > 6.5 * len(label):  # about 900 px of axis: label if it fits
                    ax.text((start + stop) / 2, r, label, ha="center", va="center", fontsize=6.5,
                            color="white" if a.op == "F" else "black", zorder=3)
        hatched = sum(len(rects) for rects, _ in boxes.values()) <= 2000  # more: too thin to see, slow to draw
        for op, (rects, colors) in boxes.items():  # one collection per hatch: thousands of boxes draw at once
            ax.add_collection(PatchCollection(rects, facecolors=colors, edgecolor="white", linewidth=0.6,
                                              hatch=OP_HATCH[op] if hatched else None))
        ax.set_yticks(range(s.pp), [f"rank {r}" for r in range(s.pp)])
        ax.set_ylim(s.pp - 0.5, -0.5)  # rank 0 on top
        ax.set_xlim(0, end * 1.005)
        ax.grid(axis="x", color="#DDDDDD", linewidth=0.6)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        virtual = f", virtual={s.virtual}" if s.virtual > 1 else ""
        ax.set_title(f"{s.name}: pp={s.pp}, {s.microbatches} micro-batches{virtual}; makespan "
                     f"{_num(t.makespan)}, bubble {t.bubble:.1%} (theory{' at comm 0' if t.comm else ''} {FORMULAS[s.name]} = "
                     f"{theory_bubble(s.name, s.pp, s.microbatches, s.virtual, t.f, t.b, t.w):.1%})",
                     fontsize=9, loc="left")
    axes[-1].set_xlabel(f"time (f={_num(timelines[0].f)}, b={_num(timelines[0].b)}, w={_num(timelines[0].w)}, "
                        f"comm={_num(timelines[0].comm)}; white = idle)")
    m = max(t.schedule.microbatches for t in timelines)
    handles = [Patch(facecolor=_MICROBATCH_COLORS[i], label=f"micro-batch {i}")
               for i in range(min(m, len(_MICROBATCH_COLORS)))]
    handles += [Patch(facecolor=mix("#666666", OP_SHADE[op]), hatch=OP_HATCH[op], edgecolor="white",
                      label=text) for op, text in OP_LEGEND
                if any(a.op == op for t in timelines for row in t.schedule.ranks for a in row)]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 8), frameon=False,
               fontsize=8)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


MAX_ACTIONS = 12_000  # F, B and W actions of all ranks: above it the grid is unreadable and slow to draw


def main(argv: list[str] | None = None) -> int:
    from fourfold.run.args import make_parser

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = make_parser("fourfold schedule", __doc__)
    parser.add_argument("--schedule", default="1f1b", choices=[*SCHEDULES, "all"],
                        help="which schedule, or all of them (default 1f1b)")
    parser.add_argument("--pp", "--stages", dest="pp", type=int, default=4, metavar="N",
                        help="pipeline ranks (default 4); with --virtual V they hold pp*V model stages")
    parser.add_argument("--microbatches", type=int, default=8, metavar="N", help="micro-batches (default 8)")
    parser.add_argument("--virtual", type=int, default=None, metavar="N",
                        help="stages per rank, interleaved only (default 2 for interleaved, else 1)")
    for flag, default, text in (("--f", 1.0, "forward"), ("--b", 1.0, "backward's input gradient"),
                                ("--w", 1.0, "backward's weight gradient"), ("--comm", 0.0, "one message")):
        parser.add_argument(flag, type=float, default=default, metavar="X",
                            help=f"time of {text} (default {default:g})")
    parser.add_argument("--out", default=None, metavar="PATH",
                        help="PNG path (default runs/schedule-NAME-pPxmM.png)")
    args = parser.parse_args(argv)
    for flag in ("f", "b", "w", "comm"):
        value = getattr(args, flag)
        if not math.isfinite(value):
            parser.error(f"--{flag} must be a finite time, got {value}.")
    actions = args.pp * args.microbatches * max(args.virtual or 1, 2 if args.schedule in ("interleaved", "all")
                                                else 1) * 3
    if actions > MAX_ACTIONS:
        parser.error(f"--pp {args.pp} x --microbatches {args.microbatches} makes {actions:,} actions to place and "
                     f"draw; fourfold schedule shows at most {MAX_ACTIONS:,} (a bigger grid is unreadable). Pass "
                     "fewer: the bubble formula (pp-1)/(m+pp-1) gives the big case's figure, e.g. --pp 8 "
                     "--microbatches 32.")
    names = list(SCHEDULES) if args.schedule == "all" else [args.schedule]
    timelines = []
    for name in names:
        virtual = args.virtual if args.virtual is not None else (2 if name == "interleaved" else 1)
        try:
            schedule = make_schedule(name, args.pp, args.microbatches, virtual)
            timeline = simulate(schedule, args.f, args.b, args.w, args.comm)
        except ValueError as e:
            if args.schedule != "all":
                parser.error(str(e))
            print(f"{name}: skipped: {e}\n")
            continue
        timelines.append(timeline)
        print(report(schedule, timeline), end="\n\n")
    if not timelines:
        return 1
    out = Path(args.out or f"runs/schedule-{args.schedule}-p{args.pp}xm{args.microbatches}.png")
    try:
        draw(timelines, out)
        print(f"picture: {out}")
    except ImportError as e:
        print(f"(no picture: {e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
