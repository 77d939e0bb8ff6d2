"""The communication of tensor parallelism: conjugate autograd functions over an explicit ``group`` of p ranks.

Each function's backward is its partner's forward (Megatron-LM: Shoeybi et al. 2019, sec. 3; the sequence pair
from Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4.2.2):

===========================  ========================  ========================  =======================
function                     forward                   backward                  used
===========================  ========================  ========================  =======================
``copy_to_tp``  (f)          identity                  all-reduce (sum)          before a column layer
``reduce_from_tp``  (g)      all-reduce (sum)          identity                  after a row layer
``gather_from_tp``           all-gather, a dim         keep own slice            ``gather_output``; SP end
``split_to_tp``              keep own slice, a dim     all-gather                row, full input; SP start
``gather_sequence``          all-gather, sequence dim  reduce-scatter            before column (SP)
``reduce_scatter_sequence``  reduce-scatter, seq. dim  all-gather                after row (SP)
``sum_over_tp``              all-reduce (sum)          all-reduce (sum)          a norm over split features
===========================  ========================  ========================  =======================

Why f all-reduces in backward: every rank computes its own Y_i = X A_i from the same X, so
dL/dX = sum_i dL/dY_i A_i^T, a sum over ranks. Why g's backward is the identity: Y = sum_i Y_i, so
dL/dY_i = dL/dY, which every rank already holds. The sequence pair is the same argument with the all-reduce
cut in its two halves: an all-reduce is a reduce-scatter followed by an all-gather. ``sum_over_tp`` is the one
function that is its own partner: S = sum_i s_i is a statistic every rank then uses on its own shard (an
RMSNorm's sum of squares over features split by tp), so dL/dS is a sum of every rank's part, and dL/ds_i = dL/dS.

With a :class:`~fourfold.observe.trace.Tracer`, each collective is one comm span named ``tp.all_reduce``,
``tp.all_gather`` or ``tp.reduce_scatter``; ``bytes`` is the size of the tensor this rank hands to the
collective (its payload, not the wire traffic: a ring all-reduce of N bytes sends 2(p-1)N/p per rank), and
``args`` hold ``phase`` (``forward`` | ``backward`` | ``grad_sync``), ``site`` (the layer's module name),
``numel`` and ``ranks``; :func:`wire_bytes` turns a span's payload into what a ring sends. A group of one rank
communicates nothing and records nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch
import torch.distributed as dist

from fourfold.comm.wait import bounded_wait, default_timeout_s, group_ranks
from fourfold.observe.trace import Tracer
from fourfold.parallel.split_backward import kept_for_weights

__all__ = [
    "Phase",
    "all_gather",
    "all_reduce",
    "copy_to_tp",
    "gather_from_tp",
    "gather_sequence",
    "reduce_from_tp",
    "reduce_scatter",
    "reduce_scatter_sequence",
    "split",
    "split_to_tp",
    "sum_over_tp",
    "wire_bytes",
]

Phase = Literal["forward", "backward", "grad_sync"]
Group = dist.ProcessGroup | None

# torch 2.13 renamed the one-tensor collectives *_single and deprecates the *_tensor names, which are all that
# torch 2.4 has; both write one output laid out along dim 0. gloo implements both on CPU.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _span(tracer: Tracer | None, op: str, t: torch.Tensor, group: Group, phase: Phase, site: str) -> Any:
    if tracer is None:
        return contextlib.nullcontext()
    return tracer.span("comm", f"tp.{op}", bytes=t.numel() * t.element_size(), phase=phase, site=site,
                       numel=t.numel(), ranks=dist.get_world_size(group))


RING_SHARE = {"all_reduce": lambda p: 2 * (p - 1) / p, "reduce_scatter": lambda p: (p - 1) / p,
              "all_gather": lambda p: p - 1}
"""What a ring implementation of each collective sends from one rank, per byte of the tensor it hands in (an
all-gather's is its shard): the wire bytes a tensor-parallel span stands for (:func:`wire_bytes`)."""


def wire_bytes(op: str, payload: int, ranks: int) -> int:
    """Bytes one rank sends for collective ``op`` (``all_reduce``, ...) handed ``payload`` bytes over ``ranks``
    ranks, as a ring moves them: a reduce-scatter and an all-gather add up to the all-reduce they split."""
    return round(RING_SHARE[op](ranks) * payload)


def _wait(work: Any, name: str, t: torch.Tensor, group: Group, phase: Phase, site: str) -> None:
    """Every tensor-parallel collective ends in the one bounded, named wait (and in the hang doctor's ledger)."""
    bounded_wait(work, default_timeout_s(), rank=dist.get_rank(), op=f"tensor-parallel {name} in {phase}"
                 f"{f' of {site}' if site else ''}", awaited="the tensor-parallel group of",
                 group_ranks=group_ranks(group), tensor=t)


def _chunk(n: int, p: int, dim: int, what: str) -> int:
    if n % p:
        raise ValueError(f"{what} dimension {dim} must be divisible by tp, got {n} and {p}. Pad it to "
                         f"{-(-n // p) * p} or use a tp that divides {n}")
    return n // p


def all_reduce(x: torch.Tensor, group: Group, *, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               tracer: Tracer | None = None, phase: Phase = "forward", site: str = "") -> torch.Tensor:
    """sum_i x_i (or ``op``) over ``group``, in a new tensor; ``x`` is left as it was."""
    if dist.get_world_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    with _span(tracer, "all_reduce", out, group, phase, site):
        _wait(dist.all_reduce(out, op=op, group=group, async_op=True), "all-reduce", out, group, phase, site)
    return out


def all_gather(x: torch.Tensor, dim: int, group: Group, *, tracer: Tracer | None = None,
               phase: Phase = "forward", site: str = "") -> torch.Tensor:
    """[x_0, x_1, ..., x_{p-1}] concatenated along ``dim`` (every rank's x has the same shape)."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    front = x.movedim(dim, 0).contiguous()  # the collective lays the ranks' pieces out along dim 0
    out = front.new_empty((p * front.shape[0], *front.shape[1:]))
    with _span(tracer, "all_gather", front, group, phase, site):
        _wait(_all_gather_single(out, front, group=group, async_op=True), "all-gather", front, group, phase, site)
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, dim: int, group: Group, *, tracer: Tracer | None = None,
                   phase: Phase = "forward", site: str = "") -> torch.Tensor:
    """Chunk r (of p, along ``dim``) of sum_i x_i on rank r."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((_chunk(front.shape[0], p, dim, "reduce-scattered"), *front.shape[1:]))
    with _span(tracer, "reduce_scatter", front, group, phase, site):
        _wait(_reduce_scatter_single(out, front, group=group, async_op=True), "reduce-scatter", front, group, phase,
              site)
    return out.movedim(0, dim)


def split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Chunk r (of p, along ``dim``) of ``x`` on rank r, copied; no communication."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    n = _chunk(x.shape[dim], p, dim, "split")
    return x.narrow(dim, dist.get_rank(group) * n, n).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, tracer: Tracer | None, site: str) -> torch.Tensor:
        ctx.group, ctx.tracer, ctx.site = group, tracer, site
        return x.view_as(x)  # a view, not x itself: autograd gives it this node as its grad_fn

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return all_reduce(grad, ctx.group, tracer=ctx.tracer, phase="backward", site=ctx.site), None, None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, tracer: Tracer | None, site: str) -> torch.Tensor:
        return all_reduce(x, group, tracer=tracer, phase="forward", site=site)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None, None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group, tracer: Tracer | None, site: str) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group, tracer=tracer, phase="forward", site=site)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return split(grad, ctx.dim, ctx.group), None, None, None, None


