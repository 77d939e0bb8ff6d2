"""Ring all-reduce: a "share-reduce" phase (reduce-scatter), then a "share-only" phase (all-gather).

The flat tensor of N elements is cut into G segments (uneven lengths handled with divmod: the first N mod G
segments get one element more). Ranks sit on a ring, each sending to its right neighbour and receiving from
its left one. Member i of the ring:

* reduce-scatter, steps s = 0..G-2: send segment (i-s-1) mod G, receive segment (i-s-2) mod G and add it in.
  After G-1 steps member i holds the sum over all ranks of segment i.
* all-gather, steps s = 0..G-2: send segment (i-s) mod G, receive segment (i-s-1) mod G into place.

Cost per rank: 2(G-1) messages of about N/G elements, 2(G-1)N/G elements sent in all (exactly
2N - n_i - n_{i+1} with uneven segments, n_j the length of segment j), independent of G for large G — the
reason the ring scales where the single master does not. Latency: 2(G-1) steps, which is why small messages
prefer a tree.

Each step's receive is posted one step ahead (two scratch buffers in the reduce-scatter), so a left neighbour
that is ready to send never waits for this rank to say it can receive.

Every rank ends with bitwise the same result: each segment is summed once, by its owner, then copied.
The ring runs over any list of ``members`` (group ranks) so the hierarchical algorithm can reuse it on
sub-rings without creating process groups; ``phase``, ``step0``, ``offset`` and ``label`` let such a caller
record its messages as its own (where in the whole tensor, which phase, what the payload sums).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fourfold.comm.p2p import Communicator, Posted

__all__ = ["Label", "all_gather", "allreduce", "reduce_scatter", "segments", "theory"]

Label = Callable[[int, list[int]], str]
"""``(segment j, indices into members whose data the payload sums) -> label`` of a recorded message."""


def segments(numel: int, parts: int) -> list[tuple[int, int]]:
    """``[(offset, length)]`` of ``parts`` contiguous segments covering ``numel`` elements, as even as can be."""
    base, extra = divmod(numel, parts)
    out, offset = [], 0
    for j in range(parts):
        length = base + (1 if j < extra else 0)
        out.append((offset, length))
        offset += length
    return out


def _label(seg: int, owners: list[int]) -> str:
    return f"segment {seg}: sum of ranks {','.join(map(str, owners))}" if len(owners) > 1 else \
        f"segment {seg} of rank {owners[0]}"


def reduce_scatter(comm: Communicator, flat: torch.Tensor, members: list[int] | None = None,
                   algorithm: str = "ring", *, step0: int = 0, phase: str = "reduce-scatter", offset: int = 0,
                   label: Label | None = None) -> tuple[int, int]:
    """Share-reduce: afterwards this rank's segment of ``flat`` holds the sum over ``members``.

    Returns ``(offset, length)`` of that segment (segment i for member i) within ``flat``; the rest of
    ``flat`` holds partial sums and should be treated as scratch. ``offset`` is where ``flat`` starts in the
    caller's tensor (recorded messages only).
    """
    members = list(range(comm.size)) if members is None else members
    label = label or (lambda j, idx: _label(j, [members[k] for k in idx]))
    g, i = len(members), members.index(comm.rank)
    segs = segments(flat.numel(), g)
    if g == 1:
        return segs[0]
    right, left = members[(i + 1) % g], members[(i - 1) % g]
    record = comm.record_messages

    def post(s: int) -> Posted:  # step s's receive, into one of two scratch buffers
        return comm.post(left, comm.buffer(segs[(i - s - 2) % g][1], flat, slot=s % 2))

    ahead: Posted | None = post(0)
    for s in range(g - 1):
        send_j, recv_j = (i - s - 1) % g, (i - s - 2) % g
        (so, sl), (ro, rl) = segs[send_j], segs[recv_j]
        now, ahead = ahead, (post(s + 1) if s + 1 < g - 1 else None)
        assert now is not None  # posted one step ago
        labels = [label(send_j, [(send_j + 1 + k) % g for k in range(s + 1)])] if record else None
        comm.exchange([(right, flat[so:so + sl])], posted=[now], algorithm=algorithm, step=step0 + s,
                      phase=phase, offsets=([offset + so], [offset + ro]), labels=labels)
        flat[ro:ro + rl].add_(now.tensor)
    return segs[i]


def all_gather(comm: Communicator, flat: torch.Tensor, members: list[int] | None = None,
               algorithm: str = "ring", step0: int = 0, *, phase: str = "all-gather", offset: int = 0,
               label: Label | None = None) -> None:
    """Share-only: member i starts with its segment i complete; afterwards every member holds all of them."""
    members = list(range(comm.size)) if members is None else members
    label = label or (lambda j, idx: _label(j, [members[k] for k in idx]))
    g, i = len(members), members.index(comm.rank)
    if g == 1:
        return
    segs = segments(flat.numel(), g)
    right, left = members[(i + 1) % g], members[(i - 1) % g]
    everyone = list(range(g))

    def post(s: int) -> Posted:  # step s's receive, straight into its place
        ro, rl = segs[(i - s - 1) % g]
        return comm.post(left, flat[ro:ro + rl])

    ahead: Posted | None = post(0)
    for s in range(g - 1):
        send_j, recv_j = (i - s) % g, (i - s - 1) % g
        (so, sl), (ro, _) = segs[send_j], segs[recv_j]
        now, ahead = ahead, (post(s + 1) if s + 1 < g - 1 else None)
        assert now is not None  # posted one step ago
        labels = [label(send_j, everyone)] if comm.record_messages else None
        comm.exchange([(right, flat[so:so + sl])], posted=[now], algorithm=algorithm,
                      step=step0 + s, phase=phase, offsets=([offset + so], [offset + ro]), labels=labels)


def allreduce(comm: Communicator, flat: torch.Tensor) -> None:
    """Sum ``flat`` over the group in place: reduce-scatter, then all-gather."""
    reduce_scatter(comm, flat)
    all_gather(comm, flat, step0=comm.size - 1)


def theory(numel: int, world_size: int, rank: int, itemsize: int) -> tuple[int, int]:
    """``(bytes, messages)`` group rank ``rank`` sends in :func:`allreduce` of ``numel`` elements.

    ``(2N - n_i - n_{i+1}) * itemsize`` bytes in ``2(G-1)`` messages (some empty when N < G); nothing when
    N = 0 or G = 1, where :func:`fourfold.comm.allreduce` returns before sending.
    """
    if numel == 0 or world_size == 1:
        return 0, 0
    segs = segments(numel, world_size)
    elements = 2 * numel - segs[rank][1] - segs[(rank + 1) % world_size][1]
    return elements * itemsize, 2 * (world_size - 1)
