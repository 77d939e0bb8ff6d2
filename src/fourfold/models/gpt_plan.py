"""TinyGPT's tensor-parallel plan, beside the model: which matmuls split how, and the collectives that costs.

Builds on the layers of :mod:`fourfold.parallel.tensor.layers`: attention split by heads (fused q/k/v column-parallel,
output projection row-parallel), the MLP column -> row, the vocabulary-parallel embedding tied to the head, the
vocabulary-parallel loss, and Megatron-style sequence parallelism.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from fourfold.models.attention import causal_attention, position_ids
from fourfold.models.gpt import CausalSelfAttention, Embedding, GPTConfig, TinyGPT
from fourfold.observe.trace import Tracer
from fourfold.parallel.rng import SEQUENCE_SHARDED
from fourfold.parallel.tensor import (
    ColumnParallelLinear,
    Group,
    RowParallelLinear,
    Style,
    VocabParallelEmbedding,
    shard_layouts,
    tensor_parallel,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "TINYGPT_SHARDS",
    "TensorParallelGPT",
    "check_tinygpt_tp",
    "collective_theory",
    "collectives_per_step",
    "parallelize_tinygpt",
]


# --- TinyGPT ---------------------------------------------------------------------------------------------------


class _Embedding(nn.Module):
    """x[b, t] = E[idx[b, t]] + P[t] with E vocabulary-parallel and P replicated: (B, T) -> (B, T, C).

    With sequence parallelism E's partial lookups are reduce-scattered, and P is added for this rank's positions
    only: (B, T) -> (B, T/p, C).
    """

    def __init__(self, embed: Embedding, wte: VocabParallelEmbedding) -> None:
        super().__init__()
        self.seq_len, self.wte, self.wpe, self.drop = embed.seq_len, wte, embed.wpe, embed.drop
        self.rank, self.tp, self.sequence_parallel = wte.rank, wte.tp, wte.sequence_parallel

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2 or idx.size(1) > self.seq_len:
            raise ValueError(f"idx must have shape (B, T) with T <= seq_len={self.seq_len}, got shape "
                             f"{tuple(idx.shape)}. Crop it to its last {self.seq_len} tokens")
        T = idx.size(1)
        if self.sequence_parallel and T % self.tp:
            raise ValueError(f"sequence length must be divisible by tp with sequence parallelism, got T={T} and "
                             f"tp={self.tp}. Pass sequences of {T - T % self.tp or self.tp} tokens")
        n = T // self.tp if self.sequence_parallel else T
        first = self.rank * n if self.sequence_parallel else 0
        pos = position_ids(idx, first, n)  # (n,) or (B, n): this rank's positions
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, n, C)


class _Attention(nn.Module):
    """Causal self-attention over this rank's heads [i H/p, (i+1) H/p): qkv column-parallel, proj row-parallel.

    The fused weight W_qkv = [W_q; W_k; W_v] (3C, C) is split with parts=3, so rank i holds the rows of its
    heads in each of W_q, W_k and W_v; attention is per head, so it runs on the local heads with no
    communication. proj's input rows are the same heads: Y = sum_i heads_i A_i, one all-reduce.
    """

    def __init__(self, attn: CausalSelfAttention, group: Group, sequence_parallel: bool, tracer: Tracer | None,
                 site: str) -> None:
        super().__init__()
        kw: dict[str, Any] = {"sequence_parallel": sequence_parallel, "tracer": tracer}
        self.n_head = attn.n_head // dist.get_world_size(group)
        self.dropout = attn.dropout
        self.qkv = ColumnParallelLinear.from_linear(attn.qkv, group, parts=3, site=f"{site}.qkv", **kw)
        self.proj = RowParallelLinear.from_linear(attn.proj, group, site=f"{site}.proj", **kw)
        self.resid_drop = attn.resid_drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, 3C/p), T the full sequence also with sequence parallelism
        B, T, c = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        q, k, v = (t.view(B, T, self.n_head, c // self.n_head).transpose(1, 2) for t in qkv.split(c, dim=2))
        p = self.dropout if self.training else 0.0
        y = causal_attention(q, k, v, p)  # (B, H/p, T, D)
        y = y.transpose(1, 2).reshape(B, T, c)  # (B, T, C/p)
        return self.resid_drop(self.proj(y))  # (B, T, C), or (B, T/p, C) with sequence parallelism


TINYGPT_SHARDS = {"embed.wte": "vocab", "head.lm_head": "column", "blocks.*.attn.qkv": "column:3",
                  "blocks.*.attn.proj": "row", "blocks.*.mlp.fc": "column", "blocks.*.mlp.proj": "row"}
"""What :func:`parallelize_tinygpt` splits, as a ``{module: style}`` plan (memory estimates read it; a test checks
it against the sharded model)."""


class TensorParallelGPT(nn.Module):
    """One rank's share of a TinyGPT: ``forward(idx, targets)`` -> (this rank's logits (B, T, V/p), the loss).

    Parameter names are TinyGPT's, so :func:`gather_state_dict` gives a state dict TinyGPT loads.
    """

    def __init__(self, model: TinyGPT, group: Group, *, sequence_parallel: bool, tracer: Tracer | None) -> None:
        super().__init__()
        self.config, self.group, self.tracer = model.config, group, tracer
        self.sequence_parallel = sequence_parallel
        plan: dict[str, Style] = {"embed.wte": "vocab", "head.lm_head": "column"}
        for i in range(model.config.n_layer):
            plan.update({f"blocks.{i}.mlp.fc": "column", f"blocks.{i}.mlp.proj": "row"})
        tensor_parallel(model, plan, group, tracer=tracer, sequence_parallel=sequence_parallel)
        for i, block in enumerate(model.blocks):
            attn = block.get_submodule("attn")
            assert isinstance(attn, CausalSelfAttention)
            block.add_module("attn", _Attention(attn, group, sequence_parallel, tracer, f"blocks.{i}.attn"))
        wte = model.embed.wte
        assert isinstance(wte, VocabParallelEmbedding)  # the plan's "vocab"
        self.embed: nn.Module = _Embedding(model.embed, wte)
        self.blocks: nn.ModuleList = model.blocks
        self.head: nn.Module = model.head
        # Parameters whose gradient on one rank is a partial sum, for sync_replicated_grads: with sequence
        # parallelism every replicated parameter (wpe, the layer norms, the row-parallel biases) sees only this
        # rank's T/p positions; without it every replicated parameter sees them all.
        layouts = shard_layouts(self)
        self.partial_grad_names: tuple[str, ...] = tuple(
            n for n, _ in self.named_parameters() if sequence_parallel and layouts[n].dim is None)
        if sequence_parallel:  # this rank's positions from the embedding on: dropout draws per tp rank
            setattr(self, SEQUENCE_SHARDED, (self.embed, *self.blocks))

    def layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor,
                reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor:
        """The cross-entropy of this rank's vocabulary shard of the logits (never gathered)."""
        return vocab_parallel_cross_entropy(logits, targets, self.group, tracer=self.tracer, reduction=reduction)

    def example_inputs(self) -> list[torch.Tensor]:
        """Two inputs differing in batch and length (a multiple of tp with sequence parallelism), for the
        pipeline split to learn which dims of a stage's input may vary."""
        T, step = self.config.seq_len, (dist.get_world_size(self.group) if self.sequence_parallel else 1)
        device = next(self.parameters()).device
        shorter = T - step if T > step else T
        return [torch.zeros(1, T, dtype=torch.long, device=device),
                torch.zeros(2, shorter, dtype=torch.long, device=device)]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(idx)  # (B, T, C), or (B, T/p, C) with sequence parallelism
        for block in self.blocks:
            x = block(x)  # same shape: layer norms and residual adds run on what this rank holds
        logits = self.head(x)  # (B, T, V/p)
        if targets is None:
            return logits
        return logits, vocab_parallel_cross_entropy(logits, targets, self.group, tracer=self.tracer)


