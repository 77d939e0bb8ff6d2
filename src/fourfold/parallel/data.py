"""Data parallelism: every rank holds the whole model, sees its own shard of the batch, and averages gradients.

This is the naive version: after backward, one all-reduce per parameter, then divide by the group size. It is
the teaching version and the oracle the bucketed, overlapped version is tested against.

With the global batch split into equal shards, the mean of the ranks' mean losses is the mean loss over the
global batch, so the averaged gradient is exactly the single-process gradient::

    grad L = 1/G * sum_r grad L_r        (L_r: mean loss over rank r's B/G sequences)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch import nn

from fourfold.trace import Tracer

__all__ = ["sync_gradients"]


def sync_gradients(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None,
                   tracer: Tracer | None = None) -> None:
    """Average every parameter's ``.grad`` over ``group`` (one ``all_reduce`` per parameter, after backward).

    A parameter without a gradient is refused by name: silently skipping it would let replicas drift apart.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return
    for i, p in enumerate(params):
        if p.grad is None:
            raise RuntimeError(
                f"parameter #{i} (shape {tuple(p.shape)}) got no gradient on rank {dist.get_rank()}: every rank "
                "must use every parameter in each step, or the replicas drift apart.")
        if tracer is None:
            dist.all_reduce(p.grad, group=group)
        else:
            # The backend's own bytes on the wire are not visible from here; record the tensor's size.
            with tracer.span("comm", "all_reduce", param=i, tensor_bytes=p.grad.numel() * p.grad.element_size()):
                dist.all_reduce(p.grad, group=group)
        p.grad.div_(size)

