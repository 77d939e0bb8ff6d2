"""Hugging Face families under context parallelism: their attention runs fourfold's over the sequence shards.

transformers picks a layer's attention by ``config._attn_implementation`` from a registry it lets libraries
extend; fourfold registers :data:`IMPLEMENTATION`, which is SDPA's attention except while the engine runs a step
on a context-parallel shard: then it is :func:`fourfold.parallel.context.attend` (ring, all-gather or Ulysses)
with the layer's own ``scaling``. The positions the model's rotary or learned embeddings read are the shard's
(the tokens' global positions, or with packed documents each token's position in its document), passed as
``position_ids`` by the hook that passes packed documents (:func:`~fourfold.models.hf_split.read_documents`).
What the attention receives is after the layer's own q/k norms and rotary embedding, so those need nothing.

Not built under cp, and refused by :func:`check_context` (before launch) and by the attention call: a sliding
window shorter than the sequence (the shard's mask would need it; one as long as the sequence changes nothing),
scores soft-capped (Gemma 2), which SDPA and fourfold's block kernel do not compute, and attention dropout.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from fourfold.models.hf_split import sliding_window
from fourfold.parallel.context import attend, current_shard

__all__ = ["IMPLEMENTATION", "check_context", "read_context"]

IMPLEMENTATION = "fourfold_cp"


def check_context(config: Any, cp: int, seq_len: int | None = None) -> None:
    """Refuse a Hugging Face config whose attention context parallelism cannot compute exactly, naming the key
    (a window only when it is shorter than ``seq_len``; without one, the attention call checks it)."""
    kind = getattr(config, "model_type", "?")
    window = sliding_window(config)
    if window is not None and seq_len is not None and window < seq_len:
        _refuse_window(kind, window, seq_len, cp)
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap:
        raise ValueError(f"context parallelism (cp={cp}) computes attention without soft-capped scores, got {kind} "
                         f"with attn_logit_softcapping={cap}. Use --cp 1 for it")
    drop = getattr(config, "attention_dropout", 0.0) or getattr(config, "attn_pdrop", 0.0) or 0.0
    if drop:
        raise ValueError(f"attention dropout under context parallelism is not built, got {kind} with attention "
                         f"dropout {drop}. Set it to 0 in the model's config, or --cp 1")


def _refuse_window(kind: str, window: int, seq_len: int, cp: int) -> None:
    raise ValueError(f"context parallelism (cp={cp}) with a sliding window shorter than the sequence is not built, "
                     f"got {kind} with sliding_window={window} and sequences of {seq_len}. Set sliding_window null "
                     f"(or use_sliding_window false) in the model's config, use --seq-len {window} or less, or --cp 1")


def read_context(model: nn.Module, cp: int) -> None:
    """Make ``model``'s attention fourfold's while a context-parallel shard is current (SDPA's otherwise)."""
    config: Any = model.config
    check_context(config, cp)
    _register()
    model.set_attn_implementation(IMPLEMENTATION)  # type: ignore[operator]


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, _attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)  # outside a shard: SDPA's masks


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention call: (B, H, T, D) query, (B, H_kv, T, D) key and value -> ((B, T, H, D), None)."""
    shard = current_shard()
    if shard is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ValueError(f"attention dropout under context parallelism is not built, got dropout={dropout}. Set "
                         "the config's attention dropout to 0")
    window = kwargs.get("sliding_window")
    if window is not None and window < shard.T:
        _refuse_window(getattr(getattr(module, "config", None), "model_type", "?"), window, shard.T, shard.size)
    out = attend(shard, query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None