class _SplitToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group, tracer: Tracer | None, site: str) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.tracer, ctx.site = dim, group, tracer, site
        return split(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out = all_gather(grad, ctx.dim, ctx.group, tracer=ctx.tracer, phase="backward", site=ctx.site)
        return out, None, None, None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group, tracer: Tracer | None,
                site: str) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.tracer, ctx.site = dim, group, tracer, site
        # contiguous: its readers (q, k and v of one gathered input) then share one copy, where each would make
        # its own of a strided one, and save it for backward
        return all_gather(x, dim, group, tracer=tracer, phase="forward", site=site).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out = reduce_scatter(grad, ctx.dim, ctx.group, tracer=ctx.tracer, phase="backward", site=ctx.site)
        return out, None, None, None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group, tracer: Tracer | None,
                site: str) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.tracer, ctx.site = dim, group, tracer, site
        return reduce_scatter(x, dim, group, tracer=tracer, phase="forward", site=site)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # on the path from a row layer's output to its weight: a split backward's W reuses B's all-gather
        out = kept_for_weights(ctx, lambda: all_gather(grad, ctx.dim, ctx.group, tracer=ctx.tracer,
                                                      phase="backward", site=ctx.site))
        return out, None, None, None, None


class _SumOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, tracer: Tracer | None, site: str) -> torch.Tensor:
        ctx.group, ctx.tracer, ctx.site = group, tracer, site
        return all_reduce(x, group, tracer=tracer, phase="forward", site=site)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return all_reduce(grad, ctx.group, tracer=ctx.tracer, phase="backward", site=ctx.site), None, None, None


