"""Every rank's spans as one Chrome/Perfetto trace (Trace Event Format, JSON object form).

Open the file in https://ui.perfetto.dev (or chrome://tracing): one process row per rank, and inside it one
thread per kind (compute, comm, wait), so compute overlapping communication shows as two rows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from fourfold.files import write_text_atomic
from fourfold.observe.trace import KINDS, Span

__all__ = ["chrome_trace", "write_chrome_trace"]


def chrome_trace(spans_by_rank: Mapping[int, Sequence[Span]], groups: Mapping[int, str] | None = None
                 ) -> dict[str, Any]:
    """One Chrome/Perfetto trace (Trace Event Format, JSON object form) of every rank's spans.

    One process per rank, named ``rank N`` (``rank N: stage 1 dp 0 tp 1`` with ``groups``, ordered by it); inside it one thread per kind (compute, comm, wait) so that
    compute overlapping communication shows as two rows. Spans of one kind that overlap without nesting
    (two async messages in flight) get extra rows (``comm 2``, ...), since a thread's slices must nest.
    Complete events (``"ph": "X"``) carry ``ts``/``dur`` in microseconds.
    """
    # pid = rank + 1 and tids unique across the whole trace: Perfetto treats pid/tid 0 as the kernel's idle
    # task and names threads by tid alone, so rank 0 as pid 0 or reused tids get mangled there.
    events: list[dict[str, Any]] = []
    slices: list[dict[str, Any]] = []
    every = [s for spans in spans_by_rank.values() for s in spans]
    shift = -min(0, min((s.start_ns for s in every), default=0))  # spans before start(): keep ts >= 0
    next_tid = 1
    order = sorted(spans_by_rank, key=lambda r: (_numbers((groups or {}).get(r, "")), r))
    for rank in sorted(spans_by_rank):
        pid = rank + 1
        lanes = {kind: _lanes([s for s in spans_by_rank[rank] if s.kind == kind]) for kind in KINDS}
        tids: dict[tuple[str, int], int] = {}
        for k, kind in enumerate(KINDS):
            for lane in range(max(1, len(lanes[kind]))):
                tids[kind, lane] = next_tid
                lane_name = kind if lane == 0 else f"{kind} {lane + 1}"
                events.append(_meta("thread_name", pid, next_tid, name=lane_name))
                events.append(_meta("thread_sort_index", pid, next_tid, sort_index=10 * k + lane))
                next_tid += 1
        first = tids["compute", 0]
        label = (groups or {}).get(rank)
        events.append(_meta("process_name", pid, first, name=f"rank {rank}: {label}" if label else f"rank {rank}"))
        events.append(_meta("process_sort_index", pid, first, sort_index=order.index(rank)))
        for kind in KINDS:
            for lane, spans in enumerate(lanes[kind]):
                for s in spans:
                    if s.rank != rank:
                        raise ValueError(f"span.rank must equal its key in spans_by_rank, got span.rank="
                                         f"{s.rank} under key {rank}. Key each rank's spans by their rank.")
                    slices.append(_complete(s, pid, tids[kind, lane], shift))
    slices.sort(key=lambda e: (e["pid"], e["ts"], -e["dur"]))
    return {"traceEvents": events + slices, "displayTimeUnit": "ms"}


def _numbers(label: str) -> tuple[int, ...]:
    return tuple(int(w) for w in label.split() if w.isdigit())


def _meta(what: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": what, "ph": "M", "pid": pid, "tid": tid, "ts": 0, "args": args}


def _us(ns: int) -> float:
    # Whole eighths of a microsecond: k/8 and k/8 * 1000 are exact in binary floating point, so a viewer
    # that reads ts and dur back to nanoseconds gets exact integers and nested spans stay nested.
    return (ns // 125) / 8


def _complete(s: Span, pid: int, tid: int, shift: int) -> dict[str, Any]:
    args: dict[str, Any] = {**s.args, "bytes": s.bytes, "recv_bytes": s.recv_bytes}
    for key in ("microbatch", "step", "peer"):
        if getattr(s, key) is not None:
            args[key] = getattr(s, key)
    start, end = _us(s.start_ns + shift), _us(s.end_ns + shift)
    return {"name": s.name, "cat": s.kind, "ph": "X", "pid": pid, "tid": tid, "ts": start,
            "dur": end - start, "args": args}


def _lanes(spans: Sequence[Span]) -> list[list[Span]]:
    """Split spans into rows where each row's spans nest or follow one another (first fit)."""
    rows: list[list[Span]] = []
    open_ends: list[list[int]] = []  # per row, the end times of the spans still open (a nesting stack)
    for s in sorted(spans, key=lambda s: (s.start_ns, -s.end_ns)):
        for row, stack in zip(rows, open_ends, strict=True):
            while stack and stack[-1] <= s.start_ns:
                stack.pop()
            if not stack or s.end_ns <= stack[-1]:
                row.append(s)
                stack.append(s.end_ns)
                break
        else:
            rows.append([s])
            open_ends.append([s.end_ns])
    return rows


def write_chrome_trace(path: str | os.PathLike[str], spans_by_rank: Mapping[int, Sequence[Span]],
                       groups: Mapping[int, str] | None = None) -> None:
    """Write :func:`chrome_trace` as JSON (atomically: a temp file, then ``os.replace``)."""
    write_text_atomic(path, json.dumps(chrome_trace(spans_by_rank, groups), separators=(",", ":")))
