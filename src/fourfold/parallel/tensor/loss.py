"""The cross-entropy of vocabulary-sharded logits, never gathering them (Megatron-LM's vocab-parallel loss).

Rank i holds z[..., i V/p : (i+1) V/p]. Forward needs two all-reduces (the row maxima, then the two sums
sum_v exp(z_v - m) and z_y - m in one message); backward needs none: d loss / d z = (softmax - onehot(y)) / N
restricted to this rank's columns.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

from fourfold.loss import IGNORE_INDEX
from fourfold.observe.trace import Tracer
from fourfold.parallel.tensor.comm import Group, all_reduce

__all__ = ["vocab_parallel_cross_entropy"]


def _tp(group: Group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: Group, tracer: Tracer | None,
                site: str, reduction: str) -> torch.Tensor:
        rank, _ = _tp(group)
        kw: dict[str, Any] = {"tracer": tracer, "site": site}
        z = logits.reshape(-1, logits.shape[-1])  # (N, V/p): this rank's columns of the logits
        start = rank * z.shape[1]
        y = targets.reshape(-1)  # (N,)
        real = y != IGNORE_INDEX  # (N,) positions with a target (padding has none)
        inside = (y >= start) & (y < start + z.shape[1])  # (N,) targets in this rank's columns
        local = (y - start).masked_fill(~inside, 0)
        # phase 1: the max over the whole row, so exp never overflows (it cancels in the loss)
        m = all_reduce(z.max(dim=1).values, group, op=dist.ReduceOp.MAX, **kw)  # (N,)
        e = torch.exp(z - m.unsqueeze(1))  # (N, V/p)
        target = (z.gather(1, local.unsqueeze(1)).squeeze(1) - m).masked_fill(~inside, 0.0)  # (N,)
        # phase 2: sum_v exp(z_v - m) and z_y - m, both sums over ranks, in one message
        sums = all_reduce(torch.stack([e.sum(dim=1), target]), group, **kw)  # (2, N)
        ctx.save_for_backward(e.div_(sums[0].unsqueeze(1)), local, inside, real)  # e is softmax_local now
        ctx.shape = logits.shape
        ctx.divisor = real.sum() if reduction == "mean" else 1  # a tensor: no host sync on the step's path
        losses = (sums[0].log() - sums[1]).masked_fill(~real, 0.0)  # log sum_v exp(z_nv) - z_{n,y_n}
        return losses.sum() / ctx.divisor  # the mean (or sum) over real targets

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        softmax, local, inside, real = ctx.saved_tensors
        # d loss / d z = (softmax - onehot(y)) / N, restricted to this rank's columns: no communication
        g = softmax.clone()
        g.scatter_add_(1, local.unsqueeze(1), -inside.to(g.dtype).unsqueeze(1))
        g.mul_(real.to(g.dtype).unsqueeze(1) * (grad / ctx.divisor))  # padding rows: no gradient
        return g.view(ctx.shape), None, None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, group: Group, *,
                                 tracer: Tracer | None = None, site: str = "loss",
                                 reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor:
    """mean_n [log sum_v exp(z_nv) - z_{n,y_n}] from this rank's logits z[..., i V/p : (i+1) V/p] alone.

    Two all-reduces forward (the row maxima, then the two sums), none backward: equal to
    ``F.cross_entropy(full_logits.reshape(-1, V), targets.reshape(-1), reduction=reduction)``. ``targets``
    (...) are global ids, or ``-100`` where nothing is predicted (skipped, as cross_entropy skips them).
    """
    if local_logits.shape[:-1] != targets.shape:
        raise ValueError(f"targets must have the logits' shape without the last dim, got "
                         f"{tuple(targets.shape)} and {tuple(local_logits.shape)}. Pass targets of shape "
                         f"{tuple(local_logits.shape[:-1])}")
    vocab = local_logits.shape[-1] * dist.get_world_size(group)
    real = targets[targets != IGNORE_INDEX]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab):
        raise ValueError(f"targets must be token ids in [0, {vocab}) (or {IGNORE_INDEX}: none), got values in "
                         f"[{int(real.min())}, {int(real.max())}]. Check the tokenizer's vocabulary size")
    if local_logits.dtype in (torch.bfloat16, torch.float16):  # mixed precision: the loss in float32, as
        local_logits = local_logits.float()  # autocast runs cross_entropy (a bf16 loss keeps 3 digits)
    return _VocabParallelCrossEntropy.apply(local_logits, targets, group, tracer, site, reduction)
