"""What a model reads of the batch's documents (:mod:`fourfold.data.packing`): position ids that restart at
every document, and causal attention that stays inside a document.

Without packed documents both are the plain ones: ``arange(T)`` and ``is_causal=True``. With them, rows of
:data:`RUNS_FROM` positions or more attend document by document (:func:`document_attention`): the runs of each
length gathered into a batch, one ``scaled_dot_product_attention`` with its causal flag per length, so a packed
row costs the sum of its documents' lengths squared, not its own length squared, and no (T, T) mask is made.
Shorter rows attend through the block-diagonal mask (B, 1, T, T), which costs B T^2 whatever the documents but
one call (what Hugging Face attention is given at every length; :func:`packed_attention` chooses). Either way a
document's outputs depend on its own tokens only, bit for bit.

Under context parallelism (:mod:`fourfold.parallel.context`) the engine makes this rank's shard of the sequence
current: positions are its tokens' global ones, and attention reaches the other ranks' keys by the layout's
algorithm (ring, all-gather or Ulysses), so a model calling these two functions needs nothing else.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Literal

import torch
import torch.nn.functional as F

from fourfold.data.packing import DocumentLayout, current_layout
from fourfold.parallel.context import attend, current_shard

__all__ = ["RUNS_FROM", "causal_attention", "document_attention", "packed_attention", "position_ids"]


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
    mode = _mode.get()
    if mode == "dense" or (mode == "auto" and q.size(2) < RUNS_FROM):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask, dropout_p=dropout_p,
                                              enable_gqa=q.size(1) != k.size(1))
    return document_attention(q, k, v, layout, dropout_p)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: DocumentLayout,
                       dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention inside each run (:attr:`~fourfold.data.packing.DocumentLayout.runs`): the runs of one
    length gathered into a batch of their own, one SDPA call with its causal flag per length, the outputs put
    back in place (:attr:`~fourfold.data.packing.DocumentLayout.run_gathers`). (B, H, T, D) q, k, v -> (B, H, T,
    D); no tensor of two row lengths is made."""
    B, H, T, D = q.shape
    gathers, back = layout.run_gathers
    flat = [t.transpose(1, 2).reshape(B * T, t.size(1), D) for t in (q, k, v)]  # (B T, heads, D)
    outs = []
    for n, idx in gathers:
        qs, ks, vs = (t.index_select(0, idx).view(-1, n, t.size(1), D).transpose(1, 2) for t in flat)
        y = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout_p, is_causal=True,
                                           enable_gqa=qs.size(1) != ks.size(1))  # (runs, H, n, D)
        outs.append(y.transpose(1, 2).reshape(-1, H, D))
    return torch.cat(outs).index_select(0, back).view(B, T, H, D).transpose(1, 2)


RUNS_FROM = 1024
"""Rows of at least this many positions attend run by run; shorter ones through the dense mask, whose T^2 is
then small beside the per-length calls (``bench packing``, TinyGPT d_model 128: run by run 0.70x the mask's
speed at rows of 256, 1.27x at 1024, 2.46x at 4096)."""

Mode = Literal["auto", "dense", "runs"]


@contextlib.contextmanager
def packed_attention(mode: Mode) -> Iterator[None]:
    """Inside, packed documents attend ``dense`` (the one (B, 1, T, T) block-diagonal mask), ``runs`` (run by run,
    :func:`document_attention`) or ``auto`` (runs from rows of :data:`RUNS_FROM`, the default): what ``bench
    packing``'s ``-dense`` variants and the tests choose."""
    if mode not in ("auto", "dense", "runs"):
        raise ValueError(f"mode must be auto, dense or runs, got {mode!r}.")
    token = _mode.set(mode)
    try:
        yield
    finally:
        _mode.reset(token)


_mode: contextvars.ContextVar[Mode] = contextvars.ContextVar("fourfold_packed_attention", default="auto")


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
