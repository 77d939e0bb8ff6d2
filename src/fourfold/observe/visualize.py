"""Pictures of traced runs: one row per rank, time running right, a box per span, idle as white space.

::

    from fourfold.observe.trace import load_jsonl
    from fourfold.observe.visualize import timeline

    spans = {r: load_jsonl(f"out/trace-rank{r}.jsonl") for r in range(4)}
    timeline(spans, "timeline.png", color_by="microbatch")

Needs matplotlib (``pip install 'fourfold[viz]'``). Drawing goes through matplotlib's Agg canvas directly,
never pyplot, so it neither switches the caller's backend nor keeps figures alive.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from fourfold.files import atomic_path
from fourfold.observe.trace import KINDS, Span

__all__ = ["KIND_COLORS", "OP_HATCH", "OP_LEGEND", "OP_SHADE", "draw_packing", "draw_step", "mix", "rank_labels",
           "timeline"]

KIND_COLORS = {"compute": "#4C72B0", "comm": "#DD8452", "wait": "#C44E52"}
# Micro-batch colours: tab10 without its orange and red (comm and wait here) and its grey (no micro-batch).
_MICROBATCH_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#5254a3")
_NO_MICROBATCH = "#B0B0B0"
# A pipeline action's box: its micro-batch's colour, lighter and hatched for backward, lightest and dotted for the
# weight gradient; the same in the schedule's simulated picture (fourfold schedule --png) and a traced run's.
OP_SHADE = {"F": 0.0, "B": 0.45, "W": 0.65}  # how far each op's box is mixed towards white
OP_HATCH = {"F": None, "B": "////", "W": "...."}
OP_LEGEND = (("F", "F forward"), ("B", "B backward"), ("W", "W weight gradient"))
# Within a rank's row: compute fills the band; comm sits in its lower part and wait in its upper part, drawn
# over compute, so communication that overlaps computation shows as a strip across the compute box.
_BAND = 0.8
_STRIP = 0.38


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("fourfold.observe.visualize needs matplotlib, got none installed. "
                          "Install the extra: pip install 'fourfold[viz]'.") from e
    return Figure, FigureCanvasAgg


def rank_labels(mesh: Any) -> dict[int, str]:
    """Each rank's place on a :class:`~fourfold.mesh.Mesh`, for timelines and traces: ``"stage 1 dp 0 tp 1"``
    (axes of size 1 left out; ``rank N`` alone on one process)."""
    labels = {}
    for rank in range(mesh.world_size):
        c = mesh.coord(rank)
        parts = [f"{name} {index}" for name, index, size in
                 (("stage", c.pp, mesh.pp), ("dp", c.dp, mesh.dp), ("tp", c.tp, mesh.tp)) if size > 1]
        labels[rank] = " ".join(parts)
    return labels


def _stages(label: str, held: list[int]) -> str:
    """A rank's row label naming every stage it runs: ``stage 0`` (its pipeline coordinate) becomes
    ``stages 0, 2`` under an interleaved schedule."""
    if len(held) < 2:
        return label
    return re.sub(r"\bstage \d+", "stages " + ", ".join(map(str, held)), label, count=1)


def timeline(spans_by_rank: Mapping[int, Sequence[Span]], path: str | os.PathLike[str], title: str | None = None,
             color_by: Literal["kind", "microbatch", "name"] = "kind", labels: Mapping[int, str] | None = None
             ) -> None:
    """Draw every rank's spans as boxes on a shared time axis (ms since ``Tracer.start``) and write a PNG.

    Rank 0 is the top row; with ``labels`` (:func:`rank_labels`) each row also names the rank's pipeline
    stage and dp/tp coordinates, and rows are ordered by that label, so a stage's ranks sit together.
    ``color_by="kind"`` colours compute / comm / wait; ``"microbatch"`` colours compute
    by micro-batch (labelled inside boxes wide enough: ``F3`` for a span named ``F`` on micro-batch 3, else ``3``)
    and keeps comm and wait in their kind colours; ``"name"`` colours compute by span name (forward, backward,
    optimizer, ...).
    """
    if color_by not in ("kind", "microbatch", "name"):
        raise ValueError(f"color_by must be 'kind', 'microbatch' or 'name', got {color_by!r}.")
    if not spans_by_rank:
        raise ValueError("spans_by_rank must hold at least one rank, got an empty mapping. "
                         "Trace with an enabled Tracer and pass gather_spans(tracer).")
    Figure, FigureCanvasAgg = _matplotlib()
    ranks = sorted(spans_by_rank, key=lambda r: _label_key(labels, r))
    every = [s for r in ranks for s in spans_by_rank[r]]
    t0 = min((s.start_ns for s in every), default=0) / 1e6  # the window the spans shown cover
    t1 = max((s.end_ns / 1e6 for s in every), default=1.0)
    span_ms = max(t1 - t0, 1e-6)

    fig = Figure(figsize=(11, 1.4 + 0.55 * len(ranks)), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    legend: dict[str, list[str]] = {}  # colour -> labels sharing it
    held = {r: sorted({s.args["stage"] for s in spans_by_rank[r] if s.kind == "compute" and "stage" in s.args})
            for r in ranks}  # the pipeline stages each rank runs (interleaved: several)
    ops: set[str] = set()  # pipeline actions drawn in their own shade (B, W)
    for row, rank in enumerate(ranks):
        # one broken_barh call per colour and hatch
        boxes: dict[tuple[str, Any, str | None], list[tuple[float, float]]] = {}
        several = len(held[rank]) > 1
        for s in spans_by_rank[rank]:
            x, w = s.start_ns / 1e6 - t0, (s.end_ns - s.start_ns) / 1e6
            color, label = (_compute_color(s, color_by) if s.kind == "compute"
                            else (KIND_COLORS[s.kind], s.kind))
            if label not in legend.setdefault(color, []):
                legend[color].append(label)
            numbered = color_by == "microbatch" and s.kind == "compute" and s.microbatch is not None
            op = s.name if numbered and s.name in OP_SHADE else None  # a pipeline action: F / B / W
            if op is not None:
                ops.add(op)
            shade: Any = mix(color, OP_SHADE[op]) if op in ("B", "W") else color
            boxes.setdefault((s.kind, shade, OP_HATCH[op] if op else None), []).append((x, w))
            if numbered:
                # schedule actions are named F / B / W: "F3" reads like the schedule printouts
                text = f"{s.name}{s.microbatch}" if len(s.name) <= 2 else str(s.microbatch)
                if several and "stage" in s.args:  # which of the rank's stages: "F3 s2"
                    text = f"{text} s{s.args['stage']}"
                if w > 0.012 * span_ms * len(text):
                    ax.text(x + w / 2, row, text, ha="center", va="center", fontsize=7, zorder=4,
                            color="black" if op in ("B", "W") else "white")
        for (kind, color, hatch), xw in boxes.items():
            if kind == "compute":
                y, h = row - _BAND / 2, _BAND
            elif kind == "comm":  # lower strip
                y, h = row + _BAND / 2 - _STRIP, _STRIP
            else:  # wait: upper strip, so a wait on communication does not hide the communication itself
                y, h = row - _BAND / 2, _STRIP
            ax.broken_barh(xw, (y, h), facecolors=[color], edgecolors="white", linewidth=0.4, hatch=hatch,
                           zorder=2 if kind == "compute" else 3)

    names = [f"rank {r}" + (f"\n{_stages(labels[r], held[r])}" if labels and labels.get(r) else "") for r in ranks]
    ax.set_yticks(range(len(ranks)), names, fontsize=8 if labels else None)
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time (ms)" if t0 == 0 else f"time (ms) from {t0:,.1f} ms after the tracer started")
    ax.grid(axis="x", color="#DDDDDD", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"timeline: {len(ranks)} rank{'s' * (len(ranks) != 1)}, {t1 - t0:.1f} ms "
                 "(white = idle)", fontsize=10)
    if legend:
        from matplotlib.patches import Patch

        order = sorted(legend.items(), key=lambda item: _legend_rank(item[1][0]))
        handles = [Patch(facecolor=color) for color, _ in order]
        entries = [_join(kinds) for _, kinds in order]
        if ops - {"F"}:  # the shades of backward and weight gradient, as the schedule's picture shows them
            shades = [(op, text) for op, text in OP_LEGEND if op in ops]
            handles += [Patch(facecolor=mix("#666666", OP_SHADE[op]), hatch=OP_HATCH[op], edgecolor="white")
                        for op, _ in shades]
            entries += [text for _, text in shades]
        fig.legend(handles, entries, loc="outside lower center", ncols=min(len(handles), 6), frameon=False,
                   fontsize=8)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


def draw_step(spans_by_rank: Mapping[int, Sequence[Span]], step: int, path: str | os.PathLike[str],
              title: str, **kwargs: Any) -> bool:
    """:func:`timeline` of one step's spans; False, drawing nothing, when matplotlib is missing (pictures are
    optional: ``pip install 'fourfold[viz]'``)."""
    try:
        timeline({r: [s for s in spans if s.step == step] for r, spans in spans_by_rank.items()}, path,
                 title=title, **kwargs)
    except ImportError:
        return False
    return True


def _label_key(labels: Mapping[int, str] | None, rank: int) -> tuple[int, ...]:
    """``"stage 1 dp 0 tp 1"`` -> (1, 0, 1, rank): numbers in label order, so stages group and sort."""
    words = (labels or {}).get(rank, "").split()
    return (*(int(w) for w in words[1::2] if w.isdigit()), rank)


def mix(color: str, white: float) -> tuple[float, float, float]:
    """``color`` (``#rrggbb``) moved ``white`` of the way towards white: a lighter shade of the same colour."""
    rgb = [int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return tuple(c + (1 - c) * white for c in rgb)  # type: ignore[return-value]


def _compute_color(s: Span, color_by: str) -> tuple[str, str]:
    if color_by == "kind":
        return KIND_COLORS["compute"], "compute"
    if color_by == "name":
        return _MICROBATCH_COLORS[sum(map(ord, s.name)) % len(_MICROBATCH_COLORS)], s.name
    if s.microbatch is None:
        return _NO_MICROBATCH, "compute (no micro-batch)"
    return _MICROBATCH_COLORS[s.microbatch % len(_MICROBATCH_COLORS)], f"micro-batch {s.microbatch}"


def _legend_rank(label: str) -> tuple[int, int]:
    """Legend order: micro-batches by number, then plain compute, comm, wait."""
    if label.startswith("micro-batch "):
        return (0, int(label.split()[1]))
    if label not in ("compute", "compute (no micro-batch)", *KINDS[1:]):
        return (0, 0)  # a span name (color_by="name")
    return (1, ["compute", "compute (no micro-batch)", *KINDS[1:]].index(label))


def _join(labels: list[str]) -> str:
    # colours repeat every len(_MICROBATCH_COLORS) micro-batches: name them all on one entry
    if len(labels) > 1 and all(x.startswith("micro-batch ") for x in labels):
        numbers = sorted(int(x.split()[1]) for x in labels)
        return "micro-batch " + ", ".join(map(str, numbers))
    return " / ".join(labels)


def _piece_colors(ids: list[int]) -> dict[int, Any]:
    """A colour per document piece, none shared: matplotlib's 20 qualitative colours, or for more pieces
    evenly spaced hues, visited with a stride so neighbouring pieces differ."""
    from matplotlib import colormaps

    if len(ids) <= 20:
        return {d: colormaps["tab20"](k) for k, d in enumerate(ids)}
    n, stride = len(ids), max(1, round(len(ids) * 0.382))  # the golden section: neighbours land far apart
    while math.gcd(stride, n) != 1:
        stride += 1
    return {d: colormaps["turbo"](0.05 + 0.9 * ((k * stride) % n) / (n - 1)) for k, d in enumerate(ids)}


def draw_packing(batches: Mapping[str, Any], path: str | os.PathLike[str], title: str | None = None) -> bool:
    """One global batch per panel (``{name: Batch}``, the same documents arranged differently): a row per
    sequence, a coloured bar per document (a split one keeps its colour), padding left white. False, drawing
    nothing, when matplotlib is missing."""
    try:
        Figure, FigureCanvasAgg = _matplotlib()
    except ImportError:
        return False
    fig = Figure(figsize=(5 * len(batches), 5.5), layout="constrained")
    width = max(b.inputs.size(1) for b in batches.values())
    color = _piece_colors(sorted({d for b in batches.values() for d in b.documents.unique().tolist() if d >= 0}))
    for i, (name, b) in enumerate(batches.items()):
        ax = fig.add_subplot(1, len(batches), i + 1)
        docs = b.documents
        for r in range(docs.size(0)):
            row = docs[r].tolist()
            t = 0
            while t < len(row):
                end = t
                while end < len(row) and row[end] == row[t]:
                    end += 1
                if row[t] >= 0:
                    ax.barh(r, end - t, left=t, height=0.85, color=color[row[t]], edgecolor="white", linewidth=0.5)
                t = end
        s = b.stats
        ax.set_xlim(0, width)
        ax.set_ylim(docs.size(0) - 0.5, -0.5)
        ax.set(xlabel="position in the row", ylabel="row")
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.set_title(f"{name}: {s['rows']} rows x {s['width']}, {s['padding_fraction']:.0%} padding", fontsize=9)
    fig.suptitle(title or "the same documents, padded and packed (white = padding)", fontsize=10)
    with atomic_path(path) as tmp:
        FigureCanvasAgg(fig).print_png(str(tmp))
    return True


MEMORY_TERMS = ("parameters", "gradients", "optimizer", "activations")


def draw_memory(layouts: Mapping[str, Mapping[str, Mapping[str, int]]], path: str | os.PathLike[str],
                title: str | None = None) -> bool:
    """Bytes per rank as stacked bars, one pair per layout: ``{layout: {"estimated": {term: bytes}, "measured":
    {...}}}`` with the terms of :data:`MEMORY_TERMS`. False, drawing nothing, when matplotlib is missing."""
    try:
        Figure, FigureCanvasAgg = _matplotlib()
    except ImportError:
        return False
    fig = Figure(figsize=(2.2 + 1.9 * len(layouts), 4.8), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    colors = dict(zip(MEMORY_TERMS, ("C0", "C2", "C3", "C1"), strict=True))
    ticks, labels = [], []
    for i, (name, kinds) in enumerate(layouts.items()):
        for j, kind in enumerate(("estimated", "measured")):
            if kind not in kinds:
                continue
            x = 3 * i + j
            bottom = 0.0
            for term in MEMORY_TERMS:
                value = kinds[kind].get(term, 0) / 2**20
                ax.bar(x, value, bottom=bottom, color=colors[term], width=0.9, hatch="//" if j == 0 else None,
                       edgecolor="white", label=term if i == 0 and j == 1 else None)
                bottom += value
            ax.annotate(f"{bottom:.1f}", (x, bottom), ha="center", va="bottom", fontsize=7)
            ticks.append(x)
            labels.append(f"{name}\n{'est.' if j == 0 else 'meas.'}")
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set(ylabel="MB per rank (MB = 2^20 B)")
    ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(title or "memory per rank: estimated before launch (hatched) and measured", fontsize=10)
    with atomic_path(path) as tmp:
        FigureCanvasAgg(fig).print_png(str(tmp))
    return True
