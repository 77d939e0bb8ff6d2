"""The tracer, its JSONL and Chrome-trace outputs, and the timeline picture.

Pure tests, no processes. A failure in the Chrome-trace tests means trace.json may not open (or may open
wrong) in ui.perfetto.dev / chrome://tracing; a failure in the disabled-tracer tests means tracing off is no
longer free.
"""

from __future__ import annotations

import json
import pickle
import time

import pytest
import torch.distributed as dist

from fourfold.comm.wait import gather_spans
from fourfold.observe.chrome_trace import chrome_trace, write_chrome_trace
from fourfold.observe.trace import KINDS, Span, Tracer, load_jsonl


def _span(rank: int, kind: str, start_us: float, end_us: float, name: str = "x", **kw) -> Span:
    return Span(rank, kind, name, int(start_us * 1000), int(end_us * 1000), **kw)


def _two_ranks() -> dict[int, list[Span]]:
    """Rank 0 computes, sends, computes while a second send overlaps; rank 1 waits, receives, computes."""
    return {
        0: [_span(0, "compute", 0, 100, "F", microbatch=0, step=1),
            _span(0, "compute", 10, 40, "block", microbatch=0, step=1),
            _span(0, "comm", 100, 130, "send", bytes=4096, peer=1, step=1, args={"tag": "act"}),
            _span(0, "compute", 130, 230, "F", microbatch=1, step=1),
            _span(0, "comm", 120, 200, "send", bytes=4096, peer=1, step=1)],  # overlaps the first send
        1: [_span(1, "wait", 0, 100, "recv_wait", step=1),
            _span(1, "comm", 100, 130, "recv", recv_bytes=4096, peer=0, step=1),
            _span(1, "compute", 130, 230, "F", microbatch=0, step=1)],
    }


# --- recording ------------------------------------------------------------------------------------------


def test_spans_are_recorded_in_order_with_kinds_names_bytes_and_step() -> None:
    t = Tracer(3)
    t.start()
    t.set_step(7)
    with t.span("compute", "forward", microbatch=2):
        pass
    with t.span("comm", "send", bytes=128, peer=4, tag="act") as s:
        s.set(recv_bytes=64)
    t.set_step(8)
    t0 = t.now_ns()
    t.record("wait", "bubble", t0, t0 + 500)
    assert [(s.kind, s.name) for s in t.spans] == [("compute", "forward"), ("comm", "send"), ("wait", "bubble")]
    fwd, send, bubble = t.spans
    assert (fwd.rank, fwd.microbatch, fwd.step, fwd.bytes) == (3, 2, 7, 0)
    assert (send.bytes, send.recv_bytes, send.peer, send.args, send.step) == (128, 64, 4, {"tag": "act"}, 7)
    assert (bubble.step, bubble.end_ns - bubble.start_ns) == (8, 500)
    assert 0 <= fwd.start_ns <= fwd.end_ns <= send.start_ns <= send.end_ns
    assert bubble.duration_s == pytest.approx(5e-7)


def test_a_span_is_recorded_when_its_block_raises() -> None:
    t = Tracer(0)
    with pytest.raises(RuntimeError, match="boom"):
        with t.span("comm", "recv", peer=1):
            raise RuntimeError("boom")
    assert len(t.spans) == 1
    assert (t.spans[0].kind, t.spans[0].name, t.spans[0].args) == ("comm", "recv", {"error": "RuntimeError"})


def test_nested_spans_close_inner_first() -> None:
    t = Tracer(0)
    with t.span("compute", "outer"):
        with t.span("compute", "inner"):
            pass
    inner, outer = t.spans
    assert (inner.name, outer.name) == ("inner", "outer")
    assert outer.start_ns <= inner.start_ns <= inner.end_ns <= outer.end_ns


