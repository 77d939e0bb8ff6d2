"""A pipeline's state dict across its stages: every rank's stages merged in the model's key order, on every
rank or on one (the tensors then sent one at a time, so the receiver holds each once)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fourfold.comm.wait import bounded_wait, gather_objects, group_ranks
from fourfold.launch import DEFAULT_TIMEOUT_S

__all__ = ["Parts", "STATE_TAG", "gather_stages"]

Parts = list[tuple[int, dict[str, torch.Tensor]]]
STATE_TAG = 1 << 30
"""The first tag of a state dict's tensors sent to one rank (then one each): above every pipeline message's
(:meth:`Links._tag`)."""


def gather_stages(parts: Parts, group: dist.ProcessGroup | None, dst: int | None = None,
                  timeout_s: float = DEFAULT_TIMEOUT_S, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every rank's ``(stage index, that stage's state under the model's names)`` parts, merged in stage order
    (so in the model's key order, interleaved stages included), on every rank of ``group`` (or on global rank
    ``dst`` alone, the tensors crossing on ``device``, the group's; the others get ``{}``). A collective."""
    if dst is None:
        everyone = gather_objects(list(parts), group, op="gather the pipeline's state_dict")
    else:
        everyone = _gather_onto(parts, group, dst, timeout_s, torch.device(device))
    out: dict[str, torch.Tensor] = {}
    for _, part in sorted((item for got in everyone for item in got), key=lambda item: item[0]):
        out.update(part)
    return out


def _gather_onto(parts: Parts, group: dist.ProcessGroup | None, dst: int, timeout_s: float,
                 device: torch.device) -> list[Parts]:
    """Every rank's ``parts`` on ``dst`` (``[]`` elsewhere), the tensors sent one at a time: only their names,
    shapes and dtypes travel pickled, so ``dst`` holds each received tensor once (a pickled gather holds every
    rank's pickle, padded to the largest, beside what it unpickles). Each tensor has a tag of its own, its place
    in its sender's list (:func:`_tensors`)."""
    me = dist.get_rank()
    shapes = [(index, [(k, tuple(v.shape), v.dtype) for k, v in part.items()]) for index, part in parts]
    everyone = gather_objects(shapes, group, op="gather the names and shapes of the pipeline's state_dict", dst=dst)
    if me != dst:  # one tensor at a time
        for j, (k, v) in enumerate(_tensors(parts)):
            t = v.contiguous().to(device)
            bounded_wait(dist.isend(t, dst, group=group, tag=STATE_TAG + j), timeout_s, rank=me,
                         op=f"send {k} (state_dict)", awaited="send to", peer=dst, tensor=t, direction="send")
        return []
    received: dict[int, Parts] = {me: list(parts)}
    posted = []  # every receive posted at once, so no sender waits for the ranks before it to be received
    for src, theirs in zip(group_ranks(group), everyone, strict=True):
        if src != me:
            received[src] = [(index, {k: torch.empty(shape, dtype=dtype, device=device) for k, shape, dtype in listed})
                             for index, listed in theirs]
            posted += [(src, k, t, dist.irecv(t, src, group=group, tag=STATE_TAG + j))
                       for j, (k, t) in enumerate(_tensors(received[src]))]
    for src, k, t, work in posted:
        bounded_wait(work, timeout_s, rank=me, op=f"receive {k} (state_dict)", awaited="receive from", peer=src,
                     tensor=t, direction="recv")
    return [[(index, {k: t.cpu() for k, t in part.items()}) for index, part in received[src]]
            for src in group_ranks(group)]


def _tensors(parts: Parts) -> list[tuple[str, torch.Tensor]]:
    """``parts``' tensors in one list, stage by stage: the order a sender sends them and its receiver tags them."""
    return [(k, t) for _, part in parts for k, t in part.items()]
