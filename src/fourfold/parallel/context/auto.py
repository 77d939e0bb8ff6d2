"""``--cp-algorithm auto``: each attention call's algorithm chosen from the α-β cost model the all-reduce's
``auto`` uses (:mod:`fourfold.comm.auto`: ``fourfold bench allreduce`` fits it; rank 0's, broadcast to the cp
group, so every rank picks alike), per layer shape, with the reason.

What it predicts is the wire time a call exposes, forward and backward, for N = cp ranks, q the rank's query (and
output) bytes, kv its keys' and values', kv' their gradients' (float32 at least), α per step, β per byte::

    allgather  2(N-1) steps, (N-1)(kv + kv') bytes             a ring all-gather, then a reduce-scatter
    ring       (3N-2) steps, N kv' bytes                        K/V hops hidden behind each block's attention
                                                                (stated assumption), the dK/dV hops not
    ulysses    8 steps, 2 (N-1)/N (2q + kv) bytes               four all-to-alls each way, N-1 messages at once

Ulysses needs the heads to divide by cp (it is no candidate otherwise), and with key/value heads that do not
divide, kv is the repeated heads' bytes. What the model does not see: compute (fourfold's ring kernel, which
must return each block's log-sum-exp, is slower on CPU than SDPA's fused kernel that Ulysses and all-gather call:
``fourfold bench cp``) and memory (all-gather holds the whole sequence's K/V). So on one machine, where β is
small, auto mostly picks by steps.
"""

from __future__ import annotations

from fourfold.comm.cost import CostModel

__all__ = ["choose", "predict"]


def predict(algorithm: str, cp: int, model: CostModel, *, q_bytes: int, kv_bytes: int, grad_kv_bytes: int,
            heads: int, kv_heads: int) -> float | None:
    """Predicted exposed wire seconds of one attention call (forward + backward), or None where ``algorithm``
    cannot run (Ulysses with heads that do not divide by cp)."""
    a, b, n = model.alpha_s, model.beta_s_per_byte, cp
    if n == 1:
        return 0.0
    if algorithm == "allgather":
        return 2 * (n - 1) * a + (n - 1) * (kv_bytes + grad_kv_bytes) * b
    if algorithm == "ring":
        return (3 * n - 2) * a + n * grad_kv_bytes * b
    if heads % n:
        return None
    kv = kv_bytes if kv_heads % n == 0 else kv_bytes * heads // kv_heads
    return 8 * a + 2 * (n - 1) * (2 * q_bytes + kv) * b / n


def choose(cp: int, model: CostModel, *, q_bytes: int, kv_bytes: int, grad_kv_bytes: int, heads: int,
           kv_heads: int) -> tuple[str, str]:
    """``(algorithm, reason)``: the least predicted time (ties: ring, then Ulysses, then all-gather). Pure: every
    rank given the same arguments picks the same."""
    times = {name: predict(name, cp, model, q_bytes=q_bytes, kv_bytes=kv_bytes, grad_kv_bytes=grad_kv_bytes,
                           heads=heads, kv_heads=kv_heads) for name in ("ring", "ulysses", "allgather")}
    known = {k: t for k, t in times.items() if t is not None}
    best = min(known, key=known.__getitem__)
    others = ", ".join(f"{k} {_fmt(t)}" for k, t in known.items() if k != best)
    skipped = "" if len(known) == len(times) else f" (ulysses: {heads} heads do not divide by cp={cp})"
    reason = (f"{best} {_fmt(known[best])} <= {others} predicted wire time for q {q_bytes} B, K/V {kv_bytes} B per "
              f"rank at cp={cp}{skipped} [alpha {model.alpha_s * 1e6:.1f} us, beta {model.beta_s_per_byte * 1e9:.3f} "
              f"ns/B; {model.source or 'default'}]")
    return best, reason


def _fmt(s: float) -> str:
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"