def sum_over_tp(x: torch.Tensor, group: Group, *, tracer: Tracer | None = None, site: str = "") -> torch.Tensor:
    """sum_i x_i over ``group`` forward, and the gradients' sum backward: a statistic every rank uses on its own
    shard, such as a norm's sum of squares over features tp splits."""
    return x if dist.get_world_size(group) == 1 else _SumOverTP.apply(x, group, tracer, site)


def copy_to_tp(x: torch.Tensor, group: Group, *, tracer: Tracer | None = None, site: str = "") -> torch.Tensor:
    """f: identity forward, all-reduce (sum) of the gradient backward."""
    return x if dist.get_world_size(group) == 1 else _CopyToTP.apply(x, group, tracer, site)


def reduce_from_tp(x: torch.Tensor, group: Group, *, tracer: Tracer | None = None,
                   site: str = "") -> torch.Tensor:
    """g: all-reduce (sum) forward, identity backward."""
    return x if dist.get_world_size(group) == 1 else _ReduceFromTP.apply(x, group, tracer, site)


def gather_from_tp(x: torch.Tensor, group: Group, *, dim: int = -1, tracer: Tracer | None = None,
                   site: str = "") -> torch.Tensor:
    """[x_0 ... x_{p-1}] along ``dim`` forward; backward keeps this rank's slice of the gradient (which every rank
    holds whole: what follows is replicated, or ends in an f that all-reduces)."""
    return x if dist.get_world_size(group) == 1 else _GatherFromTP.apply(x, dim, group, tracer, site)


def split_to_tp(x: torch.Tensor, group: Group, *, dim: int = -1, tracer: Tracer | None = None,
                site: str = "") -> torch.Tensor:
    """This rank's slice of ``dim`` forward (of a tensor every rank holds whole); backward all-gathers the
    gradient."""
    return x if dist.get_world_size(group) == 1 else _SplitToTP.apply(x, dim, group, tracer, site)


def gather_sequence(x: torch.Tensor, group: Group, *, dim: int = 1, tracer: Tracer | None = None,
                    site: str = "") -> torch.Tensor:
    """(B, T/p, C) sequence shards -> (B, T, C) forward; backward reduce-scatters the gradient to the shards."""
    return x if dist.get_world_size(group) == 1 else _GatherSequence.apply(x, dim, group, tracer, site)


def reduce_scatter_sequence(x: torch.Tensor, group: Group, *, dim: int = 1, tracer: Tracer | None = None,
                            site: str = "") -> torch.Tensor:
    """(B, T, C) partial sums -> this rank's (B, T/p, C) shard of their sum; backward all-gathers."""
    return x if dist.get_world_size(group) == 1 else _ReduceScatterSequence.apply(x, dim, group, tracer, site)
