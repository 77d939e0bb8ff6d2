"""The language-model loss every strategy uses by default (its tensor-parallel twin, over vocabulary-sharded
logits, is :func:`fourfold.parallel.tensor.vocab_parallel_cross_entropy`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["lm_loss"]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all B*T positions: -1/(BT) sum_{b,t} log softmax(logits[b,t])[y[b,t]]."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
