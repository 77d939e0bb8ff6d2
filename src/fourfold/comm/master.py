"""Single master: every rank sends its tensor to one root, the root sums and sends the result back.

Cost: the root receives (G-1)N and sends (G-1)N elements in 2(G-1) messages; every other rank sends N and
receives N. Fewer bytes in total than naive (2(G-1)N instead of G(G-1)N), but all of them pass through one
rank, so the root's link and its additions are the bottleneck and the time grows with G.
"""

from __future__ import annotations

import torch

from fourfold.comm.naive import sum_in_rank_order
from fourfold.comm.p2p import Communicator

__all__ = ["allreduce", "theory"]


def allreduce(comm: Communicator, flat: torch.Tensor, root: int = 0) -> None:
    """Sum ``flat`` over the group in place through group rank ``root``."""
    g, me = comm.size, comm.rank
    others = [r for r in range(g) if r != root]
    if me != root:
        label = [f"all of rank {me}"] if comm.record_messages else None
        comm.exchange([(root, flat)], [], algorithm="master", step=0, phase="gather", offsets=([0], []),
                      labels=label)
        comm.exchange([], [(root, flat)], algorithm="master", step=1, phase="broadcast")
        return
    inbox = comm.buffer((g - 1) * flat.numel(), flat).view(g - 1, flat.numel())  # (G-1, N)
    comm.exchange([], [(r, inbox[k]) for k, r in enumerate(others)], algorithm="master", step=0,
                  phase="gather")
    sum_in_rank_order(flat, root, {r: inbox[k] for k, r in enumerate(others)})  # rank order, as everywhere
    label = ["sum of all ranks"] * len(others) if comm.record_messages else None
    comm.exchange([(r, flat) for r in others], [], algorithm="master", step=1, phase="broadcast",
                  offsets=([0] * len(others), []), labels=label)


def theory(numel: int, world_size: int, rank: int, itemsize: int, root: int = 0) -> tuple[int, int]:
    """``(bytes, messages)`` group rank ``rank`` sends: the root ``(G-1) * N * itemsize`` in ``G-1`` messages,
    every other rank ``N * itemsize`` in one (nothing for N = 0 or G = 1)."""
    if numel == 0 or world_size == 1:
        return 0, 0
    if rank == root:
        return (world_size - 1) * numel * itemsize, world_size - 1
    return numel * itemsize, 1
