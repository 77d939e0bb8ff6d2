"""Attention over one block of keys, with the log-sum-exp that lets blocks be merged: fourfold's own kernel.

Ring attention sees the keys a block at a time, so each block's result must carry its softmax's normaliser:
for queries q and a block of keys k, values v (scores s = q k^T / sqrt(d), masked where the key comes after the
query)::

    lse_b = log sum_j exp(s_j)            out_b = sum_j exp(s_j - lse_b) v_j

and two blocks merge exactly: ``lse = logaddexp(lse_1, lse_2)``, ``out = exp(lse_1 - lse) out_1 +
exp(lse_2 - lse) out_2``. PyTorch's CPU scaled_dot_product_attention returns no log-sum-exp, so the block is
computed here, in float32 at least (float64 stays float64), and so is its backward, from the merged output and
log-sum-exp alone (FlashAttention's): with ``delta = rowsum(dout * out)`` and ``p = exp(s - lse)``::

    dv = p^T dout      ds = p (dout v^T - delta)      dq = ds k / sqrt(d)      dk = ds^T q / sqrt(d)

Grouped-query attention: q has H heads, k and v have H_kv (H a multiple of it); query heads
``[g i, g (i + 1))`` read key head i, g = H / H_kv, and a key head's gradient sums its g query heads'.
Shapes: q (B, H, Tq, D); k, v (B, H_kv, Tk, D); ``seen`` (Tq, Tk) or, per row (packed documents), (B, Tq, Tk)
bool: which keys each query sees (:func:`visible` for the causal mask of global positions); None where every
key is seen (a tile wholly before its queries: no mask made or applied).
"""

from __future__ import annotations

import torch

__all__ = ["block_backward", "block_forward", "merge", "visible"]


def visible(qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """(Tq, Tk) bool: which keys each query sees under the causal mask (key position <= query position)."""
    return kpos[None, :] <= qpos[:, None]


def _grouped(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q (B, H, T, D) as (B, H_kv, g, T, D), its heads grouped by the key head they read."""
    B, H, T, D = q.shape
    hk = k.size(1)
    if H % hk:
        raise ValueError(f"query heads must be a multiple of key/value heads, got {H} and {hk}.")
    return q.reshape(B, hk, H // hk, T, D)


def _scores(q: torch.Tensor, k: torch.Tensor, seen: torch.Tensor | None, scale: float,
            acc: torch.dtype) -> torch.Tensor:
    """Masked scores (B, H_kv, g, Tq, Tk) in ``acc``, -inf where hidden (``seen`` None: nothing hidden)."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", _grouped(q, k).to(acc), k.to(acc)) * scale
    if seen is None:
        return s
    mask = seen if seen.dim() == 2 else seen[:, None, None]  # (Tq, Tk), or per row (B, 1, 1, Tq, Tk)
    return s.masked_fill(~mask, float("-inf"))


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor | None, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """This block's (out (B, H, Tq, D), lse (B, H, Tq)), both in float32 at least. A query that sees no key of
    the block gets out 0 and lse -inf (it merges as nothing)."""
    acc = _acc(q)
    s = _scores(q, k, seen, scale, acc)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, g, Tq); -inf for a row with nothing visible
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])  # exp(-inf) = 0 where hidden
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v.to(acc))
    B, H, T, D = q.shape
    return out.reshape(B, H, T, D), lse.reshape(B, H, T)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, out_b: torch.Tensor, lse_b: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two blocks' results as one, exactly (a block whose lse is -inf adds nothing)."""
    if out is None or lse is None:
        return out_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    safe = new.masked_fill(torch.isinf(new), 0.0)
    w, w_b = torch.exp(lse - safe), torch.exp(lse_b - safe)
    return out * w[..., None] + out_b * w_b[..., None], new


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor | None, scale: float,
                   lse: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of (dq, dk, dv), in float32 at least, from the merged ``lse`` (B, H, Tq), ``dout``
    (B, H, Tq, D) and ``delta = rowsum(dout * out)`` (B, H, Tq) of the whole attention."""
    acc = _acc(q)
    s = _scores(q, k, seen, scale, acc)
    g = _grouped(q, k)
    lse_g = lse.reshape(*g.shape[:-1])
    p = torch.exp(s - lse_g.masked_fill(torch.isinf(lse_g), 0.0)[..., None])  # 0 where hidden
    do = _grouped(dout, k).to(acc)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, do)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", do, v.to(acc))
    ds = p * (dp - delta.reshape(*g.shape[:-1])[..., None])
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k.to(acc)) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, g.to(acc)) * scale
    return dq.reshape(q.shape), dk, dv
