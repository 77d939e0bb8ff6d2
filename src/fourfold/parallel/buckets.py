"""The flat buckets gradients are packed into for their reduction (and ZeRO's parameters for their gathers):
which parameters share a bucket, its padded flat buffer and each parameter's offset in it, and the storage a
bucket frees between uses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["FIRST_BUCKET_BYTES", "Bucket", "allocate", "flat_of", "group_params", "make_bucket", "padded",
           "release"]

FIRST_BUCKET_BYTES = 2**20


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients are reduced together, packed into one flat buffer."""

    index: int
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    flat: torch.Tensor
    ready: set[int] = field(default_factory=set)    # ids of the parameters whose gradient is in ``flat``
    handle: Any = None                              # the in-flight all-reduce (Work or Future)
    zero: Any = None                                # ZeRO: the parameters' flat buffer and this rank's shard
    wire: torch.Tensor | None = None                # what the collective reduces (flat, or a reduce_dtype copy)


def group_params(named: list[tuple[str, nn.Parameter]], cap_bytes: int,
           first_cap: int = FIRST_BUCKET_BYTES) -> list[list[tuple[str, nn.Parameter]]]:
    """Parameters, last-registered first (roughly the order backward produces gradients), in groups of at most
    ``cap_bytes`` (the first at most ``first_cap``; a larger parameter gets a group of its own); one dtype and
    device per group."""
    groups: list[list[tuple[str, nn.Parameter]]] = []
    size = 0
    for name, p in reversed(named):
        nbytes = p.numel() * p.element_size()
        same_kind = groups and groups[-1][0][1].dtype == p.dtype and groups[-1][0][1].device == p.device
        # The first bucket is small (at most 1 MiB, as DDP does): it fills early in backward, so communication
        # starts early even when the whole model would fit in one bucket.
        cap = min(cap_bytes, first_cap) if len(groups) == 1 else cap_bytes
        if not groups or not same_kind or size + nbytes > cap:
            groups.append([])
            size = 0
        groups[-1].append((name, p))
        size += nbytes
    return groups


def padded(numel: int, multiple: int) -> int:
    """``numel`` rounded up to a multiple of ``multiple`` (ZeRO: every rank's segment the same length)."""
    return -(-numel // multiple) * multiple


def make_bucket(index: int, members: list[tuple[str, nn.Parameter]], multiple: int = 1) -> Bucket:
    """One bucket of ``members``, its flat buffer padded with zeros to a multiple of ``multiple`` elements."""
    offsets, total = [], 0
    for _, p in members:
        offsets.append(total)
        total += p.numel()
    first = members[0][1]
    flat = torch.zeros(padded(total, multiple), dtype=first.dtype, device=first.device)
    return Bucket(index, [n for n, _ in members], [p for _, p in members], offsets, total, flat)


def flat_of(tensors: Sequence[torch.Tensor], offsets: Sequence[int], numel: int) -> torch.Tensor:
    """A new flat tensor of ``numel`` elements (zeros past the last: padding) holding ``tensors`` at
    ``offsets``."""
    first = tensors[0]
    flat = torch.zeros(numel, dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for t, offset in zip(tensors, offsets, strict=True):
            flat[offset:offset + t.numel()].copy_(t.reshape(-1))
    return flat


def release(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def allocate(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())