def test_bad_input_is_refused_with_the_value() -> None:
    t = Tracer(0)
    with pytest.raises(ValueError, match="kind must be one of .* got 'compte'"):
        t.span("compte", "forward")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="end_ns must be >= start_ns, got 10..5"):
        t.record("comm", "send", 10, 5)
    with pytest.raises(ValueError, match=r"must not reuse Span field names, got \['step'\]"):
        t.span("compute", "forward", step=3)
    with pytest.raises(ValueError, match="rank must be >= 0, got -1"):
        Tracer(-1)
    assert t.spans == []


def test_count_and_totals_sum_per_kind_and_comm_bytes() -> None:
    t = Tracer(0)
    t.record("compute", "F", 0, 2_000_000)
    t.record("comm", "send", 2_000_000, 2_500_000, bytes=100, peer=1)
    t.record("comm", "recv", 2_500_000, 3_000_000, recv_bytes=40, peer=1)
    t.record("wait", "bubble", 3_000_000, 4_000_000)
    t.record("compute", "B", 4_000_000, 8_000_000, bytes=999)  # bytes on compute are not traffic
    assert t.count() == 5 and t.count("comm") == 2 and t.count(name="F") == 1 and t.count("wait", "F") == 0
    assert t.totals() == {"compute_s": pytest.approx(6e-3), "comm_s": pytest.approx(1e-3),
                          "wait_s": pytest.approx(1e-3), "bytes": 100, "recv_bytes": 40, "messages": 2}
    since = t.totals(since=2)
    assert (since["compute_s"], since["comm_s"], since["bytes"], since["messages"]) == \
        (pytest.approx(4e-3), pytest.approx(5e-4), 0, 1)
    assert t.totals(since=99)["messages"] == 0
    with pytest.raises(ValueError, match="since must be"):
        t.totals(since=-1)


# --- disabled -------------------------------------------------------------------------------------------


def test_disabled_tracer_records_nothing_and_hands_out_one_object() -> None:
    t = Tracer(0, enabled=False)
    first = t.span("compute", "forward")
    assert t.span("comm", "send", bytes=8, peer=1, tag="x") is first
    with t.span("comm", "recv") as s:
        s.set(recv_bytes=8)
    t.record("wait", "bubble", 0, 10)
    assert t.spans == [] and t.count() == 0 and t.now_ns() == 0
    assert t.totals()["messages"] == 0


def test_disabled_span_reads_no_clock_and_allocates_nothing(monkeypatch) -> None:
    # What makes a disabled tracer free, checked as behaviour (not timed): no clock read, one shared null span.
    t = Tracer(0, enabled=False)

    def no_clock() -> int:
        raise AssertionError("a disabled tracer read the clock")

    monkeypatch.setattr(time, "perf_counter_ns", no_clock)
    spans = set()
    for _ in range(3):
        with t.span("compute", "forward", microbatch=1) as s:
            spans.add(id(s))
    assert len(spans) == 1 and t.spans == []


# --- files ----------------------------------------------------------------------------------------------


def test_jsonl_round_trip(tmp_path) -> None:
    t = Tracer(2)
    t.set_step(1)
    with t.span("comm", "all_reduce", bytes=12, tensor_bytes=12, shape=[3, 1]):
        pass
    t.record("compute", "F", 5, 9, microbatch=0)
    path = tmp_path / "trace-rank2.jsonl"
    t.write_jsonl(path)
    assert len(path.read_text().splitlines()) == 2
    assert load_jsonl(path) == t.spans
    assert not list(tmp_path.glob(".*.tmp"))  # the temp file was moved into place


def test_jsonl_refuses_args_that_are_not_json(tmp_path) -> None:
    t = Tracer(0)
    t.record("compute", "F", 0, 1, obj=object())
    with pytest.raises(TypeError, match="args must be JSON-serialisable"):
        t.write_jsonl(tmp_path / "t.jsonl")
    assert list(tmp_path.iterdir()) == []


def test_span_pickles_as_gather_object_needs() -> None:
    s = _span(1, "comm", 1, 2, bytes=3, args={"a": [1]})
    assert pickle.loads(pickle.dumps(s)) == s
    assert hash(s) == hash(pickle.loads(pickle.dumps(s)))


