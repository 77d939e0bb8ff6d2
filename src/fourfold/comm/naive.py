"""Naive all-to-all: every rank sends its whole tensor to every other rank and sums what it receives.

Cost per rank: (G-1) messages of N elements, (G-1)N sent and (G-1)N received; G(G-1)N elements cross the
network in all — the quadratic traffic that motivates everything else in ``fourfold.comm``. Latency: one step.

Every rank adds the G tensors in rank order 0..G-1, so every rank ends with bitwise the same sum.
"""

from __future__ import annotations

import torch

from fourfold.comm.p2p import Communicator

__all__ = ["allreduce", "sum_in_rank_order", "theory"]


def allreduce(comm: Communicator, flat: torch.Tensor) -> None:
    """Sum ``flat`` over the group in place, every rank receiving every other rank's whole tensor."""
    g, me = comm.size, comm.rank
    others = [r for r in range(g) if r != me]
    inbox = comm.buffer((g - 1) * flat.numel(), flat).view(g - 1, flat.numel())  # (G-1, N)
    label = [f"all of rank {me}"] * len(others) if comm.record_messages else None
    comm.exchange([(r, flat) for r in others], [(r, inbox[k]) for k, r in enumerate(others)],
                  algorithm="naive", step=0, phase="all-to-all", offsets=([0] * len(others), [0] * len(others)),
                  labels=label)
    sum_in_rank_order(flat, me, {r: inbox[k] for k, r in enumerate(others)})


def sum_in_rank_order(flat: torch.Tensor, me: int, received: dict[int, torch.Tensor]) -> None:
    """``flat`` (rank ``me``'s tensor) becomes ((t_0 + t_1) + t_2) + ... over every rank, in rank order.

    The same order on every rank gives bitwise the same sum; IEEE addition is commutative (a+b == b+a), so the
    ranks before ``me`` are summed in the first received buffer, added into ``flat``, and the ranks after
    ``me`` follow: no copies of the whole tensor.
    """
    before = [received[r] for r in sorted(received) if r < me]
    if before:
        acc = before[0]  # a receive buffer: free to overwrite
        for t in before[1:]:
            acc.add_(t)
        flat.add_(acc)  # t_me + acc == acc + t_me, bitwise
    for r in sorted(received):
        if r > me:
            flat.add_(received[r])


def theory(numel: int, world_size: int, rank: int, itemsize: int) -> tuple[int, int]:
    """``(bytes, messages)`` every rank sends: ``(G-1) * N * itemsize`` in ``G-1`` messages (0 for N = 0)."""
    if numel == 0 or world_size == 1:
        return 0, 0
    return (world_size - 1) * numel * itemsize, world_size - 1
