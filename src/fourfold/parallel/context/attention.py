"""Causal attention when the sequence is split over the context-parallel ranks: three ways, each counted.

Every rank holds the queries, keys and values of its own positions (:mod:`~fourfold.parallel.context.chunks`)
for every head. Attention needs every earlier key, so keys and values (or queries) must travel:

``allgather``  every rank gathers every chunk's K and V (a ring all-gather), attends its queries to them all;
               backward reduce-scatters their gradients back. Simple; holds the whole sequence's K and V.
``ring``       K/V blocks travel the ring, one hop a step, while each rank attends its queries to the block it
               holds (:mod:`~fourfold.parallel.context.kernel`: partial results merged by their log-sum-exp); the
               next block's transfer overlaps this block's compute. Backward sends the blocks round again with
               their dK/dV accumulating, which arrive home after the last hop. Holds two blocks at a time.
``ulysses``    an all-to-all swaps the sequence shards for head shards (DeepSpeed-Ulysses): each rank attends
               H / cp heads over the whole sequence, and a second all-to-all swaps back. Needs the heads to divide
               by cp; key/value heads that do not divide (grouped-query attention) are repeated to the query heads
               first, and the extra bytes are sent and counted.

What each rank sends per attention call (forward + backward, ``theory``), for K/V of ``kv`` bytes per rank and
Q (and the output) of ``q`` bytes per rank, N = cp::

    allgather  (N-1) kv forward, (N-1) kv' backward        (kv' = the gradients, float32 at least)
    ring       (N-1) kv forward, (N-1) kv + N kv' backward
    ulysses    (N-1)/N (q + kv + q) forward, the same backward

Exact: every algorithm computes the one-process attention to rounding (float64: 1e-12 in the tests), because the
causal mask compares global positions, whatever the chunks. Attention dropout is not drawn under cp.

Packed documents (``codes``): each position carries the code of its run (its row and the run's first position,
:func:`~fourfold.parallel.context.shard.run_codes`), so a rank knows, for any other rank's positions of the same rows, which of them share a
query's document; the mask is then (rows, Tq, Tk), a masked key adds an exact zero, and a document's outputs do
not depend on its neighbours, across chunk boundaries too. Positions restart at each document's start.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fourfold.comm import ring as ring_comm
from fourfold.parallel.context.kernel import block_backward, block_forward, merge, visible
from fourfold.parallel.context.shard import ALGORITHMS, Algorithm, ContextShard, Tile, rows_of

__all__ = ["ALGORITHMS", "Algorithm", "attend", "theory"]


class _Hop:
    """One ring hop in flight: started before a block's attention, waited for after it. The timeline gets a
    ``comm`` span ``cp.ring`` from start to arrival, holding its bytes (overlapping the compute it hides behind),
    and a ``wait`` span ``cp.wait`` for the time the rank then still waited: with the contiguous cut, the ranks
    with less causal work wait there for the busiest."""

    def __init__(self, shard: ContextShard, send: torch.Tensor, into: torch.Tensor, step: int, phase: str,
                 label: str) -> None:
        self.shard, r, n = shard, shard.rank, shard.size
        self.start = shard.tracer.now_ns() if shard.tracer is not None else 0
        self.pending = shard.comm.start([((r + 1) % n, send)], [((r - 1) % n, into)], algorithm="ring attention",
                                        step=step, phase=phase, labels=[label])

    def wait(self) -> None:
        shard, tracer = self.shard, self.shard.tracer
        waiting = tracer.now_ns() if tracer is not None else 0
        before = shard.comm.stats.sent_bytes
        self.pending.wait()
        if tracer is not None:
            end = tracer.now_ns()
            tracer.record("comm", "cp.ring", self.start, end, bytes=shard.comm.stats.sent_bytes - before,
                          ranks=shard.size)
            tracer.record("wait", "cp.wait", waiting, end, ranks=shard.size)


def attend(shard: ContextShard, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
           ) -> torch.Tensor:
    """softmax(Q K^T scale + causal mask) V for this rank's queries over the whole sequence's keys:
    q (B, H, T/cp, D), k and v (B, H_kv, T/cp, D) -> (B, H, T/cp, D). ``scale``: 1 / sqrt(D) unless given (a
    model's own, as Hugging Face attention passes it)."""
    if q.size(2) != shard.mine.numel() or k.size(2) != q.size(2):
        raise ValueError(f"context parallelism: this rank holds {shard.mine.numel()} positions of {shard.T}, got "
                         f"queries of {q.size(2)} and keys of {k.size(2)} positions. The model must attend over the "
                         "sequence it was given (its chunk), not a sequence of its own making")
    if q.size(1) % k.size(1):
        raise ValueError(f"query heads must be a multiple of key/value heads, got {q.size(1)} and {k.size(1)}.")
    scale = q.size(-1) ** -0.5 if scale is None else scale
    if shard.size == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.size(1) != k.size(1), scale=scale)
    algorithm = shard.algorithm
    if algorithm == "auto":
        if shard.pick is None:
            raise ValueError("cp_algorithm 'auto' needs the engine's ContextParallel, which holds the cost model; "
                             "a ContextShard made by hand names its algorithm: ring, allgather or ulysses")
        algorithm = shard.pick(q, k)
    if algorithm == "ring":
        return _Ring.apply(q, k, v, shard, scale)  # type: ignore[no-any-return]
    if algorithm == "allgather":
        return _allgather(shard, q, k, v, scale)
    return _ulysses(shard, q, k, v, scale)


