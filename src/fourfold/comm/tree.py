"""Recursive doubling: the latency-optimal all-reduce for small messages, in about log2(G) steps.

With G a power of two, at step k = 0..log2(G)-1 every rank swaps its whole current vector with partner
``rank XOR 2^k`` and adds what it receives. Before step k each rank holds the sum over its aligned block of
2^k ranks; the partner holds the sum over the neighbouring block, so afterwards both hold the sum over
2^(k+1) ranks, and after log2(G) steps everyone holds the total::

    G = 4      step 0: 0<->1, 2<->3      step 1: 0<->2, 1<->3
    rank 0:    x0  ->  x0+x1             ->  (x0+x1)+(x2+x3)
    rank 3:    x3  ->  x3+x2             ->  (x3+x2)+(x1+x0)       same bits: a+b == b+a in IEEE arithmetic

Any other G (P the largest power of two <= G, E = G - P extra ranks): first the *fold*, extra rank P+j sends
its vector to rank j (j < E), which adds it; then doubling among ranks 0..P-1; then the *unfold*, rank j sends
the result back to rank P+j.

Cost per rank, N elements, d = log2(P):

* G a power of two: d messages of N elements, d*N sent and d*N received; d steps.
* otherwise: ranks j < E send (d+1) messages, (d+1)*N elements (d exchanges and the unfold; they receive the
  fold too); ranks E..P-1 send d messages, d*N; extra ranks send 1 message, N (and receive the result, N);
  d+2 steps. On the wire in all: (P*d + 2E)*N elements.

Compare the ring's 2(G-1)*N/G per rank in 2(G-1) steps: the tree sends more bytes for every G > 2
(log2(G)*N against under 2N) but needs far fewer steps, so it wins while per-message latency, not bandwidth,
dominates: small tensors, many ranks.

Every rank ends with bitwise the same result: at each doubling step the two partners compute a+b and b+a from
the same two values, which IEEE addition (and integer wrap-around) makes equal; the fold only changes which
value a rank starts from, and the unfold copies. (Only NaN payloads could differ between a+b and b+a.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fourfold.comm.p2p import Communicator

__all__ = ["allreduce", "folded", "power_split", "theory"]


def power_split(world_size: int) -> tuple[int, int, int]:
    """``(P, E, d)``: the largest power of two P <= G, the E = G - P extra ranks, d = log2(P)."""
    d = world_size.bit_length() - 1
    return 1 << d, world_size - (1 << d), d


def _holders(rank: int, k: int, power: int, extra: int) -> str:
    """What rank (< P) holds before doubling step k: the sum over its block of 2^k ranks and their extras."""
    lo = (rank >> k) << k
    block = list(range(lo, lo + (1 << k)))
    ranks = sorted(block + [r + power for r in block if r < extra])
    return f"sum of ranks {','.join(map(str, ranks))}" if len(ranks) > 1 else f"all of rank {rank}"


@contextlib.contextmanager
def folded(comm: Communicator, flat: torch.Tensor, algorithm: str, steps: int) -> Iterator[bool]:
    """Run a power-of-two algorithm of ``steps`` steps inside over any G: extra rank P+j first folds its vector
    into rank j (which adds it), the block runs (yielding True) on ranks 0..P-1 only, then rank j sends the total
    back (the unfold). An extra rank yields False and holds the total afterwards. The block's steps are numbered
    from 1 when there is a fold, from 0 otherwise."""
    power, extra, _ = power_split(comm.size)
    me, record = comm.rank, comm.record_messages
    last = (1 if extra else 0) + steps
    if me >= power:  # an extra rank: hand the vector over, then wait for the total
        comm.exchange([(me - power, flat)], [], algorithm=algorithm, step=0, phase="fold", offsets=([0], []),
                      labels=[f"all of rank {me}"] if record else None)
        comm.exchange([], [(me - power, flat)], algorithm=algorithm, step=last, phase="unfold")
        yield False
        return
    if me < extra:  # fold the extra rank's vector into ours
        scratch = comm.buffer(flat.numel(), flat)
        comm.exchange([], [(me + power, scratch)], algorithm=algorithm, step=0, phase="fold")
        flat.add_(scratch)
    yield True
    if me < extra:  # unfold: the total back to the extra rank
        comm.exchange([(me + power, flat)], [], algorithm=algorithm, step=last, phase="unfold",
                      offsets=([0], []), labels=["sum of all ranks"] if record else None)


def allreduce(comm: Communicator, flat: torch.Tensor) -> None:
    """Sum ``flat`` over the group in place by recursive doubling (with a fold when G is not a power of 2)."""
    size, me, numel = comm.size, comm.rank, flat.numel()
    if size == 1 or numel == 0:
        return
    power, extra, d = power_split(size)
    first = 1 if extra else 0  # the doubling steps follow the fold step, when there is one
    with folded(comm, flat, "tree", d) as inside:
        if not inside:
            return
        scratch = comm.buffer(numel, flat)  # (N,) what the partner sends
        for k in range(d):  # recursive doubling among ranks 0..P-1
            partner = me ^ (1 << k)
            comm.exchange([(partner, flat)], [(partner, scratch)], algorithm="tree", step=first + k,
                          phase="recursive doubling", offsets=([0], [0]),
                          labels=[_holders(me, k, power, extra)] if comm.record_messages else None)
            flat.add_(scratch)  # mine + theirs here, theirs + mine there: the same bits


def theory(numel: int, world_size: int, rank: int, itemsize: int) -> tuple[int, int]:
    """``(bytes, messages)`` group rank ``rank`` sends in :func:`allreduce` of ``numel`` elements.

    d = log2(P) messages of N elements for ranks E..P-1, d+1 for ranks below E, 1 for the extra ranks >= P;
    nothing when N = 0 or G = 1, where :func:`fourfold.comm.allreduce` returns before sending.
    """
    if numel == 0 or world_size == 1:
        return 0, 0
    power, extra, d = power_split(world_size)
    messages = 1 if rank >= power else d + 1 if rank < extra else d
    return messages * numel * itemsize, messages
