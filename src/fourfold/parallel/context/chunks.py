"""Which positions of a sequence each context-parallel rank holds, and the causal work that gives each.

A sequence of T tokens is cut over N ranks. Cut in N contiguous chunks, rank i's queries see the keys of chunks
0..i under the causal mask, so rank N-1 does about 2N-1 times rank 0's attention work while rank 0 waits. The
head-tail cut (``balanced``) cuts it in 2N chunks instead and gives rank i chunks i and 2N-1-i: a short-sighted
chunk and a far-sighted one, and every rank the same work (Megatron-Core's and torchtitan's load balancing)::

    T = 16, N = 2      contiguous: rank 0 [0..7]           rank 1 [8..15]          work 36 : 100
                       head-tail:  rank 0 [0..3]+[12..15]  rank 1 [4..7]+[8..11]   work 68 : 68

Positions are the tokens' global indices: the causal mask compares them (key position <= query position), so
attention is exact whichever chunks a rank holds, and the model's position embeddings read them.
"""

from __future__ import annotations

import torch

__all__ = ["causal_work", "check_length", "pieces", "positions"]


def check_length(T: int, cp: int, balanced: bool) -> None:
    """Refuse a sequence length the cut cannot divide evenly, naming the values and the fix."""
    parts = 2 * cp if balanced else cp
    if T % parts:
        cut = f"the head-tail cut makes 2 x cp = {parts} chunks" if balanced else f"cp = {cp} chunks"
        fix = T - T % parts or parts
        raise ValueError(f"context parallelism cuts each sequence into equal chunks and {cut}, got a sequence of "
                         f"T={T} tokens. Use sequences of a multiple of {parts} tokens (e.g. --seq-len {fix})"
                         + ("" if not balanced else " or --cp-balance none (cp chunks, unbalanced)"))


def pieces(T: int, cp: int, rank: int, balanced: bool) -> list[tuple[int, int]]:
    """Rank ``rank``'s contiguous runs of positions, ``[(start, stop)]`` in the order it holds them."""
    check_length(T, cp, balanced)
    if not 0 <= rank < cp:
        raise ValueError(f"rank must be in [0, {cp}), got {rank}.")
    if not balanced:
        n = T // cp
        return [(rank * n, (rank + 1) * n)]
    n = T // (2 * cp)
    tail = 2 * cp - 1 - rank
    return [(rank * n, (rank + 1) * n), (tail * n, (tail + 1) * n)]


def positions(T: int, cp: int, rank: int, balanced: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rank ``rank``'s global positions, (T / cp,) int64, in the order its tokens sit in its chunk."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in pieces(T, cp, rank, balanced)])


def causal_work(T: int, cp: int, balanced: bool) -> list[int]:
    """The score elements each rank computes under the causal mask (query-key pairs with key <= query, over the
    whole sequence's keys): what its attention costs. They sum to T (T + 1) / 2."""
    out = []
    for rank in range(cp):
        out.append(sum((b * (b + 1) - a * (a + 1)) // 2 for a, b in pieces(T, cp, rank, balanced)))
    return out