def parallelize_tinygpt(model: TinyGPT, group: Group, *, sequence_parallel: bool = False,
                        tracer: Tracer | None = None) -> TensorParallelGPT:
    """Shard ``model`` over ``group`` (Megatron's layout): heads, MLP columns and the vocabulary split p ways.

    ``model`` is taken apart (its modules are replaced in place and reused): build one TinyGPT per rank from
    the same seed, shard it, and use only the returned model. A tied head shares the embedding's shard.
    """
    if not isinstance(model, TinyGPT):
        raise TypeError(f"model must be a TinyGPT, got {type(model).__name__}. Use tensor_parallel(model, plan, "
                        "group) for other models")
    check_tinygpt_tp(model.config, dist.get_world_size(group), sequence_parallel=sequence_parallel)
    return TensorParallelGPT(model, group, sequence_parallel=sequence_parallel, tracer=tracer)


def check_tinygpt_tp(config: GPTConfig, tp: int, *, sequence_parallel: bool = False, within: int | None = None) -> None:
    """Refuse a TinyGPT shape that ``tp`` ranks cannot split (ValueError naming the values and the fix).

    Pure: call it before any process starts. Heads, the MLP's 4C columns and the vocabulary are split p ways;
    with sequence parallelism the context length too. ``within``: the ranks a tp group is cut from (world / pp),
    so the other tp sizes suggested are ones the launch can make.
    """
    sizes = {"n_head": config.n_head, "4*d_model": 4 * config.d_model, "vocab_size": config.vocab_size}
    if sequence_parallel:
        sizes["seq_len"] = config.seq_len
    for what, n in sizes.items():
        if n % tp:
            tps = [t for t in range(2, tp + 1) if all(m % t == 0 for m in sizes.values())
                   and (within is None or within % t == 0)]
            other = f"--tp {' or --tp '.join(map(str, tps))}" if tps else "--tp 1 (no tensor parallelism)"
            raise ValueError(f"{what} must be divisible by tp, got {what}={n} and tp={tp}. Pass {other}, or "
                             f"{_shape_fix(config, tp, sequence_parallel)}.")


