"""The one bounded wait: every collective and send/recv in fourfold ends here, or in a :class:`CommError` that
names this rank, the operation and the peer it was waiting for.

    work = dist.irecv(buf, src, group=group)
    bounded_wait(work, timeout_s, rank=3, op="1F2", awaited="receive the activation of 0F2 from", peer=1)
    # -> CommError("rank 3: 1F2: receive the activation of 0F2 from rank 1 did not complete within 30 s. ...")

``awaited`` reads as a sentence before ``rank <peer>`` ("send to", "receive the gradient of ... from"); with no
peer (a collective), it names the operation and the group's ranks.

Every wait enters this process's ledger (:mod:`fourfold.comm.ledger`) first, so the hang doctor
(:mod:`fourfold.comm.doctor`) can see it; when the wait times out, the doctor's account of the ranks that never
arrived is added to the error.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fourfold.comm.ledger import LEDGER, Direction
from fourfold.observe.trace import Span, Tracer

__all__ = ["DEFAULT_TIMEOUT_S", "CommError", "Pending", "all_reduce", "barrier", "bounded_wait", "broadcast_object",
           "collective", "default_timeout_s", "gather_objects", "gather_spans", "group_ranks", "group_timeout", "set_default_timeout",
           "settle_pending"]

DEFAULT_TIMEOUT_S = 120.0
"""Seconds any collective or send/recv may wait before it fails (fourfold's default, gloo's is 30 min)."""

_timeout_s = DEFAULT_TIMEOUT_S  # of waits not handed one; launch.init sets the run's --timeout
_explain_with: Callable[[Any], str] | None = None  # the running hang doctor's explain(), if any

HINT = ("The peer is dead, stuck, or running a different operation; its own error (if any) says which.")


_PEER_GONE = re.compile(r"connection (closed|reset|refused)|broken pipe|closed by peer", re.IGNORECASE)
"""What the transport says when the process at the other end has exited (gloo: 'Connection closed by peer')."""


class CommError(RuntimeError):
    """A send, receive or collective that did not complete within the timeout (peer dead, stuck, out of step).
    ``peer_gone``: it failed early because a peer's connection broke, the echo of another rank's own error."""

    def __init__(self, message: str, *, peer_gone: bool = False) -> None:
        super().__init__(message)
        self.peer_gone = peer_gone


def set_default_timeout(timeout_s: float) -> None:
    """The timeout of waits that are not handed one (tensor-parallel collectives); set by ``launch.init``."""
    global _timeout_s
    _timeout_s = timeout_s


def default_timeout_s() -> float:
    return _timeout_s


def set_explainer(explain: Callable[[Any], str] | None) -> None:
    """Install (or remove, with None) the doctor whose account of a stuck wait joins its :class:`CommError`."""
    global _explain_with
    _explain_with = explain


_RANKS: dict[Any, tuple[int, ...]] = {}
"""group -> its global ranks, under the world group of the moment: a process group made again (a second run in
one process, or a rank forked from a process that ran one) starts it afresh."""
_RANKS_WORLD: list[Any] = [None]


def forget_groups() -> None:
    """Drop the cached groups (the process group was destroyed: :meth:`fourfold.launch.DistContext.close`)."""
    _RANKS.clear()
    _RANKS_WORLD[0] = None


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The global ranks of ``group`` (None: the whole world), cached."""
    world = dist.group.WORLD
    if _RANKS_WORLD[0] is not world:
        _RANKS.clear()
        _RANKS_WORLD[0] = world
    key = world if group is None else group
    if key not in _RANKS:
        _RANKS[key] = tuple(dist.get_process_group_ranks(key))
    return _RANKS[key]


