"""Point-to-point messaging for one process group: every byte counted, every wait bounded, buffers reused.

The synchronisation algorithms (naive, master, ring, tree, hierarchical) are written on :class:`Communicator`
alone, so what they send is exactly what is counted::

    comm = Communicator(group, timeout_s=30)
    comm.exchange(sends=[(right, segment)], recvs=[(left, scratch)], algorithm="ring", step=0,
                  phase="reduce-scatter")
    comm.stats.sent_bytes          # bytes this rank has put on the wire through comm so far

Peers are *group* ranks (0..size-1); errors name global ranks too, since that is what a user launched.

gloo semantics worth knowing: ``isend`` does not copy the tensor, so a tensor being sent must not change until
its exchange returns; a blocking send waits for its matching receive at every size; a receive buffer smaller
than the message aborts the process (SIGABRT), which is why :func:`check_same` runs before an algorithm.

Receives are posted before sends. gloo sends a message's data only once the receiver has said it posted the
receive, and that notice travels on the same connection as the data going the other way: when two ranks swap
large messages and one posts its send first, the other's notice waits behind the first's whole message, and the
exchange takes two transfers instead of one (measured in the lab, 1 Gbit/s links, 16 MB each way: 275 ms
send-first against 140 ms receive-first, the link's own 134 ms).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fourfold.comm.ledger import Direction
from fourfold.comm.wait import CommError, bounded_wait, collective

__all__ = ["CommError", "CommStats", "Communicator", "Exchange", "Message", "Posted", "check_same"]


class Posted(NamedTuple):
    """A receive posted ahead of the :meth:`Communicator.exchange` that waits for it."""

    peer: int  # group rank
    tensor: torch.Tensor
    work: Any


class Message(NamedTuple):
    """One message, as recorded when ``record_messages`` is on (for pictures and tests)."""

    algorithm: str
    phase: str
    step: int
    src: int          # group ranks
    dst: int
    offset: int       # element range [offset, offset + numel) of the flat tensor, when the caller says
    numel: int
    nbytes: int
    label: str = ""   # what the payload means, e.g. "segment 2 (partial sum of ranks 1,2)"


@dataclass
class CommStats:
    """What one rank sent and received through a :class:`Communicator`."""

    sent_bytes: int = 0
    recv_bytes: int = 0
    sent_messages: int = 0
    recv_messages: int = 0

    def reset(self) -> None:
        self.sent_bytes = self.recv_bytes = self.sent_messages = self.recv_messages = 0


@dataclass
class Communicator:
    """Counted, bounded point-to-point exchanges within ``group`` (None: the default group)."""

    group: dist.ProcessGroup | None = None
    timeout_s: float = 120.0
    record_messages: bool = False
    stats: CommStats = field(default_factory=CommStats)
    messages: list[Message] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("a Communicator needs a process group: call fourfold.launch.init() first.")
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.global_ranks = dist.get_process_group_ranks(self.group) if self.group is not None else \
            list(range(self.size))
        self._buffers: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = {}

    @property
    def global_rank(self) -> int:
        return self.global_ranks[self.rank]

    def buffer(self, numel: int, like: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """A scratch tensor of ``numel`` elements (dtype and device of ``like``), reused across calls.

        Fresh large receive buffers are costly (about 60 ms per 64 MB on this kind of machine), so each slot
        keeps its largest allocation and hands out views of it.
        """
        key = (like.dtype, like.device, slot)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
            self._buffers[key] = buf
        return buf[:numel]

    def post(self, peer: int, tensor: torch.Tensor) -> Posted:
        """Post a receive from group ``peer`` into ``tensor`` now, to be waited for by a later :meth:`exchange`
        (``posted=[...]``). Algorithms post the next step's receive before this step's exchange, so the sender
        of the next step never waits for this rank to say it is ready (see the module's note on gloo)."""
        return Posted(peer, tensor, dist.irecv(tensor, self.global_ranks[peer], group=self.group))

    def exchange(
        self,
        sends: list[tuple[int, torch.Tensor]] = (),  # type: ignore[assignment]
        recvs: list[tuple[int, torch.Tensor]] = (),  # type: ignore[assignment]
        *,
        algorithm: str,
        step: int,
        phase: str = "",
        offsets: tuple[list[int], list[int]] | None = None,
        labels: list[str] | None = None,
        posted: list[Posted] = (),  # type: ignore[assignment]
    ) -> None:
        """Post every send and receive at once, then wait for all of them (bounded by ``timeout_s``).

        ``sends``/``recvs`` are ``(group peer, tensor)`` pairs; tensors must be contiguous. ``posted`` are
        receives :meth:`post`-ed earlier, waited for (and counted) here. ``offsets`` and ``labels`` (one per send)
        only decorate recorded messages.
        """
        self.start(sends, recvs, algorithm=algorithm, step=step, phase=phase, offsets=offsets, labels=labels,
                   posted=posted).wait()

    def start(
        self,
        sends: list[tuple[int, torch.Tensor]] = (),  # type: ignore[assignment]
        recvs: list[tuple[int, torch.Tensor]] = (),  # type: ignore[assignment]
        *,
        algorithm: str,
        step: int,
        phase: str = "",
        offsets: tuple[list[int], list[int]] | None = None,
        labels: list[str] | None = None,
        posted: list[Posted] = (),  # type: ignore[assignment]
    ) -> Exchange:
        """:meth:`exchange` without the wait: every send and receive posted now, and an :class:`Exchange` whose
        :meth:`~Exchange.wait` (bounded by ``timeout_s`` from now) waits for them and counts them. What overlaps a
        transfer with compute uses it: start, compute, wait. A tensor being sent must not change until then."""
        works: list[tuple[Direction, int, Any]] = [("recv", r.peer, r.work) for r in posted]
        for peer, t in recvs:  # receives first: see the module's note on gloo
            works.append(("recv", peer, dist.irecv(t, self.global_ranks[peer], group=self.group)))
        for peer, t in sends:
            works.append(("send", peer, dist.isend(t, self.global_ranks[peer], group=self.group)))
        where = f"{algorithm} step {step}{f' ({phase})' if phase else ''}"
        received = [t for _, t in recvs] + [r.tensor for r in posted]
        if self.record_messages:
            for i, (peer, t) in enumerate(sends):
                offset = offsets[0][i] if offsets else 0
                label = labels[i] if labels else ""
                self.messages.append(Message(algorithm, phase, step, self.rank, peer, offset, t.numel(),
                                             t.numel() * t.element_size(), label))
        return Exchange(self, works, where, [t for _, t in sends], received, time.monotonic() + self.timeout_s)


@dataclass
class Exchange:
    """Sends and receives in flight (:meth:`Communicator.start`): :meth:`wait` once for all of them."""

    comm: Communicator
    works: list[tuple[Direction, int, Any]]
    where: str
    sent: list[torch.Tensor]
    received: list[torch.Tensor]
    deadline: float
    done: bool = False

    def wait(self) -> None:
        """Wait for every send and receive (bounded, naming the peer), then count them. Idempotent."""
        if self.done:
            return
        comm = self.comm
        for direction, peer, work in self.works:
            remaining = max(self.deadline - time.monotonic(), 0.001)
            assert work is not None  # None only for a rank outside the group, which exchange never targets
            bounded_wait(work, remaining, reported_s=comm.timeout_s, rank=comm.global_rank, op=self.where,
                         awaited="send to" if direction == "send" else "recv from", peer=comm.global_ranks[peer],
                         direction=direction)
        self.done = True
        comm.stats.sent_bytes += sum(t.numel() * t.element_size() for t in self.sent)
        comm.stats.recv_bytes += sum(t.numel() * t.element_size() for t in self.received)
        comm.stats.sent_messages += len(self.sent)
        comm.stats.recv_messages += len(self.received)


_DTYPE_CODES = {dt: i for i, dt in enumerate([torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                               torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])}


def check_same(comm: Communicator, tensor: torch.Tensor, algorithm: str, names: list[str]) -> None:
    """Refuse, on every rank, a call whose length, dtype or algorithm differs between ranks.

    Costs one all-gather of three integers; without it, a length mismatch aborts gloo (SIGABRT) or hangs.
    """
    if tensor.dtype not in _DTYPE_CODES:
        raise TypeError(f"allreduce supports {', '.join(str(d) for d in _DTYPE_CODES)}, got {tensor.dtype}.")
    mine = torch.tensor([tensor.numel(), _DTYPE_CODES[tensor.dtype], names.index(algorithm)], dtype=torch.int64)
    if tensor.device.type != "cpu":
        mine = mine.to(tensor.device)
    everyone = [torch.empty_like(mine) for _ in range(comm.size)]
    collective(dist.all_gather(everyone, mine, group=comm.group, async_op=True), comm.group,
               op=f"{algorithm} all-reduce's check of lengths and dtypes", timeout_s=comm.timeout_s)
    rows = [tuple(int(v) for v in t.tolist()) for t in everyone]
    if len(set(rows)) > 1:
        dtypes = {code: str(dt).replace("torch.", "") for dt, code in _DTYPE_CODES.items()}
        detail = ", ".join(f"rank {comm.global_ranks[r]}: {n} x {dtypes[d]} with {names[a]!r}"
                           for r, (n, d, a) in enumerate(rows))
        raise ValueError(f"allreduce needs the same length, dtype and algorithm on every rank, got {detail}. "
                         f"Every rank must reduce the same tensor shape with the same algorithm "
                         f"(this rank called {algorithm!r}).")
