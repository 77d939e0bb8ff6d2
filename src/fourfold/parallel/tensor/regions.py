"""A plan-sharded model's tensor-parallel regions, entered once each, and Megatron's sequence parallelism
(Korthikanti et al. 2022) around them: for a stack of blocks (a Hugging Face family's decoder layers) whose
column -> row pairs (attention, the MLP) are modules of their own. TinyGPT's plan does the same in its own
modules (:mod:`fourfold.models.gpt_plan`).

    tensor_parallel(model, plan, group)                          # heads and MLP columns split p ways
    shard_regions(model, group, blocks="model.layers", norm="model.norm", sequence_parallel=sp)

A *region* is a module holding a block's column layers (``self_attn``, ``mlp``). Its input enters it once: one f
(identity forward, all-reduce backward) for q, k and v together, where each column layer would otherwise all-reduce
its own input gradient (three all-reduces in a Llama attention's backward, two in its MLP's: one each). With
``sequence_parallel`` each rank holds only its sequence shard (B, T/p, C) between the regions, positions
[r T/p, (r+1) T/p): the residual stream, the blocks' norms and the final norm run on 1/p of the tokens, and what
the blocks keep for backward shrinks with them. What the model computes before its blocks (the embedding, rotary
tables and masks over the whole sequence) is unchanged::

    embedding (B,T,C) -> block 0's input: keep this rank's shard (backward: all-gather)        split_to_tp
      block:  norm (B,T/p,C) -> attention's input: all-gather (backward: reduce-scatter)      gather_sequence
              q | k | v on H/p heads (no f: the entry sums dL/dX) -> o_proj: reduce-scatter -> + residual
              norm -> MLP's input: all-gather -> gate | up -> down: reduce-scatter -> + residual
    final norm (B,T/p,C) -> head's input: all-gather (backward: reduce-scatter) -> head     gather_sequence
    (no head given: the norm's output all-gathered, backward keep own slice; GPT-2)          gather_from_tp

Each block's all-reduce is cut into its two halves, so the bytes are plain tensor parallelism's. A replicated
parameter that sees only this rank's tokens (the blocks' norms, the row layers' biases, the final norm) gets a
partial gradient, summed over tp after backward (``model.partial_grad_names``). The sequence length must divide
by p.

A region's entry sums the gradient of everything inside that reads its input, so every such reader must be a
column layer (as in Megatron): a replicated module reading it there would have its gradient counted p times.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fourfold.observe.trace import Tracer
from fourfold.parallel.rng import SEQUENCE_SHARDED
from fourfold.parallel.tensor.comm import Group, copy_to_tp, gather_from_tp, gather_sequence, split_to_tp
from fourfold.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from fourfold.parallel.tensor.plan import shard_layouts

__all__ = ["SEQUENCE_SHARDS", "full_length", "holders", "shard_regions"]

SEQUENCE_SHARDS = "fourfold_sequence_shards"
"""The attribute on each block after the first under sequence parallelism: into how many shards its input's
sequence is cut."""


def full_length(block: nn.Module, hidden: torch.Tensor) -> int:
    """The whole sequence's length, given ``block``'s input ``hidden`` (B, T or T/p, C): what a pipeline's piece
    computes positions, rotary tables and masks over."""
    return hidden.size(1) * getattr(block, SEQUENCE_SHARDS, 1)


def shard_regions(model: nn.Module, group: Group, *, blocks: str, norm: str, head: str | None = None,
                  sequence_parallel: bool = False, tracer: Tracer | None = None) -> nn.Module:
    """Enter each of ``model``'s tensor-parallel regions once, in place, after
    :func:`~fourfold.parallel.tensor.tensor_parallel` has sharded its blocks' matmuls: ``blocks`` names its
    ``nn.ModuleList`` of blocks, ``norm`` the module between the last block and the head, ``head`` the
    column-parallel head when it reads ``norm``'s output position by position (under sequence parallelism it
    then gathers the sequence itself, its backward a reduce-scatter; None: ``norm``'s output is gathered). Without
    ``sequence_parallel`` a model whose blocks hold no regions (linear layers directly in a block) is left as it
    is, each column layer with its own f; with it, such a model is refused. Returns ``model``."""
    layers = model.get_submodule(blocks)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        if not sequence_parallel:
            return model
        raise ValueError(f"sequence parallelism runs around a model's blocks, got {blocks!r}: "
                         f"{type(layers).__name__}. Name the nn.ModuleList of its blocks")
    try:
        found = [_regions(layer, f"{blocks}.{i}") for i, layer in enumerate(layers)]
    except ValueError:
        if not sequence_parallel:
            return model
        raise
    empty = [f"{blocks}.{i}" for i, regions in enumerate(found) if not regions]
    if sequence_parallel and empty:  # its attention would run on this rank's tokens only
        raise ValueError(f"sequence parallelism gathers the sequence for each block's tensor-parallel modules, got "
                         f"{', '.join(empty[:4])} with no column layer. Shard each block's attention and MLP "
                         "(the family's own plan does), or drop sequence_parallel")
    enter = gather_sequence if sequence_parallel else copy_to_tp
    for i, regions in enumerate(found):
        for name, region in regions.items():
            entry = functools.partial(enter, group=group, tracer=tracer, site=f"{blocks}.{i}.{name}")
            region.register_forward_pre_hook(_on_hidden(entry), with_kwargs=True)
            for module in region.modules():
                if isinstance(module, ColumnParallelLinear):
                    module.region_input = True
                elif isinstance(module, RowParallelLinear):
                    module.sequence_parallel = sequence_parallel
    if sequence_parallel:
        _shard_sequence(model, group, layers, found, blocks, norm, head, tracer)
    return model


def _shard_sequence(model: nn.Module, group: Group, layers: nn.ModuleList, found: list[dict[str, nn.Module]],
                    blocks: str, norm: str, head: str | None, tracer: Tracer | None) -> None:
    """The sequence split at the first block and gathered after ``norm`` (or by ``head``), and the partial
    gradients listed."""
    layouts = shard_layouts(model)
    partial: list[str] = []
    for i, (layer, regions) in enumerate(zip(layers, found, strict=True)):
        prefix = f"{blocks}.{i}"
        for name, module in layer.named_modules():
            if isinstance(module, RowParallelLinear) and module.bias is not None:
                partial.append(f"{prefix}.{name}.bias")  # added after the reduce-scatter: this rank's tokens only
        partial += [f"{prefix}.{n}" for n, q in layer.named_parameters() if q.requires_grad
                    and not any(n.startswith(f"{r}.") for r in regions) and layouts[f"{prefix}.{n}"].dim is None]
        if i:
            setattr(layer, SEQUENCE_SHARDS, dist.get_world_size(group))
    scatter = functools.partial(_scatter, group=group, tracer=tracer, site=blocks)
    layers[0].register_forward_pre_hook(_on_hidden(scatter), with_kwargs=True)
    last = model.get_submodule(norm)
    reader = model.get_submodule(head) if head is not None else None
    if isinstance(reader, ColumnParallelLinear):  # gathers its input: backward a reduce-scatter, not an all-reduce
        reader.sequence_parallel = True
    else:
        last.register_forward_hook(functools.partial(_gather_output, group, tracer, norm))
    partial += [f"{norm}.{n}" for n, q in last.named_parameters() if q.requires_grad]
    setattr(model, SEQUENCE_SHARDED, tuple(layers))  # their dropout draws per tp rank: fourfold.parallel.rng
    known = tuple(getattr(model, "partial_grad_names", ()))
    setattr(model, "partial_grad_names", (*known, *(n for n in partial if n not in known)))  # noqa: B010


def holders(block: nn.Module, is_column: Callable[[nn.Module], bool]) -> tuple[dict[str, nn.Module], str | None]:
    """The block's tensor-parallel regions by name, the modules directly holding its column layers (those
    ``is_column`` says), and the first column layer that is the block's own child (None: none is), which leaves
    the block no region to tell apart from its residual stream. Shared with the memory estimate, which reads an
    unsharded model by its plan."""
    regions: dict[str, nn.Module] = {}
    for name, module in block.named_modules():
        if is_column(module):
            parent = name.rpartition(".")[0]
            if not parent:
                return regions, name
            regions.setdefault(parent, block.get_submodule(parent))
    return regions, None


def _regions(layer: nn.Module, prefix: str) -> dict[str, nn.Module]:
    """:func:`holders` of a sharded block, refused (ValueError) where a column layer is directly in it or a row
    layer outside every region."""
    regions, direct = holders(layer, lambda m: isinstance(m, ColumnParallelLinear))
    if direct is not None:
        raise ValueError(f"sequence parallelism gathers the input of the module holding a block's column layers, got "
                         f"{prefix}.{direct} directly in the block {prefix}. Put the attention and the MLP in modules "
                         "of their own, or drop sequence_parallel")
    for name, module in layer.named_modules():
        if isinstance(module, RowParallelLinear) and name.rpartition(".")[0] not in regions:
            raise ValueError(f"sequence parallelism reduce-scatters a row layer's output inside the module that "
                             f"gathers its input, got {prefix}.{name} with no column layer beside it. Shard the "
                             "layer feeding it 'column', or drop sequence_parallel")
    return regions


def _scatter(hidden: torch.Tensor, group: Group, tracer: Tracer | None, site: str) -> torch.Tensor:
    p = dist.get_world_size(group)
    if hidden.dim() < 2 or hidden.size(1) % p:
        raise ValueError(f"sequence parallelism cuts the sequence into tp={p} shards, got hidden states of shape "
                         f"{tuple(hidden.shape)} (T={hidden.size(1) if hidden.dim() > 1 else '?'}). Pass sequences "
                         f"whose length is a multiple of {p} (fourfold train: --seq-len), or drop sequence parallelism "
                         "(sequence_parallel=False; --sequence-parallel)")
    return split_to_tp(hidden, group, dim=1, tracer=tracer, site=site)


def _gather_output(group: Group, tracer: Tracer | None, site: str, module: nn.Module, args: Any,
                   out: torch.Tensor) -> torch.Tensor:
    return gather_from_tp(out, group, dim=1, tracer=tracer, site=site)


def _on_hidden(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    """A forward pre-hook applying ``fn`` to a module's hidden states: its first argument, or ``hidden_states=``."""
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
        raise ValueError(f"tensor parallelism reads a {type(module).__name__}'s hidden states from its first "
                         f"argument or hidden_states=, got keywords {sorted(kwargs)}.")
    return hook