# --- Chrome / Perfetto trace ----------------------------------------------------------------------------


def test_chrome_trace_is_valid_trace_event_json(tmp_path) -> None:
    path = tmp_path / "trace.json"
    write_chrome_trace(path, _two_ranks())
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    for e in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= e.keys(), e
        assert e["ph"] in ("X", "M") and e["ts"] >= 0
        assert all(isinstance(e[k], int) and e[k] > 0 for k in ("pid", "tid")), e  # Perfetto: 0 is special
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["cat"] in KINDS and isinstance(e["ts"], float), e
    meta = [e for e in events if e["ph"] == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert processes == {1: "rank 0", 2: "rank 1"}
    sort = {e["pid"]: e["args"]["sort_index"] for e in meta if e["name"] == "process_sort_index"}
    assert sort == {1: 0, 2: 1}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert sorted(threads.values()) == sorted(["compute", "comm", "comm 2", "wait", "compute", "comm", "wait"])
    assert len({tid for _, tid in threads}) == len(threads)  # tids unique across the trace
    for e in events:  # every slice sits on a named thread of its own process
        if e["ph"] == "X":
            assert threads[e["pid"], e["tid"]].split()[0] == e["cat"]


def test_chrome_trace_times_and_args() -> None:
    events = chrome_trace(_two_ranks())["traceEvents"]
    sends = sorted((e for e in events if e["name"] == "send"), key=lambda e: e["ts"])
    assert [(e["ts"], e["dur"]) for e in sends] == [(100.0, 30.0), (120.0, 80.0)]  # microseconds
    assert sends[0]["tid"] != sends[1]["tid"]  # overlapping, not nested: separate rows
    assert sends[0]["args"] == {"tag": "act", "bytes": 4096, "recv_bytes": 0, "step": 1, "peer": 1}
    f1 = next(e for e in events if e["name"] == "F" and e["args"].get("microbatch") == 1 and e["pid"] == 1)
    assert f1["args"]["microbatch"] == 1 and f1["cat"] == "compute"
    block = next(e for e in events if e["name"] == "block")
    outer = next(e for e in events if e["name"] == "F" and e["pid"] == 1 and e["ts"] == 0.0)
    assert block["tid"] == outer["tid"]  # nested spans share a row
    recv = next(e for e in events if e["name"] == "recv")
    assert recv["pid"] == 2 and recv["args"]["recv_bytes"] == 4096 and recv["args"]["peer"] == 0


def test_chrome_trace_shifts_spans_from_before_start_to_keep_ts_non_negative() -> None:
    spans = {0: [_span(0, "compute", -50, 10)], 1: [_span(1, "comm", 0, 5)]}
    xs = {e["pid"]: e for e in chrome_trace(spans)["traceEvents"] if e["ph"] == "X"}
    assert (xs[1]["ts"], xs[1]["dur"], xs[2]["ts"]) == (0.0, 60.0, 50.0)  # both ranks shift together


def test_chrome_trace_of_a_rank_without_spans_still_names_its_process() -> None:
    events = chrome_trace({0: [], 1: [_span(1, "compute", 0, 1)]})["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"rank 0", "rank 1"}


def test_chrome_trace_refuses_spans_under_the_wrong_rank() -> None:
    with pytest.raises(ValueError, match="span.rank must equal its key in spans_by_rank, got span.rank=1"):
        chrome_trace({0: [_span(1, "compute", 0, 1)]})


# --- gather ---------------------------------------------------------------------------------------------


def test_gather_spans_without_a_process_group_returns_this_rank() -> None:
    assert not dist.is_initialized()
    t = Tracer(5)
    t.record("compute", "F", 0, 1)
    gathered = gather_spans(t)
    assert gathered == {5: t.spans}
    gathered[5].append(_span(5, "wait", 1, 2))
    assert len(t.spans) == 1  # a copy, not the tracer's own list


# --- picture --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("color_by", ["kind", "microbatch"])
def test_timeline_writes_a_png(tmp_path, color_by) -> None:
    pytest.importorskip("matplotlib")
    from fourfold.observe.visualize import timeline

    path = tmp_path / f"timeline-{color_by}.png"
    timeline(_two_ranks(), path, title="two ranks", color_by=color_by)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_a_traced_pipeline_step_shades_b_and_w_as_the_schedules_picture_does(tmp_path, monkeypatch) -> None:
    """F solid, B lighter and hatched, W lightest and dotted, in the micro-batch's colour (fourfold schedule
    --png): without it an interleaved or pp4 timeline, too narrow to label, cannot tell F from B."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from fourfold.observe.visualize import _MICROBATCH_COLORS, OP_HATCH, OP_SHADE, mix, timeline

    drawn = []
    barh = Axes.broken_barh
    monkeypatch.setattr(Axes, "broken_barh", lambda self, xranges, yrange, **kw: (
        drawn.append((kw["facecolors"][0], kw.get("hatch"))), barh(self, xranges, yrange, **kw))[1])
    spans = {0: [_span(0, "compute", 10 * i, 10 * i + 9, op, microbatch=1, args={"stage": 0}) for i, op in enumerate("FBW")]}
    timeline(spans, tmp_path / "zb.png", color_by="microbatch")
    green = _MICROBATCH_COLORS[1]
    assert drawn == [(green if op == "F" else mix(green, OP_SHADE[op]), OP_HATCH[op]) for op in "FBW"], drawn


def test_timeline_refuses_bad_input(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from fourfold.observe.visualize import timeline

    with pytest.raises(ValueError, match="color_by must be 'kind', 'microbatch' or 'name', got 'rank'"):
        timeline(_two_ranks(), tmp_path / "t.png", color_by="rank")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one rank"):
        timeline({}, tmp_path / "t.png")


def test_hidden_fraction_counts_comm_under_compute_but_not_under_a_wait() -> None:
    from fourfold.observe.trace import hidden_fraction

    spans = [
        _span(0, "compute", 0, 100),    # backward, 0..100
        _span(0, "wait", 80, 100),      # ... blocked on the last bucket from 80
        _span(0, "comm", 50, 100, name="allreduce:ring"),   # a bucket reduced 50..100: 30 hidden, 20 exposed
        _span(0, "comm", 10, 20, name="tp.all_reduce"),     # inline tensor-parallel collective: not counted
    ]
    assert hidden_fraction(spans) == pytest.approx(30 / 50)
    assert hidden_fraction(spans[:2]) is None  # no communication at all


def test_hidden_fraction_counts_zeros_reduce_scatters_and_all_gathers() -> None:
    from fourfold.observe.trace import hidden_fraction

    spans = [
        _span(0, "compute", 0, 100),
        _span(0, "comm", 40, 60, name="reduce_scatter:ring"),  # under backward: hidden
        _span(0, "comm", 100, 120, name="all_gather:native"),  # after it: exposed
    ]
    assert hidden_fraction(spans) == pytest.approx(20 / 40)


def test_an_interleaved_rank_is_labelled_with_every_stage_it_runs(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from fourfold.observe.visualize import _stages, timeline

    assert _stages("stage 0 dp 1", [0, 2]) == "stages 0, 2 dp 1"
    assert _stages("stage 1", [1]) == "stage 1" and _stages("dp 0", []) == "dp 0"
    spans = {r: [_span(r, "compute", 100 * k, 100 * k + 90, name="F", microbatch=k % 2, args={"stage": r + 2 * (k // 2)})
                 for k in range(4)] for r in range(2)}
    timeline(spans, tmp_path / "t.png", color_by="microbatch", labels={0: "stage 0", 1: "stage 1"})
    assert (tmp_path / "t.png").stat().st_size > 0


def test_every_document_piece_gets_its_own_colour() -> None:
    pytest.importorskip("matplotlib")
    from fourfold.observe.visualize import _piece_colors

    for n in (3, 20, 21, 64):  # the demo's step holds 20 pieces: 10 colours made pairs look alike
        assert len(set(_piece_colors(list(range(n))).values())) == n
