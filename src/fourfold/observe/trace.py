"""Per-rank spans (compute / comm / wait) -> JSONL, and one merged Chrome/Perfetto trace of every rank.

Each rank owns one :class:`Tracer` and passes it to whatever does work; there is no module-level tracer::

    tracer = Tracer(rank)
    dist.barrier(); tracer.start()          # t=0 on every rank is the instant the barrier released
    tracer.set_step(1)
    with tracer.span("compute", "forward", microbatch=0):
        y = model(x)
    with tracer.span("comm", "send", bytes=y.nbytes, peer=rank + 1):
        dist.send(y, rank + 1)
    with tracer.span("comm", "recv", peer=rank - 1) as s:
        dist.recv(buf, rank - 1)
        s.set(recv_bytes=buf.nbytes)        # sizes known only afterwards can be added inside the block
    tracer.totals(since=0)                  # {"compute_s": ..., "comm_s": ..., "bytes": ..., "messages": ...}
    spans = gather_spans(tracer)            # every rank's spans on rank 0, None elsewhere (fourfold.comm.wait)
    if spans is not None:
        write_chrome_trace("trace.json", spans)   # open in https://ui.perfetto.dev or chrome://tracing

Kinds: ``compute`` (useful work), ``comm`` (a send, recv or collective in flight), ``wait`` (blocked on a
peer or a dependency: idle time with a reason). Times are ``time.perf_counter_ns()`` minus the origin set by
:meth:`Tracer.start`; ranks share t=0 only as well as the barrier before ``start()`` lines them up (tens of
microseconds on one machine; each machine's clock runs on its own).

A disabled tracer (``Tracer(rank, enabled=False)``) costs one attribute test per call: ``span()`` returns one
shared no-op context manager and reads no clock.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from fourfold.files import write_text_atomic

__all__ = [
    "DATA_PARALLEL_SPANS",
    "KINDS",
    "Kind",
    "Span",
    "Tracer",
    "hidden_fraction",
    "load_jsonl",
]

Kind = Literal["compute", "comm", "wait"]
KINDS: tuple[Kind, ...] = ("compute", "comm", "wait")
_RESERVED = frozenset({"rank", "kind", "name", "start_ns", "end_ns", "step", "args"})


@dataclass(frozen=True, slots=True)
class Span:
    """One timed piece of work on one rank: ``[start_ns, end_ns)`` on that rank's tracer clock.

    ``bytes``/``recv_bytes`` are the payload sent/received by a comm span; ``peer`` the other rank of a
    point-to-point message; ``args`` any extra JSON-serialisable detail.
    """

    rank: int
    kind: Kind
    name: str
    start_ns: int
    end_ns: int
    bytes: int = 0
    recv_bytes: int = 0
    microbatch: int | None = None
    step: int | None = None
    peer: int | None = None
    args: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Span:
        if d.get("kind") not in KINDS:
            raise ValueError(f"span kind must be one of {KINDS}, got {d.get('kind')!r} in {dict(d)}.")
        return cls(**d)


class _OpenSpan:
    """The context manager behind :meth:`Tracer.span`: times its block and records one :class:`Span`."""

    __slots__ = ("_tracer", "_kind", "_name", "_bytes", "_recv_bytes", "_microbatch", "_peer", "_args",
                 "_step", "_start")

    def __init__(self, tracer: Tracer, kind: Kind, name: str, bytes: int, recv_bytes: int,
                 microbatch: int | None, peer: int | None, args: dict[str, Any]) -> None:
        self._tracer, self._kind, self._name = tracer, kind, name
        self._bytes, self._recv_bytes, self._microbatch, self._peer, self._args = (
            bytes, recv_bytes, microbatch, peer, args)

    def set(self, *, bytes: int | None = None, recv_bytes: int | None = None, **args: Any) -> None:
        """Fill in fields known only inside the block (a received tensor's size, say)."""
        if bytes is not None:
            self._bytes = bytes
        if recv_bytes is not None:
            self._recv_bytes = recv_bytes
        if args:
            _check_args(args)
            self._args = {**self._args, **args}

    def __enter__(self) -> _OpenSpan:
        self._step = self._tracer.step
        self._start = time.perf_counter_ns()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        end = time.perf_counter_ns()
        t = self._tracer
        args = self._args if exc_type is None else {**self._args, "error": exc_type.__name__}
        t.spans.append(Span(t.rank, self._kind, self._name, self._start - t.origin_ns, end - t.origin_ns,
                            self._bytes, self._recv_bytes, self._microbatch, self._step, self._peer, args))


class _NullSpan:
    """The one context manager a disabled tracer hands out: does nothing, allocates nothing."""

    __slots__ = ()

    def set(self, **fields: Any) -> None:
        pass

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


_NULL_SPAN = _NullSpan()


def _check_args(args: Mapping[str, Any]) -> None:
    clash = _RESERVED.intersection(args)
    if clash:
        raise ValueError(f"span extra args must not reuse Span field names, got {sorted(clash)}. "
                         "Rename them (the step comes from tracer.set_step).")


class Tracer:
    """Records this rank's spans in memory. Not a singleton: make one per rank and pass it along.

    ``spans`` is appended from whichever thread closes a span (list.append is atomic under the GIL), so
    autograd hooks may trace too.
    """

    def __init__(self, rank: int, enabled: bool = True) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}.")
        self.rank = rank
        self.enabled = enabled
        self.step: int | None = None
        self.spans: list[Span] = []
        self.origin_ns = time.perf_counter_ns()

    def start(self) -> None:
        """Set t=0 to now. Call it right after a barrier so every rank's t=0 is the same instant."""
        self.origin_ns = time.perf_counter_ns()

    def set_step(self, step: int | None) -> None:
        """Stamp ``step`` on every span opened from now on."""
        self.step = step

    def now_ns(self) -> int:
        """Nanoseconds since :meth:`start` (0 when disabled): the clock :meth:`record` expects."""
        return time.perf_counter_ns() - self.origin_ns if self.enabled else 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing recorded inside (a check, an evaluation: work that is no step's); recording as before after."""
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was

    def span(self, kind: Kind, name: str, *, bytes: int = 0, recv_bytes: int = 0,
             microbatch: int | None = None, peer: int | None = None, **args: Any) -> _OpenSpan | _NullSpan:
        """A context manager that records one span when its block exits, also when it raises.

        A span left by an exception carries ``args["error"]`` = the exception's type name.
        """
        if not self.enabled:
            return _NULL_SPAN
        if kind not in KINDS:
            raise ValueError(f"span kind must be one of {KINDS}, got {kind!r} for span {name!r}.")
        if args:
            _check_args(args)
        return _OpenSpan(self, kind, name, bytes, recv_bytes, microbatch, peer, args)

    def record(self, kind: Kind, name: str, start_ns: int, end_ns: int, *, bytes: int = 0, recv_bytes: int = 0,
               microbatch: int | None = None, peer: int | None = None, **args: Any) -> None:
        """Record a span measured elsewhere, with times from :meth:`now_ns` (e.g. an isend until its wait)."""
        if not self.enabled:
            return
        if kind not in KINDS:
            raise ValueError(f"span kind must be one of {KINDS}, got {kind!r} for span {name!r}.")
        if end_ns < start_ns:
            raise ValueError(f"span end_ns must be >= start_ns, got {start_ns}..{end_ns} for span {name!r}. "
                             "Take both from tracer.now_ns().")
        if args:
            _check_args(args)
        self.spans.append(Span(self.rank, kind, name, start_ns, end_ns, bytes, recv_bytes, microbatch,
                               self.step, peer, args))

    def count(self, kind: Kind | None = None, name: str | None = None) -> int:
        """How many spans match ``kind`` and ``name`` (None matches any)."""
        return sum(1 for s in self.spans if (kind is None or s.kind == kind) and (name is None or s.name == name))

    def totals(self, since: int = 0) -> dict[str, Any]:
        """Sums over ``spans[since:]``: seconds per kind, and bytes / recv_bytes / messages of comm spans.

        ``messages`` counts comm spans (one per send, recv or collective call), or a span's ``messages`` arg
        where it carries one (an all-reduce made of several sends). Nested spans of one kind
        count twice: keep bytes on the innermost comm span.
        """
        if since < 0:
            raise ValueError(f"since must be a span index >= 0, got {since}. Pass len(tracer.spans) "
                             "taken before the step.")
        seconds = dict.fromkeys(KINDS, 0)
        sent = received = messages = 0
        for s in self.spans[since:]:
            seconds[s.kind] += s.end_ns - s.start_ns
            if s.kind == "comm":
                sent += s.bytes
                received += s.recv_bytes
                messages += s.args.get("messages", 1)
        out: dict[str, Any] = {f"{k}_s": ns / 1e9 for k, ns in seconds.items()}
        out.update(bytes=sent, recv_bytes=received, messages=messages)
        return out

    def write_jsonl(self, path: str | os.PathLike[str]) -> None:
        """Write one JSON object per span (atomically)."""
        lines = []
        for s in self.spans:
            try:
                lines.append(json.dumps(s.to_dict()))
            except TypeError as e:
                raise TypeError(f"span args must be JSON-serialisable, got {s.args!r} in span {s.name!r} on "
                                f"rank {s.rank}: {e}. Pass numbers, strings, lists or dicts.") from e
        write_text_atomic(path, "".join(line + "\n" for line in lines))

    def __repr__(self) -> str:
        return f"Tracer(rank={self.rank}, enabled={self.enabled}, spans={len(self.spans)}, step={self.step})"


DATA_PARALLEL_SPANS = ("allreduce:", "reduce_scatter:", "all_gather:")
"""How the data-parallel collectives' comm spans are named: ``allreduce:<algorithm>`` for each bucket, and
under ZeRO the ring's halves, ``reduce_scatter:`` of the gradients and ``all_gather:`` of the parameters."""


def hidden_fraction(spans: Sequence[Span], prefix: str | tuple[str, ...] = DATA_PARALLEL_SPANS) -> float | None:
    """The share of data-parallel communication time that overlapped computation, from one step's spans.

    Only comm spans named ``prefix...`` count (the data-parallel collectives, which run beside backward, and
    under ZeRO-3 the parameters' all-gathers beside forward); the inline collectives of tensor parallelism
    block the computation they sit in and are never hidden.
    Communication counts as hidden while a compute span runs and no wait span does (a wait inside backward is
    the rank blocked on communication, not computing). ``None`` when there was no such communication.
    """
    comm = [(s.start_ns, s.end_ns) for s in spans if s.kind == "comm" and s.name.startswith(prefix)]
    total = sum(e - b for b, e in comm)
    if total == 0:
        return None
    busy = [(s.start_ns, s.end_ns) for s in spans if s.kind == "compute"]
    blocked = [(s.start_ns, s.end_ns) for s in spans if s.kind == "wait"]
    hidden = sum(_overlap(c, busy) - _overlap(c, [_clip(w, c) for w in blocked]) for c in comm)
    return max(0.0, min(1.0, hidden / total))


def _clip(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return max(a[0], b[0]), min(a[1], b[1])


def _overlap(interval: tuple[int, int], others: Sequence[tuple[int, int]]) -> int:
    """Length of ``interval`` covered by the union of ``others``."""
    start, end = interval
    covered, cursor = 0, start
    for b, e in sorted(others):
        b, e = max(b, cursor), min(e, end)
        if e > b:
            covered += e - b
            cursor = e
    return covered


def load_jsonl(path: str | os.PathLike[str]) -> list[Span]:
    """Read spans written by :meth:`Tracer.write_jsonl`."""
    with open(path, encoding="utf-8") as f:
        return [Span.from_dict(json.loads(line)) for line in f if line.strip()]