def _shape_fix(config: GPTConfig, tp: int, sequence_parallel: bool) -> str:
    """The flags that make every size ``tp`` splits divisible by it while the model's own rule still holds
    (d_model a multiple of n_head): the nearest larger shape."""
    def up(n: int, k: int) -> int:
        return -(-n // k) * k

    c = config
    if c.n_head % tp:  # whole heads per rank, d_model still split into them
        heads = next((h for h in range(up(c.n_head, tp), c.d_model + 1, tp) if c.d_model % h == 0), None)
        c = replace(c, n_head=heads) if heads else replace(c, n_head=up(c.n_head, tp), d_model=up(
            c.d_model, up(c.n_head, tp)))
    if 4 * c.d_model % tp:  # the MLP's 4C columns, and C still a multiple of n_head
        step = tp // math.gcd(4, tp)
        c = replace(c, d_model=up(c.d_model, step * c.n_head // math.gcd(step, c.n_head)))
    if c.vocab_size % tp:
        c = replace(c, vocab_size=up(c.vocab_size, tp))  # padded: ids past the data's are never targets
    if sequence_parallel and c.seq_len % tp:
        c = replace(c, seq_len=up(c.seq_len, tp))
    return " ".join(f"--{f.replace('_', '-')} {getattr(c, f)}" for f in ("n_head", "d_model", "vocab_size", "seq_len")
                    if getattr(c, f) != getattr(config, f))


def collective_theory(sequence_parallel: bool) -> dict[str, dict[tuple[str, str], int]]:
    """The collectives one TinyGPT step issues per part, ``{part: {(phase, op): count}}``; "block" is each block.

    Without sequence parallelism a block is two halves, each f (backward all-reduce) then g (forward all-reduce).
    With it, each all-reduce is cut into its halves: reduce-scatter after the row layer, all-gather before the
    column layer, in forward and (transposed) in backward. The loss adds two forward all-reduces.
    """
    ar, ag, rs = "all_reduce", "all_gather", "reduce_scatter"
    if not sequence_parallel:
        return {"embed": {("forward", ar): 1},
                "block": {("forward", ar): 2, ("backward", ar): 2},
                "head": {("backward", ar): 1},
                "loss": {("forward", ar): 2}}
    return {"embed": {("forward", rs): 1, ("backward", ag): 1},
            "block": {("forward", ag): 2, ("forward", rs): 2, ("backward", rs): 2, ("backward", ag): 2},
            "head": {("forward", ag): 1, ("backward", rs): 1},
            "loss": {("forward", ar): 2},
            "grad_sync": {("grad_sync", ar): 1}}


def collectives_per_step(n_layer: int, sequence_parallel: bool) -> dict[tuple[str, str], int]:
    """``{(phase, op): count}`` for a whole TinyGPT step of ``n_layer`` blocks: :func:`collective_theory` summed.

    Without sequence parallelism: 2L + 3 all-reduces forward and 2L + 1 backward.
    """
    total: dict[tuple[str, str], int] = {}
    for part, counts in collective_theory(sequence_parallel).items():
        for key, n in counts.items():
            total[key] = total.get(key, 0) + n * (n_layer if part == "block" else 1)
    return total