def bounded_wait(work: Any, timeout_s: float, *, rank: int, op: str, awaited: str, peer: int | None = None,
                 group_ranks: Sequence[int] | None = None, hint: str = HINT,
                 tensor: torch.Tensor | None = None, direction: Direction | None = None,
                 message: str | None = None, reported_s: float | None = None) -> None:
    """Wait for ``work`` (a ``dist.Work``) at most ``timeout_s`` seconds, or raise :class:`CommError` naming
    ``rank``, ``op`` and ``peer`` (or ``group_ranks`` for a collective). ``None`` work (nothing posted) returns.
    ``tensor`` (optional) gives the ledger the shape and dtype moved; ``direction`` (``"send"`` or ``"recv"``)
    says which end of a point-to-point transfer this rank is, so the hang doctor can tell the peer's matching
    send from a receive of its own; ``message`` names the message ("0F3") the same way at both ends, so it can
    tell a send of another message too. ``reported_s``: the timeout the error names when ``timeout_s`` is what
    is left of it (the later waits of one exchange)."""
    if work is None:
        return
    entry = LEDGER.enter(op, awaited, peer=peer, group=group_ranks if peer is None else None, tensor=tensor,
                         direction=direction, message=message)
    try:
        work.wait(timeout=datetime.timedelta(seconds=max(timeout_s, 0.001)))
    except RuntimeError as e:
        who = f" rank {peer}" if peer is not None else (
            f" ranks {list(group_ranks)}" if group_ranks is not None else "")
        cause = _first_line(e)
        waited = time.time() - entry.since
        if waited < 0.9 * timeout_s:  # not a timeout: most often the connection broke (a peer exited or was killed)
            gone = _PEER_GONE.search(cause) is not None
            how = "a peer's connection broke" if gone else "it failed"
            raise CommError(f"rank {rank}: {op}: {awaited}{who} failed after {waited:.1f} s: {how}. {hint} "
                            f"[{cause}]", peer_gone=gone) from e
        limit = reported_s if reported_s is not None else timeout_s
        raise CommError(f"rank {rank}: {op}: {awaited}{who} did not complete within {limit:g} s. {hint} "
                        f"{_explain(entry)}[{cause}]") from e
    finally:
        LEDGER.leave(entry)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _explain(entry: Any) -> str:
    if _explain_with is None:
        return ""
    try:
        text = _explain_with(entry)
    except Exception:  # the store is gone too: the error stands without the doctor's account
        return ""
    return f"Hang doctor: {text} " if text else ""


@contextlib.contextmanager
def _object_collective(op: str, awaited: str, ranks: tuple[int, ...]) -> Iterator[None]:
    """Around a blocking object collective (bounded by its group's own timeout): under the ledger, so the doctor
    sees the wait, and its failure a :class:`CommError` naming this rank, ``op`` and the group."""
    entry = LEDGER.enter(op, f"{awaited} the group of", group=ranks)
    try:
        yield
    except RuntimeError as e:
        cause = _first_line(e)
        gone = _PEER_GONE.search(cause) is not None  # the echo of another rank's own error, as in bounded_wait
        broke = ": a peer's connection broke" if gone else ""
        raise CommError(f"rank {dist.get_rank()}: {op}: {awaited} the group of ranks {list(ranks)} failed{broke}. "
                        f"{HINT} {_explain(entry)}[{cause}]", peer_gone=gone) from e
    finally:
        LEDGER.leave(entry)


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup | None = None, *, op: str) -> Any:
    """``dist.broadcast_object_list`` of one object from global rank ``src``: ``src``'s ``obj`` on every rank of
    ``group``. Bounded by the process group's timeout, named like :func:`gather_objects`."""
    box = [obj]
    with _object_collective(op, f"receive an object from rank {src} in", group_ranks(group)):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_objects(obj: Any, group: dist.ProcessGroup | None = None, *, op: str, dst: int | None = None
                   ) -> list[Any]:
    """``dist.all_gather_object`` under the ledger: every rank's ``obj``, in group-rank order. Bounded by the
    process group's timeout (``--timeout``); the doctor sees the wait like any other. ``dst`` (a global rank of
    ``group``): only it receives them (``dist.gather_object``); the others get ``[]``."""
    ranks = group_ranks(group)
    everyone: list[Any] = [None] * len(ranks)
    with _object_collective(op, "gather objects from", ranks):
        if dst is None:
            dist.all_gather_object(everyone, obj, group=group)
        else:
            mine = dist.get_rank() == dst
            dist.gather_object(obj, everyone if mine else None, dst=dst, group=group)
            everyone = everyone if mine else []
    return everyone


