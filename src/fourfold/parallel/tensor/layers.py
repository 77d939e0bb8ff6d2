"""Tensor-parallel layers: every big matmul's weight split over the p ranks of a ``group`` (Megatron-LM,
Shoeybi et al. 2019), with the same numbers as one process. Notation: a linear layer is Y = XA + b with
A = W^T, the (in, out) matrix (``nn.Linear`` stores W, (out, in)).

* :class:`ColumnParallelLinear`: A = [A_1 ... A_p] split by output columns; rank i computes Y_i = X A_i + b_i.
* :class:`RowParallelLinear`: A = [A_1; ...; A_p] split by input rows, X = [X_1 ... X_p]; Y = sum_i X_i A_i + b.
* :class:`VocabParallelEmbedding`: the table's rows (the vocabulary) split; ids outside a rank's rows give zeros.

A column layer feeding a row layer (elementwise work such as GELU between) needs one all-reduce forward (g,
after the row layer) and one backward (f, before the column layer): that is one transformer block half. The
collectives live in :mod:`~fourfold.parallel.tensor.comm`, the loss over sharded logits in
:mod:`~fourfold.parallel.tensor.loss`, sharding a whole model by a plan in :mod:`~fourfold.parallel.tensor.plan`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fourfold.observe.trace import Tracer
from fourfold.parallel.tensor.comm import (
    Group,
    copy_to_tp,
    gather_from_tp,
    gather_sequence,
    reduce_from_tp,
    reduce_scatter_sequence,
    split_to_tp,
)

__all__ = [
    "REPLICATED",
    "ColumnParallelLinear",
    "ShardLayout",
    "RowParallelLinear",
    "Sharded",
    "Style",
    "VocabParallelEmbedding",
    "blocks",
    "fused",
    "is_conv1d",
    "proportions",
    "shard",
    "unshard",
]

Style = Literal["column", "row", "vocab", "head"]  # or "column:<parts>" for a fused weight ("column:32,8,8")


class ShardLayout(NamedTuple):
    """How a full tensor is cut: along ``dim`` (None: replicated), each of its ``parts`` blocks split p ways.

    ``parts`` > 1 is a fused weight such as [W_q; W_k; W_v] (parts=3): rank i holds [W_q,i; W_k,i; W_v,i]. Blocks
    of unequal sizes are given by their proportions, lowest terms: ``(2, 1, 1)`` for the fused q|k|v of
    grouped-query attention with twice as many query heads as key/value heads (Phi-3's ``qkv_proj``).
    """

    dim: int | None
    parts: int | tuple[int, ...] = 1


REPLICATED = ShardLayout(None)


def proportions(parts: int | tuple[int, ...]) -> tuple[int, ...]:
    """The blocks' relative sizes: ``parts`` equal ones, or the proportions given."""
    return (1,) * parts if isinstance(parts, int) else tuple(parts)


def fused(parts: int | Sequence[int]) -> int | tuple[int, ...]:
    """``parts`` as a :class:`ShardLayout` holds it: a count of equal blocks, or their proportions in lowest terms
    (``(32, 8, 8)`` -> ``(4, 1, 1)``, ``(8, 8)`` -> ``2``), so that two cuts alike compare equal."""
    if isinstance(parts, int):
        return parts
    shares = [int(s) for s in parts]
    if not shares or min(shares) < 1:
        raise ValueError(f"parts must be a count or block widths >= 1, got {list(parts)}.")
    common = math.gcd(*shares)
    return len(shares) if len(set(shares)) == 1 else tuple(s // common for s in shares)


def blocks(t: torch.Tensor, layout: ShardLayout) -> tuple[torch.Tensor, ...]:
    """``t`` (a full tensor, or one rank's piece of it) as its fused blocks along ``layout.dim`` (views)."""
    assert layout.dim is not None
    shares = proportions(layout.parts)
    unit = t.shape[layout.dim] // sum(shares)
    return t.split([s * unit for s in shares], layout.dim)


def shard(full: torch.Tensor, layout: ShardLayout, rank: int, p: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` under ``layout`` (a copy)."""
    if layout.dim is None:
        return full.detach().clone()
    dim = layout.dim
    return torch.cat([b.narrow(dim, rank * (b.shape[dim] // p), b.shape[dim] // p)
                      for b in blocks(full.detach(), layout)], dim)


def unshard(pieces: list[torch.Tensor], layout: ShardLayout) -> torch.Tensor:
    """The full tensor from every rank's piece, in rank order: the inverse of :func:`shard`."""
    if layout.dim is None:
        return pieces[0].clone()
    per_rank = [blocks(piece, layout) for piece in pieces]
    return torch.cat([b[j] for j in range(len(per_rank[0])) for b in per_rank], layout.dim)


def _tp(group: Group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _divisible(what: str, n: int, p: int, parts: int | tuple[int, ...] = 1) -> None:
    shares = proportions(parts)
    m = p * sum(shares)  # fused: each block (its share of n) is split p ways
    if n % m:
        times = "" if m == p else f"*{sum(shares)}" + ("" if len(set(shares)) == 1 else
                                                       f" (blocks in proportions {':'.join(map(str, shares))})")
        raise ValueError(f"{what} must be divisible by tp{times}, got {n} and {p}. "
                         f"Use {what}={-(-n // m) * m} or a tp that divides {n // sum(shares)}")


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A = [A_1 ... A_p] split by output columns: rank i holds A_i, b_i; Y_i = X A_i + b_i.

    Rank i's weight is rows [i out/p, (i+1) out/p) of W. The input X (B, T, in) is replicated, passed through f
    (dL/dX = sum_i dL/dY_i A_i^T is all-reduced in backward); the output is Y_i (B, T, out/p), or with
    ``gather_output`` [Y_1 ... Y_p] (B, T, out). ``sequence_parallel``: X arrives as this rank's sequence shard
    (B, T/p, in) and is all-gathered first (dL/dX reduce-scattered back); ``region_input``: X arrives through its
    module's entry (:func:`~fourfold.parallel.tensor.regions.shard_regions`: one f, or one all-gather, for q, k and
    v), which sums dL/dX over the ranks itself, so no f here. ``parts`` > 1: A is ``parts`` blocks
    side by side (fused q, k, v: parts=3; of unequal widths: their proportions, as ``(2, 1, 1)``), each split p
    ways, so Y_i = [X A^(1)_i ... X A^(parts)_i].
    ``transposed``: the weight is stored as A itself, (in, out/p), as GPT-2's ``Conv1D`` keeps it, so the
    state dict keeps the model's shapes. ``head``: this layer's output is the logits; it is gathered
    (``gather_output``) unless the engine applies the vocabulary-parallel loss to the split logits.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, *, bias: bool = True,
                 parts: int | tuple[int, ...] = 1,
                 gather_output: bool = False, sequence_parallel: bool = False, region_input: bool = False,
                 tracer: Tracer | None = None, site: str = "", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, transposed: bool = False, head: bool = False) -> None:
        super().__init__()
        self.rank, self.tp = _tp(group)
        parts = fused(parts)
        _divisible("out_features", out_features, self.tp, parts)
        if gather_output and len(proportions(parts)) > 1:
            raise ValueError(f"gather_output needs parts=1, got parts={parts}: the gathered blocks would be "
                             "interleaved by rank. Split the output into its parts first, then gather each")
        self.in_features, self.out_features, self.parts = in_features, out_features, parts
        self.group, self.tracer, self.site = group, tracer, site
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.region_input, self.transposed, self.head = region_input, transposed, head
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        shape = (in_features, out_features // self.tp) if transposed else (out_features // self.tp, in_features)
        self.weight = nn.Parameter(torch.empty(shape, **kw))  # (out/p, in), or (in, out/p) transposed
        self.bias = nn.Parameter(torch.empty(out_features // self.tp, **kw)) if bias else None
        bound = 1 / math.sqrt(in_features)  # nn.Linear's init for the full layer; use from_linear to match one
        for t in (self.weight, self.bias):
            if t is not None:
                nn.init.uniform_(t, -bound, bound)

    def layouts(self) -> dict[str, ShardLayout]:
        return {"weight": ShardLayout(1 if self.transposed else 0, self.parts), "bias": ShardLayout(0, self.parts)}

    @classmethod
    def from_linear(cls, linear: nn.Module, group: Group, **kw: Any) -> ColumnParallelLinear:
        """This rank's columns of ``linear`` (an ``nn.Linear``, or a GPT-2 ``Conv1D``): the same function."""
        return _from_linear(cls, linear, group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kw: dict[str, Any] = {"tracer": self.tracer, "site": self.site}
        if self.sequence_parallel:
            x = gather_sequence(x, self.group, **kw)
        elif not self.region_input:
            x = copy_to_tp(x, self.group, **kw)
        y = _linear(x, self.weight, self.bias, self.transposed)  # (B, T, out/p)
        return gather_from_tp(y, self.group, **kw) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (/{self.tp}), "
                f"parts={self.parts}, sequence_parallel={self.sequence_parallel}"
                + (", region_input" if self.region_input else "") + (", transposed" if self.transposed else "") + (", head" if self.head else ""))


class RowParallelLinear(nn.Module):
    """Y = XA + b with A = [A_1; ...; A_p] split by input rows and X = [X_1 ... X_p]: Y = sum_i X_i A_i + b.

    Rank i's weight is columns [i in/p, (i+1) in/p) of W; its input X_i (B, T, in/p) is a column layer's output
    (``input_is_parallel``, the default) or cut here from a replicated X. The partial products X_i A_i are
    all-reduced (g), or with ``sequence_parallel`` reduce-scattered to this rank's (B, T/p, out) sequence shard;
    the bias, replicated, is added once, after the reduction. ``transposed``: the weight is stored as A,
    (in/p, out), as GPT-2's ``Conv1D`` keeps it.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, tracer: Tracer | None = None,
                 site: str = "", device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 transposed: bool = False) -> None:
        super().__init__()
        self.rank, self.tp = _tp(group)
        _divisible("in_features", in_features, self.tp)
        self.in_features, self.out_features = in_features, out_features
        self.group, self.tracer, self.site = group, tracer, site
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.transposed = transposed
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        shape = (in_features // self.tp, out_features) if transposed else (out_features, in_features // self.tp)
        self.weight = nn.Parameter(torch.empty(shape, **kw))  # (out, in/p), or (in/p, out) transposed
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        bound = 1 / math.sqrt(in_features)
        for t in (self.weight, self.bias):
            if t is not None:
                nn.init.uniform_(t, -bound, bound)

    def layouts(self) -> dict[str, ShardLayout]:
        return {"weight": ShardLayout(0 if self.transposed else 1), "bias": REPLICATED}

    @classmethod
    def from_linear(cls, linear: nn.Module, group: Group, **kw: Any) -> RowParallelLinear:
        """This rank's rows of A (columns of ``linear.weight``; rows of a ``Conv1D``'s); the bias whole."""
        return _from_linear(cls, linear, group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kw: dict[str, Any] = {"tracer": self.tracer, "site": self.site}
        if not self.input_is_parallel:
            x = split_to_tp(x, self.group, **kw)  # (B, T, in/p)
        y = _linear(x, self.weight, None, self.transposed)  # (B, T, out): this rank's partial sum X_i A_i
        y = reduce_scatter_sequence(y, self.group, **kw) if self.sequence_parallel else reduce_from_tp(
            y, self.group, **kw)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (/{self.tp}), out_features={self.out_features}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """E[idx] with the table E (V, C) split by rows: rank i holds E_i = rows [i V/p, (i+1) V/p).

    Rank i looks up the ids in its rows and writes zeros for the others, so the sum over ranks is the lookup:
    E[idx] = sum_i 1[idx in rows_i] E_i[idx - i V/p]. The sum is an all-reduce (output (B, T, C), replicated)
    or, with ``sequence_parallel``, a reduce-scatter to this rank's (B, T/p, C) sequence shard.
    ``padding_idx`` acts as in ``nn.Embedding`` (its row gets no gradient) on the rank holding that row.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group, *, sequence_parallel: bool = False,
                 tracer: Tracer | None = None, site: str = "", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, padding_idx: int | None = None) -> None:
        super().__init__()
        self.rank, self.tp = _tp(group)
        if num_embeddings % self.tp:
            raise ValueError(f"vocab_size must be divisible by tp, got {num_embeddings} and {self.tp}. Pad the "
                             f"vocabulary to {-(-num_embeddings // self.tp) * self.tp}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.tracer, self.site, self.sequence_parallel = group, tracer, site, sequence_parallel
        self.start = self.rank * num_embeddings // self.tp  # this rank's rows: [start, start + V/p)
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.padding_idx = padding_idx
        rows = range(self.start, self.start + num_embeddings // self.tp)
        self._local_padding = padding_idx - self.start if padding_idx is not None and padding_idx in rows else None
        self.weight = nn.Parameter(torch.empty(num_embeddings // self.tp, embedding_dim, device=device,
                                               dtype=dtype))  # (V/p, C)
        nn.init.normal_(self.weight)

    def layouts(self) -> dict[str, ShardLayout]:
        return {"weight": ShardLayout(0)}

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: Group, **kw: Any) -> VocabParallelEmbedding:
        """This rank's rows of ``embedding``'s table."""
        extras = {"max_norm": embedding.max_norm, "scale_grad_by_freq": embedding.scale_grad_by_freq or None,
                  "sparse": embedding.sparse or None}
        extras = {k: v for k, v in extras.items() if v is not None}
        if extras:  # each would act on the masked local ids (every other rank's token counts as id 0)
            raise ValueError(f"VocabParallelEmbedding supports nn.Embedding with padding_idx at most, got "
                             f"{extras}. Build the embedding without {', '.join(extras)}")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, device=embedding.weight.device,
                    dtype=embedding.weight.dtype, padding_idx=embedding.padding_idx, **kw)
        _copy_shards(layer, embedding)
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.numel():  # as nn.Embedding refuses: no rank holds such a row, and the lookup would be zeros
            low, high = torch.stack(torch.aminmax(idx)).tolist()  # on every rank, silently (one host sync)
            if low < 0 or high >= self.num_embeddings:
                raise ValueError(f"the embedding's ids must be in [0, {self.num_embeddings}), got ids in [{low}, "
                                 f"{high}]. Check the tokenizer's vocabulary size against the model's (vocab_size)")
        outside = (idx < self.start) | (idx >= self.start + self.weight.shape[0])  # (B, T)
        local = F.embedding((idx - self.start).masked_fill(outside, 0), self.weight,  # (B, T, C)
                            padding_idx=self._local_padding)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)  # rows another rank holds
        kw: dict[str, Any] = {"tracer": self.tracer, "site": self.site}
        if self.sequence_parallel:
            return reduce_scatter_sequence(local, self.group, **kw)  # (B, T/p, C)
        return reduce_from_tp(local, self.group, **kw)  # (B, T, C)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (/{self.tp}), {self.embedding_dim}, "
                f"sequence_parallel={self.sequence_parallel}"
                + ("" if self.padding_idx is None else f", padding_idx={self.padding_idx}"))


class Sharded(Protocol):
    """A module holding this rank's pieces of whole tensors, cut as its :meth:`layouts` say (these layers,
    :class:`~fourfold.parallel.tensor.norm.ShardedRMSNorm`; the tuple of them: ``plan.SHARDED``)."""

    rank: int
    tp: int
    weight: nn.Parameter

    def layouts(self) -> dict[str, ShardLayout]: ...


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    if transposed:  # weight is A (in, out): Conv1D's x A + b
        y = x @ weight
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's ``Conv1D`` (transformers): a linear layer storing A = W^T, (in, out); known by shape, not import."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and getattr(module, "nf", None) == weight.shape[1])


def computes_linear(module: nn.Module) -> bool:
    """``nn.Linear``, or a subclass whose forward computes what nn.Linear's does (Falcon's ``FalconLinear``,
    torchtitan's projections), so a column or row split keeps its function: a subclass that overrides forward
    is run once on a random input (its own generator: the run's random stream is untouched) against
    ``F.linear``. On the meta device (the preflight) only its type is known: the ranks check it with values."""
    if type(module) is nn.Linear or (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward):
        return True
    if not isinstance(module, nn.Linear):
        return False
    weight, bias = module.weight, module.bias
    if weight.is_meta:
        return True
    gen = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(3, module.in_features, generator=gen, device=weight.device).to(weight.dtype)
    with torch.no_grad():
        got, want = module(x), F.linear(x, weight, bias)
    tol = (1e-10, 1e-12) if weight.dtype == torch.float64 else (1e-4, 1e-5) if weight.dtype == torch.float32 else \
        (2e-2, 2e-2)
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, *tol)


@torch.no_grad()
def _from_linear(cls: type[ColumnParallelLinear | RowParallelLinear], linear: nn.Module, group: Group, **kw: Any) -> Any:
    """A column- or row-parallel layer shaped like ``linear``, holding this rank's slice of its weights."""
    weight = linear.weight
    assert isinstance(weight, torch.Tensor)
    transposed = is_conv1d(linear)
    fan_in, fan_out = weight.shape if transposed else weight.shape[::-1]
    layer = cls(fan_in, fan_out, group, bias=getattr(linear, "bias", None) is not None,  # type: ignore[call-arg]
                device=weight.device, dtype=weight.dtype, transposed=transposed, **kw)
    _copy_shards(layer, linear)
    return layer


@torch.no_grad()
def _copy_shards(layer: Sharded, full: nn.Module) -> None:
    for name, layout in layer.layouts().items():
        mine, theirs = getattr(layer, name), getattr(full, name, None)
        if mine is not None and theirs is not None:
            mine.copy_(shard(theirs, layout, layer.rank, layer.tp))
