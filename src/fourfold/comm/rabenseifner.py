"""Rabenseifner's all-reduce: the ring's bytes in 2 log2(G) steps instead of 2(G-1).

Reduce-scatter by **recursive halving**, then all-gather by **recursive doubling** (Rabenseifner 2004; Thakur,
Rabenseifner & Gropp 2005). The flat tensor is cut into P segments (P = G a power of two; uneven lengths as the
ring cuts them); rank r ends the first half owning segment r summed over everyone::

    G = 4, segments 0..3      halving, distance 2: 0<->2, 1<->3   halving, distance 1: 0<->1, 2<->3
    rank 0 holds [0 1 2 3]    sends [2 3], keeps [0 1] + rank 2's   sends [1], keeps [0] + rank 1's: done
    then the reverse: doubling, distance 1 (swap single segments), distance 2 (swap pairs): everyone has all.

At each halving step a rank's block of segments halves: it sends the half its partner keeps and adds the
partner's copy of its own half, so it sends N/2 + N/4 + ... = (P-1)N/P elements in log2(P) steps; the doubling
sends the same amount back. Per rank: **2(P-1)N/P elements (the ring's bytes) in 2 log2(P) steps (the ring
takes 2(P-1))**: as few bytes as the ring and nearly as few steps as the tree, which is why MPI libraries use
it for mid-sized and large messages.

Any other G (P the largest power of two <= G, E = G - P): first the fold, extra rank P+j sends its vector to
rank j (j < E), which adds it; then Rabenseifner among ranks 0..P-1; then the unfold, rank j sends the result
back to rank P+j (tree.py's fold: simple, at the cost of 2N more on the wire for each extra rank).

Every rank ends with bitwise the same result: each segment is summed along one halving path and then only
copied (and a+b == b+a: partners add the same two values).
"""

from __future__ import annotations

import torch

from fourfold.comm.p2p import Communicator, Posted
from fourfold.comm.ring import segments
from fourfold.comm.tree import folded, power_split

__all__ = ["allreduce", "theory"]


def _span(segs: list[tuple[int, int]], lo: int, hi: int) -> tuple[int, int]:
    """(offset, length) of segments lo..hi-1 together (contiguous)."""
    start = segs[lo][0]
    end = segs[hi - 1][0] + segs[hi - 1][1]
    return start, end - start


def allreduce(comm: Communicator, flat: torch.Tensor) -> None:
    """Sum ``flat`` over the group in place: recursive-halving reduce-scatter, recursive-doubling all-gather."""
    size, me, numel = comm.size, comm.rank, flat.numel()
    if size == 1 or numel == 0:
        return
    power, extra, d = power_split(size)
    record = comm.record_messages
    first = 1 if extra else 0
    with folded(comm, flat, "rabenseifner", 2 * d) as inside:
        if not inside:
            return
        segs = segments(numel, power)
        halving, doubling = _plan(me, power, d)

        def post_half(k: int) -> Posted:  # step k's receive (the kept half), into one of two scratch buffers
            partner, keep, _ = halving[k]
            return comm.post(partner, comm.buffer(_span(segs, *keep)[1], flat, slot=k % 2))

        def post_double(k: int) -> Posted:  # step k's receive (the partner's block), straight into its place
            partner, _, other = doubling[k]
            oo, ol = _span(segs, *other)
            return comm.post(partner, flat[oo:oo + ol])

        ahead: Posted | None = post_half(0)
        for k, (partner, keep, give) in enumerate(halving):  # reduce-scatter: distance P/2, P/4, ..., 1
            now, ahead = ahead, post_half(k + 1) if k + 1 < d else None
            assert now is not None  # posted one step ago
            (ko, kl), (go, gl) = _span(segs, *keep), _span(segs, *give)
            comm.exchange([(partner, flat[go:go + gl])], posted=[now], algorithm="rabenseifner",
                          step=first + k, phase="reduce-scatter (halving)", offsets=([go], [ko]),
                          labels=[f"segments {give[0]}..{give[1] - 1}, partial sum"] if record else None)
            flat[ko:ko + kl].add_(now.tensor)
        ahead = post_double(0)  # not earlier: it lands where the last halving step sent from
        for k, (partner, mine, other) in enumerate(doubling):  # all-gather: distance 1, 2, ..., P/2
            now, ahead = ahead, post_double(k + 1) if k + 1 < d else None
            assert now is not None  # posted one step ago
            (mo, ml), (oo, _) = _span(segs, *mine), _span(segs, *other)
            comm.exchange([(partner, flat[mo:mo + ml])], posted=[now], algorithm="rabenseifner",
                          step=first + d + k, phase="all-gather (doubling)", offsets=([mo], [oo]),
                          labels=[f"segments {mine[0]}..{mine[1] - 1}, summed"] if record else None)


Block = tuple[int, int]


def _plan(me: int, power: int, d: int) -> tuple[list[tuple[int, Block, Block]], list[tuple[int, Block, Block]]]:
    """Rank ``me``'s steps among ``power`` ranks: ``[(partner, keep, give)]`` halving, then ``[(partner, mine,
    other)]`` doubling, blocks as segment ranges [lo, hi). Known before the first message, so every receive can
    be posted a step ahead."""
    halving, doubling = [], []
    lo, hi = 0, power  # the block of segments this rank still reduces
    for _ in range(d):
        half = (hi - lo) // 2
        mid = lo + half
        keep, give = ((lo, mid), (mid, hi)) if me < mid else ((mid, hi), (lo, mid))
        halving.append((me ^ half, keep, give))
        lo, hi = keep
    for _ in range(d):
        width = hi - lo
        other = (lo + width, hi + width) if me & width == 0 else (lo - width, hi - width)
        doubling.append((me ^ width, (lo, hi), other))
        lo, hi = min(lo, other[0]), max(hi, other[1])
    return halving, doubling


def theory(numel: int, world_size: int, rank: int, itemsize: int) -> tuple[int, int]:
    """``(bytes, messages)`` group rank ``rank`` sends in :func:`allreduce` of ``numel`` elements.

    Among the P ranks: everything but its own segment in the halving, then every segment but the half its last
    partner held in the doubling (2(P-1)N/P when P divides N); ranks below E also send the unfold (N), extra
    ranks only the fold (N). Nothing when N = 0 or G = 1.
    """
    if numel == 0 or world_size == 1:
        return 0, 0
    power, extra, d = power_split(world_size)
    if rank >= power:
        return numel * itemsize, 1
    segs = segments(numel, power)
    sent, lo, hi = 0, 0, power
    for _ in range(d):  # halving: send the other half of the block
        half = (hi - lo) // 2
        mid = lo + half
        keep, give = ((lo, mid), (mid, hi)) if rank < mid else ((mid, hi), (lo, mid))
        sent += _span(segs, *give)[1]
        lo, hi = keep
    for _ in range(d):  # doubling: send the block held so far
        width = hi - lo
        sent += _span(segs, lo, hi)[1]
        lo, hi = (lo, hi + width) if rank & width == 0 else (lo - width, hi)
    messages = 2 * d + (1 if rank < extra else 0)
    return (sent + (numel if rank < extra else 0)) * itemsize, messages
