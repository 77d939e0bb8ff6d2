"""The language-model loss every strategy uses by default (its tensor-parallel twin, over vocabulary-sharded
logits, is :func:`fourfold.parallel.tensor.vocab_parallel_cross_entropy`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "lm_loss", "lm_loss_sum"]

IGNORE_INDEX = -100
"""A target nobody predicts (padding): every loss skips it (``F.cross_entropy``'s default ``ignore_index``)."""


def _positions(logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Refuse logits that are not one row of scores per target, naming both shapes (cross-entropy's own error
    speaks of flattened batch sizes the user never wrote)."""
    if logits.dim() == 0 or logits.numel() // max(1, logits.size(-1)) != targets.numel():
        raise ValueError(f"the model must give one row of logits per target, (B, T, vocab) for targets (B, T), got "
                         f"logits {tuple(logits.shape)} for targets {tuple(targets.shape)}. A forward that returns "
                         "only the last position's logits when called without targets (nanoGPT's generate path) must "
                         "return every position's: fourfold calls model(inputs) and computes the loss itself.")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all B*T positions: -1/(BT) sum_{b,t} log softmax(logits[b,t])[y[b,t]]."""
    _positions(logits, targets)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the real targets (``-100``, padding, skipped): the engine divides it
    by the global batch's count of real targets, so every token weighs the same whatever row, micro-batch or
    rank it lands on."""
    _positions(logits, targets)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")
