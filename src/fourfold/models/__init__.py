"""Reference models: TinyGPT, built as a list of one-tensor-in, one-tensor-out stages."""

from __future__ import annotations

from fourfold.models.gpt import (
    MLP,
    Block,
    CausalSelfAttention,
    Embedding,
    GPTConfig,
    Head,
    TinyGPT,
    lm_loss,
)

__all__ = [
    "MLP",
    "Block",
    "CausalSelfAttention",
    "Embedding",
    "GPTConfig",
    "Head",
    "TinyGPT",
    "lm_loss",
]
