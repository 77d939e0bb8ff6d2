"""Gradient-synchronisation algorithms, written out on point-to-point sends so their cost can be seen.

    from fourfold import comm

    comm.allreduce(grad, algorithm="ring")          # SUM over the default group, in place; returns grad
    c = comm.Communicator(group)                    # reuse buffers and count bytes across calls
    comm.allreduce(grad, algorithm="naive", comm=c)
    c.stats.sent_bytes

| algorithm | idea | elements sent per rank | steps |
|---|---|---|---|
| ``naive``  | everyone sends everything to everyone | (G-1)N | 1 |
| ``master`` | gather to one root, it sums and sends back | root (G-1)N, others N | 2 |
| ``ring``   | reduce-scatter then all-gather around a ring | 2(G-1)N/G | 2(G-1) |
| ``tree``   | recursive doubling (fold extras when G is not 2^k) | log2(G)N, G = 2^k | log2(G) (+2) |
| ``rabenseifner`` | recursive halving reduce-scatter, recursive doubling all-gather (fold extras) | 2(G-1)N/G, G = 2^k | 2 log2(G) (+2) |
| ``hierarchical`` | rings in node, across nodes on N/g, in node | 2(G-1)N/G; 2(n-1)N/(gn) across | 2(g+n-2) |
| ``auto``   | ring, tree, rabenseifner or hierarchical, whichever an α-β-γ cost model predicts fastest (``comm/auto.py``) | that algorithm's | that algorithm's |
| ``native`` | ``torch.distributed.all_reduce`` (the backend's own) | - | - |

Any contiguous tensor of any length (0, 1, not divisible by G), dtypes float16, bfloat16, float32, float64 and
the integer types; world size 1 returns at once. Every algorithm leaves bitwise the same result on every rank.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from fourfold.comm import auto, hierarchical, master, naive, rabenseifner, ring, tree
from fourfold.comm.p2p import CommStats, Communicator, Message, Posted, check_same
from fourfold.comm.wait import CommError, bounded_wait
from fourfold.observe.trace import Tracer

__all__ = ["ALGORITHMS", "CommError", "CommStats", "Communicator", "Message", "Posted", "allreduce", "counted_span"]

Algorithm = Callable[[Communicator, torch.Tensor], None]


def _native(comm: Communicator, flat: torch.Tensor) -> None:
    """The backend's own all-reduce (gloo's ring/halving-doubling, NCCL's ring/tree): the baseline."""
    work = dist.all_reduce(flat, group=comm.group, async_op=True)
    bounded_wait(work, comm.timeout_s, rank=comm.global_rank, op="native all_reduce", awaited="the group of",
                 group_ranks=comm.global_ranks)


ALGORITHMS: dict[str, Algorithm] = {
    "naive": naive.allreduce,
    "master": master.allreduce,
    "ring": ring.allreduce,
    "tree": tree.allreduce,
    "rabenseifner": rabenseifner.allreduce,
    "hierarchical": hierarchical.allreduce,
    "auto": auto.allreduce,
    "native": _native,
}
"""Name -> ``fn(comm, flat)`` summing ``flat`` in place over ``comm``'s group."""


def allreduce(
    tensor: torch.Tensor,
    algorithm: str = "ring",
    group: dist.ProcessGroup | None = None,
    *,
    comm: Communicator | None = None,
    tracer: Tracer | None = None,
    timeout_s: float = 120.0,
    check: bool = True,
) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place with ``algorithm`` and return it.

    ``comm`` carries reusable buffers and byte counts across calls (one is made per call otherwise).
    ``check`` first verifies, with one tiny all-gather, that every rank passes the same length, dtype and
    algorithm, so a mismatch is a ``ValueError`` on every rank instead of a gloo abort or a hang; skip it only
    for calls whose shapes are known to agree (e.g. a data-parallel bucket after its first step).
    """
    if algorithm not in ALGORITHMS:
        near = difflib.get_close_matches(algorithm, ALGORITHMS, n=1)
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}."
                         + (f" Did you mean {near[0]!r}?" if near else ""))
    if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
        raise ValueError("tensor must be a contiguous torch.Tensor, got "
                         f"{type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else 'a strided view'}. "
                         "Call .contiguous() first (and copy the result back).")
    if comm is None:
        comm = Communicator(group, timeout_s=timeout_s)
    elif group is not None and comm.group is not group:
        raise ValueError("comm and group disagree: pass one or the other.")
    if comm.size == 1:
        return tensor
    flat = tensor.view(-1)
    if check:
        check_same(comm, flat, algorithm, list(ALGORITHMS))
    if flat.numel() == 0:
        return tensor
    with counted_span(comm, tracer, f"allreduce:{algorithm}", numel=flat.numel(),
                      dtype=str(flat.dtype).replace("torch.", "")):
        ALGORITHMS[algorithm](comm, flat)
    return tensor


@contextlib.contextmanager
def counted_span(comm: Communicator, tracer: Tracer | None, name: str, **args: Any) -> Iterator[None]:
    """Record the block as one ``comm`` span carrying the bytes, received bytes and messages ``comm`` counted in
    it (nothing when ``tracer`` is None or off; nothing when the block raises)."""
    if tracer is None or not tracer.enabled:
        yield
        return
    s = comm.stats
    before, start = (s.sent_bytes, s.recv_bytes, s.sent_messages), tracer.now_ns()
    yield
    tracer.record("comm", name, start, tracer.now_ns(), bytes=s.sent_bytes - before[0],
                  recv_bytes=s.recv_bytes - before[1], messages=s.sent_messages - before[2], **args)