# ------------------------------------------------------------------------------------------------- ring


def _tiles_forward(q: torch.Tensor, kv: torch.Tensor, tiles: list[Tile], scale: float, out: torch.Tensor,
                   lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` and ``lse`` (this rank's queries so far) with one more block's tiles merged in."""
    for t in tiles:
        o, lse_b = block_forward(q[:, :, t.qa:t.qb], kv[0][:, :, t.ka:t.kb], kv[1][:, :, t.ka:t.kb], t.seen, scale)
        merged, new = merge(out[:, :, t.qa:t.qb], lse[:, :, t.qa:t.qb], o, lse_b)
        out[:, :, t.qa:t.qb], lse[:, :, t.qa:t.qb] = merged, new
    return out, lse


class _Ring(torch.autograd.Function):
    """Ring attention (pass-K/V): forward and backward written out, so the blocks' log-sum-exp merge exactly."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: ContextShard,
                scale: float) -> torch.Tensor:
        N, r = shard.size, shard.rank
        kv = torch.stack([k.detach(), v.detach()])  # (2, B, H_kv, T/cp, D): one message a hop
        local = shard.local_codes()  # packed documents: which keys share a query's document
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)  # nothing seen yet
        for s in range(N):
            hop = None
            if s < N - 1:  # the next block travels while this one is attended to
                nxt = torch.empty_like(kv)
                hop = _Hop(shard, kv, nxt, s, "forward K/V", f"K/V of rank {(r - s) % N}")
            out, lse = _tiles_forward(q.detach(), kv, shard.tiles((r - s) % N, local), scale, out, lse)
            if hop is not None:
                hop.wait()
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.shard, ctx.local, ctx.scale = shard, local, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        shard: ContextShard = ctx.shard
        comm, N, r = shard.comm, shard.size, shard.rank
        right, left = (r + 1) % N, (r - 1) % N
        scale = ctx.scale
        delta = (dout.to(out.dtype) * out).sum(-1)  # rowsum(dout * out), (B, H, T/cp)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=out.dtype, device=kv.device)  # this block's dK/dV so far
        dq = torch.zeros(q.shape, dtype=out.dtype, device=q.device)
        for s in range(N):
            hop = None
            if s < N - 1:
                nxt = torch.empty_like(kv)
                hop = _Hop(shard, kv, nxt, s, "backward K/V", f"K/V of rank {(r - s) % N}")
            for t in shard.tiles((r - s) % N, ctx.local):
                dq_b, dk_b, dv_b = block_backward(q[:, :, t.qa:t.qb], kv[0][:, :, t.ka:t.kb], kv[1][:, :, t.ka:t.kb],
                                                  t.seen, scale, lse[:, :, t.qa:t.qb], dout[:, :, t.qa:t.qb],
                                                  delta[:, :, t.qa:t.qb])
                dq[:, :, t.qa:t.qb] += dq_b
                dkv[0][:, :, t.ka:t.kb] += dk_b
                dkv[1][:, :, t.ka:t.kb] += dv_b
            got = torch.empty_like(dkv)  # the left neighbour's accumulation: the next block's (or, last, ours)
            with shard.counted("ring"):
                comm.exchange([(right, dkv)], [(left, got)], algorithm="ring attention", step=s, phase="dK/dV",
                              labels=[f"dK/dV of rank {(r - s) % N}"])
            dkv = got
            if hop is not None:
                hop.wait()
                kv = nxt
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


# -------------------------------------------------------------------------------------------- all-gather


class _GatherSequence(torch.autograd.Function):
    """(2, B, H_kv, T/cp, D) this rank's K and V -> (cp, 2, B, H_kv, T/cp, D) every rank's, by a ring all-gather;
    backward: the gradients reduce-scattered back to their owners (a ring reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, kv: torch.Tensor, shard: ContextShard) -> torch.Tensor:
        n, r = kv.numel(), shard.rank
        flat = torch.empty(shard.size * n, dtype=kv.dtype, device=kv.device)
        flat[r * n:(r + 1) * n] = kv.reshape(-1)
        ring_comm.all_gather(shard.comm, flat, algorithm="all-gather K/V")
        ctx.shard, ctx.shape = shard, kv.shape
        return flat.view(shard.size, *kv.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        shard: ContextShard = ctx.shard
        flat = grad.to(torch.promote_types(grad.dtype, torch.float32)).contiguous().view(-1).clone()
        with shard.counted("allgather"):
            offset, length = ring_comm.reduce_scatter(shard.comm, flat, algorithm="reduce-scatter dK/dV")
        return flat[offset:offset + length].view(ctx.shape).to(grad.dtype), None


def _allgather(shard: ContextShard, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    with shard.counted("allgather"):
        every = _GatherSequence.apply(torch.stack([k, v]), shard)  # (cp, 2, B, H_kv, T/cp, D)
    B, hk, t, D = k.shape
    whole = every.permute(1, 2, 3, 0, 4, 5).reshape(2, B, hk, shard.size * t, D)  # rank order along the sequence
    seen = shard.seen(0, shard.local_codes(), keys=torch.cat(shard.everyone)).to(q.device)
    mask = seen if seen.dim() == 2 else seen[:, None]  # (Tq, T), or per row (rows, 1, Tq, T)
    return F.scaled_dot_product_attention(q, whole[0], whole[1], attn_mask=mask, enable_gqa=q.size(1) != hk,
                                          scale=scale)


# ----------------------------------------------------------------------------------------------- Ulysses


class _AllToAll(torch.autograd.Function):
    """``x`` cut in cp parts along ``scatter``, part j sent to rank j; the parts received joined along ``gather``
    in rank order. Its backward is the same swap the other way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: ContextShard, scatter: int, gather: int) -> torch.Tensor:
        ctx.shard, ctx.dims = shard, (scatter, gather)
        return _swap(shard, x, scatter, gather)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter, gather = ctx.dims
        return _swap(ctx.shard, grad, gather, scatter), None, None, None


def _swap(shard: ContextShard, x: torch.Tensor, scatter: int, gather: int) -> torch.Tensor:
    N, r = shard.size, shard.rank
    parts = [p.contiguous() for p in x.chunk(N, dim=scatter)]
    got = [p if j == r else torch.empty_like(p) for j, p in enumerate(parts)]
    with shard.counted("ulysses"):
        shard.comm.exchange([(j, parts[j]) for j in range(N) if j != r], [(j, got[j]) for j in range(N) if j != r],
                            algorithm="ulysses all-to-all", step=0)
    return torch.cat(got, dim=gather)


def _ulysses(shard: ContextShard, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    N, H, hk = shard.size, q.size(1), k.size(1)
    if H % N:
        raise ValueError(f"Ulysses context parallelism gives each cp rank H / cp of this rank's query heads, got "
                         f"{H} heads and cp={N}. Use --cp-algorithm ring or allgather, or a cp that divides {H}")
    if hk % N:  # key/value heads that do not divide: each query head's own copy travels (counted)
        k, v = k.repeat_interleave(H // hk, dim=1), v.repeat_interleave(H // hk, dim=1)
    qs, ks, vs = (_AllToAll.apply(t, shard, 1, 2) for t in (q, k, v))  # (B, heads / cp, T, D)
    pos = torch.cat(shard.everyone).to(q.device)  # the swapped sequence's positions, rank by rank
    gqa = qs.size(1) != ks.size(1)
    if shard.codes is None:  # put the sequence in order: SDPA's own causal flag, no (T, T) mask made or saved
        order = torch.argsort(pos)
        qs, ks, vs = (t.index_select(2, order) for t in (qs, ks, vs))
        y = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa, scale=scale).index_select(2, pos)
    else:  # packed documents: the whole rows' codes, in the swapped sequence's order
        codes = shard.codes[rows_of(shard.local_codes(), shard.T)][:, pos.to(shard.codes.device)].to(q.device)
        seen = visible(pos, pos)[None] & (codes[:, :, None] == codes[:, None, :])
        y = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seen[:, None], enable_gqa=gqa, scale=scale)
    return _AllToAll.apply(y, shard, 2, 1)  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------------------ theory


def theory(algorithm: Algorithm, cp: int, *, q_bytes: int, kv_bytes: int, grad_kv_bytes: int | None = None,
           kv_heads_divide: bool = True, heads_per_kv: int = 1) -> dict[str, int]:
    """Bytes one rank sends in one attention call, forward and backward, under ``algorithm``: ``q_bytes`` its
    queries (= its output), ``kv_bytes`` its keys and values together, ``grad_kv_bytes`` their gradients as sent
    (float32 at least; default ``kv_bytes``). Ulysses with key/value heads that do not divide by cp sends each
    query head's copy (``heads_per_kv`` times ``kv_bytes``)."""
    gkv = kv_bytes if grad_kv_bytes is None else grad_kv_bytes
    if cp == 1:
        return {"forward": 0, "backward": 0}
    if algorithm == "allgather":
        return {"forward": (cp - 1) * kv_bytes, "backward": (cp - 1) * gkv}
    if algorithm == "ring":
        return {"forward": (cp - 1) * kv_bytes, "backward": (cp - 1) * kv_bytes + cp * gkv}
    kv = kv_bytes if kv_heads_divide else kv_bytes * heads_per_kv
    each = (q_bytes + kv + q_bytes) * (cp - 1) // cp
    return {"forward": each, "backward": each}
