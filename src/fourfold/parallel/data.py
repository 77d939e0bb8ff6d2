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

from fourfold.comm import Communicator, allreduce
from fourfold.trace import Tracer

__all__ = ["sync_gradients"]


def sync_gradients(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None,
                   tracer: Tracer | None = None, algorithm: str = "native", comm: Communicator | None = None,
                   check: bool = True) -> None:
    """Average every parameter's ``.grad`` over ``group``: one all-reduce per parameter, after backward.

    ``algorithm`` is any of :data:`fourfold.comm.ALGORITHMS`; pass a ``comm`` to reuse its buffers and count
    bytes across steps, and ``check=False`` once the shapes are known to agree on every rank (the first step
    checked them). A parameter without a gradient is refused by name: silently skipping it would let the
    replicas drift apart.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return
    comm = comm if comm is not None else Communicator(group)
    for i, p in enumerate(params):
        if p.grad is None:
            raise RuntimeError(
                f"parameter #{i} (shape {tuple(p.shape)}) got no gradient on rank {dist.get_rank()}: every rank "
                "must use every parameter in each step, or the replicas drift apart.")
        allreduce(p.grad, algorithm, comm=comm, tracer=tracer, check=check)
        p.grad.div_(size)