def collective(work: Any, group: dist.ProcessGroup | None, *, op: str, timeout_s: float | None = None,
               awaited: str = "the group of", tensor: torch.Tensor | None = None) -> None:
    """Wait for a collective started with ``async_op=True`` over ``group`` (None: every rank) through the
    bounded, named wait: ``op`` says what it moves; ``timeout_s`` None is the run's (:func:`default_timeout_s`)."""
    bounded_wait(work, default_timeout_s() if timeout_s is None else timeout_s, rank=dist.get_rank(), op=op,
                 awaited=awaited, group_ranks=group_ranks(group), tensor=tensor)


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, timeout_s: float | None, *, op: str,
               awaited: str = "the group of", reduce_op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """``dist.all_reduce`` of ``t`` in place over ``group`` (None: every rank), waited for through the bounded,
    named wait: ``op`` says what it reduces. Returns ``t``."""
    collective(dist.all_reduce(t, op=reduce_op, group=group, async_op=True), group, op=op, timeout_s=timeout_s,
               awaited=awaited, tensor=t)
    return t


def group_timeout(timeout_s: float | None = None, backend: str | None = None) -> datetime.timedelta:
    """The timeout to create a process group with, for waits bounded at ``timeout_s`` (None: the run's).

    gloo's is the same: its operation fails when the bounded wait does, and a group destroyed with work still
    running waits for that work. NCCL's watchdog aborts the process when its timeout passes, counted from the
    collective's launch, which is before the bounded wait begins: it is given a quarter more and 30 s, so the
    named error (:class:`CommError`, the hang doctor's account) is raised first."""
    seconds = default_timeout_s() if timeout_s is None else timeout_s
    backend = backend if backend is not None else str(dist.get_backend()) if dist.is_initialized() else "gloo"
    if "nccl" in backend:  # "nccl", or launch.init's "cpu:gloo,cuda:nccl"
        seconds = 1.25 * seconds + 30
    return datetime.timedelta(seconds=seconds)


def barrier(op: str, group: dist.ProcessGroup | None = None) -> None:
    """``dist.barrier`` through the bounded, named wait: ``op`` says what the ranks are lining up for."""
    ranks = group_ranks(group)
    if len(ranks) > 1:
        bounded_wait(dist.barrier(group=group, async_op=True), default_timeout_s(), rank=dist.get_rank(), op=op,
                     awaited="line up with", group_ranks=ranks)


class Pending:
    """A collective started and waited for later, when its result is read (a step's loss all-reduce, read by
    ``Loss.item`` after the optimiser step). Until then it is in flight; one never read is waited for when its
    holder is dropped, or by :func:`settle_pending` before the process group is destroyed: gloo aborts the
    process (``terminate called without an active exception``) when a group goes with work still running."""

    def __init__(self, work: Any, timeout_s: float, *, op: str, awaited: str, group_ranks: Sequence[int]) -> None:
        self.work, self.timeout_s, self.op, self.awaited, self.ranks = work, timeout_s, op, awaited, tuple(group_ranks)
        if work is not None:
            _PENDING.add(self)

    def wait(self) -> None:
        """Bounded (:func:`bounded_wait`); at most once."""
        work, self.work = self.work, None
        _PENDING.discard(self)
        bounded_wait(work, self.timeout_s, rank=dist.get_rank(), op=self.op, awaited=self.awaited,
                     group_ranks=self.ranks)

    def __del__(self) -> None:
        if self.work is not None:  # never read: still waited for, quietly (its error is the next collective's)
            with contextlib.suppress(Exception):
                self.wait()


_PENDING: weakref.WeakSet[Pending] = weakref.WeakSet()


def settle_pending() -> None:
    """Wait for every :class:`Pending` collective not yet waited for (before the process group is destroyed)."""
    for pending in list(_PENDING):
        with contextlib.suppress(Exception):
            pending.wait()


def gather_spans(tracer: Tracer, group: dist.ProcessGroup | None = None,
                 dst: int = 0) -> dict[int, list[Span]] | None:
    """Every rank's spans on global rank ``dst`` as ``{rank: spans}``; None on the other ranks.

    A collective: every rank of ``group`` must call it. Without a process group (or with one rank) it
    returns this tracer's spans alone.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {tracer.rank: list(tracer.spans)}
    gathered = gather_objects((tracer.rank, list(tracer.spans)), group, op="gather of the trace's spans", dst=dst)
    if dist.get_rank() != dst:
        return None
    out: dict[int, list[Span]] = {}
    for rank, spans in gathered:
        if rank in out:
            raise RuntimeError(f"tracer ranks must be unique across the group, got rank {rank} twice. "
                               "Build each Tracer with its own global rank.")
        out[rank] = spans
    return dict(sorted(out.items()))
