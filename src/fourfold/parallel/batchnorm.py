"""BatchNorm under data parallelism. Each rank normalises its B/dp samples with their own mean and variance, so
a replicated BatchNorm does not compute what one process computes on the whole batch, and its running
statistics drift apart per rank. :func:`batchnorm_layers` finds them (the engine warns, naming them);
:func:`sync_batchnorm` swaps each for :class:`SyncBatchNorm`, which takes the statistics over the data-parallel
group (one all-reduce of [sum, sum of squares, count] forward, one of their gradients backward), on CPU and
GPU alike (``torch.nn.SyncBatchNorm`` runs on CUDA only).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fourfold.comm.wait import all_reduce
from fourfold.launch import DEFAULT_TIMEOUT_S

__all__ = ["BATCHNORMS", "SyncBatchNorm", "batchnorm_for_data_parallel", "batchnorm_for_microbatches",
           "batchnorm_layers", "sync_batchnorm"]


BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def batchnorm_layers(model: nn.Module) -> list[str]:
    """The paths of ``model``'s BatchNorm layers (each normalises with its own rank's batch in training)."""
    return [name for name, m in model.named_modules() if name and isinstance(m, BATCHNORMS)]


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, timeout_s: float, op: str) -> torch.Tensor:
    return all_reduce(t.contiguous(), group, timeout_s, op=op, awaited="the data-parallel group of")


class _SumOverGroup(torch.autograd.Function):
    """Sum over the group forward; the gradient of a sum is the same sum of gradients backward."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: dist.ProcessGroup | None, timeout_s: float) -> torch.Tensor:
        ctx.group, ctx.timeout_s = group, timeout_s
        return _all_reduce(t.clone(), group, timeout_s, "sync batchnorm statistics")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_reduce(grad.clone(), ctx.group, ctx.timeout_s, "sync batchnorm gradients"), None, None


class SyncBatchNorm(nn.Module):
    """BatchNorm whose training statistics are the whole data-parallel batch's (every rank's samples), with a
    BatchNorm's state-dict names (weight, bias, running_mean, running_var, num_batches_tracked).

    Equal shards give exactly one process's result; shards of different sizes are weighted by their counts.
    Evaluation uses the running statistics, as nn.BatchNorm does. Build with :func:`sync_batchnorm`.
    """

    weight: nn.Parameter | None
    bias: nn.Parameter | None
    running_mean: torch.Tensor | None
    running_var: torch.Tensor | None
    num_batches_tracked: torch.Tensor | None

    def __init__(self, norm: nn.Module, group: dist.ProcessGroup | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__()
        bn: Any = norm
        self.num_features: int = bn.num_features
        self.eps: float = bn.eps
        self.momentum: float | None = bn.momentum
        self.affine: bool = bn.affine
        self.weight, self.bias = bn.weight, bn.bias  # the same Parameters: the optimiser's view is unchanged
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            self.register_buffer(name, getattr(norm, name))
        self.group, self.timeout_s = group, timeout_s
        self.train(norm.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm expects (N, {self.num_features}, ...) input, got shape "
                             f"{tuple(x.shape)}")
        if not self.training and self.running_mean is not None:  # running statistics: nothing to share
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        dims = [0, *range(2, x.dim())]  # every dim but the channels
        count = torch.full((1,), x.numel() / x.shape[1], dtype=x.dtype, device=x.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])  # (2C+1,)
        stats = _SumOverGroup.apply(stats, self.group, self.timeout_s)
        c = x.shape[1]
        n = stats[-1]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean  # biased, as BatchNorm normalises
        if self.training and self.running_mean is not None:
            self._update_running(mean.detach(), var.detach(), float(n.detach()))
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.weight is not None and self.bias is not None:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        running_mean, running_var, batches = self.running_mean, self.running_var, self.num_batches_tracked
        assert running_mean is not None and running_var is not None and batches is not None
        batches.add_(1)
        momentum = (1.0 / float(batches)) if self.momentum is None else self.momentum
        unbiased = var * (n / max(n - 1.0, 1.0))
        running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)


def sync_batchnorm(model: nn.Module, group: dist.ProcessGroup | None,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> nn.Module:
    """Replace every BatchNorm in ``model`` by a :class:`SyncBatchNorm` over ``group``, keeping its parameters
    and running statistics (the same objects: names and the optimiser's view are unchanged). Returns ``model``."""
    for name in batchnorm_layers(model):
        new = SyncBatchNorm(model.get_submodule(name), group, timeout_s)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return model


def batchnorm_for_data_parallel(model: nn.Module, sync: bool, group: dist.ProcessGroup | None,
                                timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Before data parallelism: ``sync`` swaps ``model``'s BatchNorms for :class:`SyncBatchNorm`; otherwise a
    warning names them (the engine calls this when dp > 1)."""
    norms = batchnorm_layers(model)
    if not norms:
        return
    if sync:
        sync_batchnorm(model, group, timeout_s)
        return
    if _first_rank():
        warnings.warn(f"BatchNorm layers {_shown(norms)} normalise each data-parallel rank's shard with its own "
                      "mean and variance, so training differs from one process and the running statistics differ "
                      "per rank (the saved model has rank 0's). Pass sync_batchnorm=True (fourfold train "
                      "--sync-batchnorm) to take them over the whole batch.", stacklevel=4)


def batchnorm_for_microbatches(model: nn.Module, microbatches: int, accumulated: bool = False) -> None:
    """Under a pipeline of ``microbatches`` > 1 (or ``accumulated``: gradient accumulation over that many): a
    warning names ``model``'s BatchNorms, which see one micro-batch at a time (the engine calls this; no sync
    spans micro-batches)."""
    norms = batchnorm_layers(model)
    if norms and _first_rank():
        whose, fix = (("gradient accumulation's", "no accumulation (fourfold train --grad-accum 1)") if accumulated
                      else ("the pipeline's", "one micro-batch (fourfold train --strategy model)"))
        warnings.warn(f"BatchNorm layers {_shown(norms)} normalise each of {whose} {microbatches} micro-batches "
                      "with its own mean and variance (and update the running statistics once per micro-batch), so "
                      f"training differs from one process. Use {fix}, or a LayerNorm / GroupNorm, which "
                      "normalise each sample on its own.", stacklevel=4)


def _shown(norms: list[str]) -> str:
    return ", ".join(norms[:6]) + (f" and {len(norms) - 6} more" if len(norms) > 6 else "")


def _first_rank() -> bool:
    """Warn once per job, not once per rank."""
    return not dist.is_initialized() or dist.get_rank() == 0
