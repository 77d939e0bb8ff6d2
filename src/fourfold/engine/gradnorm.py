"""The gradients' global norm under any layout, and clipping by it: what ``torch.nn.utils.clip_grad_norm_``
computes on one process's whole model.

Each rank holds pieces of the gradient, and some pieces more than once across the world: a parameter that
tensor parallelism leaves replicated is whole on every tp rank, a tied weight has a copy on each pipeline
stage that uses it (both holding the summed gradient), and every data-parallel replica holds the same
averaged gradients (under ZeRO each holds only its own segment instead). Each piece's ``|g|^p`` is weighted
by one over its number of copies, summed on every rank, and the sums are added over the world in one
all-reduce: every element of the one-process gradient is then counted exactly once. The infinity norm needs
no weights: the largest element is the largest wherever it lies.

    total = engine.clip_grad_norm_(1.0)       # after engine.step(), before optimizer.step(); every rank
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from fourfold.comm.wait import all_reduce
from fourfold.engine.runner import Runner
from fourfold.mesh import Mesh
from fourfold.observe.trace import Tracer
from fourfold.parallel.data import DataParallel


class Engine(Protocol):
    """What the gradient norm reads of an engine (:class:`fourfold.engine.step.Engine`)."""

    layouts: dict[str, Any]
    runner: Runner
    dp: DataParallel | None
    tracer: Tracer
    timeout_s: float

    @property
    def mesh(self) -> Mesh: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def grad_copies(self) -> dict[int, int]: ...
    def parameters(self) -> list[nn.Parameter]: ...

__all__ = ["clip_grad_norm_", "grad_norm", "pieces"]


def copies(engine: Engine) -> dict[int, int]:
    """How many ranks of one data-parallel replica hold each of this rank's parameters (by ``id``): the tp
    ranks for a parameter tensor parallelism leaves whole, times the stages holding a tied weight's copy."""
    tp = engine.mesh.tp

    def over_tp(name: str) -> int:
        layout = engine.layouts.get(name)
        return tp if layout is None or layout.dim is None else 1

    return engine.runner.copies(over_tp)  # a pipeline's tied copies count once per stage holding one


def pieces(engine: Engine) -> Iterator[tuple[torch.Tensor, int]]:
    """This rank's gradient pieces, each with the number of ranks in the world that hold the same values.

    Under ZeRO the gradients are the segments' (``shard.grad``), each a run of several parameters; a segment is
    this rank's alone over dp, so only the run's own tp and tied copies count. Otherwise ``p.grad`` of every
    parameter this rank holds, replicated over dp too."""
    held = engine.grad_copies  # copies(engine), found once per engine
    if engine.dp is not None:  # the gradients' owner says what it holds (ZeRO: its segments)
        yield from engine.dp.grad_pieces(held)
        return
    for p in engine.parameters():
        if p.grad is not None:
            yield p.grad, held.get(id(p), 1)


def grad_norm(engine: Engine, norm_type: float = 2.0) -> float:
    """The ``norm_type``-norm of the whole model's gradient, as one process computes it: the same on every rank
    (an all-reduce over the world, bounded by the engine's timeout)."""
    if not (norm_type > 0):
        raise ValueError(f"norm_type must be > 0 (2.0, or math.inf for the largest element), got {norm_type}.")
    device = engine.device
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for g, n in pieces(engine):
        if g.numel() == 0:
            continue
        if math.isinf(norm_type):
            total = torch.maximum(total, g.detach().abs().max().to(torch.float64))
        else:
            total += torch.linalg.vector_norm(g.detach(), norm_type).to(torch.float64) ** norm_type / n
    if dist.is_initialized() and engine.mesh.world_size > 1:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        start = engine.tracer.now_ns()
        all_reduce(total, None, engine.timeout_s, op="gradient norm all-reduce", awaited="every rank of", reduce_op=op)
        engine.tracer.record("comm", "grad_norm_all_reduce", start, engine.tracer.now_ns(), tensor_bytes=8)
    value = total.item()
    return value if math.isinf(norm_type) else value ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(engine: Engine, max_norm: float, norm_type: float = 2.0) -> float:
    """Scale every gradient piece by ``max_norm / (norm + 1e-6)`` when that is below 1, as
    ``torch.nn.utils.clip_grad_norm_`` does on one process; the norm before clipping. ``max_norm=math.inf``
    only measures it."""
    if not (max_norm > 0):
        raise ValueError(f"max_norm must be > 0 (math.inf: measure the norm, clip nothing), got {max_norm}.")
    total = grad_norm(engine, norm_type)
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for p in engine.parameters():  # what the optimiser steps: under ZeRO the segments, each holding its grad
            if p.grad is not None:
                p.grad.mul_(coef)
    return total
