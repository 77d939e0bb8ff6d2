"""ZeRO's segments: each rank's 1/G of a flat bucket (the tensor its optimiser updates), and the reduce-scatter and
all-gather that fill them, with the bytes they send in theory."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fourfold.comm import Communicator, ring
from fourfold.comm.wait import bounded_wait
from fourfold.observe.trace import Tracer
from fourfold.parallel.buckets import allocate, flat_of, padded, release

__all__ = ["ZeroBucket", "flatten", "gather_flat", "reduce_scatter", "theory_bytes"]


@dataclass(eq=False)
class ZeroBucket:
    """One bucket's parameters, flat: ``params`` holds them all (the model's parameters are views of it) and
    ``shard`` is this rank's segment, the tensor the optimiser updates."""

    params: torch.Tensor
    shard: nn.Parameter
    offset: int
    length: int
    stage: int
    gathered: bool = True
    handle: Any = None  # an all-gather in flight (a Work or a Future)

    @property
    def own(self) -> torch.Tensor:
        return self.params[self.offset:self.offset + self.length]

    def free(self) -> None:
        """Stage 3: release the whole parameters (their storage shrinks to nothing; the views stay valid)."""
        if self.stage == 3 and self.gathered:
            release(self.params)
            self.gathered = False

    def allocate(self) -> None:
        """Stage 3: the whole parameters' storage back, this rank's segment copied in, ready to gather."""
        if not self.gathered:
            allocate(self.params)
            self.own.copy_(self.shard.detach())


def flatten(params: Sequence[nn.Parameter], offsets: Sequence[int], numel: int, group_rank: int, size: int,
            stage: int) -> ZeroBucket:
    """Move ``params`` into one flat buffer of ``numel`` elements (padded with zeros) and make each parameter a
    view of its slice; this rank's segment becomes the optimiser's shard (its own copy under stage 3)."""
    flat = flat_of([p.detach() for p in params], offsets, numel)
    for p, offset in zip(params, offsets, strict=True):
        p.data = flat[offset:offset + p.numel()].view_as(p)
    length = numel // size
    own = flat[group_rank * length:(group_rank + 1) * length]
    shard = nn.Parameter(own.clone() if stage == 3 else own)
    return ZeroBucket(flat, shard, group_rank * length, length, stage)


def reduce_scatter(comm: Communicator, flat: torch.Tensor, algorithm: str, *, tracer: Tracer | None,
                   index: int) -> torch.Tensor:
    """Sum ``flat`` over the group, keeping only this rank's segment: returns it (a view of ``flat`` for the
    ring, a new tensor for the backend's collective). ``flat``'s other segments become scratch."""
    start = tracer.now_ns() if tracer is not None else 0
    before = comm.stats.sent_bytes
    length = flat.numel() // comm.size
    if algorithm == "native":
        out = torch.empty(length, dtype=flat.dtype, device=flat.device)
        work = dist.reduce_scatter_single(out, flat, group=comm.group, async_op=True)
        bounded_wait(work, comm.timeout_s, rank=comm.global_rank, op=f"native reduce-scatter of bucket {index}",
                     awaited="the data-parallel group of", group_ranks=comm.global_ranks,
                     hint="A peer is dead, stuck, or skipped a backward.")
    else:
        offset, _ = ring.reduce_scatter(comm, flat)
        out = flat[offset:offset + length]
    _record(tracer, f"reduce_scatter:{algorithm}", start, comm, before, index, flat)
    return out


def gather_flat(comm: Communicator, flat: torch.Tensor, algorithm: str, *, tracer: Tracer | None = None,
                index: int = 0) -> None:
    """All-gather ``flat`` (a multiple of G elements) whose segment r group rank r holds."""
    start = tracer.now_ns() if tracer is not None else 0
    before = comm.stats.sent_bytes
    if algorithm == "native":
        length = flat.numel() // comm.size
        own = flat[comm.rank * length:(comm.rank + 1) * length].clone()
        work = dist.all_gather_single(flat, own, group=comm.group, async_op=True)
        bounded_wait(work, comm.timeout_s, rank=comm.global_rank, op=f"native all-gather of bucket {index}",
                     awaited="the data-parallel group of", group_ranks=comm.global_ranks,
                     hint="A peer is dead, stuck, or skipped a step.")
    else:
        ring.all_gather(comm, flat)
    _record(tracer, f"all_gather:{algorithm}", start, comm, before, index, flat)


def _record(tracer: Tracer | None, name: str, start: int, comm: Communicator, before: int, index: int,
            flat: torch.Tensor) -> None:
    if tracer is not None and tracer.enabled:
        tracer.record("comm", name, start, tracer.now_ns(), bytes=comm.stats.sent_bytes - before, bucket=index,
                      numel=flat.numel(), dtype=str(flat.dtype).replace("torch.", ""))


def theory_bytes(bucket_numels: Iterable[int], itemsize: int, size: int, gathers: int = 1) -> int:
    """Bytes one rank sends per step with fourfold's ring: one reduce-scatter and ``gathers`` all-gathers of
    every bucket, each sending (G-1)/G of its padded elements. ``gathers``: 1 for stages 1-2 and under a
    pipeline, 2 for stage 3 without one (forward and backward)."""
    total = sum(padded(n, size) for n in bucket_numels)
    return (1 + gathers) * (size - 1) * (total // size) * itemsize
