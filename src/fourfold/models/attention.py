"""What a model reads of the batch's documents (:mod:`fourfold.data.packing`): position ids that restart at
every document, and causal attention that stays inside a document.

Without packed documents both are the plain ones: ``arange(T)`` and ``is_causal=True``. With them, attention
is PyTorch's ``scaled_dot_product_attention`` given the layout's block-diagonal causal mask (B, 1, T, T), one
mask per micro-batch shared by every layer. The same call on CPU and CUDA: SDPA picks its kernel for the mask
(on CUDA the memory-efficient one; flash attention takes no mask). A masked key contributes an exact zero, so a
document's outputs do not depend on its neighbours' tokens, bit for bit.

Under context parallelism (:mod:`fourfold.parallel.context`) the engine makes this rank's shard of the sequence
current: positions are its tokens' global ones, and attention reaches the other ranks' keys by the layout's
algorithm (ring, all-gather or Ulysses), so a model calling these two functions needs nothing else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fourfold.data.packing import current_layout
from fourfold.parallel.context import attend, current_shard

__all__ = ["causal_attention", "position_ids"]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + M) V for (B, H, T, D) q, k, v; M causal, and block-diagonal by document when a
    packed batch is running."""
    shard = current_shard()
    if shard is not None:
        if dropout_p:
            raise ValueError(f"attention dropout under context parallelism is not built (each rank would draw "
                             f"masks for its own chunk), got dropout_p={dropout_p}. Build the model with dropout=0")
        return attend(shard, q, k, v)
    layout = current_layout()
    if layout is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    layout.check((q.size(0), q.size(2)), "the attention's (batch, sequence)")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask, dropout_p=dropout_p)


def position_ids(idx: torch.Tensor, first: int = 0, n: int | None = None) -> torch.Tensor:
    """Positions [first, first + n) of a (B, T, ...) batch: ``arange`` (n,), or, for packed documents, each
    token's offset in its document (B, n)."""
    T = idx.size(1)
    n = T - first if n is None else n
    shard = current_shard()
    if shard is not None:  # this rank's chunks of the sequence: their global positions
        return shard.document_positions(first, n).to(idx.device)
    layout = current_layout()
    if layout is None:
        return torch.arange(first, first + n, device=idx.device)
    layout.check(idx.shape[:2], "the inputs")
    return layout.positions[:, first:first + n]
